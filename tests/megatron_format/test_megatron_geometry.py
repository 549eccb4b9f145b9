"""Bucket geometry: computed from the param list, it equals what Megatron's live optimizer reported."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_fixtures import CONFIGS, RELOADS, model_params, rank_info, truth, truth_geometry

from tiered_ckpt.errors import ConfigError, DecodeError, LayoutMismatchError
from tiered_ckpt.megatron.geometry import (
    BufferGeometry,
    OptimizerGeometry,
    ParamSpec,
    bucket_pad_multiple,
    buffer_from_sizes,
    compute_buffer_geometry,
    compute_optimizer_geometry,
    geometry_from_sizes,
    megatron_bucket_size,
)

CASES = [(c, None) for c in CONFIGS] + list(RELOADS)


def _computed(t: dict, rank: int) -> OptimizerGeometry:
    info = t["rank_map"][str(rank)]
    bucket_size = megatron_bucket_size(
        t["dp"],
        ddp_bucket_size=t["model"]["ddp_bucket_size"],
        overlap_grad_reduce=t["model"]["overlap_grad_reduce"],
        pp_rank=info["pp"],
    )
    return compute_optimizer_geometry(model_params(t, rank), dp_size=t["dp"], bucket_size=bucket_size)


@pytest.mark.parametrize(("config", "reload_dp"), CASES)
def test_computed_geometry_equals_megatrons(config: str, reload_dp: int | None) -> None:
    t = truth(config, reload_dp)
    for rank in t["ranks"]:
        geo = _computed(t, int(rank))
        info = rank_info(t, int(rank))
        assert len(geo.buffers) == len(info["buffers"])
        for buf, want in zip(geo.buffers, info["buffers"], strict=True):
            assert buf.dtype_key == (torch.float32, torch.float32)
            assert (buf.numel, buf.numel_unpadded) == (want["numel"], want["numel_unpadded"])
            assert [(b.offset, b.numel, b.numel_unpadded) for b in buf.buckets] == [
                (b["offset_in_buffer"], b["N_b"], b["U_b"]) for b in want["buckets"]
            ]
            for bucket, want_bucket in zip(buf.buckets, want["buckets"], strict=True):
                assert [(p.name, list(p.shape), [p.start, p.end]) for p in bucket.params] == [
                    (p["name"], p["shape"], p["gbuf_world"]) for p in want_bucket["params"]
                ]
        # The constructor from live sizes agrees with the computed geometry.
        given = truth_geometry(t, int(rank))
        assert [(b.offset, b.numel, b.numel_unpadded) for b in given.buffers[0].buckets] == [
            (b.offset, b.numel, b.numel_unpadded) for b in geo.buffers[0].buckets
        ]


@pytest.mark.parametrize(("config", "reload_dp"), CASES)
def test_local_param_ranges_equal_megatrons_param_range_map(config: str, reload_dp: int | None) -> None:
    t = truth(config, reload_dp)
    for rank, info in t["ranks"].items():
        geo = _computed(t, int(rank))
        assert geo.dp_size == info["dp_size"]
        for buf, want in zip(geo.buffers, info["buffers"], strict=True):
            ranges = buf.local_param_ranges(info["dp_rank"])
            for b, want_bucket in enumerate(want["buckets"]):
                n = buf.shard_numel(b)
                assert n == want_bucket["local_numel"]
                assert [info["dp_rank"] * n, (info["dp_rank"] + 1) * n] == want_bucket[
                    "dp_rank_local_range_in_bucket"
                ]
                expected = [(p["name"], p["local"]) for p in want_bucket["params"] if "local" in p]
                got = [
                    (
                        r.name,
                        {
                            "gbuf_world": list(r.gbuf_world),
                            "gbuf_world_in_bucket": list(r.gbuf_world_in_bucket),
                            "gbuf_local": list(r.gbuf_local),
                            "param": list(r.param),
                        },
                    )
                    for r in ranges[b]
                ]
                assert got == expected


@pytest.mark.parametrize(("config", "dp"), RELOADS)
def test_with_dp_size_equals_megatrons_geometry_at_the_new_dp(config: str, dp: int) -> None:
    """docs/megatron-format.md, "Buckets and their sizes": only N_b changes with DP; U_b and in-bucket positions stay
    (confirmed)."""
    src, dst = truth(config), truth(config, dp)
    for rank, info in dst["ranks"].items():
        pp = dst["rank_map"][rank]["pp"]
        src_rank = next(int(r) for r, i in src["rank_map"].items() if i["pp"] == pp and i["dp"] == 0)
        for base in (truth_geometry(src, src_rank), _computed(src, src_rank)):
            moved = base.with_dp_size(dp)
            want = info["per_bucket_numel"][0]["float32,float32"]
            assert [b.numel for b in moved.buffers[0].buckets] == want
            assert [b.numel_unpadded for b in moved.buffers[0].buckets] == info["per_bucket_numel_unpadded"][
                0
            ]["float32,float32"]
            mult = math.lcm(dp, 128)
            assert want == [
                -(-u // mult) * mult for u in info["per_bucket_numel_unpadded"][0]["float32,float32"]
            ]
        assert _computed(src, src_rank).with_dp_size(dp) == _computed(dst, int(rank))


def test_pp_stage_above_zero_ignores_ddp_bucket_size() -> None:
    """The PP=2 run set ddp_bucket_size=6000, yet stage 1 has one bucket (+ the shared embedding's own)."""
    t = truth("dp2_tp1_pp2")
    assert t["model"]["ddp_bucket_size"] == 6000
    assert [b["N_b"] for b in rank_info(t, 2)["buffers"][0]["buckets"]] == [8192, 100096]
    assert megatron_bucket_size(2, ddp_bucket_size=6000, pp_rank=1) is None
    assert megatron_bucket_size(2, ddp_bucket_size=6000, pp_rank=0) == 6000
    assert megatron_bucket_size(8) == 40_000_000
    assert megatron_bucket_size(64) == 64_000_000  # grows with DP: re-sharding across this changes buckets
    assert megatron_bucket_size(8, overlap_grad_reduce=False) is None
    assert megatron_bucket_size(8, disable_bucketing=True) is None


def test_pp1_tied_embedding_shares_a_bucket() -> None:
    """With PP = 1 the word embedding is not shared_embedding: it shares the last bucket with other params."""
    t = truth("dp4_tp1_pp1")
    last = rank_info(t, 0)["buffers"][0]["buckets"][-1]
    assert [p["name"] for p in last["params"]][-1] == "module.embedding.word_embeddings.weight"
    assert len(last["params"]) > 1


def test_param_starts_are_64_aligned_and_gaps_count_as_unpadded() -> None:
    params = [ParamSpec("a", (10,)), ParamSpec("b", (3, 5)), ParamSpec("c", (64,))]  # placed c, b, a
    buf = compute_buffer_geometry(params, dp_size=3, bucket_size=None)
    (bucket,) = buf.buckets
    assert [(p.name, p.start, p.end) for p in bucket.params] == [("c", 0, 64), ("b", 64, 79), ("a", 128, 138)]
    assert bucket.numel_unpadded == 138  # includes the 79..128 gap
    assert bucket.numel == 384  # lcm(3, 128)
    assert buf.world_range(bucket.params[2]) == (128, 138)


def test_bucket_closing_rules() -> None:
    params = [ParamSpec(f"p{i}", (100,)) for i in range(6)] + [ParamSpec("emb", (50,), shared_embedding=True)]
    # Placed: emb (own bucket), p5..p0 with bucket_size 150: buckets close once >= 150 elements.
    buf = compute_buffer_geometry(params, dp_size=2, bucket_size=150)
    assert [[p.name for p in b.params] for b in buf.buckets] == [
        ["emb"],
        ["p5", "p4"],
        ["p3", "p2"],
        ["p1", "p0"],
    ]
    assert [b.numel_unpadded for b in buf.buckets] == [50, 228, 228, 228]  # 100, gap to 128, 100
    assert [b.numel for b in buf.buckets] == [128, 256, 256, 256]
    assert [b.offset for b in buf.buckets] == [0, 128, 384, 640]
    # A shared embedding in the middle closes the current bucket before and after it.
    mid = [ParamSpec("x", (10,)), ParamSpec("emb", (10,), shared_embedding=True), ParamSpec("y", (10,))]
    buf = compute_buffer_geometry(mid, dp_size=1, bucket_size=None)
    assert [[p.name for p in b.params] for b in buf.buckets] == [["y"], ["emb"], ["x"]]


def test_high_nccl_busbw_padding() -> None:
    assert bucket_pad_multiple(3) == 384
    assert bucket_pad_multiple(3, pad_for_high_nccl_busbw=True) == math.lcm(3, 128, 65536)
    buf = compute_buffer_geometry(
        [ParamSpec("a", (1000,))], dp_size=4, bucket_size=None, pad_for_high_nccl_busbw=True
    )
    assert buf.buckets[0].numel == 65536
    assert buf.with_dp_size(3).buckets[0].numel == 3 * 65536  # the flag carries over


def test_buffers_split_by_dtype_in_order_of_first_appearance() -> None:
    params = [
        ParamSpec("a", (8,), torch.bfloat16),
        ParamSpec("b", (8,)),
        ParamSpec("c", (8,), torch.bfloat16),
    ]
    geo = compute_optimizer_geometry(params, dp_size=1, bucket_size=None, grad_dtype=torch.float32)
    assert [b.dtype_key for b in geo.buffers] == [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ]
    assert [[p.name for p in b.params()] for b in geo.buffers] == [["c", "a"], ["b"]]
    geo = compute_optimizer_geometry(params, dp_size=1, bucket_size=None)
    assert geo.buffers[0].dtype_key == (torch.bfloat16, torch.bfloat16)


def test_geometry_from_sizes_checks_its_input() -> None:
    key = (torch.bfloat16, torch.float32)
    geo = geometry_from_sizes([(key, [256, 128], [200, 128])], dp_size=2)
    assert (
        geo.dp_size == 2
        and geo.buffers[0].numel_unpadded == 328
        and geo.buffers[0].world_offsets() == [0, 200]
    )
    with pytest.raises(LayoutMismatchError, match="divisible"):
        buffer_from_sizes(key, [255], [200], dp_size=2)
    with pytest.raises(LayoutMismatchError, match="U_b <= N_b"):
        buffer_from_sizes(key, [256], [300], dp_size=2)
    with pytest.raises(LayoutMismatchError, match="unpadded sizes"):
        buffer_from_sizes(key, [256], [], dp_size=2)
    with pytest.raises(DecodeError, match="integers"):
        buffer_from_sizes(key, [256.0], [200], dp_size=2)
    with pytest.raises(LayoutMismatchError, match="DP size"):
        OptimizerGeometry(
            (buffer_from_sizes(key, [256], [2], dp_size=2), buffer_from_sizes(key, [384], [2], dp_size=3))
        )
    with pytest.raises(ConfigError):
        buffer_from_sizes(key, [256], [2], dp_size=0)
    with pytest.raises(ConfigError):
        geo.buffers[0].local_param_ranges(2)


def test_to_dict_round_trip() -> None:
    geo = truth_geometry(truth("dp2_tp1_pp2"), 0)
    d = geo.to_dict()
    assert d["buffers"][0]["param_dtype"] == "float32"
    assert OptimizerGeometry.from_dict(d) == geo
    with pytest.raises(DecodeError):
        OptimizerGeometry.from_dict({"buffers": [{"param_dtype": "float32"}], "state_keys": []})
    with pytest.raises(DecodeError, match="dtype"):
        BufferGeometry.from_dict({**d["buffers"][0], "grad_dtype": "os.system"})


def test_state_keys_read_from_json_are_megatron_s_string_objects() -> None:
    """A chained optimizer's second dict must use the very key objects of the first: pickle writes a string it
    saw before as a reference (Megatron's keys are literals, one object each). Keys decoded from each rank
    file's JSON were new objects, so an expert-parallel ``distrib_optim.pt`` came out 64 bytes longer than
    Megatron's own, with the same content (a MoE trial against genuine megatron-core)."""
    import io
    import json

    geo = truth_geometry(truth("dp2_tp1_pp2"), 0)
    decoded = [OptimizerGeometry.from_dict(json.loads(json.dumps(geo.to_dict()))) for _ in range(2)]
    assert all(a is b for a, b in zip(decoded[0].state_keys, decoded[1].state_keys, strict=True))

    def saved(geometries) -> bytes:
        buf = io.BytesIO()
        torch.save([{k: 0 for k in g.state_keys} for g in geometries], buf)
        return buf.getvalue()

    literal = OptimizerGeometry(geo.buffers, ("param", "exp_avg", "exp_avg_sq"))
    assert saved(decoded) == saved([literal, literal])
