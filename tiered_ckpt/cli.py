"""The ``tiered-ckpt`` command line.

Exit codes: 0 success; 1 a check failed (verify found a mismatch, a checkpoint cannot be converted); 2 bad usage
or configuration; 3 nothing found (no such directory, bucket, step or checkpoint); 4 a tier could not be read
(unreachable, permission denied, no credentials: nothing can be said about what it holds); 130 interrupted
(Ctrl-C); 141 the reader of the output went away (``| head``). With ``--json`` a failure is a JSON object on
stdout, ``{"error": ..., "exit_code": N}``, instead of a message on stderr.

``ls``, ``inspect``, ``verify`` and ``gc`` (without ``--delete``) only read: a tier whose directory does not
exist is reported, never created, and lock files are only looked at.

Only the standard library is imported at start-up: ``--help`` and argument errors never load torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import (
    BlobNotFoundError,
    ConfigError,
    NoCheckpointError,
    TieredCkptError,
    TierError,
    TierUnavailableError,
)

if TYPE_CHECKING:
    from .config import Config, TierConfig
    from .file_store import FileStore
    from .store import Store

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNREADABLE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away

DESCRIPTION = "List, inspect, verify, convert and clean up tiered_ckpt checkpoints on any tier."
EPILOG = ("exit status: 0 success, 1 a check failed, 2 bad usage or configuration, 3 nothing found, 4 a tier "
          "could not be read, 130 interrupted. With --json, a failure prints {\"error\": ..., \"exit_code\": N} "
          "on stdout.")
DEFAULT_SHM_PATH = "/dev/shm/tiered_ckpt"
_json_errors = False  # set by main(): argument errors as JSON too when --json was given


class CommandError(Exception):
    """A command's failure: the message, the exit code, and extra fields for ``--json``."""

    def __init__(self, message: str, exit_code: int, **extra: Any):
        super().__init__(message)
        self.exit_code = exit_code
        self.extra = extra


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        if _json_errors:
            _print_json({"error": f"{self.prog}: {message}", "exit_code": EXIT_USAGE})
            sys.exit(EXIT_USAGE)
        super().error(message)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _print_table(rows: list[list[Any]], headers: list[str]) -> None:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _note(args: argparse.Namespace, text: str) -> None:
    print(f"tiered-ckpt {args.command}: {text}", file=sys.stderr)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ----- storage options ------------------------------------------------------------------------------------
def storage_options(items: list[str] | None, endpoint_url: str | None) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--endpoint-url`` as fsspec storage options.

    VALUE is read as JSON when it is valid JSON (``true``, ``8``, ``{"region_name": "x"}``), else as text; quote
    a number to keep it text (``'token="123"'``). A dotted KEY sets a nested option:
    ``client_kwargs.region_name=eu-west-1``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {item!r}: expected KEY=VALUE")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.strip().split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--storage-option {item!r}: {p} is set to a value, not to options")
        node[leaf] = value
    if endpoint_url:
        out["endpoint_url"] = endpoint_url
    return out


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _is_url(target: str) -> bool:
    return "://" in target and not target.startswith("file://")


def _config_for_target(target: str, layout: str, options: dict[str, Any] | None = None) -> Config:
    """A one-tier configuration for a bare directory or URL."""
    from .config import load_config
    from .plugins import get_plugin_manager

    if _is_url(target):
        raw: dict[str, Any] = {"name": "target", "kind": "fsspec", "url": target}
        if options:
            raw["options"] = options
    else:
        if options:
            raise ConfigError("--storage-option and --endpoint-url are for URLs (s3://...), not directories")
        raw = {"name": "target", "kind": "local", "path": target.removeprefix("file://")}
    return load_config({"layout": layout, "tiers": [raw]}, registries=get_plugin_manager().registries)


