"""S3's ``split_blobs``: the engine's own files as part-sized objects instead of multipart uploads, against moto's
real HTTP server and read back with plain boto3 (what is on the server), with the engine and the CLI."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
import torch
from helpers import assert_same

from tiered_ckpt import CheckpointEngine, SaveError
from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.errors import CorruptionError, TransientTierError
from tiered_ckpt.tiers import _s3, _s3_split
from tiered_ckpt.tiers._s3_split import METADATA_KEY, PIECE_MARK, Split, is_piece_name, piece_name
from tiered_ckpt.tiers.base import StableChunks
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
PART = 5 * MiB


def blob(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def where(s3_bucket):
    return s3_bucket, uuid.uuid4().hex


@pytest.fixture
def tier(make_tier, s3_server, where):
    bucket, prefix = where
    return make_tier("fsspec", url=f"s3://{bucket}/{prefix}", options=s3_server.storage_options(), part_size=PART,
                     max_concurrency=2, split_blobs=True)


def objects(s3_server, bucket: str, prefix: str) -> dict[str, int]:
    """What the server holds under ``prefix``: key (relative) -> size."""
    out = {}
    for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        out.update({o["Key"][len(prefix) + 1:]: o["Size"] for o in page.get("Contents", [])})
    return out


@pytest.mark.parametrize("chunks", [list, StableChunks])
def test_a_private_blob_is_stored_as_pieces_and_read_as_one(tier, s3_server, where, chunks):
    bucket, prefix = where
    data = blob(2 * PART + 3 * MiB + 7, 1)
    assert tier.write_private_blob("d/x.flat", chunks([data[:MiB], data[MiB:]])) == data.numel()

    held = objects(s3_server, bucket, prefix)
    pieces = sorted(k for k in held if is_piece_name(k))
    assert len(pieces) == 2 and all(held[k] == PART for k in pieces)
    assert held["d/x.flat"] == 3 * MiB + 7  # the last part, under the key
    head = s3_server.client().head_object(Bucket=bucket, Key=f"{prefix}/d/x.flat")
    split = Split.from_metadata(head["Metadata"])
    assert split is not None and (split.parts, split.piece_size, split.total) == (3, PART, data.numel())
    assert pieces == [piece_name("d/x.flat", split.token, n) for n in (1, 2)]
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    assert tier.list() == ["d/x.flat"] and tier.list("d/") == ["d/x.flat"]
    assert tier.size("d/x.flat") == data.numel() and tier.exists("d/x.flat")
    assert torch.equal(tier.read_blob("d/x.flat"), data)
    for off, n in [(0, 10), (PART - 5, 10), (PART - 5, PART + 10), (2 * PART, 3 * MiB + 7), (0, data.numel()),
                   (data.numel() - 1, 1), (7, 0)]:
        assert tier.read_range("d/x.flat", off, n) == data[off:off + n].numpy().tobytes(), (off, n)


@pytest.mark.parametrize("chunks", [list, StableChunks])
@pytest.mark.parametrize("nbytes", [PART, 2 * PART, 4 * PART])
def test_whole_parts_keep_the_last_one_for_the_key(tier, s3_server, where, nbytes, chunks):
    """A blob of whole parts, fed as one chunk (the parts go straight from the caller's buffer): the last part is
    still the key's own object."""
    bucket, prefix = where
    data = blob(nbytes, 2)
    tier.write_private_blob("k", chunks([data]))
    held = objects(s3_server, bucket, prefix)
    assert held["k"] == PART and len(held) == nbytes // PART
    assert torch.equal(tier.read_blob("k"), data)


def test_write_blob_stays_one_object(tier, s3_server, where):
    """Files other programs read (Megatron's, DCP's) go through write_blob: one object, whatever the option."""
    bucket, prefix = where
    data = blob(2 * PART + 1, 3)
    tier.write_blob("model_optim_rng.pt", [data])
    assert objects(s3_server, bucket, prefix) == {"model_optim_rng.pt": data.numel()}
    body = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/model_optim_rng.pt")["Body"].read()
    assert body == data.numpy().tobytes()


def test_writing_a_key_again_removes_the_old_pieces(tier, s3_server, where):
    bucket, prefix = where
    for i, n in enumerate([3 * PART + 1, 2 * PART + 2, MiB]):
        data = blob(n, 10 + i)
        tier.write_private_blob("k", [data])
        assert torch.equal(tier.read_blob("k"), data)
        held = objects(s3_server, bucket, prefix)
        assert sum(held.values()) == n, held  # no piece of an earlier write is left
    assert list(held) == ["k"]


def test_delete_and_delete_prefix_take_the_pieces(tier, s3_server, where):
    bucket, prefix = where
    tier.write_private_blob("a/one", [blob(2 * PART + 1, 4)])
    tier.write_private_blob("b/two", [blob(2 * PART + 1, 5)])
    tier.delete("a/one")
    assert list(objects(s3_server, bucket, prefix)) == ["b/two"] + [k for k in objects(s3_server, bucket, prefix)
                                                                    if is_piece_name(k)]
    tier.delete_prefix("b")
    assert objects(s3_server, bucket, prefix) == {}


def test_a_lost_piece_is_a_corruption_error_naming_it(tier, s3_server, where):
    bucket, prefix = where
    tier.write_private_blob("k", [blob(2 * PART + 1, 6)])
    lost = sorted(k for k in objects(s3_server, bucket, prefix) if is_piece_name(k))[1]
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/{lost}")
    with pytest.raises(CorruptionError, match=r"piece 2 of 3 of the split blob is missing") as info:
        tier.read_blob("k")
    assert lost in str(info.value) and "'k'" in str(info.value)
    with pytest.raises(CorruptionError, match="piece 2 of 3"):
        tier.read_range("k", PART + 1, 10)


def test_a_failing_producer_leaves_no_pieces(tier, s3_server, where):
    bucket, prefix = where
    tier.write_private_blob("k", [blob(MiB, 7)])

    def chunks():
        yield blob(3 * PART, 8)
        raise RuntimeError("the producer broke")

    with pytest.raises(RuntimeError, match="the producer broke"):
        tier.write_private_blob("k", chunks())
    assert objects(s3_server, bucket, prefix) == {"k": MiB}  # the old blob, whole
    assert torch.equal(tier.read_blob("k"), blob(MiB, 7))


def test_a_blob_written_again_while_being_read_is_read_again(tier, s3_server, where, monkeypatch):
    """The reader got the key's first answer, then another writer replaced the blob (new pieces, then the key,
    then the old pieces removed): the old pieces are gone, so the reader starts over and returns the new blob."""
    bucket, prefix = where
    old, new = blob(2 * PART + 1, 9), blob(2 * PART + 5, 10)
    tier.write_private_blob("k", [old])
    client = s3_server.client()
    real = type(tier)._split_of
    done = threading.Event()

    def rewrite_after_first_answer(self, resp, key):
        split = real(self, resp, key)
        if split is not None and not done.is_set():
            done.set()  # what SplitUpload does, done with plain boto3 (the tier's event loop is busy with us)
            token = "b" * 12
            for n in (1, 2):
                client.put_object(Bucket=bucket, Key=f"{prefix}/{piece_name('k', token, n)}",
                                  Body=new[(n - 1) * PART:n * PART].numpy().tobytes())
            client.put_object(Bucket=bucket, Key=f"{prefix}/k", Body=new[2 * PART:].numpy().tobytes(),
                              Metadata=Split(token, PART, 3, new.numel()).encode())
            for n in (1, 2):
                client.delete_object(Bucket=bucket, Key=f"{prefix}/{piece_name('k', split.token, n)}")
        return split

    monkeypatch.setattr(type(tier), "_split_of", rewrite_after_first_answer)
    assert torch.equal(tier.read_blob("k"), new) and done.is_set()


def test_a_description_from_a_newer_version_is_refused_clearly(tier, s3_server, where):
    bucket, prefix = where
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/k", Body=b"x", Metadata={METADATA_KEY: "2 future"})
    with pytest.raises(CorruptionError, match=r"unknown split description .*newer tiered_ckpt"):
        tier.read_blob("k")
    with pytest.raises(CorruptionError, match="unknown split description"):
        tier.size("k")


def test_a_capitalised_metadata_name_is_read_too():
    """Some servers send header names capitalised, and botocore keeps the case it was sent."""
    split = Split("c" * 12, 10, 3, 25)
    (name, value), = split.encode().items()
    assert Split.from_metadata({name.title(): value}) == split
    assert Split.from_metadata({"other": "x"}) is None


def test_a_last_request_whose_answer_was_lost_leaves_the_blob_whole(tier, s3_server, where, monkeypatch):
    """The key's own object landed but its PUT reported a failure: the pieces it names must stay."""
    bucket, prefix = where
    data = blob(2 * PART + 9, 11)
    real = _s3_split.SplitUpload._put

    def landed_but_failed(self, view, metadata=None):
        real(self, view, metadata)
        raise TransientTierError("the answer was lost", tier=tier.name, key=self.key)

    monkeypatch.setattr(_s3_split.SplitUpload, "_put", landed_but_failed)
    with pytest.raises(TransientTierError, match="the answer was lost"):
        tier.write_private_blob("k", [data])
    monkeypatch.undo()
    assert torch.equal(tier.read_blob("k"), data)
    assert len(objects(s3_server, bucket, prefix)) == 3


def test_a_piece_of_the_wrong_size_is_a_corruption_error(tier, s3_server, where):
    bucket, prefix = where
    tier.write_private_blob("k", [blob(2 * PART + 1, 12)])
    piece = sorted(k for k in objects(s3_server, bucket, prefix) if is_piece_name(k))[0]
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{piece}", Body=b"short")
    with pytest.raises(CorruptionError, match=rf"piece 1 of 3 of the split blob is not {PART} bytes"):
        tier.read_blob("k")


def test_a_range_read_never_mixes_two_writes(tier, s3_server, where, monkeypatch):
    """The key is written again (as a plain object) between read_range's look at it and its reads: the read fails
    as transient, it does not return bytes of two different blobs."""
    bucket, prefix = where
    tier.write_private_blob("k", [blob(2 * PART + 1, 13)])
    real = type(tier)._head

    def head_then_rewritten(self, key, path):
        resp = real(self, key, path)
        s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/k", Body=b"z" * 100)
        return resp

    monkeypatch.setattr(type(tier), "_head", head_then_rewritten)
    with pytest.raises(TransientTierError, match="replaced while being read"):
        tier.read_range("k", 2 * PART - 4, 5)  # the last bytes of piece 2, the first of the key's own object


def test_verify_reports_a_damaged_piece_and_goes_on(s3_server, where, shm_root, capsys, monkeypatch):
    bucket, prefix = where
    s3 = {"name": "s3", "kind": "fsspec", "url": f"s3://{bucket}/{prefix}", "options": s3_server.storage_options(),
          "part_size": PART, "split_blobs": True, "keep": 2}
    items = {"model": {"w": torch.arange(3 * PART // 4, dtype=torch.float32)}}
    with CheckpointEngine({"run_id": "split-v", "drain": {"mode": "thread"},
                           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}, s3]}) as engine:
        for step in (1, 2):
            engine.save(step, items).wait()
    piece = sorted(k for k in objects(s3_server, bucket, prefix) if is_piece_name(k) and k.startswith("iter_0000002"))
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{piece[0]}", Body=b"short")
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["verify", f"s3://{bucket}/{prefix}", "--all", "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["ok"]) for r in results] == [(1, True), (2, False)]
    assert "piece 1 of" in json.dumps(results[1])


def test_gc_sizes_and_removes_the_pieces_of_a_save_that_died(s3_server, where, shm_root, capsys, monkeypatch):
    """A save killed after some pieces of its first file landed leaves a step of a marker and hidden pieces: gc
    reports what it really holds and removes all of it."""
    bucket, prefix = where
    s3 = {"name": "s3", "kind": "fsspec", "url": f"s3://{bucket}/{prefix}", "options": s3_server.storage_options(),
          "part_size": PART, "split_blobs": True}
    with CheckpointEngine({"run_id": "split-g", "drain": {"mode": "thread"},
                           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}, s3]}) as engine:
        engine.save(5, {"model": {"w": torch.zeros(1000)}}).wait()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=f"{prefix}/iter_0000004/tiered_ckpt/rank_00000.started", Body=b"{}")
    for n in (1, 2):
        name = piece_name("iter_0000004/rank_00000/model.flat", "d" * 12, n)
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=b"p" * PART)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["gc", f"s3://{bucket}/{prefix}", "--min-age", "0", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["found"]
    assert [(f["what"], f["key"], f["bytes"]) for f in found] == [("partial step", "iter_0000004", 2 * PART + 2)]
    assert cli_main(["gc", f"s3://{bucket}/{prefix}", "--min-age", "0", "--delete"]) == 0
    assert not any(k.startswith("iter_0000004") for k in objects(s3_server, bucket, prefix))


def test_split_blobs_is_only_for_plain_s3_urls():
    with pytest.raises(ValueError, match="split_blobs: only plain S3 URLs"):
        FsspecOptions(url="gs://bucket/run", split_blobs=True)
    with pytest.raises(ValueError, match="split_blobs"):
        FsspecOptions(url="simplecache::s3://bucket/run", split_blobs=True)
    with pytest.raises(ValueError, match=r"scheme in lower case \(s3://, not S3://\)"):
        FsspecOptions(url="S3://bucket/run", split_blobs=True)
    assert FsspecOptions(url="s3://bucket/run", split_blobs=True).split_blobs


def test_spans_cover_a_range_part_by_part():
    split = Split("a" * 12, 10, 3, 25)
    assert split.spans(0, 25) == [(1, 0, 10, 0), (2, 0, 10, 10), (3, 0, 5, 20)]
    assert split.spans(8, 5) == [(1, 8, 2, 0), (2, 0, 3, 2)]
    assert split.spans(24, 1) == [(3, 4, 1, 0)]
    with pytest.raises(ValueError, match="inconsistent"):
        Split.from_metadata(Split("a" * 12, 10, 3, 31).encode())


# ----- the engine ----------------------------------------------------------------------------------------------
def test_the_engine_s_own_files_go_split_and_come_back_verified(s3_server, where, shm_root, capsys, monkeypatch):
    bucket, prefix = where
    s3 = {"name": "s3", "kind": "fsspec", "url": f"s3://{bucket}/{prefix}", "options": s3_server.storage_options(),
          "part_size": PART, "max_concurrency": 4, "split_blobs": True, "keep": 1, "codecs": {"extra": "torch"}}
    g = torch.Generator().manual_seed(0)
    items = {"model": {"w": torch.randn(3 * PART // 4 + 17, generator=g)},
             "extra": {"v": torch.randn(2 * PART // 4, generator=g)}}
    cfg = {"run_id": "split", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}, s3]}
    copied_for = []  # keys whose parts were gathered into buffers of the upload's own
    real_take = _s3.Upload._take_buffer
    monkeypatch.setattr(_s3.Upload, "_take_buffer", lambda self: copied_for.append(self.key) or real_take(self))
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            items["model"]["w"].add_(1.0)
            engine.save(step, items).wait()
    # the flat file's parts are views of the pinned slot (StableChunks), header and tensor bytes alike
    assert copied_for and not any(k.endswith(".flat") for k in copied_for), copied_for
    held = objects(s3_server, bucket, prefix)
    assert not any(k.startswith("iter_0000001/") for k in held)  # keep: 1, pieces included
    flat = [k for k in held if k.endswith(".flat")]
    assert flat == ["iter_0000002/rank_00000/model.flat"]
    assert [k.split(PIECE_MARK)[0] for k in held if is_piece_name(k)] == flat * 3  # 15 MiB and a header
    torch_file = "iter_0000002/rank_00000/extra.pt"
    assert held[torch_file] > 2 * PART  # another program's format: one object
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    with CheckpointEngine({"run_id": "split-r", "tiers": [s3]}) as reader:
        res = reader.load()
    assert res.tier == "s3" and res.step == 2 and res.verified
    assert_same(res.items, items)

    for name, value in s3_server.env().items():  # the CLI reads the endpoint and keys from the environment
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["verify", f"s3://{bucket}/{prefix}"]) == 0
    out = capsys.readouterr().out
    assert "model.flat" in out or "ok" in out.lower(), out


def test_the_drain_s_failure_midway_leaves_the_previous_step_and_no_pieces(s3_server, where, shm_root, monkeypatch):
    bucket, prefix = where
    s3 = {"name": "s3", "kind": "fsspec", "url": f"s3://{bucket}/{prefix}", "options": s3_server.storage_options(),
          "part_size": PART, "max_concurrency": 2, "split_blobs": True,
          "retry": {"attempts": 1, "initial_s": 0.01, "max_s": 0.01, "deadline_s": 5}}
    items = {"model": {"w": torch.arange(3 * PART // 4, dtype=torch.float32)}}
    cfg = {"run_id": "split-f", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}, s3]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, items).wait()
        before = objects(s3_server, bucket, prefix)
        real = _s3_split.SplitUpload._send_part
        calls = [0]

        async def fail_second(self, number, view, checksum):
            calls[0] += 1
            if calls[0] == 2:
                raise TransientTierError("injected", tier="s3", key=self.key)
            return await real(self, number, view, checksum)

        monkeypatch.setattr(_s3_split.SplitUpload, "_send_part", fail_second)
        items["model"]["w"].add_(1)
        with pytest.raises(SaveError, match="injected"):
            engine.save(2, items).wait()
    after = objects(s3_server, bucket, prefix)
    assert {k: v for k, v in after.items() if k.startswith("iter_0000001/")} == {
        k: v for k, v in before.items() if k.startswith("iter_0000001/")} != {}
    assert not any(is_piece_name(k) for k in after if k.startswith("iter_0000002/"))
    with CheckpointEngine({"run_id": "split-fr", "tiers": [s3]}) as reader:
        assert reader.load().step == 1


# ----- what the requests carry ----------------------------------------------------------------------------------
def _crc32_b64(data: bytes) -> str:
    from botocore.httpchecksum import Crc32Checksum

    c = Crc32Checksum()
    c.update(data)
    return c.b64digest()


@pytest.mark.parametrize("config, crc, signed", [({}, True, False),
                                                 ({"request_checksum_calculation": "when_required"}, False, False),
                                                 ({"s3": {"payload_signing_enabled": True}}, True, True)])
def test_puts_carry_the_crc_botocore_would_send_and_no_body_hash(make_tier, s3_fault_proxy, where, config, crc,
                                                                 signed):
    """Each PutObject carries the CRC-32 botocore would have computed on the event loop (computed in the
    producer's thread instead), and over plain HTTP no SHA-256 of its body; both as configured."""
    bucket, prefix = where
    options = {**s3_fault_proxy.storage_options(), "config_kwargs": config}
    tier = make_tier("fsspec", url=f"s3://{bucket}/{prefix}", options=options, part_size=PART, max_concurrency=2,
                     split_blobs=True)
    data = blob(2 * PART + 5, 14)
    s3_fault_proxy.reset_log()
    tier.write_private_blob("k", [data])
    tier.write_blob("small", [b"abc"])
    puts = s3_fault_proxy.ops("PutObject")
    assert len(puts) == 4
    raw = data.numpy().tobytes()
    expected = sorted(_crc32_b64(b) for b in (raw[:PART], raw[PART:2 * PART], raw[2 * PART:], b"abc"))
    assert sorted(r.checksum_crc32 or "" for r in puts) == (expected if crc else [""] * 4)
    assert all((r.payload_hash != "UNSIGNED-PAYLOAD") == signed for r in puts), [r.payload_hash for r in puts]
    assert torch.equal(tier.read_blob("k"), data)

    s3_fault_proxy.reset_log()  # a multipart upload's parts (files other programs read) carry theirs too
    tier.write_blob("whole", [data])
    parts = sorted(s3_fault_proxy.ops("UploadPart"), key=lambda r: r.part_number)
    assert [r.checksum_crc32 for r in parts] == ([_crc32_b64(raw[:PART]), _crc32_b64(raw[PART:2 * PART]),
                                                  _crc32_b64(raw[2 * PART:])] if crc else [None] * 3)
    assert torch.equal(tier.read_blob("whole"), data)


def test_checksums_off_in_the_aws_config_file_are_off(make_tier, s3_fault_proxy, where, tmp_path, monkeypatch):
    """``request_checksum_calculation = when_required`` in the AWS config file (a store that refuses checksum
    headers) is honoured as botocore honours it: no CRC header from the tier either."""
    bucket, prefix = where
    config = tmp_path / "aws_config"
    config.write_text("[default]\nrequest_checksum_calculation = when_required\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    tier = make_tier("fsspec", url=f"s3://{bucket}/{prefix}", options=s3_fault_proxy.storage_options(),
                     part_size=PART)
    s3_fault_proxy.reset_log()
    tier.write_blob("small", [b"abc"])
    assert [r.checksum_crc32 for r in s3_fault_proxy.ops("PutObject")] == [None]


def test_a_piece_listing_that_says_more_and_not_where_is_an_error_not_a_loop(tier, s3_server, where, monkeypatch):
    """A store answering IsTruncated with the continuation token it was given: the listing of a blob's pieces
    asked again for ever (found by a review). It gives up with a transient error, as the tier's other listings do."""
    import threading

    from tiered_ckpt.errors import TransientTierError

    tier.write_private_blob("a/one", [blob(2 * PART + 1, 4)])
    call = tier.fs._call_s3

    async def stuck(method, *args, **kwargs):
        kwargs.pop("ContinuationToken", None)
        answer = await call(method, *args, **kwargs)
        if method == "list_objects_v2" and ".tcsplit-" in kwargs.get("Prefix", ""):
            answer = {**answer, "IsTruncated": True, "NextContinuationToken": "the same"}
        return answer

    monkeypatch.setattr(tier.fs, "_call_s3", stuck)
    outcome: list[BaseException | None] = []

    def delete() -> None:
        try:
            tier.delete("a/one")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            outcome.append(exc)

    worker = threading.Thread(target=delete, daemon=True)
    worker.start()
    worker.join(60)
    assert outcome and isinstance(outcome[0], TransientTierError), outcome
    assert "the store says there is more, and not where" in str(outcome[0])
