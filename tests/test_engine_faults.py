"""The engine when storage misbehaves: retries, permanent failures, a training process killed mid-drain."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
from helpers import assert_same, make_items

from tiered_ckpt import CheckpointEngine, SaveError
from tiered_ckpt.errors import CheckpointUnreadableError
from tiered_ckpt.housekeeping import run_state

FAST_RETRY = {"attempts": 6, "initial_s": 0.01, "max_s": 0.05, "deadline_s": 30}


def _config(shm_root, tmp_path, *extra: dict, run_id: str | None = None) -> dict:
    return {
        "run_id": run_id or f"f{uuid.uuid4().hex[:8]}",
        "drain": {"mode": "thread"},
        "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                  {"name": "local", "kind": "local", "path": str(tmp_path / "local")}, *extra],
    }


def _faulty(name: str, path, **faults) -> dict:
    return {"name": name, "kind": "faulty", "inner": {"kind": "local", "path": str(path)}, "retry": FAST_RETRY,
            **faults}


def test_transient_failures_are_retried_then_committed(shm_root, tmp_path, recorder):
    flaky = _faulty("flaky", tmp_path / "flaky", transient_errors=3)
    with CheckpointEngine(_config(shm_root, tmp_path, flaky)) as engine:
        handle = engine.save(1, make_items(1))
        handle.wait(timeout=60)
        assert handle.results == {"local": True, "flaky": True}
        retries = recorder.kinds("retry", "flaky")
        assert len(retries) == 3
        assert all("attempt" in e.message for e in retries)
        assert_same(make_items(1), engine._load_from("flaky", 1, True, None)[0])


def test_permanent_failure_spares_the_other_tiers(shm_root, tmp_path, recorder):
    broken = _faulty("broken", tmp_path / "broken", permanent_error=True)
    with CheckpointEngine(_config(shm_root, tmp_path, broken)) as engine:
        handle = engine.save(1, make_items(1))
        with pytest.raises(SaveError) as info:
            handle.wait(timeout=60)
        assert list(info.value.failures) == ["broken"]
        assert handle.results == {"local": True, "broken": False}
        assert not recorder.kinds("retry", "broken")  # permanent: not retried
        assert recorder.kinds("commit_failed", "broken")
        assert engine.available_steps() == {"shm": [1], "local": [1], "broken": []}
        # Training goes on: the next save is unaffected and lands on the healthy tiers.
        second = engine.save(2, make_items(2))
        with pytest.raises(SaveError):
            second.wait(timeout=60)
        second.wait(tier="local", timeout=60)
        assert engine.load().step == 2


def test_deadline_bounds_the_retries(shm_root, tmp_path, recorder):
    slow = _faulty("slow", tmp_path / "slow", transient_errors=1000,
                   retry={"attempts": 1000, "initial_s": 0.01, "max_s": 0.02, "deadline_s": 0.3})
    with CheckpointEngine(_config(shm_root, tmp_path, slow)) as engine:
        handle = engine.save(1, make_items(1))
        with pytest.raises(SaveError, match="slow"):
            handle.wait(timeout=60)
        assert 1 <= len(recorder.kinds("retry", "slow")) < 1000


def test_zstd_tier_round_trip_and_transcoding(shm_root, tmp_path):
    packed = {"name": "packed", "kind": "local", "path": str(tmp_path / "packed"),
              "compression": {"codec": "zstd", "level": 3}}
    plain_after = {"name": "plain", "kind": "local", "path": str(tmp_path / "plain")}
    cfg = _config(shm_root, tmp_path, packed, plain_after)
    cfg["tiers"] = [cfg["tiers"][0], packed, plain_after]  # shm -> zstd tier -> plain tier copies from it
    with CheckpointEngine(cfg) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
        packed_m = engine.pipeline.stores["packed"].read_manifest(1)
        plain_m = engine.pipeline.stores["plain"].read_manifest(1)
        (pf,), (qf,) = packed_m.files, plain_m.files
        assert pf.compression == "zstd" and pf.size < pf.raw_size
        assert qf.compression is None and qf.size == pf.raw_size
        for name in ("packed", "plain"):
            assert_same(make_items(1), engine._load_from(name, 1, True, None)[0])


KILLED_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {tests!r})
    from helpers import make_items
    from tiered_ckpt import CheckpointEngine
    cfg = json.loads({cfg!r})
    engine = CheckpointEngine(cfg)
    engine.save(3, make_items(3))
    print("SAVED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_killed_after_save_recovers_from_shm_and_drains(shm_root, tmp_path, recorder):
    run_id = f"k{uuid.uuid4().hex[:8]}"
    # The killed process drains to a tier slow enough that it never gets there.
    slow_local = _faulty("local", tmp_path / "local", latency_s=60)
    cfg = _config(shm_root, tmp_path, run_id=run_id)
    cfg["tiers"][1] = slow_local
    script = KILLED_SCRIPT.format(tests=os.path.dirname(__file__), cfg=json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "SAVED" in proc.stdout
    assert not (tmp_path / "local" / "iter_0000003").exists()

    with CheckpointEngine(_config(shm_root, tmp_path, run_id=run_id)) as engine:
        assert [h.step for h in engine.recovered] == [3]
        assert recorder.kinds("recover")
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (3, "shm")
        assert_same(make_items(3), loaded.items)
        engine.recovered[0].wait(timeout=60)
        assert engine.available_steps()["local"] == [3]
        assert_same(make_items(3), engine._load_from("local", 3, True, None)[0])


def test_a_restart_drains_memory_snapshots_only_to_the_tiers_their_save_was_due_on(shm_root, tmp_path):
    """``every`` holds across a restart: the snapshots a closed engine kept in shared memory go to the tiers their
    save was due on and lacks, not to a tier whose ``every`` skipped them (a large upload per restart)."""
    run_id = f"e{uuid.uuid4().hex[:8]}"
    sparse = {"name": "sparse", "kind": "local", "path": str(tmp_path / "sparse"), "every": 10}
    with CheckpointEngine(_config(shm_root, tmp_path, sparse, run_id=run_id)) as engine:
        for step in range(1, 12):  # saves 1 and 11 are due on `sparse`
            engine.save(step, make_items(step))
        engine.wait()
        assert engine.available_steps()["sparse"] == [1, 11]
    # The slots of steps 10 and 11 stay in shm (on_close: keep). `sparse` loses step 11, as if its drain had
    # never finished: a restart owes it that step, and only that one.
    shutil.rmtree(tmp_path / "sparse" / "iter_0000011")
    with CheckpointEngine(_config(shm_root, tmp_path, sparse, run_id=run_id)) as engine:
        assert {h.step: h.due for h in engine.recovered} == {11: ("sparse",)}
        engine.recovered[0].wait(timeout=60)
        assert engine.available_steps()["sparse"] == [1, 11]  # not step 10, which its `every` skipped
        assert_same(make_items(11), engine._load_from("sparse", 11, True, None)[0])


def test_a_stalled_tier_does_not_hold_the_recovery_at_start_up(shm_root, tmp_path, recorder):
    """The killed process left step 3 in shm only; at the restart the file tier's listing stalls (5 s here):
    the engine is built after load.list_timeout_s, leaves step 3 in memory for a later start (tier_unreachable
    names the setting) and loads it from shm (before: construction waited for the listing, however long)."""
    run_id = f"k{uuid.uuid4().hex[:8]}"
    cfg = _config(shm_root, tmp_path, run_id=run_id)
    cfg["tiers"][1] = _faulty("local", tmp_path / "local", latency_s=60)  # the killed process never gets there
    script = KILLED_SCRIPT.format(tests=os.path.dirname(__file__), cfg=json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    stalled = {**_config(shm_root, tmp_path, run_id=run_id), "load": {"list_timeout_s": 0.3}}
    stalled["tiers"][1] = _faulty("local", tmp_path / "local", latency_s=5, ops=["list"])
    with CheckpointEngine(stalled) as engine:
        assert engine.recovered == []
        (event,) = recorder.kinds("tier_unreachable", "local")
        assert "load.list_timeout_s" in event.message
        loaded = engine.load()  # a new listing, waited for RELIST_AFTER_STALL_S only (the limit is shorter here)
        assert (loaded.step, loaded.tier) == (3, "shm")
        assert_same(make_items(3), loaded.items)
        assert "local" in engine._stalled_at_start and "local" in loaded.unreachable


def test_a_tier_stalled_at_start_up_is_waited_for_briefly_then_listed_again(shm_root, tmp_path, monkeypatch):
    """The start-up's listing of a tier did not answer within load.list_timeout_s: load() lists it again but
    waits RELIST_AFTER_STALL_S for it, not the whole limit a second time (a restart with the store down waited
    twice list_timeout_s); a store that is back answers that listing, and is used."""
    import tiered_ckpt.engine as engine_module

    path, run_id = _step_1_saved_on(shm_root, tmp_path, "remote")
    cfg = {"run_id": run_id, "drain": {"mode": "thread"}, "load": {"list_timeout_s": 1},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, _faulty("remote", path, latency_s=60,
                                                                              ops=["list"])]}
    monkeypatch.setattr(engine_module, "RELIST_AFTER_STALL_S", 0.2)
    with CheckpointEngine(cfg) as engine:
        assert "remote" in engine._stalled_at_start  # its start-up listing did not answer
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (1, "shm")
        assert "at the engine's start, nor within 0.2 s now" in loaded.unreachable["remote"]
    with CheckpointEngine(cfg) as engine:
        assert "remote" in engine._stalled_at_start
        store = engine.pipeline.stores["remote"]
        monkeypatch.setattr(store, "loadable_steps", lambda coords: [1])  # the store is back
        assert engine.available_steps()["remote"] == [1] and "remote" not in engine._stalled_at_start


def test_process_drain_from_a_script_without_main_guard(tmp_path, shm_root):
    """spawn re-imports __main__: a training script without `if __name__ == "__main__"` must still work."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from tiered_ckpt import CheckpointEngine
        cfg = {{"run_id": "noguard-{uuid.uuid4().hex[:6]}", "drain": {{"mode": "process"}},
               "tiers": [{{"name": "shm", "kind": "shm", "path": {str(shm_root)!r}}},
                         {{"name": "local", "kind": "local", "path": {str(tmp_path / "local")!r}}}]}}
        with CheckpointEngine(cfg) as engine:
            engine.save(1, {{"state": {{"w": torch.ones(4)}}}}).wait(timeout=120)
        print("DONE")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.count("DONE") == 1, proc.stderr[-3000:]
    assert (tmp_path / "local" / "iter_0000001" / "tiered_ckpt" / "manifest.json").exists()


