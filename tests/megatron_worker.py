"""One rank of a Megatron-shaped job in tests/test_megatron_engine.py (started through test_multirank.run_ranks)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import TieredCkptError
from tiered_ckpt.megatron import rank_shard
from tiered_ckpt.megatron.synthetic import SyntheticJob


def digest(shards: dict) -> dict[str, str]:
    return {k: hashlib.sha256(torch.as_tensor(v).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sorted(shards.items())}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    job = SyntheticJob(**spec["job"])
    out: dict = {"rank": rank}
    try:
        with CheckpointEngine(spec["config"], job.parallel) as engine:
            if spec["mode"] == "save":
                engine.save(job.iteration, job.rank_items(rank)).wait(timeout=120)
            else:
                loaded = engine.load()
                shard = rank_shard.parse(loaded.items["distrib_optim"], where=f"rank {rank}")
                (opt,) = shard.optimizers
                out.update(step=loaded.step, tier=loaded.tier, verified=loaded.verified, dp_rank=opt.dp_rank,
                           shards=digest(opt.shards), expected=digest(job.local_shards(rank, "dense")))
                model = loaded.items.get("model_optim_rng", {}).get("model")
                if model is not None:
                    want = job.model_state(job.shard_of(rank))
                    out["model_ok"] = all(torch.equal(model[k], v) for k, v in want.items()
                                          if isinstance(v, torch.Tensor))
    except TieredCkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