def _with_storage_options(config: Config, options: dict[str, Any]) -> Config:
    """The configuration with the command line's storage options added to each fsspec tier's own."""
    from dataclasses import replace

    tiers, hit = [], False
    for t in config.tiers:
        if t.kind == "fsspec":
            hit = True
            t = replace(t, options=replace(t.options, options=_merged(t.options.options, options)))
        tiers.append(t)
    if not hit:
        raise ConfigError("--storage-option and --endpoint-url apply to fsspec tiers; the configuration has none")
    return replace(config, tiers=tuple(tiers))


def _config(args: argparse.Namespace) -> Config:
    from .config import load_config
    from .plugins import get_plugin_manager

    options = storage_options(getattr(args, "storage_option", None), getattr(args, "endpoint_url", None))
    if args.config:
        if getattr(args, "target", None):
            raise ConfigError(f"give a checkpoint directory or URL, or --config, not both ({args.target!r} and "
                              f"--config {args.config})")
        config = load_config(args.config, registries=get_plugin_manager().registries)
        return _with_storage_options(config, options) if options else config
    if getattr(args, "target", None):
        return _config_for_target(args.target, args.layout, options)
    raise ConfigError("give a checkpoint directory or URL, or --config tiers.yaml")


# ----- opening tiers --------------------------------------------------------------------------------------
@dataclass
class Opened:
    """The tiers a command looks at: built ones, and those with nothing to look at or that could not be read."""

    config: Config
    target: str | None  # the bare directory or URL given instead of --config
    cfgs: dict[str, TierConfig] = field(default_factory=dict)  # every selected tier, opened or not
    stores: dict[str, Store] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)  # file tiers with nothing there: why
    unreadable: dict[str, str] = field(default_factory=dict)  # tiers that could not be read: why

    def label(self, name: str) -> str:
        return self.target if self.target is not None else f"tier {name!r}"

    def file_stores(self) -> dict[str, FileStore]:
        return {n: files for n, s in self.stores.items() if (files := s.files()) is not None}

    def problem(self, found: bool, nothing: str) -> CommandError | None:
        """The command's failure, if any: a tier could not be read (4), or nothing was found (3): because the
        directory or bucket given does not exist, or because ``nothing``."""
        if self.unreadable:
            why = "; ".join(f"{self.label(n)}: {w}" for n, w in self.unreadable.items())
            return CommandError(f"could not read {why} (nothing can be said about what it holds)", EXIT_UNREADABLE,
                                unreadable=dict(self.unreadable))
        if self.target is not None and self.absent:
            return CommandError(f"{self.target}: {next(iter(self.absent.values()))}", EXIT_NOT_FOUND)
        if not found:
            why = "; ".join(f"{self.label(n)}: {w}" for n, w in self.absent.items())
            return CommandError(nothing + (f" ({why})" if why else ""), EXIT_NOT_FOUND)
        return None

    def notes(self, args: argparse.Namespace) -> None:
        """Tiers with nothing there, on stderr (a configured directory that does not exist yet is no error)."""
        if self.target is None:
            for n, why in self.absent.items():
                _note(args, f"{self.label(n)}: {why}")


