"""Retention of node-local tiers on several nodes (tiered_ckpt/node_commits.py, docs/operations.md): a step that
fails on one node's disk never lets the other nodes retire the newest step every node holds.

Two gloo ranks, each its own node (``TIERED_CKPT_NODE``), each with a local tier of its own behind the faults
plugin. A review found that with ``keep: 1`` node A, committing step 3 that node B's disk refused, deleted step 2:
no step was left on both, and the restart could load nothing (with ``keep: 2``, two failures in a row did it)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_multirank import committed, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parents[1] / "node_retention_worker.py"
NODES = {0: "A", 1: "B"}


def _committed(base: Path, node: str) -> list[int]:
    return committed(base / node / "local")


@pytest.mark.parametrize(("keep", "fail", "mode"), [
    (1, [3], "thread"),
    (2, [3, 4], "process"),  # two failures in a row, the drain in its own process
])
def test_a_step_one_node_failed_never_costs_the_step_every_node_holds(tmp_path, keep, fail, mode):
    spec = {"base": str(tmp_path), "run_id": f"nl{uuid.uuid4().hex[:6]}", "keep": keep, "mode": mode}
    steps = list(range(1, fail[-1] + 1))
    saved = run_ranks(2, {**spec, "save": steps, "fail": {"B": fail}}, node_of=NODES, worker=WORKER)
    assert saved[1].get("failed") == fail and "failed" not in saved[0], saved
    last_common = fail[0] - 1
    assert last_common in _committed(tmp_path, "A") and last_common in _committed(tmp_path, "B")
    assert max(_committed(tmp_path, "A")) == fail[-1]  # node A committed the steps B failed
    loaded = run_ranks(2, {**spec, "load": True}, node_of=NODES, worker=WORKER)
    assert [loaded[r]["step"] for r in (0, 1)] == [last_common] * 2, loaded
    assert loaded[0]["w"] == [float(last_common)] * 4

    # once newer steps are on every node again (and the nodes learnt it), the older ones go
    again = run_ranks(2, {**spec, "save": [10, 11, 12], "pause_s": 1.0}, node_of=NODES, worker=WORKER)
    assert not any("failed" in r for r in again.values()), again
    for node in NODES.values():  # keep, or one more: the newest step every node holds stays with the newer ones
        assert _committed(tmp_path, node) in ([11, 12][-keep:], [11, 12]), _committed(tmp_path, node)


def test_a_step_saved_again_that_fails_on_one_node_never_costs_the_one_before(tmp_path):
    """A review: the nodes published every step they had ever committed, by number. A restarted job saving again
    the step it resumed at un-commits the old one on every node first; when the new save then failed on node B,
    node A (holding the new save of the step, B's old one still listed) retired the step before it."""
    spec = {"base": str(tmp_path), "run_id": f"nl{uuid.uuid4().hex[:6]}", "keep": 1, "mode": "thread"}
    first = run_ranks(2, {**spec, "save": [1, 2, 3], "pause_s": 0.5}, node_of=NODES, worker=WORKER)
    assert not any("failed" in r for r in first.values()), first
    again = run_ranks(2, {**spec, "save": [3], "fail": {"B": [3]}, "settle_s": 1.0}, node_of=NODES, worker=WORKER)
    assert again[1].get("failed") == [3], again
    assert 2 in _committed(tmp_path, "A") and _committed(tmp_path, "B") == [2]
    loaded = run_ranks(2, {**spec, "load": True}, node_of=NODES, worker=WORKER)
    assert [loaded[r]["step"] for r in (0, 1)] == [2, 2], loaded


def test_a_job_gone_back_to_older_step_numbers_keeps_the_step_every_node_holds(tmp_path):
    """A review: after saves below the steps already there (a job that went back), the floor was the newest
    old step every node held, above every step retention counts: it protected none of them."""
    spec = {"base": str(tmp_path), "run_id": f"nl{uuid.uuid4().hex[:6]}", "keep": 1, "mode": "thread"}
    out = run_ranks(2, {**spec, "save": [10, 11, 5, 6], "fail": {"B": [6]}, "pause_s": 0.5}, node_of=NODES,
                    worker=WORKER)
    assert out[1].get("failed") == [6], out
    assert 5 in _committed(tmp_path, "A") and 5 in _committed(tmp_path, "B"), _committed(tmp_path, "A")
