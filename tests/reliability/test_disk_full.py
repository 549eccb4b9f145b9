"""Disk full on the local tier: that tier's save fails with a clear event, earlier checkpoints stay intact, no
temporary file stays behind, the other tiers take the step, and the tier takes the next step once there is room.

Two ways to fill the disk: the ``faulty`` plugin's ``disk_full_after`` (at every write of a step: the first item,
midway through an item, the second item, the rank manifest, the checkpoint manifest, the tracker; in the
training process and in the drain worker process), and a real tmpfs of a few hundred KiB where the machine lets
a test mount one.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from crash_worker import scenario_items
from helpers import assert_same
from tiered_ckpt_faults import FaultyTier, write_control_file

from tiered_ckpt import CheckpointEngine, SaveError
from tiered_ckpt.handles import SavesFailedError
from tiered_ckpt.inventory import verify_step
from tiered_ckpt.tiers import _files
from tiered_ckpt.tiers._files import is_temp_name


@pytest.fixture(autouse=True)
def fresh_fault_controls():
    FaultyTier.controls.clear()
    yield
    FaultyTier.controls.clear()


def items(step: int) -> dict:
    return scenario_items(step, 1)


def temp_files(root: Path) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if is_temp_name(n)]


def config(tmp_path: Path, shm_root: str, local: dict, mode: str = "thread") -> dict:
    return {"run_id": f"full-{uuid.uuid4().hex[:8]}", "drain": {"mode": mode},
            "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, local,
                      {"name": "shared", "kind": "fsspec", "url": f"file://{tmp_path / 'shared'}"}]}


def faulty_local(tmp_path: Path, **faults) -> dict:
    return {"name": "local", "kind": "faulty", "inner": {"kind": "local", "path": str(tmp_path / "local")},
            "retry": {"attempts": 3, "initial_s": 0.01, "max_s": 0.02}, **faults}


def write_sizes(root: Path, step: int) -> list[int]:
    """The bytes of each write of one step on a file tier, in order: items, rank manifest, manifest, tracker."""
    manifest = json.loads((root / f"iter_{step:07d}/tiered_ckpt/manifest.json").read_text())
    files = [f["size"] for f in manifest["files"]]
    meta = root / f"iter_{step:07d}/tiered_ckpt"
    return [*files, (meta / "rank_00000.json").stat().st_size, (meta / "manifest.json").stat().st_size,
            (root / "latest_checkpointed_iteration.txt").stat().st_size]


# Where the disk fills up, as a byte budget computed from the sizes of a step's writes (a, b items, r rank
# manifest, m manifest): before anything, midway through the first item, in the second, at the rank manifest,
# at the checkpoint manifest. (The tracker, whose offset depends on the manifest's exact size: see below.)
WHERE = {
    "first_item": lambda a, b, r, m: 0,
    "midway_first_item": lambda a, b, r, m: a // 2,
    "second_item": lambda a, b, r, m: a + b // 2,
    "rank_manifest": lambda a, b, r, m: a + b + r // 2,
    "checkpoint_manifest": lambda a, b, r, m: a + b + r + m // 2,
    "tracker": None,
}


def fill_up_at_the_tracker(monkeypatch, root: Path) -> None:
    """The local tier's own writes fail with ENOSPC from the OS, for the tracker only (the ``shared`` tier, on
    ``file://``, writes through the same code: its directory is not full)."""
    real = _files._write_all

    def write_all(fd, views):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(f"{root}/") and path.rsplit("/", 1)[-1].startswith(".latest_checkpointed_iteration"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, views)

    monkeypatch.setattr(_files, "_write_all", write_all)


