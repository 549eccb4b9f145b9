"""The ``fsspec`` tier on S3 over real HTTP (moto's server), through a fault-injecting proxy.

Engine-level: shm (or staging) + an s3 tier, thread drain mode. Covers: parallel multipart uploads and parallel
ranged reads; SlowDown / 500 / connection resets / stalls on parts, on the manifest PUT and on reads, retried
and committed; a deadline that runs out (nothing partial visible, no multipart upload left); a bucket read with
plain boto3; credentials kept out of events, logs and reprs.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import assert_same

from tiered_ckpt import CheckpointEngine, NoCheckpointError, SaveError
from tiered_ckpt.checksum import ALGORITHM, digest
from tiered_ckpt.cli import EXIT_NOT_FOUND, EXIT_UNREADABLE
from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.errors import CheckpointUnreadableError, ConfigError, CorruptionError
from tiered_ckpt.testing.s3 import S3FaultProxy, S3Server, s3_operation
from tiered_ckpt.tiers import _s3
from tiered_ckpt.tiers._s3 import RequestBody
from tiered_ckpt.tiers.base import StableChunks, StableStream
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier, redact, redacted_options, secret_values
from tiered_ckpt.tiers.s3 import S3Tier
from tiered_ckpt.validate import build_dataclass

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
PART = 5 * MiB  # S3's minimum part size (moto enforces it)
FAST_RETRY = {"attempts": 6, "initial_s": 0.05, "max_s": 0.2, "deadline_s": 60}
STEP_KEY = "iter_{:07d}/rank_00000/state.flat"
MANIFEST = r"iter_\d{7}/tiered_ckpt/manifest\.json$"


def make_state(seed: int, mib: int = 16) -> dict:
    """A small item and a ~``mib`` MiB one (several 5 MiB parts), in that order."""
    g = torch.Generator().manual_seed(seed)
    return {"meta": {"step": torch.tensor(seed), "lr": torch.tensor([1e-3 * (seed + 1)])},
            "state": {"w": torch.randn(mib * MiB // 4, generator=g),
                      "b": torch.randn(1000, generator=g).to(torch.bfloat16)}}


@dataclass
class Remote:
    """Where the s3 tier of a test writes: a fresh bucket and prefix, reached through the fault proxy."""

    server: S3Server
    proxy: S3FaultProxy
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def tier(self, *, direct: bool = False, **kw: Any) -> dict:
        storage = self.server.storage_options() if direct else self.proxy.storage_options()
        return {"name": "s3", "kind": "fsspec", "url": self.url, "options": storage, "part_size": PART,
                "max_concurrency": 4, "timeout_s": 5, "retry": FAST_RETRY, **kw}

    def keys(self) -> list[str]:
        client = self.server.client()
        out = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            out += [o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", [])]
        return sorted(out)

    def uploads_in_progress(self) -> list[dict]:
        return self.server.client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])


@pytest.fixture
def remote(s3_server, s3_bucket, s3_fault_proxy) -> Remote:
    return Remote(s3_server, s3_fault_proxy, s3_bucket, f"run-{uuid.uuid4().hex[:8]}")


def config(shm_root, *tiers: dict, local: Any = None) -> dict:
    entry = [{"name": "shm", "kind": "shm", "path": str(shm_root)}]
    if local is not None:
        entry.append({"name": "local", "kind": "local", "path": str(local), "fsync": False})
    return {"run_id": f"s{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [*entry, *tiers]}


def load_from_s3(remote: Remote, **tier_kw: Any):
    """A new engine with the s3 tier alone (saves stage in memory): load() must read from S3."""
    cfg = {"run_id": f"r{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [remote.tier(**tier_kw)]}
    with CheckpointEngine(cfg) as engine:
        return engine.load()


# ----- 1. parallel multipart upload, parallel ranged reads, bit-exact ---------------------------------------
def test_multipart_upload_and_ranged_reads_are_parallel_and_bit_exact(remote, shm_root, recorder):
    items = make_state(1)
    with CheckpointEngine(config(shm_root, remote.tier())) as engine:
        handle = engine.save(10, items)
        handle.wait(timeout=60)
        assert handle.results == {"s3": True}
    proxy = remote.proxy
    state_key = STEP_KEY.format(10)
    parts = [r for r in proxy.ops("UploadPart") if r.path.endswith(state_key)]
    assert len(parts) == 4 and sorted(r.part_number for r in parts) == [1, 2, 3, 4]  # 16 MiB in 5 MiB parts
    assert all(r.bytes_in == PART for r in parts if r.part_number < 4)
    assert proxy.max_in_flight("UploadPart") >= 2, "parts were uploaded one after the other"
    (create,) = [r for r in proxy.ops("CreateMultipartUpload") if r.path.endswith(state_key)]
    (complete,) = [r for r in proxy.ops("CompleteMultipartUpload") if r.path.endswith(state_key)]
    assert create.end <= min(r.start for r in parts) and complete.start >= max(r.end for r in parts)
    # Small files are single PUTs; the checkpoint manifest is the last data PUT, the tracker after it.
    puts = proxy.ops("PutObject")
    (manifest,) = [r for r in puts if r.path.endswith("tiered_ckpt/manifest.json")]
    assert manifest.start >= complete.end
    assert all(manifest.start >= r.end for r in puts if "/iter_" in r.path and r is not manifest)
    tracker = [r for r in puts if r.path.endswith("latest_checkpointed_iteration.txt")]
    assert tracker and tracker[-1].start >= manifest.end
    assert remote.uploads_in_progress() == []

    proxy.reset_log()
    loaded = load_from_s3(remote)
    assert (loaded.step, loaded.tier, loaded.verified) == (10, "s3", True)
    assert_same(items, loaded.items)
    gets = [r for r in proxy.ops("GetObject") if r.path.endswith(state_key)]
    assert all(r.range and r.range.startswith("bytes=") for r in gets)
    assert sorted(int(r.range[6:].split("-")[0]) for r in gets) == [0, PART, 2 * PART, 3 * PART]
    assert len(gets) == 4 and proxy.max_in_flight("GetObject") >= 2, "ranges were read one after the other"


def test_large_chunks_go_out_without_copies_and_small_ones_in_bounded_buffers(remote, monkeypatch):
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, options=remote.proxy.storage_options(), part_size=PART,
                                          max_concurrency=2))
    assert isinstance(tier, S3Tier) and tier.kind == "fsspec"  # the fsspec kind's class for s3:// URLs
    taken = []
    real_take = _s3.Upload._take_buffer

    def spy(self):
        buf = real_take(self)
        taken.append(self.allocated)
        return buf

    monkeypatch.setattr(_s3.Upload, "_take_buffer", spy)
    data = torch.randint(0, 256, (4 * PART + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert tier.write_blob("big", [data]) == data.numel()  # one chunk of 4 whole parts: borrowed, not copied
    assert len(taken) == 1  # only the 123-byte tail was gathered into a buffer
    assert torch.equal(tier.read_blob("big"), data)

    taken.clear()
    buf = bytearray(256 * 1024)

    def reused():  # a producer that reuses one buffer: each chunk must be consumed before the next
        for i in range(0, data.numel(), len(buf)):
            piece = data[i:i + len(buf)].numpy().tobytes()
            buf[:len(piece)] = piece
            yield memoryview(buf)[:len(piece)]

    assert tier.write_blob("small-chunks", reused()) == data.numel()
    assert max(taken) <= 3, f"{max(taken)} part buffers for max_concurrency=2"
    assert torch.equal(tier.read_blob("small-chunks"), data)

    taken.clear()
    window = torch.empty(2 * PART, dtype=torch.uint8)

    def reused_large():  # borrowed parts must have landed before the producer overwrites its buffer
        for i in range(2):
            window.copy_(data[i * 2 * PART:(i + 1) * 2 * PART])
            yield window

    assert tier.write_blob("reused-large", reused_large()) == 4 * PART
    assert taken == [] and torch.equal(tier.read_blob("reused-large"), data[:4 * PART])


def test_stable_chunks_go_out_as_views_whatever_their_sizes(remote, monkeypatch):
    """Chunks that stay as they are until the write returns (StableChunks: a pinned slot's views) are never copied:
    parts are views of them, a part may span several chunks, and a part spanning chunks is still exact."""
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, options=remote.proxy.storage_options(), part_size=PART,
                                          max_concurrency=2))
    taken = []
    real_take = _s3.Upload._take_buffer
    monkeypatch.setattr(_s3.Upload, "_take_buffer", lambda self: taken.append(self.key) or real_take(self))
    data = torch.randint(0, 256, (4 * PART + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    cuts = [0, 4096, MiB + 3, PART + 1, 3 * PART - 7, 3 * PART - 6, data.numel()]  # a header, odd and tiny pieces
    pieces = StableChunks(data[a:b] for a, b in zip(cuts, cuts[1:], strict=False))
    remote.proxy.reset_log()
    assert tier.write_blob("big", pieces) == data.numel()
    parts = sorted((r.part_number, r.bytes_in) for r in remote.proxy.ops("UploadPart"))
    assert parts == [(1, PART), (2, PART), (3, PART), (4, PART), (5, 123)]
    assert torch.equal(tier.read_blob("big"), data)
    small = StableChunks([data[:10], data[10:MiB]])  # under one part: one PUT of both pieces
    assert tier.write_blob("small", small) == MiB and torch.equal(tier.read_blob("small"), data[:MiB])
    assert taken == [] and remote.uploads_in_progress() == []


def test_small_stable_pieces_are_joined_within_a_part(remote, monkeypatch):
    """A stable stream of many small pieces (a torch-format file's headers and small tensors) goes out as a few
    views per part: runs of pieces under JOIN_BELOW are joined into one buffer, large pieces stay views."""
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, options=remote.proxy.storage_options(), part_size=PART,
                                          max_concurrency=2))
    sent = []
    real_submit = _s3.Upload._submit
    monkeypatch.setattr(_s3.Upload, "_submit", lambda self, views, owner: sent.append(len(views)) or
                        real_submit(self, views, owner))
    data = torch.randint(0, 256, (2 * PART + 5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    cuts = list(range(0, PART, 1000)) + [PART + 17, 2 * PART - 3] + list(range(2 * PART, data.numel(), 100))
    cuts.append(data.numel())
    pieces = StableStream(data[a:b] for a, b in zip(cuts, cuts[1:], strict=False))
    assert tier.write_blob("many", pieces) == data.numel()
    assert torch.equal(tier.read_blob("many"), data)
    assert len(cuts) > 1000 and max(sent) <= 3, sent  # small runs joined, the large pieces as they are
    assert remote.uploads_in_progress() == []


def test_a_request_body_reads_and_iterates_its_views_in_order():
    """botocore reads the body as a file (``read``, ``seek``, ``tell``, ``len``), aiohttp iterates it: the same
    bytes, from wherever the reader stands, in slices no larger than ``SLICE``."""
    import asyncio

    a, b = memoryview(bytes(range(256)) * 9), memoryview(b"xyz" * 700)
    whole = bytes(a) + bytes(b)
    body = RequestBody(a[:100], memoryview(b""), a[100:], b)
    assert len(body) == len(whole) and body.read(10) == whole[:10] and body.tell() == 10
    assert body.read() == whole[10:] and body.read() == b""

    async def sent(start: int) -> list[bytes]:
        body.seek(start)
        return [bytes(piece) async for piece in body]

    slice_size = 700
    body.SLICE = slice_size
    for start in (0, 99, 100, 2304, len(whole) - 1):
        pieces = asyncio.run(sent(start))
        assert b"".join(pieces) == whole[start:] and max(map(len, pieces)) <= slice_size
    assert body.seek(-5, 2) == len(whole) - 5 and body.read() == whole[-5:]
    body.seek(7)
    first, again = body.__aiter__(), body.__aiter__()  # aiohttp 3.9-3.13 rebuilds a payload to send it again

    async def drain(it) -> bytes:
        return b"".join([bytes(piece) async for piece in it])

    assert asyncio.run(drain(first)) == whole[7:] and asyncio.run(drain(again)) == whole[7:]


def test_an_empty_endpoint_url_means_the_default_endpoint(remote, monkeypatch):
    """``endpoint_url: "${S3_ENDPOINT:-}"`` with the variable unset is AWS itself (or AWS_ENDPOINT_URL_S3): s3fs
    took "" for an endpoint and every request failed with "Invalid endpoint" (a docs trial)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", remote.server.endpoint)
    entry = {k: v for k, v in remote.tier(direct=True).items() if k not in ("name", "kind", "retry")}
    entry["options"] = {**entry["options"], "endpoint_url": ""}
    tier = S3Tier("s3", build_dataclass(FsspecOptions, entry))
    tier.publish("k", b"payload")
    assert bytes(tier.read_range("k", 0, 7)) == b"payload"


def test_failing_producer_aborts_the_multipart_upload(remote):
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, options=remote.proxy.storage_options(), part_size=PART))

    def chunks():
        yield torch.zeros(3 * PART, dtype=torch.uint8)
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="the producer failed"):
        tier.write_blob("k", chunks())
    assert remote.proxy.count("AbortMultipartUpload") == 1
    assert remote.keys() == [] and remote.uploads_in_progress() == []


