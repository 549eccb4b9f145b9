"""The ``tiered-ckpt`` command line.

Exit codes: 0 success; 1 a check failed (verify found a mismatch, gc found something to remove in dry-run
with ``--check``); 2 bad usage or configuration; 3 nothing found (no such step or checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from .config import Config, TierConfig, load_config
from .errors import ConfigError, NoCheckpointError, TieredCkptError
from .file_store import FileStore
from .memory_store import MemoryStore
from .parallel import RankCoords
from .pipeline import build_stores
from .plugins import get_plugin_manager

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3


def _print_table(rows: list[list[Any]], headers: list[str]) -> None:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _config_for_target(target: str, layout: str) -> Config:
    """A one-tier configuration for a bare directory or URL."""
    if "://" in target and not target.startswith("file://"):
        raw = {"name": "target", "kind": "fsspec", "url": target}
    else:
        raw = {"name": "target", "kind": "local", "path": target.removeprefix("file://")}
    return load_config({"layout": layout, "tiers": [raw]})


def _stores(args: argparse.Namespace) -> tuple[Config, dict[str, MemoryStore | FileStore]]:
    pm = get_plugin_manager()
    if args.config:
        config = load_config(args.config, registries=pm.registries)
    elif getattr(args, "target", None):
        config = _config_for_target(args.target, args.layout)
    else:
        raise ConfigError("give a checkpoint directory or URL, or --config tiers.yaml")
    names = [t.name for t in config.tiers if t.enabled is not False and not _unavailable(pm, t)]
    if getattr(args, "tier", None):
        if args.tier not in names:
            raise ConfigError(f"no enabled tier named {args.tier!r} (tiers: {', '.join(names)})")
        names = [args.tier]
    stores = build_stores(config, pm, RankCoords(rank=0), 0, names, lambda e: None)
    return config, stores


def _unavailable(pm: Any, cfg: TierConfig) -> bool:
    from .pipeline import tier_enabled

    try:
        return not tier_enabled(pm, cfg)
    except ConfigError:
        return True


# ----- commands -------------------------------------------------------------------------------------------
def cmd_plugins(args: argparse.Namespace) -> int:
    regs = get_plugin_manager().registries
    rows = []
    for what, reg in (("tier", regs.tiers), ("layout", regs.layouts), ("codec", regs.codecs)):
        for name, cls, provider in reg.items():
            rows.append({"type": what, "name": name, "provider": provider, "class": f"{cls.__module__}.{cls.__name__}"})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table([[r["type"], r["name"], r["provider"], r["class"]] for r in rows],
                     ["type", "name", "provider", "class"])
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    from .housekeeping import _run_is_live, find_stale_runs
    from .inventory import StepInfo, file_steps, memory_steps

    config, stores = _stores(args)
    infos = []
    for store in stores.values():
        if isinstance(store, MemoryStore):
            stale = not _run_is_live(config.run_id)
            for info in memory_steps(store):
                info.state = "snapshot (stale: no live engine)" if stale else "snapshot"
                infos.append(info)
            base = os.path.dirname(store.tier.root) if hasattr(store.tier, "root") else None
            if base:  # other runs' snapshots left in the same shared memory
                for run in find_stale_runs(os.path.dirname(base)):
                    if run.run_id != config.run_id:
                        infos.append(StepInfo(store.name, -1, f"stale run {run.run_id!r}", run.nbytes, run.age_s,
                                              0, run.ranks))
        else:
            infos.extend(file_steps(store))
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=1))
        return EXIT_OK
    if not infos:
        print("no checkpoints")
        return EXIT_OK
    _print_table([[i.tier, i.step, i.state, human_bytes(i.nbytes), "-" if i.age_s is None else f"{i.age_s:.0f}s",
                   i.files, _ranks(i.ranks)] for i in infos],
                 ["tier", "step", "state", "size", "age", "files", "ranks"])
    return EXIT_OK


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _pick_step(store: FileStore, step: int | None) -> int:
    steps = store.committed_steps()
    if not steps:
        raise NoCheckpointError(f"tier {store.name!r} holds no committed checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(f"tier {store.name!r} has no committed step {step} (committed: {steps})")
    return step


def _file_stores(stores: dict) -> list[FileStore]:
    out = [s for s in stores.values() if isinstance(s, FileStore)]
    if not out:
        raise ConfigError("no file tier to inspect (memory tiers are listed by `ls`)")
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    _, stores = _stores(args)
    store = _file_stores(stores)[0]
    step = _pick_step(store, args.step)
    m = store.read_manifest(step)
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"tier": store.name, **asdict(m)}, indent=1, default=str))
        return EXIT_OK
    p = m.parallel
    print(f"tier {store.name!r} ({store.tier.describe()}), step {m.step}, layout {m.layout}, run_id {m.run_id}")
    print(f"parallel: world {p.get('world_size')}  tp {p.get('tp')}  pp {p.get('pp')}  dp {p.get('dp')}  "
          f"ep {p.get('ep')}  cp {p.get('cp')}  order {p.get('order')}")
    print(f"{len(m.files)} files, {human_bytes(m.total_bytes)}")
    _print_table([[f.rank, f.item, f.key, human_bytes(f.size), f.compression or "-", f.checksum] for f in m.files],
                 ["rank", "item", "file", "size", "compression", "checksum"])
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .inventory import verify_step

    _, stores = _stores(args)
    results = []
    for store in _file_stores(stores):
        steps = store.committed_steps() if args.all else [_pick_step(store, args.step)]
        results.extend(verify_step(store, s, progress=sys.stderr.isatty() and not args.json) for s in steps)
    bad = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps([{"tier": r.tier, "step": r.step, "files": r.checked, "bytes": r.nbytes,
                           "ok": r.ok, "problems": r.problems} for r in results], indent=1))
    else:
        for r in results:
            status = "OK" if r.ok else "FAILED"
            print(f"{status}  tier {r.tier!r} step {r.step}: {r.checked} files, {human_bytes(r.nbytes)}")
            for p in r.problems:
                print(f"    {p}")
    return EXIT_FAILED if bad else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from .housekeeping import find_debris, find_stale_runs, remove_debris, remove_stale_run

    found: list[dict] = []
    if args.stale:
        for run in find_stale_runs(args.shm_path):
            found.append({"what": "stale run", **run.to_dict()})
            if args.delete:
                remove_stale_run(run)
    if args.target or args.config:
        _, stores = _stores(args)
        for store in stores.values():
            if isinstance(store, FileStore):
                debris = find_debris(store)
                found += [d.to_dict() for d in debris]
                if args.delete:
                    remove_debris(store, debris)
    elif not args.stale:
        raise ConfigError("give a checkpoint directory or URL, --config tiers.yaml, or --stale")
    if args.json:
        print(json.dumps({"deleted": args.delete, "found": found}, indent=1))
        return EXIT_OK
    verb = "removed" if args.delete else "would remove"
    for f in found:
        where = f.get("path") or f"tier {f['tier']!r}: {f['key']}"
        print(f"{verb}  {f['what']}  {where}  ({human_bytes(f['bytes'])})")
    if not found:
        print("nothing to remove")
    elif not args.delete:
        print("dry run: nothing was removed; add --delete to remove these")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from . import machine_bench as mb

    nbytes = args.size_mib << 20
    rows = [mb.copy_prefaulted(nbytes)]
    if os.path.isdir("/dev/shm"):
        rows.append(mb.fresh_shm_write(nbytes))
    stores = {}
    if args.config or args.target:
        _, stores = _stores(args)
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
        print(json.dumps([{**r.to_dict(), "vs_copy": round(r.gbps / ceiling, 3)} for r in rows], indent=1))
        return EXIT_OK
    _print_table([[r.what, f"{r.seconds:.3f}", f"{r.gbps:.2f}", f"{r.gbps / ceiling:.2f}"] for r in rows],
                 ["what", "seconds", "GB/s", "vs copy"])
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.run import run_demo

    return run_demo(args.workdir, world=args.world, steps=args.steps, remote=args.remote,
                    keep_files=not args.clean)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-ckpt", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Any, help: str, target: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if target:
            p.add_argument("target", nargs="?", help="a checkpoint directory or fsspec URL")
            p.add_argument("--config", "-c", help="a tiers.yaml: use its tiers")
            p.add_argument("--tier", help="only this tier of the configuration")
            p.add_argument("--layout", default="rank_sharded", choices=["rank_sharded", "megatron"],
                           help="layout of a bare directory (default: rank_sharded)")
        return p

    add("plugins", cmd_plugins, "list tier kinds, layouts and codecs with the plugin providing each", target=False)
    add("ls", cmd_ls, "list checkpoints per tier: committed or partial, size, age")
    p = add("inspect", cmd_inspect, "show a checkpoint's manifest: layout, parallel layout, files, checksums")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p = add("verify", cmd_verify, "re-hash every file against the manifest; exit 1 on any mismatch")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p.add_argument("--all", action="store_true", help="every committed step")
    p = add("gc", cmd_gc, "find debris (partial steps, temporary files) and dead runs' shared memory; "
                          "a dry run unless --delete")
    p.add_argument("--stale", action="store_true", help="also look for shared memory of runs with no live engine")
    p.add_argument("--shm-path", default="/dev/shm/tiered_ckpt", help="the shm tier's path (default: %(default)s)")
    p.add_argument("--delete", action="store_true", help="remove what is found (default: only list it)")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"tiered-ckpt {args.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NoCheckpointError as exc:
        print(f"tiered-ckpt {args.command}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except TieredCkptError as exc:
        print(f"tiered-ckpt {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
