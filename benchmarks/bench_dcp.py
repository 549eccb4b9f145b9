"""DCP through the tiers against DCP's own writers, stagers and reader, one process (``no_dist``), in one run.

Saves, each timed for how long the call blocks, how long until the state may change again (``staged``: the same
as blocking except for DCP's asynchronous staging) and how long until the step is durable on the local disk:

* ``dcp.save`` with DCP's ``FileSystemWriter`` (it fsyncs its files before it returns);
* ``dcp.async_save`` with ``FileSystemWriter`` and DCP's default stager (async_save's own choice: a blocking copy
  into fresh CPU memory), with ``DefaultStager(StagingOptions(use_shared_memory=True))`` (blocking copy into
  shared memory, its buffers kept between saves), and with the same plus ``use_async_staging`` (the copy runs on
  DCP's staging thread; ``staged`` is its ``staging_completion``); ``use_pinned_memory`` needs CUDA: its row says
  "n/a: no CUDA" where there is none (where there is, it stages this CPU state into pinned memory);
* ``dcp.save`` and ``dcp.async_save`` with ``TieredStorageWriter`` (shm -> local, drain in its own process;
  durable: ``writer.wait()``, the step committed on the disk tier).

Loads (``dcp.load`` into existing tensors): ``TieredStorageReader`` from shm and from the disk tier (checksums
checked), DCP's ``FileSystemReader`` on our step directory and on a ``FileSystemWriter`` one. Every candidate runs
once untimed first (slots, staging buffers, page cache); then ``--rounds`` rounds, each running every candidate
of its phase in turn, so peers share the machine's load; medians are reported. The page cache is not dropped.

    .venv/bin/python benchmarks/bench_dcp.py [--mib 512] [--rounds 5] [--dir DIR] [--json PATH]
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.dcp import TieredStorageReader, TieredStorageWriter

Timing = dict[str, float]  # "blocking", "staged", "durable" -> seconds from the call


def make_state(mib: int) -> dict:
    """A model-like state: 16 MiB tensors, 64 small ones, some bytes (DCP's BYTE_IO items)."""
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(1024, 4096, generator=g) for i in range(max(1, mib // 16))}
    model.update({f"layer{i}.norm": torch.randn(4096, generator=g) for i in range(64)})
    return {"model": model, "extra": {"step": 1, "note": "bench"}}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def zeros(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {"step": 0, "note": ""}}


def staging_options(shared: bool, pinned: bool, async_staging: bool) -> StagingOptions:
    return StagingOptions(use_pinned_memory=pinned, use_shared_memory=shared, use_async_staging=async_staging,
                          use_non_blocking_copy=pinned)


class Saves:
    """Every save candidate: name -> a function that saves ``state`` once and returns its Timing."""

    def __init__(self, state: dict, work: str, engine: CheckpointEngine):
        self.state, self.work, self.engine = state, work, engine
        self.writer = TieredStorageWriter(engine, cache_staged_state_dict=True)
        self.step = 0
        self.stagers: dict[str, DefaultStager] = {}
        cuda = torch.cuda.is_available()
        self.candidates: dict[str, Callable[[], Timing] | str] = {
            "dcp.save FileSystemWriter": self.fs_save,
            "dcp.async_save FileSystemWriter, default stager": lambda: self.fs_async(None),
            "dcp.async_save FileSystemWriter, DefaultStager shared memory": lambda: self.fs_async("shm"),
            "dcp.async_save FileSystemWriter, DefaultStager shared memory + async staging":
                lambda: self.fs_async("shm_async"),
            "dcp.async_save FileSystemWriter, DefaultStager pinned memory":
                (lambda: self.fs_async("pinned")) if cuda else "n/a: no CUDA",
            "dcp.save TieredStorageWriter": self.ours_save,
            "dcp.async_save TieredStorageWriter": self.ours_async,
        }
        options = {"shm": (True, False, False), "shm_async": (True, False, True), "pinned": (False, True, False)}
        for key, (shared, pinned, async_staging) in options.items():
            if key != "pinned" or cuda:
                self.stagers[key] = DefaultStager(staging_options(shared, pinned, async_staging))

    def _path(self, name: str) -> str:
        path = os.path.join(self.work, name)
        shutil.rmtree(path, ignore_errors=True)  # one directory per candidate: the disk holds the state once each
        return path

    def fs_save(self) -> Timing:
        path = self._path("fs_save")
        t0 = time.perf_counter()
        dcp.save(self.state, storage_writer=FileSystemWriter(path), no_dist=True)
        took = time.perf_counter() - t0
        return {"blocking": took, "staged": took, "durable": took}

    def fs_async(self, stager: str | None) -> Timing:
        path = self._path(f"fs_async_{stager or 'default'}")
        kwargs: dict[str, Any] = {"async_stager": self.stagers[stager]} if stager else {}
        t0 = time.perf_counter()
        response = dcp.async_save(self.state, storage_writer=FileSystemWriter(path), no_dist=True, **kwargs)
        blocking = time.perf_counter() - t0
        if hasattr(response, "staging_completion"):  # AsyncSaveResponse: staging went on in DCP's thread
            response.staging_completion.result()
            staged = time.perf_counter() - t0
            response.upload_completion.result()
        else:
            staged = blocking
            response.result()
        return {"blocking": blocking, "staged": staged, "durable": time.perf_counter() - t0}

    def ours_save(self) -> Timing:
        self.step += 1
        t0 = time.perf_counter()
        dcp.save(self.state, storage_writer=self.writer, checkpoint_id=self.step)
        blocking = time.perf_counter() - t0
        self.writer.wait()
        return {"blocking": blocking, "staged": blocking, "durable": time.perf_counter() - t0}

    def ours_async(self) -> Timing:
        self.step += 1
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, storage_writer=self.writer, checkpoint_id=self.step)
        blocking = time.perf_counter() - t0
        fut.result()
        self.writer.wait()
        return {"blocking": blocking, "staged": blocking, "durable": time.perf_counter() - t0}

    def close(self) -> None:
        for stager in self.stagers.values():
            stager.close()


def timed_load(load: Callable[[dict], Any], state: dict) -> float:
    target = zeros(state)
    t0 = time.perf_counter()
    load(target)
    took = time.perf_counter() - t0
    assert torch.equal(target["model"]["layer0.weight"], state["model"]["layer0.weight"])
    return took


def run_rounds(candidates: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """One untimed run of each, then ``rounds`` rounds of each in turn."""
    for fn in candidates.values():
        fn()
    samples: dict[str, list[Any]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            samples[name].append(fn())
    return samples


def bench(mib: int, rounds: int, base: str | None) -> dict:
    work = tempfile.mkdtemp(prefix="bench-dcp-", dir=base)
    shm = tempfile.mkdtemp(prefix="bench-dcp-", dir="/dev/shm")
    state = make_state(mib)
    disk = os.path.join(work, "ours")
    cfg = {"run_id": f"bench-dcp-{uuid.uuid4().hex[:8]}", "layout": "dcp", "drain": {"mode": "process"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2},
                     {"name": "disk", "kind": "local", "path": disk, "keep": 2}]}
    out: dict = {"bytes": nbytes(state), "tensors": len(state["model"]), "rounds": rounds, "cpus": os.cpu_count(),
                 "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                 "note": "medians after one untimed run of each candidate; peers alternate within each round; "
                         "page cache not dropped"}
    try:
        with CheckpointEngine(cfg) as engine:
            saves = Saves(state, work, engine)
            try:
                runnable = {k: v for k, v in saves.candidates.items() if callable(v)}
                runnable["load TieredStorageReader, shm"] = lambda: timed_load(
                    lambda t: dcp.load(t, storage_reader=TieredStorageReader(engine)), state)
                phase1 = run_rounds(runnable, rounds)
            finally:
                saves.close()
        ours_dir = os.path.join(disk, f"iter_{saves.step:07d}")
        fs_dir = os.path.join(work, "fs_save")
        disk_only = {**cfg, "tiers": cfg["tiers"][1:], "drain": {"mode": "thread"}}
        with CheckpointEngine(disk_only) as engine:
            phase2 = run_rounds({
                "load TieredStorageReader, local disk": lambda: timed_load(
                    lambda t: dcp.load(t, storage_reader=TieredStorageReader(engine)), state),
                "load FileSystemReader, our step directory": lambda: timed_load(
                    lambda t: dcp.load(t, storage_reader=FileSystemReader(ours_dir), no_dist=True), state),
                "load FileSystemReader, FileSystemWriter's directory": lambda: timed_load(
                    lambda t: dcp.load(t, storage_reader=FileSystemReader(fs_dir), no_dist=True), state),
            }, rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    out["saves"] = {}
    for name, fn in saves.candidates.items():
        if not callable(fn):
            out["saves"][name] = {"n/a": fn}
            continue
        samples = phase1[name]
        out["saves"][name] = {
            **{f"{k}_median_s": statistics.median(s[k] for s in samples) for k in ("blocking", "staged", "durable")},
            "samples_s": samples}
    loads = {**{k: v for k, v in phase1.items() if k.startswith("load")}, **phase2}
    out["loads"] = {name: {"median_s": statistics.median(v), "samples_s": v} for name, v in loads.items()}
    return out


def table(out: dict) -> str:
    """The results as benchmarks/README.md's markdown tables."""
    gib = out["bytes"] / 2**30
    lines = ["| save | blocks (ms) | state may change again (ms) | durable on disk (ms) |", "|---|---|---|---|"]
    for name, r in out["saves"].items():
        if "n/a" in r:
            lines.append(f"| {name} | {r['n/a']} | {r['n/a']} | {r['n/a']} |")
            continue
        cells = []
        for k in ("blocking", "staged", "durable"):
            s = [x[k] * 1e3 for x in r["samples_s"]]
            cells.append(f"**{r[f'{k}_median_s'] * 1e3:.0f}** ({min(s):.0f}-{max(s):.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| load (`dcp.load` into existing tensors) | ms | GiB/s |", "|---|---|---|"]
    for name, r in out["loads"].items():
        s = r["samples_s"]
        lines.append(f"| {name} | **{r['median_s'] * 1e3:.0f}** ({min(s) * 1e3:.0f}-{max(s) * 1e3:.0f}) | "
                     f"{gib / r['median_s']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    warnings.filterwarnings("ignore")  # DCP warns that torch.distributed is not initialised: intended here
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="local-disk directory (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    out = bench(args.mib, args.rounds, args.dir)
    out["wall_s"] = time.perf_counter() - t0
    print(f"state: {out['bytes'] / 2**20:.0f} MiB in {out['tensors']} tensors, medians of {args.rounds} "
          f"({out['wall_s']:.0f} s)")
    print(table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
