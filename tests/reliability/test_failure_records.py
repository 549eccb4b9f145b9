"""Failure records (tiered_ckpt/failure_records.py): a rank whose part of a save failed says so on the tier, and
the ranks waiting for that save's commit stop waiting, instead of each running out its own deadline (the
committing rank 120 s for the vote, the others as long again for the commit). Two FileStores on one directory
play two ranks here; tests/test_multirank.py runs the same with real ranks."""

from __future__ import annotations

import time

import pytest

from tiered_ckpt.errors import TierError, TransientTierError
from tiered_ckpt.megatron.convert import open_store
from tiered_ckpt.parallel import ParallelLayout

LAYOUT, STEP = ParallelLayout(dp=2), 7


@pytest.fixture
def ranks(tmp_path):
    return open_store(str(tmp_path), "rank_sharded", "shared"), open_store(str(tmp_path), "rank_sharded", "shared")


def vote(store, rank: int, save: str) -> None:
    entry = store.write_file(f"iter_{STEP:07d}/rank_{rank:05d}/state.flat", lambda: [bytes([rank]) * 64],
                             item="state", rank=rank, step=STEP, codec="flat")
    store._publish_rank(STEP, LAYOUT.coords(rank), [entry], save)


def test_the_committing_rank_stops_waiting_when_a_rank_records_that_its_part_failed(ranks):
    r0, r1 = ranks
    vote(r0, 0, "S")
    r1.write_failed(STEP, LAYOUT.coords(1), node_ranks=[0, 1], save_id="S", reason="OSError: [Errno 28] disk full")
    failure: list[str] = []
    started = time.monotonic()
    assert r0.try_commit(STEP, LAYOUT.coords(0), wait_s=60, save_id="S", fail_fast=True, failure=failure) is None
    assert time.monotonic() - started < 60  # it did not wait the deadline out
    assert failure == ["rank 1 could not write its part here: OSError: [Errno 28] disk full"]
    assert r0.committed_steps() == []


def test_a_record_the_tier_refuses_once_is_published_on_its_retry(ranks):
    """A throttled store (S3's 503 Slow Down) refusing the record once: written once, the record was lost and the
    committing rank waited its deadline out. It is published under the tier's retry policy."""
    r0, r1 = ranks
    publish, refused = r1.tier.publish, []

    def throttled(key, data):
        if key.endswith(".failed") and not refused:
            refused.append(key)
            raise TransientTierError(f"SlowDown: {key}")
        return publish(key, data)

    r1.tier.publish = throttled
    vote(r0, 0, "S")
    r1.write_failed(STEP, LAYOUT.coords(1), node_ranks=[0, 1], save_id="S", reason="OSError: [Errno 28] disk full")
    assert refused == [r1.layout.rank_failed_key(STEP, 1)]
    failure: list[str] = []
    assert r0.try_commit(STEP, LAYOUT.coords(0), wait_s=60, save_id="S", fail_fast=True, failure=failure) is None
    assert failure == ["rank 1 could not write its part here: OSError: [Errno 28] disk full"]


def test_a_recovery_and_another_save_s_record_do_not_stop_the_commit(ranks):
    """A record of another save of the step is stale; a recovery (fail_fast off) may find its own earlier
    attempt's. Neither stops a commit whose votes arrive, and the commit removes the stale records."""
    r0, r1 = ranks
    r1.write_failed(STEP, LAYOUT.coords(1), node_ranks=[0, 1], save_id="T", reason="an earlier save's failure")
    r0.write_failed(STEP, LAYOUT.coords(0), node_ranks=[0, 1], save_id="T", reason="an earlier save's failure")
    vote(r0, 0, "S")
    vote(r1, 1, "S")
    assert r0.try_commit(STEP, LAYOUT.coords(0), wait_s=5, save_id="S", fail_fast=True) is not None
    assert r0.committed_steps() == [STEP]
    assert r0.tier.list(r0.layout.rank_manifest_prefix(STEP)) == sorted(
        [r0.layout.manifest_key(STEP), r0.layout.rank_manifest_key(STEP, 0), r0.layout.rank_manifest_key(STEP, 1),
         *(k for k in r0.tier.list(r0.layout.rank_manifest_prefix(STEP)) if k.endswith(".started"))])

    r1.write_failed(STEP + 1, LAYOUT.coords(1), node_ranks=[0, 1], save_id="U", reason="recovered: an earlier try")
    failure: list[str] = []
    assert r0.try_commit(STEP + 1, LAYOUT.coords(0), wait_s=0.3, save_id="U", failure=failure) is None
    assert failure == ["no files from rank(s) 0, 1 after 0 s"]  # its deadline: a recovery does not heed records


