"""Checkpoint save and restore through S3 against the raw ceiling of the same server, side by side with DCP's
fsspec writer and with s3torchconnector.

moto's S3 server runs in a subprocess on a loopback port (``tiered_ckpt.testing.s3.start_s3_server``); each
round starts a fresh one (moto slows down as it fills up) and every client's objects are deleted after it ran.
On that server, in an order rotated every round, the same state (``states.py``, or ``--mib`` MiB in 8 fp32
tensors) is moved by:

* ``raw``: the ceiling. boto3 with ``--concurrency`` connections, two ways, alternating: one multipart upload
  of the state's bytes (``--part-mib`` parts, up to the concurrency in flight, each part a view of one
  contiguous copy made before the clock starts, request checksums off) and ranged GETs of the same parts into
  one pre-allocated buffer (``multipart``); and the same parts as separate objects, PUT and GET with the same
  concurrency (``objects``: a server may take whole objects faster than parts it must assemble). The ceiling is
  the faster way by median, each direction on its own. Nothing but the transfer: no encoding, no checksums, no
  commit;
* ``ours``: tiered_ckpt's CheckpointEngine, tiers ``shm`` + ``fsspec`` (``s3://``, the same part size and
  concurrency), drain in its own process: save = from ``save()`` until the S3 tier's commit (manifest last);
  the first ``WARMUP_SAVES`` (3) saves not counted (``keep: 1``: moto's memory for two steps' objects is faulted
  in by then, as the ceiling's is by its earlier transfers); restore = a new engine with the S3 tier alone,
  ``load()`` (every file's checksum verified) + ``copy_`` into the
  model's tensors;
* ``ours_split``: the same with the tier's ``split_blobs: true`` (the state's file stored as part-sized objects,
  the way the ceiling's ``objects`` moves them, instead of one multipart object);
* ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` with ``FsspecWriter`` / ``FsspecReader`` on the same
  bucket (``thread_count`` = the concurrency, so it writes that many files at once);
* ``s3tc``: ``s3torchconnector``'s DCP ``S3StorageWriter`` / ``S3StorageReader`` (its own CRT client), run by
  ``peers/s3tc.py`` in the peers environment (``benchmarks/.peers-venv``, installed from the package index on
  first use). Skipped with the reason when it cannot be installed or cannot talk to the local server.

Targets: ours' save and restore throughput >= 0.8x the raw PUT / GET ceiling, for both configurations. Prints a
table (seconds, MB/s, ratio to the ceiling) and, with ``--json PATH``, writes every sample.

    python benchmarks/bench_s3_save.py [--state fp32_1g] [--quick] [--mib N] [--rounds 3] [--concurrency 8]
                                       [--part-mib 16] [--clients raw,ours,ours_split,dcp,s3tc] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH / "peers"))  # _common puts benchmarks/ and the repository root on the path too

import _common as c  # noqa: E402
import states  # noqa: E402
import torch  # noqa: E402

from tiered_ckpt import CheckpointEngine, hookimpl  # noqa: E402
from tiered_ckpt.plugins import get_plugin_manager  # noqa: E402
from tiered_ckpt.testing.s3 import S3Server, start_s3_server  # noqa: E402

MiB = 1 << 20
CLIENTS = ("raw", "ours", "ours_split", "dcp", "s3tc")
OURS = ("ours", "ours_split")
LABELS = {"raw": "ceiling: raw parallel PUT / GET (boto3)", "ours": "tiered_ckpt (shm + fsspec s3)",
          "ours_split": "tiered_ckpt, split_blobs: true",
          "dcp": "DCP FsspecWriter / FsspecReader", "s3tc": "s3torchconnector DCP writer / reader"}
S3TC_SPEC = ["s3torchconnector==1.5.0"]
TARGET = 0.8


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    if args.mib:
        gen = torch.Generator().manual_seed(0)
        rows = max(1, args.mib * MiB // 4 // 8 // 1024)
        return {"state": {f"layer{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(8)}}
    return states.make(args.state, args.quick)


# ----- the ceiling ----------------------------------------------------------------------------------------------
def boto(server: S3Server, concurrency: int) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(max_pool_connections=concurrency, request_checksum_calculation="when_required",
                 response_checksum_validation="when_required", retries={"max_attempts": 3},
                 s3={"payload_signing_enabled": False})  # no SHA-256 of the bodies over HTTP, as the tier
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                        aws_secret_access_key=server.secret_key, region_name=server.region, config=cfg)


class _View:
    """A read-only file over a memoryview, so boto3 sends a part with no copy of our own."""

    def __init__(self, mv: memoryview):
        self.mv, self.pos = mv, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.mv) if n is None or n < 0 else min(len(self.mv), self.pos + n)
        out = self.mv[self.pos:end].tobytes()
        self.pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: len(self.mv) + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def __len__(self) -> int:
        return len(self.mv)


def raw_round(server: S3Server, bucket: str, flat: torch.Tensor, part: int, concurrency: int, way: str
              ) -> tuple[float, float]:
    """(PUT seconds, GET seconds) of ``flat``'s bytes, as one multipart object (``way="multipart"``) or as
    part-sized objects (``"objects"``), ``concurrency`` requests in flight; the GET is checked, then deleted."""
    client = boto(server, concurrency)
    mv = memoryview(flat.numpy())
    key = f"raw/{uuid.uuid4().hex}"
    ranges = [(a, min(len(mv), a + part)) for a in range(0, len(mv), part)]
    target = torch.empty_like(flat)
    tv = memoryview(target.numpy())
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        if way == "multipart":
            up = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            etags = list(pool.map(lambda i: client.upload_part(
                Bucket=bucket, Key=key, UploadId=up, PartNumber=i + 1,
                Body=_View(mv[ranges[i][0]:ranges[i][1]]))["ETag"], range(len(ranges))))
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={
                "Parts": [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]})
        else:
            list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=f"{key}/{i}",
                                                      Body=_View(mv[ranges[i][0]:ranges[i][1]])), range(len(ranges))))
        put_s = time.perf_counter() - t0

        def get(i: int) -> None:
            a, b = ranges[i]
            if way == "multipart":
                body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}")["Body"]
            else:
                body = client.get_object(Bucket=bucket, Key=f"{key}/{i}")["Body"]
            tv[a:b] = body.read()

        t0 = time.perf_counter()
        list(pool.map(get, range(len(ranges))))
        get_s = time.perf_counter() - t0
    if not torch.equal(target, flat):
        raise SystemExit(f"raw GET ({way}) returned other bytes than the PUT sent")
    if way == "multipart":
        client.delete_object(Bucket=bucket, Key=key)
    else:
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"{key}/{i}"} for i in range(len(ranges))]})
    return put_s, get_s


RAW_WAYS = ("multipart", "objects")
# Saves of ours not counted: the first waits for the drain worker to start, and the first three fault fresh memory
# into moto's process for the two steps' objects that keep: 1 holds at a time (measured: 0.4-0.5 s per GiB, steps
# 1-3 at 3.3-4.0 s, then 2.6-2.9 s; with the server's memory warmed by raw PUTs first, step 1 took 3.05 s instead
# of 3.96 s). The ceiling's PUTs reuse the memory its earlier transfers freed, so both are measured warm.
WARMUP_SAVES = 3


def raw_ceiling(ways: dict[str, dict[str, list[float]]]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """The ceiling's samples per direction: those of the faster way by median; and which way that was."""
    samples, chosen = {}, {}
    for d in ("save", "restore"):
        meds = {w: statistics.median(v[d]) for w, v in ways.items() if v[d]}
        if meds:
            chosen[d] = min(meds, key=meds.__getitem__)
            samples[d] = ways[chosen[d]][d]
        else:
            samples[d] = []
    return samples, chosen


