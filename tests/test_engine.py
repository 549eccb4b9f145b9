"""The engine on one rank: tier combinations, commit, fallback, retention, slots and recovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same, make_items

from tiered_ckpt import CheckpointEngine, CheckpointUnreadableError, NoCheckpointError, SaveError, StepNotFoundError
from tiered_ckpt.errors import CorruptionError, TierError
from tiered_ckpt.memory_store import MemoryStore, plan_items
from tiered_ckpt.parallel import RankCoords


def tier(kind: str, name: str | None = None, **kw) -> dict:
    return {"name": name or kind, "kind": kind, **kw}


@pytest.fixture
def tiers(tmp_path, shm_root):
    mem_url = f"memory://tiered-ckpt-tests/{uuid.uuid4().hex}"
    return {
        "gpu": tier("gpu", device="cpu"),
        "shm": tier("shm", path=str(shm_root)),
        "local": tier("local", path=str(tmp_path / "local")),
        "memory": tier("fsspec", "remote", url=mem_url),
        "file": tier("fsspec", "shared", url=f"file://{tmp_path / 'shared'}"),
    }


def config(tiers: dict, *names: str, mode: str = "thread", **top) -> dict:
    return {"run_id": f"t{uuid.uuid4().hex[:8]}", "drain": {"mode": mode}, "tiers": [tiers[n] for n in names], **top}


COMBOS = [("shm",), ("shm", "local"), ("shm", "local", "memory"), ("local",), ("gpu", "shm", "local")]


@pytest.mark.parametrize("names", COMBOS, ids=["+".join(c) for c in COMBOS])
def test_round_trip_bit_exact_on_every_tier(tiers, names, recorder):
    cfg = config(tiers, *names)
    items = make_items(3)
    with CheckpointEngine(cfg) as engine:
        handle = engine.save(10, items)
        assert handle.blocking_s > 0
        handle.wait(timeout=60)
        assert all(handle.results.values())
        # Fastest tier first; then each tier alone by hiding the faster ones.
        loaded = engine.load()
        assert loaded.step == 10 and loaded.tier == engine.tiers[0]  # never the internal _staging
        assert_same(items, loaded.items)
        for name in engine.pipeline.order:
            if name.startswith("_"):
                continue
            got = engine._load_from(name, 10, copy=True, map_location=None)[0]
            assert_same(items, got)
    commits = {e.tier for e in recorder.kinds("commit") if e.step == 10}
    assert commits >= set(n for n in engine.pipeline.order[1:])


def test_newest_step_wins_and_explicit_step(tiers):
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        for step in (1, 2, 3):
            engine.save(step, make_items(step)).wait(timeout=60)
        assert engine.load().step == 3
        old = engine.load(step=1)
        assert old.tier == "local"  # two shm slots hold 2 and 3 only
        assert_same(make_items(1), old.items)
        with pytest.raises(StepNotFoundError, match="step 7") as info:
            engine.load(step=7)
        assert not isinstance(info.value, NoCheckpointError)  # a resume script must not start over on it
        for wrong in ("3", 3.0, True, -1):  # as save() refuses them: a step from argparse is a str
            with pytest.raises(ValueError, match="step must be a non-negative integer"):
                engine.load(step=wrong)


def test_local_alone_stages_in_memory(tiers):
    with CheckpointEngine(config(tiers, "local")) as engine:
        assert engine.pipeline.order[0] == "_staging"
        engine.save(5, make_items(5)).wait(timeout=60)
    with CheckpointEngine(config(tiers, "local")) as engine:  # a new process: staging is empty
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (5, "local")
        assert_same(make_items(5), loaded.items)


def test_flipped_byte_falls_back_to_next_tier(tiers, tmp_path, recorder, caplog):
    with CheckpointEngine(config(tiers, "local", "memory")) as engine:
        engine.save(7, make_items(7)).wait(timeout=60)
    path = next((tmp_path / "local").rglob("state.flat"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with CheckpointEngine(config(tiers, "local", "memory")) as engine, caplog.at_level("WARNING"):
        loaded = engine.load()
    assert "step 7: " in caplog.text and "; trying tier 'remote'" in caplog.text  # the tier it goes to
    assert (loaded.step, loaded.tier) == (7, "remote")
    assert_same(make_items(7), loaded.items)
    falls = recorder.kinds("fallback", "local")
    assert falls and "checksum" in falls[0].message and "state.flat" in falls[0].message


def test_corrupt_everywhere_raises_clear_error(tiers, tmp_path):
    with CheckpointEngine(config(tiers, "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
    path = next((tmp_path / "local").rglob("state.flat"))
    path.write_bytes(path.read_bytes()[:-10])
    with CheckpointEngine(config(tiers, "local")) as engine:
        with pytest.raises(CheckpointUnreadableError, match="size is"):
            engine.load()


def test_older_step_used_when_newest_is_corrupt(tiers, tmp_path, recorder, caplog):
    with CheckpointEngine(config(tiers, "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        engine.save(2, make_items(2)).wait(timeout=60)
    newest = next((tmp_path / "local" / "iter_0000002").rglob("state.flat"))
    newest.unlink()
    with CheckpointEngine(config(tiers, "local")) as engine, caplog.at_level("WARNING"):
        loaded = engine.load()
    assert "no other tier holds it: trying an older step" in caplog.text  # not "the next tier": there is none
    assert loaded.step == 1 and loaded.fallbacks
    assert_same(make_items(1), loaded.items)


def test_a_step_saved_again_takes_a_free_slot_before_the_one_its_drain_still_reads(make_tier):
    """Found in review: a memory tier below the first (gpu -> shm) is kept from reuse by pins alone, and a save of a
    step whose earlier save still drains from its slot took that slot although another was free. The drain sends
    views of the slot (StableChunks), so an unpinned slot goes first; the pinned one only when nothing else is."""
    store = MemoryStore(make_tier("shm", pin=False), 0, 2)
    for slot, step in ((0, 20), (1, 10)):
        placed, total = plan_items({"m": {"w": torch.full((4,), float(step))}})
        store.write_snapshot(step, slot, placed, total, coords=RankCoords(0), layout="rank_sharded", run_id="r",
                             persistent=True)
    assert store.acquire_slot(10, wait=False, pinned=lambda s: s == 10) == 0  # step 20's slot: not pinned
    store.release_slot(0)
    assert store.acquire_slot(10, wait=False, pinned=lambda s: s in (10, 20)) == 1  # a step never waits for itself
    store.close()  # its checksums, taken in the background, are written before the directory goes


def test_a_slot_record_read_again_is_what_its_bytes_say_now_and_each_reader_gets_its_own(make_tier):
    """Records are parsed once per content (a load lists the slots, then reads them): a record rewritten in place
    is read afresh, a damaged one is refused, and a caller changing the record it got changes no other's."""
    store = MemoryStore(make_tier("shm", pin=False), 0, 1)
    for step in (3, 4):
        placed, total = plan_items({"m": {"w": torch.full((4,), float(step))}})
        store.write_snapshot(step, 0, placed, total, coords=RankCoords(0), layout="rank_sharded", run_id="r",
                             persistent=True)
        first = store.read_meta(0)
        assert first.step == step
        first.items[0].checksum, first.coords["dp"] = "xx", 99
        again = store.read_meta(0)
        assert again.step == step and again.items[0].checksum != "xx" and again.coords.get("dp") != 99
    store.settle_hash(0)  # the checksums' thread publishes the record again: done before it is damaged here
    store.tier.write_blob(store.meta_key(0), [b"{\"not\": \"a record\"}"])
    with pytest.raises(CorruptionError):
        store.read_meta(0)
    store.close()


