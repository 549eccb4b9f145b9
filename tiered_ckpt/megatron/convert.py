"""Convert a Megatron-style checkpoint between the ``megatron`` and ``rank_sharded`` layouts, and re-split it
for another DP size: :func:`convert`, and ``tiered-ckpt convert`` (:mod:`.cli_convert`).

Sources: a checkpoint Megatron-LM wrote (no manifest: each of its files is checked against the CRC-32s of its
zip directory first, the report says so), or one of ours in either layout (every file verified against the
manifest while it is read). The destination gets our manifest
and Megatron's tracker, in the commit protocol's order, all through the destination's file store (its retries,
events and crash points): the files (``FileStore.write_file``/``copy_file``, checksummed while they are written),
then ``FileStore.commit_files``: every rank's manifest, the checkpoint manifest and the tracker.

What happens to each file:

* ``model_optim_rng.pt`` is copied as is: it does not depend on DP (Megatron's own rule).
* ``rank_sharded`` → ``megatron``: each DP group's rank files are merged into ``mp_rank_*/distrib_optim.pt``
  (docs/megatron-format.md, "Merging the DP shards into the file"), byte-identical to what Megatron writes.
* ``megatron`` → ``rank_sharded``, or any source at a new DP: every rank's shards are cut out of Megatron's world
  tensors (slice ``U_b``, zero-pad to the new ``N_b``, split in DP parts: docs/megatron-format.md, "Re-splitting for
  another DP size").
* same layout, same DP: a verified copy.

Memory stays at about one bucket (merge/split pieces) or 32 MiB (copies) plus fixed overhead, whatever the model
size: sources are read by range (:mod:`.lazy_torch`), destinations written as streams (:mod:`.torch_zip`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..config import load_config
from ..errors import (
    ConfigError,
    CorruptionError,
    DecodeError,
    LayoutMismatchError,
    NoCheckpointError,
    TierError,
    UnsafePickleError,
)
from ..file_store import FileStore
from ..manifest import FileEntry
from ..parallel import ParallelLayout
from ..pipeline import make_store
from ..plugins import get_plugin_manager
from ..tiers.base import Tier, first_missing_dir
from . import legacy, loadable, rank_shard, tier_io
from .merge import plan_dirs, write_megatron_file
from .naming import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME, RELEASE, MegatronTopology
from .source import StepSource, model_dirs

log = logging.getLogger(__name__)
TARGETS = ("megatron", "rank_sharded")
MODEL_ITEM, OPTIM_ITEM = "model_optim_rng", "distrib_optim"


@dataclass
class ConvertReport:
    src: str
    dst: str
    to: str
    step: int
    source_layout: str  # megatron | rank_sharded | dlrover
    source_writer: str  # megatron | tiered_ckpt | dlrover
    source_verified: bool  # every source file checked against a manifest
    # what the source was checked against: "manifest", "zip CRC-32s" (Megatron-LM's files: torch's own CRC-32 of
    # each record; a missing file would not be seen), or "" (nothing: verify=False, or files without CRC-32s)
    source_checked: str
    source_topology: dict[str, Any]
    topology: dict[str, Any]
    files: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _local_path(target: str | os.PathLike[str] | Tier) -> str | None:
    """The directory a target names on this machine (a path, or a ``file://`` URL); None for a Tier or another
    URL."""
    if isinstance(target, Tier):
        return None
    text = os.fspath(target)
    if "://" in text and not text.startswith("file://"):
        return None
    return os.path.abspath(os.path.expanduser(text.removeprefix("file://")))


def open_store(target: str | os.PathLike[str] | Tier, layout: str, name: str) -> FileStore:
    """A FileStore for a directory, a ``file://`` or other fsspec URL, or an existing tier."""
    pm = get_plugin_manager()
    if isinstance(target, Tier):
        from ..config import TierConfig

        codecs = {n: c() for n, c, _ in pm.registries.codecs.items()}
        return FileStore(target, TierConfig(name=target.name, kind=target.kind), pm.registries.layouts.get(layout)(),
                         codecs, lambda e: None)
    path = _local_path(target)
    raw = {"name": name, "kind": "fsspec", "url": os.fspath(target)} if path is None else \
        {"name": name, "kind": "local", "path": path}
    config = load_config({"layout": layout, "tiers": [raw]}, registries=pm.registries)
    files = make_store(pm, config, config.tiers[0], ParallelLayout().coords(0), 0, lambda e: None).files()
    assert files is not None, "a local or fsspec tier holds files"
    return files


def convert(
    src: str | os.PathLike[str] | Tier,
    dst: str | os.PathLike[str] | Tier,
    *,
    to: str,
    dp: int | None = None,
    step: int | None = None,
    progress: bool = True,
    trust_pickles: bool = False,
    verify: bool = True,
) -> ConvertReport:
    """Convert the checkpoint of ``step`` (default: the newest, per the tracker) at ``src`` into layout ``to``
    at ``dst``, for data-parallel size ``dp`` (Megatron's meaning: world / (TP x PP x CP); default: unchanged).

    ``src``/``dst``: a directory, a ``file://`` or fsspec URL (``s3://...``), or a Tier. ``dst`` must not hold
    this step yet. ``progress``: a tqdm bar on stderr when it is a terminal. A convert that fails leaves no
    directory it created behind.
    """
    path = _local_path(dst)
    made = None
    if path is not None:
        made = first_missing_dir(path)
        try:  # made here, wanted: the tier would take missing parents for a mount point that is not mounted
            os.makedirs(path, exist_ok=True)
        except OSError:
            pass  # the tier says what is wrong with the path
    try:
        return _convert(src, dst, to=to, dp=dp, step=step, progress=progress, trust_pickles=trust_pickles,
                        verify=verify)
    except BaseException:
        if made is not None:  # its empty directories only, deepest first: a file (another writer's) stops it
            for here, _, _ in sorted(os.walk(made), key=lambda w: -w[0].count(os.sep)):
                try:
                    os.rmdir(here)
                except OSError:
                    pass
        raise


def _convert(src: str | os.PathLike[str] | Tier, dst: str | os.PathLike[str] | Tier, *, to: str, dp: int | None,
             step: int | None, progress: bool, trust_pickles: bool, verify: bool) -> ConvertReport:
    if to not in TARGETS:
        raise ConfigError(f"to: expected one of {', '.join(TARGETS)}, got {to!r}")
    t0 = time.perf_counter()
    if not isinstance(src, Tier) and ("://" not in os.fspath(src) or os.fspath(src).startswith("file://")):
        if not os.path.isdir(os.fspath(src).removeprefix("file://")):
            raise NoCheckpointError(f"{os.fspath(src)}: no such directory")
    src_tier = open_store(src, "rank_sharded", "source").tier
    # The checks that need no writing run before the destination is opened (which creates it); a refusal met
    # while writing (a model file Megatron-LM would refuse) removes what was written, below.
    info = legacy.detect(src_tier, step=step, trust_pickles=trust_pickles)
    if info.iteration == RELEASE:
        raise ConfigError(f"{info.where}: a release checkpoint has no iteration number; our manifests need one "
                          "(Megatron itself loads it without optimizer state)")
    step_no = int(info.iteration)
    target = _target_topology(info.topology, dp)
    if info.layout == "dlrover":
        raise LayoutMismatchError(
            f"{info.where}: DLRover's rank_*/distrib_optim.pt hold per-param fragments without bucket geometry: "
            "they cannot be merged or re-split without the model (load them with tiered_ckpt.megatron.adapter at "
            "the same DP and save again)")
    store = open_store(dst, to, "destination")
    dst_tier = store.tier
    if dst_tier.list(info.step_dir + "/"):
        raise ConfigError(f"{tier_io.where(dst_tier, info.step_dir)} already exists; convert into an empty place")
    notes = list(info.notes)
    # The bars' total: a listing and a size per file (a HEAD each on S3), asked once, and only if a bar is drawn.
    estimate = functools.cache(lambda: _estimate(src_tier, info))
    checked = "manifest" if info.has_manifest and verify else ""
    if not info.has_manifest and verify:  # after the cheap refusals: it reads the whole source
        without = _check_zip_crcs(src_tier, info, progress, estimate)
        checked = "zip CRC-32s" if not without else ""
        if without:
            notes.append(f"{len(without)} source file(s) written without CRC-32s: not verified "
                         f"({', '.join(without[:3])})")
    if not checked:
        log.warning("%s: the source is not verified (%s)", info.where,
                    "verify=False" if verify else "no manifest, and files written without CRC-32s")
    report = ConvertReport(
        src=_describe(src, src_tier), dst=_describe(dst, dst_tier), to=to, step=step_no, source_layout=info.layout,
        source_writer=info.writer, source_verified=checked == "manifest", source_checked=checked,
        source_topology=rank_shard.topology_dict(info.topology), topology=rank_shard.topology_dict(target),
        notes=notes)
    try:
        with StepSource(src_tier, info, trust_pickles=trust_pickles, verify=verify) as source, \
                _progress_bar(progress, estimate) as bar:
            entries = _write(source, store, to, target, report, bar)
            if not isinstance(bar, _NoBar):  # the total was an estimate: a finished bar says 100%, never 97%
                bar.total = bar.n
                bar.refresh()
            report.bytes_read += source.bytes_read
            store.commit_files(step_no, target, entries)
    except BaseException:
        # The step was not there before (checked above): what this convert wrote goes, so that the same command
        # can run again (e.g. with --trust-pickles) instead of finding "already exists".
        try:
            if not dst_tier.exists(store.layout.manifest_key(step_no)):
                dst_tier.delete_prefix(info.step_dir)
        except (TierError, OSError) as exc:  # the original error is the one to raise
            log.warning("%s: could not remove what the failed convert wrote: %s",
                        tier_io.where(dst_tier, info.step_dir), exc)
        raise
    report.files = [{"key": e.key, "item": e.item, "rank": e.rank, "size": e.size, "checksum": e.checksum}
                    for e in entries]
    report.bytes_written = sum(e.size for e in entries)
    report.seconds = time.perf_counter() - t0
    log.info("converted %s step %d (%s, %s) to %s (%s): %d files, %d bytes in %.1f s", report.src, step_no,
             info.layout, "verified" if report.source_verified else "unverified", report.dst, to, len(entries),
             report.bytes_written, report.seconds)
    return report


def _check_zip_crcs(tier: Tier, info: legacy.CheckpointInfo, progress: bool,
                    estimate: Callable[[], int | None]) -> list[str]:
    """A source without our manifest (Megatron-LM wrote it) has no checksums of ours: each of its torch files is
    checked against the CRC-32s of its zip directory before anything is converted, so that damage never leaves
    with our checksums vouching for it. Raises CorruptionError naming the damaged records; returns the files
    written without CRC-32s (``torch.utils.serialization.config.save.compute_crc32 = False``)."""
    from .lazy_torch import open_lazy

    keys = sorted(k for k in tier.list(info.step_dir + "/") if loadable.is_megatron_file(k))
    damaged: list[str] = []
    without: list[str] = []
    with _progress_bar(progress, estimate, "check") as bar:
        for key in keys:
            mismatches = open_lazy(tier, key, where=tier_io.where(tier, key), unpickle=False).damaged_records(
                bar.update)
            if mismatches is None:
                without.append(key)
            else:
                damaged += [f"{key}: record {m}" for m in mismatches]
    if damaged:
        raise CorruptionError(f"{info.where}: {len(damaged)} record(s) of the source do not match the CRC-32 its "
                              f"file's zip directory gives, e.g. {damaged[0]}; nothing was converted. Restore the "
                              "file from another copy, or convert an older step (--step)")
    return without


def _target_topology(src: MegatronTopology, dp: int | None) -> MegatronTopology:
    if dp is None:
        return src
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp: expected a positive integer, got {dp!r}")
    if dp % src.ep:
        raise ConfigError(f"dp: {dp} is not a multiple of EP={src.ep} (Megatron's DP includes the expert ranks)")
    return MegatronTopology(tp=src.tp, pp=src.pp, dp=dp // src.ep, ep=src.ep, cp=src.cp, order=src.order)


def _check_megatron_loadable(tier: Tier, key: str, report: ConvertReport, trust_pickles: bool) -> None:
    """A model file Megatron-LM would refuse is not converted (unless the user trusts pickles: then a note)."""
    try:
        refused = loadable.file_refusals(tier, key)
    except DecodeError as exc:
        refused = [str(exc)]
    if not refused:
        return
    message = loadable.explain(tier_io.where(tier, key), refused)
    if not trust_pickles:
        raise UnsafePickleError(message + "; the converted checkpoint would not load in Megatron-LM either (pass "
                                "--trust-pickles to convert it anyway, for tiered_ckpt's own loader)")
    report.notes.append(message)


def _carry_other_items(source: StepSource, store: FileStore, target: MegatronTopology, report: ConvertReport,
                       entries: list[FileEntry], on_read: Any) -> None:
    """Items of ours besides Megatron's (a dataloader's state, ...): both layouts keep them at
    ``iter_*/rank_RRRRR/<item>.<ext>``, so at the same DP they are copied as they are (verified, decompressed);
    at another DP a rank's state has no new owner: left out, said in the report and the log."""
    others = [e for e in (source.manifest.files if source.manifest is not None else ())
              if e.item not in (MODEL_ITEM, OPTIM_ITEM)]
    if not others:
        return
    if target.dp == source.info.topology.dp:
        step = int(source.info.iteration)
        for e in others:
            entries.append(store.copy_file(source.tier, e.key, e.key, entry=e, item=e.item, rank=e.rank, step=step,
                                           meta=dict(e.meta), codec=e.codec, on_read=on_read))
        return
    names = ", ".join(sorted({e.item for e in others}))
    note = (f"not converted: {names} (per-rank state of DP {source.info.topology.dp}, which cannot be split for DP "
            f"{target.dp})")
    report.notes.append(note)
    log.warning("%s", note)


def _write(source: StepSource, store: FileStore, to: str, target: MegatronTopology, report: ConvertReport,
           bar: Any) -> list[FileEntry]:
    info, src, dst = source.info, source.tier, store.tier
    step = int(info.iteration)
    entries: list[FileEntry] = []
    read = 0

    def on_read(n: int) -> None:
        nonlocal read
        read += n
        bar.update(n)

    def copy(key: str, item: str, rank: int, meta: dict[str, Any] | None = None) -> FileEntry:
        return store.copy_file(src, key, key, entry=source.entry(key), item=item, rank=rank, step=step, meta=meta,
                               on_read=on_read)

    writers = model_dirs(target)
    for d, writer in writers.items():
        key = source.key(d, MODEL_FILENAME)
        entries.append(copy(key, MODEL_ITEM, writer))
        _check_megatron_loadable(dst, key, report, source.trust_pickles)  # the verified copy: not committed yet
    same_dp = target.dp == info.topology.dp
    if to == "megatron":
        if info.layout == "rank_sharded" and info.rank_files:
            shards_dirs = plan_dirs(_rank_shards(source))
            for d, parts in shards_dirs.items():
                entry = write_megatron_file(store, source.key(d, DISTRIB_OPTIM_FILENAME), parts, step=step,
                                            progress=bar.update)
                if not same_dp:  # the file's writer in the target's ranks; the source's DP groups mean nothing there
                    entry = replace(entry, rank=writers[d],
                                    meta={k: v for k, v in entry.meta.items() if k != "merged_from"})
                entries.append(entry)
        elif info.has_distrib_optim:
            meta = _megatron_meta(source, report)
            for d in info.rank_dirs:
                key = source.key(d, DISTRIB_OPTIM_FILENAME)
                if src.exists(key):
                    entries.append(copy(key, OPTIM_ITEM, writers[d], meta.get(d)))
    elif info.layout == "rank_sharded" and same_dp:
        for r in info.rank_files:
            entries.append(copy(source.key(f"rank_{r:05d}", DISTRIB_OPTIM_FILENAME), OPTIM_ITEM, r))
    elif source.dir_states():
        from .merge import counted
        from .torch_zip import iter_torch_save

        for r in range(target.world_size):
            key = source.key(f"rank_{r:05d}", DISTRIB_OPTIM_FILENAME)
            entries.append(store.write_file(
                key, lambda r=r: counted(iter_torch_save(source.streamed_rank_shard(target, r)), bar.update),
                item=OPTIM_ITEM, rank=r, step=step))
    _carry_other_items(source, store, target, report, entries, on_read)
    if not any(e.item == OPTIM_ITEM for e in entries):
        report.notes.append("no distributed-optimizer state in the source: the model files were converted as they "
                            "are (a job without --use-distributed-optimizer keeps its optimizer state in them)")
    report.bytes_read += read
    return entries


def _rank_shards(source: StepSource) -> dict[int, rank_shard.RankShard]:
    from .merge import open_rank_shards

    keys = {source.key(f"rank_{r:05d}", DISTRIB_OPTIM_FILENAME): r for r in source.info.rank_files}
    return open_rank_shards(source.tier, keys, source.files, source.entries if source.manifest else None)


def _megatron_meta(source: StepSource, report: ConvertReport) -> dict[str, dict[str, Any]]:
    """Per directory: the manifest facts that let the merged file be split again exactly (kinds, DP sizes,
    bucket geometry), from the source's manifest or recomputed from the model state."""
    try:
        states = source.dir_states()
    except LayoutMismatchError as exc:
        report.notes.append(f"bucket geometry unknown ({exc}); the files are copied without it")
        return {}
    return {d: {"optimizers": [None if p is None else {"kind": p[2], "dp_size": p[1].dp_size,
                                                       "geometry": p[1].to_dict()} for p in parts]}
            for d, parts in states.items()}


def _estimate(tier: Tier, info: legacy.CheckpointInfo) -> int | None:
    try:
        return sum(tier.size(k) for k in tier.list(info.step_dir + "/") if k.endswith(".pt"))
    except Exception:  # only for the progress bar
        return None


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _progress_bar(enabled: bool, total: Callable[[], int | None], desc: str = "convert") -> Any:
    """A bar on stderr (a terminal), its total asked of ``total()`` only then."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from ..progress import progress_bar

    return progress_bar(total=total(), desc=desc, file=sys.stderr)


def _describe(target: Any, tier: Tier) -> str:
    return tier.describe() if isinstance(target, Tier) else os.fspath(target)

