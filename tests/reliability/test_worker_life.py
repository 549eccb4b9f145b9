"""The drain worker's life and death (issue #15).

* An orphaned worker (its training process SIGKILLed) writes nothing more: it exits without committing the step
  it was draining, and a new engine of the run kills one that cannot exit by itself (SIGSTOPped) before it
  touches a slot.
* The worker alone SIGKILLed at random points: every handle's outcome is what the tier has committed, and every
  committed step holds exactly what was saved (no slot was reused while a worker read it).
* ``close(timeout)`` and interpreter exit return with the worker SIGSTOPped; the committed step stays loadable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import assert_same, make_items

from tiered_ckpt import CheckpointEngine, SaveError
from tiered_ckpt import drain as drain_module
from tiered_ckpt.drain_protocol import DrainRequest
from tiered_ckpt.worker import process_state

HANG_GUARD_S = 120.0  # only against a hang: every wait below ends long before when the code is right

PARENT = textwrap.dedent("""
    import faulthandler, json, os, sys, time
    faulthandler.dump_traceback_later({dump_after!r})  # a hang shows where each thread is (stderr, in the failure)
    sys.path.insert(0, {tests!r})
    from helpers import make_items
    from tiered_ckpt import CheckpointEngine
    engine = CheckpointEngine(json.loads({cfg!r}))
    assert engine._drain._ready.wait(120), "the drain worker never came up"
    handle = engine.save(1, make_items(1))
    if {wait!r}:  # the whole drain, the worker's retention after the commit included: a worker stopped later
        handle.wait(timeout=120)  # is idle, and nothing is left for close() to wait for
        engine.wait(timeout=120)
    print("WORKER", engine._drain._proc.pid, flush=True)
    {then}
""")


def _config(shm_root: Path, tmp_path: Path, local: dict | None = None, run_id: str | None = None) -> dict:
    return {"run_id": run_id or f"w{uuid.uuid4().hex[:8]}", "drain": {"mode": "process"},
            "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                      local or {"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaps counts as gone)."""
    return process_state(pid) in (None, "Z")


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + HANG_GUARD_S
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _release(pid: int | None) -> None:
    """Cleanup: a stopped process left behind is continued and killed."""
    if pid is None:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _start_parent(cfg: dict, wait: bool, then: str) -> tuple[subprocess.Popen, int]:
    script = PARENT.format(tests=str(Path(__file__).parent.parent), cfg=json.dumps(cfg), wait=wait, then=then,
                           dump_after=HANG_GUARD_S - 20)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("WORKER"):
        proc.kill()
        pytest.fail(f"the training process did not start its worker: {line!r} {proc.stderr.read()[-3000:]}")
    return proc, int(line.split()[1])


def _manifest(tmp_path: Path, step: int) -> Path:
    return tmp_path / "local" / f"iter_{step:07d}" / "tiered_ckpt" / "manifest.json"


def test_orphaned_worker_commits_nothing_after_its_owner_died(shm_root, tmp_path):
    # Slow writes: the step is still being drained when the training process is killed.
    slow = {"name": "local", "kind": "faulty", "inner": {"kind": "local", "path": str(tmp_path / "local")},
            "latency_s": 0.5}
    cfg = _config(shm_root, tmp_path, slow)
    parent, worker = _start_parent(cfg, wait=False, then="time.sleep(600)")
    try:
        parent.kill()
        parent.wait()
        assert _wait_gone(worker), "the orphaned drain worker is still running"
        assert not _manifest(tmp_path, 1).exists(), "the orphaned worker committed step 1 after its owner died"
    finally:
        _release(worker)
        parent.kill()
    # The snapshot is still in shm: the next engine of the run drains it itself.
    with CheckpointEngine(_config(shm_root, tmp_path, run_id=cfg["run_id"])) as engine:
        assert [h.step for h in engine.recovered] == [1]
        engine.recovered[0].wait(timeout=HANG_GUARD_S)
        assert_same(make_items(1), engine._load_from("local", 1, True, None)[0])