def test_memory_rows_are_one_per_step_with_the_ranks_that_hold_it(make_tier):
    """Trial: `ls --config` printed a row per snapshot: two identical rows for a step a rank saved twice, and one
    per rank where a file tier shows `ranks 0-3` on one row."""
    from tiered_ckpt.inventory import memory_steps

    tier = make_tier("shm", pin=False)
    stores = [MemoryStore(tier, rank, 2) for rank in (0, 1)]
    for rank, slot, step in ((0, 0, 5), (0, 1, 5), (1, 0, 5), (1, 1, 6)):  # rank 0 saved step 5 twice
        placed, total = plan_items({"m": {"w": torch.full((4,), float(step))}})
        stores[rank].write_snapshot(step, slot, placed, total, coords=RankCoords(rank), layout="rank_sharded",
                                    run_id="r", persistent=True)
    rows = memory_steps(stores[0])
    assert [(r.step, r.ranks, r.files, len(r.snapshots)) for r in rows] == [(5, [0, 1], 3, 3), (6, [1], 1, 1)]
    assert rows[0].nbytes == 3 * rows[1].nbytes
    for store in stores:
        store.close()


def test_files_written_from_a_slot_a_new_save_took_meanwhile_never_count(tiers, monkeypatch):
    """The drain sends views of the slot (StableChunks): if a new save of the step takes the slot while a tier is
    written from it (a memory tier below the first, pins only), the bytes written may mix two saves. The new save
    invalidates the slot's record before it copies; the drain looks at the record after writing and drops the
    files (here the record goes mid-write, as a new save's first act would make it go)."""
    from tiered_ckpt.tiers.local import LocalTier

    tiers["local"]["retry"] = {"attempts": 1}
    real_write = LocalTier.write_blob
    taken = []

    def write_then_lose_the_slot(self, key, chunks):
        n = real_write(self, key, chunks)
        if key.endswith(".flat") and not taken:
            shm = engine.pipeline.stores["shm"]
            shm.tier.delete(shm.meta_key(0))  # what MemoryStore.invalidate does first
            taken.append(key)
        return n

    monkeypatch.setattr(LocalTier, "write_blob", write_then_lose_the_slot)
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        handle = engine.save(5, make_items(5))
        with pytest.raises(Exception, match="left slot 0 while tier 'local' was written from it"):
            handle.wait(timeout=60)
        assert taken and handle.results.get("local") is not True
        assert 5 not in engine.available_steps().get("local", [])


def test_a_failed_write_is_reported_even_when_its_cleanup_fails_too(tiers, monkeypatch, caplog):
    """From a new-user trial: an S3 endpoint dropped mid-upload; the cleanup's look for a manifest failed too and
    its error (a stat of manifest.json) replaced the upload's in the SaveError and the commit_failed event."""
    from tiered_ckpt.tiers.local import LocalTier

    tiers["local"]["retry"] = {"attempts": 1}
    real_write, real_exists = LocalTier.write_blob, LocalTier.exists
    failed = []

    def write(self, key, chunks):
        if key.endswith(".flat"):
            failed.append(key)
            raise TierError("the state's upload failed", tier=self.name, key=key)
        return real_write(self, key, chunks)

    def exists(self, key):
        if failed and key.endswith("tiered_ckpt/manifest.json"):  # the endpoint is gone for the cleanup too
            raise TierError("the cleanup's look failed", tier=self.name, key=key)
        return real_exists(self, key)

    monkeypatch.setattr(LocalTier, "write_blob", write)
    monkeypatch.setattr(LocalTier, "exists", exists)
    with CheckpointEngine(config(tiers, "shm", "local")) as engine, caplog.at_level("WARNING"):
        with pytest.raises(Exception, match="the state's upload failed") as info:
            engine.save(5, make_items(5)).wait(timeout=60)
        assert "the cleanup's look failed" not in str(info.value)
    assert "the cleanup's look failed" in caplog.text  # said, not lost


