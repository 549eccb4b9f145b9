"""DCP through the tiers against DCP's own FileSystemWriter/Reader, one process (``no_dist``), small states.

Save: how long ``dcp.save`` blocks and how long until the step is durable on the local disk, for
``TieredStorageWriter`` (shm -> local) and for DCP's ``FileSystemWriter`` (which blocks until its files are
fsynced), and the same for ``dcp.async_save`` (DCP's default stager vs our writer as stager). Load: ``dcp.load``
into existing tensors with ``TieredStorageReader`` from shm and from the disk (checksums checked), and with DCP's
``FileSystemReader`` on our step directory and on its own. The page cache is not dropped: disk loads read cached
pages. Numbers on a machine shared with other work are indicative only.

    .venv/bin/python benchmarks/bench_dcp.py [--mib 128] [--rounds 2] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.dcp import TieredStorageReader, TieredStorageWriter


def make_state(mib: int) -> dict:
    """A model-like state: a few large tensors, many small ones, some bytes (DCP's BYTE_IO items)."""
    n_large = max(1, mib // 16)
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(1024, 4096, generator=g) for i in range(n_large)}  # 16 MiB each
    model.update({f"layer{i}.norm": torch.randn(4096, generator=g) for i in range(64)})
    return {"model": model, "extra": {"step": 1, "note": "bench"}}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def zeros(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {"step": 0, "note": ""}}


def best(xs: list[float]) -> float:
    return min(xs)


def main() -> int:
    warnings.filterwarnings("ignore")  # DCP warns that torch.distributed is not initialised: intended here
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="local-disk directory (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="bench-dcp-", dir="/dev/shm")
    state = make_state(args.mib)
    out: dict = {"bytes": nbytes(state), "rounds": args.rounds, "cpus": os.cpu_count(),
                 "note": "after one warm-up save per slot; page cache not dropped"}
    cfg = {"run_id": f"bench-dcp-{uuid.uuid4().hex[:8]}", "layout": "dcp", "drain": {"mode": "process"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2},
                     {"name": "disk", "kind": "local", "path": os.path.join(work, "ours"), "keep": 2}]}
    try:
        res: dict[str, list[float]] = {k: [] for k in ("ours_blocking", "ours_durable", "ours_async_blocking",
                                                        "ours_async_durable", "dcp_save", "dcp_async_blocking",
                                                        "dcp_async_total", "load_ours_shm", "load_ours_disk",
                                                        "load_fsreader_ours", "load_fsreader_dcp")}
        with CheckpointEngine(cfg) as engine:
            writer = TieredStorageWriter(engine, cache_staged_state_dict=True)
            step = 0
            for _ in range(2):  # one save per slot first: the slots are allocated and pre-faulted once
                step += 1
                dcp.save(state, storage_writer=writer, checkpoint_id=step)
                writer.wait()
            for _ in range(args.rounds):
                step += 1
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=writer, checkpoint_id=step)
                res["ours_blocking"].append(time.perf_counter() - t0)
                writer.wait()
                res["ours_durable"].append(time.perf_counter() - t0)
                step += 1
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)
                res["ours_async_blocking"].append(time.perf_counter() - t0)
                fut.result()
                writer.wait()
                res["ours_async_durable"].append(time.perf_counter() - t0)
            for _ in range(args.rounds):
                target = zeros(state)
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=TieredStorageReader(engine))
                res["load_ours_shm"].append(time.perf_counter() - t0)
        disk_only = {**cfg, "tiers": cfg["tiers"][1:], "drain": {"mode": "thread"}}
        with CheckpointEngine(disk_only) as engine:
            for _ in range(args.rounds):
                target = zeros(state)
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=TieredStorageReader(engine))
                res["load_ours_disk"].append(time.perf_counter() - t0)
        ours_dir = os.path.join(work, "ours", f"iter_{step:07d}")
        for r in range(args.rounds):
            path = os.path.join(work, f"dcp_{r}")
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=path, no_dist=True)
            res["dcp_save"].append(time.perf_counter() - t0)
            apath = os.path.join(work, f"dcp_async_{r}")
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=apath, no_dist=True)
            res["dcp_async_blocking"].append(time.perf_counter() - t0)
            fut.result()
            res["dcp_async_total"].append(time.perf_counter() - t0)
        for _ in range(args.rounds):
            for key, path in (("load_fsreader_ours", ours_dir), ("load_fsreader_dcp", os.path.join(work, "dcp_0"))):
                target = zeros(state)
                t0 = time.perf_counter()
                dcp.load(target, checkpoint_id=path, no_dist=True)
                res[key].append(time.perf_counter() - t0)
        out["samples_s"] = res
        out["best_s"] = {k: best(v) for k, v in res.items()}
        out["median_s"] = {k: statistics.median(v) for k, v in res.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    gib = out["bytes"] / 2**30
    print(f"state: {out['bytes'] / 2**20:.0f} MiB, best of {args.rounds}")
    for k, v in out["best_s"].items():
        print(f"  {k:22s} {v * 1e3:9.1f} ms  {gib / v:6.2f} GiB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
