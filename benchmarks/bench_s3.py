"""The S3 tier against s3fs's own transfers: 1 GiB of checkpoint files to and from a local S3 server.

moto's S3 server runs in a subprocess on a loopback port (``tiered_ckpt.testing.s3.start_s3_server``). The same
files (default 8 x 128 MiB of random bytes, on /dev/shm so the disk is not what is measured) are

* uploaded and downloaded by the ``fsspec`` tier (``write_blob`` from a read-only mapping of each file: no copy;
  ``read_blob`` into a tensor, written back to a file), one file after the other, and
* uploaded and downloaded by s3fs's own ``put_file``/``get_file``, one file after the other, with the same part
  size and concurrency; and by one batched ``put``/``get`` of all files (s3fs then also moves several files
  at once: more concurrency than the others, shown for reference).

Each client's measurement gets a fresh server (moto slows down as it fills up) and the order rotates between
rounds. Every download is checked against the original bytes. Prints a table (seconds, MB/s, ours/s3fs) and, with
``--json PATH``, writes the numbers.

    python benchmarks/bench_s3.py [--files 8] [--file-mib 128] [--part-mib 16] [--concurrency 8] [--repeat 1]
                                  [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_ckpt.testing.s3 import start_s3_server  # noqa: E402
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier  # noqa: E402

MiB = 1 << 20


def make_files(root: str, count: int, nbytes: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(count):
        path = os.path.join(root, f"iter_0000001/rank_{i:05d}/state.flat")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        with open(path, "wb") as f:
            f.write(data.numpy().tobytes())
        paths.append(path)
    return paths


def same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(64 * MiB), fb.read(64 * MiB)
            if x != y:
                return False
            if not x:
                return True


def timed(fn: Callable[[], None]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(name: str, server: Any, paths: list[str], rel: list[str], part: int, concurrency: int,
            dst: str) -> tuple[float, float]:
    """(upload, download) seconds of one client moving every file; the downloads are checked."""
    import s3fs

    bucket = server.create_bucket("bench")
    if name == "ours":
        tier = FsspecTier("s3", FsspecOptions(url=f"s3://{bucket}/ours", options=server.storage_options(),
                                              part_size=part, max_concurrency=concurrency))

        def up() -> None:
            for p, key in zip(paths, rel, strict=True):
                with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                    view = memoryview(mm)
                    try:
                        tier.write_blob(key, [view])  # a read-only mapping of the file: no copy
                    finally:
                        view.release()

        def down() -> None:
            for key in rel:
                out = tier.read_blob(key)
                target = os.path.join(dst, key)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(memoryview(out.numpy()))
    else:
        fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key=server.access_key, secret=server.secret_key,
                               client_kwargs={"region_name": server.region}, skip_instance_cache=True,
                               max_concurrency=concurrency, default_block_size=part)
        remote = [f"{bucket}/{name}/{k}" for k in rel]
        local = [os.path.join(dst, k) for k in rel]

        def up() -> None:
            if name == "s3fs_batch":
                fs.put(paths, remote, chunksize=part, max_concurrency=concurrency)
                return
            for p, r in zip(paths, remote, strict=True):
                fs.put_file(p, r, chunksize=part, max_concurrency=concurrency)

        def down() -> None:
            for t in local:
                os.makedirs(os.path.dirname(t), exist_ok=True)
            if name == "s3fs_batch":
                fs.get(remote, local, chunksize=part, max_concurrency=concurrency)
                return
            for r, t in zip(remote, local, strict=True):
                fs.get_file(r, t, chunksize=part, max_concurrency=concurrency)

    up_s = timed(up)
    down_s = timed(down)
    for p, key in zip(paths, rel, strict=True):
        if not same_bytes(p, os.path.join(dst, key)):
            raise SystemExit(f"{name}: downloaded {key} differs from the original")
    shutil.rmtree(dst)
    return up_s, down_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=128)
    ap.add_argument("--part-mib", type=int, default=16, help="part size (ours) = chunksize (s3fs)")
    ap.add_argument("--concurrency", type=int, default=8, help="parallel parts / ranges per file, both")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every measurement (median reported)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    nbytes = args.file_mib * MiB
    total = args.files * nbytes
    part = args.part_mib * MiB
    work = tempfile.mkdtemp(prefix="tiered_ckpt_bench_s3_", dir=args.dir)
    names = ("ours", "s3fs", "s3fs_batch")
    results: dict[str, dict[str, list[float]]] = {n: {"upload": [], "download": []} for n in names}
    try:
        src_root = os.path.join(work, "src")
        paths = make_files(src_root, args.files, nbytes)
        rel = [os.path.relpath(p, src_root) for p in paths]
        for rnd in range(args.repeat):
            # Each measurement gets a fresh server (moto slows down as it fills), in a rotating order.
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                server = start_s3_server()
                try:
                    up, down = measure(name, server, paths, rel, part, args.concurrency, os.path.join(work, "dst"))
                finally:
                    server.stop()
                results[name]["upload"].append(up)
                results[name]["download"].append(down)
                print(f"round {rnd + 1}: {name:10s} upload {up:6.2f} s  download {down:6.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {n: {d: statistics.median(v) for d, v in r.items()} for n, r in results.items()}
    mbps = {n: {d: total / s / 1e6 for d, s in r.items()} for n, r in med.items()}
    rows = []
    for direction in ("upload", "download"):
        for name, label in (("ours", "tiered_ckpt fsspec tier"), ("s3fs", "s3fs put_file/get_file"),
                            ("s3fs_batch", "s3fs put/get (batched)")):
            ratio = mbps["ours"][direction] / mbps[name][direction]
            rows.append([direction, label, f"{med[name][direction]:.2f}", f"{mbps[name][direction]:.0f}",
                         "-" if name == "ours" else f"{ratio:.2f}"])
    headers = ["direction", "client", "seconds", "MB/s", "ours/this"]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print(f"{args.files} files x {args.file_mib} MiB = {total / MiB:.0f} MiB; part {args.part_mib} MiB, "
          f"concurrency {args.concurrency}; moto S3 server on loopback; median of {args.repeat}")
    for i, r in enumerate([headers, *rows]):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "files": args.files, "file_bytes": nbytes, "total_bytes": total, "part_bytes": part,
            "concurrency": args.concurrency, "repeat": args.repeat, "seconds": results, "median_seconds": med,
            "mb_per_s": mbps,
            "ratio_ours_over_s3fs": {d: mbps["ours"][d] / mbps["s3fs"][d] for d in ("upload", "download")},
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
