"""Saving again a step a tier already holds committed (a job saving the step it resumed at, a script re-run with
the same directory): the tier never vouches for files being replaced, and a crash part-way leaves the previous
step loadable and the tracker pointing at it (found by a new-user trial: the committed step was destroyed while
``ls`` still called it committed)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import cli

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import EXIT_OK

MIB = 1 << 20


def config(tmp_path: Path, keep: int = 2, tiers: tuple[str, ...] = ("local",), shm_root: str | None = None) -> dict:
    every = {"shm": {"name": "shm", "kind": "shm", "path": shm_root},
             "local": {"name": "local", "kind": "local", "path": str(tmp_path / "ckpt"), "keep": keep, "fsync": False}}
    return {"run_id": "resave", "drain": {"mode": "thread"}, "tiers": [every[t] for t in tiers]}


def state(value: float) -> dict:
    return {"model": {"w": torch.full((MIB // 4,), value)}, "extra": {"v": torch.full((1000,), value)}}


def save_in_a_process(tmp_path: Path, cfg: dict, steps: dict[int, float], crash_at: str | None = None) -> int:
    """Save ``steps`` (step → value) in a new process, each waited for; its exit code (-9 after a crash point)."""
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    script = textwrap.dedent(f"""
        import json, torch
        from tiered_ckpt import CheckpointEngine
        with CheckpointEngine(json.load(open({str(tmp_path / 'cfg.json')!r}))) as e:
            for step, value in {steps!r}.items():
                e.save(step, {{"model": {{"w": torch.full(({MIB // 4},), value)}},
                               "extra": {{"v": torch.full((1000,), value)}}}}).wait()
    """)
    env = {**os.environ, **({"TIERED_CKPT_CRASH_AT": crash_at} if crash_at else {})}
    return subprocess.run([sys.executable, "-c", script], env=env, timeout=300).returncode


def states_on_disk(tmp_path: Path) -> dict[int, str]:
    code, out = cli("ls", str(tmp_path / "ckpt"), "--json")
    assert code == EXIT_OK, out
    return {r["step"]: r["state"] for r in json.loads(out)}


def tracker(tmp_path: Path) -> str | None:
    path = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.exists() else None


@pytest.mark.parametrize("point", ["store.files_written:1", "files.temp_written:2", "store.rank_manifest_written:1"])
def test_a_crashed_save_of_a_committed_step_leaves_the_step_before_it_loadable(tmp_path, point):
    cfg = config(tmp_path)
    assert save_in_a_process(tmp_path, cfg, {4: 4.0, 5: 5.0}) == 0
    assert states_on_disk(tmp_path) == {4: "committed", 5: "committed"} and tracker(tmp_path) == "5"
    assert save_in_a_process(tmp_path, cfg, {5: 55.0}, crash_at=point) == -9
    found = states_on_disk(tmp_path)
    assert found[4] == "committed" and found.get(5) != "committed", found  # never "committed" over mixed files
    assert tracker(tmp_path) == "4"  # Megatron-LM, which reads the tracker alone, is sent to the intact step
    code, out = cli("verify", str(tmp_path / "ckpt"), "--all")
    assert code == EXIT_OK, out
    with CheckpointEngine(cfg) as engine:
        got = engine.load()
        assert got.step == 4 and torch.equal(got.items["model"]["w"], state(4.0)["model"]["w"])
        engine.save(5, state(56.0)).wait()  # and the job saves it again, to the end this time
    with CheckpointEngine(cfg) as engine:
        got = engine.load()
        assert got.step == 5 and got.verified and torch.equal(got.items["extra"]["v"], state(56.0)["extra"]["v"])
    assert tracker(tmp_path) == "5"


def test_saving_a_committed_step_again_replaces_it_and_says_so(tmp_path, caplog):
    cfg = config(tmp_path, keep=1)
    with CheckpointEngine(cfg) as engine:
        engine.save(7, state(7.0)).wait()
        with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
            engine.save(7, state(70.0)).wait()  # the same process, the same step: un-committed, then committed
        assert "step 7 is committed here and is being saved again: it is un-committed" in caplog.text
        engine.save(7, state(700.0)).wait()
    # Another run_id saving it again (two jobs started together, within the clock margin, are not refused): the
    # warning names both runs (an S3 user's trial: it said nothing of the other job).
    caplog.clear()
    with CheckpointEngine({**cfg, "run_id": "another"}) as engine, caplog.at_level(logging.WARNING, "tiered_ckpt"):
        engine.save(7, state(700.0)).wait()
    assert f"committed by run {cfg['run_id']!r}, this engine's run is 'another'" in caplog.text
    cfg = {**cfg, "run_id": "another"}
    with CheckpointEngine(cfg) as engine:
        got = engine.load()
        assert got.step == 7 and got.verified and torch.equal(got.items["model"]["w"], state(700.0)["model"]["w"])
    assert states_on_disk(tmp_path) == {7: "committed"}
    code, out = cli("verify", str(tmp_path / "ckpt"), "--all")
    assert code == EXIT_OK, out


def files_of_step(root: Path, step: int) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / f"iter_{step:07d}").rglob("*") if p.is_file()}


@pytest.mark.parametrize("tiers", [("local",), ("shm", "local")], ids=["from-memory", "copied-from-a-tier-above"])
def test_a_step_saved_again_without_an_item_keeps_no_file_of_it(tmp_path, shm_root, tiers):
    """The earlier save's file of an item the new save no longer has (renamed, dropped) would stay in the committed
    step with no manifest listing it: nothing would ever remove it (found as a leftover in a review). The second
    local tier is written by copying from the first, the other way a rank writes its files."""
    cfg = config(tmp_path, tiers=tiers, shm_root=shm_root)
    if len(tiers) == 2:
        cfg["tiers"].insert(1, {"name": "near", "kind": "local", "path": str(tmp_path / "near"), "fsync": False})
    with CheckpointEngine(cfg) as engine:
        engine.save(7, state(7.0)).wait()
    first = files_of_step(tmp_path / "ckpt", 7)
    assert any("extra" in f for f in first), first
    renamed = {"model": state(8.0)["model"], "more": {"v": torch.full((1000,), 8.0)}}
    with CheckpointEngine(cfg) as engine:
        engine.save(7, renamed).wait()
    again = files_of_step(tmp_path / "ckpt", 7)
    assert not any("extra" in f for f in again), again  # the dropped item's file went with its manifest entry
    assert any("more" in f for f in again), again
    code, out = cli("verify", str(tmp_path / "ckpt"), "--all")
    assert code == EXIT_OK, out
    with CheckpointEngine(config(tmp_path)) as engine:
        got = engine.load()
        assert got.step == 7 and set(got.items) == {"model", "more"}
        assert torch.equal(got.items["more"]["v"], renamed["more"]["v"])


def test_a_crashed_save_again_of_the_only_step_is_recovered_from_shared_memory(tmp_path, shm_root):
    """keep: 1 and the step saved again: the disk holds nothing committed after the crash, but never mixed files
    as committed; the new snapshot in shared memory is what the restart loads and drains."""
    cfg = config(tmp_path, keep=1, tiers=("shm", "local"), shm_root=shm_root)
    assert save_in_a_process(tmp_path, cfg, {3: 3.0}) == 0
    assert save_in_a_process(tmp_path, cfg, {3: 33.0}, crash_at="store.files_written:1") == -9
    assert states_on_disk(tmp_path).get(3) != "committed"
    with CheckpointEngine(cfg) as engine:
        got = engine.load()
        assert got.step == 3 and torch.equal(got.items["model"]["w"], state(33.0)["model"]["w"])
        engine.wait()
    assert states_on_disk(tmp_path) == {3: "committed"}
    with CheckpointEngine(config(tmp_path, keep=1)) as engine:  # the disk alone
        got = engine.load()
        assert got.step == 3 and got.verified and torch.equal(got.items["model"]["w"], state(33.0)["model"]["w"])


def test_a_crashed_dcp_save_again_does_not_leave_the_old_metadata_as_a_plain_dcp_step(tmp_path):
    """Un-committing removes what the commit derived too: DCP's ``.metadata`` left beside the new data file made
    the step pass for a plain DCP checkpoint, loaded unverified through the old metadata (found in review)."""
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.dcp import TieredStorageReader

    cfg = {**config(tmp_path, keep=3), "layout": "dcp"}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))

    def save(step: int, value: float, crash_at: str | None = None) -> int:
        script = textwrap.dedent(f"""
            import json, torch, torch.distributed.checkpoint as dcp
            from tiered_ckpt import CheckpointEngine
            from tiered_ckpt.dcp import TieredStorageWriter
            with CheckpointEngine(json.load(open({str(tmp_path / 'cfg.json')!r}))) as e:
                w = TieredStorageWriter(e)
                dcp.save({{"model": {{"w": torch.full((8, 8), {value})}}}}, storage_writer=w, checkpoint_id={step})
                w.wait(timeout=60)
        """)
        env = {**os.environ, **({"TIERED_CKPT_CRASH_AT": crash_at} if crash_at else {})}
        return subprocess.run([sys.executable, "-c", script], env=env, timeout=300).returncode

    assert save(4, 4.0) == 0 and save(5, 5.0) == 0
    assert save(5, 55.0, "store.files_written:1") == -9
    assert not (tmp_path / "ckpt" / "iter_0000005" / ".metadata").exists()
    with CheckpointEngine(cfg) as engine:
        assert engine.available_steps() == {"local": [4]}
        loaded = {"model": {"w": torch.zeros(8, 8)}}
        reader = TieredStorageReader(engine)
        dcp.load(loaded, storage_reader=reader)
        assert reader.step == 4 and reader.verified and torch.equal(loaded["model"]["w"], torch.full((8, 8), 4.0))


def test_an_earlier_save_s_commit_withdraws_when_a_rank_moves_on_to_a_later_save_of_the_step(tmp_path):
    """Two saves of one step in flight (a restart drains step 7 from shared memory while the job saves 7 again):
    rank 1 starts the later save between the committer's reading of the earlier save's votes and its publishing
    of the manifest. That commit must withdraw: it would vouch for files rank 1 is replacing (found by a review,
    by this forced interleaving of two FileStores on one directory)."""
    from tiered_ckpt.megatron.convert import open_store
    from tiered_ckpt.parallel import ParallelLayout

    layout, step = ParallelLayout(dp=2), 7
    r0, r1 = open_store(str(tmp_path), "rank_sharded", "shared"), open_store(str(tmp_path), "rank_sharded", "shared")

    def write(store, rank: int, save: str, payload: bytes) -> None:
        store._uncommit_for_rewrite(step, layout.coords(rank), save)
        entry = store.write_file(f"iter_{step:07d}/rank_{rank:05d}/state.flat", lambda: [payload], item="state",
                                 rank=rank, step=step, codec="flat")
        store._publish_rank(step, layout.coords(rank), [entry], save)

    write(r0, 0, "X.0", b"x0" * 100)
    write(r1, 1, "X.0", b"x1" * 100)
    finalize = r0.layout.finalize

    def rank_1_moves_on(*args, **kwargs):  # the votes of X are read; its manifest is not published yet
        write(r1, 1, "Y.1", b"Y1" * 100)
        return finalize(*args, **kwargs)

    r0.layout.finalize = rank_1_moves_on
    assert r0.try_commit(step, layout.coords(0), save_id="X.0") is None
    assert r0.committed_steps() == []
    assert r0.read_rank_manifest(step, 1).extra["save"] == "Y.1"  # rank 1's vote is the later save's now


def test_a_step_saved_again_loads_its_new_files_in_the_process_that_loaded_it_before(tmp_path, shm_root):
    """The training process caches the manifests a load read; the drain worker (another process) commits the step
    saved again with new checksums. The next load in the same process used the old manifest and took the new files
    for damaged (found by a review)."""
    cfg = config(tmp_path, keep=5, tiers=("shm", "local"), shm_root=shm_root)
    cfg["drain"] = {"mode": "process"}
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2, 3):
            engine.save(step, state(float(step))).wait(timeout=120)
        assert engine.load(step=1).tier == "local"  # shm's two slots hold 2 and 3
        assert engine._drain._ready.wait(120)  # the worker commits from now on (until then, threads here did)
        for step in (1, 2, 3):  # the job went back to step 1
            engine.save(step, state(100.0 + step)).wait(timeout=120)
        got = engine.load(step=1)
        assert got.tier == "local" and got.verified and not got.fallbacks
        assert torch.equal(got.items["model"]["w"], state(101.0)["model"]["w"])


def test_a_restart_after_going_back_says_it_resumes_past_the_later_run(tmp_path, caplog):
    """A Megatron user's trial: resumed at step 4 (--ckpt-step) below steps 6 and 8, the run saved step 6 again;
    a plain restart resumed from step 8, the abandoned run, and nothing said so (Megatron-LM, following its
    tracker, would take 6). load() still takes the newest step, and now says which steps came after it."""
    cfg = config(tmp_path, keep=10)
    with CheckpointEngine(cfg) as engine:
        for step in (2, 4, 6, 8):
            engine.save(step, state(float(step))).wait()
    with CheckpointEngine(cfg) as engine:
        assert engine.load(step=4).step == 4
        engine.save(6, state(60.0)).wait()
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert engine.load().step == 8
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("load: step 8 is the newest")]
    assert len(said) == 1 and "step(s) 6 on tier 'local' were committed after it" in said[0]
    assert "load(step=6)" in said[0]
    caplog.clear()
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert engine.load(step=6).step == 6  # asked for: nothing to say
        engine.save(8, state(80.0)).wait()  # the later run goes on past the old one
    with CheckpointEngine(cfg) as engine, caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert engine.load().step == 8
    assert "is the newest step, but" not in caplog.text