def test_new_owner_fences_a_stopped_orphan_before_it_starts(shm_root, tmp_path):
    cfg = _config(shm_root, tmp_path)
    parent, worker = _start_parent(cfg, wait=True, then="time.sleep(600)")
    try:
        os.kill(worker, signal.SIGSTOP)  # cannot notice its parent's death by itself
        parent.kill()
        parent.wait()
        with CheckpointEngine(cfg) as engine:
            assert _gone(worker), "a new owner of the run started while the old owner's worker could still write"
            loaded = engine.load()
            assert loaded.step == 1
            assert_same(make_items(1), loaded.items)
    finally:
        _release(worker)
        parent.kill()


def test_close_is_bounded_with_the_worker_stopped(shm_root, tmp_path):
    cfg = _config(shm_root, tmp_path)
    engine = CheckpointEngine(cfg)
    worker = None
    try:
        assert engine._drain._ready.wait(HANG_GUARD_S)
        engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
        proc = engine._drain._proc
        worker = proc.pid
        os.kill(worker, signal.SIGSTOP)
        closer = threading.Thread(target=engine.close, kwargs={"timeout": 3}, daemon=True)
        closer.start()
        closer.join(HANG_GUARD_S)
        assert not closer.is_alive(), "close(timeout=3) hangs on a stopped drain worker"
        assert proc.exitcode is not None, "close() returned with the stopped worker still there"
    finally:
        _release(worker)
        engine.close(timeout=0)
    with CheckpointEngine(cfg) as again:
        loaded = again.load()
        assert loaded.step == 1
        assert_same(make_items(1), loaded.items)


def test_interpreter_exit_is_bounded_with_the_worker_stopped(shm_root, tmp_path):
    cfg = _config(shm_root, tmp_path)
    # No close(): the interpreter's exit has to end the engine and its stopped worker.
    parent, worker = _start_parent(cfg, wait=True, then="os.kill(engine._drain._proc.pid, 19)")  # 19: SIGSTOP
    try:
        try:
            code = parent.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            parent.kill()
            _release(worker)  # first: the stopped worker holds the parent's stderr open, communicate() would hang
            pytest.fail("the interpreter's exit hangs on the stopped drain worker; its threads, 20 s before:\n"
                        + parent.communicate(timeout=60)[1][-6000:])
        assert code == 0, parent.stderr.read()[-3000:]
        assert _wait_gone(worker)
    finally:
        _release(worker)
        parent.kill()
    with CheckpointEngine(cfg) as engine:
        assert engine.load().step == 1


