"""Ownership of a run across TMPDIRs, and what ``gc`` may touch (issue #15).

* The lock of a run lives beside its slots: a second engine on the same shm path with the same run_id and rank
  refuses to start even when its ``TMPDIR`` differs (containers sharing /dev/shm), and the message names the lock
  and the owner.
* ``gc --stale --delete`` never removes the shared memory of a run whose engine is alive, whatever its ``TMPDIR``.
* ``gc --delete`` while a drain is writing leaves the write's temporary file alone: the write completes and the
  step commits (a real drain, held inside its write).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same, cli, shm_local_config

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import EXIT_OK
from tiered_ckpt.errors import RunLockedError
from tiered_ckpt.tiers import _files
from tiered_ckpt.tiers.base import _user_name
from tiered_ckpt.tiers.local import LocalTier

HOLDER = textwrap.dedent("""
    import json, sys, torch
    from tiered_ckpt import CheckpointEngine
    engine = CheckpointEngine(json.loads(sys.argv[1]))
    engine.save(1, {"state": {"w": torch.arange(1000.0)}}).wait(timeout=60)
    print("READY", flush=True)
    sys.stdin.read()  # until the test closes our stdin, or kills us
    engine.close()
""")


def config(shm_root: str, tmp_path: Path, run_id: str | None = None) -> dict:
    return shm_local_config(shm_root, tmp_path, run_id, prefix="own")



@pytest.fixture
def other_tmpdir(tmp_path, monkeypatch):
    """This process's TMPDIR; the holder gets another one (``holder_env``)."""
    monkeypatch.delenv("TIERED_CKPT_LOCK_DIR", raising=False)
    mine = tmp_path / "tmp-test"
    mine.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(mine))
    theirs = tmp_path / "tmp-holder"
    theirs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TIERED_CKPT_LOCK_DIR"}
    env["TMPDIR"] = str(theirs)
    return env


@contextlib.contextmanager
def holder(cfg: dict, env: dict):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "READY"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_second_engine_with_another_tmpdir_refuses_to_start(shm_root, tmp_path, other_tmpdir):
    cfg = config(shm_root, tmp_path)
    slots = Path(shm_root) / _user_name() / cfg["run_id"]
    with holder(cfg, other_tmpdir) as proc:
        before = {p: p.read_bytes() for p in slots.rglob("*") if p.is_file()}
        with pytest.raises(RunLockedError) as info:
            CheckpointEngine(cfg)
        message = str(info.value)
        lock = os.path.join(shm_root, _user_name(), "@locks", cfg["run_id"], "rank_00000.lock")
        assert f"run_id {cfg['run_id']!r} rank 0 is already in use on this node by process {proc.pid}" in message
        assert f"(lock {lock})" in message and "on host " in message and "since " in message
        assert {p: p.read_bytes() for p in slots.rglob("*") if p.is_file()} == before  # nothing overwritten
        proc.send_signal(signal.SIGKILL)  # a dead process holds nothing
        proc.wait(timeout=30)
    with CheckpointEngine(cfg) as engine:  # and its snapshot is there to resume from
        loaded = engine.load()
        assert loaded.step == 1
        assert_same({"state": {"w": torch.arange(1000.0)}}, loaded.items)


def test_gc_stale_never_removes_a_live_run_in_another_tmpdir(shm_root, tmp_path, other_tmpdir):
    cfg = config(shm_root, tmp_path)
    slots = Path(shm_root) / _user_name() / cfg["run_id"]
    with holder(cfg, other_tmpdir) as proc:
        code, out = cli("gc", "--stale", "--shm-path", shm_root, "--json")
        assert code == EXIT_OK and cfg["run_id"] not in {f["run_id"] for f in json.loads(out)["found"]}
        code, out = cli("gc", "--stale", "--shm-path", shm_root, "--delete")
        assert code == EXIT_OK and (slots / "rank_00000" / "slot_0.json").exists()
        code, out = cli("ls", "--config", _write(tmp_path / "cfg.json", cfg))
        assert "snapshot (live engine)" in out
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    code, out = cli("gc", "--stale", "--shm-path", shm_root, "--json")  # now it is stale: listed, removed
    assert {f["run_id"]: f["state"] for f in json.loads(out)["found"]}[cfg["run_id"]] == "stale"
    assert cli("gc", "--stale", "--shm-path", shm_root, "--delete")[0] == EXIT_OK
    assert not slots.exists()
    assert not os.path.exists(os.path.join(shm_root, _user_name(), "@locks", cfg["run_id"]))
    with CheckpointEngine(cfg):  # the run starts again afresh
        pass


