"""The CUDA path (issue #8, point 3), for a machine with a GPU: device-to-host copies into our shm slot, pinned.

Needs only this repository and torch with CUDA; tiered_ckpt's own dependencies (pluggy, PyYAML, xxhash, ...) are
needed only for the last part (the engine), which is skipped with a message where they are missing. Not part of
CI. Everything is measured on the same state (``--size-mib`` of fp32 on the GPU in ``--tensors`` tensors), each
figure the median of ``--repeats`` runs:

1. device-to-host ``copy_`` into (a) pinned memory (``torch.empty(pin_memory=True)``: the baseline), (b) pageable
   pre-faulted memory, (c) a ``/dev/shm`` slot made the way the shm tier makes one (``posix_fallocate``,
   ``MAP_SHARED``, ``MADV_POPULATE_WRITE``), as is, and (d) that slot after ``cudaHostRegister``
   (``torch.cuda.cudart().cudaHostRegister``), with the registration's own cost;
2. the same copies on a side stream while the default stream runs matmuls (a training step's stand-in): how
   long the caller blocks to enqueue them, how long until they are done, and how much the copy and the compute
   overlap (pageable slot vs registered slot);
3. the gpu tier: a raw device-to-device ``copy_`` baseline and ``CheckpointEngine.save()`` blocking time with
   tiers gpu + shm + local (first after ``prepare()`` and warm; the library copies on a side stream and the gpu
   → shm hop lands in page-locked slots, shm ``pin: auto``), the time until the shm and local tiers commit; then
   the same state saved straight into shm (no gpu tier: the device-to-host copy is the blocking part) with the
   shm tier's ``pin: true`` and ``pin: false``, each reporting whether its slots were actually registered
   (``ShmTier.is_pinned``) and its GB/s against the pinned-memory baseline of part 1.

Writes JSON to ``$OUT/cuda_check.json`` when ``$OUT`` is set (or ``--json PATH``) and prints a table. Without a
GPU it says so and exits 0 having measured nothing (``--cpu-dry-run`` runs the same code on the CPU, skipping
what needs CUDA, to check the script itself).

    python benchmarks/cuda_check.py [--size-mib 1024] [--tensors 8] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault; the slot is used from one device


# ----- helpers --------------------------------------------------------------------------------------------------
class Dev:
    """What differs between the real run (CUDA) and ``--cpu-dry-run`` (CPU, nothing pinned, no streams)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def stream(self) -> Any:
        return None if self.dry else torch.cuda.Stream()

    def use(self, stream: Any) -> Any:
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.dry)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def views_of(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append(buf[off:off + n].view(t.dtype).view(t.shape))
        off += n
    return out


def enqueue_on(dev: Dev, stream: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``copy_(non_blocking=True)`` of every tensor on ``stream`` (None: the current stream), after the work
    already queued on the current stream (what a snapshot must see)."""
    if stream is None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=True)
        return
    stream.wait_stream(torch.cuda.current_stream())  # taken before switching: the training stream
    with dev.use(stream):
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=True)


def timed_copies(dev: Dev, dst: list[torch.Tensor], src: list[torch.Tensor], repeats: int,
                 stream: Any = None) -> dict[str, Any]:
    """``copy_(non_blocking=True)`` of every tensor, then wait: (enqueue seconds, total seconds) per run."""
    enqueue, total = [], []
    for _ in range(repeats + 1):  # the first run warms up (driver staging buffers, page tables)
        dev.sync()
        t0 = time.perf_counter()
        enqueue_on(dev, stream, dst, src)
        t1 = time.perf_counter()
        (stream.synchronize() if stream is not None else dev.sync())
        enqueue.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return {"enqueue_s": median(enqueue[1:]), "total_s": median(total[1:]), "all_total_s": total[1:]}


class ShmSlot:
    """A /dev/shm file mapped MAP_SHARED and pre-faulted, as ``ShmTier.allocate_slot`` makes a slot."""

    def __init__(self, nbytes: int):
        self.root = tempfile.mkdtemp(prefix="cuda_check_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd = os.open(os.path.join(self.root, "slot.data"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            self.mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            torch.frombuffer(self.mm, dtype=torch.uint8)[::mmap.PAGESIZE].zero_()
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False

    def register(self) -> float:
        """``cudaHostRegister`` the whole mapping; returns the seconds it took."""
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        rc = cudart.cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), CUDA_HOST_REGISTER_DEFAULT)
        seconds = time.perf_counter() - t0
        torch.cuda.check_error(rc)
        self.registered = True
        return seconds

    def close(self) -> None:
        if self.registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            self.registered = False
        self.tensor = None  # type: ignore[assignment]
        shutil.rmtree(self.root, ignore_errors=True)  # the mapping goes when the last tensor over it does


def matmul_work(dev: Dev, steps: int) -> Any:
    n = 4096 if not dev.dry else 256
    a = torch.randn(n, n, device=dev.device, dtype=torch.bfloat16 if not dev.dry else torch.float32)

    def run() -> None:
        x = a
        for _ in range(steps):
            x = x @ a
            x = x / x.norm()
    return run


def overlap(dev: Dev, dst: list[torch.Tensor], src: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    """Side-stream copies while the default stream computes: blocking (enqueue) and completion times, and
    ``(compute alone + copy alone) / together`` (2.0: perfect overlap; 1.0: none)."""
    side = dev.stream()
    work = matmul_work(dev, 400)
    work()
    dev.sync()
    alone_c, alone_x, together, enqueue = [], [], [], []
    for _ in range(repeats):
        dev.sync()
        t0 = time.perf_counter()
        work()
        dev.sync()
        alone_c.append(time.perf_counter() - t0)
        alone_x.append(timed_copies(dev, dst, src, 1, side)["total_s"])
        dev.sync()
        t0 = time.perf_counter()
        enqueue_on(dev, side, dst, src)
        enqueue.append(time.perf_counter() - t0)
        work()
        dev.sync()
        together.append(time.perf_counter() - t0)
    c, x, t = median(alone_c), median(alone_x), median(together)
    return {"compute_alone_s": c, "copy_alone_s": x, "together_s": t, "overlap": (c + x) / t,
            "copy_enqueue_s": median(enqueue)}


# ----- the engine (tiered_ckpt) ---------------------------------------------------------------------------------
def engine_part(dev: Dev, tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    try:
        sys.path.insert(0, str(REPO))
        from tiered_ckpt import CheckpointEngine, hookimpl
        from tiered_ckpt.plugins import get_plugin_manager
    except Exception as exc:  # tiered_ckpt's dependencies are not installed on this machine
        return {"skipped": f"cannot import tiered_ckpt: {type(exc).__name__}: {exc}"}

    class Commits:
        def __init__(self) -> None:
            self.seconds: dict[tuple[str, int], float] = {}

        @hookimpl
        def tiered_ckpt_on_event(self, event):
            if event.kind == "commit":
                self.seconds[(event.tier, event.step)] = event.seconds

    items = {"state": {f"layer{i}.weight": t for i, t in enumerate(tensors)}}
    out: dict[str, Any] = {}
    commits = Commits()
    pm = get_plugin_manager()
    pm.register(commits)
    # pin: true needs CUDA (a ConfigError without): the dry run asks for "auto", which pins nothing on the CPU.
    runs = (("gpu_shm_local", True, "auto"), ("shm_local_pinned", False, "auto" if dev.dry else True),
            ("shm_local_unpinned", False, False))
    try:
        for name, with_gpu, pin in runs:
            shm = tempfile.mkdtemp(prefix="cuda_check_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            disk = tempfile.mkdtemp(prefix="cuda_check_")
            tiers = [{"name": "hbm", "kind": "gpu", "device": str(dev.device), "slots": 2}] if with_gpu else []
            tiers += [{"name": "shm", "kind": "shm", "path": shm, "slots": 2, "pin": pin},
                      {"name": "local", "kind": "local", "path": os.path.join(disk, "ckpt"), "keep": 1}]
            res: dict[str, Any] = {"pin": pin}
            try:
                with CheckpointEngine({"run_id": f"cuda-check-{uuid.uuid4().hex[:6]}", "tiers": tiers}) as eng:
                    t0 = time.perf_counter()
                    eng.prepare(items)
                    res["prepare_s"] = time.perf_counter() - t0
                    h = eng.save(1, items)
                    res["first_s"] = h.blocking_s
                    h.wait()
                    res["registered"] = registered_slots(eng, "shm")
                    warm, shm_s, local_s = [], [], []
                    for step in range(2, 2 + repeats):
                        h = eng.save(step, items)
                        warm.append(h.blocking_s)
                        h.wait()
                        shm_s.append(commits.seconds.get(("shm", step)))
                        local_s.append(commits.seconds.get(("local", step)))
                    res["warm_s"] = median(warm)
                    res["all_warm_s"] = warm
                    if with_gpu:
                        res["shm_commit_after_s"] = median([s for s in shm_s if s is not None])
                    res["local_commit_after_s"] = median([s for s in local_s if s is not None])
                    loaded = eng.load()
                    res["load_tier"] = loaded.tier
            except Exception as exc:
                res["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                shutil.rmtree(shm, ignore_errors=True)
                shutil.rmtree(disk, ignore_errors=True)
            out[name] = res
    finally:
        pm.unregister(commits)
    return out


def registered_slots(eng: Any, tier: str) -> list[bool] | str:
    """Per slot of ``tier``: is it page-locked (``cudaHostRegister``-ed by the library)?"""
    store = eng.pipeline.stores[tier]
    is_pinned = getattr(store.tier, "is_pinned", None)
    if is_pinned is None:
        return "unknown (this tiered_ckpt does not pin shm slots)"
    return [bool(is_pinned(store.data_key(i))) for i in range(store.nslots)]


# ----- main -----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="default: $OUT/cuda_check.json when $OUT is set")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run on the CPU, skipping CUDA-only steps")
    args = ap.parse_args(argv)
    json_path = args.json or (os.path.join(os.environ["OUT"], "cuda_check.json") if os.environ.get("OUT") else None)

    if not args.cpu_dry_run and not torch.cuda.is_available():
        why = (f"no CUDA device here (torch {torch.__version__}, built with CUDA {torch.version.cuda}): "
               "cuda_check measures the CUDA path and needs a GPU. Nothing was measured.")
        print(f"cuda_check: SKIPPED: {why}")
        if json_path:
            Path(json_path).write_text(json.dumps({"skipped": why}) + "\n")
        return 0

    dev = Dev(args.cpu_dry_run)
    nbytes = (args.size_mib << 20) // args.tensors // 4 * 4 * args.tensors
    per = nbytes // args.tensors // 4
    gen = torch.Generator(device=dev.device).manual_seed(0)
    src = [torch.randn(per, generator=gen, device=dev.device) for _ in range(args.tensors)]
    r: dict[str, Any] = {"bytes": nbytes, "tensors": args.tensors, "repeats": args.repeats, "torch": torch.__version__,
                         "cuda": torch.version.cuda, "dry_run": dev.dry,
                         "device": "cpu" if dev.dry else torch.cuda.get_device_name(0)}

    # 1. device -> host copies into four kinds of destination
    pinned = dev.pinned(nbytes)
    r["d2h_pinned"] = timed_copies(dev, views_of(pinned, src), src, args.repeats)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(0)  # pre-faulted
    r["d2h_pageable"] = timed_copies(dev, views_of(pageable, src), src, args.repeats)
    del pageable
    slot = ShmSlot(nbytes)
    slot_views = views_of(slot.tensor, src)
    r["d2h_shm_slot"] = timed_copies(dev, slot_views, src, args.repeats)
    r["overlap_shm_slot"] = overlap(dev, slot_views, src, args.repeats)
    if not dev.dry:
        try:
            r["cudaHostRegister_s"] = slot.register()
        except Exception as exc:  # reported, and the registered measurements are left out
            r["cudaHostRegister_error"] = f"{type(exc).__name__}: {exc}"
        if slot.registered:
            r["d2h_shm_slot_registered"] = timed_copies(dev, slot_views, src, args.repeats)
            r["d2h_shm_slot_registered_side_stream"] = timed_copies(dev, slot_views, src, args.repeats,
                                                                    dev.stream())
            r["overlap_shm_slot_registered"] = overlap(dev, slot_views, src, args.repeats)
    assert all(torch.equal(v, s.cpu()) for v, s in zip(slot_views, src, strict=True))
    del slot_views
    slot.close()
    r["overlap_pinned"] = overlap(dev, views_of(pinned, src), src, args.repeats)
    del pinned

    # 2. the gpu tier's device-to-device snapshot: a raw copy_ baseline, then the engine
    dbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev.device)
    r["d2d_copy"] = timed_copies(dev, views_of(dbuf, src), src, args.repeats)
    del dbuf
    r["engine"] = engine_part(dev, src, args.repeats)

    print(report(r))
    if json_path:
        Path(json_path).write_text(json.dumps(r, indent=1, default=str) + "\n")
        print(f"\nwrote {json_path}")
    return 0


def report(r: dict[str, Any]) -> str:
    n = r["bytes"]
    base = r["d2h_pinned"]["total_s"]
    dry = ", DRY RUN on CPU" if r["dry_run"] else ""
    lines = [f"cuda_check on {r['device']} (torch {r['torch']}, CUDA {r['cuda']}{dry})"
             f": {n / 2**30:.2f} GiB fp32 in {r['tensors']} tensors, medians of {r['repeats']}", "",
             "| device -> host copy into             | seconds | GB/s   | vs pinned |",
             "|---------------------------------------|---------|--------|-----------|"]
    for key, label in (("d2h_pinned", "pinned memory (baseline)"), ("d2h_pageable", "pageable memory, pre-faulted"),
                       ("d2h_shm_slot", "shm slot, not registered"),
                       ("d2h_shm_slot_registered", "shm slot, cudaHostRegister-ed"),
                       ("d2h_shm_slot_registered_side_stream", "shm slot, registered, side stream")):
        if key in r:
            s = r[key]["total_s"]
            lines.append(f"| {label:<37} | {s:7.4f} | {gbps(n, s):6.2f} | {base / s:9.2f} |")
    if "cudaHostRegister_s" in r:
        lines.append(f"\ncudaHostRegister of the slot (once, at prepare): {r['cudaHostRegister_s']:.4f} s")
    if "cudaHostRegister_error" in r:
        lines.append(f"\ncudaHostRegister of the slot FAILED: {r['cudaHostRegister_error']}")
    lines += ["", "| side-stream copy during matmuls       | enqueue s | copy s | compute s | together s | overlap |",
              "|---------------------------------------|-----------|--------|-----------|------------|---------|"]
    for key, label in (("overlap_pinned", "into pinned memory"), ("overlap_shm_slot", "into shm slot, not registered"),
                       ("overlap_shm_slot_registered", "into shm slot, registered")):
        if key in r:
            o = r[key]
            lines.append(f"| {label:<37} | {o['copy_enqueue_s']:9.4f} | {o['copy_alone_s']:6.4f} | "
                         f"{o['compute_alone_s']:9.4f} | {o['together_s']:10.4f} | {o['overlap']:7.2f} |")
    lines += ["", f"device -> device copy_ (the gpu tier's snapshot, raw): {r['d2d_copy']['total_s']:.4f} s "
              f"({gbps(n, r['d2d_copy']['total_s']):.1f} GB/s)"]
    eng = r["engine"]
    if "skipped" in eng:
        lines.append(f"engine: skipped ({eng['skipped']})")
    for name, label in (("gpu_shm_local", "tiers gpu + shm + local"),
                        ("shm_local_pinned", "tiers shm + local (no gpu)"),
                        ("shm_local_unpinned", "tiers shm + local (no gpu)")):
        e = eng.get(name)
        if not e:
            continue
        if "error" in e:
            lines.append(f"engine, {label}: error: {e['error']}")
            continue
        extra = f", shm committed {e['shm_commit_after_s']:.3f} s after" if "shm_commit_after_s" in e else ""
        pinned = e.get("registered")
        pinned = (f"{sum(pinned)}/{len(pinned)} shm slots registered" if isinstance(pinned, list)
                  else f"shm slots registered: {pinned}")
        pin = str(e.get("pin")).lower()
        lines.append(f"engine, {label} (shm pin: {pin}): save() blocking first {e['first_s']:.4f} s, warm "
                     f"{e['warm_s']:.4f} s ({gbps(n, e['warm_s']):.1f} GB/s, {base / e['warm_s']:.2f} of pinned "
                     f"copy_){extra}, local committed {e['local_commit_after_s']:.3f} s after; prepare "
                     f"{e['prepare_s']:.3f} s; {pinned}; load() from {e['load_tier']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
