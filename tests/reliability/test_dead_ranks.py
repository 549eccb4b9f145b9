"""A rank whose training process dies mid-save, with the process drain (its worker writes and commits): the
committing rank gives the step up as soon as it sees the dead rank's lock left unheld, the other ranks stop
waiting for a committing rank that died, and a rank that is only late is still waited for (thread drain:
tests/test_multirank.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path

import pytest
from test_multirank import committed, run_ranks

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parents[1] / "dead_rank_worker.py"


@pytest.mark.parametrize("case", ["non-committing rank killed", "committing rank killed", "a rank late"])
def test_process_drain_ranks_tell_a_dead_rank_from_a_late_one(tmp_path, shm_root, case):
    victim = {"non-committing rank killed": 1, "committing rank killed": 0, "a rank late": -1}[case]
    pids = tmp_path / "pids"
    pids.mkdir()
    cfg = {"run_id": f"d{uuid.uuid4().hex[:8]}", "drain": {"mode": "process", "commit_timeout_s": 120},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "shared", "kind": "local", "path": str(tmp_path / "shared")}]}
    spec = {"config": cfg, "victim": victim, "pids": str(pids), "wait_committed": victim == 0,
            "delay_of": {"2": 2} if victim < 0 else {}}
    try:
        results = run_ranks(3, spec, worker=WORKER, timeout=200)
    finally:
        for p in pids.iterdir():  # the victim's stopped worker (the others are gone)
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.read_text()), signal.SIGKILL)
    if victim < 0:
        assert all(r.get("ok") for r in results.values()), results
        assert committed(tmp_path / "shared") == [1]
        return
    assert results[victim]["killed"]
    if victim == 1:
        error = results[0]["save_error"]
        assert "the engine of rank(s) 1 on this node died" in error and "rank_00001.lock" in error, error
    else:
        for rank in (1, 2):
            error = results[rank]["save_error"]
            assert "the engine of the committing rank 0 died on this node" in error, error
    assert committed(tmp_path / "shared") == []
