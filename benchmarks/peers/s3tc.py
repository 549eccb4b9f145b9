"""s3torchconnector's DCP writer and reader against the benchmark's local S3 server (``bench_s3_save.py``), run
with the peers environment's Python (s3torchconnector is installed there, not in the project's venv).

Its DCP classes take a region and an ``s3://`` path but no endpoint, so their file system is rebuilt on an
``S3Client`` pointed at the local server (path-style addressing, the same part size as the other clients);
credentials come from the AWS_* environment the caller sets. One argument, a JSON spec: ``endpoint``, ``region``,
``bucket``, ``saves``, ``state``, ``quick``, ``mib``, ``part``, ``threads`` (its writer's thread_count), ``out``.
Writes {"save_s": [...], "load_s": [...]}.
"""

from __future__ import annotations

import json
import sys
import time

import _common as c
import torch


def main() -> int:
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    spec = json.loads(sys.argv[1])
    if spec["mib"]:  # the same tensors as bench_s3_save.make_state
        gen = torch.Generator().manual_seed(0)
        rows = max(1, spec["mib"] * (1 << 20) // 4 // 8 // 1024)
        items = {"state": {f"layer{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(8)}}
    else:
        items = c.states.make(spec["state"], spec["quick"])
    cfg = S3ClientConfig(force_path_style=True, part_size=spec["part"])
    region, endpoint = spec["region"], spec["endpoint"]

    def fs(**kw) -> S3FileSystem:
        return S3FileSystem(region, s3_client=S3Client(region, endpoint=endpoint, s3client_config=cfg), **kw)

    save_s, load_s = [], []
    for i in range(spec["saves"]):
        path = f"s3://{spec['bucket']}/s3tc/step_{i}"
        writer = S3StorageWriter(region, path, s3client_config=cfg, thread_count=spec["threads"])
        writer.fs = fs()
        writer.path = writer.fs.init_path(path)
        t0 = time.perf_counter()
        dcp.save(items, storage_writer=writer, no_dist=True)
        save_s.append(time.perf_counter() - t0)
        reader = S3StorageReader(region, path, s3client_config=cfg)
        reader.fs = fs(reader_constructor=reader._reader_constructor)
        reader.path = reader.fs.init_path(path)
        t0 = time.perf_counter()
        dcp.load(items, storage_reader=reader, no_dist=True)
        load_s.append(time.perf_counter() - t0)
    c.write_result(spec["out"], {"save_s": save_s, "load_s": load_s})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