# ----- ours ------------------------------------------------------------------------------------------------------
class _Commits:
    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.failed: list[str] = []

    @hookimpl
    def tiered_ckpt_on_event(self, event):
        if event.tier == "s3" and event.kind == "commit":
            self.seconds[event.step] = event.seconds
        elif event.kind == "commit_failed":
            self.failed.append(f"{event.tier} step {event.step}: {event.message}")


def ours_round(server: S3Server, bucket: str, items: dict[str, Any], part: int, concurrency: int, saves: int,
               split: bool = False) -> tuple[list[float], list[float], list[float]]:
    """(save() call -> committed on S3 s, of which save() blocking s, restore s) of ``saves`` warm saves (the
    first ``WARMUP_SAVES`` are not counted) and one restore per save.
    ``split``: the tier's ``split_blobs`` (the state's files as part-sized objects, no multipart upload)."""
    s3 = {"name": "s3", "kind": "fsspec", "url": f"s3://{bucket}/ours{'-split' if split else ''}",
          "options": server.storage_options(), "part_size": part, "max_concurrency": concurrency, "keep": 1,
          "split_blobs": split}
    run_id = f"s3bench-{uuid.uuid4().hex[:8]}"
    shm = tempfile.mkdtemp(prefix="bench_s3_", dir="/dev/shm")
    commits, pm = _Commits(), get_plugin_manager()
    pm.register(commits)
    total, blocking, restore = [], [], []
    try:
        with CheckpointEngine({"run_id": run_id, "tiers": [{"name": "shm", "kind": "shm", "path": shm, "slots": 2},
                                                            s3]}) as engine:
            engine.prepare(items)
            for step in range(1, 1 + WARMUP_SAVES):
                engine.save(step, items).wait()
            for step in range(1 + WARMUP_SAVES, 1 + WARMUP_SAVES + saves):
                h = engine.save(step, items)
                h.wait()
                total.append(h.blocking_s + commits.seconds[step])
                blocking.append(h.blocking_s)
        with CheckpointEngine({"run_id": f"{run_id}-r", "tiers": [s3]}) as reader:
            for _ in range(saves):
                t0 = time.perf_counter()
                res = reader.load(copy=True)
                c.copy_into(items, res.items)
                restore.append(time.perf_counter() - t0)
                if res.tier != "s3" or not res.verified:
                    raise SystemExit(f"ours restored from {res.tier!r}, verified={res.verified}")
                del res
        if commits.failed:
            raise SystemExit(f"ours: commits failed: {commits.failed}")
    finally:
        pm.unregister(commits)
        shutil.rmtree(shm, ignore_errors=True)
    return total, blocking, restore


