"""The engine against this machine's limits, one run: 1 GiB in 8 fp32 tensors, tiers shm + local.

Reports, with the limits measured in the same run (see limits.py):
  * first save after ``prepare()`` and warm saves: ``save()`` blocking time vs the all-core copy ceiling into
    pre-faulted memory (``limits.copy_ceiling``: the fastest of ``copy_``, the threaded memmove and streaming
    stores; targets: warm >= 0.85x of its bandwidth; first <= 2x a warm save);
  * warm saves issued while the previous step drains (a save, then at once the next into the other slot):
    their max over their median (target: <= 1.3x, issue #18);
  * local tier committed (time from save to the local commit event) vs a raw write+fsync of the same bytes taken
    just before each save (target: >= 0.8x of raw bandwidth, the median of the per-save ratios);
  * memory-only saves (``persistent=False``) issued back to back, each as soon as the last returned: against the
    copy ceiling, for information (a loop that does nothing but save).

    python benchmarks/bench_engine.py [--size-mib 1024] [--dir DIR] [--mode process|thread] [--busy N]
                                      [--restores N] [--back-to-back N] [--json PATH]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import limits  # noqa: E402

from tiered_ckpt import CheckpointEngine, hookimpl  # noqa: E402
from tiered_ckpt.plugins import get_plugin_manager  # noqa: E402


class CommitTimes:
    def __init__(self):
        self.commits: dict[tuple[str, int], float] = {}

    @hookimpl
    def tiered_ckpt_on_event(self, event):
        if event.kind == "commit":
            self.commits[(event.tier, event.step)] = event.seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--warm", type=int, default=4, help="warm saves to time")
    ap.add_argument("--dir", default=None, help="disk directory for the local tier (default: a temp dir)")
    ap.add_argument("--mode", default="process", choices=["process", "thread"])
    ap.add_argument("--busy", type=int, default=4, help="saves to time while the previous step drains")
    ap.add_argument("--restores", type=int, default=3, help="restores to time, each way")
    ap.add_argument("--back-to-back", type=int, default=8,
                    help="memory-only saves (persistent=False) to time, each issued as soon as the last returned")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    nbytes = args.size_mib << 20
    per = nbytes // args.tensors // 4
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(per, generator=gen) for _ in range(args.tensors)]
    items = {"state": {f"layer{i}.weight": t for i, t in enumerate(tensors)}}
    disk = tempfile.mkdtemp(prefix="tiered_ckpt_bench_", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="tiered_ckpt_bench_", dir="/dev/shm")

    ceiling = limits.copy_ceiling(tensors)
    copy_s = ceiling["seconds"]
    write_s = limits.write_fsync_seconds(tensors, disk)

    observer = CommitTimes()
    get_plugin_manager().register(observer)
    config = {"run_id": f"bench-{uuid.uuid4().hex[:6]}", "drain": {"mode": args.mode},
              "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2},
                        {"name": "local", "kind": "local", "path": os.path.join(disk, "ckpt"), "keep": 1}]}
    try:
        with CheckpointEngine(config) as engine:
            t0 = time.perf_counter()
            engine.prepare(items)
            prepare_s = time.perf_counter() - t0
            first = engine.save(1, items)
            first.wait()
            warm, durable, raw = [], [], []
            for step in range(2, 2 + args.warm):
                # The disk's speed drifts (write-back, other tenants): each save is paired with a raw
                # write+fsync of the same bytes taken just before it, and the ratio is taken per pair.
                raw.append(limits.write_fsync_seconds(tensors, disk, repeats=1))
                h = engine.save(step, items)
                warm.append(h.blocking_s)
                h.wait()
                durable.append(observer.commits[("local", step)])
            # Saves while the previous step drains: save a (not timed), at once save b into the other slot.
            busy, step = [], 2 + args.warm
            for _ in range(args.busy):
                a = engine.save(step, items)
                b = engine.save(step + 1, items)
                busy.append(b.blocking_s)
                a.wait()
                b.wait()
                step += 2
            # Memory-only saves with nothing between them (a loop that only saves): each overwrites the slot of
            # the one before the last, whose checksums may still be being taken.
            engine.wait()
            tight = []
            for _ in range(args.back_to_back):
                tight.append(engine.save(step, items, persistent=False).blocking_s)
                step += 1
            engine.wait()
            restore_copy, restore_into = [], []
            for _ in range(args.restores):
                t0 = time.perf_counter()
                loaded = engine.load(copy=True)
                restore_copy.append(time.perf_counter() - t0)
                assert loaded.tier == "shm" and loaded.verified
                del loaded
                t0 = time.perf_counter()
                loaded = engine.load(into=items)
                restore_into.append(time.perf_counter() - t0)
                assert loaded.tier == "shm" and loaded.verified
                del loaded
    finally:
        get_plugin_manager().unregister(observer)
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    warm_s = statistics.median(warm)
    durable_s = statistics.median(durable)
    busy_s = statistics.median(busy) if busy else float("nan")
    busy_max = max(busy) if busy else float("nan")
    restore_copy_s, restore_into_s = statistics.median(restore_copy), statistics.median(restore_into)
    tight_s = statistics.median(tight[2:] or tight) if tight else float("nan")  # past the first two slots' turn

    def vs_copy(s: float) -> float:
        return limits.gbps(nbytes, s) / limits.gbps(nbytes, copy_s)

    rows = {
        f"copy ceiling, all cores ({ceiling['method']})": (copy_s, None),
        "  copy_ (median)": (statistics.median(ceiling["single_s"]), None),
        f"  threaded memmove, {ceiling['threads']} threads (median)": (statistics.median(ceiling["threaded_s"]), None),
        **({f"  streaming stores, {ceiling['threads']} threads (median)": (statistics.median(ceiling["streaming_s"]),
                                                                          None)} if "streaming_s" in ceiling else {}),
        "raw write+fsync": (write_s, None),
        "prepare() (allocate + pre-fault 2 slots)": (prepare_s, None),
        "first save() after prepare": (first.blocking_s, first.blocking_s / warm_s),
        "warm save() (median)": (warm_s, vs_copy(warm_s)),
        "save() while the previous drains (median)": (busy_s, vs_copy(busy_s)),
        "save() while the previous drains (max; /median)": (busy_max, busy_max / busy_s),
        "memory-only saves back to back (median)": (tight_s, vs_copy(tight_s)),
        "raw write+fsync, paired (median)": (statistics.median(raw), None),
        "save -> local committed (median)": (durable_s, statistics.median(r / d for r, d in zip(raw, durable,
                                                                                                   strict=True))),
        "restore from shm (copy, median)": (restore_copy_s, vs_copy(restore_copy_s)),
        "restore from shm into the tensors (median)": (restore_into_s, vs_copy(restore_into_s)),
    }
    print(f"{args.size_mib} MiB in {args.tensors} fp32 tensors, drain mode {args.mode}, torch {torch.__version__}")
    print(f"{'what':44} {'seconds':>9} {'GB/s':>7} {'ratio':>7}")
    for what, (s, ratio) in rows.items():
        r = "" if ratio is None else f"{ratio:7.2f}"
        print(f"{what:44} {s:9.3f} {limits.gbps(nbytes, s):7.2f} {r}")
    targets = {
        "warm save >= 0.85x the copy ceiling": rows["warm save() (median)"][1] >= 0.85,
        "saves while draining: max <= 1.3x their median": busy_max <= 1.3 * busy_s,
        "first save <= 2x warm": first.blocking_s <= 2 * warm_s,
        "local committed >= 0.8x raw write+fsync": rows["save -> local committed (median)"][1] >= 0.8,
    }
    for what, ok in targets.items():
        print(f"  {'MET ' if ok else 'MISSED'}  {what}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "bytes": nbytes, "mode": args.mode,
            "rows": {k: {"seconds": s, "gbps": limits.gbps(nbytes, s), "ratio": r} for k, (s, r) in rows.items()},
            "samples": {"warm": warm, "busy": busy, "back_to_back": tight, "restore_copy": restore_copy,
                        "restore_into": restore_into,
                        "ceiling": ceiling},
            "targets": targets}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
