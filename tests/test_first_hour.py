"""A user's first hour (issue 17, part B): a resume never starts over by mistake, the quick start never stalls and
leaves nothing behind, configuration and API mistakes point at the fix, plugin options may be paths."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from helpers import assert_same

from tiered_ckpt import (
    CheckpointEngine,
    CheckpointUnreadableError,
    NoCheckpointError,
    SaveError,
    StepNotFoundError,
    TierUnavailableError,
    state,
)
from tiered_ckpt.config import load_config
from tiered_ckpt.errors import ConfigError, EncodeError, LoadIntoError, PluginError, TransientTierError
from tiered_ckpt.handles import SavesFailedError
from tiered_ckpt.locking import lock_dir
from tiered_ckpt.testing.contract import TierContract
from tiered_ckpt.tiers.base import _user_name
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.validate import build_dataclass

ROOT = Path(__file__).resolve().parents[1]


def run_id() -> str:
    return f"fh{uuid.uuid4().hex[:8]}"


@pytest.fixture
def own_lock_dir(tmp_path, monkeypatch):
    """Lock files of this test's engines in a directory of its own (to look at what close() leaves)."""
    monkeypatch.setenv("TIERED_CKPT_LOCK_DIR", str(tmp_path / "locks"))
    return tmp_path / "locks"


def unreachable_s3(name: str = "s3") -> dict:
    """An S3 tier whose endpoint refuses connections: listing it fails at once, as with a store that is down."""
    pytest.importorskip("s3fs")
    return {"name": name, "kind": "fsspec", "url": f"s3://bucket/{uuid.uuid4().hex[:8]}", "timeout_s": 2,
            "request_attempts": 1, "retry": {"attempts": 1},
            "options": {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}}


def test_a_misspelt_s3_option_is_a_configuration_error_before_any_save(tmp_path):
    """s3fs passes options it does not know on to aiobotocore, which refused them only at the first request, in
    the drain (a new-user trial: the save failed with a TypeError); the engine now refuses them at the key."""
    tier = unreachable_s3()
    tier["options"] = {**tier["options"], "endpoint_urll": tier["options"]["endpoint_url"]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.options: unknown s3fs option 'endpoint_urll'; did you "
                                          r"mean 'endpoint_url'\?"):
        CheckpointEngine({"run_id": run_id(), "tiers": [tier]})


# ----- 1. "nothing there" is not "could not look" ---------------------------------------------------------------
def test_an_unreachable_tier_is_named_and_the_newest_reachable_step_loads(tmp_path, recorder):
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}, unreachable_s3()]}
    with CheckpointEngine(cfg) as engine:
        with pytest.raises(SaveError):
            engine.save(1, {"model": {"w": torch.arange(4.0)}}).wait(timeout=60)
        assert engine.available_steps() == {"disk": [1]}  # s3 could not be listed: no key, not []
        assert engine.tiers == ["disk", "s3"]
        assert "Could not connect" in engine.unreachable_tiers()["s3"]
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "disk")
        assert list(loaded.unreachable) == ["s3"] and "Could not connect" in loaded.unreachable["s3"]
        assert [e.tier for e in recorder.kinds("tier_unreachable")] == ["s3"]


def test_nothing_loadable_with_an_unreachable_tier_is_not_no_checkpoint(tmp_path):
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}, unreachable_s3("remote")]}
    with CheckpointEngine(cfg) as engine:
        with pytest.raises(TierUnavailableError) as info:
            engine.load()
    assert not isinstance(info.value, NoCheckpointError)
    assert list(info.value.unreachable) == ["remote"]
    message = str(info.value)
    assert "could not list tier 'remote'" in message and "Could not connect" in message
    assert 'not "no checkpoint"' in message
    print(message)