def _write(path: Path, cfg: dict) -> str:
    path.write_text(json.dumps(cfg))
    return str(path)


def test_gc_delete_during_a_drain_leaves_the_write_in_flight(shm_root, tmp_path, monkeypatch):
    """A real drain (thread mode) is held after it wrote its temporary file, before the rename; ``gc --delete``
    runs then (with the configuration: the run's lock is held; without: the file is younger than the grace
    period); the write then completes and the step commits."""
    cfg = config(shm_root, tmp_path)
    cfg_path = _write(tmp_path / "tiers.json", cfg)
    reached, go = threading.Event(), threading.Event()
    real = LocalTier.write_blob

    def held_write(self, key, chunks):
        def stream():
            yield from chunks
            if not go.is_set():  # every byte is in the temporary file; the rename waits
                reached.set()
                go.wait(timeout=120)
        return real(self, key, stream())

    monkeypatch.setattr(LocalTier, "write_blob", held_write)
    items = {"state": {"w": torch.arange(4096.0)}}
    local = tmp_path / "local"
    with CheckpointEngine(cfg) as engine:
        handle = engine.save(1, items)
        try:
            assert reached.wait(timeout=60), "the drain never reached its write"
            temps = [p for p in local.rglob("*") if _files.is_temp_name(p.name)]
            assert temps, "the write in flight has a temporary file"
            for argv in (("gc", "--config", cfg_path, "--delete", "--json"),
                         ("gc", str(local), "--delete", "--json")):
                code, out = cli(*argv)
                assert code == EXIT_OK, out
                assert [f for f in json.loads(out)["found"] if f["what"] == "temporary file"] == []
                assert all(p.exists() for p in temps)
        finally:
            go.set()
        handle.wait(timeout=60)
        assert engine.available_steps()["local"] == [1]
    old = local / "iter_0000001" / ".leftover.tmp-0123456789abcdef"  # a write that died an hour ago is debris
    old.write_bytes(b"half")
    os.utime(old, (1, 1))
    code, out = cli("gc", str(local), "--delete", "--json")
    assert code == EXIT_OK and not old.exists()
    with CheckpointEngine({**cfg, "tiers": cfg["tiers"][1:]}) as engine:
        assert_same(items, engine.load().items)


def test_gc_removes_a_closed_run_whose_lock_directory_is_gone(shm_root, tmp_path):
    """A run closed with its slots kept, on a node where the lock directory was cleaned away (or written by an
    older version): gc still takes the run's lock before removing it, creating what it needs."""
    cfg = config(shm_root, tmp_path)
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"state": {"w": torch.ones(10)}}).wait(timeout=60)
    locks = Path(shm_root) / _user_name() / "@locks"
    shutil.rmtree(locks)
    code, out = cli("gc", "--stale", "--shm-path", shm_root, "--delete", "--json")
    assert code == EXIT_OK
    assert {f["run_id"]: f["state"] for f in json.loads(out)["found"]} == {cfg["run_id"]: "closed"}
    assert not (Path(shm_root) / _user_name() / cfg["run_id"]).exists()
    assert not (locks / cfg["run_id"]).exists()


