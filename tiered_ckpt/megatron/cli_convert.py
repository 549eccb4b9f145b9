"""``tiered-ckpt convert SRC DST --to megatron|rank_sharded [--dp N] [--step N] [--json]``.

Exit codes are the CLI's (``tiered_ckpt.cli``): 0 converted; 1 the source failed verification or cannot be
converted (corrupt file, layout mismatch, unsafe pickle); 2 bad usage (unknown layout, bad DP, destination not
empty); 3 no checkpoint at the source (no such directory, no tracker and no step, missing step directory); 4 a
tier could not be read or written (unreachable, permission denied). With ``--json`` a failure is
``{"error": ..., "exit_code": N}`` on stdout.

``--storage-option KEY=VALUE`` and ``--endpoint-url`` apply to SRC and DST when they are URLs.

Between Megatron's ``torch`` and ``torch_dist`` formats nothing is converted here (:data:`TORCH_DIST_HELP` says
why and what to do instead).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

TORCH_DIST_HELP = (
    "convert works on Megatron's legacy torch format only (layouts megatron and rank_sharded). A torch_dist "
    "checkpoint cannot be made from a torch one, or the reverse, without the model: torch_dist keys and shards "
    "every tensor by the model's sharded_state_dict() (its names, TP/PP splits, the optimizer's sharding type), which "
    "the files do not hold; Megatron's own converter builds the model for the same reason. Instead load the "
    "checkpoint in the job through the adapter with its format (args.ckpt_format) and save it once with the other "
    "(a torch_dist engine needs layout: dcp). A torch_dist checkpoint needs no conversion for another TP/PP/DP: "
    "Megatron's dist_checkpointing.load and the adapter reshard it at load (the distributed optimizer across TP/PP "
    "only if it was saved with --dist-ckpt-optim-fully-reshardable).")


def _target(text: str, name: str, options: dict[str, Any]) -> Any:
    """``text`` itself, or for a URL with storage options from the command line, a tier built with them."""
    from ..cli_common import _is_url

    if not options or not _is_url(text):
        return text
    from ..config import load_config
    from ..plugins import get_plugin_manager
    from ..tiers.base import TierContext

    pm = get_plugin_manager()
    cfg = load_config({"tiers": [{"name": name, "kind": "fsspec", "url": text, "options": options}]},
                      registries=pm.registries).tiers[0]
    return pm.registries.tiers.get(cfg.kind)(name, cfg.options, TierContext())


def cmd_convert(args: argparse.Namespace) -> int:
    from ..cli_common import storage_options
    from ..errors import ConfigError, DecodeError
    from .convert import convert

    if args.to == "torch_dist":
        raise ConfigError(f"--to torch_dist: {TORCH_DIST_HELP}", key_path="to")
    options = storage_options(args.storage_option, args.endpoint_url)
    try:
        report = convert(_target(args.src, "source", options), _target(args.dst, "destination", options),
                         to=args.to, dp=args.dp, step=args.step, progress=not args.json,
                         trust_pickles=args.trust_pickles)
    except DecodeError as exc:
        if "torch_dist" not in str(exc):
            raise
        raise DecodeError(f"{exc}. {TORCH_DIST_HELP}") from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
        return 0
    s, t = report.source_topology, report.topology
    print(f"converted step {report.step}: {report.src} ({report.source_layout}, written by {report.source_writer}) "
          f"-> {report.dst} ({report.to})")
    print(f"  TP {t['tp']}  PP {t['pp']}  EP {t['ep']}  DP {s['dp'] * s['ep']} -> {t['dp'] * t['ep']}"
          f"  ({len(report.files)} files, {report.bytes_written} bytes, {report.seconds:.1f} s)")
    print("  source " + {"manifest": "verified against its manifest",
                         "zip CRC-32s": "checked against its files' zip CRC-32s (no manifest: a file missing "
                                        "altogether would not be seen)"}.get(report.source_checked,
                                                                             "NOT verified: it has no checksums"))
    for note in report.notes:
        print(f"  note: {note}")
    return 0


def add_convert_command(sub: Any, add: Any) -> argparse.ArgumentParser:
    """Register ``convert`` with the CLI's ``add(name, func, help, target=False)`` helper."""
    from ..cli_common import add_storage_flags

    p = add("convert", cmd_convert, "convert a Megatron checkpoint (legacy torch format) between the megatron and "
                                    "rank_sharded layouts, or re-split it for another DP size; torch <-> torch_dist "
                                    "needs the model (--to torch_dist says why and what to do)", target=False)
    p.add_argument("src", help="the source: a directory or fsspec URL holding Megatron's tracker and iter_* dirs")
    p.add_argument("dst", help="where to write (a directory or fsspec URL; must not hold the step yet)")
    p.add_argument("--to", required=True, choices=["megatron", "rank_sharded", "torch_dist"],
                   help="the destination's layout; torch_dist is refused with what to do instead (it needs the model)")
    p.add_argument("--dp", type=int, help="data-parallel size of the destination (world / (TP x PP x CP), as "
                                          "Megatron counts it; default: the source's)")
    p.add_argument("--step", type=int, help="the iteration to convert (default: the source's tracker)")
    p.add_argument("--trust-pickles", action="store_true",
                   help="allow pickled classes outside Megatron's allow-list in the source (trusted files only)")
    add_storage_flags(p)
    return p