def test_the_other_ranks_stop_waiting_for_a_commit_the_committing_rank_recorded_as_failed(ranks):
    r0, r1 = ranks
    vote(r1, 1, "S")
    r0.write_failed(STEP, LAYOUT.coords(0), node_ranks=[0, 1], save_id="S",
                    reason="TierError: step 7 not committed: rank 2 could not write its part here: disk full")
    with pytest.raises(TierError, match=r"step 7 was not committed here: TierError: step 7 not committed: rank 2 "
                                        r"could not write its part here: disk full"):
        r1.wait_committed(STEP, 1, 60, save_id="S", fail_fast=True)
    with pytest.raises(TierError, match=r"not committed here after 0 s"):  # a recovery waits its deadline out
        r1.wait_committed(STEP, 1, 0.3, save_id="S")
    with pytest.raises(TierError, match=r"not committed here after 0 s"):  # another save's record is stale
        r1.wait_committed(STEP, 1, 0.3, save_id="V", fail_fast=True)


def test_a_rank_that_writes_alone_records_nothing(tmp_path):
    store = open_store(str(tmp_path), "rank_sharded", "shared")
    store.write_failed(STEP, ParallelLayout().coords(0), node_ranks=[0], save_id="S", reason="disk full")
    assert store.tier.list("") == []


def test_a_commit_that_runs_out_of_time_names_the_ranks_it_lacks(ranks):
    """The SaveError of a step some rank never voted for said only "not every rank's files arrived" (a fault
    trial: which rank died had to be read from the committing rank's log)."""
    r0, _ = ranks
    vote(r0, 0, "S")
    failure: list[str] = []
    assert r0.try_commit(STEP, LAYOUT.coords(0), wait_s=0.2, save_id="S", failure=failure) is None
    assert failure == ["no files from rank(s) 1 after 0 s"]


def test_a_record_of_this_save_is_seen_after_another_save_s_and_beside_a_stale_vote(ranks):
    """Rank 1 left a record of an earlier save (T) and its vote of it; the commit of S read the stale record once
    and never again, and a rank whose stale vote was listed was not looked at for records at all: both waited
    out commit_timeout_s (a review). Records are read again, at most once a second."""
    import threading

    r0, r1 = ranks
    vote(r1, 1, "T")
    r1.write_failed(STEP, LAYOUT.coords(1), node_ranks=[0, 1], save_id="T", reason="the earlier save's failure")
    vote(r0, 0, "S")
    later = threading.Timer(0.3, lambda: r1.write_failed(STEP, LAYOUT.coords(1), node_ranks=[0, 1], save_id="S",
                                                         reason="this save's failure"))
    later.start()
    failure: list[str] = []
    try:
        assert r0.try_commit(STEP, LAYOUT.coords(0), wait_s=60, save_id="S", fail_fast=True, failure=failure) is None
    finally:
        later.cancel()
    assert failure == ["rank 1 could not write its part here: this save's failure"]


def test_waiting_ranks_see_the_failure_beside_another_save_s_commit(ranks):
    """A step another save committed (another job's, say) and this save's commit failed there: the waiting rank
    looked for the record only where no manifest was, and waited its deadline out (a review)."""
    r0, r1 = ranks
    vote(r0, 0, "T")
    vote(r1, 1, "T")
    assert r0.try_commit(STEP, LAYOUT.coords(0), wait_s=5, save_id="T") is not None
    r0.write_failed(STEP, LAYOUT.coords(0), node_ranks=[0, 1], save_id="S", reason="refused: another job's step")
    with pytest.raises(TierError, match="was not committed here: refused: another job's step"):
        r1.wait_committed(STEP, 1, 60, save_id="S", fail_fast=True)