def _step_1_saved_on(shm_root, tmp_path, name: str) -> tuple:
    """Step 1 saved (shm, local and a fault-free faulty tier ``name``): that tier's path and the run_id, for an
    engine that reopens it with faults."""
    path = tmp_path / name
    run_id = f"f{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(_config(shm_root, tmp_path, _faulty(name, path), run_id=run_id)) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)
    return path, run_id


@pytest.mark.parametrize("ops", [["list"], ["read_blob"]])
def test_transient_errors_while_listing_steps_are_retried(shm_root, tmp_path, recorder, ops):
    """A throttled listing or manifest read must not hide a tier's steps from this rank (it would resume older)."""
    path, run_id = _step_1_saved_on(shm_root, tmp_path, "flaky")
    only_flaky = {"run_id": run_id, "drain": {"mode": "thread"},
                  "tiers": [_faulty("flaky", path, transient_errors=2, ops=ops)]}
    with CheckpointEngine(only_flaky) as engine:
        assert engine.available_steps()["flaky"] == [1]
        assert len(recorder.kinds("retry", "flaky")) == 2
        assert_same(make_items(1), engine.load().items)


def test_a_tier_whose_listing_does_not_answer_in_time_is_left_out_of_load(shm_root, tmp_path, recorder):
    """load.list_timeout_s: a stalled store (each listing held 3 s here) does not hold a restart for its timeouts
    times its retries. load() takes the newest step the other tiers hold, and result.unreachable and a
    tier_unreachable event name the stalled tier and the setting (before: it waited, and listed it)."""
    path, run_id = _step_1_saved_on(shm_root, tmp_path, "remote")
    stalled = {"run_id": run_id, "drain": {"mode": "thread"}, "load": {"list_timeout_s": 0.2},
               "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local")},
                         _faulty("remote", path, latency_s=3, ops=["list"])]}
    with CheckpointEngine(stalled) as engine:
        result = engine.load()
        assert (result.step, result.tier) == (1, "local")
        assert_same(make_items(1), result.items)
        assert list(result.unreachable) == ["remote"]
        assert "load.list_timeout_s" in result.unreachable["remote"]
        assert [e.tier for e in recorder.kinds("tier_unreachable")] == ["remote"]
    patient = {**stalled, "load": {"list_timeout_s": None}}
    with CheckpointEngine(patient) as engine:  # no limit: the slow listing is waited for
        result = engine.load()
        assert result.step == 1 and result.unreachable == {}


