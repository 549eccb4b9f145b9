"""merge_step_on_tier: rank files on a tier -> Megatron's distrib_optim.pt, streamed and checksummed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from megatron_fixtures import CONFIGS, ITER_DIR, fixture_rank_shard, truth
from megatron_synthetic import ModelSpec, SyntheticJob

from tiered_ckpt.compression import compress_chunks
from tiered_ckpt.config import CompressionConfig
from tiered_ckpt.errors import CorruptionError, LayoutMismatchError, TransientTierError
from tiered_ckpt.file_streams import checked_pieces
from tiered_ckpt.manifest import FileEntry
from tiered_ckpt.megatron import rank_shard
from tiered_ckpt.megatron.convert import open_store
from tiered_ckpt.megatron.distrib_optim import merge_shards
from tiered_ckpt.megatron.merge import merge_step_on_tier
from tiered_ckpt.megatron.naming import MegatronTopology
from tiered_ckpt.megatron.torch_zip import iter_torch_save
from tiered_ckpt.parallel import ParallelLayout
from tiered_ckpt.tiers.local import LocalOptions, LocalTier


def _tier(path: Path) -> LocalTier:
    return LocalTier("shared", LocalOptions(path=str(path), fsync=False))


def _store(tier: LocalTier):
    """The tier's file store: what the commit path merges through."""
    return open_store(tier, "megatron", tier.name)


def _verify(tier: LocalTier, entry: FileEntry) -> int:
    """Re-read a file checking it against its entry; the bytes read."""
    return sum(len(p) for p in checked_pieces(tier, entry.key, entry))


def _write_rank_files(tier: LocalTier, objs: dict[int, dict], step_dir: str = ITER_DIR,
                      compress: bool = False) -> list[FileEntry]:
    entries = []
    for r, obj in objs.items():
        key = f"{step_dir}/rank_{r:05d}/distrib_optim.pt"
        if compress:
            raw = b"".join(bytes(c) for c in iter_torch_save(obj))
            entry = _store(tier).write_file(key, lambda raw=raw: compress_chunks([raw], CompressionConfig()),
                                            item="distrib_optim", rank=r, step=10)
            entry = FileEntry(**{**entry.__dict__, "compression": "zstd", "raw_size": len(raw)})
        else:
            entry = _store(tier).write_file(key, lambda obj=obj: iter_torch_save(obj), item="distrib_optim", rank=r,
                                            step=10)
        entries.append(entry)
    return entries


def _fixture_files(tier: LocalTier, config: str, **kw) -> list[FileEntry]:
    return _write_rank_files(tier, {r: fixture_rank_shard(config, r) for r in range(truth(config)["world_size"])},
                             **kw)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_merged_files_are_megatrons_bytes(tmp_path: Path, config: str, compress: bool) -> None:
    tier, t = _tier(tmp_path), truth(config)
    rank_entries = _fixture_files(tier, config, compress=compress)
    entries = merge_step_on_tier(_store(tier), 10, topology=ParallelLayout(tp=t["tp"], pp=t["pp"], dp=t["dp"]),
                                 entries=rank_entries)
    dirs = sorted({i["checkpoint_subdir"] for i in t["rank_map"].values()})
    assert [e.key for e in entries] == [f"{ITER_DIR}/{d}/distrib_optim.pt" for d in dirs]
    for e in entries:
        assert hashlib.sha256((tmp_path / e.key).read_bytes()).hexdigest() == t["files"][e.key]["sha256"]
        assert _verify(tier, e) == e.size  # checksum computed while writing
        assert (e.item, e.codec, e.compression, e.raw_size) == ("distrib_optim", "torch", None, e.size)
        group = [int(r) for r, i in t["rank_map"].items() if i["checkpoint_subdir"] == e.key.split("/")[1]]
        assert e.rank == min(group) and e.meta["merged_from"] == sorted(group)
        (opt,) = e.meta["optimizers"]
        assert (opt["kind"], opt["dp_size"]) == ("dense", t["dp"])


