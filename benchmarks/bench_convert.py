"""Peak memory of ``convert`` on a Megatron-shaped checkpoint, against its biggest bucket (not a test).

Writes a synthetic checkpoint of about ``--size`` GiB (bf16 model files, fp32 optimizer state; Megatron's default
bucket size of 40M elements) in the ``rank_sharded`` layout, then runs each conversion in a fresh subprocess and
reads its peak resident set (``VmHWM`` in ``/proc/self/status``, ``ru_maxrss``):

* ``baseline``: the same imports, no conversion (Python + torch + tiered_ckpt);
* ``merge``: rank_sharded -> megatron (every DP group's rank files into ``distrib_optim.pt``);
* ``split``: megatron -> rank_sharded at twice the DP (Megatron's gathered files cut for each new rank);
* ``naive`` (``--naive``): what loading everything would cost: ``torch.load`` of every rank file of one group,
  ``merge_shards`` in memory, ``torch.save``.

    python benchmarks/bench_convert.py --size 2 --json results.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_MEASURE = """
import json, resource, sys, time
t0 = time.perf_counter()
from tiered_ckpt.megatron.convert import convert
{body}
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({{"vmhwm": int(status["VmHWM"].split()[0]) * 1024,
                  "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "seconds": time.perf_counter() - t0}}))
"""

_NAIVE = """
import torch
from tiered_ckpt.megatron.distrib_optim import merge_shards
from tiered_ckpt.megatron import rank_shard
files = [torch.load(f"{src}/iter_{step:07d}/rank_{{r:05d}}/distrib_optim.pt", weights_only=True) for r in range({dp})]
geo = rank_shard.parse(files[0], where="r0").optimizers[0].geometry
state = merge_shards([f["optimizers"][0]["shards"] for f in files], geo)
torch.save(state, "{dst}/naive_distrib_optim.pt")
"""


def run(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _MEASURE.format(body=body)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=2.0, help="checkpoint size in GiB (default: %(default)s)")
    parser.add_argument("--dp", type=int, default=2, help="DP size of the saved job (default: %(default)s)")
    parser.add_argument("--workdir", help="where to write (default: a temporary directory, removed afterwards)")
    parser.add_argument("--naive", action="store_true", help="also measure the load-everything approach")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from tests.megatron_synthetic import SyntheticJob, spec_for_bytes, write_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    job = SyntheticJob(spec_for_bytes(int(args.size * (1 << 30)), ddp_bucket_size=None), dp=args.dp, iteration=100)
    geo = job.geometries(job.shards()[0])[0]
    biggest = max(b.numel_unpadded for buf in geo.buffers for b in buf.buckets)
    t0 = time.perf_counter()
    write_checkpoint(job, work / "rank_sharded")
    written = time.perf_counter() - t0
    total = sum(p.stat().st_size for p in (work / "rank_sharded").rglob("*.pt"))
    src, meg, split = work / "rank_sharded", work / "megatron", work / "split"
    results = {
        "checkpoint_bytes": total, "params": sum(p.spec.numel for p in job.params(job.shards()[0])),
        "hidden": job.spec.hidden, "layers": job.spec.num_layers, "dp": args.dp,
        "buckets": [b.numel_unpadded for buf in geo.buffers for b in buf.buckets],
        "biggest_bucket_fp32_bytes": biggest * 4, "write_seconds": written,
        "baseline": run("pass"),
        "merge": run(f"convert({str(src)!r}, {str(meg)!r}, to='megatron', progress=False)"),
        "split": run(f"convert({str(meg)!r}, {str(split)!r}, to='rank_sharded', dp={2 * args.dp}, progress=False)"),
    }
    if args.naive:
        results["naive"] = run(_NAIVE.format(src=src, step=job.iteration, dp=args.dp, dst=work))
    base = results["baseline"]["vmhwm"]
    print(f"checkpoint {total / 2**30:.2f} GiB ({results['params'] / 1e6:.0f}M params, DP {args.dp}); biggest bucket "
          f"{biggest / 1e6:.1f}M elements = {biggest * 4 / 2**20:.0f} MiB in fp32")
    print(f"{'run':<10}{'peak RSS':>12}{'above baseline':>16}{'/ bucket':>10}{'seconds':>10}")
    for name in ("baseline", "merge", "split", "naive"):
        if name in results:
            r = results[name]
            extra = r["vmhwm"] - base
            print(f"{name:<10}{r['vmhwm'] / 2**20:>10.0f} MiB{extra / 2**20:>12.0f} MiB{extra / (biggest * 4):>10.2f}"
                  f"{r['seconds']:>10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