def test_a_stalled_only_tier_is_waited_for_once_per_load_and_listed_once_at_a_time(shm_root, tmp_path, recorder):
    """The stalled tier is the only one: load() raises TierUnavailableError (never NoCheckpointError) after one
    list_timeout_s, not once more for its relist; and the next call waits for the listing still in flight
    instead of starting a second one beside it."""
    from tiered_ckpt import NoCheckpointError, TierUnavailableError

    path, run_id = _step_1_saved_on(shm_root, tmp_path, "remote")
    only = {"run_id": run_id, "drain": {"mode": "thread"}, "load": {"list_timeout_s": 0.3},
            "tiers": [_faulty("remote", path, latency_s=5, ops=["list"])]}
    with CheckpointEngine(only) as engine:
        with pytest.raises(TierUnavailableError, match="load.list_timeout_s") as info:
            engine.load()
        assert not isinstance(info.value, NoCheckpointError)
        assert [e.tier for e in recorder.kinds("tier_unreachable")] == ["remote"]  # its relist left it out
        listing = engine._listings["remote"]
        assert engine.unreachable_tiers().keys() == {"remote"}
        assert engine._listings["remote"] is listing  # waited on the listing in flight: no second one beside it
        assert listing.done.wait(10) and listing.steps == [1]  # it finished in the background