def test_retention_keeps_newest_and_removes_debris(tiers, tmp_path, recorder):
    tiers["local"]["keep"] = 2
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        for step in range(1, 6):
            engine.save(step, make_items(step)).wait(timeout=60)
        assert engine.available_steps()["local"] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [
        "iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "local" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert [e.step for e in recorder.kinds("evict", "local")] == [1, 2, 3]


def _blocked_deletions(monkeypatch):
    """LocalTier.delete_prefix held until the returned ``go_on`` is set; ``deleting`` is set once one waits."""
    from tiered_ckpt.tiers.local import LocalTier

    deleting, go_on = threading.Event(), threading.Event()
    delete_prefix = LocalTier.delete_prefix

    def slow_delete_prefix(self, prefix):
        deleting.set()
        assert go_on.wait(30)
        return delete_prefix(self, prefix)

    monkeypatch.setattr(LocalTier, "delete_prefix", slow_delete_prefix)
    return deleting, go_on


def test_a_save_is_reported_durable_before_retention_deletes_older_files(tiers, tmp_path, monkeypatch):
    """Retention un-commits the old step with the commit, but deleting its files (an unlink of 1 GiB took 0.3 s
    on the development VM) waits until the new step's handle is resolved and its slot released; engine.wait()
    still covers it."""
    deleting, go_on = _blocked_deletions(monkeypatch)
    tiers["local"]["keep"] = 1
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        engine.save(2, make_items(2)).wait(timeout=30)  # before: blocked behind the deletion of step 1's files
        assert deleting.wait(30)
        assert engine.available_steps()["local"] == [2]  # step 1 un-committed already
        assert (tmp_path / "local" / "iter_0000001").exists()
        go_on.set()
        engine.wait(timeout=60)
        assert not (tmp_path / "local" / "iter_0000001").exists()
        assert_same(make_items(2), engine.load().items)


def test_a_step_saved_again_waits_for_the_deletion_of_its_old_files(tiers, tmp_path, monkeypatch):
    """A job that went back saves a step whose old files retention is still deleting: the new files are written
    after the deletion, never deleted by it (a guard for any drain that runs deletions beside the next step)."""
    deleting, go_on = _blocked_deletions(monkeypatch)
    tiers["local"]["keep"] = 1
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        engine.save(2, make_items(2)).wait(timeout=30)
        assert deleting.wait(30)  # step 1's old files: held
        release = threading.Timer(1.0, go_on.set)
        release.start()
        try:
            engine.save(1, make_items(11)).wait(timeout=60)
            engine.wait(timeout=60)
        finally:
            release.cancel()
            go_on.set()
        assert engine.available_steps()["local"] == [1, 2]
    with CheckpointEngine(config(tiers, "local")) as engine:  # the disk alone: its files, not the slot's
        loaded = engine.load(step=1)
        assert loaded.tier == "local" and loaded.verified
        assert_same(make_items(11), loaded.items)


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_tier_writes_its_next_step_while_older_files_are_deleted(tiers, tmp_path, monkeypatch, recorder):
    """Retention's deletions run beside the tier's next write (an S3 step's deletion held up the next drain by
    0.2-0.4 s); only the next commit waits for them, so retention never lists the tier while it deletes."""
    deleting, go_on = _blocked_deletions(monkeypatch)
    tiers["local"]["keep"] = 1
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        engine.save(2, make_items(2)).wait(timeout=30)
        assert deleting.wait(30)  # step 1's files: held
        try:
            handle = engine.save(3, make_items(3))
            # step 3 is written meanwhile, and not committed before the deletion is over
            assert _wait_for(lambda: any(e.step == 3 for e in recorder.kinds("drain", "local")))
            assert engine.available_steps()["local"] == [2] and not handle.done()
        finally:
            go_on.set()
        handle.wait(timeout=60)
        engine.wait(timeout=60)
        assert engine.available_steps()["local"] == [3]
        assert sorted(p.name for p in (tmp_path / "local").glob("iter_*")) == ["iter_0000003"]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_deletions_slower_than_the_saves_still_keep_only_keep_steps(tiers, tmp_path, monkeypatch, caplog, mode):
    """Deletions slower than a step never pile up: at most one per tier runs, the next commit waits for it, so
    ``keep`` holds after engine.wait() and retention never mistakes a step being deleted for a newer one."""
    from tiered_ckpt.tiers.local import LocalTier

    delete_prefix = LocalTier.delete_prefix

    def slow_delete_prefix(self, prefix):
        time.sleep(0.3)
        return delete_prefix(self, prefix)

    monkeypatch.setattr(LocalTier, "delete_prefix", slow_delete_prefix)  # not in a process drain's worker
    tiers["local"]["keep"] = 1
    with CheckpointEngine(config(tiers, "shm", "local", mode=mode)) as engine:
        for step in range(1, 9):
            engine.save(step, make_items(step)).wait(timeout=60)
            assert engine.available_steps()["local"] == [step]
            assert len(list((tmp_path / "local").glob("iter_*"))) <= 2  # this step's, and one being deleted
        engine.wait(timeout=120)
        assert engine.available_steps()["local"] == [8]
        assert sorted(p.name for p in (tmp_path / "local").glob("iter_*")) == ["iter_0000008"]
        assert_same(make_items(8), engine.load(step=8).items)
    assert not [r for r in caplog.records if "newer than step" in r.getMessage()]


def _three_tiers_local_keep_1(tiers) -> dict:
    """shm -> local (keep 1) -> remote: the remote tier's thread ends each job, and with it runs retention of
    local (``DrainRuntime._finish``) beside local's own thread."""
    tiers["local"]["keep"] = 1
    return config(tiers, "shm", "local", "memory")


def _hold_remote_step(monkeypatch, held_step: int = 1):
    """The remote tier's write of ``held_step`` waits for the returned event: local keeps it (pinned) until then."""
    from tiered_ckpt.file_store import FileStore

    go = threading.Event()
    write_step = FileStore.write_step

    def held(self, step, *a, **k):
        if self.name == "remote" and step == held_step:
            assert go.wait(60)
        return write_step(self, step, *a, **k)

    monkeypatch.setattr(FileStore, "write_step", held)
    return go


def test_retention_beside_a_commit_never_takes_the_step_for_another_run_s(tiers, monkeypatch, caplog):
    """Retention of local, run on the remote tier's thread, lists local between the manifest of local's new step
    and the end of its commit: the step is this run's, not "newer than the step this run saved"."""
    from tiered_ckpt.file_store import FileStore

    remote_go = _hold_remote_step(monkeypatch)
    at_tracker, tracker_go, retained = threading.Event(), threading.Event(), threading.Event()
    update, retain = FileStore._update_tracker, FileStore.retain

    def held_update(self, step, rank):
        if self.name == "local" and step == 3:
            at_tracker.set()
            assert tracker_go.wait(60)
        return update(self, step, rank)

    def noted_retain(self, *a, **k):
        try:
            return retain(self, *a, **k)
        finally:
            if self.name == "local" and at_tracker.is_set():
                retained.set()

    monkeypatch.setattr(FileStore, "_update_tracker", held_update)
    monkeypatch.setattr(FileStore, "retain", noted_retain)
    with CheckpointEngine(_three_tiers_local_keep_1(tiers)) as engine:
        engine.save(1, make_items(1)).wait("local", timeout=60)
        engine.save(2, make_items(2)).wait("local", timeout=60)  # step 1 stays: remote still needs it
        engine.save(3, make_items(3))
        try:
            assert at_tracker.wait(60)  # step 3's manifest is on local; its commit is not over
            remote_go.set()  # remote takes step 1, and its job's end runs retention of local
            assert retained.wait(60)
        finally:
            remote_go.set()
            tracker_go.set()
        engine.wait(timeout=120)
        assert engine.available_steps()["local"] == [3]
    assert not [r for r in caplog.records if "newer than step" in r.getMessage()]


def test_a_step_saved_again_waits_for_its_deletion_on_another_tier_s_thread(tiers, tmp_path, monkeypatch):
    """A step saved again on local while retention of local, run on the remote tier's thread, still deletes its
    old files: the new files are written after that deletion, never removed by it."""
    from tiered_ckpt.tiers.local import LocalTier

    remote_go = _hold_remote_step(monkeypatch)
    deleting, del_go = threading.Event(), threading.Event()
    delete_prefix = LocalTier.delete_prefix

    def held_delete(self, prefix):
        if "0000001" in prefix and not deleting.is_set():
            deleting.set()
            assert del_go.wait(60)
        return delete_prefix(self, prefix)

    monkeypatch.setattr(LocalTier, "delete_prefix", held_delete)
    with CheckpointEngine(_three_tiers_local_keep_1(tiers)) as engine:
        engine.save(1, make_items(1)).wait("local", timeout=60)
        engine.save(2, make_items(2)).wait("local", timeout=60)
        remote_go.set()
        try:
            assert deleting.wait(60)  # step 1's old files on local: held
            handle = engine.save(1, make_items(11))
            release = threading.Timer(1.0, del_go.set)  # the re-save is under way by then
            release.start()
            handle.wait("local", timeout=60)
        finally:
            del_go.set()
        engine.wait(timeout=120)
        assert engine.available_steps()["local"] == [1, 2]
    with CheckpointEngine(config(tiers, "local")) as engine:  # the disk alone: its files, not the slot's
        loaded = engine.load(step=1)
        assert loaded.tier == "local" and loaded.verified
        assert_same(make_items(11), loaded.items)


def test_a_failed_commit_never_moves_this_run_s_newest_step(tiers, monkeypatch):
    """A job that went back (100, 200, then 150, 160) fails to commit 210 on local: retention, run when a job
    ends (remote's step 150), still counts keep from 160, this run's newest commit, and leaves 200 alone."""
    from tiered_ckpt.file_store import FileStore
    from tiered_ckpt.handles import SaveError

    go = _hold_remote_step(monkeypatch, 150)
    try_commit = FileStore.try_commit

    def failing(self, step, *a, **k):
        if self.name == "local" and step == 210:
            return None  # e.g. a rank's files late: "step 210 not committed"
        return try_commit(self, step, *a, **k)

    monkeypatch.setattr(FileStore, "try_commit", failing)
    with CheckpointEngine(_three_tiers_local_keep_1(tiers)) as engine:
        try:
            for step in (100, 200):
                engine.save(step, make_items(step)).wait(timeout=60)
            engine.save(150, make_items(150)).wait("local", timeout=60)  # went back
            engine.save(160, make_items(160)).wait("local", timeout=60)
            with pytest.raises(SaveError, match="210"):
                engine.save(210, make_items(210)).wait("local", timeout=60)
        finally:
            go.set()
        with pytest.raises(SaveError):
            engine.wait(timeout=120)
        assert engine.available_steps()["local"] == [160, 200]


def test_deletions_run_in_place_when_no_thread_can_start(tiers, tmp_path, monkeypatch):
    """At interpreter shutdown (close() from atexit) Python 3.12 starts no new thread: the deletions run on the
    tier's own thread instead, and close() returns (it waited out close_timeout_s on an unstarted thread)."""
    tiers["local"]["keep"] = 1
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)  # the tier's thread exists now
        start = threading.Thread.start

        def refuse_deleters(self):
            if self.name.startswith("tiered_ckpt-delete-"):
                raise RuntimeError("can't create new thread at interpreter shutdown")
            return start(self)

        monkeypatch.setattr(threading.Thread, "start", refuse_deleters)
        engine.save(2, make_items(2)).wait(timeout=60)
        assert engine._drain.close(timeout=60)  # idle: the deletion ran
    assert sorted(p.name for p in (tmp_path / "local").glob("iter_*")) == ["iter_0000002"]


