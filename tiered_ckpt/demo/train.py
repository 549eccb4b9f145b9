"""One rank of the demo job: train, checkpoint every few steps, resume from the newest step all ranks can read.

Run by :mod:`tiered_ckpt.demo.run` as ``python -m tiered_ckpt.demo.train SPEC_JSON`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (what torchrun would set). Prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..engine import CheckpointEngine
from ..megatron import rank_shard
from ..megatron.geometry import OptimizerGeometry
from ..parallel import ParallelLayout
from .gpt import TinyGPT, batch
from .zero import KEYS, DistributedAdam


def items(step: int, model: TinyGPT, opt: DistributedAdam, args: argparse.Namespace, rank: int,
          world: int) -> dict:
    """Megatron's two files of one rank: model_optim_rng (model, optimizer meta, RNG, args) and distrib_optim."""
    model_optim_rng = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state()}],
    }
    sub = rank_shard.SubOptimizerShard(geometry=OptimizerGeometry((opt.geometry,), KEYS), dp_rank=rank,
                                       group=tuple(range(world)), shards=opt.local_shards())
    distrib_optim = rank_shard.build(rank=rank, topology=ParallelLayout(dp=world), optimizers=[sub])
    return {"model_optim_rng": model_optim_rng, "distrib_optim": distrib_optim}


def restore(loaded: dict, model: TinyGPT, opt: DistributedAdam, rank: int) -> None:
    mor = loaded["model_optim_rng"]
    model.load_state_dict(mor["model"])
    opt.load_state_dict(mor["optimizer"])
    rng = mor["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    shard = rank_shard.parse(loaded["distrib_optim"], where=f"rank {rank} distrib_optim")
    opt.load_local_shards({k: torch.as_tensor(v) for k, v in shard.optimizers[0].shards.items()})
    opt._fill_buffer_from_params()


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # deterministic and fair on small machines
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(1234)  # the same initial weights on every rank
    random.seed(1234)
    np.random.seed(1234)
    model = TinyGPT()
    opt = DistributedAdam(model, dp_rank=rank, dp_size=world)
    args = argparse.Namespace(micro_batch_size=8, seq_length=32, lr=opt.lr, train_iters=spec["steps"],
                              save_interval=spec["save_every"], world_size=world)
    engine = CheckpointEngine(spec["config"], ParallelLayout(dp=world), rank=rank) if spec.get("config") else None
    start = 0
    if engine is not None and spec.get("resume"):
        loaded = engine.load()
        restore(loaded.items, model, opt, rank)
        start = loaded.step
        print(json.dumps({"rank": rank, "resumed": start, "tier": loaded.tier, "load_s": loaded.seconds}),
              flush=True)
    for step in range(start + 1, spec["steps"] + 1):
        loss = model.loss(batch(step, rank))
        model.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        print(json.dumps({"rank": rank, "step": step, "loss": reduced.item() / world}), flush=True)
        if engine is not None and step % spec["save_every"] == 0:
            handle = engine.save(step, items(step, model, opt, args, rank, world))
            print(json.dumps({"rank": rank, "saved": step, "blocking_s": handle.blocking_s}), flush=True)
        if step == spec.get("kill_step") and spec.get("kill_rank") is not None:
            # Every rank is past this step's save before the failure, so where the job resumes from does not
            # depend on how the machine scheduled the ranks (a save of the kill step in flight on one of them).
            dist.barrier()
            if spec["kill_rank"] == rank:
                os.kill(os.getpid(), signal.SIGKILL)  # a node failure: no clean-up of any kind
    if engine is not None:
        engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
