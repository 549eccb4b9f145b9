"""Issue #15: a snapshot's checksums are born with its data.

Each item is hashed from the slot right after the save's copy (off the blocking path), so a snapshot damaged in
memory between ``save()`` and a crash is not stamped verified when a restart drains it: the drain checks the
slot against those checksums and refuses it. A snapshot whose checksums were never taken (its process died
first) is recovered with status "unverified origin": every load of it, from memory or from the files drained
from it, says ``verified=False``.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import replace

import pytest
import torch

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import CheckpointUnreadableError


def config(shm_root: str, tmp_path, run_id: str, *, with_local: bool) -> dict:
    tiers = [{"name": "shm", "kind": "shm", "path": shm_root}]
    if with_local:
        tiers.append({"name": "local", "kind": "local", "path": str(tmp_path / "local"), "fsync": False})
    return {"run_id": run_id, "drain": {"mode": "thread"}, "tiers": tiers}


def items(step: int) -> dict:
    return {"state": {"w": torch.arange(4096, dtype=torch.float32) + step, "step": step}}


def saved_and_left(shm_root: str, tmp_path, run_id: str, step: int):
    """A job saves ``step`` into shm only and goes away; the slot's record and data file."""
    eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=False))
    eng.save(step, items(step))
    eng.close()
    reader = CheckpointEngine(config(shm_root, tmp_path, f"{run_id}-r", with_local=False))  # another run's lock
    reader.close()
    store = eng.pipeline.entry_store
    meta = next(m for m in store.metas().values() if m.step == step)
    return store, meta


def find_data_file(shm_root: str, key: str) -> str:
    for d, _, names in os.walk(shm_root):
        for n in names:
            path = os.path.join(d, n)
            if path.endswith(key):
                return path
    raise AssertionError(f"no file {key} under {shm_root}")


def test_checksums_are_in_the_record_once_the_save_settles(shm_root, tmp_path):
    run_id = f"ck-{uuid.uuid4().hex[:8]}"
    store, meta = saved_and_left(shm_root, tmp_path, run_id, 4)
    assert meta.checksums == "saved" and meta.checksummed


def test_damage_after_save_is_not_stamped_verified_by_recovery(shm_root, tmp_path, recorder):
    run_id = f"ck-{uuid.uuid4().hex[:8]}"
    store, meta = saved_and_left(shm_root, tmp_path, run_id, 5)
    assert all(it.checksum for it in meta.items)  # taken at save: before the fix, only a drain took them
    # a byte of the item's data flips in memory after the save, before anything drained it
    path = find_data_file(shm_root, store.data_key(meta.slot))
    item = meta.items[0]
    with open(path, "r+b") as f:
        f.seek(item.offset + item.nbytes - 8)
        b = f.read(1)
        f.seek(item.offset + item.nbytes - 8)
        f.write(bytes([b[0] ^ 0xFF]))
    eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True))
    try:
        assert [h.step for h in eng.recovered] == [5]  # checksummed at save: drained, and checked
        with pytest.raises(Exception, match="damaged after save"):
            eng.wait(timeout=60)
        assert eng.available_steps()["local"] == []  # never committed with the damage
        with pytest.raises(CheckpointUnreadableError):
            eng.load()  # and shm's copy fails its own checksum
    finally:
        eng.close()


def test_a_snapshot_whose_checksums_never_came_is_recovered_as_unverified(shm_root, tmp_path, caplog):
    run_id = f"ck-{uuid.uuid4().hex[:8]}"
    store, meta = saved_and_left(shm_root, tmp_path, run_id, 6)
    # as if the process died between the copy and its checksums: the record it published first
    pending = replace(meta, checksums="pending", items=[replace(it, checksum=None) for it in meta.items])
    store.tier.publish(store.meta_key(meta.slot), pending.to_json())
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.engine"):
        eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True))
    try:
        eng.wait(timeout=60)
        assert [h.step for h in eng.recovered] == [6]  # drained, so the other ranks' commit is not left waiting
        assert "unverified origin" in caplog.text and "step 6" in caplog.text
        res = eng.load()
        assert res.step == 6 and res.tier == "shm" and not res.verified
        local = eng.pipeline.stores["local"].read_step(6, eng.coords, copy=True, map_location=None, verify=True,
                                                       trust_pickles=False, into=None)
        assert not local[1]  # the files say where their bytes came from: never stamped verified
        assert torch.equal(local[0]["state"]["w"], items(6)["state"]["w"])
    finally:
        eng.close()


