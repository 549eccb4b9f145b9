"""Issue #15: an elastic restart with another parallel layout never commits an old rank's snapshot as the new
layout's state, nor loads one as such.

The old job (DP 2) dies with its snapshots in shared memory, never drained. The new job (DP 1) finds rank 0's
snapshot there: it was rank 0 of two, half of the job's state, and must not become the DP 1 job's checkpoint.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import NoCheckpointError
from tiered_ckpt.parallel import ParallelLayout


def config(shm_root: str, tmp_path, run_id: str, *, with_local: bool) -> dict:
    tiers = [{"name": "shm", "kind": "shm", "path": shm_root}]
    if with_local:
        tiers.append({"name": "local", "kind": "local", "path": str(tmp_path / "local"), "fsync": False})
    return {"run_id": run_id, "drain": {"mode": "thread"}, "tiers": tiers}


def old_job_dies_with_snapshots(shm_root: str, tmp_path, run_id: str, step: int) -> None:
    """Both ranks of a DP 2 job save ``step`` into shm only and go away without draining it anywhere."""
    layout = ParallelLayout(dp=2)
    for rank in (0, 1):
        eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=False), layout, rank=rank)
        eng.save(step, {"state": {"shard": torch.full((64,), float(rank)), "rank": rank}}).wait(timeout=60)
        eng.close()


def test_dp2_snapshot_is_not_committed_as_the_dp1_state(shm_root, tmp_path, recorder, caplog):
    run_id = f"el-{uuid.uuid4().hex[:8]}"
    old_job_dies_with_snapshots(shm_root, tmp_path, run_id, step=10)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.engine"):
        eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True), ParallelLayout(dp=1), rank=0)
    try:
        eng.wait(timeout=60)
        assert eng.recovered == []  # nothing queued: the snapshot is another layout's
        assert not recorder.kinds("commit", tier="local")
        assert eng.available_steps().get("local") == []
        # the warning names the snapshot, its layout and the current one
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "step 10" in text and "DP 2 → 1" in text and "rank 0" in text, text
        with pytest.raises(NoCheckpointError):
            eng.load()  # nor is it loaded from shm as the DP 1 job's state
    finally:
        eng.close()


def test_a_snapshot_of_another_layout_is_refused_by_the_drain_itself(shm_root, tmp_path):
    """Whoever hands the drain another layout's snapshot (a recovery that skipped the check), the file tier
    refuses to write it under the current layout."""
    from tiered_ckpt.drain_protocol import DrainRequest

    run_id = f"el-{uuid.uuid4().hex[:8]}"
    old_job_dies_with_snapshots(shm_root, tmp_path, run_id, step=7)
    eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True), ParallelLayout(dp=1), rank=0)
    try:
        entry = eng.pipeline.entry_store
        meta = next(m for m in entry.metas().values() if m.step == 7)
        entry.hold_slot(meta.slot)
        failures = []
        eng._drain.submit(DrainRequest(step=7, source="shm", slot=meta.slot, due=("local",), created=meta.created,
                                       recover=True))
        eng._drain.wait_idle(60)
        failures = eng._failures.get(7, {})
        assert "local" in failures and "parallel layout" in failures["local"], failures
        assert eng.available_steps().get("local") == []
    finally:
        eng.close()


def test_same_layout_snapshot_is_still_recovered(shm_root, tmp_path):
    run_id = f"el-{uuid.uuid4().hex[:8]}"
    eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=False), ParallelLayout(dp=1), rank=0)
    eng.save(3, {"state": {"x": torch.arange(8)}}).wait(timeout=60)
    eng.close()
    eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True), ParallelLayout(dp=1), rank=0)
    try:
        eng.wait(timeout=60)
        assert [h.step for h in eng.recovered] == [3]
        assert eng.available_steps()["local"] == [3]
        res = eng.load()
        assert res.step == 3 and res.verified
    finally:
        eng.close()


def test_layout_changes_count_dp_as_megatron_does():
    """DP in a message is Megatron's (world / (TP x PP x CP), expert ranks included), as `convert --dp` counts it:
    a MoE job (EP 2) going from DP 4 to 2 was told "DP 2 → 1" (a Megatron trial)."""
    from tiered_ckpt.parallel import ParallelLayout, layout_changes

    saved = ParallelLayout(dp=2, ep=2).to_dict()
    assert layout_changes(saved, ParallelLayout(dp=1, ep=2)) == ["DP 4 → 2"]
    assert layout_changes(saved, ParallelLayout(dp=4, ep=1)) == ["EP 2 → 1"]  # Megatron's DP is 4 both times
    assert layout_changes(ParallelLayout(dp=4).to_dict(), ParallelLayout(dp=2)) == ["DP 4 → 2"]
    assert layout_changes(saved, ParallelLayout(dp=2, ep=2)) == []