def test_list_timeout_must_be_positive(shm_root):
    from tiered_ckpt.errors import ConfigError

    cfg = {"run_id": "x", "load": {"list_timeout_s": 0}, "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}]}
    with pytest.raises(ConfigError, match="list_timeout_s: expected a positive duration or null"):
        CheckpointEngine(cfg)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_slow_tier_below_holds_steps_above_only_until_it_has_them(shm_root, tmp_path, mode, recorder):
    """A tier below slower than the saves: the local tier (keep: 1) keeps each step until the slow tier has
    copied it from there, and no longer. Its retention ran only at its own commits, so once the slow tier caught
    up every step it had needed stayed on the local disk for good (29 of 30 in a user's run)."""
    slow = _faulty("remote", tmp_path / "remote", latency_s=0.2, ops=["write_blob"])
    cfg = _config(shm_root, tmp_path, slow)
    cfg["drain"]["mode"] = mode
    cfg["tiers"][1]["keep"] = 1
    cfg["tiers"][1]["fsync"] = False  # the local tier frees the slots; a loaded disk's fsyncs could let the slow
    # tier keep up with the saves (nothing to warn about)
    with CheckpointEngine(cfg) as engine:
        for step in range(1, 7):
            engine.save(step, make_items(step))
        engine.wait(timeout=120)
        assert engine.available_steps()["local"] == [6]
        assert engine.available_steps()["remote"] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("iter_")) == ["iter_0000006"]
    behind = recorder.kinds("tier_behind")  # the user is told that saves outpace the tier
    assert behind and {e.tier for e in behind} == {"remote"} and behind[0].detail["steps"] == 4, behind


def _recovery_that_fails(shm_root, tmp_path) -> dict:
    """A closed engine's snapshot of step 3 kept in shared memory, which the local tier lost; a file stands where
    the step's directory goes, so the next engine's recovery of it there fails."""
    cfg = _config(shm_root, tmp_path)
    with CheckpointEngine(cfg) as engine:
        engine.save(3, make_items(3)).wait(timeout=60)
    shutil.rmtree(tmp_path / "local" / "iter_0000003")
    (tmp_path / "local" / "iter_0000003").write_text("in the way")
    return cfg


def test_a_failed_recovery_is_reported_as_the_earlier_process_s_snapshot(shm_root, tmp_path):
    with CheckpointEngine(_recovery_that_fails(shm_root, tmp_path)) as engine:
        [recovered] = engine.recovered
        with pytest.raises(SaveError):
            recovered.wait(timeout=60)
        with pytest.raises(SaveError, match="step 3 on tier 'local'.*an earlier process left in shared memory"):
            engine.wait(timeout=60)


