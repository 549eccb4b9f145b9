"""The local tier's drain with O_DIRECT against the same drain through the page cache, and both raw limits.

One engine (tiers shm + local, thread drain, layout ``rank_sharded``), its local tier switched between direct and
buffered writes save after save, then, after each pair, a raw buffered write+fsync and a raw ``O_DIRECT``
write+fsync of the same bytes (``limits.py``). Every figure is the ``drain`` event's seconds (files and rank
manifest durable) or a limit's seconds; medians over ``--pairs`` rounds, every sample in the JSON.

    python benchmarks/bench_direct_io.py [--state megatron_2g|fp32_1g] [--quick] [--pairs 5] [--dir DIR]
                                         [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))  # _common puts benchmarks/ and the repository root on the path too

import _common as c  # noqa: E402
import limits  # noqa: E402
import states  # noqa: E402

from tiered_ckpt import CheckpointEngine, hookimpl  # noqa: E402
from tiered_ckpt.plugins import get_plugin_manager  # noqa: E402


class DrainTimes:
    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    @hookimpl
    def tiered_ckpt_on_event(self, event):
        if event.kind == "drain" and event.tier == "local":
            self.seconds[event.step] = event.seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", default="megatron_2g", choices=sorted(states.STATES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="a directory on the disk to test (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    items = states.make(args.state, args.quick)
    tensors = states.tensors(items)
    work = tempfile.mkdtemp(prefix="bench_direct_", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="bench_direct_", dir="/dev/shm")
    times = DrainTimes()
    pm = get_plugin_manager()
    pm.register(times)
    samples: dict[str, list[float]] = {"direct": [], "buffered": [], "raw_buffered": [], "raw_direct": []}
    try:
        cfg = {"run_id": f"direct-{uuid.uuid4().hex[:8]}", "layout": "rank_sharded", "drain": {"mode": "thread"},
               "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2},
                         {"name": "local", "kind": "local", "path": f"{work}/ckpt", "keep": 1}]}
        with CheckpointEngine(cfg) as engine:
            files = engine.pipeline.stores["local"].tier.files
            engine.prepare(items)
            engine.save(1, items).wait()
            step = 2
            for i in range(args.pairs):
                for mode in ("direct", "buffered"):
                    files.direct_io = mode == "direct"
                    c.drop_cache(work)
                    engine.save(step, items).wait()
                    samples[mode].append(times.seconds[step])
                    step += 1
                c.drop_cache(work)
                samples["raw_buffered"].append(limits.write_fsync_seconds(tensors, work, repeats=1))
                samples["raw_direct"].append(limits.direct_write_fsync_seconds(tensors, work, repeats=1))
                print(f"pair {i + 1}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items()), flush=True)
    finally:
        pm.unregister(times)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    nbytes = states.nbytes(items)
    print(f"\n{states.describe(args.state, args.quick)}; medians of {args.pairs}:")
    for k, v in med.items():
        print(f"  {k:13s} {v:.3f} s  {nbytes / v / 1e9:5.2f} GB/s")
    print(f"  drain direct / raw direct: {med['raw_direct'] / med['direct']:.2f}x the bandwidth; "
          f"drain direct / raw buffered: {med['raw_buffered'] / med['direct']:.2f}x; "
          f"drain buffered / raw buffered: {med['raw_buffered'] / med['buffered']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"state": args.state, "quick": args.quick, "bytes": nbytes,
                                               "samples": samples, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
