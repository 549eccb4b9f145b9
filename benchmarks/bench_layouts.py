"""Time to durable of a multi-rank Megatron-shaped job, layouts ``rank_sharded`` and ``megatron`` side by side,
against the O_DIRECT ceiling of all the ranks writing the same bytes at once.

``--world`` gloo ranks on loopback (one node) save a synthetic Megatron GPT (``tests/megatron_synthetic.py``:
TP=1, PP=1, DP=world, the distributed optimizer: ``distrib_optim`` on every rank, ``model_optim_rng`` on rank 0)
through tiers ``shm`` + ``local`` (``keep: 1``, ``O_DIRECT``; one node holds every rank, so the local tier's
commit covers the job, and with ``layout: megatron`` rank 0 merges the optimizer shards into Megatron's gathered
``mp_rank_00/distrib_optim.pt`` before the checkpoint manifest). Per save, every rank starts at a barrier; time
to durable is rank 0's ``save()`` call to the job's commit (its blocking time + the ``commit`` event's seconds).
After each save, under the same load, every rank writes its own bytes with ``O_DIRECT`` + fsync at the same
time (``limits.DirectIO``), timed on rank 0 from a barrier to a barrier: the ceiling. The ratio is ceiling
seconds / ours (>= 0.85 is the target); the megatron layout also writes the gathered file, which the ceiling
does not (its bytes are reported).

``--tier s3``: the file tier is S3 instead (moto's server on loopback, a fresh bucket per layout, ``part_size``
``--part-mib``, ``max_concurrency`` ``--concurrency``), and the ceiling is every rank putting its own bytes at once
as ``--part-mib`` objects on ``--concurrency`` connections of a plain boto3 client (the raw parallel PUT). With
``layout: megatron`` the ranks upload their parts of Megatron's file themselves (no gather).

    python benchmarks/bench_layouts.py [--quick] [--world 4] [--gib 2] [--saves 5] [--tier local|s3]
                                       [--dir DIR] [--json PATH]
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
import time
import uuid
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
LAYOUTS = ("rank_sharded", "megatron")
TARGET = 0.85

RANK = r"""
import json, os, shutil, sys, tempfile, time
from datetime import timedelta
sys.path.insert(0, sys.argv[2])
import torch.distributed as dist
import _common as c
from tiered_ckpt import CheckpointEngine, hookimpl
from tests.megatron_synthetic import SyntheticJob, spec_for_bytes
from tiered_ckpt.plugins import get_plugin_manager
spec = json.loads(sys.argv[1]); rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
commits = {}
class Obs:
    @hookimpl
    def tiered_ckpt_on_event(self, event):
        if event.kind == "commit" and event.tier == "files":
            commits[event.step] = event.seconds
get_plugin_manager().register(Obs())
job = SyntheticJob(spec=spec_for_bytes(spec["bytes"], ddp_bucket_size=None), dp=world, iteration=1)
items = job.rank_items(rank)
tensors = c.states.tensors(items)
s3 = spec.get("s3")
if s3:
    files = {"name": "files", "kind": "fsspec", "url": f"s3://{s3['bucket']}/ckpt", "options": s3["options"],
             "part_size": s3["part"], "max_concurrency": s3["concurrency"], "keep": 1}
    direct = c.limits.RawPut(tensors, s3, str(rank))
else:
    files = {"name": "files", "kind": "local", "path": os.path.join(spec["root"], "ckpt"), "keep": 1}
    direct = c.limits.DirectIO(tensors, os.path.join(spec["root"], "raw", str(rank)))  # made before anything runs
    os.makedirs(direct.directory, exist_ok=True)
