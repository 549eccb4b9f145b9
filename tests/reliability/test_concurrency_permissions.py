"""Concurrency and permissions.

* Two engines with the same ``run_id`` (and rank) on one node: the second fails at once with a clear
  :class:`RunLockedError` (in the same process or another one) and the first carries on untouched; other ranks of
  the run, and the same run after its process died, start fine.
* The shared memory of a run whose process was killed is reported by ``ls`` (stale: no live engine) and removed by
  ``gc --stale --delete``; a live run's never is.
* Shared-memory files, lock files and the temporary files of writes in progress are 0600 in 0700 directories of
  this user, whatever the umask; a lock directory another user owns (or a symlink) is refused.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from crash_worker import scenario_items
from helpers import assert_same, cli, shm_local_config

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import EXIT_OK
from tiered_ckpt.errors import RunLockedError, TieredCkptError
from tiered_ckpt.locking import RunLock, lock_dir
from tiered_ckpt.tiers import _files
from tiered_ckpt.tiers.base import _user_name

WORKER = Path(__file__).with_name("crash_worker.py")


def config(shm_root: str, tmp_path: Path, run_id: str | None = None) -> dict:
    return shm_local_config(shm_root, tmp_path, run_id, prefix="cc")



def snapshot_files(root: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, n), root): Path(d, n).read_bytes()
            for d, _, names in os.walk(root) for n in names}


# ----- two engines, one run_id ---------------------------------------------------------------------------------
def test_second_engine_in_the_same_process_fails_and_the_first_carries_on(shm_root, tmp_path):
    cfg = config(shm_root, tmp_path)
    with CheckpointEngine(cfg) as first:
        first.save(1, scenario_items(1, 1)).wait(timeout=60)
        before = snapshot_files(shm_root)
        with pytest.raises(RunLockedError) as info:
            CheckpointEngine(cfg)
        message = str(info.value)
        assert f"run_id {cfg['run_id']!r} rank 0 is already in use on this node by process {os.getpid()}" in message
        assert "give each job its own run_id" in message
        assert snapshot_files(shm_root) == before  # the refused engine touched nothing
        first.save(2, scenario_items(2, 1)).wait(timeout=60)
        loaded = first.load()
        assert loaded.step == 2
        assert_same(scenario_items(2, 1), loaded.items)
    with CheckpointEngine(cfg) as again:  # released on close
        assert again.load().step == 2


def test_other_ranks_of_the_run_are_not_blocked():
    run_id = f"cc-{uuid.uuid4().hex[:8]}"
    locks = [RunLock(run_id, rank) for rank in range(4)]
    for lock in locks:
        lock.acquire()
    with pytest.raises(RunLockedError, match="rank 2 is already in use"):
        RunLock(run_id, 2).acquire()
    for lock in locks:
        lock.release()


HOLDER = textwrap.dedent("""
    import json, sys
    from tiered_ckpt import CheckpointEngine
    engine = CheckpointEngine(json.loads(sys.argv[1]))
    print("READY", flush=True)
    sys.stdin.read()  # until the test closes our stdin, or kills us
    engine.close()