# ----- 3. faults: retried, committed ------------------------------------------------------------------------
@pytest.mark.parametrize("kind, text", [("slowdown", "SlowDown"), ("internal_error", "InternalError"),
                                        ("reset", ""), ("bad_gateway", "HTTP 502"),
                                        ("too_many_requests", "HTTP 429")])
def test_fault_on_a_part_is_retried_by_the_engine_and_committed(remote, shm_root, recorder, kind, text):
    # request_attempts=1: the tier does not try again itself, so failures reach the engine's retry. (aiohttp
    # itself resends an idempotent request once when a reused connection breaks: part 2 is reset twice.)
    items = make_state(2)
    fault = remote.proxy.inject(kind, op="UploadPart", path=r"state\.flat$", query=r"partNumber=2\b", times=2)
    with CheckpointEngine(config(shm_root, remote.tier(request_attempts=1))) as engine:
        engine.save(20, items).wait(timeout=60)
    assert fault.hits == 2
    retries = recorder.kinds("retry", "s3")
    assert retries and all("state.flat" in e.message for e in retries)
    assert text in retries[0].message
    assert recorder.kinds("commit", "s3")
    assert remote.proxy.count("AbortMultipartUpload") >= 1  # the failed upload was aborted, not left behind
    assert remote.uploads_in_progress() == []
    assert_same(items, load_from_s3(remote).items)


