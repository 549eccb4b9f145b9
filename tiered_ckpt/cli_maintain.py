"""The ``tiered-ckpt`` commands that clean up or measure: ``gc`` (debris and dead runs' shared memory; a dry run
unless ``--delete``), ``bench`` (this machine's and the tiers' throughput) and ``demo``.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import TYPE_CHECKING, Any

from .cli_common import (
    DEFAULT_SHM_PATH,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREADABLE,
    EXIT_USAGE,
    CommandError,
    Opened,
    _built_stores,
    _emit,
    _is_url,
    _open,
    _print_json,
    _print_table,
    _text,
    human_bytes,
    human_duration,
    step_directory_hint,
)
from .errors import ConfigError, TierError

if TYPE_CHECKING:
    from .housekeeping import StaleRun


def cmd_gc(args: argparse.Namespace) -> int:
    from .housekeeping import (
        LEFT_YOUNG,
        find_debris,
        find_stale_locks,
        find_stale_runs,
        find_unfinished_uploads,
        remove_stale_locks,
        remove_stale_run,
        run_state,
    )
    from .locking import shm_paths

    found: list[dict] = []
    left: list = []  # found and left (younger than --min-age, a step newer than every commit): said, not removed
    absent_shm: list[str] = []  # the configuration's shm paths that do not exist (yet)
    live_run = None  # the configuration's run, when an engine of it is live on this node
    opened = _open(args, memory=False) if args.target or args.config else None
    if opened is None and not args.stale:
        raise ConfigError("give a checkpoint directory or URL, --config tiers.yaml, or --stale")
    if args.stale:
        every_tier = None  # the configuration's file tiers, all of them, for what only shared memory holds
        if opened is not None and args.config:
            every_tier = _open(argparse.Namespace(**{**vars(args), "tier": None}), memory=False) if args.tier \
                else opened
        looked_in = []
        for shm_path in _shm_paths(args, opened):  # every path checked before anything is removed
            if not args.shm_path and not os.path.lexists(shm_path):  # where no engine has run yet (not a typo)
                absent_shm.append(shm_path)
            elif not os.path.isdir(shm_path):  # a typo must not read as "nothing to remove"
                origin = "--shm-path" if args.shm_path else f"{args.config}: shm tier path" if args.config else \
                    "the default shm path"
                raise CommandError(f"{origin} {shm_path}: no such directory (give the shm tier's path)",
                                   EXIT_NOT_FOUND)
            else:
                looked_in.append(shm_path)
        for shm_path in looked_in:
            for run in find_stale_runs(shm_path):
                entry = {"what": "stale run", **run.to_dict(), "undrained": None, "kept": False}
                undrained = _undrained(every_tier, run) if every_tier is not None else {}
                if undrained:
                    # Those snapshots are the only copy of their steps: the next engine of the run drains them.
                    entry["undrained"] = {"steps": sorted({s for v in undrained.values() for s in v}),
                                          "tiers": sorted(undrained)}
                    entry["kept"] = not args.force
                elif run.records and (every_tier is None or run.run_id != every_tier.config.run_id):
                    # another run's snapshots meant for file tiers: nothing here tells whether they got there
                    entry["unknown"] = sorted({m.step for m in run.records})
                found.append(entry)
                if args.delete and not entry.get("kept"):
                    remove_stale_run(run, shm_path)
        # Lock files with no shared memory beside them (a killed engine of a run without an shm tier, in $TMPDIR;
        # one killed before its first slot): nothing else ever removes them. --shm-path: only there.
        for locks in find_stale_locks(looked_in, tmpdir=not args.shm_path):
            entry = locks.to_dict()
            found.append(entry)
            if args.delete and not remove_stale_locks(locks):
                entry["error"] = "an engine took one of its lock files meanwhile, or the directory could not go"
    if opened is not None:
        live = bool(args.config) and run_state(opened.config.run_id, shm_paths(opened.config)) == "live"
        live_run = opened.config.run_id if live else None
        for name, store in opened.file_stores().items():
            try:
                debris = find_debris(store, live=live, min_age_s=args.min_age, left=left)
            except (TierError, OSError) as exc:
                opened.unreadable[name] = _text(exc)
                continue
            try:  # apart: a store that will not list its uploads (permissions) still has its other debris found
                debris += find_unfinished_uploads(store, live=live, min_age_s=args.min_age, left=left)
            except (TierError, OSError) as exc:
                opened.unreadable[name] = ("its unfinished uploads could not be listed, so none of them is reported "
                                           "(on S3 that needs the s3:ListBucketMultipartUploads and "
                                           f"s3:ListMultipartUploadParts permissions): {_text(exc)}")
            found += _removed(args, opened, name, store, debris)
        # A prefix holding no object may still hold the uploads of a save killed there (after its objects were
        # deleted, say): invisible, billed, and found only this way.
        for name, backend in opened.empty.items():
            store = backend.files()
            try:
                debris = find_unfinished_uploads(store, live=live, min_age_s=args.min_age, left=left) \
                    if store else []
            except (TierError, OSError):
                debris = []  # nothing stored, and nothing more to say than that
            if debris or any(d.tier == name for d in left):
                del opened.absent[name]
                found += _removed(args, opened, name, store, debris)
        opened.notes(args)
    problem = opened.problem(True, "") if opened is not None else None
    verb = "removed" if args.delete else "would remove"

    def text() -> None:
        for f in found:
            if f["what"] == "stale run":
                steps = f", steps {', '.join(map(str, f['steps']))}" if f["steps"] else ""
                un = f.get("undrained")
                print(f"{'kept' if f.get('kept') else verb}  shared memory of run {f['run_id']!r} ({f['state']}"
                      f"{steps})  {f['path']}  ({human_bytes(f['bytes'])})")
                if un:
                    one = len(un["steps"]) == 1
                    which = f"step {un['steps'][0]} is" if one else f"steps {', '.join(map(str, un['steps']))} are"
                    them = "it" if one else "them"
                    lost = f"removing the run's memory loses {them}; --force removes it anyway" if f.get("kept") \
                        else "removed anyway (--force)"
                    print(f"      {which} not on {', '.join(map(repr, un['tiers']))} yet: the next engine of run "
                          f"{f['run_id']!r} drains {them}; {lost}")
                elif f.get("unknown"):
                    print(f"      whether step(s) {', '.join(map(str, f['unknown']))} reached a file tier is not "
                          f"known here (not this configuration's run): gc --config <run {f['run_id']!r}'s "
                          "configuration> --stale checks it and keeps what is only in memory")
            elif f["what"] == "stale locks":
                done = f"kept ({f['error']})" if f.get("error") else verb
                print(f"{done}  lock files of run {f['run_id']!r} ({f['state']}, no shared memory)  {f['path']}")
            else:
                done = "could not remove" if f.get("error") else verb
                print(f"{done}  {f['what']}  tier {f['tier']!r}: {f['key']}  ({_size(f['bytes'])})")
        for d in left:
            age = "age unknown" if d.age_s is None else f"changed {human_duration(d.age_s)} ago"
            why = "" if d.left == LEFT_YOUNG else ("; newer than every committed step: a save may be writing it, "
                                                  "and retention removes it once a step above it is committed")
            print(f"left  {d.what}  tier {d.tier!r}: {d.key}  ({_size(d.nbytes)}; {age}{why})")
        young = sum(d.left == LEFT_YOUNG for d in left)
        if young:
            print(f"{young} left: changed less than --min-age ({human_duration(args.min_age)}) ago, or whose age "
                  "cannot be told; a write may still be in flight there (once no save runs, --min-age 0 takes them "
                  "too)")
        if live_run is not None:
            print(f"run {live_run!r} has a live engine on this node: nothing on its file tiers is touched (its own "
                  "retention removes its debris after each commit)")
        if not found:
            if problem is None and not left and live_run is None:  # an unreadable or absent tier is not an empty one
                print("nothing to remove" + (f" (no shared memory at {', '.join(absent_shm)})" if absent_shm else "")
                      + (step_directory_hint(opened.target) if opened is not None and opened.target else ""))
        elif not args.delete and not all(f.get("kept") for f in found):
            print("dry run: nothing was removed; add --delete to remove these")

    payload = {"deleted": args.delete, "found": found, "left": [d.to_dict() for d in left], "live_run": live_run}
    return _emit(args, payload, problem, text, bool(found))


def _size(nbytes: int | None) -> str:
    return "size unknown" if nbytes is None else human_bytes(nbytes)


def parse_min_age(text: str) -> float:
    """``--min-age``'s value: seconds (any float: 90, 1e3, inf for a listing that never removes), or a number with
    a unit (s, m or min, h, d): 90s, 30m, 2h, 1.5d."""
    import argparse
    import math
    import re

    try:
        value = float(text)
    except ValueError:
        match = re.fullmatch(r"\s*([-+]?(?:\d+\.?\d*|\.\d+))\s*(s|m|min|h|d)\s*", text.lower())
        if match is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not an age: give seconds, or a number with s, m, h or d "
                                             "(e.g. 3600, 30m, 2h, 1d)") from None
        value = float(match[1]) * {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[match[2]]
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: give seconds, or a number with s, m, h or d "
                                         "(e.g. 3600, 30m, 2h, 1d)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an age cannot be negative (0 takes debris whatever its age)")
    return value


def _removed(args: argparse.Namespace, opened: Opened, name: str, store: Any, debris: list) -> list[dict]:
    """``debris`` as gc reports it, removed first with ``--delete``: what could not be removed is reported as
    found (not removed) and makes the tier's failure, naming the first error."""
    if not args.delete:
        return [d.to_dict() for d in debris]
    from .housekeeping import remove_debris

    _, failed = remove_debris(store, debris, min_age_s=args.min_age)
    errors = {id(d): _text(exc) for d, exc in failed}
    if failed:
        what, _ = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        rest = len(debris) - len(failed)
        done = f" ({rest} other{'s' if rest > 1 else ''} removed)" if rest else ""
        opened.unchanged[name] = f"could not remove {what.what} {what.key}{more}: {errors[id(what)]}{done}"
    return [{**d.to_dict(), **({"error": errors[id(d)]} if id(d) in errors else {})} for d in debris]