def test_a_failed_recovery_superseded_by_a_new_save_of_its_step_is_no_failure(shm_root, tmp_path):
    """A restart resumes below a snapshot it could not drain and saves that step again: once the tier commits the
    new save, engine.wait() does not report the step as missing from it (found on 2 ranks, where rank 0's
    recovery of a step the dead rank never saved timed out and its new save of the step committed)."""
    with CheckpointEngine(_recovery_that_fails(shm_root, tmp_path)) as engine:
        [recovered] = engine.recovered
        with pytest.raises(SaveError):
            recovered.wait(timeout=60)
        (tmp_path / "local" / "iter_0000003").unlink()
        engine.save(3, make_items(3)).wait(timeout=60)
        engine.wait(timeout=60)  # no SavesFailedError: the tier holds step 3, from this process's save
        assert engine.available_steps()["local"] == [3]


def test_a_failed_save_of_this_process_is_not_cleared_by_a_later_one(shm_root, tmp_path):
    """The recovery failed, then this process's own save of the step failed too, then a third save committed:
    only the recovery's failure is superseded; the process's own failure stays reported (found by a review)."""
    with CheckpointEngine(_recovery_that_fails(shm_root, tmp_path)) as engine:
        [recovered] = engine.recovered
        with pytest.raises(SaveError):
            recovered.wait(timeout=60)
        with pytest.raises(SaveError):  # the file is still in the way
            engine.save(3, make_items(3)).wait(timeout=60)
        (tmp_path / "local" / "iter_0000003").unlink()
        engine.save(3, make_items(3)).wait(timeout=60)
        with pytest.raises(SaveError, match="step 3 on tier 'local'") as info:
            engine.wait(timeout=60)
        assert "earlier process" not in str(info.value)


def test_an_engine_whose_drain_cannot_start_lets_its_lock_go(shm_root, tmp_path, monkeypatch):
    """Spawning the drain worker fails (EAGAIN under a pids limit): the constructor raises, and the next engine of
    the run, in this process, starts. It was refused with RunLockedError naming this very process: the failed
    engine's lock stayed held for the life of the process."""
    from tiered_ckpt import worker as worker_module

    cfg = {"run_id": f"fb-{uuid.uuid4().hex[:8]}",
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}

    def failing_start(self):
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    with monkeypatch.context() as m:
        m.setattr(worker_module.ProcessDrain, "_start", failing_start)
        with pytest.raises(BlockingIOError):
            CheckpointEngine(cfg)
    assert run_state(cfg["run_id"], shm_root) == "closed"
    with CheckpointEngine(cfg) as engine:
        engine.save(1, make_items(1)).wait(timeout=60)


def test_a_close_that_waits_for_drains_says_what_for_and_how_long(shm_root, tmp_path, monkeypatch, caplog):
    """A user's trial: Ctrl-C in a training script whose last save drained to a slow tier sat silent for up to
    close_timeout_s (600 s) while its engine closed at exit. Past a few seconds close() names the step, the tier,
    how long it may wait and what interrupting it means."""
    import logging

    from tiered_ckpt import engine as engine_module

    monkeypatch.setattr(engine_module, "CLOSE_NOTICE_S", 0.2)
    cfg = _config(shm_root, tmp_path)
    cfg["tiers"][1] = _faulty("local", tmp_path / "local", latency_s=0.5)
    engine = CheckpointEngine(cfg)
    engine.save(7, make_items(7))
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.engine"):
        engine.close(timeout=30)
    said = [r.getMessage() for r in caplog.records if "close() waits" in r.getMessage()]
    assert len(said) == 1 and "step 7 to 'local'" in said[0] and "close_timeout_s: 30 s" in said[0], said
    assert "stays in shared memory" in said[0] and cfg["run_id"] in said[0]
    caplog.clear()
    quick = CheckpointEngine(_config(shm_root, tmp_path))  # a close with nothing to wait for says nothing
    quick.save(8, make_items(8)).wait(timeout=60)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.engine"):
        quick.close()
    assert not [r for r in caplog.records if "close() waits" in r.getMessage()]