def test_a_restart_with_snapshots_in_memory_while_a_tier_is_down_still_loads(tmp_path, shm_root, recorder):
    """The snapshots an engine leaves in shared memory are recovered at the next start: a tier that cannot be
    listed then (an object store down) is left out of that recovery, named, and the engine starts and loads the
    newest step (a new-user trial: the engine could not even be made, TransientTierError from __init__)."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}, unreachable_s3()]}
    state_1 = {"model": {"w": torch.arange(4.0)}}
    with CheckpointEngine(cfg) as engine:  # close() keeps the snapshot in shared memory (on_close: keep)
        with pytest.raises(SaveError):
            engine.save(1, state_1).wait(timeout=60)
    with CheckpointEngine(cfg) as engine:
        assert [e.tier for e in recorder.kinds("tier_unreachable")] == ["s3"]
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "shm")
        assert_same(state_1, loaded.items)


@pytest.mark.parametrize("kind", ["fsspec", "local"])
def test_a_file_tier_whose_directory_cannot_be_read_is_unreachable_not_empty(tmp_path, kind):
    """A tier directory that became a file (or sits under one: ENOTDIR) is "could not look": fsspec's find
    and os.walk would have listed it as empty."""
    root = tmp_path / "ckpt"
    tier = ({"name": "disk", "kind": "fsspec", "url": f"file://{root}"} if kind == "fsspec"
            else {"name": "disk", "kind": "local", "path": str(root)})
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"}, "tiers": [tier]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"model": {"w": torch.ones(4)}}).wait(timeout=60)
    os.rename(root, tmp_path / "moved")
    root.write_text("not a directory")  # an unmounted volume's placeholder, a wrong path: anything but the tier
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.(path|url): .*ckpt is a file"):  # checked when built
        CheckpointEngine(cfg)
    if kind == "local":  # the local tier makes its directory when built: one below a file fails there
        return
    below = {**tier, "url": f"file://{root}/run"}  # below the file: refused when built, as above
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url: .*ckpt is a file, not a directory \(in the tier's"):
        CheckpointEngine({**cfg, "tiers": [below]})
    root.unlink()
    os.rename(tmp_path / "moved", root)
    with CheckpointEngine({**cfg, "tiers": [below]}) as engine:  # built while its parent was a directory
        os.rename(root, tmp_path / "moved")
        root.write_text("not a directory")  # ENOTDIR when listed, not "empty"
        with pytest.raises(TierUnavailableError, match="disk"):
            engine.load()


def test_nothing_saved_anywhere_is_still_no_checkpoint(tmp_path):
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine, pytest.raises(NoCheckpointError) as info:
        engine.load()
    # where it looked, so that a wrong path or run_id shows (trial: the message named no tier)
    assert f"(looked in 'disk' (local {tmp_path / 'disk'}" in str(info.value)
    assert f"run_id {cfg['run_id']!r})" in str(info.value)


def test_a_step_no_tier_holds_is_named_with_the_steps_they_do_hold(tmp_path):
    """From a new-user trial: ``load(step=99)`` said only that step 99 was nowhere; the steps that are there
    (a typo, a step retention removed) are what the user needs next."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk"), "keep": 3},
                     {"name": "far", "kind": "local", "path": str(tmp_path / "far"), "keep": 1}]}
    with CheckpointEngine(cfg) as engine:
        for step in (10, 20):
            engine.save(step, {"model": {"w": torch.full((8,), float(step))}})
        engine.wait()
        with pytest.raises(StepNotFoundError, match=r"step 99 .*hold steps disk: 10, 20; far: 20\)$"):
            engine.load(step=99)
        assert engine.load(step=10).step == 10


def test_checkpoints_that_all_fail_to_load_are_not_no_checkpoint(tmp_path):
    """Found by a new-user trial: every step of a directory damaged, load() said NoCheckpointError, the script
    started over as the docs advise, and retention deleted the new run's steps at once (the damaged 100 and 200
    still counted as the newest). Steps that are there and fail are CheckpointUnreadableError, which a resume
    script catching NoCheckpointError does not swallow."""
    root = tmp_path / "disk"
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(root), "keep": 2}]}
    with CheckpointEngine(cfg) as engine:
        for step in (100, 200):
            engine.save(step, {"model": {"w": torch.full((4096,), float(step))}})
        engine.wait()
    for step in (100, 200):  # bit rot in both steps
        path = root / f"iter_{step:07d}" / "rank_00000" / "model.flat"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    with CheckpointEngine(cfg) as engine:
        with pytest.raises(CheckpointUnreadableError) as info:
            engine.load()
        assert not isinstance(info.value, NoCheckpointError)
        assert "200, 100" in str(info.value) or "100, 200" in str(info.value)
        assert "do not start from scratch" in str(info.value)
        assert any("step 200" in f for f in info.value.failures) and any("step 100" in f for f in info.value.failures)
        with pytest.raises(CheckpointUnreadableError, match="step 200"):
            engine.load(step=200)
        with pytest.raises(StepNotFoundError):  # a step that is not there at all: not that step, no more
            engine.load(step=7)


