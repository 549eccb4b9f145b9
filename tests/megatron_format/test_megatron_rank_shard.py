"""The rank_sharded per-rank file: built from local shards and geometry, parsed and validated."""

from __future__ import annotations

import io

import pytest
import torch
from megatron_fixtures import fixture_rank_shard, local_shards, truth, truth_geometry
from megatron_synthetic import ModelSpec, SyntheticJob

from tiered_ckpt.errors import DecodeError
from tiered_ckpt.megatron import rank_shard
from tiered_ckpt.megatron.naming import MegatronTopology


def test_content_and_weights_only_load_without_allow_list() -> None:
    obj = fixture_rank_shard("dp2_tp1_pp2", 3)
    assert obj["format"] == rank_shard.FORMAT and obj["rank"] == 3
    assert obj["coords"] == {"tp": 0, "pp": 1, "dp": 1, "ep": 0, "cp": 0}
    assert obj["topology"] == {"tp": 1, "pp": 2, "dp": 2, "ep": 1, "cp": 1, "order": "tp-cp-ep-dp-pp"}
    (opt,) = obj["optimizers"]
    assert (opt["kind"], opt["dp_rank"], opt["dp_size"], opt["group"]) == ("dense", 1, 2, [2, 3])
    assert opt["buffers"] == [{"param_dtype": torch.float32, "grad_dtype": torch.float32, "numel": [8192, 100096],
                               "numel_unpadded": [8192, 100096], "pad_for_high_nccl_busbw": False}]
    assert list(opt["shards"]) == list(local_shards("dp2_tp1_pp2", 3))  # Megatron's order: buffer, bucket, key
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([]):
        back = torch.load(buf, weights_only=True)  # tensors, dicts, lists, ints, bools, str, dtypes only
    parsed = rank_shard.parse(back, where="f.pt")
    assert parsed.mp_dir == "mp_rank_00_001" and parsed.owner_dir(0) == "mp_rank_00_001"
    assert parsed.optimizers[0].geometry == truth_geometry(truth("dp2_tp1_pp2"), 3)


def test_moe_rank_has_dense_and_expert_groups() -> None:
    job = SyntheticJob(ModelSpec(num_experts=4), tp=2, dp=2, ep=2)
    parsed = rank_shard.parse(job.rank_shard(6), where="r6")
    dense, expert = parsed.optimizers
    assert (dense.kind, dense.group, dense.dp_rank) == ("dense", (0, 2, 4, 6), 3)
    assert (expert.kind, expert.group, expert.dp_rank) == ("expert", (2, 6), 1)
    assert parsed.owner_dir(0) == "mp_rank_00_000" and parsed.owner_dir(1) == "mp_rank_00_001"


def _broken(mutate) -> dict:
    obj = fixture_rank_shard("dp4_tp1_pp1", 1)
    mutate(obj)
    return obj


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda o: o.update(format="dlrover"), "format is 'dlrover'"),
    (lambda o: o.update(version=9), "version 9"),
    (lambda o: o.update(rank=2), "disagree with rank 2"),
    (lambda o: o["optimizers"][0].update(kind="lion"), "kind: expected one of"),
    (lambda o: o["optimizers"][0].update(group=[0, 2, 1, 3]), r"group \[0, 2, 1, 3\] does not hold rank 1"),
    (lambda o: o["optimizers"][0]["shards"].pop("gbuf0/bucket3/exp_avg"), r"missing \['gbuf0/bucket3/exp_avg'\]"),
    (lambda o: o["optimizers"][0]["shards"].update({"gbuf0/bucket0/param": torch.zeros(5)}),
     r"is torch.float32 \(5,\), expected a float \(4160,\) tensor"),
    (lambda o: o["optimizers"][0]["buffers"][0].update(numel=[1]), "buffers:"),
    (lambda o: o.update(topology={"tp": 0}), "topology:"),
])
def test_parse_errors_name_the_file(mutate, message: str) -> None:
    with pytest.raises(DecodeError, match=message) as info:
        rank_shard.parse(_broken(mutate), where="iter_0000010/rank_00001/distrib_optim.pt")
    assert str(info.value).startswith("iter_0000010/rank_00001/distrib_optim.pt: not a valid rank_sharded")


def test_dp_groups_follow_megatron_rank_order() -> None:
    topo = MegatronTopology(tp=2, pp=2, dp=2, ep=2)
    assert rank_shard.dp_group(topo, 5, "dense") == [1, 3, 5, 7]  # ep and dp vary, tp and pp fixed
    assert rank_shard.dp_group(topo, 5, "expert") == [1, 5]  # only dp varies
    with pytest.raises(DecodeError, match="unknown optimizer kind"):
        rank_shard.dp_group(topo, 0, "hybrid")