def test_a_job_whose_end_fails_still_ends(tiers, monkeypatch, caplog):
    """Releasing the step's slot raises as the job ends: logged with the step, and wait() and close() still
    return (the job used to stay pending for ever, so both waited out their timeouts)."""
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        release = engine.pipeline.entry_store.release_slot
        calls = []

        def broken(slot):
            calls.append(slot)
            if len(calls) == 1:
                raise OSError("slot bookkeeping broke")
            return release(slot)

        monkeypatch.setattr(engine.pipeline.entry_store, "release_slot", broken)
        handle = engine.save(1, make_items(1))
        handle.wait(timeout=30)
        assert handle.results == {"local": True}
        engine.wait(timeout=30)  # TimeoutError before the fix
        assert "step 1: releasing its slot 0 on tier 'shm' failed" in caplog.text
        assert "slot bookkeeping broke" in caplog.text
        engine.save(2, make_items(2)).wait(timeout=30)  # the other slot
        assert engine.load().step == 2


def test_a_tier_thread_outlives_an_unexpected_error_and_its_job_still_ends(tiers, monkeypatch, caplog):
    """An error the drain does not expect, raised on a tier's thread after the step is committed there: logged
    with the step, the job ends (wait() returns) and the thread drains the next step (it used to die, leaving
    that job and every later one on the tier pending)."""
    from tiered_ckpt.drain import DrainRuntime

    settle = DrainRuntime._settle_deletion
    calls = []

    def broken(self, tier):
        calls.append(tier)
        if len(calls) == 2:  # the first is the commit's own; the second comes once step 1 is reported
            raise RuntimeError("a bug in the drain")
        return settle(self, tier)

    monkeypatch.setattr(DrainRuntime, "_settle_deletion", broken)
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        handle = engine.save(1, make_items(1))
        handle.wait(timeout=30)
        assert handle.results == {"local": True}
        engine.wait(timeout=30)  # TimeoutError before the fix: the job never ended
        assert "tier 'local': the drain of step 1 failed unexpectedly" in caplog.text
        assert "a bug in the drain" in caplog.text
        engine.save(2, make_items(2)).wait(timeout=30)  # the tier's thread is still there
        engine.wait(timeout=30)
        assert engine.load().step == 2