def _undrained(opened: Opened, run: StaleRun) -> dict[str, list[int]]:
    """Per file tier of the configuration (all of them, whatever ``--tier`` chose): the steps of ``run`` (this
    configuration's own run) newer than everything the tier has committed, i.e. held only in shared memory (as
    ``ls`` marks them); non-persistent snapshots, which no file tier takes, are not counted. A tier that cannot
    be read counts as lacking them: a failure must not look like a safe delete."""
    if run.run_id != opened.config.run_id:
        return {}
    from .snapshot_record import undrained_tiers

    def owed(name: str, committed: list[int] | None) -> list[int]:
        """The steps ``name`` lacks and was due to take (None: it could not be read, so it lacks them all)."""
        return sorted({m.step for m in run.records if name not in m.skipped
                       and (committed is None or undrained_tiers(m, {name: committed}))})

    out: dict[str, list[int]] = {}
    for name, store in opened.file_stores().items():
        try:
            committed: list[int] | None = store.committed_steps()
        except (TierError, OSError):
            committed = None
        missing = owed(name, committed)
        if missing:
            out[name] = missing
    for name in [*opened.absent, *opened.unreadable]:  # nothing there yet, or could not be read
        missing = owed(name, None)
        if missing:
            out[name] = missing
    return out


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
    if args.target and not _is_url(args.target) and not os.path.isdir(args.target.removeprefix("file://")):
        # a typo would be created, measured, left
        raise CommandError(f"{args.target}: no such directory (bench writes its test files into an existing one; "
                           "create it first)", EXIT_NOT_FOUND)
    rows = [mb.copy_prefaulted(nbytes)]
    if os.path.isdir("/dev/shm"):
        try:
            rows.append(mb.fresh_shm_write(nbytes))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            print(f"tiered-ckpt bench: skipped the first write into a fresh /dev/shm file: {exc.strerror}; "
                  f"give a smaller --size-mib, or a larger /dev/shm (docker run --shm-size, a pod's memory-backed "
                  f"emptyDir): an shm tier needs room for its slots there too", file=sys.stderr)
    stores: dict = {}
    if args.config or args.target:
        _, stores = _built_stores(args)
    for store in stores.values():
        path = getattr(store.tier.options, "path", None)
        if store.tier.kind == "local" and path:
            which = "the directory given" if args.target else f"the path of tier {store.name!r} in {args.config}"
            rows.append(_write_fsync(mb, nbytes, path, which))
    if not stores:
        rows.append(_write_fsync(mb, nbytes, os.getcwd(), "the current directory: no directory or --config given"))
    for store in stores.values():
        rows.extend(mb.tier_round_trip(store.tier, nbytes))
    ceiling = rows[0].gbps
    if args.json:
        _print_json([{**r.to_dict(), "vs_copy": round(r.gbps / ceiling, 3)} for r in rows])
        return EXIT_OK
    _print_table([[r.what, f"{r.seconds:.3f}", f"{r.gbps:.2f}", f"{r.gbps / ceiling:.2f}"] for r in rows],
                 ["what", "seconds", "GB/s", "vs copy"])
    return EXIT_OK


def _write_fsync(mb: Any, nbytes: int, directory: str, which: str) -> Any:
    """``mb.write_fsync``, its OSError (a directory this user cannot write, a read-only filesystem) told as what
    bench tried, where, and how to go on."""
    try:
        return mb.write_fsync(nbytes, directory)
    except OSError as exc:
        fix = ("; give a directory this user can write on a writable filesystem (tiered-ckpt bench DIR), or run "
               "bench from one" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "")
        raise CommandError(f"cannot write its {human_bytes(nbytes)} test file (to measure write+fsync) in {directory} "
                           f"({which}): {exc.strerror or exc}{fix}", EXIT_UNREADABLE) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.run import DemoFailed, WorkdirError, run_demo

    try:
        return run_demo(args.workdir, world=args.world, steps=args.steps, remote=args.remote,
                        keep_files=not args.clean, as_json=args.json)
    except WorkdirError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    except DemoFailed as exc:  # what the demo shows did not happen: a failed check, not a bug's exit 70
        raise CommandError(f"the demo failed: {exc}", EXIT_FAILED) from None
