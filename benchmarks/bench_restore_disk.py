"""Restore of a Megatron-shaped checkpoint (``torch``-codec files) from the local disk, page cache dropped.

Saves ``states.make("megatron_2g")`` once with a ``CheckpointEngine`` (tiers shm + local, layout ``rank_sharded``,
as ``peers/ours.py`` does), then alternates, ``--repeats`` times:

* ``ours``: drop the files from the page cache, a new engine with only the local tier, ``load(copy=True)`` (checksums
  verified, restricted unpickler) and a copy into the original tensors (what ``load_state_dict`` does);
* ``torch``: drop the cache, ``torch.load(path, weights_only=False)`` of the same files and the same copy;
* ``old_path``: drop the cache, what ``load()`` did for these files before (``LocalTier.read_blob``, a second
  pass to hash, ``safe_load.load_bytes`` copying every storage out of the buffer) and the same copy: the
  before/after comparison within one run, on the same machine load.

The order of the three rotates every round; ``peak_growth_mib`` is the kernel's peak RSS of this process during
one restore over its RSS before it (``ours`` holds both files' tensors at once, as ``load()`` returns them; the
other two free each file's result after copying it). Prints medians and writes every sample to
``benchmarks/results/restore_disk.json`` under ``--label`` (runs with other labels already there are kept, so
``before`` and ``after`` sit side by side).

    .venv/bin/python benchmarks/bench_restore_disk.py [--quick] [--repeats 5] [--label after] [--workdir DIR]
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
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))  # _common puts benchmarks/ and the repository root on the path too

import _common as c  # noqa: E402
import torch  # noqa: E402
from ours import config  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402
from tiered_ckpt.checksum import digest  # noqa: E402
from tiered_ckpt.hostmem import populated_empty  # noqa: E402
from tiered_ckpt.megatron import safe_load  # noqa: E402
from tiered_ckpt.tiers.base import as_memoryview  # noqa: E402

RESULTS = BENCH / "results" / "restore_disk.json"


def torch_files(root: str) -> dict[str, str]:
    """item name -> path of every ``.pt`` file under ``root`` (the ``torch`` codec's files of the one step)."""
    found = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.endswith(".pt") and not n.startswith("."):
                found[n[:-3]] = os.path.join(dirpath, n)
    return found


def peak_window() -> int:
    """Start a memory window: settle, reset the kernel's peak RSS; returns the RSS at the start."""
    c.settle()
    c.reset_peak_rss()
    return c.proc_status().get("VmRSS", 0)


def peak_growth_mib(start: int) -> float:
    return (c.proc_status().get("VmHWM", 0) - start) / c.MIB


def run_ours(run_id: str, local: str, items: dict[str, Any], check: bool) -> dict[str, float]:
    engine = CheckpointEngine(config(run_id, None, local))
    try:
        c.drop_cache(local)
        start = peak_window()
        t0 = time.perf_counter()
        res = engine.load(copy=True)
        t1 = time.perf_counter()
        c.copy_into(items, res.items)
        t2 = time.perf_counter()
        grew = peak_growth_mib(start)
        assert res.tier == "local" and res.verified, (res.tier, res.verified)
        if check:
            assert c.same_tensors(items, res.items), "the restore returned other values"
        del res
    finally:
        engine.close()
    return {"total_s": t2 - t0, "load_s": t1 - t0, "peak_growth_mib": grew}


def _timed_files(local: str, files: dict[str, str], items: dict[str, Any], load: Any) -> dict[str, float]:
    """Drop the cache, then ``load(path)`` each file and copy it into the items' tensors; times and peak."""
    c.drop_cache(local)
    start = peak_window()
    load_s = 0.0
    t0 = time.perf_counter()
    for item, path in files.items():
        t = time.perf_counter()
        obj = load(path)
        load_s += time.perf_counter() - t
        c.copy_into(items[item], obj)
        del obj
    total = time.perf_counter() - t0
    return {"total_s": total, "load_s": load_s, "peak_growth_mib": peak_growth_mib(start)}


def run_torch(local: str, files: dict[str, str], items: dict[str, Any]) -> dict[str, float]:
    return _timed_files(local, files, items, lambda path: torch.load(path, weights_only=False))


def _old_read(path: str) -> torch.Tensor:
    """How ``LocalTier.read_blob`` read before ``hostmem.read_file``: populate the whole buffer, then one
    ``readinto``."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        out = populated_empty(size)
        view, pos = memoryview(out.numpy()), 0
        while pos < size:
            pos += f.readinto(view[pos:pos + (1 << 30)])
    return out


def run_old_path(local: str, files: dict[str, str], items: dict[str, Any]) -> dict[str, float]:
    """The path ``load()`` took for these files before ``Tier.read_blob_hashed`` and ``safe_load.load_views``:
    the old ``read_blob`` (populate, then one ``readinto``), a second pass to hash, and ``load_bytes`` (which
    copies every storage out of that buffer)."""
    def load(path: str) -> Any:
        blob = _old_read(path)
        digest(blob)
        return safe_load.load_bytes(as_memoryview(blob), where=path)

    return _timed_files(local, files, items, load)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 0.49 GiB variant of the state")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default="run", help="the key this run is stored under in the JSON")
    ap.add_argument("--workdir", default=None, help="a directory on the local disk (default: a temp dir)")
    ap.add_argument("--note", default="", help="what code this run measured, stored with it")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()

    items = c.states.make("megatron_2g", args.quick)
    nbytes = c.states.nbytes(items)
    work = tempfile.mkdtemp(prefix="bench_restore_disk_", dir=args.workdir)
    shm = tempfile.mkdtemp(prefix="bench_restore_disk_", dir="/dev/shm")
    local = os.path.join(work, "ckpt")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    samples: dict[str, list[dict[str, float]]] = {"ours": [], "torch": [], "old_path": []}
    try:
        with CheckpointEngine(config(run_id, shm, local)) as engine:
            engine.save(1, items).wait()
        shutil.rmtree(shm, ignore_errors=True)  # its slots are not needed: free the memory
        files = torch_files(local)
        assert set(files) == set(items), (sorted(files), sorted(items))
        sizes = {k: os.path.getsize(p) for k, p in files.items()}
        file_bytes = sum(sizes.values())
        runs = [("ours", lambda i: run_ours(run_id, local, items, check=i == 0)),
                ("torch", lambda i: run_torch(local, files, items)),
                ("old_path", lambda i: run_old_path(local, files, items))]
        for i in range(args.repeats):
            for k in range(len(runs)):
                name, fn = runs[(i + k) % len(runs)]
                samples[name].append(fn(i))
                print(f"  round {i}: {name:9s} " + "  ".join(f"{key} {v:.3f}" for key, v in samples[name][-1].items()),
                      flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    medians = {name: {key: statistics.median(s[key] for s in rows) for key in rows[0]}
               for name, rows in samples.items()}
    result = {"note": args.note, "state": "megatron_2g" + ("-quick" if args.quick else ""), "state_bytes": nbytes,
              "file_bytes": file_bytes, "files": sizes,
              "repeats": args.repeats, "torch": torch.__version__, "cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "median": medians, "samples": samples}
    print(f"\nmegatron_2g{' (quick)' if args.quick else ''}: {file_bytes / 2**30:.2f} GiB in {len(files)} files, "
          f"medians of {args.repeats}:")
    for name, m in medians.items():
        print(f"  {name:9s} " + "  ".join(f"{key} {v:.3f}" for key, v in m.items()))
    print(f"  ours / torch (total): {medians['ours']['total_s'] / medians['torch']['total_s']:.2f}x")

    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc.setdefault("runs", {})[args.label] = result
    doc["description"] = __doc__.split("\n\n")[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} (label {args.label!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
