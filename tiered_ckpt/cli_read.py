"""The ``tiered-ckpt`` commands that only read: ``plugins``, ``ls``, ``inspect``, ``verify``.

A tier whose directory does not exist is reported, never created, and lock files are only looked at.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import TYPE_CHECKING

from .cli_common import (
    EXIT_FAILED,
    EXIT_OK,
    CommandError,
    Opened,
    _emit,
    _file_tiers,
    _note,
    _open,
    _pick_step,
    _print_json,
    _print_table,
    _ranks,
    _text,
    human_bytes,
    human_duration,
    nested_checkpoints_hint,
    no_commit_message,
    step_directory_hint,
)
from .errors import CorruptionError, NoCheckpointError, TierError

if TYPE_CHECKING:
    from .file_store import FileStore


def cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import get_plugin_manager

    pm = get_plugin_manager()
    regs = pm.registries
    rows = []
    for what, reg in (("tier", regs.tiers), ("layout", regs.layouts), ("codec", regs.codecs)):
        for name, cls, provider in reg.items():
            rows.append({"type": what, "name": name, "provider": provider, "class": f"{cls.__module__}.{cls.__name__}"})
    for name, plugin in pm.observers():  # a plugin that only observes events registers nothing: shown here alone
        held = plugin if isinstance(plugin, type) or inspect.ismodule(plugin) else type(plugin)
        where = held.__name__ if inspect.ismodule(held) else f"{held.__module__}.{held.__qualname__}"
        rows.append({"type": "observer", "name": name, "provider": name, "class": where})
    if args.json:
        _print_json(rows)
    else:
        _print_table([[r["type"], r["name"], r["provider"], r["class"]] for r in rows],
                     ["type", "name", "provider", "class"])
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    from .inventory import UNREADABLE_MANIFEST, StepInfo, file_steps, memory_steps

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
        unread = [i for i in steps if i.state.startswith(UNREADABLE_MANIFEST)]
        if unread:  # listed, yet not known to hold anything: exit 4, as for a tier (an S3 user's trial: exit 0)
            opened.unreadable.setdefault(name, f"the manifest of step {unread[0].step} could not be read"
                                         + (f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""))
    # A file tier with nothing there (a bucket prefix never written, a directory not made yet) holds none of the
    # snapshots' steps: each is owed to it (an S3 user's trial: a snapshot never sent there was not said to be).
    committed.update({name: set() for name in opened.absent if name in opened.cfgs and name not in committed})
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
    nested = "" if infos or not opened.target else nested_checkpoints_hint(opened)
    problem = opened.problem(bool(infos), f"no checkpoints in {opened.target}{step_directory_hint(opened.target)}"
                             f"{nested}"
                             if opened.target else "no checkpoints on any tier")
    opened.notes(args)

    def text() -> None:
        _print_table([[i.tier, "-" if i.step is None else i.step, i.state, human_bytes(i.nbytes),
                       "-" if i.age_s is None else human_duration(i.age_s), i.files, _ranks(i.ranks)] for i in infos],
                     ["tier", "step", "state", "size", "age", "files", "ranks"])

    return _emit(args, [i.to_dict() for i in infos], problem, text if infos else lambda: None, bool(infos))


def _snapshot_rows(rows: list, run_id: str, committed: dict[str, set[int]], opened: Opened) -> list:
    """This run's snapshots, each with its run's state (:func:`~tiered_ckpt.housekeeping.run_state`: a live
    engine holds it; "closed": the engine closed; "stale": the process ended without ``close()``) and, with no
    live engine, the file tiers that never got it (the next engine of this run_id drains it there)."""
    from .housekeeping import run_state
    from .locking import shm_paths
    from .snapshot_record import undrained_tiers

    state = run_state(run_id, shm_paths(opened.config))
    for info in rows:
        memory_only = info.state == "snapshot (non-persistent)"  # saved for memory tiers only: never drained
        if state == "live":
            info.state = "snapshot (live engine" + ("; non-persistent)" if memory_only else ")")
            continue
        what = "closed" if state == "closed" else "stale: its process ended without close()"
        owed = {name for meta in info.snapshots for name in undrained_tiers(meta, committed)}
        missing = [name for name in committed if name in owed]
        if memory_only:
            info.state = f"snapshot ({what}; non-persistent: memory only, no file tier takes it)"
        elif missing:
            info.state = (f"snapshot ({what}; not on {', '.join(map(repr, missing))}: the next engine of run "
                          f"{run_id!r} drains it)")
        elif committed and not opened.unreadable and not opened.absent:
            skipped = any(info.step not in steps for steps in committed.values())  # by their `every`, or newer
            info.state = f"snapshot ({what}; on every file tier{' its save was due on' if skipped else ''})"
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


def cmd_inspect(args: argparse.Namespace) -> int:
    opened = _open(args, memory=False)
    stores = _file_tiers(opened)
    opened.notes(args)
    if len(stores) == 1 and not opened.unreadable:  # (one not read may hold it: _holding_tier says so, exit 4)
        name, store = next(iter(stores.items()))
        if (plain := _inspect_dcp(store, args)) is not None:  # a DCP directory without our manifest (issue #14)
            return plain
        step = _pick_step(store, args.step, opened.label(name))
    else:
        store, step = _holding_tier(opened, stores, args.step)
    try:
        m = store.read_manifest(step)
    except CorruptionError as exc:  # the newest step's manifest damaged: the others may be fine
        try:
            older = [s for s in store.committed_steps() if s != step]
        except (TierError, OSError):  # the damage found is what to report
            older = []
        shown = ", ".join(map(str, older[-8:]))
        hint = f"; the other committed steps: {shown} (inspect one with --step N)" if older else ""
        raise CommandError(f"{exc}{hint}; `tiered-ckpt verify` checks the step's files", EXIT_FAILED) from None
    from dataclasses import asdict

    def text() -> None:
        p = m.parallel
        print(f"tier {store.name!r} ({store.tier.describe()}), step {m.step}, layout {m.layout}, run_id {m.run_id}")
        print(f"parallel: world {p.get('world_size')}  tp {p.get('tp')}  pp {p.get('pp')}  dp {p.get('dp')}  "
              f"ep {p.get('ep')}  cp {p.get('cp')}  order {p.get('order')}")
        print(f"{len(m.files)} file{'' if len(m.files) == 1 else 's'}, {human_bytes(m.total_bytes)}")
        _print_table([[f.rank, f.item, f.key, human_bytes(f.size), f.compression or "-", f.checksum]
                      for f in m.files], ["rank", "item", "file", "size", "compression", "checksum"])

    # a tier that could not be listed may hold a newer step: shown, and exit 4 (as ls does)
    return _emit(args, {"tier": store.name, **asdict(m)}, opened.problem(True, ""), text, True)


def _holding_tier(opened: Opened, stores: dict[str, FileStore], step: int | None) -> tuple[FileStore, int]:
    """``inspect --config``: the fastest tier holding ``step`` (default: the newest step any tier holds, which
    ``load()`` would take), as load() looks (an S3 user's trial: only the first file tier was looked at, and an
    empty local directory on a new node read as "no checkpoint" while S3 held steps)."""
    held: dict[str, list[int]] = {}
    for name, store in stores.items():
        try:
            held[name] = store.committed_steps()
        except (TierError, OSError) as exc:
            opened.unreadable[name] = _text(exc)
    every = sorted({s for steps in held.values() for s in steps})
    want = every[-1] if step is None and every else step
    for name, steps in held.items():
        if want in steps:
            return stores[name], want
    what = f"no tier holds committed step {step} (committed: {every})" if step is not None and every else \
        "no tier holds a committed checkpoint"
    problem = opened.problem(False, what)
    assert problem is not None
    raise problem


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


def _steps_to_verify(store: FileStore, args: argparse.Namespace, label: str) -> tuple[list[int], list[int]]:
    """The committed steps of ours to verify, and the steps Megatron-LM wrote (no manifest) to check as far as
    their files allow: ``--all`` both kinds; ``--step N`` that step, whichever kind; else the newest committed
    step of ours, or without one the step Megatron-LM's tracker names (the one ``load()`` reads; a newer
    directory may be a save Megatron-LM never finished), else the newest it wrote."""
    from .inventory import foreign_megatron_steps

    committed = store.committed_steps()
    if args.step is None and committed and not args.all:
        return committed[-1:], []
    if args.step in committed and not args.all:
        return [args.step], []
    # Megatron-LM's steps are looked for (a listing more) only where ours do not answer already
    foreign = [s for s in foreign_megatron_steps(store) if s not in committed]
    if args.all:
        return committed, foreign
    if args.step is not None and args.step in foreign:
        return [], [args.step]
    if args.step is None and foreign:
        tracked = store.legacy_step()
        return [], [tracked] if tracked in foreign else foreign[-1:]
    return [_pick_step(store, args.step, label)], []  # none: its message says what is there


def cmd_verify(args: argparse.Namespace) -> int:
    from .inventory import verify_foreign_step, verify_step

    opened = _open(args, memory=False)
    stores = _file_tiers(opened)
    opened.notes(args)
    for name in opened.memory_skipped:  # said, so that a skipped tier never looks verified
        _note(args, f"tier {name!r} holds memory snapshots, which this command does not verify: load() checks "
                    "each one against its checksums before using it, and falls back to the next tier if it fails")
    results, empty = [], []
    for name, store in stores.items():
        try:
            steps, foreign = _steps_to_verify(store, args, opened.label(name))
        except NoCheckpointError as exc:
            empty.append(str(exc))
            continue
        except (TierError, OSError) as exc:
            opened.unreadable[name] = _text(exc)
            continue
        if not steps and not foreign:
            empty.append(no_commit_message(store, opened.label(name)))
            continue
        progress = sys.stderr.isatty() and not args.json
        results.extend(verify_step(store, s, progress=progress) for s in steps)
        results.extend(verify_foreign_step(store, s, progress=progress) for s in foreign)
    if len(stores) > 1:
        for text in empty:
            _note(args, text)
    bad = [r for r in results if r.problems]  # damage found
    for r in results:  # what could not be read is no damage, and no pass either: exit 4, as for a tier
        if r.unread and not r.problems:
            opened.unreadable.setdefault(r.tier, f"step {r.step}: {r.unread[0]}"
                                         + (f" (and {len(r.unread) - 1} more)" if len(r.unread) > 1 else ""))
    payload = [{"tier": r.tier, "step": r.step, "files": r.checked, "bytes": r.nbytes, "ok": r.ok,
                "status": r.status, "problems": r.problems, "unread": r.unread, "checked_against": r.against,
                **({"notes": r.notes} if r.notes else {})}
               for r in results]
    problem = None if bad else opened.problem(bool(results), "; ".join(empty) or "no committed checkpoint")

    def text() -> None:
        for r in results:
            against = "" if r.against == "manifest" else f"; checked against {r.against}"
            print(f"{r.status}  tier {r.tier!r} step {r.step}: {r.checked} file{'' if r.checked == 1 else 's'}, "
                  f"{human_bytes(r.nbytes)}{against}")
            for p in [*r.problems, *r.unread]:
                print(f"    {p}")
            for n in r.notes:
                print(f"    note: {n}")

    code = _emit(args, payload, problem, text, bool(results))
    return EXIT_FAILED if bad else code
