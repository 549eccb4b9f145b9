"""A save on a cached plan through the writer, in one process (what Megatron's ``torch_dist`` strategy does on
every save after its first with a constant structure, tiered_ckpt/megatron/torch_dist.py): the rank's own write
results staged beside its data, the coordinator's Metadata without storage_data, merged at commit and on a load
from shm; a BYTE_IO item whose length changes moves the tensors after it. And the merge's refusals."""

from __future__ import annotations

import copy
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.dcp import TieredStorageReader, TieredStorageWriter
from tiered_ckpt.dcp._metadata import dump_rank_results, load_rank_results, merge, merged_bytes
from tiered_ckpt.errors import CorruptionError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is up


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)},
            "extra": {"step": step, "note": "x" * (1000 * step)}}  # a BYTE_IO item, longer on every step


def zeros() -> dict:
    return {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(5, dtype=torch.bfloat16)},
            "extra": {"step": -1, "note": ""}}


def assert_same(a: dict, b: dict) -> None:
    assert a["extra"] == b["extra"]
    for k, v in a["model"].items():
        assert v.dtype == b["model"][k].dtype and torch.equal(v, b["model"][k]), k


class Recording(TieredStorageWriter):
    final_plan: Any = None
    metadata: Any = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.final_plan = plan
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        self.metadata = copy.deepcopy(metadata)
        super().finish(metadata, results)


def cached_save(writer: Recording, sd: dict, step: int, save_id: str) -> None:
    """As TieredSaveShardedStrategy._save_cached: no planning exchange, no collective."""
    planner = DefaultSavePlanner()
    writer.reset(checkpoint_id=step)
    planner.set_up_planner(state_dict=sd, storage_meta=writer.storage_meta(), is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0)
    writer.start_cached(save_id)
    planner.create_local_plan()
    results = writer.write_data(planner.finish_plan(writer.final_plan), planner).value()
    writer.finish_cached(results, copy.deepcopy(writer.metadata))
    writer.wait(timeout=60)


def test_a_save_on_a_cached_plan_commits_the_merged_metadata_and_loads_from_shm_and_files(tmp_path: Path,
                                                                                         shm_root: str) -> None:
    run_id = f"dcp{uuid.uuid4().hex[:8]}"
    disk = {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}
    cfg = {"run_id": run_id, "layout": "dcp", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, disk]}
    with CheckpointEngine(cfg) as engine:
        writer = Recording(engine)
        dcp.save(state(1), storage_writer=writer, checkpoint_id=1)  # planned: the plan to reuse
        writer.wait(timeout=60)
        cached_save(writer, state(2), 2, "plan-1")
        reader = TieredStorageReader(engine, step=2)
        got = zeros()
        dcp.load(got, storage_reader=reader)
        assert reader.sources == {"__0_0.distcp": "shm"} and reader.verified
        assert_same(got, state(2))
        planned = TieredStorageWriter(engine)
        dcp.save(state(2), storage_writer=planned, checkpoint_id=3)  # a planned save of the same state
        planned.wait(timeout=60)
    root = tmp_path / "disk"
    staged = root / "iter_0000002" / "tiered_ckpt" / "dcp_results_00000.bin"
    assert load_rank_results(staged.read_bytes(), str(staged))["save_id"] == "plan-1"
    got = zeros()
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(root / "iter_0000002")))  # DCP's own reader
    assert_same(got, state(2))
    with CheckpointEngine({**cfg, "tiers": [disk]}) as engine:
        reader = TieredStorageReader(engine, step=2)
        got = zeros()
        dcp.load(got, storage_reader=reader)
        assert reader.sources == {"__0_0.distcp": "disk"} and reader.verified
        assert_same(got, state(2))
    # the files of the cached plan's save are the planned save's; the tensors moved with the longer note
    data = [(root / f"iter_{s:07d}" / "__0_0.distcp").read_bytes() for s in (1, 2, 3)]
    assert data[1] == data[2] and len(data[0]) != len(data[1])
    first, cached, again = (pickle.loads((root / f"iter_{s:07d}" / ".metadata").read_bytes()) for s in (1, 2, 3))
    assert list(cached.storage_data.items()) == list(again.storage_data.items())
    assert cached.storage_data != first.storage_data
    assert cached.state_dict_metadata == again.state_dict_metadata and cached.planner_data == again.planner_data
    assert cached.storage_meta.save_id == "plan-1" and cached.version == again.version


def _parts(sid: str, world: int = 2) -> dict[int, bytes]:
    out = {}
    for r in range(world):
        wr = WriteResult(index=MetadataIndex(f"t{r}"), size_in_bytes=8, storage_data=f"info{r}")
        out[r] = dump_rank_results(r, world, sid, [wr])
    return out


def test_the_merge_takes_every_rank_of_one_save_and_refuses_the_rest() -> None:
    partial = pickle.dumps(Metadata(state_dict_metadata={}, storage_data=None, storage_meta=StorageMeta(save_id="s")))
    md = pickle.loads(merged_bytes(partial, _parts("s"), "here"))
    assert list(md.storage_data.items()) == [(MetadataIndex("t0"), "info0"), (MetadataIndex("t1"), "info1")]
    with pytest.raises(CorruptionError, match="another save"):
        merged_bytes(partial, {**_parts("s"), 1: _parts("older")[1]}, "here")
    with pytest.raises(CorruptionError, match=r"rank\(s\) \[1\]"):
        merged_bytes(partial, {0: _parts("s")[0]}, "here")
    complete = Metadata(state_dict_metadata={}, storage_data={}, storage_meta=StorageMeta(save_id="s"))
    with pytest.raises(CorruptionError, match="not a cached plan"):
        merge(complete, {r: load_rank_results(b, "") for r, b in _parts("s").items()}, "here")