def test_a_failed_part_is_sent_again_alone(remote, shm_root, recorder, caplog):
    # Default request_attempts: the tier retries the part itself; the rest of the upload is not redone.
    items = make_state(3)
    remote.proxy.inject("slowdown", op="UploadPart", path=r"state\.flat$", query=r"partNumber=3\b")
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        with CheckpointEngine(config(shm_root, remote.tier())) as engine:
            engine.save(30, items).wait(timeout=60)
    parts = [r.part_number for r in remote.proxy.ops("UploadPart") if r.path.endswith(STEP_KEY.format(30))]
    assert sorted(parts) == [1, 2, 3, 3, 4]
    assert remote.proxy.count("CreateMultipartUpload") == 1 and remote.proxy.count("AbortMultipartUpload") == 0
    assert not recorder.kinds("retry", "s3")
    assert "SlowDown" in caplog.text and "try 1 of 3" in caplog.text
    assert_same(items, load_from_s3(remote).items)


@pytest.mark.parametrize("kind", ["slowdown", "internal_error", "reset", "gateway_timeout"])
def test_fault_on_the_manifest_put_is_retried_and_committed(remote, shm_root, recorder, kind):
    items = make_state(4, mib=1)
    fault = remote.proxy.inject(kind, op="PutObject", path=MANIFEST, times=2)
    with CheckpointEngine(config(shm_root, remote.tier(request_attempts=1))) as engine:
        engine.save(40, items).wait(timeout=60)
    assert fault.hits == 2
    retries = recorder.kinds("retry", "s3")
    assert retries and all("manifest.json" in e.message for e in retries)
    assert "iter_0000040/tiered_ckpt/manifest.json" in remote.keys()
    loaded = load_from_s3(remote)
    assert loaded.step == 40
    assert_same(items, loaded.items)


def test_complete_whose_answer_was_lost_is_not_an_error(remote, shm_root, recorder):
    # The server completed the upload, the connection was cut before the answer: the retry must not fail.
    items = make_state(5)
    fault = remote.proxy.inject("reset", op="CompleteMultipartUpload", times=2)
    with CheckpointEngine(config(shm_root, remote.tier())) as engine:
        engine.save(50, items).wait(timeout=60)
    assert fault.hits >= 1 and recorder.kinds("commit", "s3")
    assert remote.uploads_in_progress() == []
    assert_same(items, load_from_s3(remote).items)


@pytest.mark.parametrize("kind", ["slowdown", "internal_error", "reset"])
def test_faults_on_reads_are_retried(remote, shm_root, recorder, kind):
    items = make_state(6)
    with CheckpointEngine(config(shm_root, remote.tier(direct=True))) as engine:
        engine.save(60, items).wait(timeout=60)
    fault = remote.proxy.inject(kind, op="GetObject", path=r"state\.flat$", nth=2, times=2)
    loaded = load_from_s3(remote, request_attempts=1)
    assert (loaded.step, loaded.tier) == (60, "s3") and not loaded.fallbacks
    assert_same(items, loaded.items)
    assert fault.hits == 2
    retries = recorder.kinds("retry", "s3")
    assert retries and all("read" in e.message and "state.flat" in e.message for e in retries)