def test_a_save_drains_verified_and_loads_verified_from_every_tier(shm_root, tmp_path):
    run_id = f"ck-{uuid.uuid4().hex[:8]}"
    eng = CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True))
    try:
        eng.save(1, items(1)).wait(timeout=60)
        res = eng.load()
        assert res.tier == "shm" and res.verified and torch.equal(res.items["state"]["w"], items(1)["state"]["w"])
        meta = next(m for m in eng.pipeline.entry_store.metas().values() if m.step == 1)
        assert meta.checksums == "saved"
        local = eng.pipeline.stores["local"].read_step(1, eng.coords, copy=True, map_location=None, verify=True,
                                                       trust_pickles=False, into=None)
        assert local[1] and torch.equal(local[0]["state"]["w"], items(1)["state"]["w"])
    finally:
        eng.close()


def test_the_drain_writes_while_the_checksums_are_taken_and_publishes_only_after_the_check(shm_root, tmp_path,
                                                                                          monkeypatch):
    """The save-time checksums take a pass over the snapshot after the copy; the drain does not wait for them
    before it writes (that pass would be on the way to durable), but its manifest waits for the check of the slot
    against them: the step drains verified, and a mismatch would still refuse it (the test above)."""
    import functools
    import threading

    from tiered_ckpt import snapshot_hash
    from tiered_ckpt.memory_store import MemoryStore
    from tiered_ckpt.tiers.local import LocalTier

    writing, checked = threading.Event(), []
    write_blob, checksum = LocalTier.write_blob, snapshot_hash.checksum

    def watched_write(self, key, chunks, *a, **k):
        writing.set()
        return write_blob(self, key, chunks, *a, **k)

    def late_checksum(data, stop=None):
        checked.append(writing.wait(15))  # the drain is writing before any checksum is in
        return checksum(data, stop)

    monkeypatch.setattr(LocalTier, "write_blob", watched_write)
    monkeypatch.setattr(snapshot_hash, "checksum", late_checksum)
    # (before: the drain waited for the checksums, which waited for the drain, until this gave up)
    monkeypatch.setattr(MemoryStore, "await_checksums",
                        functools.partialmethod(MemoryStore.await_checksums, timeout_s=30.0))
    run_id = f"ck-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(config(shm_root, tmp_path, run_id, with_local=True)) as eng:
        eng.save(1, items(1)).wait(timeout=60)
        assert checked and all(checked)
        local = eng.pipeline.stores["local"].read_step(1, eng.coords, copy=True, map_location=None, verify=True,
                                                       trust_pickles=False, into=None)
        assert local[1] and torch.equal(local[0]["state"]["w"], items(1)["state"]["w"])  # drained verified


def test_a_save_over_a_slot_whose_checksums_are_still_being_taken_calls_them_off(shm_root, tmp_path, monkeypatch):
    """Saves back to back with no drain that needs the checksums (shm only, or steps not due on a file tier): the
    save that reuses a slot waited for the old snapshot's checksums to finish, which it then overwrote (in a tight
    loop, blocking twice the copy). The hashing is called off instead; the new snapshot's are taken as usual."""
    import threading
    import time

    from tiered_ckpt import memory_store, snapshot_hash

    release = threading.Event()
    real = snapshot_hash.checksum

    def held(data, stop=None):  # hashing that goes on until released or called off
        while not release.is_set():
            if stop is not None and stop.is_set():
                raise snapshot_hash.Stopped
            time.sleep(0.01)
        return real(data, stop)

    monkeypatch.setattr(memory_store.snapshot_hash, "checksum", held)
    cfg = config(shm_root, tmp_path, f"h{uuid.uuid4().hex[:6]}", with_local=False)
    cfg["tiers"][0]["slots"] = 1
    with CheckpointEngine(cfg) as engine:
        try:
            engine.save(1, items(1))
            second = threading.Thread(target=engine.save, args=(2, items(2)), daemon=True)
            second.start()
            second.join(60)
            assert not second.is_alive(), "the save waited for the checksums of the snapshot it overwrites"
        finally:
            release.set()
        loaded = engine.load()
        assert loaded.step == 2 and loaded.verified
        assert torch.equal(loaded.items["state"]["w"], items(2)["state"]["w"])