def test_reads_that_fail_with_the_tier_s_errors_never_advise_removing_the_steps(tmp_path):
    """Review: every read of a listed step timing out (an object store's outage) said the steps were damaged and
    to remove them. A tier's error is no proof of damage: the advice is to load again."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(100, {"m": {"w": torch.ones(4)}}).wait(timeout=60)
    with CheckpointEngine(cfg) as engine:
        def timing_out(*args, **kwargs):
            raise TransientTierError("read timed out (503 SlowDown)", tier="disk")

        engine.pipeline.stores["disk"].read_step = timing_out
        with pytest.raises(CheckpointUnreadableError) as info:
            engine.load()
        assert "not proven damage" in str(info.value) and "load again" in str(info.value)
        assert "remove a step" not in str(info.value)


def test_steps_some_ranks_hold_and_others_lack_are_not_no_checkpoint(tmp_path):
    """Review: a rank with nothing (a replaced node's node-local tier) beside ranks holding steps made load() say
    NoCheckpointError on every rank, and Megatron's adapter started from iteration 0 beside them. Simulated: the
    step agreement sees a second rank that lists nothing (the real exchange is tests/test_multirank.py's)."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        for step in (100, 200):
            engine.save(step, {"m": {"w": torch.ones(4)}})
        engine.wait()
    with CheckpointEngine(cfg) as engine:
        real = engine.coordinator.all_gather
        engine.coordinator.all_gather = lambda v, what="": real(v, what) + ([[]] if what == "agree_on_step" else [])
        with pytest.raises(CheckpointUnreadableError, match=r"Some ranks hold steps \(rank 0: 100, 200\) that not "
                                                            r"every rank holds"):
            engine.load()


def test_a_resume_from_an_older_step_than_some_ranks_hold_says_so(tmp_path, caplog):
    """A review: with node-local tiers, a step that failed on one node's disk (or that node's retention) leaves
    ranks holding different steps; load() resumed every rank from the newest step all hold without a word, the
    newer steps some ranks had silently passed over. Simulated as above: a second rank that lists only step 100."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        for step in (100, 200):
            engine.save(step, {"m": {"w": torch.full((4,), float(step))}})
        engine.wait()
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        real = engine.coordinator.all_gather
        engine.coordinator.all_gather = lambda v, what="": real(v, what) + ([[100]] if what == "agree_on_step" else [])
        assert engine.load().step == 100
        said = [r.getMessage() for r in caplog.records if "newest step every rank holds" in r.getMessage()]
        assert len(said) == 1 and "rank 0: 200" in said[0], said
        caplog.clear()
        engine.coordinator.all_gather = lambda v, what="": real(v, what) + ([v] if what == "agree_on_step" else [])
        assert engine.load().step == 200 and not [r for r in caplog.records if "every rank holds" in r.getMessage()]


def test_a_job_that_goes_back_to_an_older_step_keeps_its_new_steps(tmp_path, caplog):
    """Review: in one process, a job that loaded step 100 (of 100 and 200, keep: 1) and saved 110 saw 110 deleted
    right after its commit: retention counted from the highest step the process had ever committed."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk"), "keep": 2}]}
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        for step in (100, 200):
            engine.save(step, {"m": {"w": torch.full((4,), float(step))}})
        engine.wait()
        assert engine.load(step=100).step == 100  # a loss spike: back to step 100
        for step in (110, 120, 130):
            engine.save(step, {"m": {"w": torch.full((4,), float(step))}})
            engine.wait()
        assert engine.available_steps()["disk"] == [120, 130, 200]


def test_a_run_saving_below_an_earlier_run_s_steps_keeps_its_own_newest_steps(tmp_path, caplog):
    """Trial: a new run saving steps 1-3 into a directory holding an earlier run's 100 and 200 (keep: 2) had each
    new step deleted by retention right after its commit, wait() raising nothing. The steps above this run's
    newest are left alone (and said so once); keep counts among the rest."""
    root = tmp_path / "disk"
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(root), "keep": 2}]}
    with CheckpointEngine(cfg) as engine:
        for step in (100, 200):
            engine.save(step, {"model": {"w": torch.full((8,), float(step))}})
        engine.wait()
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        for step in (1, 2, 3):
            engine.save(step, {"model": {"w": torch.full((8,), float(step))}})
            engine.wait()
        assert engine.available_steps()["disk"] == [2, 3, 100, 200]
        assert torch.equal(engine.load(step=3).items["model"]["w"], torch.full((8,), 3.0))
    said = [r.getMessage() for r in caplog.records if "newer than step" in r.getMessage()]
    assert len(said) == 1 and "100, 200" in said[0] and "'disk'" in said[0]