@pytest.mark.parametrize("kind", ["slowdown", "reset"])
def test_a_newest_step_the_store_will_not_serve_is_never_passed_over_for_an_older_one(remote, shm_root, kind):
    """A new user's trial: every read of the newest step's data failing (throttled) past the retries made load()
    resume from the step before, with a warning only, and the job's next save replaced the newest step. The load
    fails instead, naming the step, and loads it once the store serves it again."""
    with CheckpointEngine(config(shm_root, remote.tier(direct=True), local=None)) as engine:
        for step in (1, 2):
            engine.save(step, make_state(step, mib=1)).wait(timeout=60)
    fault = remote.proxy.inject(kind, op="GetObject", path=r"iter_0000002/rank_00000/state\.flat$", times=None)
    with pytest.raises(CheckpointUnreadableError, match=r"step 2 could not be read .*load\(step=1\)") as err:
        load_from_s3(remote, request_attempts=1, retry={"attempts": 2, "initial_s": 0.01, "max_s": 0.02})
    assert not isinstance(err.value, NoCheckpointError)
    assert fault.hits >= 2  # the retries went to the store
    remote.proxy.clear()
    loaded = load_from_s3(remote)
    assert loaded.step == 2
    assert_same(make_state(2, mib=1), loaded.items)


def test_a_refused_request_says_which_credentials_to_check(remote, shm_root, capsys):
    """An S3 user's trial with a key the store did not know: a HEAD's 403 has no body, and saves, `ls` and `verify`
    said "permission denied: Forbidden" and no more."""
    from tiered_ckpt.cli import main

    remote.proxy.inject("access_denied", method="HEAD", times=None)
    with CheckpointEngine(config(shm_root, remote.tier())) as engine, pytest.raises(SaveError) as err:
        engine.save(1, make_state(1, mib=1)).wait(timeout=60)
    assert "permission denied" in str(err.value) and "check the tier's key/secret" in str(err.value)
    flags = [f for k, v in remote.proxy.storage_options().items() if isinstance(v, str) for f in ("-o", f"{k}={v}")]
    assert main(["ls", remote.url, *flags]) == 4
    assert "check the tier's key/secret" in capsys.readouterr().err


def test_stalls_past_the_timeout_are_retried_and_never_hang(remote, shm_root, recorder):
    items = make_state(7)
    up = remote.proxy.inject("stall", op="UploadPart", nth=2, delay_s=60)
    t0 = time.monotonic()
    with CheckpointEngine(config(shm_root, remote.tier(timeout_s=1))) as engine:
        handle = engine.save(70, items)
        assert not handle.done()  # save() never waits for the remote tier (its part stalls for the 1 s timeout)
        handle.wait(timeout=60)
    assert up.hits == 1 and time.monotonic() - t0 < 60  # waiting out the stall would take 60 s or more
    down = remote.proxy.inject("stall", op="GetObject", path=r"state\.flat$", nth=3, delay_s=60)
    t0 = time.monotonic()
    loaded = load_from_s3(remote, timeout_s=1)
    assert down.hits == 1 and time.monotonic() - t0 < 60
    assert_same(items, loaded.items)
    assert remote.uploads_in_progress() == []


def test_listings_heads_and_deletes_trickled_within_the_read_timeout_end_and_are_tried_again(remote):
    """An answer sent a byte at a time, each byte within botocore's read timeout, would hold a listing, a HEAD or a
    delete for as long as the server kept sending: each such request has the tier's ceiling (connect + read
    timeout) too, and is sent again after it."""
    entry = {k: v for k, v in remote.tier(timeout_s=1).items() if k not in ("name", "kind", "retry")}
    tier = FsspecTier("s3", build_dataclass(FsspecOptions, entry))
    for i in range(3):
        tier.write_blob(f"d/blob{i}", [b"x" * (i + 1)])
    calls = [("ListObjectsV2", lambda: tier.list("d/"), ["d/blob0", "d/blob1", "d/blob2"]),
             ("HeadObject", lambda: tier.size("d/blob1"), 2),
             ("DeleteObject", lambda: tier.delete("d/blob0"), None),
             ("DeleteObjects", lambda: tier.delete_prefix("d/"), None)]
    for op, call, expected in calls:
        remote.proxy.reset_log()
        fault = remote.proxy.inject("trickle", op=op, delay_s=0.3)  # a 200-byte answer would take a minute
        assert call() == expected, op
        assert fault.hits == 1 and remote.proxy.count(op) == 2, op  # cut at the ceiling, then answered at once
    assert tier.list("d/") == []


def test_a_completion_slower_than_the_read_timeout_is_waited_for_not_sent_again(remote, shm_root, caplog):
    """A server may assemble a large upload for longer than the read timeout before it answers
    CompleteMultipartUpload (moto takes 15 s and more for 1 GiB and sends nothing meanwhile): the tier waits, within
    a ceiling scaled to the object's size, instead of timing out and sending the completion again while the first
    is still at work (which moto answered with 500 InternalError, and the whole file was uploaded again)."""
    items = make_state(9)
    slow = remote.proxy.inject("stall", op="CompleteMultipartUpload", delay_s=2.5)  # answered 2.5 s late
    with CheckpointEngine(config(shm_root, remote.tier(timeout_s=1))) as engine:  # read timeout: 1 s
        handle = engine.save(90, items)
        handle.wait(timeout=60)
        assert handle.results == {"s3": True}
    assert slow.hits == 1
    assert remote.proxy.count("CompleteMultipartUpload") == 1
    assert remote.proxy.count("UploadPart") == 4  # 16 MiB in 5 MiB parts, each sent once
    assert "try 1 of" not in caplog.text
    assert_same(items, load_from_s3(remote).items)


