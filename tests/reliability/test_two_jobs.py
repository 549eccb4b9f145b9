"""Two jobs saving into one directory at once (another run_id, running beside this one): neither may take the
other's committed steps for its own. A fault trial ran two 2-rank jobs, keep: 2, into one local directory: each
un-committed the other's steps as "saved again", retention counted them too, and at the end no step was
loadable while one job had been told its saves committed. An earlier run's steps (a re-run of a script) are
still replaced and retired as before."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch

from tiered_ckpt import CheckpointEngine, SaveError
from tiered_ckpt.file_store import CONCURRENT_JOB_MARGIN_S


def engine(tmp_path, run_id: str, keep: int | None = None) -> CheckpointEngine:
    tier = {"name": "disk", "kind": "local", "path": str(tmp_path / "ckpt"), "fsync": False}
    return CheckpointEngine({"run_id": run_id, "drain": {"mode": "thread"},
                             "tiers": [{**tier, "keep": keep} if keep else tier]})


def state(value: float) -> dict:
    return {"model": {"w": torch.full((64,), value)}}


@pytest.fixture
def late(monkeypatch):
    """Commits of another job count as "while this one runs" at once (the margin is for machines' clocks)."""
    monkeypatch.setattr("tiered_ckpt.file_store.CONCURRENT_JOB_MARGIN_S", -1.0)


def test_a_job_does_not_replace_a_step_another_running_job_committed(tmp_path, late):
    a, b = engine(tmp_path, f"a{uuid.uuid4().hex[:6]}"), engine(tmp_path, f"b{uuid.uuid4().hex[:6]}")
    try:
        a.save(7, state(1.0)).wait(timeout=60)
        with pytest.raises(SaveError, match=r"step 7 here was committed .* by another job \(run_id 'a.*two jobs "
                                            r"are saving into one directory"):
            b.save(7, state(2.0)).wait(timeout=60)
        loaded = a.load()
        assert loaded.step == 7 and torch.equal(loaded.items["model"]["w"], torch.full((64,), 1.0))
    finally:
        a.close()
        b.close()


def test_retention_leaves_a_running_job_s_steps_alone(tmp_path, late, caplog):
    a, b = engine(tmp_path, f"a{uuid.uuid4().hex[:6]}"), engine(tmp_path, f"b{uuid.uuid4().hex[:6]}", keep=1)
    try:
        a.save(1, state(1.0)).wait(timeout=60)
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt.file_store"):
            b.save(2, state(2.0)).wait(timeout=60)
            b.save(3, state(3.0)).wait(timeout=60)
        assert "another job (run_id 'a" in caplog.text
        assert a.load(step=1).step == 1  # job a's step is still committed
        assert sorted(b.available_steps()["disk"]) == [1, 3]  # b's own keep: 1 applied to b's steps
    finally:
        a.close()
        b.close()


def test_an_earlier_run_s_step_is_replaced_as_before(tmp_path):
    first = engine(tmp_path, f"a{uuid.uuid4().hex[:6]}")
    first.save(7, state(1.0)).wait(timeout=60)
    first.close()
    with engine(tmp_path, f"b{uuid.uuid4().hex[:6]}") as again:  # the margin as configured: a re-run
        again.save(7, state(2.0)).wait(timeout=60)
        assert torch.equal(again.load().items["model"]["w"], torch.full((64,), 2.0))


def test_another_running_job_s_steps_count_for_no_keep_and_its_step_in_flight_is_not_debris(tmp_path, late):
    """Job b (keep: 2) commits 40 and 50 while job a commits 45 between them: keep counted a's step and retired
    b's 40, and b's retention deleted a's step in flight (older than b's newest) as debris (a review)."""
    a, b = engine(tmp_path, f"a{uuid.uuid4().hex[:6]}"), engine(tmp_path, f"b{uuid.uuid4().hex[:6]}", keep=2)
    try:
        b.save(30, state(30.0)).wait(timeout=60)
        b.save(40, state(40.0)).wait(timeout=60)
        a.save(45, state(45.0)).wait(timeout=60)
        # a's save of 47 under way: its marker is there, its manifest not yet
        a_files = a.pipeline.stores["disk"].files()
        a_files._mark_started(47, 0)
        b.save(50, state(50.0)).wait(timeout=60)
        assert sorted(b.available_steps()["disk"]) == [40, 45, 50]  # b keeps two of its own; a's step stays
        assert (tmp_path / "ckpt" / "iter_0000047").is_dir()  # a's step in flight is not b's debris
    finally:
        a.close()
        b.close()


def test_retention_reads_afresh_a_step_it_committed_before_another_job_replaced_it(tmp_path):
    """Job b replaced job a's step 5 (committed before b started: an earlier run's, for b); a, still running,
    held its own manifest of 5 in its cache, took the step for its own and retired b's commit (an operator
    trial's event log: b's commit of 5, then a's evict of 5)."""
    a = engine(tmp_path, f"a{uuid.uuid4().hex[:6]}", keep=1)
    try:
        a.save(5, state(5.0)).wait(timeout=60)
        time.sleep(CONCURRENT_JOB_MARGIN_S + 0.5)  # b's commits come after a's start by more than the margin
        with engine(tmp_path, f"b{uuid.uuid4().hex[:6]}") as b:
            b.save(5, state(55.0)).wait(timeout=60)
            a.save(6, state(6.0)).wait(timeout=60)
            a.save(7, state(7.0)).wait(timeout=60)
            assert 5 in b.available_steps()["disk"]
            assert torch.equal(b.load(step=5).items["model"]["w"], torch.full((64,), 55.0))
    finally:
        a.close()
