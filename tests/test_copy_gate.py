"""The copy gate (copy_gate.py): a save's copy marks itself, the drain's loops sleep meanwhile, never past the
mark's deadline (a training process killed mid-copy), in threads and in the drain worker process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

import pytest
import torch

from tiered_ckpt import CheckpointEngine, copy_gate, file_store, snapshot_hash
from tiered_ckpt import checksum as checksum_mod
from tiered_ckpt.checksum import snapshot_checksum, snapshot_matches


@pytest.fixture
def counted_waits(monkeypatch):
    """Every call of copy_gate.wait_clear, counted (the gate itself left alone)."""
    calls = []
    real = copy_gate.wait_clear

    def counting(limit_s=None):
        calls.append(limit_s)
        return real(limit_s)

    monkeypatch.setattr(copy_gate, "wait_clear", counting)
    return calls


def test_copying_marks_and_clears_the_cell():
    assert not copy_gate.busy()
    with copy_gate.copying(1 << 20):
        assert copy_gate.busy()
        with copy_gate.copying(10):  # a second saver in this process: the mark stays until both are done
            assert copy_gate.busy()
        assert copy_gate.busy()
    assert not copy_gate.busy()
    assert copy_gate.shared().value == 0.0
    assert copy_gate.wait_clear() == 0.0


def test_the_mark_is_cleared_when_the_copy_raises():
    with pytest.raises(RuntimeError), copy_gate.copying(1):
        raise RuntimeError("copy failed")
    assert not copy_gate.busy()


def test_wait_clear_returns_once_the_copy_ends(monkeypatch):
    import threading

    monkeypatch.setattr(copy_gate, "ALLOWANCE_S", 600.0)
    entered, leave = threading.Event(), threading.Event()

    def saver() -> None:
        with copy_gate.copying(0):
            entered.set()
            leave.wait()

    t = threading.Thread(target=saver)
    t.start()
    entered.wait()
    assert copy_gate.busy()
    threading.Timer(0.05, leave.set).start()
    copy_gate.wait_clear()  # returns because the copy ended: its deadline is ten minutes away
    t.join()
    assert not copy_gate.busy()


def test_wait_clear_stops_at_its_limit(monkeypatch):
    monkeypatch.setattr(copy_gate, "ALLOWANCE_S", 600.0)
    with copy_gate.copying(0):
        copy_gate.wait_clear(limit_s=0.01)  # returns although the mark stands
        assert copy_gate.busy()


def _die_mid_copy(cell, ready) -> None:
    copy_gate.install(cell)
    copy_gate.ALLOWANCE_S = 0.3
    with copy_gate.copying(0):
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)  # the training process dies in the middle of its copy


def test_a_saver_killed_mid_copy_never_holds_the_drain_past_its_deadline():
    ctx = mp.get_context("spawn")
    cell = copy_gate.shared()
    ready = ctx.Event()
    proc = ctx.Process(target=_die_mid_copy, args=(cell, ready))
    proc.start()
    proc.join(120)
    assert ready.is_set() and proc.exitcode == -signal.SIGKILL
    assert cell.value != 0.0  # nobody cleared it
    copy_gate.wait_clear()  # and still this returns: the deadline passes
    assert not copy_gate.busy()
    cell.value = 0.0


def test_the_write_loop_hands_pieces_and_looks_at_the_gate_before_each(counted_waits):
    data = torch.arange(file_store.WRITE_PIECE * 2 + 5, dtype=torch.uint8)  # wraps around: any bytes do
    counting = file_store._Counting([data[:7], data], file_store.WRITE_PIECE)
    pieces = [bytes(p) for p in counting]
    assert [len(p) for p in pieces] == [7, file_store.WRITE_PIECE, file_store.WRITE_PIECE, 5]
    assert b"".join(pieces) == bytes(data[:7].numpy()) + bytes(data.numpy())
    assert counting.nbytes == 7 + data.numel() and len(counted_waits) == 4
    whole = file_store._Counting([data], None)  # a remote tier: the chunks as they come
    assert [len(p) for p in whole] == [data.numel()] and len(counted_waits) == 5


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(checksum_mod, "SNAPSHOT_PIECE", (1 << 20) + 3)
    monkeypatch.setattr(snapshot_hash, "SNAPSHOT_PIECE", (1 << 20) + 3)
    monkeypatch.setattr(snapshot_hash, "STEP", 100_000)


@pytest.mark.parametrize("n", [0, 5, (1 << 20) + 3, 3 * ((1 << 20) + 3) + 11])
def test_yielding_checksums_equal_the_snapshot_checksums(small_pieces, counted_waits, n):
    data = torch.randint(0, 255, (n,), dtype=torch.uint8)
    assert snapshot_hash.checksum(data) == snapshot_checksum(data)
    assert snapshot_hash.matches(data, snapshot_checksum(data))
    piece = (1 << 20) + 3
    steps = sum(-(-min(piece, n - at) // 100_000) for at in range(0, n, piece))
    assert len(counted_waits) == 2 * steps  # before every step, of both
    if n:
        bad = data.clone()
        bad[n // 2] ^= 1
        assert not snapshot_hash.matches(bad, snapshot_checksum(data))
    plain = f"{checksum_mod.ALGORITHM}:{checksum_mod.digest(data)}"
    assert snapshot_hash.matches(data, plain) == snapshot_matches(data, plain) is True


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_drain_waits_while_a_copy_is_marked(shm_root, tmp_path, monkeypatch, mode):
    """While a copy is marked (held open here, as a save in progress would), the previous step's drain to the
    local tier does not finish; once it ends, it does."""
    items = {"state": {"w": torch.randn(1 << 16), "b": torch.arange(10)}}
    cfg = {"run_id": f"gate{uuid.uuid4().hex[:8]}", "drain": {"mode": mode},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root), "slots": 2},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}
    monkeypatch.setattr(copy_gate, "ALLOWANCE_S", 600.0)
    with CheckpointEngine(cfg) as engine:
        engine.save(1, items).wait()  # the worker, if any, is up and drains from now on
        with copy_gate.copying(0):
            handle = engine.save(2, items)
            with pytest.raises(TimeoutError):
                handle.wait(timeout=1.0)
            assert "local" in engine.pending().get(2, [])
        handle.wait()
        assert engine.available_steps()["local"][-1] == 2
