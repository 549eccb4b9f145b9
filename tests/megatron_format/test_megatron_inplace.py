"""The gather-free commit of the ``megatron`` layout (tiered_ckpt/megatron/inplace.py): each DP rank writes its
own ranges of Megatron's ``distrib_optim.pt`` in place, the committing rank the rest; the file must be the gather
path's byte for byte."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import zlib

import pytest
import torch
from megatron_synthetic import ModelSpec, SyntheticJob

from tiered_ckpt.errors import CorruptionError, LayoutMismatchError
from tiered_ckpt.megatron import inplace, rank_shard
from tiered_ckpt.megatron.crc_combine import crc32_combine, crc32_of_parts
from tiered_ckpt.megatron.merge import GroupPart, megatron_object
from tiered_ckpt.megatron.torch_zip import iter_torch_save
from tiered_ckpt.tiers._files import BlobFiles
from tiered_ckpt.tiers._positional import PositionalFiles


def _files(tmp_path) -> PositionalFiles:
    return PositionalFiles(BlobFiles("t", str(tmp_path), file_mode=0o644, dir_mode=0o755, fsync=False))


def _gathered(job: SyntheticJob) -> dict[str, bytes]:
    """The gather path's bytes of every directory's file."""
    shards = {r: rank_shard.parse(job.rank_shard(r), where=f"rank {r}") for r in range(job.world_size)}
    from tiered_ckpt.megatron.merge import plan_dirs

    out = {}
    for d, parts in plan_dirs(shards).items():
        out[d] = b"".join(bytes(memoryview(c).cast("B")) if not isinstance(c, torch.Tensor)
                          else c.numpy().tobytes() for c in iter_torch_save(megatron_object(parts),
                                                                            archive="distrib_optim"))
    return out


def _in_place(job: SyntheticJob, tmp_path, order=None, entries_out: list | None = None
              ) -> tuple[dict[str, bytes], list]:
    writer = _files(tmp_path)
    entries = []
    ranks = list(range(job.world_size)) if order is None else order
    for r in ranks:
        shard = rank_shard.parse(job.rank_shard(r), where=f"rank {r}")
        facts = inplace.write_rank_pieces(writer, "iter_0000001", shard, run_id="run", step=1)
        assert facts is not None
        size, checksum = inplace.piece_checksum(facts)
        entries.append(_entry(r, size, checksum, facts))
    merged = inplace.finish_files(writer, 1, entries)
    if entries_out is not None:
        entries_out += entries
    out = {e.key.split("/")[1]: (tmp_path / e.key).read_bytes() for e in merged}
    for e in merged:
        data = out[e.key.split("/")[1]]
        assert e.size == len(data) and e.checksum == f"crc32:{zlib.crc32(data):08x}"
    return out, merged


def _entry(rank: int, size: int, checksum: str, facts: dict):
    from tiered_ckpt.manifest import FileEntry

    return FileEntry(key=f"iter_0000001/rank_{rank:05d}/distrib_optim.pt", item="distrib_optim", rank=rank,
                     codec="torch", size=size, checksum=checksum, meta={"in_place": facts})


def test_crc_combine_matches_zlib_on_the_whole():
    rng = random.Random(1)
    for _ in range(50):
        a, b = os.urandom(rng.randrange(0, 300)), os.urandom(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = os.urandom(100_000)
    cuts = sorted(rng.sample(range(1, len(data)), 20))
    pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert crc32_of_parts((zlib.crc32(p), len(p)) for p in pieces) == zlib.crc32(data)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("bucket", [6000, 777, None])  # uneven buckets (777: shards end inside padding)
def test_in_place_equals_the_gather(tmp_path, dp, bucket):
    job = SyntheticJob(spec=ModelSpec(ddp_bucket_size=bucket), dp=dp)
    want = _gathered(job)
    got, merged = _in_place(job, tmp_path, order=list(reversed(range(job.world_size))))
    assert got == want
    obj = torch.load(io.BytesIO(got["mp_rank_00"]), weights_only=True)
    assert obj["buckets_coalesced"] is True
    assert not [n for n in os.listdir(tmp_path / "iter_0000001" / "mp_rank_00") if ".tmp-" in n]


def test_in_place_tp2_pp2(tmp_path):
    job = SyntheticJob(tp=2, pp=2, dp=2)
    assert _in_place(job, tmp_path)[0] == _gathered(job)


def test_chained_optimizer_with_ep_is_left_to_the_gather():
    job = SyntheticJob(spec=ModelSpec(num_experts=4), dp=2, ep=2)
    shard = rank_shard.parse(job.rank_shard(1), where="rank 1")
    assert len(shard.optimizers) == 2 and inplace.directory_parts(shard) is None


def test_stale_longer_temp_file_is_cut_and_missing_ranks_refused(tmp_path):
    job = SyntheticJob(dp=2)
    writer = _files(tmp_path)
    shard0 = rank_shard.parse(job.rank_shard(0), where="rank 0")
    facts = inplace.write_rank_pieces(writer, "iter_0000001", shard0, run_id="run", step=1)
    with pytest.raises(LayoutMismatchError, match="pieces from ranks"):
        inplace.finish_files(writer, 1, [_entry(0, *inplace.piece_checksum(facts), facts)])
    # a piece missing from the list (a torn manifest): the gap is named, nothing is renamed
    short = {**facts, "pieces": facts["pieces"][1:]}
    shard1 = rank_shard.parse(job.rank_shard(1), where="rank 1")
    facts1 = inplace.write_rank_pieces(writer, "iter_0000001", shard1, run_id="run", step=1)
    with pytest.raises(CorruptionError, match="written by no rank"):
        inplace.finish_files(writer, 1, [_entry(0, 0, "", short), _entry(1, 0, "", facts1)])
    assert not (tmp_path / "iter_0000001/mp_rank_00/distrib_optim.pt").exists()
    with open(tmp_path / facts["temp"], "ab") as f:  # another attempt's longer file
        f.write(b"x" * 1000)
    inplace.finish_files(writer, 1, [_entry(0, 0, "", facts), _entry(1, 0, "", facts1)])
    assert (tmp_path / "iter_0000001/mp_rank_00/distrib_optim.pt").read_bytes() == _gathered(job)["mp_rank_00"]


def _split_item(data: bytes, facts: dict, rank: int, topology) -> dict:
    """The reference for a rank's item read back: Megatron's whole object loaded and split for the rank (what a
    load through the file's pickle gives)."""
    from tiered_ckpt.megatron.distrib_optim import split_state, sub_optimizer_states

    states = sub_optimizer_states(torch.load(io.BytesIO(data), weights_only=True))
    subs = []
    for part in inplace.parts_from_meta(facts["optimizers"]):
        dp_rank = part.group.index(rank)
        shards = split_state(states[part.index], part.geometry, dp_rank, dp_size=len(part.group))
        subs.append(rank_shard.SubOptimizerShard(part.geometry, dp_rank, part.group, shards, part.kind))
    return rank_shard.build(rank=rank, topology=topology, optimizers=subs)


@pytest.mark.parametrize(("tp", "pp", "dp", "bucket"), [(1, 1, 2, None), (1, 1, 4, 777), (2, 2, 2, 6000)])
def test_a_rank_reads_its_shards_from_its_ranges_once(tmp_path, tp, pp, dp, bucket):
    """Every rank's item read back from the merged file equals Megatron's object split for it (777: shards end
    inside the padding, which the file does not hold), and only the rank's ranges are read, each once."""
    from helpers import assert_same

    from tiered_ckpt.tiers.local import LocalOptions, LocalTier

    job = SyntheticJob(spec=ModelSpec(ddp_bucket_size=bucket), tp=tp, pp=pp, dp=dp)
    entries: list = []
    files, merged = _in_place(job, tmp_path, entries_out=entries)
    tier = LocalTier("t", LocalOptions(path=str(tmp_path)))
    reads: list[int] = []
    read_range = tier.read_range
    tier.read_range = lambda key, offset, length: reads.append(length) or read_range(key, offset, length)
    for e in entries:
        facts = e.meta["in_place"]
        reads.clear()
        got = inplace.read_rank_shard(tier, e, e.rank, job.topology, verify=True)
        assert sorted(reads) == sorted(p[2] for p in facts["pieces"])
        want = _split_item(files[facts["key"].split("/")[1]], facts, e.rank, job.topology)
        assert_same(want, got)
    # a job whose DP groups are not the ones that wrote the file is refused, not given another rank's bytes
    other = SyntheticJob(spec=ModelSpec(ddp_bucket_size=bucket), tp=1, pp=1, dp=tp * pp * dp)
    if other.topology.world_size == job.topology.world_size and (tp, pp) != (1, 1):
        with pytest.raises(LayoutMismatchError, match="DP group"):
            inplace.read_rank_shard(tier, entries[1], entries[1].rank, other.topology, verify=True)


def test_a_damaged_range_is_named_and_a_manifest_of_other_ranges_refused(tmp_path):
    from tiered_ckpt.tiers.local import LocalOptions, LocalTier

    job = SyntheticJob(dp=2)
    entries: list = []
    _, merged = _in_place(job, tmp_path, entries_out=entries)
    tier = LocalTier("t", LocalOptions(path=str(tmp_path)))
    facts = entries[1].meta["in_place"]
    plan = inplace.plan_file(inplace.parts_from_meta(facts["optimizers"]))
    t, pos, length, _ = facts["pieces"][0]
    with open(tmp_path / merged[0].key, "r+b") as f:
        f.seek(plan.records[t].data_offset + pos + length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    inplace.read_rank_shard(tier, entries[0], 0, job.topology, verify=True)  # rank 0's ranges are intact
    with pytest.raises(CorruptionError, match=f"rank 1's bytes at {pos} of {plan.records[t].name}"):
        inplace.read_rank_shard(tier, entries[1], 1, job.topology, verify=True)
    inplace.read_rank_shard(tier, entries[1], 1, job.topology, verify=False)  # verify=False reads it as is
    torn = dataclasses.replace(entries[1], meta={"in_place": {**facts, "pieces": facts["pieces"][1:]}})
    with pytest.raises(CorruptionError, match="other ranges than the file's plan"):
        inplace.read_rank_shard(tier, torn, 1, job.topology, verify=True)


def test_pieces_name_ranges_of_the_file(tmp_path):
    job = SyntheticJob(dp=2)
    _, merged = _in_place(job, tmp_path)
    shard = rank_shard.parse(job.rank_shard(1), where="rank 1")
    (tmp_path / "again").mkdir()
    facts = inplace.write_rank_pieces(_files(tmp_path / "again"), "iter_0000001", shard, run_id="run", step=1)
    plan = inplace.plan_file([GroupPart(0, "dense", (0, 1), shard.optimizers[0].geometry, ())])
    data = (tmp_path / merged[0].key).read_bytes()
    for t, pos, length, crc in facts["pieces"]:
        start = plan.records[t].data_offset + pos
        assert zlib.crc32(data[start:start + length]) == crc


@pytest.mark.parametrize("direct", [True, False])
def test_write_range_direct_interiors_and_shared_edges(tmp_path, direct):
    """Writers of adjacent, unaligned ranges of one file (each with its own descriptors, as ranks have): the
    whole pages of a large range go direct (copied through bounce buffers, or from memory congruent with the
    file), the pages two ranges share through the page cache; the file is every range's bytes, and each
    writer's hasher saw exactly its range."""
    from tiered_ckpt.checksum import Crc32Hasher

    files = BlobFiles("t", str(tmp_path), file_mode=0o644, dir_mode=0o755, fsync=True, direct_io=direct)
    data = torch.randint(0, 256, (7 << 20,), dtype=torch.uint8)
    cuts = [0, 1000, (1 << 20) + 5000, (3 << 20) + 12345, 4 << 20, (6 << 20) + 7, 7 << 20]  # one 4 KiB-aligned
    handles = [PositionalFiles(files).open("d/.f.tmp-0123456789abcdef", size=len(data)) for _ in cuts[1:]]
    assert all((h.direct_fd is not None) == direct for h in handles)
    for i in reversed(range(len(cuts) - 1)):
        crc = Crc32Hasher()
        view = memoryview(data.numpy())[cuts[i]:cuts[i + 1]]
        PositionalFiles(files).write_range(handles[i], view, cuts[i], crc)
        assert crc.crc == zlib.crc32(view)
        PositionalFiles(files).sync(handles[i], data_only=True)
    for h in handles:
        PositionalFiles(files).close(h)
    PositionalFiles(files).rename("d/.f.tmp-0123456789abcdef", "d/f")
    assert (tmp_path / "d" / "f").read_bytes() == data.numpy().tobytes()


class _PositionalTier:
    def positional(self):
        return object()


class _ObjectStoreTier:
    def positional(self):
        return None


@pytest.mark.parametrize("dp", [1, 4])
def test_the_placement_is_each_shard_s_offset_in_megatron_s_file_modulo_a_page(dp):
    """Every fp32 shard of the rank is named, with the offset its first byte has in the file the ranks write."""
    from tiered_ckpt.layouts.megatron import MegatronLayout
    from tiered_ckpt.megatron.distrib_optim import shard_key

    job = SyntheticJob(dp=dp)
    rank = dp - 1
    item = job.rank_shard(rank)
    wish = MegatronLayout().placement("distrib_optim", item, _PositionalTier())
    shard = rank_shard.parse(item, where="test")
    _, parts = inplace.directory_parts(shard)
    plan = inplace.plan_file(parts)
    spans = inplace.rank_spans(plan, parts, rank)
    assert spans and len(wish) == len(spans)
    for span in spans:
        t = shard.optimizers[span.optimizer].shards[shard_key(span.buffer, span.bucket, span.key)]
        assert wish[id(t)] == (plan.records[span.record].data_offset + span.pos) % 4096
    assert MegatronLayout().placement("model_optim_rng", item, _PositionalTier()) is None
    assert MegatronLayout().placement("distrib_optim", item, _ObjectStoreTier()) is None  # S3: parts, no pages


def test_a_placement_that_cannot_be_made_never_fails_the_save(monkeypatch):
    """Only speed depends on the placement: an item it cannot read, or any error while planning, gives none."""
    from tiered_ckpt.errors import ConfigError
    from tiered_ckpt.layouts.megatron import MegatronLayout

    assert MegatronLayout().placement("distrib_optim", {"format": "other"}, _PositionalTier()) is None

    def fails(shard, modulus):
        raise ConfigError("rank 9 is outside the world of 4")

    monkeypatch.setattr(inplace, "shard_placement", fails)
    assert MegatronLayout().placement("distrib_optim", SyntheticJob(dp=2).rank_shard(0), _PositionalTier()) is None
