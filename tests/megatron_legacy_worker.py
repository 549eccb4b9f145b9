"""One rank loading a checkpoint Megatron-LM wrote itself (tests/test_megatron_engine.py)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from megatron_worker import digest  # noqa: E402

from tiered_ckpt import CheckpointEngine, ParallelLayout  # noqa: E402
from tiered_ckpt.errors import TieredCkptError  # noqa: E402
from tiered_ckpt.megatron import rank_shard  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out: dict = {"rank": rank}
    try:
        with CheckpointEngine(spec["config"], ParallelLayout(dp=world)) as engine:
            loaded = engine.load()
            shard = rank_shard.parse(loaded.items["distrib_optim"], where=f"rank {rank}")
            out.update(step=loaded.step, verified=loaded.verified, shards=digest(shard.optimizers[0].shards))
    except TieredCkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