def test_two_tiers_in_one_place_are_a_configuration_error(tmp_path):
    """Trial: tiers 'a' (keep 1) and 'b' (keep 3) on one directory: b's keep broken, a fallback copy that does not
    exist listed twice."""
    where = str(tmp_path / "ckpt")
    for second in ({"name": "b", "kind": "local", "path": where + "/", "keep": 3},
                   {"name": "b", "kind": "fsspec", "url": f"file://{where}", "keep": 3}):
        cfg = {"run_id": run_id(), "tiers": [{"name": "a", "kind": "local", "path": where, "keep": 1}, second]}
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.(path|url): .* is also tiers\[0\]'s \('a'\)"):
            CheckpointEngine(cfg)
    cfg = {"run_id": run_id(), "tiers": [{"name": "a", "kind": "local", "path": where},
                                         {"name": "b", "kind": "local", "path": str(tmp_path / "other")}]}
    CheckpointEngine(cfg).close()  # two places: fine


@pytest.mark.parametrize("below", ["", "/sub/dir"], ids=["the-path", "a-parent"])
@pytest.mark.parametrize("kind", ["local", "shm", "fsspec"])
def test_a_tier_path_that_is_a_file_is_a_configuration_error_at_its_key_for_every_kind(tmp_path, kind, below):
    """Trial: a local tier said so at tiers[i].path; an shm tier raised a bare error without the key, and an fsspec
    file:// tier built fine and failed only in the drain. A second trial: with a file as a parent of the path, a
    local tier raised an unlocated "Not a directory", shm "cannot create the lock directory", fsspec built."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    path = f"{afile}{below}"
    tier = {"local": {"name": "t", "kind": "local", "path": path},
            "shm": {"name": "t", "kind": "shm", "path": path},
            "fsspec": {"name": "t", "kind": "fsspec", "url": f"file://{path}"}}[kind]
    tiers = [tier] if kind != "shm" else [tier, {"name": "disk", "kind": "local", "path": str(tmp_path / "d")}]
    key = "url" if kind == "fsspec" else "path"
    where = f" \\(in the tier's path {re.escape(path)}\\)" if below else ""
    with pytest.raises(ConfigError, match=rf"tiers\[0\]\.{key}: .*afile is a file, not a directory{where}: give"):
        CheckpointEngine({"run_id": run_id(), "tiers": tiers})
    assert afile.read_text() == "not a directory"


def test_an_events_file_that_cannot_be_written_is_a_configuration_error(tmp_path):
    """Trial: events.jsonl in a directory that does not exist printed a traceback at every event, all run long."""
    cfg = {"run_id": run_id(), "events": {"jsonl": str(tmp_path / "no" / "such" / "dir" / "e.jsonl")},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with pytest.raises(ConfigError, match=r"events\.jsonl: cannot append to .*e\.jsonl: No such file"):
        CheckpointEngine(cfg)


def test_the_staging_tier_is_never_listed_or_loaded_from(tmp_path):
    cfg = {"run_id": run_id(), "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(3, {"model": {"w": torch.ones(3)}}).wait(timeout=60)
        assert engine.available_steps() == {"disk": [3]}
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (3, "disk") and not loaded.unreachable
        assert engine.pipeline.order == ["_staging", "disk"] and engine.tiers == ["disk"]


# ----- 2. the quick start: no stall, safe twice, nothing left behind ---------------------------------------------
def test_the_first_saves_never_wait_for_the_drain_worker_to_start(shm_root, tmp_path, monkeypatch, recorder):
    """The worker process is held at its start-up (its interpreter waits for a gate file, as one importing torch
    from a slow filesystem would) while three saves go through two slots: they drain in threads here, and no save
    waits for a slot; once the worker is up, it takes the next ones."""
    gate, site = tmp_path / "gate", tmp_path / "slow-start"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys, time\n"
        "if '--multiprocessing-fork' in sys.argv:  # a spawned child: the drain worker\n"
        f"    while not os.path.exists({str(gate)!r}):\n"
        "        time.sleep(0.05)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    cfg = {"run_id": run_id(), "drain": {"mode": "process"},
           "tiers": [{"name": "host", "kind": "shm", "path": shm_root, "slots": 2},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        try:
            first = engine.save(1, {"model": {"w": torch.full((256,), 1.0)}})
            engine.save(2, {"model": {"w": torch.full((256,), 2.0)}})
            first.wait(timeout=30)  # drained although the worker is not up
            engine.save(3, {"model": {"w": torch.full((256,), 3.0)}}).wait(timeout=30)
            assert not recorder.kinds("slot_wait")
            assert engine._drain.drained_here == 3 and not engine._drain._ready.is_set()
        finally:
            gate.touch()
        assert engine._drain._ready.wait(120), "the worker never came up"
        engine.save(4, {"model": {"w": torch.full((256,), 4.0)}}).wait(timeout=60)
        assert engine._drain.drained_here == 3  # step 4 went to the worker
        engine.wait(timeout=60)
        assert engine.available_steps()["disk"] == [1, 2, 3, 4]
        assert torch.equal(engine.load().items["model"]["w"], torch.full((256,), 4.0))


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quick_start_runs_twice_and_leaves_only_its_checkpoint_directory(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(_quick_start())
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("TIERED_CKPT_LOCK_DIR", None)
    shm_user_dir = Path("/dev/shm/tiered_ckpt") / _user_name()
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        match = re.search(r"^(quickstart-\w+): resumed step 3 from tier 'host'$", proc.stdout, re.M)
        assert match, proc.stdout
        runs.append(match.group(1))
        assert not (shm_user_dir / match.group(1)).exists(), "memory slots left in /dev/shm after close()"
    assert runs[0] != runs[1]
    locks = tmp_path / f"tiered_ckpt-{_user_name()}"
    assert not locks.exists() or os.listdir(locks) == [], "lock directories left after close()"
    ckpt_dirs = sorted(p for p in tmp_path.iterdir() if p.name.startswith("quickstart-") and p.is_dir())
    assert len(ckpt_dirs) == 2  # what the README says stays: each run's checkpoint directory, steps 2 and 3
    for d in ckpt_dirs:
        assert sorted(p.name for p in d.iterdir() if p.name.startswith("iter_")) == ["iter_0000002", "iter_0000003"]


def test_on_close_release_frees_the_slots_whose_steps_are_on_disk(shm_root, tmp_path, own_lock_dir):
    rid = run_id()
    run_dir = Path(shm_root) / _user_name() / rid
    cfg = {"run_id": rid, "drain": {"mode": "thread"},
           "tiers": [{"name": "host", "kind": "shm", "path": shm_root, "on_close": "release"},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"model": {"w": torch.ones(100)}}).wait(timeout=60)
        engine.save(2, {"model": {"w": torch.ones(100)}}, persistent=False).wait(timeout=60)  # memory only
        assert run_dir.is_dir()
    # Step 1 is on disk: its slot went. Step 2 is nowhere else: it stays, the only copy.
    assert sorted(p.name for p in (run_dir / "rank_00000").iterdir()) == ["slot_1.data", "slot_1.json"]
    with CheckpointEngine(cfg) as engine:
        assert engine.available_steps() == {"host": [2], "disk": [1]}
        engine.save(3, {"model": {"w": torch.ones(100)}}).wait(timeout=60)
    assert not run_dir.exists()  # every slot's step is on disk now: nothing left in /dev/shm
    assert not (Path(shm_root) / _user_name() / "@locks" / rid).exists()  # nor a lock directory for the run
    # keep: 1 on disk, 2 slots: step 5 is committed, then retired by step 6's commit; its slot goes too (it
    # stayed, for ever, found by a fault trial)
    rid2 = run_id()
    one = {**cfg, "run_id": rid2, "tiers": [cfg["tiers"][0], {**cfg["tiers"][1], "path": str(tmp_path / "d2"),
                                                                "keep": 1}]}
    with CheckpointEngine(one) as engine:
        for step in (5, 6):
            engine.save(step, {"model": {"w": torch.ones(100)}}).wait(timeout=60)
    assert not (Path(shm_root) / _user_name() / rid2).exists()
    keep = {**cfg, "run_id": run_id(), "tiers": [{**cfg["tiers"][0], "on_close": "keep"}, cfg["tiers"][1]]}
    with CheckpointEngine(keep) as engine:
        engine.save(4, {"model": {"w": torch.ones(100)}}).wait(timeout=60)
    assert (Path(shm_root) / _user_name() / keep["run_id"] / "rank_00000" / "slot_0.json").exists()  # the default


def test_a_closed_engine_leaves_no_lock_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("TIERED_CKPT_LOCK_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    rid = run_id()
    cfg = {"run_id": rid, "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg):
        assert os.listdir(os.path.join(tempfile.gettempdir(), f"tiered_ckpt-{_user_name()}", rid)) == [
            "rank_00000.lock"]
    assert os.listdir(os.path.join(tempfile.gettempdir(), f"tiered_ckpt-{_user_name()}")) == []
    with CheckpointEngine(cfg):  # and the next engine of that run_id locks as before
        assert os.path.isdir(lock_dir(rid))


# ----- 3. configuration errors that point at the fix -------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("tiers: [{name: a, kind: local, path: /x, keeep: 2}]",
     "tiers.yaml: tiers[0].keeep: unknown key (allowed for a local tier: codec, codecs, compression, direct_io, "
     "enabled, every, fsync, keep, kind, name, path, retry); did you mean 'keep'?"),
    ("tier: [{name: a, kind: local, path: /x}]",
     "tiers.yaml: tier: unknown key (allowed here: drain, events, layout, load, run_id, tiers); did you mean "
     "'tiers'?"),
    ("tiers: [{name: a, kind: local, path: /x}, {name: m, kind: shm, keep: 2}]",
     "tiers.yaml: tiers[1].keep: does not apply to a memory tier (kind 'shm')"),
    ("tiers: [{name: m, kind: shm, every: 10}]", "tiers.yaml: tiers[0].every: does not apply to a memory tier"),
    ("tiers: [{name: m, kind: shm, compression: {codec: zstd}}]",
     "tiers.yaml: tiers[0].compression: does not apply to a memory tier (kind 'shm'): a memory tier holds raw "
     "snapshots, never compressed; remove the key"),
    ("tiers: [{name: a, kind: local, path: /x, when_full: skip}]", "tiers.yaml: tiers[0].when_full: only memory"),
    ("tiers: [{name: m, kind: shm, slotz: 3}]", "tiers.yaml: tiers[0].slotz: unknown key (allowed for a shm tier: "
     "enabled, kind, min_free, name, on_close, path, pin, slots, when_full); did you mean 'slots'?"),
    ("tiers: [{name: g, kind: gpu, device: tpu}]", 'tiers.yaml: tiers[0].device: expected a torch device'),
    ("tiers: [{name: a, kind: local, path: /x, retry: {atempts: 3}}]",
     "tiers.yaml: tiers[0].retry.atempts: unknown key (allowed here: attempts, deadline_s, initial_s, max_s); "
     "did you mean 'attempts'?"),
])
def test_config_errors_name_the_file_the_key_and_the_fix(tmp_path, text, expected):
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value).replace(str(tmp_path) + "/", "").startswith(expected), str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pin_true_without_cuda_fails_when_the_engine_is_built(tmp_path, shm_root):
    path = tmp_path / "tiers.yaml"
    path.write_text(f"run_id: {run_id()}\ndrain: {{mode: thread}}\n"
                    f"tiers: [{{name: host, kind: shm, path: {shm_root}, pin: true}}]\n")
    with pytest.raises(ConfigError, match=r"tiers\.yaml: tiers\[0\]\.pin: pin is true but CUDA is not available"):
        CheckpointEngine(str(path))


# ----- 4. API traps -------------------------------------------------------------------------------------------
@pytest.fixture
def engine(shm_root, tmp_path):
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "host", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        yield engine


def test_a_bare_state_dict_as_items_is_refused(engine):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"save\(12, items\): every value of items is a tensor \('weight', "
                                         r"'bias'\).*save\(12, \{\"model\": model.state_dict\(\)\}\)"):
        engine.save(12, model.state_dict())
    assert engine.available_steps() == {"host": [], "disk": []}


def test_a_module_as_an_item_says_to_call_state_dict(engine):
    with pytest.raises(EncodeError, match=r"^item 'model': cannot encode object of type "
                                          r"torch.nn.modules.linear.Linear without pickle; .*\.state_dict\(\)"):
        engine.save(11, {"model": torch.nn.Linear(2, 2)})
    with pytest.raises(EncodeError, match=r"^item 'train' at optim\['inner'\]: cannot encode object of type "
                                          r"torch.optim.sgd.SGD"):
        engine.save(11, {"train": {"optim": {"inner": torch.optim.SGD([torch.zeros(1, requires_grad=True)])}}})


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_load_into_an_unknown_item_or_another_shape_is_an_error(engine, tier):
    items = {"model": {"w": torch.arange(6.0), "b": torch.zeros(2)}, "meta": {"step": 1}}
    engine.save(1, items).wait(timeout=60)
    if tier == "disk":
        engine.pipeline.stores["host"].invalidate(0)  # the snapshot is gone: the disk copy is loaded
    with pytest.raises(LoadIntoError, match=rf"no item 'modle' in step 1 on tier '{tier}' \(its items: 'model', "
                                            r"'meta'\); did you mean 'model'\?"):
        engine.load(into={"modle": {"w": torch.empty(6)}})
    with pytest.raises(LoadIntoError, match=r"item 'model'\['w'\] is float32\[6\] in the checkpoint but "
                                            r"float32\[2, 3\] in into"):
        engine.load(into={"model": {"w": torch.empty(2, 3), "b": torch.empty(2)}})
    target = {"model": {"w": torch.empty(6), "b": torch.ones(2)}}
    assert engine.load(into=target).tier == tier and torch.equal(target["model"]["w"], torch.arange(6.0))


def test_engine_wait_raises_for_a_failed_tier_like_handle_wait(tmp_path):
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}, unreachable_s3()]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"model": {"w": torch.ones(2)}})
        engine.save(2, {"model": {"w": torch.ones(2)}})
        with pytest.raises(SavesFailedError) as info:
            engine.wait(timeout=60)
        assert isinstance(info.value, SaveError) and sorted(info.value.steps) == [1, 2]
        assert list(info.value.steps[1]) == ["s3"] and "step 2 on tier 's3'" in str(info.value)
        engine.wait(timeout=60)  # each failure is reported once


def test_a_timeout_given_to_a_handle_s_wait_as_its_tier_says_so(tmp_path):
    """From a new-user trial: engine.wait(60) takes a timeout first, handle.wait(60) a tier name; 60 was looked up
    as a tier ("tier 60 is not due")."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        handle = engine.save(1, {"model": {"w": torch.ones(2)}})
        with pytest.raises(TypeError, match=r"first argument is a tier name, got 60: .*wait\(timeout=60\)"):
            handle.wait(60)
        handle.wait(timeout=60)