def test_moe_files_hold_dense_and_expert_states(tmp_path: Path) -> None:
    job = SyntheticJob(ModelSpec(num_experts=4), tp=1, pp=2, dp=2, ep=2)
    tier = _tier(tmp_path)
    _write_rank_files(tier, {r: job.rank_shard(r) for r in job.iter_ranks()}, step_dir="iter_0000100")
    entries = merge_step_on_tier(_store(tier), 100, topology=job.parallel)
    assert len(entries) == 4  # one per (pp, ep) directory
    for e in entries:
        got = torch.load(tmp_path / e.key, weights_only=True)
        d = e.key.split("/")[1]
        shard = next(s for s in job.shards() if job.mp_dir(s) == d)
        want = []
        for kind in job.kinds():
            group = rank_shard.dp_group(job.topology, job.writer_rank(shard), kind)
            if job.topology.rank_dir(group[0]) != d:
                want.append(None)
                continue
            want.append(merge_shards([job.local_shards(r, kind) for r in group], job.geometry(shard, kind)))
        assert_same(want, got)
        assert (got[0] is None) == (shard.ep != 0)  # dense state lives in the ep = 0 directory only


def test_corrupt_rank_file_is_named(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    entries = _fixture_files(tier, "dp4_tp1_pp1")
    path = tmp_path / ITER_DIR / "rank_00002" / "distrib_optim.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="rank_00002/distrib_optim.pt.*checksum mismatch"):
        merge_step_on_tier(_store(tier), 10, entries=entries)
    assert not (tmp_path / ITER_DIR / "mp_rank_00").exists()


def test_incomplete_or_foreign_steps_are_refused(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    _write_rank_files(tier, {r: fixture_rank_shard("dp4_tp1_pp1", r) for r in (0, 1, 3)})
    with pytest.raises(LayoutMismatchError, match=r"missing for ranks \[2\]"):
        merge_step_on_tier(_store(tier), 10)
    _write_rank_files(tier, {2: fixture_rank_shard("dp4_tp1_pp1", 2)})
    with pytest.raises(LayoutMismatchError, match="the job is"):
        merge_step_on_tier(_store(tier), 10, topology=MegatronTopology(tp=2, dp=2))
    with pytest.raises(LayoutMismatchError, match="step 11: no rank_"):
        merge_step_on_tier(_store(tier), 11)
    other = tmp_path / "other"
    _write_rank_files(_tier(other), {0: fixture_rank_shard("dp4_tp1_pp1", 1)})
    with pytest.raises(CorruptionError, match="holds rank 1's state, not rank 0's"):
        merge_step_on_tier(_store(_tier(other)), 10)


class _FlakyTier(LocalTier):
    """Fails the first write of each Megatron ``mp_rank_*/distrib_optim.pt`` with a transient error."""

    failed: set[str]

    def write_blob(self, key, chunks):
        if "/mp_rank_" in key and key not in self.failed:
            self.failed.add(key)
            for _ in chunks:  # the stream is consumed, as a real tier would before failing
                break
            raise TransientTierError("connection reset", tier=self.name, key=key)
        return super().write_blob(key, chunks)


def test_the_merge_writes_through_the_store_with_its_retries_and_events(tmp_path: Path) -> None:
    from tiered_ckpt.codecs.file_codecs import FlatFileCodec, TorchFileCodec
    from tiered_ckpt.config import RetryConfig, TierConfig
    from tiered_ckpt.file_store import FileStore
    from tiered_ckpt.layouts.megatron import MegatronLayout

    tier = _FlakyTier("shared", LocalOptions(path=str(tmp_path), fsync=False))
    tier.failed = set()
    events = []
    store = FileStore(tier, TierConfig(name="shared", kind="local", retry=RetryConfig(attempts=2, initial_s=0.01)),
                      MegatronLayout(), {"flat": FlatFileCodec(), "torch": TorchFileCodec()}, events.append)
    t = truth("dp4_tp1_pp1")
    rank_entries = _fixture_files(tier, "dp4_tp1_pp1")
    entries = merge_step_on_tier(store, 10, topology=ParallelLayout(dp=t["dp"]), entries=rank_entries)
    for e in entries:  # the retried write is Megatron's file, byte for byte, and its entry says so
        assert hashlib.sha256((tmp_path / e.key).read_bytes()).hexdigest() == t["files"][e.key]["sha256"]
        assert _verify(tier, e) == e.size
    retries = [ev for ev in events if ev.kind == "retry"]
    assert sorted(tier.failed) == sorted(e.key for e in entries) and len(retries) == len(entries)
    assert all(ev.tier == "shared" and ev.step == 10 and "mp_rank_00/distrib_optim.pt" in ev.message for ev in retries)
