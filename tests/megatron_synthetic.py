"""Megatron-shaped training state for any (TP, PP, DP, EP), without Megatron: test data for the tests and the
benchmarks (not shipped in the package).

A :class:`SyntheticJob` describes a GPT model the way Megatron-LM's local transformer implementation names and
shapes it (the fixtures in ``tests/data/megatron`` show those names): per pipeline stage, the embedding (first
stage), ``decoder.layers.<local i>.*`` (attention, layer norms, a dense MLP or, with ``num_experts``, a router
and ``mlp.experts.local_experts.<j>.*``), the final norm and output layer (last stage; with tied embeddings only
when PP > 1). Column-parallel weights are split along dim 0 by TP, row-parallel ones along dim 1, experts over EP.

Per model-parallel shard it gives what a rank holds: bf16 model params, fp32 main params and Adam moments (a
deterministic function of ``seed``, the shard and the param name: a rank regenerates just what it needs), the
bucket geometry (``tiered_ckpt.megatron.geometry``), each rank's contiguous local shards (dense and expert
optimizers, the way Megatron's DistributedOptimizer holds them), ``args``, RNG states, and the ``model_optim_rng``
dict. Everything is generated lazily, rank by rank, so a multi-GB job never sits in memory.
"""

from __future__ import annotations

import argparse
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from tiered_ckpt.megatron import rank_shard
from tiered_ckpt.megatron.distrib_optim import shard_key
from tiered_ckpt.megatron.geometry import (
    ADAM_STATE_KEYS,
    OptimizerGeometry,
    ParamSpec,
    compute_optimizer_geometry,
    megatron_bucket_size,
)
from tiered_ckpt.megatron.naming import MegatronTopology
from tiered_ckpt.parallel import ParallelLayout

STATE_KEYS = ADAM_STATE_KEYS


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int = 4
    hidden: int = 64
    heads: int = 4
    ffn_hidden: int | None = None  # default 4 * hidden
    vocab: int = 128  # the padded vocab size (divisible by TP)
    seq_length: int = 16
    num_experts: int | None = None  # MoE MLP in every layer (divisible by EP)
    moe_ffn_hidden: int | None = None  # default ffn_hidden
    tied_embeddings: bool = True
    ddp_bucket_size: int | None = 6000  # --ddp-bucket-size (None: Megatron's default, 40M elements and up)
    overlap_grad_reduce: bool = True  # without it, one bucket per buffer
    params_dtype: torch.dtype = torch.bfloat16
    grads_in_fp32: bool = True  # --accumulate-allreduce-grads-in-fp32 (Megatron forces it with bf16)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden or self.ffn


@dataclass(frozen=True)
class SyntheticParam:
    spec: ParamSpec
    expert: bool
    tp_split: bool  # differs across TP ranks (else replicated: same values on every TP rank)


@dataclass(frozen=True)
class Shard:
    """A model-parallel shard: one ``mp_rank_*`` directory."""

    tp: int
    pp: int
    ep: int


