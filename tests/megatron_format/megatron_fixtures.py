"""Access to the genuine Megatron-LM checkpoints in tests/data/megatron (see its README.md) for the tests
here."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from tiered_ckpt.megatron.geometry import (
    OptimizerGeometry,
    ParamSpec,
    dtype_from_name,
    geometry_from_sizes,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "megatron"
CONFIGS = ("dp2_tp1_pp2", "dp4_tp1_pp1")
# (config, DP that Megatron re-split the checkpoint at)
RELOADS = (("dp4_tp1_pp1", 2), ("dp4_tp1_pp1", 3), ("dp2_tp1_pp2", 1), ("dp2_tp1_pp2", 4))
ITER_DIR = "iter_0000010"
# Tied embeddings: Megatron marks these shared_embedding only when PP > 1 (first and last stage).
SHARED_EMBEDDINGS = ("module.embedding.word_embeddings.weight", "module.output_layer.weight")


def folder(config: str, reload_dp: int | None = None) -> Path:
    return DATA / config if reload_dp is None else DATA / config / f"reload_dp{reload_dp}"


@functools.cache
def truth(config: str, reload_dp: int | None = None) -> dict[str, Any]:
    return json.loads((folder(config, reload_dp) / "truth.json").read_text())


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sha256_tensor(t: torch.Tensor) -> str:
    """As truth.json computes it: sha256 of ``.numpy().tobytes()`` (float32, little-endian)."""
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor, so comparisons are exact (NaN, -0.0)."""
    assert t.dtype == torch.float32
    return t.contiguous().view(torch.int32)


def mp_dirs(t: dict[str, Any]) -> dict[str, list[int]]:
    """``mp_rank_*`` directory -> the global ranks of its DP group, ordered by DP rank."""
    out: dict[str, list[tuple[int, int]]] = {}
    for rank, info in t["rank_map"].items():
        out.setdefault(info["checkpoint_subdir"], []).append((info["dp"], int(rank)))
    return {d: [r for _, r in sorted(v)] for d, v in sorted(out.items())}


def rank_info(t: dict[str, Any], rank: int) -> dict[str, Any]:
    return t["ranks"][str(rank)]


def truth_geometry(t: dict[str, Any], rank: int) -> OptimizerGeometry:
    """The geometry as the live optimizer reported it: per buffer, dtypes, N_b and U_b."""
    info = rank_info(t, rank)
    buffers = []
    for buf in info["buffers"]:
        key = (dtype_from_name(buf["param_dtype"]), dtype_from_name(buf["grad_dtype"]))
        buffers.append((key, [b["N_b"] for b in buf["buckets"]], [b["U_b"] for b in buf["buckets"]]))
    return geometry_from_sizes(
        buffers, dp_size=info["dp_size"], state_keys=tuple(info["optimizer_state_keys"])
    )


def model_params(t: dict[str, Any], rank: int) -> list[ParamSpec]:
    """The rank's trainable params in ``named_parameters()`` order: the reverse of their buffer order."""
    pp_size = t["pp"]
    params = []
    for buf in rank_info(t, rank)["buffers"]:
        for bucket in buf["buckets"]:
            for p in bucket["params"]:
                params.append(
                    ParamSpec(
                        p["name"],
                        tuple(p["shape"]),
                        dtype_from_name(p["dtype"]),
                        shared_embedding=pp_size > 1 and p["name"] in SHARED_EMBEDDINGS,
                    )
                )
    return params[::-1]


@functools.cache
def load_shards(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def local_shards(config: str, rank: int, reload_dp: int | None = None) -> dict[str, torch.Tensor]:
    return load_shards(folder(config, reload_dp) / "local_shards" / f"rank_{rank:05d}.pt")


def distrib_optim_path(config: str, subdir: str) -> Path:
    return folder(config) / ITER_DIR / subdir / "distrib_optim.pt"


def model_path(config: str, subdir: str) -> Path:
    return folder(config) / ITER_DIR / subdir / "model_optim_rng.pt"


def all_dirs() -> list[tuple[str, str]]:
    """Every (config, mp_rank_* directory) of the fixtures."""
    return [(c, d) for c in CONFIGS for d in mp_dirs(truth(c))]


# ------------------------------------------------------------------------------------------------------------
# for the conversion, merge and loading tests


def copy_checkpoint(config: str, dst: Path) -> Path:
    """Only what Megatron wrote (tracker and iter_*), the way a user's checkpoint directory looks."""
    import shutil

    shutil.copytree(folder(config) / ITER_DIR, dst / ITER_DIR)
    shutil.copy(folder(config) / "latest_checkpointed_iteration.txt", dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)  # the fixtures are read-only
    dst.chmod(0o755)
    return dst


def oracle_split(world: torch.Tensor, unpadded: list[int], dp: int, dp_rank: int) -> list[torch.Tensor]:
    """Megatron's load recipe (docs/megatron-format.md, "Re-splitting for another DP size"), written out
    plainly: per bucket, slice U_b off the world tensor, pad with zeros to N_b = U_b rounded up to lcm(dp, 128),
    take part dp_rank of dp equal parts."""
    import math

    out, offset = [], 0
    for u in unpadded:
        n = -(-u // math.lcm(dp, 128)) * math.lcm(dp, 128)
        padded = torch.zeros(n, dtype=torch.float32)
        padded[:u] = world[offset:offset + u]
        offset += u
        out.append(padded[dp_rank * n // dp:(dp_rank + 1) * n // dp])
    assert offset == world.numel()
    return out


def fixture_rank_shard(config: str, rank: int) -> dict[str, Any]:
    """The rank_sharded file content for a fixture rank, from Megatron's in-memory local shards."""
    from tiered_ckpt.megatron import rank_shard
    from tiered_ckpt.megatron.naming import MegatronTopology

    t = truth(config)
    topo = MegatronTopology(tp=t["tp"], pp=t["pp"], dp=t["dp"])
    group = rank_shard.dp_group(topo, rank, "dense")
    sub = rank_shard.SubOptimizerShard(truth_geometry(t, rank), group.index(rank), tuple(group),
                                       local_shards(config, rank), "dense")
    return rank_shard.build(rank=rank, topology=topo, optimizers=[sub])
