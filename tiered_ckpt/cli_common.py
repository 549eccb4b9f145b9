"""What every ``tiered-ckpt`` command shares: exit codes, output (JSON or a table), the configuration a target
names, the tiers it opens, and the storage flags of URL targets. The commands are in :mod:`.cli_read` (``plugins``,
``ls``, ``inspect``, ``verify``), :mod:`.cli_maintain` (``gc``, ``bench``, ``demo``) and
:mod:`.megatron.cli_convert` (``convert``); the parser and ``main`` in :mod:`.cli`.

Only the standard library is imported at start-up: ``--help`` and argument errors never load torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    NoCheckpointError,
    TierError,
)

if TYPE_CHECKING:
    from .config import Config, TierConfig
    from .file_store import FileStore
    from .store import Store

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNREADABLE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away
EXIT_INTERNAL = 70  # EX_SOFTWARE: an exception nobody expected (a bug here, or a plugin's own error): never 1

DESCRIPTION = "List, inspect, verify, convert and clean up tiered_ckpt checkpoints on any tier."
EPILOG = ("exit status: 0 success, 1 a check failed, 2 bad usage or configuration, 3 nothing found, 4 a tier "
          "could not be read, 70 an error nobody expected (a bug, or a plugin's own exception), 130 interrupted "
          "(Ctrl-C), 141 the reader of the output went away (| head). With --json, a failure prints "
          "{\"error\": ..., \"exit_code\": N} on stdout.")
# The shm tier's default path (tiers/shm.py ShmOptions.path), spelled here so that start-up stays stdlib-only;
# tests/test_cli.py holds the two equal.
DEFAULT_SHM_PATH = "/dev/shm/tiered_ckpt"
_json_errors = False  # set by the CLI's main() (set_json_errors): argument errors as JSON too when --json was given


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


def int_at_least(minimum: int, why: str = "") -> Any:
    """An argparse ``type``: a whole number of at least ``minimum``; a smaller one is a usage error (exit 2) naming
    the allowed range (and ``why``, when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more{why}, got {value}")
        return value

    return parse


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


def human_duration(seconds: float) -> str:
    """``seconds`` as a person reads it: 45 s, 12 min, 3.5 h, 2 d, inf."""
    if seconds == float("inf"):
        return "inf"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.1f}".removesuffix(".0") + f" {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{seconds:.0f} s"


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
        if getattr(args, "layout", None):
            raise ConfigError(f"--layout {args.layout} is for a bare directory or URL; with --config the "
                              "configuration's `layout` is used")
        if getattr(args, "target", None):
            raise ConfigError(f"give a checkpoint directory or URL, or --config, not both ({args.target!r} and "
                              f"--config {args.config})")
        config = load_config(args.config, registries=get_plugin_manager().registries)
        return _with_storage_options(config, options) if options else config
    if getattr(args, "target", None):
        return _config_for_target(args.target, getattr(args, "layout", None) or "rank_sharded", options)
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
    # Absent tiers that could still be built (an object-store prefix with no object): gc asks them for uploads.
    empty: dict[str, Store] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # tiers that could not be read: why
    unchanged: dict[str, str] = field(default_factory=dict)  # tiers where a removal (gc --delete) failed: why
    memory_skipped: list[str] = field(default_factory=list)  # selected shm-like tiers left closed (memory=False)

    def label(self, name: str) -> str:
        return self.target if self.target is not None else f"tier {name!r}"

    def file_stores(self) -> dict[str, FileStore]:
        return {n: files for n, s in self.stores.items() if (files := s.files()) is not None}

    def problem(self, found: bool, nothing: str) -> CommandError | None:
        """The command's failure, if any: a tier could not be read (4), or nothing was found (3): because the
        directory or bucket given does not exist, or because ``nothing``."""
        if self.unreadable or self.unchanged:
            told = []
            if self.unreadable:
                why = "; ".join(f"{self.label(n)}: {_unprefixed(w, n)}" for n, w in self.unreadable.items())
                told.append(f"could not read {why} (nothing can be said about what it holds)")
            if self.unchanged:
                told.append("; ".join(f"{self.label(n)}: {w}" for n, w in self.unchanged.items()))
            extra = {k: dict(v) for k, v in (("unreadable", self.unreadable), ("unchanged", self.unchanged)) if v}
            return CommandError("; ".join(told), EXIT_UNREADABLE, **extra)
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


def _unprefixed(text: str, tier: str) -> str:
    """``text`` (a tier error's) without the "tier 'x'" it starts with, which the label before it says already
    ("could not read tier 'db': tier 'db': ..." read twice: a trial)."""
    for head in (f"tier {tier!r}: ", f"tier {tier!r}, "):
        if text.startswith(head):
            return text[len(head):]
    return text


def step_directory_hint(target: str) -> str:
    """When ``target`` names one step's directory (``iter_0000010``) rather than the checkpoint directory above
    it, the advice to give its parent (commands look for ``iter_*`` directories in the directory given)."""
    from .layouts.base import Layout

    parent, _, name = target.rstrip("/").rpartition("/")
    if Layout().parse_step_dir(name) is None:
        return ""
    return (f": {target} is one step's directory; give its parent, {parent or '.'}, the directory that holds the "
            "iter_* directories")


def nested_checkpoints_hint(opened: Opened) -> str:
    """When the directory or bucket given holds no step directory of its own but checkpoints one or more levels
    down (``s3://bucket`` whose runs are under prefixes), the advice to give one of those (an S3 user's trial:
    "no checkpoints", exit 3, and no word of the runs there)."""
    from .layouts.base import Layout

    parse = Layout().parse_step_dir
    found: list[str] = []
    for store in opened.file_stores().values():
        try:
            keys = store.tier.list("")
        except (TierError, OSError):
            continue
        for key in keys:
            parts = key.split("/")
            at = next((i for i, part in enumerate(parts[1:-1], 1) if parse(part) is not None), None)
            if at is not None and (where := "/".join(parts[:at])) not in found:
                found.append(where)
    if not found or opened.target is None:
        return ""
    base = opened.target.rstrip("/")
    shown = ", ".join(f"{base}/{d}" for d in found[:4]) + (f" (and {len(found) - 4} more)" if len(found) > 4 else "")
    return f"; it holds checkpoints one level down or more: {shown}: give one of those"


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
    for index, cfg in enumerate(config.tiers):
        if cfg.name not in names:
            continue
        cls = pm.registries.tiers.get(cfg.kind)
        caps = cls.capabilities_for(cfg.options)
        is_memory = caps.memory
        if is_memory and not caps.survives_process:
            continue  # a process's own memory (gpu, or a plugin's like it): nothing to see from here
        if is_memory and not memory:
            opened.memory_skipped.append(cfg.name)  # snapshots that outlive a process, not asked for here
            continue
        opened.cfgs[cfg.name] = cfg
        store = None
        try:
            where_set = f"{config.source or 'the configuration'}: tiers[{index}].path" if args.config else None
            why = absent_before_open(cfg, config.run_id, user, where_set)
            if why is None:
                store = build_stores(config, pm, RankCoords(rank=0), 0, [cfg.name], lambda e: None)[cfg.name]
                why = absent_location(store.tier)
                url = getattr(store.tier.options, "url", None)
                if why == "no such directory" and args.config and isinstance(url, str):  # say which, as for paths
                    why = f"no such directory ({store.tier.describe()})"
        except Unreadable as exc:
            opened.unreadable[cfg.name] = str(exc)
            continue
        except (TierError, OSError) as exc:
            opened.unreadable[cfg.name] = _text(exc)
            continue
        if why is not None:
            if not is_memory:
                opened.absent[cfg.name] = why
                if store is not None:
                    opened.empty[cfg.name] = store
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


def set_json_errors(on: bool) -> None:
    """Argument errors as a JSON object on stdout (``--json`` was given) instead of argparse's message."""
    global _json_errors
    _json_errors = on


def add_storage_flags(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--endpoint-url`` for URL tiers."""
    p.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE",
                   help="an fsspec storage option for URLs (repeatable), e.g. -o anon=true, "
                        "-o client_kwargs.region_name=eu-west-1; VALUE is JSON when it parses as JSON, else text")
    p.add_argument("--endpoint-url", metavar="URL",
                   help="the object store's endpoint, e.g. http://localhost:9000 (MinIO); the same as "
                        "-o endpoint_url=URL")


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def no_commit_message(store: FileStore, label: str) -> str:
    """Why ``label`` has nothing to verify or inspect: no committed checkpoint, and which steps there another
    program wrote (they exist, but carry no checksums of ours)."""
    from .layouts.foreign import MEGATRON_STATE, foreign_step_dirs

    try:
        foreign = foreign_step_dirs(store.tier.list(""), store.tier)
    except (TierError, OSError):
        foreign = {}
    steps = sorted((n, state) for d, state in foreign.items() if (n := store.layout.parse_step_dir(d)) is not None)
    if not steps:
        return f"{label} holds no committed checkpoint{step_directory_hint(label)}"
    megatron = [n for n, state in steps if state == MEGATRON_STATE]
    others = [n for n, state in steps if state != MEGATRON_STATE]
    parts = []
    if megatron:
        parts.append(f"step(s) {', '.join(map(str, megatron))} written by Megatron-LM or DLRover (engine.load() "
                     "and convert read them; `verify` checks their files' zip CRC-32s)")
    if others:
        parts.append(f"step(s) {', '.join(map(str, others))} written by DCP (DCP's own reader and "
                     "tiered_ckpt.dcp.TieredStorageReader read them, unverified)")
    return (f"{label} holds no committed checkpoint of tiered_ckpt, only {' and '.join(parts)}, with no manifest of "
            "ours; `ls` lists them")


def _pick_step(store: FileStore, step: int | None, label: str) -> int:
    steps = store.committed_steps()
    if not steps:
        raise NoCheckpointError(no_commit_message(store, label))
    if step is None:
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(f"{label} has no committed step {step} (committed: {steps})")
    return step


def _file_tiers(opened: Opened) -> dict[str, FileStore]:
    stores = opened.file_stores()
    if not stores:
        nothing = "no file tier holds anything yet" if opened.absent else \
            "no file tier to look at (memory tiers are listed by `ls`)"
        problem = opened.problem(False, nothing)
        assert problem is not None
        raise problem
    return stores