def test_saving_a_step_twice_while_the_first_is_in_flight_keeps_both_handles(shm_root, tmp_path):
    slow = {"name": "disk", "kind": "faulty", "latency_s": 0.5,
            "inner": {"kind": "local", "path": str(tmp_path / "disk")}}
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "host", "kind": "shm", "path": shm_root}, slow]}
    with CheckpointEngine(cfg) as engine:
        first = engine.save(5, {"model": {"w": torch.ones(4)}})
        second = engine.save(5, {"model": {"w": torch.full((4,), 2.0)}})
        first.wait(timeout=30)  # was never resolved: the second handle replaced it
        second.wait(timeout=30)
        assert first.results == second.results == {"disk": True}
        assert torch.equal(engine.load().items["model"]["w"], torch.full((4,), 2.0))


def test_models_and_optimizers_through_tiered_ckpt_state(engine):
    torch.manual_seed(0)

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optimizer = build()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    items = state.items_of(model=model, optimizer=optimizer, meta={"step": 7})
    assert sorted(items) == ["meta", "model", "optimizer"] and "0.weight" in items["optimizer"]["state"]
    engine.save(7, items).wait(timeout=60)
    for tier in ("host", "disk"):
        fresh, fresh_optimizer = build()
        if tier == "disk":
            engine.pipeline.stores["host"].invalidate(0)
        result = engine.load()
        assert result.tier == tier
        state.apply(result, model=fresh, optimizer=fresh_optimizer)
        assert_same(model.state_dict(), fresh.state_dict())
        assert_same(optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"])
    with pytest.raises(TypeError, match="give its .state_dict"):
        state.items_of(model=model, other=optimizer)
    with pytest.raises(ValueError, match="no item 'optimizer'"):
        state.apply({"model": items["model"]}, model=fresh, optimizer=fresh_optimizer)


# ----- 5. plugins: Path options, documented types, Options from YAML --------------------------------------------
@dataclass(frozen=True)
class PathOptions:
    path: Path
    scratch: Path | None = None
    fsync: bool = True
    direct_io: bool | Literal["auto"] = "auto"


class PathLocalTier(LocalTier):
    """The local tier, its options typed as a plugin author would: paths as ``pathlib.Path``."""

    kind = "pathlocal"
    Options = PathOptions


def test_an_options_field_typed_path_loads_from_yaml(tmp_path):
    options = build_dataclass(PathOptions, {"path": str(tmp_path), "scratch": "~/x"}, "tiers[0]", "tiers.yaml")
    assert options.path == tmp_path and options.scratch == Path("~/x")
    with pytest.raises(ConfigError, match=r"tiers\.yaml: tiers\[0\]\.path: expected a path, got 3"):
        build_dataclass(PathOptions, {"path": 3}, "tiers[0]", "tiers.yaml")


def test_an_unsupported_options_field_type_names_the_field():
    @dataclass(frozen=True)
    class DeviceOptions:
        device: torch.device = torch.device("cpu")

    with pytest.raises(PluginError, match=r"DeviceOptions\.device: annotation .*cannot be read from a "
                                          r"configuration file \(supported: str, bool, int, float, pathlib\.Path"):
        build_dataclass(DeviceOptions, {})


class TestPathOptionsTier(TierContract):
    """The contract suite, its YAML test included, over a tier whose options hold a pathlib.Path."""

    @pytest.fixture
    def tier(self, tmp_path, tier_context):
        tier = PathLocalTier("pathlocal", PathOptions(path=tmp_path / "root"), tier_context)
        yield tier
        tier.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_errors_of_a_tier_being_built_name_the_file_and_tiers_i(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(f"run_id: {run_id()}\ndrain: {{mode: thread}}\n"
                    f"tiers: [{{name: hbm, kind: gpu, enabled: true}}, "
                    f"{{name: disk, kind: local, path: {tmp_path / 'disk'}}}]\n")
    with pytest.raises(ConfigError, match=r"tiers\.yaml: tiers\[0\]\.enabled: enabled is true but the device cannot "
                                          r"be used: .*\(tier 'hbm'\)$"):
        CheckpointEngine(str(path))


def test_ctrl_c_does_not_kill_the_drain_worker_mid_write(tmp_path, shm_root):
    """Ctrl-C reaches the terminal's whole process group: the drain worker ignores it (no traceback, no torn
    write); the training process decides what happens, and its close() still drains."""
    import signal

    from tiered_ckpt.worker import ProcessDrain

    cfg = {"run_id": run_id(), "tiers": [{"name": "host", "kind": "shm", "path": shm_root},
                                         {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:  # the default drain: a worker process
        engine.save(1, {"model": {"w": torch.ones(4)}}).wait(timeout=120)
        drain = engine._drain
        drain = drain if isinstance(drain, ProcessDrain) else next(
            v for v in vars(drain).values() if isinstance(v, ProcessDrain))
        deadline = time.monotonic() + 120
        while (drain._proc is None or not drain._proc.is_alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc = drain._proc
        assert proc is not None and proc.is_alive()
        os.kill(proc.pid, signal.SIGINT)
        engine.save(2, {"model": {"w": torch.ones(4)}}).wait(timeout=120)
        assert proc.is_alive()
        assert engine.available_steps()["disk"] == [1, 2]


def test_drain_progress_is_visible(tmp_path, shm_root, capsys):
    """engine.pending() says which tiers still owe which step; wait(progress=True) shows it as a bar."""
    cfg = {"run_id": run_id(), "drain": {"mode": "thread"},
           "tiers": [{"name": "host", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, {"model": {"w": torch.ones(1 << 20)}})
        engine.save(2, {"model": {"w": torch.ones(1 << 20)}})
        assert set(engine.pending()) <= {1, 2} and all(t == ["disk"] for t in engine.pending().values())
        engine.wait(timeout=120, progress=True)
        assert engine.pending() == {}
    assert "rank 0 drain" in capsys.readouterr().err


@pytest.mark.parametrize("keeps, warned", [((1,), True), ((1, 1), True), ((2,), False), ((1, None), False)])
def test_keeping_only_the_newest_step_everywhere_is_warned_about(tmp_path, caplog, keeps, warned):
    """With keep: 1 on every file tier a damaged newest step leaves load() nothing to fall back to (sparse
    retention plus a corrupt latest step cost a user thousands of steps): the engine says so when it starts."""
    tiers = [{"name": f"t{i}", "kind": "local", "path": str(tmp_path / f"t{i}"), "keep": k}
             for i, k in enumerate(keeps)]
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        with CheckpointEngine({"run_id": f"k{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
                               "tiers": tiers}):
            pass
    said = [r.getMessage() for r in caplog.records if "keeps only its newest step" in r.getMessage()]
    assert bool(said) == warned, said


_SAVE_AND_RETURN = """
import json, sys, torch
from tiered_ckpt import CheckpointEngine
engine = CheckpointEngine(json.loads(sys.argv[1]))
for step in (1, 2):
    engine.save(step, {"m": {"w": torch.full((50_000,), float(step))}})
print("returning", flush=True)  # no wait(), no close(): the script just ends, as a short training job does
"""


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_script_that_saves_and_returns_without_close_still_gets_its_saves_to_disk(tmp_path, shm_root, mode):
    """Trial (a short Megatron job through the drop-in): the exit hook closed the engine after concurrent.futures
    had stopped the thread pools, and every save still draining failed with "cannot schedule new futures after
    interpreter shutdown": the job's last checkpoint never reached the disk."""
    import json

    cfg = {"run_id": run_id(), "drain": {"mode": mode},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    proc = subprocess.run([sys.executable, "-c", _SAVE_AND_RETURN, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and "returning" in proc.stdout, proc.stderr
    assert "could not take step" not in proc.stderr, proc.stderr
    disk_only = {**cfg, "run_id": run_id(), "tiers": cfg["tiers"][1:]}
    with CheckpointEngine(disk_only) as engine:
        assert engine.available_steps()["disk"] == [1, 2]
        loaded = engine.load()
    assert loaded.step == 2 and loaded.tier == "disk"
    assert torch.equal(loaded.items["m"]["w"], torch.full((50_000,), 2.0))
