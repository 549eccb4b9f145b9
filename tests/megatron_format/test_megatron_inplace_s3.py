"""The gather-free commit of the ``megatron`` layout on S3 (tiered_ckpt/megatron/inplace_parts.py), against moto's
real HTTP server: every DP rank uploads its parts of one multipart upload of Megatron's ``distrib_optim.pt``, the
committing rank sends the file's tail and completes it; the object must be the gather path's byte for byte."""

from __future__ import annotations

import io
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from megatron_synthetic import ModelSpec, SyntheticJob
from test_megatron_inplace import _entry, _gathered

from tiered_ckpt.errors import CorruptionError, LayoutMismatchError, PermanentTierError, TransientTierError
from tiered_ckpt.megatron import inplace, inplace_parts, rank_shard
from tiered_ckpt.megatron.merge import GroupPart
from tiered_ckpt.tiers._s3 import S3_MIN_PART
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

MiB = 1 << 20
STEP_DIR = "iter_0000001"


@pytest.fixture
def s3_url(s3_server, s3_bucket):
    return f"s3://{s3_bucket}/run-{uuid.uuid4().hex[:8]}", s3_server.storage_options()


def _tier(s3_url, part_size: int = 8 * MiB):
    url, options = s3_url
    return FsspecTier("s3", FsspecOptions(url=url, options=options, part_size=part_size, max_concurrency=4,
                                          timeout_s=10))


def _ranks(job: SyntheticJob, s3_url, *, part_size: int = 8 * MiB, ranks=None, wait_s: float = 60.0):
    """Every rank's ``write_rank_parts`` at once, each with a tier of its own (as processes have)."""
    ranks = list(range(job.world_size)) if ranks is None else ranks

    def one(r: int):
        shard = rank_shard.parse(job.rank_shard(r), where=f"rank {r}")
        tier = _tier(s3_url, part_size)
        return r, inplace_parts.write_rank_parts(tier.shared_parts(), tier, STEP_DIR, shard, run_id="run", step=1,
                                                 wait_s=wait_s)

    with ThreadPoolExecutor(len(ranks)) as pool:
        return dict(pool.map(one, ranks))


def _finish(job, s3_url, facts, part_size: int = 8 * MiB):
    tier = _tier(s3_url, part_size)
    entries = [_entry(r, *inplace.piece_checksum(f), f) for r, f in sorted(facts.items())]
    return tier, inplace_parts.finish_uploads(tier.shared_parts(), tier, 1, entries)


def _leftovers(tier) -> list[str]:
    bucket, prefix, _ = tier.fs.split_path(tier.root)
    uploads = tier.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in uploads] + tier.temp_files()


@pytest.mark.parametrize(("dp", "spec"), [
    (2, ModelSpec(hidden=256, ddp_bucket_size=None)),  # one bucket per buffer: every span its own part(s)
    (4, ModelSpec(hidden=256, ddp_bucket_size=400_000)),  # 0.4 MiB spans: grouped, most of them loose
])
def test_uploaded_parts_equal_the_gather(s3_url, dp, spec):
    job = SyntheticJob(spec=spec, dp=dp)
    facts = _ranks(job, s3_url)
    assert all(f is not None and f["upload"] == facts[0]["upload"] for f in facts.values())
    tier, merged = _finish(job, s3_url, facts)
    want = _gathered(job)["mp_rank_00"]
    got = tier.read_blob(merged[0].key).numpy().tobytes()
    assert got == want
    assert merged[0].size == len(got) and merged[0].checksum == f"crc32:{zlib.crc32(got):08x}"
    assert torch.load(io.BytesIO(got), weights_only=True)["buckets_coalesced"] is True
    assert _leftovers(tier) == []  # no upload in progress, no side object
    sent = sorted(p["PartNumber"] for f in facts.values() for p in f["parts"])
    assert sent == list(range(1, len(sent) + 1))  # the committer sent only the tail
    # each rank's pieces are its ranges of the object: a load of its shards reads them back, checked
    for r, f in facts.items():
        inplace.read_rank_shard(tier, _entry(r, 0, "", f), r, job.topology, verify=True)


