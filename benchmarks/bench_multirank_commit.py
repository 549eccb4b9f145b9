"""Per-save commit overhead across ranks: N gloo ranks on loopback save through shm → a shared file:// tier.

For each save, rank 0 reports the time from its snapshot to its own files being written (``drain`` event) and to
the job-wide commit (``commit`` event: every rank's manifest present, checkpoint manifest and tracker written).
The difference is what committing across ranks costs on top of writing.

    python benchmarks/bench_multirank_commit.py [--world 8] [--saves 5] [--mib-per-rank 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import uuid

RANK_SCRIPT = r"""
import json, os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
from tiered_ckpt import CheckpointEngine, hookimpl
from tiered_ckpt.plugins import get_plugin_manager
spec = json.loads(sys.argv[1]); rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
seen = {}
class Obs:
    @hookimpl
    def tiered_ckpt_on_event(self, event):
        if event.kind in ("drain", "commit") and event.tier == "shared":
            seen.setdefault(event.step, {})[event.kind] = event.seconds
get_plugin_manager().register(Obs())
state = {"state": {"w": torch.randn(spec["mib"] << 18)}}
with CheckpointEngine(spec["config"]) as engine:
    for step in range(1, spec["saves"] + 1):
        dist.barrier()
        engine.save(step, state).wait()
        dist.barrier()
if rank == 0:
    print(json.dumps(seen))
dist.destroy_process_group()
"""


def run(world: int, saves: int, mib: int) -> dict[int, dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tempfile.mkdtemp(prefix="tiered_ckpt_bench_")
    shm = tempfile.mkdtemp(prefix="tiered_ckpt_bench_", dir="/dev/shm")
    config = {"run_id": f"mr{uuid.uuid4().hex[:6]}", "drain": {"mode": "process"},
              "tiers": [{"name": "shm", "kind": "shm", "path": shm},
                        {"name": "shared", "kind": "fsspec", "url": f"file://{root}/shared"}]}
    spec = json.dumps({"config": config, "saves": saves, "mib": mib})
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, spec], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    return {int(k): v for k, v in json.loads(outs[0].strip().splitlines()[-1]).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--mib-per-rank", type=int, default=8)
    args = ap.parse_args()
    for world in (1, args.world):
        steps = run(world, args.saves, args.mib_per_rank)
        later = [v for s, v in sorted(steps.items()) if s > 1]  # the first save also waits for worker start-up
        write = statistics.median(v["drain"] for v in later)
        commit = statistics.median(v["commit"] for v in later)
        print(f"{world} rank(s), {args.mib_per_rank} MiB each: snapshot → own files written {write:.3f} s, "
              f"→ committed for the job {commit:.3f} s (median of saves 2-{args.saves})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
