"""The ``tiered-ckpt`` command line.

Exit codes: 0 success; 1 a check failed (verify found a mismatch, a checkpoint cannot be converted); 2 bad usage
or configuration; 3 nothing found (no such directory, bucket, step or checkpoint); 4 a tier could not be read
(unreachable, permission denied, no credentials: nothing can be said about what it holds); 70 an error nobody
expected (a bug, or a plugin's own exception: the traceback is on stderr); 130 interrupted
(Ctrl-C); 141 the reader of the output went away (``| head``). With ``--json`` a failure is a JSON object on
stdout, ``{"error": ..., "exit_code": N}``, instead of a message on stderr.

``ls``, ``inspect``, ``verify`` and ``gc`` (without ``--delete``) only read: a tier whose directory does not
exist is reported, never created, and lock files are only looked at.

Only the standard library is imported at start-up: ``--help`` and argument errors never load torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from typing import Any

from .cli_common import (  # noqa: F401  (the names tests and scripts import from tiered_ckpt.cli)
    DEFAULT_SHM_PATH,
    DESCRIPTION,
    EPILOG,
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREADABLE,
    EXIT_USAGE,
    CommandError,
    _config_for_target,
    _Parser,
    _print_json,
    add_storage_flags,
    human_bytes,
    int_at_least,
    set_json_errors,
    storage_options,
)
from .cli_maintain import cmd_bench, cmd_demo, cmd_gc, parse_min_age
from .cli_read import cmd_inspect, cmd_ls, cmd_plugins, cmd_verify
from .demo import SAVE_EVERY, min_steps
from .errors import (
    BlobNotFoundError,
    ConfigError,
    NoCheckpointError,
    PluginError,
    TieredCkptError,
    TierError,
    TierUnavailableError,
)

DEMO_MIN_STEPS = min_steps(SAVE_EVERY)
DEMO_STEPS_WHY = (f" (the demo saves every {SAVE_EVERY} steps and kills a rank at step steps*3//4+1, which must come "
                  "after a save for the job to resume)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiered-ckpt", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (errors too); before or after "
                        "the command")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Any, help: str, target: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG)
        p.set_defaults(func=func)
        # SUPPRESS: absent here, the top level's --json stands (`tiered-ckpt --json ls` as `tiered-ckpt ls --json`)
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="machine-readable output (errors too)")
        if target:
            p.add_argument("target", nargs="?", help="a checkpoint directory or fsspec URL")
            p.add_argument("--config", "-c", help="a tiers.yaml: use its tiers")
            p.add_argument("--tier", help="only this tier of the configuration")
            # any registered layout (plugins' too): the configuration check names the known ones on a typo
            p.add_argument("--layout",
                           help="layout of a bare directory: rank_sharded (default), megatron, dcp or a plugin's")
            add_storage_flags(p)
        return p

    add("plugins", cmd_plugins, "list tier kinds, layouts and codecs with the plugin providing each", target=False)
    add("ls", cmd_ls, "list checkpoints per tier: committed or partial, size, age; shared memory of runs "
                      "(live, closed or stale). Reads only")
    p = add("inspect", cmd_inspect, "show a checkpoint's manifest: layout, parallel layout, files, checksums")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p = add("verify", cmd_verify, "re-hash every file against the manifest; exit 1 on any mismatch")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="default: the newest committed step")
    which.add_argument("--all", action="store_true", help="every committed step")
    p = add("gc", cmd_gc, "find debris (partial steps, temporary files, an object store's unfinished uploads) and "
                          "dead runs' shared memory; a dry run unless --delete")
    p.add_argument("--stale", action="store_true", help="also look for shared memory of runs with no live engine")
    p.add_argument("--shm-path", help=f"the shm tier's path (default: the configuration's shm tiers, else "
                                      f"{DEFAULT_SHM_PATH})")
    p.add_argument("--delete", action="store_true", help="remove what is found (default: only list it)")
    p.add_argument("--force", action="store_true", help="with --stale --config: also remove stale runs whose shared "
                   "memory holds steps that no file tier of the configuration has yet (their only copy); this "
                   "applies to every stale run under the shm path, not only the configuration's run_id")
    p.add_argument("--min-age", type=parse_min_age, default=3600.0, metavar="AGE", help="leave temporary files, "
                   "partial steps and unfinished uploads modified less than this long ago: writes in flight; "
                   "seconds, or with a unit: 30m, 2h, 1d; inf lists without removing (default: 1h)")
    p = add("demo", cmd_demo, "train a small GPT on 4 ranks, checkpoint through shm, local and remote tiers, kill a "
                              "rank, resume, and check the resumed run matches an uninterrupted one", target=False)
    p.add_argument("--workdir", default="demo-run", help="where the demo writes (default: %(default)s): a new or "
                   "empty directory, or one an earlier demo wrote, which it empties first; any other is refused")
    p.add_argument("--remote", help="the remote tier's URL (default: a file:// folder in the workdir)")
    p.add_argument("--world", type=int_at_least(1), default=4, help="ranks, 1 or more (default: %(default)s)")
    p.add_argument("--steps", type=int_at_least(DEMO_MIN_STEPS, DEMO_STEPS_WHY), default=30,
                   help=f"training steps, {DEMO_MIN_STEPS} or more (default: %(default)s)")
    p.add_argument("--clean", action="store_true",
                   help="remove what the demo wrote afterwards (and the workdir, if the demo made it)")
    p = add("bench", cmd_bench, "this machine's memcpy, shm and disk bandwidth, and each configured tier's "
                                "write and read throughput against them")
    p.add_argument("--size-mib", type=int_at_least(1), default=256,
                   help="MiB moved per measurement, 1 or more (default: %(default)s)")
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
    except PluginError as exc:  # an installed plugin is broken: no command can trust the registries (not "failed")
        return _failure(args, f"plugin error: {exc}", EXIT_USAGE)
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
    except Exception as exc:  # noqa: BLE001 - any other: a bug, or a plugin tier's own exception (not TierError)
        # The traceback says where; the exit status must not read as "a check failed" (1, Python's default), and
        # --json still gets its error object (a plugin author's trial: sqlite3.DatabaseError from a plugin tier).
        traceback.print_exc(file=sys.stderr)
        return _failure(args, f"internal error: {type(exc).__name__}: {exc} (a bug in tiered_ckpt or in a plugin "
                              "the traceback above names; a plugin tier should raise TierError for its store's "
                              "errors: docs/plugins.md)", EXIT_INTERNAL)


def _import_torch_without_sigint() -> None:
    """Import torch with SIGINT blocked, so that the native thread it starts never takes a Ctrl-C: the kernel hands
    a process-wide signal to any thread that does not block it, only the main thread turns it into
    KeyboardInterrupt, and a main thread blocked in a read (a FIFO, a hung mount) would then never see it. A Ctrl-C
    during the import stays pending and is raised when the mask is restored."""
    if "torch" in sys.modules or not hasattr(signal, "pthread_sigmask"):
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    set_json_errors("--json" in argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        try:
            _import_torch_without_sigint()
            return _run(args)
        except KeyboardInterrupt:
            if getattr(args, "json", False):  # a script reading stdout gets the failure it was promised
                _print_json({"error": "interrupted", "exit_code": EXIT_INTERRUPTED})
                sys.stdout.flush()
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
