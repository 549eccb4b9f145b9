"""Restore from a shm snapshot into the model's existing tensors, three ways, against a plain ``copy_``.

One engine (tiers shm + local, thread drain; the drain records the snapshot's checksums in shm): after one
save, ``--repeats`` rounds of, alternating: ``load(into=items)`` (copy and verification fused),
``load(copy=False)`` + ``copy_`` into the tensors (verify first, copy after), the same with ``load.verify:
false`` (nothing verified), and a plain ``copy_`` of the tensors from a copy of the state (the ceiling). Every
restore is checked bit for bit. Medians; samples in the JSON.

    python benchmarks/bench_restore_shm.py [--state fp32_1g|megatron_2g] [--quick] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))  # _common puts benchmarks/ and the repository root on the path too

import _common as c  # noqa: E402
import states  # noqa: E402
import torch  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", default="fp32_1g", choices=sorted(states.STATES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    items = states.make(args.state, args.quick)
    tensors = states.tensors(items)
    reference = [t.clone() for t in tensors]
    shm = tempfile.mkdtemp(prefix="bench_restore_shm_", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="bench_restore_shm_")
    samples: dict[str, list[float]] = {"load_into": [], "views_copy": [], "views_copy_unverified": [], "copy": []}

    def timed_restore(engine: CheckpointEngine, how: str) -> float:
        for t in tensors:
            t.view(-1)[:16].add_(1)  # the restore must really overwrite them
        t0 = time.perf_counter()
        if how == "load_into":
            res = engine.load(into=items)
        else:
            res = engine.load(copy=False)
            c.copy_into(items, res.items)
        seconds = time.perf_counter() - t0
        assert res.tier == "shm" and res.verified == engine.config.load.verify, (res.tier, res.verified)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, reference,
                                                                                          strict=True)), how
        del res
        return seconds

    try:
        # The local tier is there for the drain, which records the snapshot's checksums in shm once it is durable.
        base = {"run_id": f"restore-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
                "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 1},
                          {"name": "local", "kind": "local", "path": f"{work}/ckpt"}]}
        with CheckpointEngine(base) as engine:
            engine.save(1, items).wait()
            verified = engine.config
            unverified = replace(verified, load=replace(verified.load, verify=False))  # load.verify: false
            for _ in range(args.repeats):
                samples["load_into"].append(timed_restore(engine, "load_into"))
                samples["views_copy"].append(timed_restore(engine, "views_copy"))
                engine.config = unverified
                samples["views_copy_unverified"].append(timed_restore(engine, "views_copy"))
                engine.config = verified
                t0 = time.perf_counter()
                for dst, src in zip(tensors, reference, strict=True):
                    dst.copy_(src)
                samples["copy"].append(time.perf_counter() - t0)
                c.settle()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{states.describe(args.state, args.quick)}; medians of {args.repeats}:")
    for k, v in med.items():
        print(f"  {k:22s} {v:.3f} s   {med['copy'] / v:.2f}x of copy_")
    if args.json:
        Path(args.json).write_text(json.dumps({"state": args.state, "quick": args.quick, "samples": samples,
                                               "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
