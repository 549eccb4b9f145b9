"""The S3 tier against s3fs's own transfers: 1 GiB of checkpoint files to and from a local S3 server.

moto's S3 server runs in a subprocess on a loopback port (``tiered_ckpt.testing.s3.start_s3_server``). The same
files (default 8 x 128 MiB of random bytes, on /dev/shm so the disk is not what is measured) are moved

* by the ``fsspec`` tier: ``write_blob`` from a read-only mapping of the file (no copy), ``read_blob`` into a
  tensor that is written back to a file;
* by s3fs's own ``put_file`` / ``get_file`` with the same part size and concurrency;
* for reference, by one batched s3fs ``put`` / ``get`` of all files (s3fs then also moves several files at
  once: more concurrency than the other two, which move one file at a time as a rank's drain does).

The first two are interleaved file by file on one server (upload, download, delete; who goes first alternates),
so both see the same machine load and the same server state; each round starts a fresh server (moto slows down
as it fills up), and the batched reference gets its own. Every download is checked against the original bytes.
Prints a table (seconds, MB/s, ours/s3fs) and, with ``--json PATH``, writes the numbers.

    python benchmarks/bench_s3.py [--files 8] [--file-mib 128] [--part-mib 16] [--concurrency 8] [--repeat 3]
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

from tiered_ckpt.testing.s3 import S3Server, start_s3_server  # noqa: E402
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier  # noqa: E402

MiB = 1 << 20
CLIENTS = ("ours", "s3fs", "s3fs_batch")
LABELS = {"ours": "tiered_ckpt fsspec tier", "s3fs": "s3fs put_file/get_file", "s3fs_batch": "s3fs put/get (batched)"}


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


def check_same(a: str, b: str) -> None:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(64 * MiB), fb.read(64 * MiB)
            if x != y:
                raise SystemExit(f"{b} differs from {a}")
            if not x:
                return


def timed(fn: Callable[..., Any], *args: Any) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def s3fs_for(server: S3Server, part: int, concurrency: int) -> Any:
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=server.endpoint, key=server.access_key, secret=server.secret_key,
                             client_kwargs={"region_name": server.region}, skip_instance_cache=True,
                             max_concurrency=concurrency, default_block_size=part)


def round_interleaved(paths: list[str], rel: list[str], part: int, concurrency: int, work: str
                      ) -> dict[str, tuple[float, float]]:
    """Ours and s3fs's put_file/get_file, file by file on one fresh server: {client: (upload s, download s)}."""
    server = start_s3_server()
    try:
        bucket = server.create_bucket("bench")
        tier = FsspecTier("s3", FsspecOptions(url=f"s3://{bucket}/ours", options=server.storage_options(),
                                              part_size=part, max_concurrency=concurrency))
        fs = s3fs_for(server, part, concurrency)

        def ours_up(path: str, key: str) -> None:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                view = memoryview(mm)
                try:
                    tier.write_blob(key, [view])  # a read-only mapping of the file: no copy
                finally:
                    view.release()

        def ours_down(key: str, target: str) -> None:
            out = tier.read_blob(key)
            with open(target, "wb") as f:
                f.write(memoryview(out.numpy()))

        def s3fs_up(path: str, key: str) -> None:
            fs.put_file(path, f"{bucket}/s3fs/{key}", chunksize=part, max_concurrency=concurrency)

        def s3fs_down(key: str, target: str) -> None:
            fs.get_file(f"{bucket}/s3fs/{key}", target, chunksize=part, max_concurrency=concurrency)

        ops = {"ours": (ours_up, ours_down), "s3fs": (s3fs_up, s3fs_down)}
        totals = {n: [0.0, 0.0] for n in ops}
        for i, (path, key) in enumerate(zip(paths, rel, strict=True)):
            order = ("ours", "s3fs") if i % 2 == 0 else ("s3fs", "ours")
            for name in order:
                totals[name][0] += timed(ops[name][0], path, key)
            for name in order:
                target = os.path.join(work, f"{name}.out")
                totals[name][1] += timed(ops[name][1], key, target)
                check_same(path, target)
                os.unlink(target)
            tier.delete(key)
            fs.rm_file(f"{bucket}/s3fs/{key}")
        return {n: (up, down) for n, (up, down) in totals.items()}
    finally:
        server.stop()


def round_batched(paths: list[str], rel: list[str], part: int, concurrency: int, work: str) -> tuple[float, float]:
    server = start_s3_server()
    try:
        bucket = server.create_bucket("bench")
        fs = s3fs_for(server, part, concurrency)
        remote = [f"{bucket}/batch/{k}" for k in rel]
        local = [os.path.join(work, "batch", k) for k in rel]
        for t in local:
            os.makedirs(os.path.dirname(t), exist_ok=True)
        up = timed(lambda: fs.put(paths, remote, chunksize=part, max_concurrency=concurrency))
        down = timed(lambda: fs.get(remote, local, chunksize=part, max_concurrency=concurrency))
        for p, t in zip(paths, local, strict=True):
            check_same(p, t)
        shutil.rmtree(os.path.join(work, "batch"))
        return up, down
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=128)
    ap.add_argument("--part-mib", type=int, default=16, help="part size (ours) = chunksize (s3fs)")
    ap.add_argument("--concurrency", type=int, default=8, help="parallel parts / ranges per file, both")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (the median is reported)")
    ap.add_argument("--no-batched", action="store_true", help="skip the batched s3fs reference")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    nbytes = args.file_mib * MiB
    total = args.files * nbytes
    part = args.part_mib * MiB
    names = CLIENTS[:2] if args.no_batched else CLIENTS
    results: dict[str, dict[str, list[float]]] = {n: {"upload": [], "download": []} for n in names}
    work = tempfile.mkdtemp(prefix="tiered_ckpt_bench_s3_", dir=args.dir)
    try:
        paths = make_files(os.path.join(work, "src"), args.files, nbytes)
        rel = [os.path.relpath(p, os.path.join(work, "src")) for p in paths]
        for rnd in range(args.repeat):
            measured = round_interleaved(paths, rel, part, args.concurrency, work)
            if not args.no_batched:
                measured["s3fs_batch"] = round_batched(paths, rel, part, args.concurrency, work)
            for name, (up, down) in measured.items():
                results[name]["upload"].append(up)
                results[name]["download"].append(down)
                print(f"round {rnd + 1}: {name:10s} upload {up:6.2f} s  download {down:6.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {n: {d: statistics.median(v) for d, v in r.items()} for n, r in results.items()}
    mbps = {n: {d: total / s / 1e6 for d, s in r.items()} for n, r in med.items()}
    rows = []
    for direction in ("upload", "download"):
        for name in names:
            ratio = "-" if name == "ours" else f"{mbps['ours'][direction] / mbps[name][direction]:.2f}"
            rows.append([direction, LABELS[name], f"{med[name][direction]:.2f}", f"{mbps[name][direction]:.0f}",
                         ratio])
    headers = ["direction", "client", "seconds", "MB/s", "ours/this"]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print(f"{args.files} files x {args.file_mib} MiB = {total / MiB:.0f} MiB; part {args.part_mib} MiB, "
          f"concurrency {args.concurrency}; moto S3 server on loopback; median of {args.repeat} rounds")
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
