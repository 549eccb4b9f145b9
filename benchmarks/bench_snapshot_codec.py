"""Snapshot codec vs a plain ``Tensor.copy_``: is the flat codec's blocking copy at memory speed?

Both candidates copy the same tensors into the same pre-allocated, pre-faulted ``/dev/shm`` slot at the same
offsets, alternating, several times:

  (a) ``copy_``: ``view.copy_(tensor)`` for each tensor, destination views built before timing;
  (b) codec:     ``plan_snapshot(items)`` + ``copy_into(plan, slot)`` + ``encode_header(plan)``, with a fresh
                 plan each time, as the engine's ``save()`` does.

It reports the median seconds and GB/s of each, and ``ratio = GB/s(b) / GB/s(a)`` (target: >= 0.85).

    python benchmarks/bench_snapshot_codec.py [--size-mib 1024] [--tensors 8] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_ckpt.codecs.flat import copy_into, encode_header, plan_snapshot  # noqa: E402

TARGET_RATIO = 0.85


def make_items(total_bytes: int, n: int) -> dict:
    per = total_bytes // n // 4
    gen = torch.Generator().manual_seed(0)
    return {"state": {"model": {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(n)}}}


def open_slot(nbytes: int) -> tuple[str, mmap.mmap, torch.Tensor]:
    """A /dev/shm file of ``nbytes``, mapped and pre-faulted (written once), as a uint8 tensor."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmpdir = tempfile.mkdtemp(prefix="bench_snapshot_codec_", dir=root)
    path = os.path.join(tmpdir, "slot.data")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    slot = torch.frombuffer(mm, dtype=torch.uint8)
    slot.copy_(torch.zeros(nbytes, dtype=torch.uint8))  # one write pass: every page faulted in before timing
    return path, mm, slot


def close_slot(path: str, mm: mmap.mmap) -> None:
    gc.collect()
    try:
        mm.close()
    except BufferError:  # a tensor still exports the mapping; the unlink below still frees the file
        pass
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


def measure(items: dict, plan, slot: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    tensors = list(items["state"]["model"].values())
    # (a) the baseline: the same tensors into the same buffer at the same offsets, views made up front
    views = [
        slot[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape)
        for e, t in zip(plan.tensors, tensors, strict=True)
    ]

    def plain() -> None:
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t)

    def codec() -> None:
        p = plan_snapshot(items)
        copy_into(p, slot)
        encode_header(p)

    plain()  # warm both paths once (allocator, thread pool)
    codec()
    times: dict[str, list[float]] = {"copy_": [], "codec": []}
    for _ in range(repeats):
        for name, fn in (("copy_", plain), ("codec", codec)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for e, t in zip(plan.tensors, tensors, strict=True):  # the codec's bytes are the tensors' bytes
        assert torch.equal(slot[e.offset : e.offset + e.nbytes].view(t.dtype), t)
    return times


def run(size_mib: int, n_tensors: int, repeats: int) -> dict:
    items = make_items(size_mib << 20, n_tensors)
    nbytes = sum(t.numel() * t.element_size() for t in items["state"]["model"].values())
    plan = plan_snapshot(items)
    path, mm, slot = open_slot(plan.total_bytes)
    try:
        times = measure(items, plan, slot, repeats)
    finally:
        del slot
        close_slot(path, mm)

    result: dict = {
        "bytes": nbytes,
        "tensors": n_tensors,
        "repeats": repeats,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "target_ratio": TARGET_RATIO,
        "runs": {},
    }
    for name, ts in times.items():
        med = statistics.median(ts)
        result["runs"][name] = {"median_s": med, "gb_per_s": nbytes / med / 1e9, "all_s": ts}
    a, b = result["runs"]["copy_"], result["runs"]["codec"]
    result["ratio"] = b["gb_per_s"] / a["gb_per_s"]
    result["ok"] = result["ratio"] >= TARGET_RATIO
    return result


def table(result: dict) -> str:
    gib = result["bytes"] / 2**30
    lines = [
        f"{gib:.2f} GiB in {result['tensors']} fp32 tensors -> pre-faulted /dev/shm slot; "
        f"median of {result['repeats']} alternating runs; torch {result['torch']}, "
        f"{result['torch_threads']} threads, {result['cpus']} CPUs",
        "",
        "| candidate                                     | median s | GB/s  |",
        "|-----------------------------------------------|----------|-------|",
    ]
    labels = {
        "copy_": "(a) Tensor.copy_ per tensor",
        "codec": "(b) plan_snapshot + copy_into + encode_header",
    }
    for name, label in labels.items():
        r = result["runs"][name]
        lines.append(f"| {label:<45} | {r['median_s']:8.4f} | {r['gb_per_s']:5.2f} |")
    verdict = "meets" if result["ok"] else "MISSES"
    lines += ["", f"ratio b/a (throughput) = {result['ratio']:.3f}  ({verdict} the {TARGET_RATIO} target)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    ap.add_argument("--size-mib", type=int, default=1024, help="total state size (default 1024 MiB)")
    ap.add_argument("--tensors", type=int, default=8, help="number of fp32 tensors (default 8)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each candidate (>= 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON to this path")
    args = ap.parse_args(argv)
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.size_mib, args.tensors, args.repeats)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
