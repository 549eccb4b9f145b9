"""The synthetic Megatron state: Megatron's names, shapes and bucket geometry, consistent shards, deterministic."""

from __future__ import annotations

import argparse

import torch
from helpers import assert_same
from megatron_fixtures import model_path, truth, truth_geometry
from megatron_synthetic import ModelSpec, SyntheticJob, spec_for_bytes

from tiered_ckpt.megatron import safe_load
from tiered_ckpt.megatron.distrib_optim import iter_param_states, merge_shards
from tiered_ckpt.megatron.rank_shard import dp_group

FP32 = dict(params_dtype=torch.float32, grads_in_fp32=False)


def test_same_model_as_the_fixtures() -> None:
    """The fixtures' GPT (4 layers, hidden 64, vocab 128, fp32): same state-dict names and shapes, and the same
    bucket geometry Megatron's live optimizer reported, per pipeline stage."""
    for config, pp, dp in (("dp4_tp1_pp1", 1, 4), ("dp2_tp1_pp2", 2, 2)):
        job = SyntheticJob(ModelSpec(**FP32), pp=pp, dp=dp)
        t = truth(config)
        for shard in job.shards():
            subdir = job.mp_dir(shard)
            real = safe_load.load(model_path(config, subdir))["model"]
            ours = job.model_state(shard)
            assert list(ours) == list(real)
            assert [(tuple(v.shape), v.dtype) for v in ours.values() if v is not None] == [
                (tuple(v.shape), v.dtype) for v in real.values() if v is not None]
            ours, real = job.geometry(shard, "dense"), truth_geometry(t, job.writer_rank(shard))
            assert [(b.dtype_key, [(k.numel, k.numel_unpadded) for k in b.buckets]) for b in ours.buffers] == [
                (b.dtype_key, [(k.numel, k.numel_unpadded) for k in b.buckets]) for b in real.buffers]


def test_shards_are_consistent_with_params() -> None:
    job = SyntheticJob(ModelSpec(num_experts=4), tp=2, pp=2, dp=2, ep=2, seed=1)
    for shard in job.shards():
        by_name = {p.spec.name: p for p in job.params(shard)}
        model = job.model_state(shard)
        for kind in job.kinds():
            geo = job.geometry(shard, kind)
            group = dp_group(job.topology, job.writer_rank(shard), kind)
            merged = merge_shards([job.local_shards(r, kind) for r in group], geo)
            seen = set()
            for _, name, key, view in iter_param_states(merged, geo):
                main = job.main_state(shard, by_name[name])[key].view(view.shape)
                assert torch.equal(view, main), (name, key)
                if key == "param":
                    assert torch.equal(model[name], main.to(torch.bfloat16))
                seen.add(name)
            assert seen == {n for n, p in by_name.items() if p.expert == (kind == "expert")}


def test_names_and_shapes_follow_tp_pp_ep() -> None:
    job = SyntheticJob(ModelSpec(num_layers=4, hidden=64, vocab=128, num_experts=4), tp=2, pp=2, dp=1, ep=2)
    first, last = job.shards()[0], job.shards()[-1]
    assert (first.pp, last.pp, last.ep) == (0, 1, 1)
    s0, s1 = job.model_state(first), job.model_state(last)
    assert s0["embedding.word_embeddings.weight"].shape == (64, 64) and "output_layer.weight" not in s0
    assert s1["output_layer.weight"].shape == (64, 64) and "embedding.word_embeddings.weight" not in s1
    assert s0["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (96, 64)
    assert "decoder.layers.2.input_layernorm.weight" not in s0  # two layers per stage, numbered locally
    experts = [n for n in s1 if ".experts." in n and n.endswith("linear_fc1.weight")]
    assert experts == [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight"
                       for i in range(2) for j in range(2)]
    # dense params are replicated over EP and (norms, row-parallel biases) over TP; experts differ
    a, b = job.model_state(job.shard_of(0)), job.model_state(job.shard_of(job.topology.rank_of(tp=1, ep=1)))
    assert torch.equal(a["decoder.layers.0.input_layernorm.weight"], b["decoder.layers.0.input_layernorm.weight"])
    assert not torch.equal(a["decoder.layers.0.self_attention.linear_qkv.weight"],
                           b["decoder.layers.0.self_attention.linear_qkv.weight"])
    assert args_are_safe(job.args())


def args_are_safe(args: argparse.Namespace) -> bool:
    return all(isinstance(v, int | float | str | bool | type(None) | torch.dtype) for v in vars(args).values())


def test_deterministic_by_seed() -> None:
    one, two = SyntheticJob(tp=2, dp=2, seed=3), SyntheticJob(tp=2, dp=2, seed=3)
    assert_same(one.rank_items(0), two.rank_items(0))
    other = SyntheticJob(tp=2, dp=2, seed=4).rank_shard(1)["optimizers"][0]["shards"]["gbuf0/bucket0/param"]
    assert not torch.equal(one.rank_shard(1)["optimizers"][0]["shards"]["gbuf0/bucket0/param"], other)
    assert set(one.rank_items(2)) == {"distrib_optim"} and set(one.rank_items(0)) == {"model_optim_rng",
                                                                                      "distrib_optim"}


def test_spec_for_bytes() -> None:
    job = SyntheticJob(spec_for_bytes(64 << 20, ddp_bucket_size=None))
    assert 0.7 < job.nbytes() / (64 << 20) < 1.3