def test_plan_parts_tiles_the_file_within_s3_limits():
    """Every part but the tail is at least S3's minimum, the parts tile the file, each chunk lies in its part, and
    long spans are cut at part_size."""
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=300_000), dp=4)
    shard = rank_shard.parse(job.rank_shard(0), where="rank 0")
    parts = [GroupPart(0, "dense", tuple(range(4)), shard.optimizers[0].geometry, ())]
    plan = inplace.plan_file(parts)
    spans = inplace.rank_spans(plan, parts)
    for part_size in (S3_MIN_PART, 6 * MiB):
        pp = inplace_parts.plan_parts(plan, spans, part_size=part_size, min_part=S3_MIN_PART, max_part=5 << 30,
                                      max_parts=10_000)
        assert pp is not None
        assert pp.parts[0].start == 0 and pp.parts[-1].end == plan.total
        assert all(a.end == b.start for a, b in zip(pp.parts, pp.parts[1:], strict=False))
        assert all(p.end - p.start >= S3_MIN_PART for p in pp.parts[:-1])
        assert pp.parts[-1].uploader == inplace_parts.COMMITTER and not pp.parts[-1].chunks
        covered = sum(c.size for p in pp.parts for c in p.chunks)
        assert covered == sum(s.length for s in spans)
        for p in pp.parts:
            for c in p.chunks:
                s = spans[c.span]
                at = plan.records[s.record].data_offset + s.pos + c.lo
                assert p.start <= at and at + c.size <= p.end
        assert all(spans[c.span].length < S3_MIN_PART for _, c in pp.loose())  # only short spans travel
    # too little data for one part: left to the gather
    small = SyntheticJob(dp=2)
    shard = rank_shard.parse(small.rank_shard(0), where="rank 0")
    parts = [GroupPart(0, "dense", (0, 1), shard.optimizers[0].geometry, ())]
    plan = inplace.plan_file(parts)
    assert inplace_parts.plan_parts(plan, inplace.rank_spans(plan, parts), part_size=S3_MIN_PART,
                                    min_part=S3_MIN_PART, max_part=5 << 30, max_parts=10_000) is None


def test_a_small_file_is_left_to_the_gather(s3_url):
    job = SyntheticJob(dp=2)  # a few KiB of optimizer state: no part reaches S3's minimum
    assert set(_ranks(job, s3_url).values()) == {None}
    assert _leftovers(_tier(s3_url)) == []


def test_a_missing_rank_is_named_after_the_wait(s3_url):
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=None), dp=2)
    with pytest.raises(TransientTierError, match="rank 0"):
        _ranks(job, s3_url, ranks=[1], wait_s=1.0)  # rank 0 never starts the upload


def test_the_commit_refuses_parts_that_do_not_match(s3_url):
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=None), dp=2)
    facts = _ranks(job, s3_url)
    bad = {0: facts[0], 1: {**facts[1], "descriptors": {t: crc ^ 1 for t, crc in facts[1]["descriptors"].items()}}}
    assert facts[1]["descriptors"]  # rank 1 sends the parts that end a record: it waited for rank 0's CRC-32s
    with pytest.raises(CorruptionError, match="data descriptor"):
        _finish(job, s3_url, bad)
    short = {0: facts[0], 1: {**facts[1], "parts": facts[1]["parts"][1:]}}
    with pytest.raises(LayoutMismatchError, match="rank 1 sent parts"):
        _finish(job, s3_url, short)
    tier = _tier(s3_url)
    assert not tier.exists(facts[0]["key"])  # nothing visible under the key
    _finish(job, s3_url, facts)  # the upload is still whole: the right facts complete it
    assert tier.read_blob(facts[0]["key"]).numpy().tobytes() == _gathered(job)["mp_rank_00"]


def test_a_retried_rank_reuses_the_upload(s3_url):
    """The directory's first rank writing again (a retry of its write) keeps the upload the others sent parts
    to: its id object names an upload the store still knows."""
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=None), dp=2)
    facts = _ranks(job, s3_url)
    again = _ranks(job, s3_url, ranks=[0])[0]
    assert again["upload"] == facts[0]["upload"]
    tier, merged = _finish(job, s3_url, {0: again, 1: facts[1]})
    assert tier.read_blob(merged[0].key).numpy().tobytes() == _gathered(job)["mp_rank_00"]


def test_a_commit_retried_after_its_completion_finds_the_object(s3_url):
    """The completion's answer lost, the commit tried again: the object the parts made is recognised (its multipart
    ETag), not sent again; an upload that is gone without making the object is an error, not a success."""
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=None), dp=2)
    facts = _ranks(job, s3_url)
    _, first = _finish(job, s3_url, facts)
    tier, again = _finish(job, s3_url, facts)
    assert again == first
    assert tier.read_blob(first[0].key).numpy().tobytes() == _gathered(job)["mp_rank_00"]
    tier.delete(first[0].key)
    with pytest.raises(PermanentTierError, match="neither open nor completed"):
        _finish(job, s3_url, facts)


def test_a_token_left_by_an_earlier_save_of_the_step_is_not_taken(s3_url):
    """The same step saved again while the token of its first save's (completed) upload is still there: the
    first rank publishes a new upload, and the others wait for it instead of sending parts to the old one."""
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=None), dp=2)
    facts = _ranks(job, s3_url)
    tier, _ = _finish(job, s3_url, facts)
    token = inplace_parts.SideObjects(facts[0]["key"], facts[0]["sides"]).upload
    tier.shared_parts().publish(token, facts[0]["key"], facts[0]["upload"])  # as a crash after completing leaves
    with pytest.raises(TransientTierError, match="an open upload"):  # rank 1 alone: it never takes the old one
        _ranks(job, s3_url, ranks=[1], wait_s=1.0)
    again = _ranks(job, s3_url)
    assert again[0]["upload"] == again[1]["upload"] != facts[0]["upload"]
    tier, merged = _finish(job, s3_url, again)
    assert tier.read_blob(merged[0].key).numpy().tobytes() == _gathered(job)["mp_rank_00"]
    assert _leftovers(tier) == []