def test_an_unexpected_error_before_a_tier_s_outcome_fails_the_save_with_its_text(tiers, monkeypatch, recorder):
    """The error comes before the tier had an outcome for the step (here: as a re-save of step 1 starts): the
    save fails on that tier naming the error, with a commit_failed event, its slot is released and the job
    ends; the tier's next step commits."""
    from tiered_ckpt.drain import DrainRuntime

    settle = DrainRuntime._settle_deletion
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=30)

        def broken(self, tier):
            raise RuntimeError("a bug before the write")

        monkeypatch.setattr(DrainRuntime, "_settle_deletion", broken)
        handle = engine.save(1, make_items(2))  # step 1 again: the drain first waits for deletions there
        with pytest.raises(SaveError, match="the drain failed unexpectedly: RuntimeError: a bug before the write"):
            handle.wait(timeout=30)
        assert handle.results == {"local": False}
        assert [e.step for e in recorder.kinds("commit_failed", "local")] == [1]
        with pytest.raises(SaveError, match="step 1 on tier 'local'"):  # the job ended, and failed
            engine.wait(timeout=30)
        monkeypatch.setattr(DrainRuntime, "_settle_deletion", settle)
        for step in (2, 3):  # both slots come back: the failed job released its own
            engine.save(step, make_items(step)).wait(timeout=30)
        assert engine.load().step == 3