# ----- 3. a deadline that runs out: nothing partial visible ------------------------------------------------
def test_deadline_exceeded_leaves_nothing_visible(remote, shm_root, tmp_path, recorder, capsys, monkeypatch):
    items = make_state(8)
    # Every part of the big file is throttled: the small file lands, the big one never does.
    remote.proxy.inject("slowdown", op="UploadPart", times=None)
    s3 = remote.tier(request_attempts=1, retry={"attempts": 1000, "initial_s": 0.05, "max_s": 0.1,
                                                "deadline_s": 1.5})
    with CheckpointEngine(config(shm_root, s3, local=tmp_path / "local")) as engine:
        handle = engine.save(80, items)
        assert not handle.done()  # save() returns before the remote tier's 1.5 s deadline runs out
        with pytest.raises(SaveError) as info:
            handle.wait(timeout=60)
        assert list(info.value.failures) == ["s3"]
        assert handle.results == {"local": True, "s3": False}
        assert engine.available_steps()["s3"] == []
        loaded = engine.load()
        assert loaded.step == 80 and loaded.tier != "s3"
        assert_same(items, loaded.items)
    # retried until the deadline (how many tries fit in 1.5 s depends on the machine's load), then given up
    assert recorder.kinds("retry", "s3") and recorder.kinds("commit_failed", "s3")
    assert remote.uploads_in_progress() == []
    keys = remote.keys()
    assert "iter_0000080/rank_00000/meta.flat" in keys  # the file that did land...
    assert not any(k.startswith("iter_0000080/tiered_ckpt/") and k.endswith(".json") for k in keys)  # no manifest,
    assert "iter_0000080/tiered_ckpt/rank_00000.started" in keys  # no vote; the marker makes it debris of ours
    assert "latest_checkpointed_iteration.txt" not in keys
    with pytest.raises(NoCheckpointError):
        load_from_s3(remote)
    # tiered-ckpt ls, with the endpoint and credentials from the environment only
    for name, value in remote.server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["ls", remote.url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(i["step"], i["state"]) for i in listed] == [(80, "partial")]
    # The next step goes through, and retention removes the debris of the failed one.
    remote.proxy.clear()
    with CheckpointEngine(config(shm_root, s3)) as engine:
        engine.save(81, make_state(81)).wait(timeout=60)
    assert not any(k.startswith("iter_0000080/") for k in remote.keys())
    assert load_from_s3(remote).step == 81


# ----- 3. a save killed mid-upload: gc finds the upload it left open -----------------------------------------
_KILLED_MID_UPLOAD = """
import json, sys, torch
from tiered_ckpt import CheckpointEngine, crashpoints
cfg, part = json.loads(sys.argv[1]), int(sys.argv[2])
with CheckpointEngine(cfg) as engine:
    engine.save(1, {"state": {"w": torch.ones(1000)}}).wait(timeout=60)
    crashpoints.arm("s3.part_sent:2")  # SIGKILL once two parts of the next upload are on the store
    engine.save(2, {"state": {"w": torch.arange(5 * part // 4, dtype=torch.float32)}}).wait(timeout=60)
sys.exit("step 2 was saved: the crash point was never reached")
"""


