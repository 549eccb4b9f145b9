"""Issue #15: the commit path checks every rank's manifest before it becomes part of a checkpoint.

* A rank manifest that lists another rank's file (its digest recomputed, so only the field checks of
  ``manifest.load_rank`` can tell) is refused at commit: no checkpoint is committed, no rank restores another's.
* A rank manifest of another parallel layout (an old job's, left in the step directory) is not this job's vote:
  the commit waits for the current rank's own and, without it, commits nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import torch

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import NoCheckpointError
from tiered_ckpt.handles import SaveError
from tiered_ckpt.manifest import dump_rank
from tiered_ckpt.parallel import ParallelLayout


def config(tmp_path, run_id: str) -> dict:
    return {"run_id": run_id, "drain": {"mode": "thread", "commit_timeout_s": 2},
            "tiers": [{"name": "shared", "kind": "fsspec", "url": f"file://{tmp_path / 'shared'}"}]}


def state(rank: int) -> dict:
    return {"state": {"w": torch.full((32,), float(rank)), "rank": rank}}


def test_a_rank_manifest_listing_another_ranks_file_is_refused_at_commit(tmp_path):
    run_id = f"cc-{uuid.uuid4().hex[:8]}"
    layout = ParallelLayout(dp=2)
    r1 = CheckpointEngine(config(tmp_path, run_id), layout, rank=1)
    r0 = CheckpointEngine(config(tmp_path, run_id), layout, rank=0)
    try:
        r1.save(1, state(1)).wait(timeout=60)  # rank 1's files and manifest; rank 0 commits
        store = r1.pipeline.stores["shared"]
        key = store.layout.rank_manifest_key(1, 1)
        mine = store.read_rank_manifest(1, 1)
        other = store.layout.item_key(1, "state", layout.coords(0), "flat")
        forged = replace(mine, files=tuple(replace(f, key=other) for f in mine.files))
        store.tier.publish(key, dump_rank(forged))  # a consistent digest: only the field checks catch it
        with pytest.raises(SaveError, match="rank_00001"):
            r0.save(1, state(0)).wait(timeout=60)
        assert store.committed_steps() == []
        with pytest.raises(NoCheckpointError):
            r1.load()
    finally:
        r0.close()
        r1.close()


def test_a_rank_manifest_of_another_layout_is_not_this_jobs_vote(tmp_path):
    run_id = f"cc-{uuid.uuid4().hex[:8]}"
    old = CheckpointEngine(config(tmp_path, run_id), ParallelLayout(tp=2), rank=1)
    old.save(3, state(1)).wait(timeout=60)  # the old job's rank 1 wrote its part of step 3, then the job ended
    old.close()
    new = CheckpointEngine(config(tmp_path, run_id), ParallelLayout(dp=2), rank=0)
    try:
        with pytest.raises(SaveError, match="not committed"):
            new.save(3, state(0)).wait(timeout=60)  # rank 1 of this job never wrote step 3
        assert new.pipeline.stores["shared"].committed_steps() == []
    finally:
        new.close()
