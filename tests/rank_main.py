"""The frame of every rank script in the multi-rank tests: join the gloo job, run the body, print one JSON line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from tiered_ckpt.errors import TieredCkptError


def rank_main(body: Callable[[int, int, dict, dict], None], *, exit_at_once: bool = False) -> None:
    """``body(rank, world, spec, out)`` fills ``out``; our own errors are reported in it as ``error``.

    ``exit_at_once``: leave with ``os._exit(0)`` once the result is printed and the process group destroyed, for
    ranks that used DTensor (FSDP2, DCP). torch 2.13's DTensor caches (DTensorSpec, the redistribute planners)
    keep the DeviceMesh, and through it the gloo process group, alive past ``destroy_process_group()``: its worker
    threads (``pt_gloo_runloop``) are still running when the interpreter tears down, which aborted such a rank
    now and then ("terminate called without an active exception", or SIGSEGV) after it had printed its result.
    Ranks that do not use DTensor end every gloo thread in ``destroy_process_group()`` and exit normally, so an
    exit our own threads would hold up still shows there."""
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out: dict = {"rank": rank}
    try:
        body(rank, world, spec, out)
    except TieredCkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    if exit_at_once:
        sys.stderr.flush()
        os._exit(0)