def test_a_save_waiting_on_a_stopped_worker_says_why_and_goes_on_once_it_is_killed(shm_root, tmp_path, caplog,
                                                                                     monkeypatch):
    """One slot, held by a step the SIGSTOPped worker never drains: the next save() waited for ever without a word
    at the default log level (an operator's trial). It warns, naming the stopped process and what to do; once the
    worker is killed, the save goes on (the dead worker's slot is free) and a new worker drains it."""
    from tiered_ckpt import engine as engine_module

    monkeypatch.setattr(engine_module, "SLOT_WAIT_WARN_S", 1.0)
    monkeypatch.setattr(engine_module, "SLOT_WAIT_WARN_EVERY_S", 1.0)
    cfg = _config(shm_root, tmp_path)
    cfg["tiers"][0]["slots"] = 1
    worker = None
    with CheckpointEngine(cfg) as engine:
        try:
            assert engine._drain._ready.wait(HANG_GUARD_S)
            worker = engine._drain._proc.pid
            os.kill(worker, signal.SIGSTOP)
            first = engine.save(1, make_items(1))
            saver = threading.Thread(target=lambda: engine.save(2, make_items(2)), daemon=True)
            with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
                saver.start()
                deadline = time.monotonic() + HANG_GUARD_S
                while not any("kill -CONT" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline and saver.is_alive(), "no warning while save() waits"
                    time.sleep(0.1)
            said = next(r.getMessage() for r in caplog.records if "kill -CONT" in r.getMessage())
            assert "step 2 has waited" in said and f"process {worker}) is stopped" in said, said
            assert saver.is_alive()
            os.kill(worker, signal.SIGKILL)
            saver.join(HANG_GUARD_S)
            assert not saver.is_alive(), "save() still waits after the stopped worker was killed"
            with pytest.raises(SaveError, match="drain worker exited"):
                first.wait(timeout=HANG_GUARD_S)
            with pytest.raises(SaveError) as failed:  # step 2: drained by the worker started in the dead one's place
                engine.wait(timeout=HANG_GUARD_S)
            assert "step 1 on tier 'local'" in str(failed.value) and "step 2" not in str(failed.value)
            assert engine.available_steps()["local"] == [2]
        finally:
            _release(worker)


def _semaphores(pid: int) -> set[str]:
    """The named POSIX semaphores process ``pid`` has open (glibc maps each one's /dev/shm/sem.* file)."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/sem." in line}


def test_the_worker_s_channels_hold_no_named_semaphore(shm_root, tmp_path):
    """A job killed with SIGKILL (a scheduler's last word) takes multiprocessing's resource tracker with it: the
    named semaphores a ``multiprocessing.Queue`` holds (three each) stayed in /dev/shm for good. The channels
    between a training process and its worker are pipes, which the kernel closes: neither side holds one."""
    before = _semaphores(os.getpid())
    with CheckpointEngine(_config(shm_root, tmp_path)) as engine:
        assert engine._drain._ready.wait(HANG_GUARD_S)
        engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
        assert _semaphores(engine._drain._proc.pid) == set()
        assert _semaphores(os.getpid()) - before == set()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_worker_killed_at_random_points(shm_root, tmp_path, seed):
    """The worker alone SIGKILLed at random moments (seeded) while saves go on: a handle fails only where the step
    is not committed, succeeds only where it is, and each committed step is exactly what was saved."""
    rnd = random.Random(seed)
    run_id = f"r{seed}{uuid.uuid4().hex[:6]}"
    cfg = {"run_id": run_id, "drain": {"mode": "process"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root), "slots": 2},
                     {"name": "shm2", "kind": "shm", "path": os.path.join(shm_root, "second"), "slots": 2},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}
    handles = []
    engine = CheckpointEngine(cfg)
    try:
        drain = engine._drain.proc if hasattr(engine._drain, "proc") else engine._drain
        assert drain._ready.wait(HANG_GUARD_S)
        for step in range(1, 9):
            handles.append(engine.save(step, make_items(step)))
            if rnd.random() < 0.4:
                assert drain._ready.wait(HANG_GUARD_S)  # kill a worker at work, not one starting
                time.sleep(rnd.uniform(0.0, 0.4))  # a random point of the drain
                proc = drain._proc
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(HANG_GUARD_S)  # the next save goes to a replacement
        outcomes = {}
        for h in handles:
            try:
                h.wait("local", timeout=HANG_GUARD_S)
                outcomes[h.step] = True
            except SaveError:
                outcomes[h.step] = False
        committed = set(engine.pipeline.stores["local"].durable_steps())
        assert {s for s, ok in outcomes.items() if ok} == committed, (outcomes, committed)
        for step in committed:
            assert_same(make_items(step), engine._load_from("local", step, True, None)[0])
    finally:
        engine.close(timeout=HANG_GUARD_S)


def test_forked_children_leave_the_parent_s_engine_alone(shm_root, tmp_path):
    """A DataLoader's workers are forked (Linux's default) and run ``threading``'s exit hooks when they end: they
    closed their copy of the parent's engine, deleting its slots (``on_close: release``), unlocking its run lock
    and stopping its drain worker (found by a review). A child that calls ``close()`` itself does no harm either."""
    import torch

    cfg = _config(shm_root, tmp_path)
    cfg["tiers"][0]["on_close"] = "release"
    run_dir = Path(shm_root)

    def slots() -> list[str]:
        return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("slot_*"))

    with CheckpointEngine(cfg) as engine:
        assert engine._drain._ready.wait(HANG_GUARD_S)
        engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
        before = slots()
        assert before
        loader = torch.utils.data.DataLoader(list(range(8)), num_workers=2,
                                             multiprocessing_context="fork")
        assert [int(b) for b in loader] == list(range(8))
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's exit code says how it went
            try:
                engine.close()
            finally:
                os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
        assert slots() == before, "a forked child deleted the parent's slots"
        with pytest.raises(Exception, match="already in use"):
            CheckpointEngine(cfg)  # the run lock is still the parent's
        engine.save(2, make_items(2)).wait(timeout=HANG_GUARD_S)  # its drain worker still drains
    with CheckpointEngine(cfg) as again:
        loaded = again.load()
        assert loaded.step == 2
        assert_same(make_items(2), loaded.items)


def test_a_step_saved_again_is_not_reported_saved_by_the_earlier_save_s_commit(shm_root, tmp_path):
    """The drain worker dies before it touches the second save of step 5: the tier still holds the first save's
    commit of step 5, which is not this save's (it was reported saved; found by a review)."""
    import torch

    with CheckpointEngine(_config(shm_root, tmp_path)) as engine:
        assert engine._drain._ready.wait(HANG_GUARD_S)
        engine.save(5, {"state": {"w": torch.zeros(4)}}).wait(timeout=HANG_GUARD_S)
        worker = engine._drain._proc.pid
        os.kill(worker, signal.SIGSTOP)  # it cannot take the next request
        try:
            again = engine.save(5, {"state": {"w": torch.ones(4)}})
        finally:
            os.kill(worker, signal.SIGKILL)
        with pytest.raises(SaveError, match="drain worker exited"):
            again.wait(timeout=HANG_GUARD_S)
        with pytest.raises(SaveError, match="step 5"):
            engine.wait(timeout=HANG_GUARD_S)


def test_engine_wait_reports_the_steps_of_a_worker_that_dies_while_it_waits(shm_root, tmp_path):
    """wait() was woken when the dead worker's requests were dropped, before their failures were reported: it
    returned normally, and the failure surfaced only at the next wait (found by a review)."""
    with CheckpointEngine(_config(shm_root, tmp_path)) as engine:
        assert engine._drain._ready.wait(HANG_GUARD_S)
        drain = engine._drain
        looked_up = drain._committed

        def slow_lookup(*args):  # an object store's listing takes a while: wait() must not return meanwhile
            time.sleep(0.5)
            return looked_up(*args)

        drain._committed = slow_lookup
        worker = drain._proc.pid
        os.kill(worker, signal.SIGSTOP)
        engine.save(1, make_items(1))
        outcome: list[BaseException | None] = []

        def wait() -> None:
            try:
                engine.wait(timeout=HANG_GUARD_S)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                outcome.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(0.3)  # wait() is waiting
        os.kill(worker, signal.SIGKILL)
        waiter.join(HANG_GUARD_S)
        assert outcome and isinstance(outcome[0], SaveError), outcome
        assert "step 1 on tier 'local'" in str(outcome[0])


def test_a_save_the_drain_cannot_take_frees_its_slot(shm_root, tmp_path, monkeypatch):
    """The worker is dead and starting a new one fails (EAGAIN from fork/spawn): save() raises, and its slot and
    handle are let go. They were kept for ever, so the third save waited for a slot for ever (found by a
    review)."""
    from tiered_ckpt import worker as worker_module

    cfg = _config(shm_root, tmp_path)
    with CheckpointEngine(cfg) as engine:
        drain = engine._drain
        assert drain._ready.wait(HANG_GUARD_S)
        engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
        os.kill(drain._proc.pid, signal.SIGKILL)
        drain._proc.join(HANG_GUARD_S)
        start = worker_module.ProcessDrain._start
        failures = [2]

        def failing_start(self):
            if failures[0]:
                failures[0] -= 1
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return start(self)

        monkeypatch.setattr(worker_module.ProcessDrain, "_start", failing_start)
        for step in (2, 3):  # the shm tier has two slots: both would be held
            with pytest.raises(BlockingIOError):
                engine.save(step, make_items(step))
        assert engine.pending() == {}
        saved = []
        saver = threading.Thread(target=lambda: saved.append(engine.save(4, make_items(4))), daemon=True)
        saver.start()
        saver.join(HANG_GUARD_S)
        assert saved, "save(4) waits for a slot the failed saves still hold"
        saved[0].wait(timeout=HANG_GUARD_S)
    with CheckpointEngine(cfg) as again:
        loaded = again.load()
        assert loaded.step == 4
        assert_same(make_items(4), loaded.items)


def test_the_worker_lives_through_a_sigterm_its_training_process_handles(shm_root, tmp_path):
    """A scheduler's SIGTERM goes to the whole process group. A training process that handles it (Megatron-LM's
    --exit-signal-handler saves a last checkpoint, then exits) still needs its drain: the worker died of it,
    failing the step in flight (found by a review). A training process that dies of it takes the worker along
    (test_orphaned_worker_commits_nothing_after_its_owner_died)."""
    with CheckpointEngine(_config(shm_root, tmp_path)) as engine:
        drain = engine._drain
        assert drain._ready.wait(HANG_GUARD_S)
        worker = drain._proc.pid
        os.kill(worker, signal.SIGTERM)
        engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
        assert drain._proc.pid == worker and drain._proc.is_alive()


def test_the_worker_s_log_records_reach_the_training_process_s_handlers(shm_root, tmp_path, caplog):
    """The drain worker's warnings (a step saved again, a commit that failed) went to its own stderr, bare: no
    logger name, rank or time, and never to the job's log handlers (found by a user's fault trial). They are
    handled by the training process's loggers now."""
    import logging

    cfg = _config(shm_root, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"), CheckpointEngine(cfg) as engine:
        assert engine._drain._ready.wait(HANG_GUARD_S)  # the worker drains from here on
        engine.save(7, make_items(7)).wait(timeout=HANG_GUARD_S)
        engine.save(7, make_items(8)).wait(timeout=HANG_GUARD_S)  # the worker warns: committed, saved again
    said = [r for r in caplog.records if "is committed here and is being saved again" in r.getMessage()]
    assert said and said[0].name == "tiered_ckpt.file_store" and said[0].process != os.getpid()


def test_a_submit_after_close_is_refused_and_starts_no_worker(shm_root, tmp_path):
    with CheckpointEngine(_config(shm_root, tmp_path)) as engine:
        engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
        drain = engine._drain
    proc = drain._proc
    with pytest.raises(Exception, match="closed"):
        drain.submit(DrainRequest(step=2, source="shm", slot=0, due=("local",), created=time.time(), save_id=""))
    assert drain._proc is proc and not proc.is_alive()


def test_a_save_submitted_behind_the_stop_message_is_never_left_pending(shm_root, tmp_path):
    """The save's submit lands right after close() queued the worker's stop message: it is refused (or, were
    it sent, reported failed), never a handle that no one resolves."""
    engine = CheckpointEngine(_config(shm_root, tmp_path))
    drain = engine._drain
    engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
    assert drain._ready.wait(HANG_GUARD_S)
    store = engine.pipeline.entry_store
    copy_may_end, outcome = threading.Event(), []
    write_snapshot = store.write_snapshot

    def slow_copy(*a, **k):
        copy_may_end.wait(HANG_GUARD_S)
        return write_snapshot(*a, **k)

    def save():
        try:
            outcome.append(engine.save(2, make_items(2)))
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)

    store.write_snapshot = slow_copy
    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    time.sleep(0.3)
    put = drain._requests.put

    def put_then_let_the_save_submit(msg):
        put(msg)
        if msg is None:
            copy_may_end.set()
            saver.join(HANG_GUARD_S)

    drain._requests.put = put_then_let_the_save_submit
    engine.close()
    assert outcome
    if not isinstance(outcome[0], Exception):
        with pytest.raises(SaveError):
            outcome[0].wait(timeout=15)  # resolved, as failed (HEAD: TimeoutError: never resolved)
    assert engine.pending() == {} and drain.wait_idle(5)


def test_a_thread_drain_refuses_a_submit_that_passed_its_check_as_close_ran(shm_root, tmp_path, monkeypatch):
    engine = CheckpointEngine({**_config(shm_root, tmp_path), "drain": {"mode": "thread"}})
    drain = engine._drain
    engine.save(1, make_items(1)).wait(timeout=HANG_GUARD_S)
    inside, go_on, outcome = threading.Event(), threading.Event(), []
    job = drain_module._Job

    def late_job(*a, **k):
        if threading.current_thread().name == "racer":
            inside.set()
            go_on.wait(HANG_GUARD_S)
        return job(*a, **k)

    monkeypatch.setattr(drain_module, "_Job", late_job)

    def save():
        try:
            outcome.append(engine.save(2, make_items(2)))
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)

    racer = threading.Thread(target=save, name="racer", daemon=True)
    racer.start()
    assert inside.wait(HANG_GUARD_S)
    engine.close()
    go_on.set()
    racer.join(HANG_GUARD_S)
    assert outcome and isinstance(outcome[0], Exception), "HEAD: a handle that never resolves"
    assert drain.wait_idle(5)