def test_gc_aborts_the_multipart_upload_of_a_save_killed_mid_upload(remote, shm_root, capsys, monkeypatch):
    """A process killed while it uploads a file in parts leaves an upload no listing shows, whose parts S3 bills:
    gc lists it with its bytes (not while it is young enough to be in flight), --delete aborts it, and the step
    committed before it still loads."""
    cfg = config(shm_root, remote.tier(direct=True, max_concurrency=2))
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_UPLOAD, json.dumps(cfg), str(PART)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = remote.uploads_in_progress()
    assert left["Key"] == f"{remote.prefix}/{STEP_KEY.format(2)}"
    for name, value in remote.server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["gc", remote.url, "--json"]) == 0  # the default grace: its parts are seconds old
    result = json.loads(capsys.readouterr().out)
    assert result["found"] == []  # left, and said so
    assert [(d["what"], d["key"], d["left"]) for d in result["left"]] == [  # the killed save's step, its upload
        ("partial step", "iter_0000002", "newer than every committed step"),
        ("unfinished upload", STEP_KEY.format(2), "younger than --min-age")]
    client = remote.server.client()  # others' uploads beside our steps (not in a step directory): never ours
    theirs = []
    for name in ("notes/big.bin", "iter_0000003"):
        theirs.append(client.create_multipart_upload(Bucket=remote.bucket, Key=f"{remote.prefix}/{name}")["UploadId"])
        client.upload_part(Bucket=remote.bucket, Key=f"{remote.prefix}/{name}", UploadId=theirs[-1], PartNumber=1,
                           Body=b"n" * 100)
    assert cli_main(["gc", remote.url, "--min-age", "0", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["found"]
    assert [f["key"] for f in found if f["what"] == "unfinished upload"] == [STEP_KEY.format(2)]
    found = {f["what"]: f for f in found}
    upload = found["unfinished upload"]
    assert (upload["key"], upload["upload_id"]) == (STEP_KEY.format(2), left["UploadId"])
    assert upload["bytes"] >= 2 * PART and upload["bytes"] % PART == 0  # at least the two parts sent, all whole
    assert cli_main(["gc", remote.url, "--min-age", "0"]) == 0
    assert f"would remove  unfinished upload  tier 'target': {STEP_KEY.format(2)}" in capsys.readouterr().out
    assert {u["UploadId"] for u in remote.uploads_in_progress()} == {left["UploadId"], *theirs}  # a dry run
    remote.proxy.inject("access_denied", op="AbortMultipartUpload", times=None)  # a policy without the right
    code = cli_main(["gc", remote.url, "--endpoint-url", remote.proxy.endpoint, "--min-age", "0", "--delete"])
    out, err = capsys.readouterr()
    assert code == EXIT_UNREADABLE
    assert f"could not remove  unfinished upload  tier 'target': {STEP_KEY.format(2)}" in out
    assert "s3:AbortMultipartUpload" in err and "removed)" not in err  # nothing else was there to remove
    assert "could not read" not in err  # a removal refused is no failure to read (a user's trial: it said so)
    remote.proxy.clear()
    assert cli_main(["gc", remote.url, "--min-age", "0", "--delete"]) == 0
    assert {u["UploadId"] for u in remote.uploads_in_progress()} == set(theirs)
    loaded = load_from_s3(remote, direct=True)
    assert loaded.step == 1 and loaded.tier == "s3"
    assert_same({"state": {"w": torch.ones(1000)}}, loaded.items)

    # The objects of a run deleted by hand, its killed save's upload left: the prefix holds nothing to list, and
    # gc still finds (and aborts) the upload instead of saying there is nothing there.
    gone = f"{remote.prefix}-gone"
    key = f"{gone}/{STEP_KEY.format(7)}"
    upload = client.create_multipart_upload(Bucket=remote.bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=remote.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"p" * 100)
    assert cli_main(["gc", f"s3://{remote.bucket}/{gone}", "--min-age", "0", "--delete"]) == 0
    assert f"removed  unfinished upload  tier 'target': {STEP_KEY.format(7)}" in capsys.readouterr().out
    assert upload not in {u["UploadId"] for u in remote.uploads_in_progress()}
    assert cli_main(["gc", f"s3://{remote.bucket}/{gone}", "--min-age", "0"]) == EXIT_NOT_FOUND  # now: nothing


def test_retention_aborts_the_upload_a_killed_save_left_in_the_step_it_removes(remote, shm_root, caplog):
    """The next run's first commit removes the killed save's partial step, and the upload it left open there
    with it (no gc needed); an upload beside the steps is not retention's. Without the permission to list
    uploads, retention warns and still removes the step's files."""
    cfg = config(shm_root, remote.tier(direct=True, max_concurrency=2))
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_UPLOAD, json.dumps(cfg), str(PART)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = remote.uploads_in_progress()
    client = remote.server.client()
    theirs = client.create_multipart_upload(Bucket=remote.bucket, Key=f"{remote.prefix}/notes/big.bin")["UploadId"]
    later = {"run_id": f"n{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [remote.tier()]}
    with CheckpointEngine(later) as engine:  # another run: the killed one's step 2 is debris, not to recover
        engine.save(3, make_state(3, mib=1)).wait(timeout=60)
    assert {u["UploadId"] for u in remote.uploads_in_progress()} == {theirs}
    assert left["UploadId"] not in {u["UploadId"] for u in remote.uploads_in_progress()}
    assert not [k for k in remote.keys() if k.startswith("iter_0000002/")]

    key = f"{remote.prefix}/{STEP_KEY.format(4)}"  # a step 4 killed the same way, under credentials that may not list
    client.put_object(Bucket=remote.bucket, Key=f"{remote.prefix}/iter_0000004/tiered_ckpt/rank_00000.started",
                      Body=b"{}")
    stuck = client.create_multipart_upload(Bucket=remote.bucket, Key=key)["UploadId"]
    remote.proxy.inject("access_denied", op="ListMultipartUploads", times=None)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"), \
            CheckpointEngine(later) as engine:
        engine.save(5, make_state(5, mib=1)).wait(timeout=60)
    remote.proxy.clear()
    assert not [k for k in remote.keys() if k.startswith("iter_0000004/")]
    assert "could not look for uploads left open" in caplog.text and "gc --delete" in caplog.text
    assert {u["UploadId"] for u in remote.uploads_in_progress()} == {theirs, stuck}
    assert load_from_s3(remote).step == 5


def test_gc_without_the_permission_to_list_uploads_says_so_and_finds_the_rest(remote, shm_root, capsys,
                                                                              monkeypatch):
    """Credentials that may not list multipart uploads: gc still reports the tier's other debris, and fails
    naming what it could not list (never "nothing to remove")."""
    with CheckpointEngine(config(shm_root, remote.tier())) as engine:
        engine.save(2, make_state(2, mib=1)).wait(timeout=60)
    remote.server.client().put_object(Bucket=remote.bucket, Key=f"{remote.prefix}/iter_0000001/rank_00000/x.flat",
                                      Body=b"x" * 10)
    remote.server.client().put_object(Bucket=remote.bucket,
                                      Key=f"{remote.prefix}/iter_0000001/tiered_ckpt/rank_00000.started", Body=b"{}")
    remote.proxy.inject("access_denied", op="ListMultipartUploads", times=None)
    for name, value in remote.server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = cli_main(["gc", remote.url, "--endpoint-url", remote.proxy.endpoint, "--min-age", "0"])
    out, err = capsys.readouterr()
    assert code == EXIT_UNREADABLE, (out, err)
    assert "would remove  partial step" in out and "iter_0000001" in out
    assert "its unfinished uploads could not be listed" in err and "s3:ListBucketMultipartUploads" in err
    assert "Access Denied" in err


# ----- 4. the bucket, read with plain boto3 ---------------------------------------------------------------
def test_plain_boto3_sees_ordinary_objects_matching_the_manifest(remote, shm_root):
    items = make_state(9)
    with CheckpointEngine(config(shm_root, remote.tier(direct=True))) as engine:
        engine.save(90, items).wait(timeout=60)
    client = remote.server.client()
    base = remote.prefix
    tracker = client.get_object(Bucket=remote.bucket, Key=f"{base}/latest_checkpointed_iteration.txt")
    assert tracker["Body"].read() == b"90"
    raw = client.get_object(Bucket=remote.bucket, Key=f"{base}/iter_0000090/tiered_ckpt/manifest.json")
    manifest = json.loads(raw["Body"].read())
    assert manifest["step"] == 90
    files = manifest["files"]
    assert sorted(f["key"] for f in files) == ["iter_0000090/rank_00000/meta.flat",
                                               "iter_0000090/rank_00000/state.flat"]
    for entry in files:
        head = client.head_object(Bucket=remote.bucket, Key=f"{base}/{entry['key']}")
        assert head["ContentLength"] == entry["size"]
        body = client.get_object(Bucket=remote.bucket, Key=f"{base}/{entry['key']}")["Body"].read()
        assert len(body) == entry["size"] and f"{ALGORITHM}:{digest(body)}" == entry["checksum"]
    assert remote.keys() == sorted(["latest_checkpointed_iteration.txt", "iter_0000090/tiered_ckpt/manifest.json",
                                    "iter_0000090/tiered_ckpt/rank_00000.json",
                                    "iter_0000090/tiered_ckpt/rank_00000.started",  # written before its files
                                    *(f["key"] for f in files)])


# ----- 5. endpoint and credentials: config or environment, never printed ----------------------------------
def test_credentials_never_reach_events_logs_or_reprs(remote, shm_root, recorder, caplog):
    secret, access = remote.server.secret_key, remote.server.access_key
    # Failures that reach the engine (retry events, warnings): errors that name the endpoint URL among them.
    remote.proxy.inject("slowdown", op="UploadPart", query=r"partNumber=1\b", times=3)
    remote.proxy.inject("stall", op="PutObject", path=MANIFEST, times=2, delay_s=30)
    remote.proxy.inject("internal_error", op="GetObject", path=r"state\.flat$")
    with caplog.at_level(logging.DEBUG, logger="tiered_ckpt"):
        with CheckpointEngine(config(shm_root, remote.tier(request_attempts=2, timeout_s=1))) as engine:
            engine.save(100, make_state(10)).wait(timeout=60)
            tier = engine.pipeline.stores["s3"].tier
            shown = [repr(tier), tier.describe(), repr(engine.config), repr(tier.options)]
        load_from_s3(remote, request_attempts=1)
    messages = " ".join(e.message for e in recorder.kinds("retry", "s3"))
    assert "SlowDown" in messages and "timeout" in messages and "InternalError" in messages
    assert "try 1 of 2" in caplog.text
    events = json.dumps([e.to_dict() for e in recorder.events], default=str)
    for text in [events, caplog.text, *shown]:
        assert secret not in text and access not in text
    assert remote.proxy.endpoint in shown[1]


def test_credentials_and_endpoint_from_the_environment(remote, monkeypatch):
    for name, value in remote.server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", remote.proxy.endpoint)
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, part_size=PART))
    tier.write_blob("x/y", [b"from the environment"])
    assert tier.read_blob("x/y").numpy().tobytes() == b"from the environment"
    assert remote.proxy.count("PutObject") == 1  # it went to the endpoint named by the environment
    assert remote.server.secret_key not in repr(tier) and remote.proxy.endpoint in tier.describe()


def test_redaction():
    secrets = secret_values({"key": "AKIAEXAMPLEKEY", "client_kwargs": {"aws_secret_access_key": "s3cr3t/Value+x"}},
                            env={"AWS_SESSION_TOKEN": "tok-123456"})
    assert secrets == {"AKIAEXAMPLEKEY", "s3cr3t/Value+x", "tok-123456"}
    text = ('failed: key=AKIAEXAMPLEKEY secret: s3cr3t/Value+x url http://user:pw@host:9000/b '
            'https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F2024&X-Amz-Signature=abcdef '
            '"Authorization": "AWS4-HMAC-SHA256 Credential=AKIA/x, Signature=f00" token=tok-123456 '
            'aws_secret_access_key="zzz-other"')
    out = redact(text, secrets)
    for leaked in ["AKIAEXAMPLEKEY", "s3cr3t", "user:pw", "abcdef", "AKIA%2F2024", "f00", "tok-123456", "zzz-other"]:
        assert leaked not in out, (leaked, out)
    assert "http://***@host:9000/b" in out and "failed:" in out
    assert redacted_options({"key": "a", "endpoint_url": "http://u:p@h", "client_kwargs": {"secret": "b"}}) == {
        "key": "***", "endpoint_url": "http://***@h", "client_kwargs": {"secret": "***"}}
    opts = FsspecOptions(url="s3://b/p", options={"key": "AKIAEXAMPLEKEY", "secret": "s3cr3t/Value+x"})
    assert "AKIAEXAMPLEKEY" not in repr(opts) and "s3cr3t" not in repr(opts)


# ----- options and helpers --------------------------------------------------------------------------------
@pytest.mark.parametrize("data, message", [
    ({"url": "s3://b/p", "part_size": "1MiB"}, "part_size: expected 5MiB to 5GiB"),
    ({"url": "s3://b/p", "max_concurrency": 0}, "max_concurrency: expected a positive integer"),
    ({"url": "s3://b/p", "timeout_s": 0}, "timeout_s: expected a positive duration"),
    ({"url": "s3://b/p", "request_attempts": "many"}, "request_attempts: expected a positive integer"),
])
def test_s3_options_are_validated(data, message):
    with pytest.raises(ConfigError, match=message):
        build_dataclass(FsspecOptions, data, "tiers[1]", "tiers.yaml")


def test_s3_options_parse_units():
    opts = build_dataclass(FsspecOptions, {"url": "s3://b/p", "part_size": "8MiB", "timeout_s": "250ms",
                                           "max_concurrency": 16})
    assert (opts.part_size, opts.timeout_s, opts.max_concurrency) == (8 * MiB, 0.25, 16)
    assert build_dataclass(FsspecOptions, {"url": "s3a://b/p", "part_size": "5MiB"}).part_size == 5 * MiB
    # elsewhere the S3 keys are refused rather than ignored, but their defaults may be written out
    assert build_dataclass(FsspecOptions, {"url": "memory://x/y", "part_size": "64MiB"}).part_size == 64 * MiB


def test_s3_operation_names():
    assert s3_operation("POST", "/b/k", {"uploads": [""]}) == "CreateMultipartUpload"
    assert s3_operation("PUT", "/b/k", {"partNumber": ["1"], "uploadId": ["u"]}) == "UploadPart"
    assert s3_operation("POST", "/b/k", {"uploadId": ["u"]}) == "CompleteMultipartUpload"
    assert s3_operation("DELETE", "/b/k", {"uploadId": ["u"]}) == "AbortMultipartUpload"
    assert s3_operation("GET", "/b", {"list-type": ["2"]}) == "ListObjectsV2"
    assert s3_operation("GET", "/b/k/x", {}) == "GetObject" and s3_operation("PUT", "/b/k", {}) == "PutObject"


# ----- reads bounded by the manifest, answers that do not decode ------------------------------------------
def test_an_object_larger_than_its_manifest_says_is_refused_from_the_first_answer(remote):
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, options=remote.proxy.storage_options(), part_size=PART))
    tier.write_blob("big", [bytes(3 * PART)])
    remote.proxy.reset_log()
    with pytest.raises(CorruptionError, match=f"is {3 * PART} bytes, more than the 10 bytes its manifest records"):
        tier.read_blob_hashed("big", None, max_size=10)
    assert remote.proxy.count("GetObject") == 1  # the first range told the size: no other range was asked for
    assert tier.read_blob_hashed("big", None, max_size=3 * PART).numel() == 3 * PART


