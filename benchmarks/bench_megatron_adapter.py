"""The Megatron adapter's blocking time on genuine megatron-core: the first save of a job and warm saves.

One rank (TP 1, PP 1, DP 1) of a GPT built by megatron-core on CPU (tests/megatron_real/harness.py: the local layer
spec, DistributedDataParallel, DistributedOptimizer, Adam), trained one iteration, then saved through
``tiered_ckpt.megatron.adapter.save_checkpoint`` with the default configuration (shm with 2 slots + a local tier,
drain in its own process). Two ways a job starts, each in a fresh process and a fresh run:

* ``resume``: Megatron's ``load_checkpoint`` runs first (``--load`` set, no checkpoint there yet: it returns
  ``(0, 0)``), which sizes and pre-faults the slots in the background; the user never calls ``prepare()``;
* ``cold``: no ``load_checkpoint`` (a job without ``--load``): the first save faults its slot's pages itself; the
  adapter pre-faults the remaining slots after it.

For each: the time ``save_checkpoint`` blocks the training loop (building the items from Megatron's objects, then
the engine's snapshot copy; ``handle.blocking_s`` is the copy alone), save 1, 2, 3 ..., each after one training
iteration, against the machine's ceiling for the same
bytes: ``Tensor.copy_`` of the items' tensors into pre-faulted shared memory, median of 5 (benchmarks/limits.py).
Warm = median of saves 3 onwards (both slots used once). Results: benchmarks/results/megatron_adapter.json.

    python benchmarks/bench_megatron_adapter.py [--hidden 768] [--layers 8] [--saves 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))  # rank_procs, which the harness takes its preload list from
sys.path.insert(0, str(BENCH.parent / "tests" / "megatron_real"))
sys.path.insert(0, str(BENCH))


def one_job(rank: int, world: int, mode: str, hidden: int, layers: int, saves: int, root: str) -> dict:
    import torch
    from harness import build_job, train
    from limits import copy_seconds

    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.megatron import adapter

    job = build_job(1, 1, "fp32", seed=5, num_layers=layers, hidden=hidden, ffn_hidden=4 * hidden, heads=8,
                    vocab=1024, seq=32, micro_batch=1, global_batch=1)
    cfg = {"run_id": f"bench{uuid.uuid4().hex[:6]}", "layout": "rank_sharded",
           "tiers": [{"name": "shm", "kind": "shm", "path": "/dev/shm"},
                     {"name": "local", "kind": "local", "path": os.path.join(root, mode)}]}
    engine = CheckpointEngine(cfg, job.layout)
    out: dict = {"mode": mode}
    try:
        if mode == "resume":
            t0 = time.perf_counter()
            assert adapter.load_checkpoint(job.model, job.optimizer, job.scheduler, engine=engine,
                                           args=job.args, rng_tracker=job.tracker) == (0, 0)
            out["load_checkpoint_s"] = time.perf_counter() - t0
        blocking, engine_blocking = [], []
        for _ in range(saves):
            train(job, 1)  # a job trains between saves (one iteration here)
            t0 = time.perf_counter()
            handle = adapter.save_checkpoint(job.iteration, job.model, job.optimizer, job.scheduler, 0.0,
                                             engine=engine, args=job.args, rng_tracker=job.tracker)
            blocking.append(time.perf_counter() - t0)  # what the training loop waits: items built + snapshot
            engine_blocking.append(handle.blocking_s)
            handle.wait(timeout=600)
        items = adapter._items(job.iteration, job.model, job.optimizer, job.scheduler, 0.0, job.args, job.tracker,
                               engine, False)
        tensors: list[torch.Tensor] = []

        def walk(x: object) -> None:
            if isinstance(x, torch.Tensor):
                tensors.append(x.detach())
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list | tuple):
                for v in x:
                    walk(v)

        walk(items)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        out.update(blocking_s=blocking, engine_blocking_s=engine_blocking, nbytes=nbytes,
                   copy_ceiling_s=copy_seconds(tensors), tensors=len(tensors))
    finally:
        engine.close()
    return out


def main() -> None:
    from harness import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=7)
    p.add_argument("--json", default=str(BENCH / "results" / "megatron_adapter.json"))
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench_megatron_adapter_")
    results = []
    try:
        for mode in ("resume", "cold"):
            (r,) = launch(one_job, 1, mode, a.hidden, a.layers, a.saves, root, timeout=1800)
            warm = statistics.median(r["blocking_s"][2:])
            r.update(first_s=r["blocking_s"][0], warm_s=warm, first_vs_ceiling=r["copy_ceiling_s"] / r["blocking_s"][0],
                     warm_vs_ceiling=r["copy_ceiling_s"] / warm)
            results.append(r)
            print(f"{mode:7s} {r['nbytes'] / 2**20:8.0f} MiB in {r['tensors']} tensors: first save "
                  f"{r['first_s'] * 1e3:7.1f} ms, saves {' '.join(f'{x * 1e3:.0f}' for x in r['blocking_s'])} ms; "
                  f"warm (median of saves 3..) {warm * 1e3:6.1f} ms; copy ceiling {r['copy_ceiling_s'] * 1e3:6.1f} ms "
                  f"(ceiling/first {r['first_vs_ceiling']:.2f}, ceiling/warm {r['warm_vs_ceiling']:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "hidden": a.hidden,
                                        "layers": a.layers, "results": results}, indent=1))


if __name__ == "__main__":
    main()