@dataclass
class SyntheticJob:
    spec: ModelSpec = field(default_factory=ModelSpec)
    tp: int = 1
    pp: int = 1
    dp: int = 1  # the dp dimension; Megatron's data-parallel size is ep * dp
    ep: int = 1
    seed: int = 0
    iteration: int = 100

    def __post_init__(self) -> None:
        s = self.spec
        if s.num_layers % self.pp or s.vocab % self.tp or s.hidden % self.tp or s.ffn % self.tp \
                or (3 * s.hidden) % self.tp or s.hidden % s.heads:
            raise ValueError(f"{s} does not split over TP={self.tp}, PP={self.pp}")
        if self.ep > 1 and (not s.num_experts or s.num_experts % self.ep):
            raise ValueError(f"EP={self.ep} needs num_experts divisible by it, got {s.num_experts}")

    # ----- layout --------------------------------------------------------------------------------------------
    @cached_property
    def topology(self) -> MegatronTopology:
        return MegatronTopology(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)

    @property
    def parallel(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def shard_of(self, rank: int) -> Shard:
        p = self.topology.position(rank)
        return Shard(p.tp, p.pp, p.ep)

    def shards(self) -> list[Shard]:
        return [Shard(t, p, e) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def mp_dir(self, shard: Shard) -> str:
        return self.topology.rank_dir(self.topology.rank_of(tp=shard.tp, pp=shard.pp, ep=shard.ep))

    def writer_rank(self, shard: Shard) -> int:
        """The rank that writes the shard's ``model_optim_rng.pt`` (dp = 0)."""
        return self.topology.rank_of(tp=shard.tp, pp=shard.pp, ep=shard.ep)

    # ----- params --------------------------------------------------------------------------------------------
    def params(self, shard: Shard) -> list[SyntheticParam]:
        """The shard's params in ``named_parameters()`` order."""
        s, tp = self.spec, self.tp
        h, dt = s.hidden, s.params_dtype
        out: list[SyntheticParam] = []

        def add(name: str, shape: tuple[int, ...], split: bool, expert: bool = False, shared: bool = False) -> None:
            out.append(SyntheticParam(ParamSpec(name, shape, dt, shared_embedding=shared), expert, split))

        per_stage = s.num_layers // self.pp
        first, last = shard.pp == 0, shard.pp == self.pp - 1
        tied_shared = self.pp > 1 and s.tied_embeddings
        if first:
            add("embedding.word_embeddings.weight", (s.vocab // tp, h), True, shared=tied_shared)
            add("embedding.position_embeddings.weight", (s.seq_length, h), False)
        for i in range(per_stage):
            p = f"decoder.layers.{i}."
            add(p + "input_layernorm.weight", (h,), False)
            add(p + "input_layernorm.bias", (h,), False)
            add(p + "self_attention.linear_proj.weight", (h, h // tp), True)
            add(p + "self_attention.linear_proj.bias", (h,), False)
            add(p + "self_attention.linear_qkv.weight", (3 * h // tp, h), True)
            add(p + "self_attention.linear_qkv.bias", (3 * h // tp,), True)
            add(p + "pre_mlp_layernorm.weight", (h,), False)
            add(p + "pre_mlp_layernorm.bias", (h,), False)
            if s.num_experts:
                add(p + "mlp.router.weight", (s.num_experts, h), False)
                for j in range(s.num_experts // self.ep):
                    e = f"{p}mlp.experts.local_experts.{j}."
                    add(e + "linear_fc1.weight", (s.moe_ffn // tp, h), True, expert=True)
                    add(e + "linear_fc2.weight", (h, s.moe_ffn // tp), True, expert=True)
            else:
                add(p + "mlp.linear_fc1.weight", (s.ffn // tp, h), True)
                add(p + "mlp.linear_fc1.bias", (s.ffn // tp,), True)
                add(p + "mlp.linear_fc2.weight", (h, s.ffn // tp), True)
                add(p + "mlp.linear_fc2.bias", (h,), False)
        if last:
            add("decoder.final_layernorm.weight", (h,), False)
            add("decoder.final_layernorm.bias", (h,), False)
            if not s.tied_embeddings or self.pp > 1:
                add("output_layer.weight", (s.vocab // tp, h), True, shared=tied_shared)
        return out

    def kinds(self) -> list[str]:
        """The DistributedOptimizers of every rank, in ChainedOptimizer order."""
        return ["dense", "expert"] if self.spec.num_experts else ["dense"]

    def dp_size(self, kind: str) -> int:
        return len(rank_shard.dp_group(self.topology, 0, kind))

    def geometry(self, shard: Shard, kind: str) -> OptimizerGeometry:
        s = self.spec
        params = [p.spec for p in self.params(shard) if p.expert == (kind == "expert")]
        bucket_size = megatron_bucket_size(self.dp_size("dense"), ddp_bucket_size=s.ddp_bucket_size,
                                           overlap_grad_reduce=s.overlap_grad_reduce, pp_rank=shard.pp)
        return compute_optimizer_geometry(params, dp_size=self.dp_size(kind), bucket_size=bucket_size,
                                          grad_dtype=torch.float32 if s.grads_in_fp32 else None)

    def geometries(self, shard: Shard) -> list[OptimizerGeometry]:
        return [self.geometry(shard, k) for k in self.kinds()]

    # ----- values --------------------------------------------------------------------------------------------
    def _generator(self, shard: Shard, p: SyntheticParam) -> torch.Generator:
        # Replicated params have the same values wherever they live (dense ones across EP, untouched by TP).
        who = f"{shard.tp if p.tp_split else '-'}/{shard.pp}/{shard.ep if p.expert else '-'}"
        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{who}/{p.spec.name}".encode()))

    def main_state(self, shard: Shard, p: SyntheticParam) -> dict[str, torch.Tensor]:
        """fp32 main param, exp_avg and exp_avg_sq of one param, flattened."""
        g, n = self._generator(shard, p), p.spec.numel
        return {
            "param": torch.randn(n, generator=g) * 0.02,
            "exp_avg": torch.randn(n, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(n, generator=g) * 1e-6,
        }

    def model_state(self, shard: Shard) -> OrderedDict[str, Any]:
        """``model`` of ``model_optim_rng.pt``: bf16 params (the main params rounded), ``_extra_state`` None."""
        out: OrderedDict[str, Any] = OrderedDict()
        params = self.params(shard)
        for i, p in enumerate(params):
            out[p.spec.name] = self.main_state(shard, p)["param"].to(self.spec.params_dtype).view(p.spec.shape)
            module = p.spec.name.rsplit(".", 1)[0]
            following = params[i + 1].spec.name.rsplit(".", 1)[0] if i + 1 < len(params) else None
            if following != module and (".linear_" in p.spec.name or module == "output_layer"):
                out[module + "._extra_state"] = None  # after a linear layer's weight and bias, as Megatron's
        if shard.pp == self.pp - 1 and "output_layer._extra_state" not in out:
            out["output_layer._extra_state"] = None  # the tied output layer has no weight of its own, but this
        return out

    def local_shards(self, rank: int, kind: str) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s contiguous local shards of one optimizer: ``{"gbuf<g>/bucket<b>/<key>": fp32}``."""
        shard = self.shard_of(rank)
        geo = self.geometry(shard, kind)
        dp_rank = rank_shard.dp_group(self.topology, rank, kind).index(rank)
        by_name = {p.spec.name: p for p in self.params(shard)}
        out: dict[str, torch.Tensor] = {}
        cache: tuple[str, dict[str, torch.Tensor]] | None = None
        for g, buf in enumerate(geo.buffers):
            ranges = buf.local_param_ranges(dp_rank)
            for b in range(len(buf.buckets)):
                local = {k: torch.zeros(buf.shard_numel(b), dtype=torch.float32) for k in STATE_KEYS}
                for r in ranges[b]:
                    if cache is None or cache[0] != r.name:
                        cache = (r.name, self.main_state(shard, by_name[r.name]))
                    for k in STATE_KEYS:
                        local[k][r.gbuf_local[0]:r.gbuf_local[1]] = cache[1][k][r.param[0]:r.param[1]]
                for k in STATE_KEYS:
                    out[shard_key(g, b, k)] = local[k]
        return out

    def rank_shard(self, rank: int) -> dict[str, Any]:
        """The content of this rank's ``rank_sharded`` file (:mod:`tiered_ckpt.megatron.rank_shard`)."""
        shard = self.shard_of(rank)
        subs = []
        for kind in self.kinds():
            group = rank_shard.dp_group(self.topology, rank, kind)
            subs.append(rank_shard.SubOptimizerShard(self.geometry(shard, kind), group.index(rank), tuple(group),
                                                     self.local_shards(rank, kind), kind))
        return rank_shard.build(rank=rank, topology=self.topology, optimizers=subs)

    # ----- model_optim_rng -----------------------------------------------------------------------------------
    def args(self) -> argparse.Namespace:
        """Megatron-like args, of allow-listed types only (no Megatron enums)."""
        s = self.spec
        return argparse.Namespace(
            num_layers=s.num_layers, hidden_size=s.hidden, ffn_hidden_size=s.ffn, num_attention_heads=s.heads,
            seq_length=s.seq_length, max_position_embeddings=s.seq_length, padded_vocab_size=s.vocab,
            untie_embeddings_and_output_weights=not s.tied_embeddings, num_experts=s.num_experts,
            moe_ffn_hidden_size=s.moe_ffn if s.num_experts else None,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.tp, context_parallel_size=1,
            data_parallel_size=self.ep * self.dp, world_size=self.world_size,
            virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=True, ckpt_format="torch",
            ddp_bucket_size=s.ddp_bucket_size, overlap_grad_reduce=s.overlap_grad_reduce,
            accumulate_allreduce_grads_in_fp32=s.grads_in_fp32, ddp_pad_buckets_for_high_nccl_busbw=False,
            bf16=s.params_dtype == torch.bfloat16, fp16=s.params_dtype == torch.float16,
            params_dtype=s.params_dtype, optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1,
            adam_beta1=0.9, adam_beta2=0.95, seed=1234 + self.seed, data_parallel_random_init=False,
            consumed_train_samples=self.iteration * 8, consumed_valid_samples=0, iteration=self.iteration,
            save="/ckpt/synthetic", load=None, no_save_optim=None, no_save_rng=None,
        )

    def param_groups(self, kind: str) -> list[dict[str, Any]]:
        groups = []
        for wd_mult in (1.0, 0.0):
            groups.append({
                "is_expert_parallel": kind == "expert", "default_config": True, "wd_mult": wd_mult,
                "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": 1e-3, "min_lr": 1e-4,
                "lr": 1e-3 * (0.5 + 0.5 * math.cos(self.iteration / 1000)), "betas": (0.9, 0.95), "eps": 1e-8,
                "weight_decay": 0.1 * wd_mult, "bias_correction": True, "amsgrad": False, "step": self.iteration,
            })
        return groups

    def optimizer_state(self) -> Any:
        """``optimizer`` of ``model_optim_rng.pt``: the ChainedOptimizer's state_dict (no tensors: those are in
        ``distrib_optim.pt``)."""
        states = [{"optimizer": {"param_groups": self.param_groups(k)}} for k in self.kinds()]
        return states[0] if len(states) == 1 else states

    def scheduler_state(self) -> dict[str, Any]:
        return {"max_lr": 1e-3, "lr_warmup_steps": 10, "num_steps": self.iteration, "lr_decay_style": "cosine",
                "lr_decay_steps": 1000, "min_lr": 1e-4, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
                "wd_incr_steps": 1000}

    def rng_state(self, shard: Shard) -> list[dict[str, Any]]:
        seed = 1234 + self.seed + 100 * shard.pp + 7 * shard.tp

        def philox(offset: int) -> torch.Tensor:  # 16-byte CUDA generator state (seed, offset)
            return torch.tensor(np.array([seed + offset, 0], dtype=np.uint64).view(np.uint8))

        return [{
            "random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": np.random.RandomState(seed).get_state(),
            "torch_rng_state": torch.Generator().manual_seed(seed).get_state(),
            "cuda_rng_state": philox(0),
            "rng_tracker_states": {"data-parallel-rng": philox(0), "model-parallel-rng": philox(2718),
                                   "expert-parallel-rng": philox(1024)},
        }]

    def model_optim_rng(self, shard: Shard) -> dict[str, Any]:
        """What Megatron's ``generate_state_dict`` builds for the shard, key order included (docs/megatron-format.md,
        "model_optim_rng.pt")."""
        return {
            "args": self.args(),
            "checkpoint_version": 3.0,
            "iteration": self.iteration,
            "model": self.model_state(shard),
            "optimizer": self.optimizer_state(),
            "opt_param_scheduler": self.scheduler_state(),
            "rng_state": self.rng_state(shard),
            "num_floating_point_operations_so_far": 6 * self.iteration * 1_000_000,
        }

    def rank_items(self, rank: int) -> dict[str, Any]:
        """What the adapter saves on ``rank``: ``distrib_optim`` always, ``model_optim_rng`` on its writer."""
        items: dict[str, Any] = {}
        shard = self.shard_of(rank)
        if self.writer_rank(shard) == rank:
            items["model_optim_rng"] = self.model_optim_rng(shard)
        items["distrib_optim"] = self.rank_shard(rank)
        return items

    # ----- sizes ---------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the checkpoint (model files in bf16, optimizer state in fp32), roughly."""
        total = 0
        for shard in self.shards():
            params = self.params(shard)
            total += sum(p.spec.numel for p in params) * self.spec.params_dtype.itemsize
            total += sum(g.buffers[i].numel_unpadded for g in self.geometries(shard)
                         for i in range(len(g.buffers))) * 4 * len(STATE_KEYS)
        return total

    def iter_ranks(self) -> Iterator[int]:
        return iter(range(self.world_size))


def spec_for_bytes(nbytes: int, *, layers: int = 8, **kw: Any) -> ModelSpec:
    """A ModelSpec whose checkpoint (TP = PP = 1) is about ``nbytes`` (14 bytes per param: bf16 + 3 fp32)."""
    params = nbytes / 14
    hidden = max(64, int(math.sqrt(params / (12 * layers)) // 64 * 64))
    return ModelSpec(num_layers=layers, hidden=hidden, heads=max(1, hidden // 64), vocab=4096, **kw)


def write_checkpoint(job: SyntheticJob, dst: Any, *, layout: str = "rank_sharded", manifest: bool = True,
                     extra: Any = None) -> list[Any]:
    """Write ``job``'s checkpoint to ``dst`` (a directory, URL or Tier) as the adapter and engine leave it
    (``manifest=True``: our manifests, then the tracker), or as Megatron-LM writes it (``layout="megatron"``,
    ``manifest=False``: its files and tracker only). Returns the files' manifest entries. The ``megatron`` layout
    holds every rank's shards in memory while merging: for tests; a large checkpoint is written ``rank_sharded``
    and converted. ``extra(rank)``: an item ``extra`` of each rank besides Megatron's (a dataloader's state), in
    the ``flat`` codec, as the engine saves one."""
    from tiered_ckpt.megatron.convert import open_store
    from tiered_ckpt.megatron.merge import plan_dirs, write_megatron_file
    from tiered_ckpt.megatron.naming import TRACKER_FILENAME, iteration_dir_name
    from tiered_ckpt.megatron.torch_zip import iter_torch_save

    store = open_store(dst, layout, "synthetic")
    tier, step_dir = store.tier, iteration_dir_name(job.iteration)
    entries = []
    for shard in job.shards():
        key = f"{step_dir}/{job.mp_dir(shard)}/model_optim_rng.pt"
        entries.append(store.write_file(
            key, lambda shard=shard: iter_torch_save(job.model_optim_rng(shard), archive="model_optim_rng"),
            item="model_optim_rng", rank=job.writer_rank(shard), step=job.iteration))
    if layout == "rank_sharded":
        for r in job.iter_ranks():
            entries.append(store.write_file(f"{step_dir}/rank_{r:05d}/distrib_optim.pt",
                                            lambda r=r: iter_torch_save(job.rank_shard(r)), item="distrib_optim",
                                            rank=r, step=job.iteration))
    elif layout == "megatron":
        shards = {r: rank_shard.parse(job.rank_shard(r), where=f"rank {r}") for r in job.iter_ranks()}
        for d, parts in plan_dirs(shards).items():
            entries.append(write_megatron_file(store, f"{step_dir}/{d}/distrib_optim.pt", parts, step=job.iteration))
    else:
        raise ValueError(f"layout: expected megatron or rank_sharded, got {layout!r}")
    if extra is not None:
        from tiered_ckpt.codecs.transcode import item_source

        flat = store.codecs["flat"]
        for r in job.iter_ranks():
            entries.append(store.write_file(f"{step_dir}/rank_{r:05d}/extra.flat",
                                            lambda r=r: flat.encode(item_source("extra", extra(r))), item="extra",
                                            rank=r, step=job.iteration, codec="flat"))
    if manifest:
        store.commit_files(job.iteration, job.topology, entries)
    else:  # Megatron-LM writes nothing of ours: not the markers our writes leave before any manifest either
        tier.delete_prefix(f"{step_dir}/tiered_ckpt/")
        tier.publish(TRACKER_FILENAME, str(job.iteration).encode())
    return entries