@pytest.mark.parametrize("length", ["many", None, -5])
def test_an_answer_without_a_byte_count_is_a_corruption_error(remote, monkeypatch, length):
    tier = FsspecTier("s3", FsspecOptions(url=remote.url, options=remote.proxy.storage_options(), part_size=PART))
    tier.write_blob("k", [b"twelve bytes"])
    real = tier.fs._call_s3

    async def garbled(op, *args, **kwargs):  # a proxy in the way that mangles the headers
        resp = await real(op, *args, **kwargs)
        if op in ("get_object", "head_object"):
            resp = {**resp, "ContentLength": length}
            resp.pop("ContentRange", None)
        return resp

    monkeypatch.setattr(tier.fs, "_call_s3", garbled)
    monkeypatch.setattr(tier.fs, "call_s3", lambda op, *args, **kwargs: tier.run_sync(garbled, op, *args, **kwargs))
    for read in (tier.read_blob, tier.size):
        with pytest.raises(CorruptionError, match="the store's answer gives no byte count") as info:
            read("k")
        assert "tier 's3'" in str(info.value)


def test_a_bucket_that_does_not_exist_is_not_no_checkpoint(remote, shm_root):
    """s3fs lists a missing bucket as an empty prefix: load() said "no checkpoint", and a resume script would start
    afresh while every save failed (found by a review). The tier is unusable, and load() says which bucket."""
    from dataclasses import replace

    from tiered_ckpt.errors import TierUnavailableError

    typo = replace(remote, bucket=f"{remote.bucket}-typo")
    cfg = {"run_id": f"r{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [typo.tier(direct=True)]}
    with CheckpointEngine(cfg) as engine, pytest.raises(TierUnavailableError, match="no such bucket"):
        engine.load()
    with CheckpointEngine(cfg) as engine, pytest.raises(SaveError) as err:  # a save says which bucket too
        engine.save(1, make_state(1, mib=1)).wait(timeout=60)
    assert f"no such bucket '{typo.bucket}': create it, or correct the tier's url" in str(err.value)
    with CheckpointEngine({**cfg, "tiers": [remote.tier(direct=True)]}) as engine, \
            pytest.raises(NoCheckpointError):  # the bucket is there, nothing under the prefix yet
        engine.load()


def test_a_throttled_tracker_read_after_the_manifest_does_not_fail_the_commit(remote, shm_root):
    """The commit reads Megatron's tracker after publishing the checkpoint manifest, outside the retry policy: a
    throttled read failed a step that was committed (found by a review). It is retried like the rest."""
    with CheckpointEngine(config(shm_root, remote.tier())) as engine:
        engine.save(1, make_state(1, mib=1)).wait(timeout=60)
        fault = remote.proxy.inject("slowdown", op="GetObject", path=r"latest_checkpointed_iteration", times=3)
        engine.save(2, make_state(2, mib=1)).wait(timeout=60)
    assert fault.hits == 3
    tracker = remote.server.client().get_object(Bucket=remote.bucket,
                                                Key=f"{remote.prefix}/latest_checkpointed_iteration.txt")
    assert tracker["Body"].read() == b"2"
    assert load_from_s3(remote).step == 2


def test_a_shared_upload_whose_completion_answer_was_lost_is_complete(remote, make_tier):
    """Megatron's file written in place on S3 is one multipart upload the ranks share. Its completion's answer was
    lost and the store answered the retry NoSuchUpload (it forgets a completed upload, as MinIO and S3 do): the
    commit failed for good, though the object was complete (found by a review). As for a plain upload, the
    object is looked at: made of these parts, it is the completion."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    tier = make_tier("fsspec", url=remote.url, options=remote.proxy.storage_options(), part_size=PART,
                     timeout_s=5)
    patient = tier.patient_fs()
    call, completions = patient._call_s3, []

    async def forgetful(method, *args, **kwargs):
        if method == "complete_multipart_upload":
            completions.append(kwargs["UploadId"])
            if len(completions) > 1:
                raise translate_boto_error(ClientError({"Error": {"Code": "NoSuchUpload", "Message": "gone"}},
                                                       "CompleteMultipartUpload"))
        return await call(method, *args, **kwargs)

    patient._call_s3 = forgetful
    remote.proxy.inject("reset", op="CompleteMultipartUpload", times=1)  # done, the answer cut off
    shared, key = tier.shared_parts(), "iter_0000001/mp_rank_00/distrib_optim.pt"
    upload = shared.create(key)
    parts = shared.upload(key, upload, [(1, memoryview(bytes(PART))), (2, memoryview(b"x" * 100))])
    shared.complete(key, upload, parts, nbytes=PART + 100)
    assert len(completions) == 2
    head = remote.server.client().head_object(Bucket=remote.bucket, Key=f"{remote.prefix}/{key}")
    assert head["ContentLength"] == PART + 100


@pytest.mark.parametrize(("status", "code", "transient"), [
    (502, "502", True), (504, "504", True), (429, None, True),  # a gateway's answer: no S3 error code (botocore
    (503, None, True),  # names the status as the code, or nothing)
    (501, "NotImplemented", False), (507, "XMinioStorageFull", False),  # the store says what is wrong
])
def test_an_http_status_without_an_error_code_decides_only_then(remote, make_tier, status, code, transient):
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from tiered_ckpt.errors import PermanentTierError, TransientTierError

    tier = make_tier("fsspec", url=remote.url, options=remote.server.storage_options())
    answer = {"Error": {"Code": code, "Message": "said"} if code else {},
              "ResponseMetadata": {"HTTPStatusCode": status}}
    try:
        raise translate_boto_error(ClientError(answer, "PutObject"))
    except OSError as exc:
        err = tier._tier_exception(exc, "k", "upload", "b/k")
    assert isinstance(err, TransientTierError if transient else PermanentTierError), (type(err), err)
