"""One rank of a Megatron-shaped job in tests/test_megatron_engine.py (started through test_multirank.run_ranks)."""

from __future__ import annotations

import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from megatron_synthetic import ModelSpec, SyntheticJob  # noqa: E402
from rank_main import rank_main  # noqa: E402

from tiered_ckpt import CheckpointEngine, ParallelLayout  # noqa: E402
from tiered_ckpt.megatron import rank_shard  # noqa: E402


def digest(shards: dict) -> dict[str, str]:
    return {k: hashlib.sha256(torch.as_tensor(v).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sorted(shards.items())}


def body(rank: int, world: int, spec: dict, out: dict) -> None:
    if spec["mode"] == "legacy":  # a checkpoint Megatron-LM wrote, loaded at this job's DP size
        with CheckpointEngine(spec["config"], ParallelLayout(dp=world)) as engine:
            loaded = engine.load()
            shard = rank_shard.parse(loaded.items["distrib_optim"], where=f"rank {rank}")
            out.update(step=loaded.step, verified=loaded.verified, shards=digest(shard.optimizers[0].shards))
        return
    job_kw = dict(spec["job"])
    if "model" in job_kw:  # ModelSpec fields, e.g. {"hidden": 256, "ddp_bucket_size": None}
        job_kw["spec"] = ModelSpec(**job_kw.pop("model"))
    job = SyntheticJob(**job_kw)
    with CheckpointEngine(spec["config"], job.parallel) as engine:
        if spec["mode"] == "save":
            engine.save(job.iteration, job.rank_items(rank)).wait(timeout=120)
            return
        if spec["mode"] == "steps":  # the same items saved as each of these steps, in turn
            out["ok"] = []
            for step in spec["steps"]:
                engine.save(step, job.rank_items(rank)).wait(timeout=120)
                out["ok"].append(step)
            return
        loaded = engine.load()
        shard = rank_shard.parse(loaded.items["distrib_optim"], where=f"rank {rank}")
        (opt,) = shard.optimizers
        out.update(step=loaded.step, tier=loaded.tier, verified=loaded.verified, dp_rank=opt.dp_rank,
                   shards=digest(opt.shards), expected=digest(job.local_shards(rank, "dense")))
        model = loaded.items.get("model_optim_rng", {}).get("model")
        if model is not None:
            want = job.model_state(job.shard_of(rank))
            out["model_ok"] = all(torch.equal(model[k], v) for k, v in want.items() if isinstance(v, torch.Tensor))


if __name__ == "__main__":
    rank_main(body)