def test_a_manifest_read_as_the_step_is_saved_again_is_not_cached(tiers, monkeypatch):
    """A listing reads step 1's manifest, and before it caches it a re-save of step 1 commits there: the old
    manifest must not go into the cache over the new one (a load would take the new files for damaged ones)."""
    with CheckpointEngine(config(tiers, "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=30)
        store = engine.pipeline.stores["local"]
        read = store._manifest_bytes

        def read_then_resaved(key):
            data = read(key)  # step 1's first manifest...
            monkeypatch.setattr(store, "_manifest_bytes", read)
            engine.save(1, make_items(2)).wait(timeout=30)  # ...replaced by the re-save's before it is cached
            return data

        monkeypatch.setattr(store, "_manifest_bytes", read_then_resaved)
        store._manifests.clear()
        old = store.read_manifest(1, cached=True)
        assert store.read_manifest(1, cached=True) != old  # the re-save's, not the listing's late copy
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "local")
        assert_same(make_items(2), loaded.items)


def test_retention_aborts_only_the_uploads_left_before_its_deletion(tiers, monkeypatch):
    """Retention aborts the uploads left open in the steps it removes, not one that sent a part (or began) after
    the deletion started (a rank saving that step again), and not one outside those steps; a store that cannot
    list them is no reason to keep the step's files."""
    from tiered_ckpt.tiers.base import UnfinishedUpload

    with CheckpointEngine(config(tiers, "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=30)
        store = engine.pipeline.stores["local"]
        now = time.time()
        uploads = [UnfinishedUpload("iter_0000001/rank_00000/a.flat", "left", 10, now - 60),
                   UnfinishedUpload("iter_0000001/rank_00001/b.flat", "unknown age", 10, None),
                   UnfinishedUpload("iter_0000001/rank_00002/c.flat", "saving again", 10, now + 60),
                   UnfinishedUpload("iter_00000010/x.flat", "another step", 10, now - 60)]
        asked, aborted = [], []

        def unfinished(min_age_s=0.0, keys=None):
            asked.append(min_age_s)
            return [u for u in uploads if keys is None or keys(u.key)]

        monkeypatch.setattr(store.tier, "unfinished_uploads", unfinished)
        monkeypatch.setattr(store.tier, "abort_upload", lambda u: aborted.append(u.upload_id))
        assert store.remove_steps([1], 0) == [1]
        assert asked == [0.0] and aborted == ["left", "unknown age"]
        assert not os.path.exists(os.path.join(tiers["local"]["path"], "iter_0000001"))

        engine.save(2, make_items(2)).wait(timeout=30)

        def denied(min_age_s=0.0, keys=None):
            raise TierError("Access Denied", tier="local")

        monkeypatch.setattr(store.tier, "unfinished_uploads", denied)
        assert store.remove_steps([2], 0) == [2]
        assert not os.path.exists(os.path.join(tiers["local"]["path"], "iter_0000002"))


def test_a_process_exits_while_a_deletion_still_runs(tiers, tmp_path):
    """The deletion thread never holds the process past close(): what it leaves is debris for the next
    retention or gc."""
    tiers["local"]["keep"] = 1
    script = textwrap.dedent(f"""
        import json, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from helpers import make_items
        from tiered_ckpt import CheckpointEngine
        from tiered_ckpt.tiers.local import LocalTier
        started = threading.Event()
        def stuck(self, prefix):
            started.set()
            threading.Event().wait(600)
        LocalTier.delete_prefix = stuck
        cfg = json.loads(sys.argv[1])
        engine = CheckpointEngine(cfg)
        engine.save(1, make_items(1)).wait(timeout=60)
        engine.save(2, make_items(2)).wait(timeout=60)
        assert started.wait(60)
        engine.close()
        print("closed", flush=True)
    """)
    cfg = config(tiers, "shm", "local")
    cfg["drain"]["close_timeout_s"] = 1
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-2000:]
    with CheckpointEngine(config(tiers, "local")) as engine:  # step 2 stays the committed one
        assert engine.available_steps()["local"] == [2]
        assert_same(make_items(2), engine.load().items)


def test_every_sends_every_nth_save(tiers):
    tiers["memory"]["every"] = 3
    with CheckpointEngine(config(tiers, "shm", "local", "memory")) as engine:
        handles = [engine.save(s, make_items(s)) for s in range(1, 8)]
        engine.wait(60)
        assert [("remote" in h.due) for h in handles] == [True, False, False, True, False, False, True]
        assert engine.available_steps()["remote"] == [1, 4, 7]


def test_structure_change_replans_the_slot(tiers, recorder):
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        bigger = make_items(2, scale=50)
        bigger["state"]["extra"] = torch.arange(1000)
        engine.save(2, bigger).wait(timeout=60)
        assert recorder.kinds("replan")
        assert_same(bigger, engine.load().items)
        assert_same(make_items(1), engine.load(step=1).items)


def test_saves_of_one_structure_follow_every_change_of_its_values(tiers, recorder):
    """The layout planned once is reused (no replan), and every save still holds its own values: tensors changed
    in place, tensors replaced by new ones, and values that are not tensors."""
    w, b = torch.randn(300, 300), torch.zeros(300)
    items = {"model": {"w": w, "b": b}, "iteration": 1}
    expected = {}
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        for step in range(1, 6):
            if step % 2:
                w.mul_(-1.5)  # same memory
            else:
                items["model"]["b"] = torch.full((300,), float(step))  # a new tensor, elsewhere
            items["iteration"] = step
            expected[step] = {"model": {k: v.clone() for k, v in items["model"].items()}, "iteration": step}
            engine.save(step, items).wait(timeout=60)
        assert not recorder.kinds("replan")
        for step in (4, 5):  # the shm slots hold the last two; the local tier every step
            assert_same(expected[step], engine.load(step=step).items)
        assert_same(expected[1], engine.load(step=1).items)


def test_prepare_preallocates_slots(tiers, shm_root):
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        engine.prepare(make_items(0))
        slots = sorted(p.name for p in Path(shm_root).rglob("slot_*.data"))
        assert slots == ["slot_0.data", "slot_1.data"]
        engine.save(1, make_items(1)).wait(timeout=60)


def test_when_full_skip(tiers, recorder):
    # A slow remote keeps the only slot busy; policy skip returns at once.
    tiers["shm"]["slots"] = 1
    tiers["shm"]["when_full"] = "skip"
    with CheckpointEngine(config(tiers, "shm")) as engine:
        first = engine.save(1, make_items(1))
        engine.wait(30)
        engine.pipeline.entry_store.hold_slot(0)  # simulate a drain that has not finished with the slot
        skipped = engine.save(2, make_items(2))
        assert skipped.skipped and recorder.kinds("skip")
        engine._slot_released("shm", 0, 1)
        assert not engine.save(3, make_items(3)).skipped
        assert first.done()


def _mapped_file(ptr: int) -> str | None:
    """The file mapped at address ``ptr`` of this process, if any (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def test_loaded_views_are_zero_copy_when_asked_and_writing_into_them_never_changes_the_snapshot(tiers):
    """load(copy=False): views of the slot file, mapped copy-on-write. In the saving process they were views of
    its own writable slot buffer: a user's trial wrote into them (an optimizer step) and the next load() found
    the snapshot damaged."""
    with CheckpointEngine(config(tiers, "shm")) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        viewed = engine.load(copy=False).items["state"]["model"]["embedding.weight"]
        copied = engine.load(copy=True).items["state"]["model"]["embedding.weight"]
        base = list(engine.pipeline.entry_store._buffers.values())
        assert (_mapped_file(viewed.data_ptr()) or "").endswith(".data")  # zero-copy: the slot file's pages
        for t in (viewed, copied):
            assert not any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in base)
        viewed.add_(1)
        again = engine.load(copy=False)
        assert again.verified and torch.equal(again.items["state"]["model"]["embedding.weight"], copied)


def test_second_engine_same_run_id_fails_clearly(tiers):
    cfg = config(tiers, "shm")
    with CheckpointEngine(cfg):
        with pytest.raises(Exception, match="already in use"):
            CheckpointEngine(cfg)


def test_process_mode_with_a_tier_in_this_process_s_memory_drains_in_threads(tiers, recorder):
    """A plugin author's trial: with ``memory://`` (or any tier whose blobs live in the writing process) below shm,
    the worker process committed every step into its own memory: reported committed, never loadable here."""
    from tiered_ckpt.plugins import _uses_worker, get_plugin_manager

    cfg = config(tiers, "shm", "memory", mode="process")
    with CheckpointEngine(cfg) as engine:
        assert type(engine._drain).__name__ == "DrainRuntime"
        assert not _uses_worker(get_plugin_manager(), engine.config)  # nor is a plugin checked for one
        h = engine.save(4, make_items(4))
        h.wait(timeout=120)
        assert h.results == {"remote": True}
        assert engine.available_steps()["remote"] == [4]
        assert_same(make_items(4), engine._load_from("remote", 4, True, None)[0])


def test_process_mode_drains_and_commits(tiers, recorder):
    cfg = config(tiers, "shm", "local", "memory", mode="process")
    cfg["tiers"][2] = tiers["file"]  # memory:// is per process; a file:// tier is visible to the worker
    with CheckpointEngine(cfg) as engine:
        assert type(engine._drain).__name__ == "ProcessDrain"
        h = engine.save(4, make_items(4))
        h.wait(timeout=120)
        assert h.results == {"local": True, "shared": True}
        assert_same(make_items(4), engine._load_from("shared", 4, True, None)[0])
    assert recorder.kinds("commit", "local") and recorder.kinds("drain", "shared")
    assert os.path.exists(tiers["local"]["path"])


def test_process_mode_with_gpu_entry_hops_through_shm(tiers):
    cfg = config(tiers, "gpu", "shm", "local", mode="process")
    with CheckpointEngine(cfg) as engine:
        assert type(engine._drain).__name__ == "SplitDrain"
        h = engine.save(9, make_items(9))
        h.wait(timeout=120)
        assert h.results == {"shm": True, "local": True}
        assert_same(make_items(9), engine._load_from("local", 9, True, None)[0])
        assert_same(make_items(9), engine._load_from("shm", 9, True, None)[0])


def _mappings(pid: int) -> list[str]:
    """The files ``pid`` maps, one entry per mapping (the kernel shows resolved paths)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the worker's mappings from /proc")
@pytest.mark.parametrize("names", [("shm", "local"), ("gpu", "shm", "local")], ids=["shm+local", "gpu+shm+local"])
def test_the_worker_maps_every_slot_after_prepare_before_any_save(tiers, names):
    """prepare() pays the first-use costs of every process: the worker maps the slots it will read then, not on
    the drain of the first save into each (which would otherwise reach durable later)."""
    cfg = config(tiers, *names, mode="process")
    with CheckpointEngine(cfg) as engine:
        drain = engine._drain
        proc = getattr(drain, "proc", drain)._proc
        engine.prepare(make_items(1))
        shm = engine.pipeline.stores["shm"]
        slot_files = {os.path.realpath(shm.tier.files.path(shm.data_key(i))) for i in range(shm.nslots)}
        assert len(slot_files) == 2 and all(os.path.exists(p) for p in slot_files)
        assert _wait_for(lambda: slot_files <= set(_mappings(proc.pid)), timeout=120), \
            f"the worker mapped {sorted(p for p in _mappings(proc.pid) if 'slot_' in p)}"
        before = sorted(p for p in _mappings(proc.pid) if p in slot_files)
        h = engine.save(3, make_items(3))
        h.wait(timeout=120)
        assert h.results["local"] is True
        # the drain read the slot through the mapping made ahead, not a new one
        assert sorted(p for p in _mappings(proc.pid) if p in slot_files) == before
        assert_same(make_items(3), engine._load_from("local", 3, True, None)[0])


def test_snapshots_of_another_layout_are_named_in_one_warning(shm_root, tmp_path, caplog):
    """An elastic restart (DP 2 -> 1) finds this rank's old snapshots in shm: they are not recovered as this
    job's, and one warning names them all (it was one long line per slot, per rank), a non-persistent one too,
    which no file tier holds (a Megatron user's trial: the newest step, non-persistent, went unmentioned)."""
    import logging

    from tiered_ckpt import ParallelLayout

    cfg = {"run_id": f"el{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread", "commit_timeout_s": 5},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root), "slots": 2}]}
    with CheckpointEngine(cfg, ParallelLayout(dp=2), rank=0) as engine:
        for step in (1, 2):
            engine.save(step, make_items(step), persistent=step == 1).wait(timeout=60)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        with CheckpointEngine(cfg, ParallelLayout(dp=1), rank=0) as engine:
            assert engine.recovered == []
    said = [r.getMessage() for r in caplog.records if "not recovered" in r.getMessage()]
    assert len(said) == 1 and "2 snapshot(s)" in said[0] and "step 1 (slot" in said[0], said
    assert "step 2 (slot 1: DP 2 → 1, non-persistent: held nowhere else)" in said[0], said