# ----- DCP over fsspec ---------------------------------------------------------------------------------------------
def dcp_round(server: S3Server, bucket: str, items: dict[str, Any], concurrency: int, saves: int
              ) -> tuple[list[float], list[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = server.storage_options()
    save_s, load_s = [], []
    for i in range(saves):
        path = f"s3://{bucket}/dcp/step_{i}"
        t0 = time.perf_counter()
        dcp.save(items, storage_writer=FsspecWriter(path, thread_count=concurrency, **opts), no_dist=True)
        save_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load(items, storage_reader=FsspecReader(path, **opts), no_dist=True)
        load_s.append(time.perf_counter() - t0)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=opts["endpoint_url"], key=opts["key"],
                          secret=opts["secret"], client_kwargs=opts["client_kwargs"]).rm(path, recursive=True)
    return save_s, load_s


# ----- s3torchconnector, in the peers environment ---------------------------------------------------------------
def s3tc_python() -> tuple[str | None, str]:
    """The peers environment's Python with s3torchconnector installed (on first use), or None and why not."""
    sys.path.insert(0, str(BENCH))
    import run_all

    py, why = run_all.peer_python()
    if py is None:
        return None, f"no peers environment: {why}"
    stamp = run_all.PEER_VENV / ".s3tc-installed"
    if stamp.exists() and stamp.read_text() == json.dumps(S3TC_SPEC):
        return py, "s3torchconnector ready"
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--retries", "1", "--timeout", "30", *S3TC_SPEC],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-2:]
        return None, f"pip install {' '.join(S3TC_SPEC)} failed: {' | '.join(tail)}"
    r = subprocess.run([py, "-c", "import torch, s3torchconnector.dcp"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None, f"s3torchconnector does not import: {r.stderr.strip().splitlines()[-1:]}"
    stamp.write_text(json.dumps(S3TC_SPEC))
    return py, "s3torchconnector installed"


def s3tc_round(py: str, server: S3Server, bucket: str, args: argparse.Namespace, saves: int
               ) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "s3tc.json")
        spec = {"endpoint": server.endpoint, "region": server.region, "bucket": bucket, "saves": saves,
                "state": args.state, "quick": args.quick, "mib": args.mib, "part": args.part_mib * MiB,
                "threads": args.concurrency, "out": out}
        env = {**os.environ, **server.env()}
        r = subprocess.run([py, "-W", "ignore", str(BENCH / "peers" / "s3tc.py"), json.dumps(spec)], env=env,
                           capture_output=True, text=True, timeout=1200)
        if r.returncode != 0 or not os.path.exists(out):
            tail = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()][-2:]
            raise RuntimeError(f"exit {r.returncode}: {' | '.join(tail)}")
        got = json.loads(Path(out).read_text())
        return got["save_s"], got["load_s"]


# ----- the run ---------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    items = make_state(args)
    tensors = states.tensors(items)
    nbytes = states.nbytes(items)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # the ceiling's bytes, made untimed
    part = args.part_mib * MiB
    clients = [x for x in args.clients.split(",") if x]
    skipped: dict[str, str] = {}
    py = None
    if "s3tc" in clients:
        py, why = s3tc_python()
        print(why if py else f"s3torchconnector skipped: {why}", file=sys.stderr, flush=True)
        if py is None:
            skipped["s3tc"] = why
            clients.remove("s3tc")
    samples: dict[str, dict[str, list[float]]] = {k: {"save": [], "restore": []} for k in clients}
    blocking: list[float] = []
    raw_ways: dict[str, dict[str, list[float]]] = {w: {"save": [], "restore": []} for w in RAW_WAYS}
    for rnd in range(args.rounds):
        server = start_s3_server()
        try:
            bucket = server.create_bucket("bench")
            order = clients[rnd % len(clients):] + clients[:rnd % len(clients)]
            for name in order:
                t0 = time.perf_counter()
                try:
                    if name == "raw":
                        for i in range(args.saves):
                            for way in (RAW_WAYS if i % 2 == 0 else RAW_WAYS[::-1]):
                                up, down = raw_round(server, bucket, flat, part, args.concurrency, way)
                                raw_ways[way]["save"].append(up)
                                raw_ways[way]["restore"].append(down)
                    elif name in OURS:
                        tot, blk, rest = ours_round(server, bucket, items, part, args.concurrency, args.saves,
                                                    split=name == "ours_split")
                        samples[name]["save"] += tot
                        samples[name]["restore"] += rest
                        blocking += blk if name == "ours" else []
                    elif name == "dcp":
                        sv, ld = dcp_round(server, bucket, items, args.concurrency, args.saves)
                        samples[name]["save"] += sv
                        samples[name]["restore"] += ld
                    elif name == "s3tc":
                        sv, ld = s3tc_round(py, server, bucket, args, args.saves)
                        samples[name]["save"] += sv
                        samples[name]["restore"] += ld
                except (RuntimeError, OSError) as exc:
                    if name != "s3tc":
                        raise
                    skipped["s3tc"] = f"could not talk to the local S3 server: {exc}"
                    clients.remove("s3tc")
                    samples.pop("s3tc", None)
                    print(f"round {rnd + 1}: s3tc skipped: {exc}", flush=True)
                    continue
                print(f"round {rnd + 1}: {name:5s} done in {time.perf_counter() - t0:6.1f} s", flush=True)
        finally:
            server.stop()
    raw_way: dict[str, str] = {}
    if "raw" in samples:
        samples["raw"], raw_way = raw_ceiling(raw_ways)
    return {"raw_ways": raw_ways, "raw_way": raw_way,
            "bytes": nbytes, "part_bytes": part, "concurrency": args.concurrency, "rounds": args.rounds,
            "saves_per_round": args.saves, "samples": samples, "ours_blocking_s": blocking, "skipped": skipped,
            "state": f"{args.mib} MiB in 8 fp32 tensors" if args.mib else states.describe(args.state, args.quick)}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    med = {k: {d: statistics.median(v) for d, v in r.items() if v} for k, r in res["samples"].items()}
    out = []
    for direction, what in (("save", "PUT"), ("restore", "GET")):
        raw = med.get("raw", {}).get(direction)
        for name in (*OURS, "dcp", "s3tc"):
            mine = med.get(name, {}).get(direction)
            if raw and mine:
                ratio = raw / mine  # throughput ratio = ceiling seconds / client seconds
                out.append({"client": name, "direction": direction, "ratio": ratio,
                            "met": (ratio >= TARGET) if name in OURS else None,
                            "target": f"{name} {direction} throughput >= {TARGET}x the raw parallel {what}"
                            if name in OURS else f"({name} {direction} on the same measure, for information)"})
    return out


def table(res: dict[str, Any], tg: list[dict[str, Any]]) -> str:
    n = res["bytes"]
    ratio = {(t["client"], t["direction"]): t for t in tg}
    head = ["client", "save s", "save MB/s", "vs PUT ceiling", "restore s", "restore MB/s", "vs GET ceiling"]
    rows = []
    for name, r in res["samples"].items():
        cells = [LABELS[name] + ("" if name != "raw" else " [" + ", ".join(
            f"{d}: {w}" for d, w in res.get("raw_way", {}).items()) + "]")]
        for d in ("save", "restore"):
            if not r[d]:
                cells += ["-", "-", ""]
                continue
            m = statistics.median(r[d])
            t = ratio.get((name, d))
            verdict = "" if t is None else f"{t['ratio']:.2f}" + (
                "" if t["met"] is None else (" MET" if t["met"] else " MISSED"))
            cells += [f"{m:.3f} ({min(r[d]):.3f}-{max(r[d]):.3f})", f"{n / m / 1e6:.0f}", verdict]
        rows.append(cells)
    for name, why in res["skipped"].items():
        rows.append([LABELS[name], "skipped: " + why[:120], "", "", "", "", ""])
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    lines = [f"### S3 (moto on loopback): {res['state']} ({n / 2**30:.2f} GiB), part {res['part_bytes'] // MiB} MiB, "
             f"concurrency {res['concurrency']}, {res['rounds']} round(s) x {res['saves_per_round']}; "
             "medians (min-max)", "", line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
             *[line(r) for r in rows]]
    if res["ours_blocking_s"]:
        lines += ["", f"ours: save() blocked {statistics.median(res['ours_blocking_s']):.3f} s (median) of that"]
    lines += ["", "Targets:"]
    for t in tg:
        verdict = "info  " if t["met"] is None else ("MET   " if t["met"] else "MISSED")
        lines.append(f"  {verdict} {t['target']} ratio {t['ratio']:.2f}")
    if not any(t["client"] in OURS for t in tg):
        lines.append("  n/a    ours save/restore >= 0.8x the raw parallel PUT/GET: raw or ours did not run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", default="fp32_1g", choices=sorted(states.STATES))
    ap.add_argument("--quick", action="store_true", help="the state's small variant")
    ap.add_argument("--mib", type=int, default=0, help="instead of --state: MiB in 8 fp32 tensors (validation)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh server")
    ap.add_argument("--saves", type=int, default=2, help="saves (and restores) per client and round")
    ap.add_argument("--concurrency", type=int, default=8, help="connections / parts in flight, every client")
    ap.add_argument("--part-mib", type=int, default=16, help="multipart part and ranged-read size")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    res["targets"] = targets(res)
    res["table"] = table(res, res["targets"])
    print(res["table"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