shm = tempfile.mkdtemp(prefix="bench_layouts_", dir="/dev/shm")
cfg = {"run_id": spec["run_id"], "layout": spec["layout"],
       "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2}, files]}
out = {"rank": rank, "bytes": c.states.nbytes(items), "blocking_s": [], "durable_s": [], "ceiling_s": []}
try:
    with CheckpointEngine(cfg, job.parallel) as engine:
        engine.prepare(items)
        engine.save(1, items).wait()
        for step in range(2, 2 + spec["saves"]):
            if rank == 0 and not s3:
                c.drop_cache(spec["root"])
            dist.barrier()
            h = engine.save(step, items)
            h.wait()
            engine.wait()  # retention's deletions too (after the handle): the ceiling below runs quiet
            dist.barrier()  # every rank's own files durable, and rank 0 has committed the job
            out["blocking_s"].append(h.blocking_s)
            if rank == 0:
                out["durable_s"].append(h.blocking_s + commits[step])
                if s3:
                    import s3fs
                    o = s3["options"]
                    fs = s3fs.S3FileSystem(key=o["key"], secret=o["secret"], endpoint_url=o["endpoint_url"],
                                           client_kwargs=o["client_kwargs"], skip_instance_cache=True)
                    out["written_bytes"] = fs.du(f"{s3['bucket']}/ckpt/iter_{step:07d}")
                else:
                    files = os.path.join(spec["root"], "ckpt", f"iter_{step:07d}")
                    out["written_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(files)
                                               for f in fs)
            dist.barrier()
            t0 = time.perf_counter()
            direct.put() if s3 else direct.write_fsync(spec["io_threads"])
            dist.barrier()
            out["ceiling_s"].append(time.perf_counter() - t0)
finally:
    direct.close()
    shutil.rmtree(shm, ignore_errors=True)
sizes = [None] * world
dist.all_gather_object(sizes, out["bytes"])
out["job_bytes"] = sum(sizes)
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: str, args: argparse.Namespace, nbytes: int, root: str, s3: Any = None) -> dict[str, Any]:
    spec = {"layout": layout, "bytes": nbytes, "saves": args.saves, "root": root, "io_threads": args.io_threads,
            "run_id": f"lay{uuid.uuid4().hex[:6]}"}
    if s3 is not None:
        spec["s3"] = {"bucket": s3.create_bucket(), "options": s3.storage_options(), "part": args.part_mib << 20,
                      "concurrency": args.concurrency}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", RANK, json.dumps(spec), str(BENCH / "peers")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(BENCH.parent),
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.world),
                                   "LOCAL_RANK": str(r), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in range(args.world)]
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode:
            raise RuntimeError(f"{layout}: rank {rank} exited {p.returncode}: {err.strip()[-1500:]}")
    ranks = [json.loads([ln for ln in o.splitlines() if ln.startswith("{")][-1]) for o, _ in outs]
    r0 = ranks[0]
    return {"layout": layout, "world": args.world, "job_bytes": r0["job_bytes"], "written_bytes": r0["written_bytes"],
            "durable_s": r0["durable_s"], "ceiling_s": r0["ceiling_s"],
            "blocking_s": {r["rank"]: r["blocking_s"] for r in ranks}}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    dur, ceil = statistics.median(res["durable_s"]), statistics.median(res["ceiling_s"])
    blk = statistics.median([s for v in res["blocking_s"].values() for s in v])
    return {"layout": res["layout"], "durable_s": dur, "ceiling_s": ceil, "ratio": ceil / dur,
            "met": ceil / dur >= TARGET,
            "blocking_s": blk, "job_bytes": res["job_bytes"], "written_bytes": res["written_bytes"],
            "durable_gbps": res["job_bytes"] / dur / 1e9, "ceiling_gbps": res["job_bytes"] / ceil / 1e9}


def table(rows: list[dict[str, Any]], world: int, saves: int, tier: str = "local") -> str:
    ceiling = "O_DIRECT" if tier == "local" else "raw PUT"
    head = ["layout", "job bytes", "bytes written", "blocking s", "call -> durable s", "GB/s", f"{ceiling} s",
            "GB/s", "ceiling/ours", "target"]
    body = [[r["layout"], f"{r['job_bytes'] / 2**30:.2f} GiB", f"{r['written_bytes'] / 2**30:.2f} GiB",
             f"{r['blocking_s']:.3f}", f"{r['durable_s']:.3f}", f"{r['durable_gbps']:.2f}", f"{r['ceiling_s']:.3f}",
             f"{r['ceiling_gbps']:.2f}", f"{r['ratio']:.2f}", "MET" if r["met"] else "MISSED"] for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    where = "shm + local O_DIRECT" if tier == "local" else "shm + S3 (moto on loopback)"
    lines = [f"### Layouts: {world} ranks (one node, gloo), synthetic Megatron GPT (TP 1, PP 1, DP {world}, "
             f"distributed optimizer), {where}; medians of {saves} saves", "", line(head),
             "|" + "|".join("-" * (w + 2) for w in widths) + "|", *[line(b) for b in body], "", "Targets:"]
    for r in rows:
        lines.append(f"  {'MET   ' if r['met'] else 'MISSED'} time to durable >= {TARGET}x the {ceiling} ceiling, "
                     f"layout {r['layout']} (ceiling s / ours s) ratio {r['ratio']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks, 64 MiB in all, 3 saves")
    ap.add_argument("--world", type=int, default=None, help="ranks (default 4; --quick 2)")
    ap.add_argument("--gib", type=float, default=None, help="the job's checkpoint size (default 2; --quick 1/16)")
    ap.add_argument("--saves", type=int, default=None, help="timed saves per layout (default 5; --quick 3)")
    ap.add_argument("--io-threads", type=int, default=1, help="O_DIRECT requests in flight per rank (ceiling)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--tier", choices=("local", "s3"), default="local", help="the file tier (s3: moto on loopback)")
    ap.add_argument("--part-mib", type=int, default=16, help="S3 part size (--tier s3)")
    ap.add_argument("--concurrency", type=int, default=8, help="S3 connections per rank (--tier s3)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.world = args.world or (2 if args.quick else 4)
    args.saves = args.saves or (3 if args.quick else 5)
    nbytes = int((args.gib or (1 / 16 if args.quick else 2)) * 2**30)
    raw, rows = [], []
    for layout in [x for x in args.layouts.split(",") if x]:
        s3 = None
        if args.tier == "s3":  # a fresh server per layout: moto slows down as it fills up
            sys.path.insert(0, str(BENCH.parent))
            from tiered_ckpt.testing.s3_server import start_s3_server

            s3 = start_s3_server()
        try:
            with tempfile.TemporaryDirectory(prefix="tiered_ckpt_layouts_", dir=args.dir) as root:
                t0 = time.perf_counter()
                res = run_layout(layout, args, nbytes, root, s3)
                print(f"  {layout}: ok in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        finally:
            if s3 is not None:
                s3.stop()
        raw.append(res)
        rows.append(summarize(res))
    text = table(rows, args.world, args.saves, args.tier)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"quick": args.quick, "world": args.world, "tier": args.tier,
                                               "rows": rows, "runs": raw,
                                               "table": text}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