def _open(args: argparse.Namespace, *, memory: bool) -> Opened:
    """The selected tiers, opened for reading only: nothing is created. ``memory``: open memory tiers too."""
    from .inventory import Unreadable, absent_before_open, absent_location
    from .parallel import RankCoords
    from .pipeline import build_stores
    from .plugins import get_plugin_manager
    from .tiers.base import _user_name

    pm = get_plugin_manager()
    config = _config(args)
    opened = Opened(config, None if args.config else args.target)
    names = [t.name for t in config.tiers if t.enabled is not False and not _unavailable(pm, t)]
    if getattr(args, "tier", None):
        if args.tier not in names:
            raise ConfigError(f"no enabled tier named {args.tier!r} (tiers: {', '.join(names)})")
        names = [args.tier]
    user = _user_name()
    for cfg in config.tiers:
        if cfg.name not in names:
            continue
        cls = pm.registries.tiers.get(cfg.kind)
        caps = cls.capabilities_for(cfg.options)
        is_memory = caps.memory
        if (is_memory and not caps.survives_process) or (is_memory and not memory):
            continue  # a process's own memory (gpu, or a plugin's like it): nothing to see from here
        opened.cfgs[cfg.name] = cfg
        try:
            why = absent_before_open(cfg, config.run_id, user)
            if why is None:
                store = build_stores(config, pm, RankCoords(rank=0), 0, [cfg.name], lambda e: None)[cfg.name]
                why = absent_location(store.tier)
        except Unreadable as exc:
            opened.unreadable[cfg.name] = str(exc)
            continue
        except (TierError, OSError) as exc:
            opened.unreadable[cfg.name] = _text(exc)
            continue
        if why is not None:
            if not is_memory:
                opened.absent[cfg.name] = why
            continue
        opened.stores[cfg.name] = store
    return opened


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _unavailable(pm: Any, cfg: TierConfig) -> bool:
    from .pipeline import tier_enabled

    try:
        return not tier_enabled(pm, cfg)
    except ConfigError:
        return True


def _built_stores(args: argparse.Namespace) -> tuple[Config, dict[str, Store]]:
    """Every enabled tier, built as the engine builds it (``bench`` writes to them)."""
    from .parallel import RankCoords
    from .pipeline import build_stores
    from .plugins import get_plugin_manager

    pm = get_plugin_manager()
    config = _config(args)
    names = [t.name for t in config.tiers if t.enabled is not False and not _unavailable(pm, t)]
    if getattr(args, "tier", None):
        if args.tier not in names:
            raise ConfigError(f"no enabled tier named {args.tier!r} (tiers: {', '.join(names)})")
        names = [args.tier]
    return config, build_stores(config, pm, RankCoords(rank=0), 0, names, lambda e: None)


def _emit(args: argparse.Namespace, payload: Any, problem: CommandError | None, text: Any, partial: bool) -> int:
    """Print the result (JSON, or ``text()``), then fail with ``problem`` if there is one (with ``--json``: the
    error object, holding the results under "results" when there are ``partial`` ones)."""
    if args.json:
        if problem is not None:
            if partial:
                problem.extra.setdefault("results", payload)
            raise problem
        _print_json(payload)
        return EXIT_OK
    text()
    if problem is not None:
        raise problem
    return EXIT_OK


# ----- commands -------------------------------------------------------------------------------------------
def cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import get_plugin_manager

    regs = get_plugin_manager().registries
    rows = []
    for what, reg in (("tier", regs.tiers), ("layout", regs.layouts), ("codec", regs.codecs)):
        for name, cls, provider in reg.items():
            rows.append({"type": what, "name": name, "provider": provider, "class": f"{cls.__module__}.{cls.__name__}"})
    if args.json:
        _print_json(rows)
    else:
        _print_table([[r["type"], r["name"], r["provider"], r["class"]] for r in rows],
                     ["type", "name", "provider", "class"])
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    from .inventory import StepInfo, file_steps, memory_steps

    opened = _open(args, memory=True)
    infos: list[StepInfo] = []
    committed: dict[str, set[int]] = {}
    for name, store in opened.file_stores().items():
        try:
            steps = file_steps(store)
        except (TierError, OSError) as exc:
            opened.unreadable[name] = _text(exc)
            continue
        committed[name] = {i.step for i in steps if i.state == "committed" and i.step is not None}
        infos.extend(steps)
    run_id = opened.config.run_id
    shm_bases: list[tuple[str, str]] = []
    for name, cfg in opened.cfgs.items():
        if cfg.kind == "shm":
            shm_bases.append((name, os.path.abspath(os.path.expanduser(cfg.options.path))))
        slots = opened.stores[name].slots() if name in opened.stores else None
        if slots is not None:
            infos.extend(_snapshot_rows(memory_steps(slots), run_id, committed, opened))
    for name, base in shm_bases:
        infos.extend(_other_runs(name, base, run_id))
    problem = opened.problem(bool(infos), f"no checkpoints in {opened.target}" if opened.target else
                             "no checkpoints on any tier")
    opened.notes(args)

    def text() -> None:
        _print_table([[i.tier, "-" if i.step is None else i.step, i.state, human_bytes(i.nbytes),
                       "-" if i.age_s is None else f"{i.age_s:.0f}s", i.files, _ranks(i.ranks)] for i in infos],
                     ["tier", "step", "state", "size", "age", "files", "ranks"])

    return _emit(args, [i.to_dict() for i in infos], problem, text if infos else lambda: None, bool(infos))