@pytest.mark.parametrize("where", list(WHERE))
def test_local_disk_full_fails_that_tier_only(tmp_path, shm_root, recorder, where, monkeypatch):
    cfg = config(tmp_path, shm_root, faulty_local(tmp_path))
    local = tmp_path / "local"
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            engine.save(step, items(step)).wait(timeout=60)
        a, b, r, m, _ = write_sizes(local, 2)
        if where == "tracker":
            fill_up_at_the_tracker(monkeypatch, local)
        else:
            FaultyTier.controls["local"].set(disk_full_after=WHERE[where](a, b, r, m))

        handle = engine.save(3, items(3))
        with pytest.raises(SaveError, match="tier 'local'.*disk full") as info:
            handle.wait(timeout=60)
        assert list(info.value.failures) == ["local"]
        assert handle.results == {"local": False, "shared": True}
        (failed,) = recorder.kinds("commit_failed", "local")
        assert failed.step == 3 and "disk full (ENOSPC)" in failed.message
        assert not recorder.kinds("retry", "local")  # permanent: retrying cannot help
        assert temp_files(local) == []

        # Earlier checkpoints are intact; the step itself is on the other tiers.
        committed = engine.pipeline.stores["local"].committed_steps()
        if where == "tracker":  # the manifest made it: step 3 is committed, only the tracker is behind
            assert committed == [1, 2, 3]
        else:
            assert committed == [1, 2]
        for step in committed:
            assert verify_step(engine.pipeline.stores["local"], step).ok
            assert_same(items(step), engine._load_from("local", step, True, None)[0])
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (3, "shm")
        assert_same(items(3), engine._load_from("shared", 3, True, None)[0])

        # Room again: the next step commits, and the failed step's debris goes with retention.
        FaultyTier.controls["local"].clear()
        monkeypatch.undo()
        engine.save(4, items(4)).wait(timeout=60)
        # The handle resolves before retention's deletions (housekeeping) run: wait for them. engine.wait()
        # reports every failure since the last one, so step 3's again, and only it.
        with pytest.raises(SavesFailedError) as waited:
            engine.wait(60)
        assert list(waited.value.steps) == [3] and list(waited.value.steps[3]) == ["local"]
        assert engine.pipeline.stores["local"].committed_steps()[-1] == 4
        assert (local / "latest_checkpointed_iteration.txt").read_text() == "4"
        if where != "tracker":  # regression: a failed first write left its empty step directory behind
            assert not (local / "iter_0000003").exists()
        assert temp_files(local) == []


@pytest.mark.slow
def test_disk_full_in_the_drain_worker_process(tmp_path, shm_root, recorder):
    """The drain runs in its own process: the fault comes through a control file, the event back to us."""
    control = tmp_path / "faults.json"
    cfg = config(tmp_path, shm_root, faulty_local(tmp_path, control_file=str(control)), mode="process")
    with CheckpointEngine(cfg) as engine:
        engine.save(1, items(1)).wait(timeout=120)
        write_control_file(control, disk_full_after=1000)
        with pytest.raises(SaveError, match="disk full"):
            engine.save(2, items(2)).wait(timeout=120)
        assert "disk full (ENOSPC)" in recorder.kinds("commit_failed", "local")[0].message
        write_control_file(control)
        engine.save(3, items(3)).wait(timeout=120)
    assert temp_files(tmp_path / "local") == []
    with CheckpointEngine({**cfg, "drain": {"mode": "thread"}}) as engine:
        assert engine.available_steps()["local"] == [1, 3]
        assert_same(items(1), engine._load_from("local", 1, True, None)[0])


@pytest.fixture
def small_mount(tmp_path):
    """A 320 KiB tmpfs, where the machine lets us mount one (root in a container with CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k,mode=0700", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)


def test_a_really_full_filesystem(tmp_path, shm_root, small_mount, recorder):
    cfg = config(tmp_path, shm_root, {"name": "local", "kind": "local", "path": str(small_mount / "ckpt")})
    big = {"state": {"w": None}}
    step = 0
    with CheckpointEngine(cfg) as engine:
        while True:  # ~96 KiB a step: the filesystem fills up within a few steps
            step += 1
            big["state"]["w"] = scenario_items(step, 1)["aux"]["noise"].repeat(640)
            handle = engine.save(step, {"state": dict(big["state"])})
            try:
                handle.wait(timeout=60)
            except SaveError as exc:
                assert "disk full (ENOSPC)" in str(exc) and "tier 'local'" in str(exc)
                break
            assert step < 10, "the small filesystem never filled up"
        assert step > 1
        assert "disk full" in recorder.kinds("commit_failed", "local")[-1].message
        assert temp_files(small_mount) == []
        store = engine.pipeline.stores["local"]
        assert store.committed_steps() == list(range(1, step))
        for s in store.committed_steps():
            assert verify_step(store, s).ok
        assert engine.load().step == step  # from shm; the shared tier has it too
        assert engine.available_steps()["shared"][-1] == step
