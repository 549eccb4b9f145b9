"""The frame of every rank script in the multi-rank tests: join the gloo job, run the body, print one JSON line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from tiered_ckpt.errors import TieredCkptError


def rank_main(body: Callable[[int, int, dict, dict], None]) -> None:
    """``body(rank, world, spec, out)`` fills ``out``; our own errors are reported in it as ``error``."""
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