def _snapshot_rows(rows: list, run_id: str, committed: dict[str, set[int]], opened: Opened) -> list:
    """This run's snapshots, each with its run's state (:func:`~tiered_ckpt.housekeeping.run_state`: a live
    engine holds it; "closed": the engine closed; "stale": the process ended without ``close()``) and, with no
    live engine, the file tiers that never got it (the next engine of this run_id drains it there)."""
    from .housekeeping import run_state
    from .locking import shm_paths

    state = run_state(run_id, shm_paths(opened.config))
    for info in rows:
        memory_only = info.state == "snapshot (non-persistent)"  # saved for memory tiers only: never drained
        if state == "live":
            info.state = "snapshot (live engine" + ("; non-persistent)" if memory_only else ")")
            continue
        what = "closed" if state == "closed" else "stale: its process ended without close()"
        missing = [n for n, steps in committed.items() if info.step not in steps and max(steps, default=-1) < info.step]
        if memory_only:
            info.state = f"snapshot ({what}; non-persistent: memory only, no file tier takes it)"
        elif missing:
            info.state = (f"snapshot ({what}; not on {', '.join(map(repr, missing))}: the next engine of run "
                          f"{run_id!r} drains it)")
        elif committed and not opened.unreadable and not opened.absent:
            info.state = f"snapshot ({what}; on every file tier)"
        else:
            info.state = f"snapshot ({what})"
    return rows