""")


def test_second_engine_in_another_process_fails_clearly(shm_root, tmp_path):
    cfg = config(shm_root, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cfg)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "READY"
        with pytest.raises(RunLockedError, match=f"already in use on this node by process {holder.pid}"):
            CheckpointEngine(cfg)
        holder.send_signal(signal.SIGKILL)  # a dead process holds nothing: the lock goes with it
        holder.wait(timeout=30)
        with CheckpointEngine(cfg):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


# ----- stale shared memory ---------------------------------------------------------------------------------------
def test_shm_of_a_killed_run_is_reported_stale_and_removed_only_by_gc(shm_root, tmp_path):
    dead = config(shm_root, tmp_path / "dead")
    spec = {"config": dead, "crash_at": "save.item_copied:3", "steps": [1, 2], "scales": [1, 1],
            "wait": [True, True], "log": str(tmp_path / "dead.log")}
    proc = subprocess.run([sys.executable, str(WORKER), "run", json.dumps(spec)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead_path = tmp_path / "dead.json"
    dead_path.write_text(json.dumps(dead))

    live = config(shm_root, tmp_path / "live")
    live_path = tmp_path / "live.json"
    live_path.write_text(json.dumps(live))
    with CheckpointEngine(live) as engine:
        engine.save(7, scenario_items(7, 1)).wait(timeout=60)
        # ls of the dead run's configuration: its snapshot (step 1; step 2 was torn mid-copy), stale.
        code, out = cli("ls", "--config", str(dead_path), "--json")
        shm_rows = [r for r in json.loads(out) if r["tier"] == "shm"]
        assert code == EXIT_OK
        assert [(r["step"], r["state"].split(";")[0]) for r in shm_rows if r["state"].startswith("snapshot")] == [
            (1, "snapshot (stale: its process ended without close()")]
        assert f"run {live['run_id']!r}: live engine" in [r["state"] for r in shm_rows]  # the other run, as it is
        # ls of the live run: its own snapshot is live, the dead run is listed as another stale run.
        code, out = cli("ls", "--config", str(live_path), "--json")
        rows = [r for r in json.loads(out) if r["tier"] == "shm"]
        assert (7, "snapshot (live engine)") in [(r["step"], r["state"]) for r in rows]
        assert [r["state"].split(";")[0] for r in rows if r["run_id"] == dead["run_id"]] == [
            f"run {dead['run_id']!r}: stale: its process ended without close()"]
        assert not [r for r in rows if r["run_id"] == live["run_id"] and "stale" in r["state"]]

        # gc --stale: a dry run lists the dead run only; --delete removes it; the live one stays.
        user_dir = Path(shm_root) / _user_name()
        code, out = cli("gc", "--stale", "--shm-path", shm_root, "--json")
        found = json.loads(out)["found"]
        assert [f["run_id"] for f in found] == [dead["run_id"]] and found[0]["ranks"] == [0]
        assert (user_dir / dead["run_id"]).exists()
        assert cli("gc", "--stale", "--shm-path", shm_root, "--delete")[0] == EXIT_OK
        assert not (user_dir / dead["run_id"]).exists()
        assert (user_dir / live["run_id"]).exists()
        assert engine.load().step == 7


# ----- permissions -----------------------------------------------------------------------------------------------
def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022], ids=["umask-000", "umask-022"])
def test_shm_lock_and_temporary_files_are_private(shm_root, tmp_path, monkeypatch, umask):
    temp_modes: dict[str, int] = {}
    real = _files.crash_point

    def spy(name: str) -> None:  # the moment a temporary file is written and not yet renamed
        if name == "files.temp_written":
            for d, _, names in os.walk(shm_root):
                for n in filter(_files.is_temp_name, names):
                    try:
                        temp_modes[os.path.join(d, n)] = _mode(os.path.join(d, n))
                    except FileNotFoundError:  # another thread's temporary file, renamed since the listing
                        pass
        real(name)

    monkeypatch.setattr(_files, "crash_point", spy)
    cfg = config(shm_root, tmp_path)
    old = os.umask(umask)
    try:
        with CheckpointEngine(cfg) as engine:
            engine.save(1, scenario_items(1, 1)).wait(timeout=60)
            lock = engine._lock.path
            assert _mode(lock) == 0o600
            assert _mode(os.path.dirname(lock)) == 0o700
            assert _mode(os.path.dirname(os.path.dirname(lock))) == 0o700  # $TMPDIR/tiered_ckpt-<user>
            user_dir = Path(shm_root) / _user_name()
            assert _mode(user_dir) == 0o700 and os.lstat(user_dir).st_uid == os.geteuid()
            for d, dirs, names in os.walk(user_dir):
                for n in dirs:
                    assert _mode(os.path.join(d, n)) == 0o700, os.path.join(d, n)
                for n in names:
                    assert _mode(os.path.join(d, n)) == 0o600, os.path.join(d, n)
            assert temp_modes and set(temp_modes.values()) == {0o600}, temp_modes
    finally:
        os.umask(old)


@pytest.fixture
def private_tmpdir(tmp_path, monkeypatch):
    """A TMPDIR of our own, so the lock directory's tests never touch the real one."""
    monkeypatch.delenv("TIERED_CKPT_LOCK_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path / f"tiered_ckpt-{_user_name()}"


def test_lock_directory_is_made_private(private_tmpdir):
    """Regression: the per-user lock directory was created with the umask's mode (0755)."""
    private_tmpdir.mkdir(mode=0o755)
    os.chmod(private_tmpdir, 0o755)
    lock = RunLock("perm-run", 3)
    lock.acquire()
    try:
        assert _mode(private_tmpdir) == 0o700
        assert _mode(private_tmpdir / "perm-run") == 0o700
        assert _mode(lock.path) == 0o600
    finally:
        lock.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_lock_directory_of_another_user_is_refused(private_tmpdir):
    private_tmpdir.mkdir(mode=0o700)
    os.chown(private_tmpdir, 4242, 4242)
    with pytest.raises(TieredCkptError, match="belongs to uid 4242, not to this user"):
        lock_dir("someone-elses")


def test_lock_directory_that_is_a_symlink_is_refused(private_tmpdir, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    private_tmpdir.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TieredCkptError, match="is not a directory \\(a symlink or a file\\)"):
        lock_dir("linked")


# ----- hangs -------------------------------------------------------------------------------------------------------
def test_a_hung_tier_never_hangs_close_and_its_step_is_recovered(shm_root, tmp_path):
    """A tier that stops answering (an NFS mount gone away) must not hold the job's shutdown: close() gives up
    after drain.close_timeout_s, the snapshot stays in shm, and the next process drains it."""
    import threading
    import time

    from tiered_ckpt_faults import FaultyTier

    cfg = config(shm_root, tmp_path)
    cfg["drain"]["close_timeout_s"] = 0.5
    inner = {k: v for k, v in cfg["tiers"][1].items() if k != "name"}
    hung = {"name": "local", "kind": "faulty", "inner": inner, "latency_s": 2, "ops": ["write_blob"]}
    FaultyTier.controls.pop("local", None)
    engine = CheckpointEngine({**cfg, "tiers": [cfg["tiers"][0], hung]})
    engine.save(1, scenario_items(1, 1))
    t0 = time.monotonic()
    engine.close()
    assert time.monotonic() - t0 < 3
    try:
        with CheckpointEngine(cfg) as again:  # the mount is back
            assert [h.step for h in again.recovered] == [1]
            again.recovered[0].wait(timeout=60)
            assert again.available_steps()["local"] == [1]
            assert_same(scenario_items(1, 1), again._load_from("local", 1, True, None)[0])
    finally:
        for th in threading.enumerate():  # the abandoned drain wakes up, finds its work done, and ends
            if th.name.startswith("tiered_ckpt-drain"):
                th.join(timeout=15)
        FaultyTier.controls.pop("local", None)