def test_a_damaged_manifest_is_warned_of_once_per_load(shm_root, tmp_path, caplog):
    """A user's trial: load() printed "tier 'disk' lists step 2 as committed, but ..." twice (it lists twice)."""
    import logging

    cfg = {"run_id": f"w{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            engine.save(step, make_items(step)).wait(timeout=60)
    (tmp_path / "disk" / "iter_0000002" / "tiered_ckpt" / "manifest.json").write_text("{ not json")
    (tmp_path / "disk" / "iter_0000001" / "rank_00000" / "state.flat").write_bytes(b"cut short")
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        with pytest.raises(CheckpointUnreadableError):  # every step tried: load() lists again before saying so
            engine.load()
    said = [r.getMessage() for r in caplog.records if "lists step 2 as committed" in r.getMessage()]
    assert len(said) == 1, said


def test_a_resume_from_memory_only_with_empty_file_tiers_says_it_is_one(shm_root, tmp_path, caplog):
    """A Megatron user's trial: the checkpoint directory emptied to start over, the job launched again with the
    same run_id resumed from its shared-memory snapshot without a word (Megatron starts at iteration 0 there)."""
    import logging

    cfg = _config(shm_root, tmp_path)
    with CheckpointEngine(cfg) as engine:
        engine.save(8, make_items(8)).wait(timeout=60)
    shutil.rmtree(tmp_path / "local")
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        loaded = engine.load()
        assert (loaded.step, loaded.tier) == (8, "shm")
    said = [r.getMessage() for r in caplog.records if "was only in memory" in r.getMessage()]
    assert said and "does not start over" in said[0] and cfg["run_id"] in said[0], said
    caplog.clear()
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        engine.save(9, make_items(9)).wait(timeout=60)
        assert engine.load().step == 9  # the file tier holds a step again: nothing to say
    assert not [r for r in caplog.records if "was only in memory" in r.getMessage()]


def test_the_only_tier_unreachable_is_not_advised_away(shm_root, tmp_path):
    """An S3 user's trial: with S3 the only tier, and down, the error spoke of "the other tiers" and advised
    `enabled: false` on it, which leaves no tier at all."""
    from tiered_ckpt.errors import TierUnavailableError

    path, run_id = _step_1_saved_on(shm_root, tmp_path, "remote")
    alone = {"run_id": run_id, "drain": {"mode": "thread"},
             "tiers": [_faulty("remote", path, permanent_error=True, ops=["list"])]}
    with CheckpointEngine(alone) as engine, pytest.raises(TierUnavailableError) as err:
        engine.load()
    assert "No other tier to look at" in str(err.value) and "enabled: false" not in str(err.value)
    both = {**alone, "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "empty")}, *alone["tiers"]]}
    with CheckpointEngine(both) as engine, pytest.raises(TierUnavailableError) as err:
        engine.load()
    assert "Nothing loadable on the other tiers" in str(err.value) and "enabled: false" in str(err.value)


def test_close_says_as_an_error_what_failed_and_no_wait_reported(shm_root, tmp_path, caplog):
    """A Megatron user's trial: every save failed on the disk tier, each a warning among many, and close() at the
    job's end said nothing. Saves that failed since the last engine.wait() are said again, as an error; the steps
    that reached no durable tier are kept for the caller to take (the Megatron drop-in raises on them)."""
    import logging

    broken = _faulty("broken", tmp_path / "broken", permanent_error=True, retry={"attempts": 1})
    cfg = _config(shm_root, tmp_path, broken)
    engine = CheckpointEngine({**cfg, "tiers": [cfg["tiers"][0], broken]})  # shm, and a tier that fails
    engine.save(1, make_items(1))
    engine.save(2, make_items(2))
    engine._drain.wait_idle(60)
    lost = engine.take_not_durable()
    assert sorted(lost) == [1, 2] and set(lost[1]) == {"broken"} and engine.take_not_durable() == {}
    with caplog.at_level(logging.ERROR, logger="tiered_ckpt"):
        engine.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and said[0].startswith("close(): 2 save(s) failed on a tier since the last engine.wait()")
    with CheckpointEngine({**cfg, "run_id": f"{cfg['run_id']}-2"}) as engine:  # the local tier took it: durable
        engine.save(3, make_items(3))
        engine._drain.wait_idle(60)
        assert engine.take_not_durable() == {}
        with pytest.raises(SaveError):
            engine.wait()