def _other_runs(tier: str, shm_path: str, run_id: str) -> list:
    """One row per other run with shared memory under ``shm_path``: its newest snapshot step, never a made-up one."""
    from .housekeeping import list_runs
    from .inventory import StepInfo

    out = []
    for run in list_runs(shm_path):
        if run.run_id == run_id:
            continue
        what = {"live": "live engine", "closed": "closed", "stale": "stale: its process ended without close()"}
        state = (f"run {run.run_id!r}: {what[run.state]}" + ("" if run.live else "; gc --stale removes it")
                 + (f"; steps {', '.join(map(str, run.steps))}" if len(run.steps) > 1 else ""))
        out.append(StepInfo(tier, run.steps[-1] if run.steps else None, state, run.nbytes, run.age_s,
                            run.snapshots, run.ranks, run_id=run.run_id))
    return out


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _pick_step(store: FileStore, step: int | None, label: str) -> int:
    steps = store.committed_steps()
    if not steps:
        raise NoCheckpointError(f"{label} holds no committed checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(f"{label} has no committed step {step} (committed: {steps})")
    return step


def _file_tiers(opened: Opened) -> dict[str, FileStore]:
    stores = opened.file_stores()
    if not stores:
        problem = opened.problem(False, "no file tier to look at (memory tiers are listed by `ls`)")
        assert problem is not None
        raise problem
    return stores


def cmd_inspect(args: argparse.Namespace) -> int:
    opened = _open(args, memory=False)
    name, store = next(iter(_file_tiers(opened).items()))
    opened.notes(args)
    if (plain := _inspect_dcp(store, args)) is not None:  # a DCP directory without our manifest (issue #14)
        return plain
    step = _pick_step(store, args.step, opened.label(name))
    m = store.read_manifest(step)
    if args.json:
        from dataclasses import asdict

        _print_json({"tier": store.name, **asdict(m)})
        return EXIT_OK
    p = m.parallel
    print(f"tier {store.name!r} ({store.tier.describe()}), step {m.step}, layout {m.layout}, run_id {m.run_id}")
    print(f"parallel: world {p.get('world_size')}  tp {p.get('tp')}  pp {p.get('pp')}  dp {p.get('dp')}  "
          f"ep {p.get('ep')}  cp {p.get('cp')}  order {p.get('order')}")
    print(f"{len(m.files)} files, {human_bytes(m.total_bytes)}")
    _print_table([[f.rank, f.item, f.key, human_bytes(f.size), f.compression or "-", f.checksum] for f in m.files],
                 ["rank", "item", "file", "size", "compression", "checksum"])
    return EXIT_OK


def _inspect_dcp(store: FileStore, args: argparse.Namespace) -> int | None:
    """``inspect`` of a DCP checkpoint written by DCP itself (no manifest of ours), where the step asked for (or
    the directory given) is one; None otherwise (issue #14, docs/dcp.md)."""
    from .dcp.inventory import inspect_plain

    committed = store.committed_steps()
    if args.step in committed or (args.step is None and committed and not store.tier.exists(".metadata")):
        return None
    found = inspect_plain(store, args.step, args.json)
    if found is None:
        return None
    if isinstance(found, dict):
        _print_json(found)
        return EXIT_OK
    lines, rows = found
    print("\n".join(lines))
    _print_table(rows, ["item", "kind", "shape", "dtype", "file", "offset", "length"])
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .inventory import verify_step

    opened = _open(args, memory=False)
    stores = _file_tiers(opened)
    opened.notes(args)
    results, empty = [], []
    for name, store in stores.items():
        try:
            steps = store.committed_steps() if args.all else [_pick_step(store, args.step, opened.label(name))]
        except NoCheckpointError as exc:
            empty.append(str(exc))
            continue
        except (TierError, OSError) as exc:
            opened.unreadable[name] = _text(exc)
            continue
        if not steps:
            empty.append(f"{opened.label(name)} holds no committed checkpoint")
            continue
        progress = sys.stderr.isatty() and not args.json
        results.extend(verify_step(store, s, progress=progress) for s in steps)
    if len(stores) > 1:
        for text in empty:
            _note(args, text)
    bad = [r for r in results if not r.ok]
    payload = [{"tier": r.tier, "step": r.step, "files": r.checked, "bytes": r.nbytes, "ok": r.ok,
                "problems": r.problems} for r in results]
    problem = None if bad else opened.problem(bool(results), "; ".join(empty) or "no committed checkpoint")

    def text() -> None:
        for r in results:
            status = "OK" if r.ok else "FAILED"
            print(f"{status}  tier {r.tier!r} step {r.step}: {r.checked} files, {human_bytes(r.nbytes)}")
            for p in r.problems:
                print(f"    {p}")

    code = _emit(args, payload, problem, text, bool(results))
    return EXIT_FAILED if bad else code


def cmd_gc(args: argparse.Namespace) -> int:
    from .housekeeping import find_debris, find_stale_runs, remove_debris, remove_stale_run, run_state
    from .locking import shm_paths

    found: list[dict] = []
    opened = _open(args, memory=False) if args.target or args.config else None
    if opened is None and not args.stale:
        raise ConfigError("give a checkpoint directory or URL, --config tiers.yaml, or --stale")
    if args.stale:
        for shm_path in _shm_paths(args, opened):
            for run in find_stale_runs(shm_path):
                found.append({"what": "stale run", **run.to_dict()})
                if args.delete:
                    remove_stale_run(run, shm_path)
    if opened is not None:
        live = bool(args.config) and run_state(opened.config.run_id, shm_paths(opened.config)) == "live"
        for name, store in opened.file_stores().items():
            try:
                debris = find_debris(store, live=live, min_age_s=args.min_age)
            except (TierError, OSError) as exc:
                opened.unreadable[name] = _text(exc)
                continue
            found += [d.to_dict() for d in debris]
            if args.delete:
                remove_debris(store, debris, min_age_s=args.min_age)
        opened.notes(args)
    problem = opened.problem(True, "") if opened is not None else None
    verb = "removed" if args.delete else "would remove"

    def text() -> None:
        for f in found:
            if f["what"] == "stale run":
                steps = f", steps {', '.join(map(str, f['steps']))}" if f["steps"] else ""
                print(f"{verb}  shared memory of run {f['run_id']!r} ({f['state']}{steps})  {f['path']}  "
                      f"({human_bytes(f['bytes'])})")
            else:
                print(f"{verb}  {f['what']}  tier {f['tier']!r}: {f['key']}  ({human_bytes(f['bytes'])})")
        if not found:
            print("nothing to remove")
        elif not args.delete:
            print("dry run: nothing was removed; add --delete to remove these")

    return _emit(args, {"deleted": args.delete, "found": found}, problem, text, bool(found))


def _shm_paths(args: argparse.Namespace, opened: Opened | None) -> list[str]:
    """Where ``gc --stale`` looks: --shm-path; else the configuration's shm tiers; else the default path."""
    if args.shm_path:
        return [args.shm_path]
    if opened is not None and args.config:
        paths = [t.options.path for t in opened.config.tiers if t.kind == "shm"]
        if paths:
            return list(dict.fromkeys(paths))
    return [DEFAULT_SHM_PATH]


def cmd_bench(args: argparse.Namespace) -> int:
    from . import machine_bench as mb

    nbytes = args.size_mib << 20
    rows = [mb.copy_prefaulted(nbytes)]
    if os.path.isdir("/dev/shm"):
        rows.append(mb.fresh_shm_write(nbytes))
    stores: dict = {}
    if args.config or args.target:
        _, stores = _built_stores(args)
    for store in stores.values():
        path = getattr(store.tier.options, "path", None)
        if store.tier.kind == "local" and path:
            rows.append(mb.write_fsync(nbytes, path))
    if not stores:
        rows.append(mb.write_fsync(nbytes, os.getcwd()))
    for store in stores.values():
        rows.extend(mb.tier_round_trip(store.tier, nbytes))
    ceiling = rows[0].gbps
    if args.json:
        _print_json([{**r.to_dict(), "vs_copy": round(r.gbps / ceiling, 3)} for r in rows])
        return EXIT_OK
    _print_table([[r.what, f"{r.seconds:.3f}", f"{r.gbps:.2f}", f"{r.gbps / ceiling:.2f}"] for r in rows],
                 ["what", "seconds", "GB/s", "vs copy"])
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.run import run_demo

    return run_demo(args.workdir, world=args.world, steps=args.steps, remote=args.remote,
                    keep_files=not args.clean)


def add_storage_flags(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--endpoint-url`` for URL tiers."""
    p.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE",
                   help="an fsspec storage option for URLs (repeatable), e.g. -o anon=true, "
                        "-o client_kwargs.region_name=eu-west-1; VALUE is JSON when it parses as JSON, else text")
    p.add_argument("--endpoint-url", metavar="URL",
                   help="the object store's endpoint, e.g. http://localhost:9000 (MinIO); the same as "
                        "-o endpoint_url=URL")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiered-ckpt", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Any, help: str, target: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG)
        p.set_defaults(func=func)
        p.add_argument("--json", action="store_true", help="machine-readable output (errors too)")
        if target:
            p.add_argument("target", nargs="?", help="a checkpoint directory or fsspec URL")
            p.add_argument("--config", "-c", help="a tiers.yaml: use its tiers")
            p.add_argument("--tier", help="only this tier of the configuration")
            p.add_argument("--layout", default="rank_sharded", choices=["rank_sharded", "megatron"],
                           help="layout of a bare directory (default: rank_sharded)")
            add_storage_flags(p)
        return p

    add("plugins", cmd_plugins, "list tier kinds, layouts and codecs with the plugin providing each", target=False)
    add("ls", cmd_ls, "list checkpoints per tier: committed or partial, size, age; shared memory of runs "
                      "(live, closed or stale). Reads only")
    p = add("inspect", cmd_inspect, "show a checkpoint's manifest: layout, parallel layout, files, checksums")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p = add("verify", cmd_verify, "re-hash every file against the manifest; exit 1 on any mismatch")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p.add_argument("--all", action="store_true", help="every committed step")
    p = add("gc", cmd_gc, "find debris (partial steps, temporary files) and dead runs' shared memory; "
                          "a dry run unless --delete")
    p.add_argument("--stale", action="store_true", help="also look for shared memory of runs with no live engine")
    p.add_argument("--shm-path", help=f"the shm tier's path (default: the configuration's shm tiers, else "
                                      f"{DEFAULT_SHM_PATH})")
    p.add_argument("--delete", action="store_true", help="remove what is found (default: only list it)")
    p.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS", help="leave temporary files "
                   "modified less than this long ago: writes in flight (default: %(default)s)")
    p = add("demo", cmd_demo, "train a small GPT on 4 ranks, checkpoint through shm, local and remote tiers, kill a "
                              "rank, resume, and check the resumed run matches an uninterrupted one", target=False)
    p.add_argument("--workdir", default="demo-run", help="where the demo writes (default: %(default)s)")
    p.add_argument("--remote", help="the remote tier's URL (default: a file:// folder in the workdir)")
    p.add_argument("--world", type=int, default=4, help="ranks (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    p.add_argument("--clean", action="store_true", help="remove the workdir afterwards")
    p = add("bench", cmd_bench, "this machine's memcpy, shm and disk bandwidth, and each configured tier's "
                                "write and read throughput against them")
    p.add_argument("--size-mib", type=int, default=256, help="bytes moved per measurement (default: %(default)s)")
    from .megatron.cli_convert import add_convert_command

    add_convert_command(sub, add)
    return parser


def _failure(args: argparse.Namespace, message: str, code: int, extra: dict | None = None) -> int:
    if getattr(args, "json", False):
        _print_json({"error": message, "exit_code": code, **(extra or {})})
    else:
        print(f"tiered-ckpt {args.command}: {message}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away is noticed here, not at interpreter exit
        return code
    except CommandError as exc:
        return _failure(args, str(exc), exc.exit_code, exc.extra)
    except ConfigError as exc:
        return _failure(args, f"configuration error: {exc}", EXIT_USAGE)
    except (NoCheckpointError, BlobNotFoundError) as exc:
        return _failure(args, str(exc), EXIT_NOT_FOUND)
    except TierUnavailableError as exc:
        return _failure(args, str(exc), EXIT_UNREADABLE)
    except TierError as exc:
        return _failure(args, f"could not read or write: {exc}", EXIT_UNREADABLE)
    except TieredCkptError as exc:
        return _failure(args, str(exc), EXIT_FAILED)
    except BrokenPipeError:
        raise
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return _failure(args, f"could not read{where}: {exc.strerror or exc}", EXIT_UNREADABLE)


def main(argv: list[str] | None = None) -> int:
    global _json_errors
    argv = sys.argv[1:] if argv is None else list(argv)
    _json_errors = "--json" in argv
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        try:
            return _run(args)
        except KeyboardInterrupt:
            print(f"tiered-ckpt {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `tiered-ckpt inspect ... | head`: the reader has what it wanted. Point stdout at /dev/null so that the
        # interpreter's own flush at exit does not fail (and print) again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