def test_a_drain_workers_lock_counts_while_held_and_is_no_sign_of_a_crash_once_let_go(shm_root):
    """The drain worker's lock (fencing.py) sits beside the engine's: held, the run is live (the worker may be
    writing, gc leaves the run alone); left behind unheld by a worker that exited, the run is closed, not stale."""
    import fcntl

    from tiered_ckpt.housekeeping import run_state
    from tiered_ckpt.locking import shm_lock_dir

    run_id = f"own-{uuid.uuid4().hex[:8]}"
    path = os.path.join(shm_lock_dir(shm_root, run_id), "worker_00000.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert run_state(run_id, shm_root) == "live"
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert run_state(run_id, shm_root) == "closed"
        Path(path).with_name("rank_00000.lock").write_text("{}")  # an engine's lock left unheld: killed
        assert run_state(run_id, shm_root) == "stale"
    finally:
        os.close(fd)


def test_a_drain_worker_that_starts_after_its_engine_is_gone_leaves_nothing_behind(tmp_path, monkeypatch):
    """A worker is a spawned interpreter that takes seconds to start: its engine may have closed (or been
    killed, and the run's shared memory removed) by then. It must not make the run's lock directories again
    (they would stay in /dev/shm for good): it reports why it drains nothing and exits."""
    import queue

    from tiered_ckpt import worker
    from tiered_ckpt.config import load_config
    from tiered_ckpt.parallel import RankCoords

    monkeypatch.setattr(worker, "watch_parent", lambda *_a, **_k: None)  # (its thread would outlive the test)
    sigint = signal.getsignal(signal.SIGINT)
    shm = tmp_path / "shm"  # the shm path as a finished test or `tiered-ckpt gc` left it: gone
    config = load_config({"run_id": f"late-{uuid.uuid4().hex[:8]}", "tiers": [
        {"name": "shm", "kind": "shm", "path": str(shm)}, {"name": "local", "kind": "local",
                                                             "path": str(tmp_path / "local")}]})
    requests, results = queue.Queue(), queue.Queue()
    threads = torch.get_num_threads()
    try:
        worker.worker_main(config, RankCoords(rank=0), ["shm", "local"], 0, [0], requests, results, os.getppid())
    finally:
        torch.set_num_threads(threads)
        signal.signal(signal.SIGINT, sigint)
    kind, message = results.get_nowait()
    assert kind == "fatal" and "lock directory" in message and "is gone" in message, message
    assert not shm.exists() and not (tmp_path / "local").exists()


HOLD = textwrap.dedent("""
    import json, sys
    from tiered_ckpt import CheckpointEngine
    engine = CheckpointEngine(json.loads(sys.argv[1]))
    print("READY", flush=True)
    sys.stdin.read()
""")


def _start(cfg, env):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, json.dumps(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "READY"
    return proc


def test_gc_stale_removes_lock_directories_without_shared_memory(shm_root, tmp_path, monkeypatch):
    monkeypatch.delenv("TIERED_CKPT_LOCK_DIR", raising=False)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))  # gc's $TMPDIR, the same as the engines'
    env = {**{k: v for k, v in os.environ.items() if k != "TIERED_CKPT_LOCK_DIR"}, "TMPDIR": str(tmp)}

    def local_only(name):
        return {"run_id": f"{name}{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
                "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / name)}]}

    dead, live = local_only("dead"), local_only("live")
    early = {"run_id": f"early{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
             "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                       {"name": "disk", "kind": "local", "path": str(tmp_path / "early")}]}
    for cfg in (dead, early):
        proc = _start(cfg, env)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (Path(shm_root) / _user_name() / early["run_id"]).rmdir()  # killed before its first slot; its slots dir went
    holder = _start(live, env)
    try:
        tmp_locks = tmp / f"tiered_ckpt-{_user_name()}"
        assert (tmp_locks / dead["run_id"] / "rank_00000.lock").exists()
        (tmp_locks / "not-a-run").mkdir()  # what else the lock directory may hold: never taken for a run's locks
        (tmp_locks / "not-a-run" / "notes.txt").write_text("mine")
        (tmp_locks / "empty").mkdir()
        conf = tmp_path / "early.json"  # gc's shm path: the test's own (--config; not --shm-path, see below)
        conf.write_text(json.dumps(early))
        code, out = cli("gc", "--stale", "--config", str(conf), "--json")  # its shm path and $TMPDIR
        assert code == 0, out
        stale = {f["run_id"] for f in json.loads(out)["found"] if f["what"] == "stale locks"}
        assert dead["run_id"] in stale and not {"not-a-run", "empty"} & stale, stale
        code, out = cli("gc", "--stale", "--shm-path", shm_root, "--delete", "--json")
        assert code == 0, out
        assert {f["run_id"] for f in json.loads(out)["found"]} == {early["run_id"]}  # --shm-path: only there
        assert not (Path(shm_root) / _user_name() / "@locks" / early["run_id"]).exists()
        assert cli("gc", "--stale", "--config", str(conf), "--delete")[0] == 0
        assert not (tmp_locks / dead["run_id"]).exists()
        assert (tmp_locks / live["run_id"] / "rank_00000.lock").exists()  # a live engine's: untouched
        assert (tmp_locks / "not-a-run" / "notes.txt").exists() and (tmp_locks / "empty").is_dir()
    finally:
        holder.kill()
        holder.wait()


def test_gc_never_unlinks_a_rank_lock_an_engine_took_while_the_stale_run_was_removed(shm_root, tmp_path,
                                                                                      monkeypatch):
    """An engine of the run starting while gc removes the run's shared memory takes its rank lock, then waits for
    run.lock (gc holds it): gc must leave that rank lock, or a second engine of the same rank would be let in."""
    import fcntl

    from tiered_ckpt import housekeeping
    from tiered_ckpt.locking import shm_lock_path

    cfg = {"run_id": f"race{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    proc = _start(cfg, dict(os.environ))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run,) = [r for r in housekeeping.find_stale_runs(shm_root) if r.run_id == cfg["run_id"]]
    rank_lock = os.path.join(shm_lock_path(shm_root, cfg["run_id"]), "rank_00000.lock")
    taken: list[int] = []
    real_rmtree = shutil.rmtree

    def rmtree_while_an_engine_starts(path, *a, **k):
        real_rmtree(path, *a, **k)
        if str(path) != run.path:  # the $TMPDIR lock files of older versions, removed after
            return
        fd = os.open(rank_lock, os.O_RDWR | os.O_CREAT, 0o600)  # what _LockFile.acquire does for the rank
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        taken.append(fd)

    monkeypatch.setattr(housekeeping.shutil, "rmtree", rmtree_while_an_engine_starts)
    try:
        housekeeping.remove_stale_run(run, shm_root)
        assert taken and os.path.exists(rank_lock)
        assert os.fstat(taken[0]).st_ino == os.stat(rank_lock).st_ino  # the very file the engine holds
    finally:
        for fd in taken:
            os.close(fd)


LOCKER = textwrap.dedent("""
    import fcntl, json, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "job": sys.argv[2]}).encode())
    print("HELD", flush=True)
    sys.stdin.read()
""")


def test_gone_ranks_are_those_whose_lock_a_dead_engine_of_the_job_left(tmp_path, monkeypatch):
    """A committing rank stops waiting for a rank of its node whose engine died: its lock file left, held by
    nobody, stamped with this job's incarnation. A live holder, a closed engine (no file), this process's own
    engine, and a lock an earlier run left (another incarnation: a restarted job whose ranks may now sit in
    another container of the same host name) are never taken for dead; the rank's next engine takes its lock."""
    from tiered_ckpt.locking import RunLock, gone_ranks

    directory = tmp_path / "locks"
    directory.mkdir()
    procs = {}
    for rank, job in ((0, "J"), (1, "J"), (4, "EARLIER")):  # 0 lives on; 1 and 4 are killed holding their lock
        procs[rank] = subprocess.Popen([sys.executable, "-c", LOCKER, str(directory / f"rank_{rank:05d}.lock"), job],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert procs[rank].stdout.readline().strip() == "HELD"
    for rank in (1, 4):
        procs[rank].kill()
        procs[rank].wait()
    monkeypatch.setenv("TIERED_CKPT_LOCK_DIR", str(tmp_path))
    run_id = directory.name
    mine = RunLock(run_id, 3)
    try:
        mine.acquire()
        mine.stamp("J")
        assert Path(mine.path).parent == directory and json.loads(Path(mine.path).read_text())["job"] == "J"
        # rank 2 has no file (closed, or on another node); rank 3 is this process's engine
        assert gone_ranks(str(directory), [0, 1, 2, 3, 4], "J") == {1: str(directory / "rank_00001.lock")}
        assert gone_ranks(str(directory), [0, 1, 2, 3, 4], "EARLIER") == {4: str(directory / "rank_00004.lock")}
        again = RunLock(run_id, 1)
        again.acquire()  # the dead rank's next engine takes its lock as usual
        try:
            again.stamp("K")
            assert gone_ranks(str(directory), [1], "J") == gone_ranks(str(directory), [1], "K") == {}
        finally:
            again.release()
        assert gone_ranks(str(directory), [1], "K") == {}  # released: its file is gone with it
    finally:
        mine.release()
        procs[0].stdin.close()
        procs[0].wait()