def test_saves_no_tier_is_due_for_keep_nothing_behind(tmp_path, shm_root):
    """A save with no file tier due (``every: 4``, or ``persistent=False``) is done when save() returns: its handle
    was kept for ever, one more per such save (found by a review)."""
    cfg = {"run_id": f"e{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "mem", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "l"), "fsync": False, "every": 4}]}
    with CheckpointEngine(cfg) as engine:
        for step in range(1, 41):
            engine.save(step, {"m": {"w": torch.full((4,), float(step))}}, persistent=step % 3 != 0).wait(timeout=60)
        engine.wait(timeout=60)
        assert engine._handles == {}
        assert engine.load().step == 40


def test_retention_removes_a_killed_writer_s_partial_files_with_their_step(tmp_path, shm_root):
    """A process killed mid-write leaves a temporary file in the step it was writing. Listings never show it, so
    retention deleted that step's keys and left the partial file, and its directory, for ever (a new user's
    trial: one per crash per rank); only gc, an hour later, found them."""
    import os

    from tiered_ckpt.tiers._files import temp_name

    local = tmp_path / "l"
    cfg = {"run_id": f"e{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "mem", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(local), "fsync": False, "keep": 1}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        partial = local / "iter_0000001" / "rank_00000" / temp_name("state.flat")
        partial.write_bytes(b"half of a file")
        os.utime(partial, (time.time() - 60, time.time() - 60))
        # a save of step 2 killed during its first file: its marker, and the file's partial write
        (local / "iter_0000002" / "rank_00000").mkdir(parents=True)
        (local / "iter_0000002" / "tiered_ckpt").mkdir()
        (local / "iter_0000002" / "tiered_ckpt" / "rank_00000.started").write_text(json.dumps(
            {"run_id": cfg["run_id"]}))
        debris = local / "iter_0000002" / "rank_00000" / temp_name("state.flat")
        debris.write_bytes(b"a crash's partial write")
        os.utime(debris, (time.time() - 60, time.time() - 60))
        engine.save(3, make_items(3)).wait(timeout=60)
        engine.wait(timeout=60)
    assert sorted(p.name for p in local.iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]


def test_a_commit_whose_retention_fails_is_reported_committed_and_retention_catches_up(tmp_path, shm_root):
    """Retention runs after the manifest and the tracker are published: its failure (a listing that times out)
    turned a committed step into a failed save (found by a review). Nor does the store cache every manifest it
    ever committed: retention drops those it un-commits."""
    cfg = {"run_id": f"e{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "mem", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "l"), "fsync": False, "keep": 2}]}
    with CheckpointEngine(cfg) as engine:
        local = engine.pipeline.stores["local"]
        real = local.uncommit_expired
        calls = []

        def fails_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise TierError("listing timed out", tier="local")
            return real(*args, **kwargs)

        local.uncommit_expired = fails_once
        for step in range(1, 13):
            engine.save(step, {"m": {"w": torch.full((4,), float(step))}}).wait(timeout=60)
        engine.wait(timeout=60)
        assert local.committed_steps() == [11, 12]
        assert set(local._manifests) <= {11, 12}  # the drain's store: it never loads, so nothing else trims it
        assert engine.load().step == 12


def test_a_rank_that_read_a_step_another_rank_could_not_says_why_it_moves_on(tmp_path, shm_root, recorder,
                                                                              monkeypatch):
    """Every rank moves to an older step when one rank cannot read its part. The ranks that read theirs did so
    silently, after a 'load' event for a step they did not load (found by a review): they now record a fallback
    naming the reason, and emit 'load' only for the step loaded."""
    cfg = {"run_id": f"e{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "mem", "kind": "shm", "path": str(shm_root)},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "l"), "fsync": False}]}
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            engine.save(step, {"m": {"w": torch.full((4,), float(step))}}).wait(timeout=60)
        agree = engine.coordinator.all_succeeded
        first = []

        def another_rank_fails_step_2(ok: bool, what: str = "") -> bool:  # what a peer's failure looks like here
            if what == "loaded" and not first:
                first.append(ok)
                return False
            return agree(ok, what)

        monkeypatch.setattr(engine.coordinator, "all_succeeded", another_rank_fails_step_2)
        got = engine.load()
    assert got.step == 1 and first == [True]
    assert any("step 2: another rank could not load its part" in f for f in got.fallbacks), got.fallbacks
    assert [e.step for e in recorder.kinds("load")] == [1]
    assert [e.step for e in recorder.kinds("fallback")] == [2]


@pytest.mark.parametrize("name", ["a\\b", "x\x00y", "/abs", "a//b", "a/../b", "..", "a" * 201, "é" * 101])
def test_an_item_name_no_file_could_have_is_refused_at_save(tiers, name):
    """A user's trial: such names passed save() and failed every tier's write in the background (SaveError at
    wait(): "invalid key", "File name too long"). save() refuses them, naming the item; nothing is written."""
    with CheckpointEngine(config(tiers, "shm", "local")) as engine:
        with pytest.raises(ValueError, match="item name"):
            engine.save(1, {name: {"t": torch.ones(2)}})
        assert engine.available_steps() == {"shm": [], "local": []}
        engine.save(2, {"a/b": {"t": torch.ones(2)}, "a" * 200: {"t": torch.zeros(1)}}).wait(timeout=60)
        assert engine.load().items["a/b"]["t"].tolist() == [1.0, 1.0]


def test_save_and_prepare_on_a_closed_engine_are_refused_and_allocate_nothing(tiers, shm_root):
    """A user's trial: prepare() after close() made the slots again in shared memory, which nothing released."""
    from tiered_ckpt.errors import TieredCkptError

    cfg = config(tiers, "shm")
    cfg["tiers"][0]["on_close"] = "release"
    engine = CheckpointEngine(cfg)
    engine.close()
    before = sorted(p.name for p in Path(shm_root).rglob("slot_*"))
    for call in (lambda: engine.prepare(make_items(1)), lambda: engine.save(1, make_items(1))):
        with pytest.raises(TieredCkptError, match="closed engine"):
            call()
    assert sorted(p.name for p in Path(shm_root).rglob("slot_*")) == before == []


def test_load_into_hands_out_no_view_of_the_snapshot_for_what_has_no_target(tiers):
    """A review: with into=, a numpy array (an RNG state) or a tensor without a counterpart in into stayed a view
    of the slot, in the saving process its own writable buffer: writing into it damaged the snapshot."""
    import numpy as np

    with CheckpointEngine(config(tiers, "shm")) as engine:
        state = {"w": torch.ones(8), "rng": np.arange(6, dtype=np.uint32), "extra": torch.zeros(4)}
        engine.save(1, {"state": state}).wait(timeout=60)
        for copy in (False, True):
            target = {"state": {"w": torch.empty(8)}}
            got = engine.load(copy=copy, into=target).items["state"]
            got["rng"][:] = 7
            got["extra"].add_(1)
            again = engine.load(copy=True)
            assert again.verified and again.items["state"]["rng"].tolist() == list(range(6))
            assert again.items["state"]["extra"].tolist() == [0.0] * 4