def test_tp2_pp2_each_directory_its_own_upload(s3_url):
    """TP 2 x PP 2 x DP 2: four mp_rank directories, each the upload of its own DP group, all completed by one
    committing rank."""
    job = SyntheticJob(spec=ModelSpec(hidden=512, ddp_bucket_size=None), tp=2, pp=2, dp=2)
    facts = _ranks(job, s3_url)
    assert all(f is not None for f in facts.values())
    assert len({f["upload"] for f in facts.values()}) == 4
    tier, merged = _finish(job, s3_url, facts)
    want = _gathered(job)
    assert sorted(e.key.split("/")[1] for e in merged) == sorted(want)
    for e in merged:
        assert tier.read_blob(e.key).numpy().tobytes() == want[e.key.split("/")[1]]
    assert _leftovers(tier) == []


def test_a_save_over_a_crashed_save_of_the_step_never_completes_stale_bytes(s3_url):
    """A save of the step crashed before its commit (its upload open, its side objects left); the step saved
    again with other values reuses the open upload. A rank that takes the crashed save's CRC-32s and loose spans
    (here: it runs before the others rewrite theirs) sends the old bytes: the commit refuses them, and nothing
    appears under the key. Run in turn, the new save's ranks complete the new values."""
    spec = ModelSpec(hidden=256, ddp_bucket_size=400_000)
    old, new = SyntheticJob(spec=spec, dp=4, seed=0), SyntheticJob(spec=spec, dp=4, seed=1)
    crashed = _ranks(old, s3_url)  # never finished
    uploader = next(r for r, f in crashed.items() if f["loose"] and f["descriptors"])
    early = _ranks(new, s3_url, ranks=[uploader])[uploader]
    assert early["upload"] == crashed[0]["upload"]  # the open upload, reused
    rest = _ranks(new, s3_url, ranks=[r for r in range(4) if r != uploader])
    with pytest.raises(CorruptionError, match="another save of this step"):
        _finish(new, s3_url, {**rest, uploader: early})
    tier = _tier(s3_url)
    assert not tier.exists(early["key"])
    facts = _ranks(new, s3_url)
    tier, merged = _finish(new, s3_url, facts)
    assert tier.read_blob(merged[0].key).numpy().tobytes() == _gathered(new)["mp_rank_00"]


def test_a_damaged_range_of_the_object_is_named(s3_url):
    """A byte of one rank's range changed in the completed object: checking that rank's pieces (what a load of its
    shards does first) names the file and the record; the other rank's pieces still check."""
    job = SyntheticJob(spec=ModelSpec(hidden=256, ddp_bucket_size=None), dp=2)
    facts = _ranks(job, s3_url)
    tier, merged = _finish(job, s3_url, facts)
    data = bytearray(tier.read_blob(merged[0].key).numpy().tobytes())
    plan = inplace.plan_file(inplace.parts_from_meta(facts[1]["optimizers"]))
    t, pos, length, _ = facts[1]["pieces"][-1]
    data[plan.records[t].data_offset + pos + length // 2] ^= 0xFF
    tier.write_blob(merged[0].key, [memoryview(data)])
    inplace.read_rank_shard(tier, _entry(0, 0, "", facts[0]), 0, job.topology, verify=True)
    with pytest.raises(CorruptionError, match=f"rank 1's bytes at {pos} of {plan.records[t].name}"):
        inplace.read_rank_shard(tier, _entry(1, 0, "", facts[1]), 1, job.topology, verify=True)


def test_an_open_upload_is_looked_up_without_reading_its_parts(s3_server, s3_bucket, s3_fault_proxy):
    """The ranks poll whether the directory's upload is open while its parts are being sent: they ask the store's
    uploads in progress, never the upload's parts (moto computes a listed part's ETag from its bytes without a
    lock; listing part 1 while it was being stored left it with a wrong ETag, and the completion failed)."""
    tier = FsspecTier("s3", FsspecOptions(url=f"s3://{s3_bucket}/run", options=s3_fault_proxy.storage_options()))
    parts = tier.shared_parts()
    upload = parts.create("d/f.pt")
    other = parts.create("d/f.pt.other")  # a key that shares the prefix
    s3_fault_proxy.reset_log()
    assert parts.alive("d/f.pt", upload) and not parts.alive("d/f.pt", other)
    parts.abort("d/f.pt", upload)
    assert not parts.alive("d/f.pt", upload)
    assert s3_fault_proxy.count("ListParts") == 0 and s3_fault_proxy.count("ListMultipartUploads") == 3
    parts.abort("d/f.pt.other", other)
