"""The command line: every command, its --json output and its exit codes."""

from __future__ import annotations

import errno
import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import make_items

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNREADABLE, EXIT_USAGE, build_parser, main
from tiered_ckpt.cli_maintain import parse_min_age


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture
def ckpt(tmp_path, shm_root):
    """A local tier with committed steps 1 and 2, and a partial step 3 (files but no manifest)."""
    root = tmp_path / "ckpt"
    cfg = {"run_id": f"c{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "disk", "kind": "local", "path": str(root)}]}
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            engine.save(step, make_items(step)).wait(timeout=60)
    (root / "iter_0000003" / "rank_00000").mkdir(parents=True)
    (root / "iter_0000003" / "rank_00000" / "state.flat").write_bytes(b"x" * 100)
    return root, cfg


def test_every_command_has_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"plugins", "ls", "inspect", "verify", "gc", "convert", "demo", "bench"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        assert "usage: tiered-ckpt " + name in capsys.readouterr().out


def test_plugins_lists_every_kind_with_its_provider(capsys):
    code, out = run(capsys, "plugins", "--json")
    rows = {(r["type"], r["name"]): r["provider"] for r in json.loads(out)}
    assert code == EXIT_OK
    for kind in ("gpu", "shm", "local", "fsspec"):
        assert rows[("tier", kind)] == "tiered_ckpt.builtin"
    assert rows[("tier", "faulty")] == "faults"
    assert rows[("layout", "megatron")] == rows[("layout", "rank_sharded")] == "tiered_ckpt.builtin"
    code, out = run(capsys, "plugins")
    assert "faulty" in out and "faults" in out


def test_ls_shows_committed_and_partial(ckpt, capsys):
    root, _ = ckpt
    code, out = run(capsys, "ls", str(root), "--json")
    rows = json.loads(out)
    assert code == EXIT_OK
    assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "committed"), (3, "partial")]
    assert rows[0]["bytes"] > 0 and rows[0]["ranks"] == [0]
    # A partial step's age is its newest file's: how long ago a save last wrote there.
    flat = root / "iter_0000003" / "rank_00000" / "state.flat"
    os.utime(flat, (time.time() - 7200, time.time() - 7200))
    code, out = run(capsys, "ls", str(root), "--json")
    assert 7190 < json.loads(out)[2]["age_s"] < 7300
    code, out = run(capsys, "ls", str(root))
    assert "partial" in out and "committed" in out
    assert re.search(r"\b3 +partial .* 2 h ", out), out


def test_ls_with_config_lists_memory_snapshots(ckpt, capsys, tmp_path):
    _, cfg = ckpt
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    code, out = run(capsys, "ls", "--config", str(path), "--json")
    states = {(r["tier"], r["step"]): r["state"] for r in json.loads(out)}
    assert code == EXIT_OK
    # Closed cleanly: no live engine, and everything on the disk too (test_cli_first_hour has the stale case).
    assert states.get(("shm", 2), "snapshot (closed").startswith("snapshot (closed")
    assert states[("disk", 2)] == "committed"


def test_inspect(ckpt, capsys):
    root, _ = ckpt
    code, out = run(capsys, "inspect", str(root), "--json")
    m = json.loads(out)
    assert code == EXIT_OK and m["step"] == 2 and m["files"][0]["key"] == "iter_0000002/rank_00000/state.flat"
    code, out = run(capsys, "inspect", str(root), "--step", "1")
    assert "step 1" in out and "xxh3_128:" in out
    assert run(capsys, "inspect", str(root), "--step", "3")[0] == EXIT_NOT_FOUND


def test_inspect_with_config_takes_the_newest_step_from_the_fastest_tier_holding_it(ckpt, capsys, tmp_path,
                                                                                   monkeypatch):
    """An S3 user's trial: with the first file tier empty (a new node's disk) and the next one holding steps,
    `inspect --config` said "holds no committed checkpoint", exit 3. It looks where load() looks."""
    root, cfg = ckpt
    cfg = {**cfg, "tiers": [cfg["tiers"][0], {"name": "new", "kind": "local", "path": str(tmp_path / "new")},
                            cfg["tiers"][1]]}
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    (tmp_path / "new").mkdir()  # there, and empty (one that does not exist is left out before this)
    code, out = run(capsys, "inspect", "--config", str(path), "--json")
    assert code == EXIT_OK and (json.loads(out)["tier"], json.loads(out)["step"]) == ("disk", 2)
    code, out = run(capsys, "inspect", "--config", str(path), "--step", "1")
    assert code == EXIT_OK and out.startswith("tier 'disk'") and "step 1" in out
    assert run(capsys, "inspect", "--config", str(path), "--step", "7")[0] == EXIT_NOT_FOUND
    # a tier that could not be listed may hold a newer step: what was found is shown, and the exit status says so
    from tiered_ckpt.tiers.local import LocalTier

    real = LocalTier.list

    def failing(self, prefix=""):
        if self.name == "new":
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "new"))
        return real(self, prefix)

    monkeypatch.setattr(LocalTier, "list", failing)
    code, out = run(capsys, "inspect", "--config", str(path))
    assert code == EXIT_UNREADABLE and "step 2" in out, out
    # the tier that holds the steps not even opened, the other empty: never "nothing found" (exit 3, a fresh
    # start), as a review found
    import tiered_ckpt.inventory as inventory

    monkeypatch.setattr(LocalTier, "list", real)
    real_open = inventory.absent_before_open

    def unreadable_disk(cfg, *args, **kwargs):
        if cfg.name == "disk":
            raise inventory.Unreadable("permission denied")
        return real_open(cfg, *args, **kwargs)

    monkeypatch.setattr(inventory, "absent_before_open", unreadable_disk)
    code, out = run(capsys, "inspect", "--config", str(path))
    assert code == EXIT_UNREADABLE, out


def test_verify_passes_then_fails_on_corruption(ckpt, capsys):
    root, _ = ckpt
    code, out = run(capsys, "verify", str(root), "--all", "--json")
    assert code == EXIT_OK and [r["ok"] for r in json.loads(out)] == [True, True]
    path = root / "iter_0000002" / "rank_00000" / "state.flat"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out = run(capsys, "verify", str(root))
    assert code == EXIT_FAILED and "checksum mismatch" in out and "state.flat" in out
    assert re.search(r"manifest says xxh3_128:[0-9a-f]{32}, the bytes stored hash to xxh3_128:[0-9a-f]{32}", out)


def test_verify_all_goes_on_after_a_file_larger_than_its_manifest(ckpt, capsys):
    """A file found damaged while it is read (here larger than its manifest says, refused before reading it) is
    that step's failure: the other steps are still checked and reported."""
    root, _ = ckpt
    with open(root / "iter_0000002" / "rank_00000" / "state.flat", "ab") as f:
        f.write(b"trailing")
    code, out = run(capsys, "verify", str(root), "--all", "--json")
    results = json.loads(out)
    assert code == EXIT_FAILED and [(r["step"], r["ok"]) for r in results] == [(1, True), (2, False)], out
    assert "more than the" in json.dumps(results[1])


def test_verify_all_goes_on_after_a_store_error_of_any_kind(ckpt, capsys, monkeypatch):
    """A storage library's own exception (gcsfs, adlfs and plugins raise their own types) is that file's step not
    read, not the whole run's end, and not damage: exit 4."""
    root, _ = ckpt
    from tiered_ckpt.tiers.local import LocalTier

    real = LocalTier.read_blob_hashed

    def failing(self, key, hasher=None, max_size=None):
        if key.startswith("iter_0000001/"):
            raise RuntimeError("the store's own error")
        return real(self, key, hasher, max_size)

    monkeypatch.setattr(LocalTier, "read_blob_hashed", failing)
    code, out = run(capsys, "verify", str(root), "--all", "--json")
    results = json.loads(out)["results"]
    assert code == EXIT_UNREADABLE and [(r["step"], r["status"]) for r in results] == [(1, "UNREADABLE"), (2, "OK")]
    assert "RuntimeError: the store's own error" in json.dumps(results[0]) and not results[0]["problems"]


@pytest.mark.parametrize(("error", "status", "exit_code"), [
    (PermissionError(errno.EACCES, "Permission denied"), "UNREADABLE", 4),
    ("tier", "UNREADABLE", 4),  # a TierError: an S3 AccessDenied, a timeout
    ("missing", "FAILED", 1),  # a file the committed step lists that is not there: damage
])
def test_verify_and_ls_never_call_what_could_not_be_read_damage(ckpt, capsys, monkeypatch, error, status,
                                                                exit_code):
    """A user's trial: a step whose manifest or data file gave "permission denied" was listed by ls as a "corrupt
    manifest" and failed verify (exit 1, "a check failed"): an operator would delete a healthy step. What could
    not be read is UNREADABLE and exit 4 ("nothing can be said"); a file that is not there is still damage."""
    from tiered_ckpt.errors import BlobNotFoundError, TierError
    from tiered_ckpt.tiers.local import LocalTier

    root, _ = ckpt
    raised = {"tier": TierError("AccessDenied", tier="target", key="k"),
              "missing": BlobNotFoundError("no such file", tier="target", key="k")}.get(error, error)
    for what in ("tiered_ckpt/manifest.json", "rank_00000/state.flat"):
        for method in ("read_blob", "read_blob_hashed"):
            def failing(self, key, *a, _real=getattr(LocalTier, method), _key=f"iter_0000002/{what}", **kw):
                if key == _key:
                    raise raised
                return _real(self, key, *a, **kw)

            monkeypatch.setattr(LocalTier, method, failing)
        code, out = run(capsys, "verify", str(root), "--step", "2")
        assert code == exit_code and out.startswith(f"{status}  tier"), out
        if what.endswith("manifest.json"):
            code, out = run(capsys, "ls", str(root))
            rows = [line for line in out.splitlines() if line.split()[1:2] == ["2"]]
            # a row that says "unreadable" and exit 0 read as fine to a monitoring script (an S3 user's trial)
            assert code == (EXIT_OK if error == "missing" else EXIT_UNREADABLE), out
            if error == "missing":  # gone since it was listed (a live job's retention): no row, no damage
                assert not rows, out
            else:
                assert len(rows) == 1 and "unreadable manifest" in rows[0], out
        monkeypatch.undo()


def test_gc_dry_run_then_delete(ckpt, capsys):
    root, _ = ckpt
    temp = root / "iter_0000002" / ".state.flat.tmp-0123456789abcdef"
    temp.write_bytes(b"half")
    os.utime(temp, (1, 1))  # a write that died long ago: gc leaves younger ones (writes in flight)
    code, out = run(capsys, "gc", str(root), "--json")
    found = json.loads(out)["found"]
    assert code == EXIT_OK
    assert {(f["what"], f["key"]) for f in found} == {("temporary file", str(temp.relative_to(root)))}
    assert temp.exists()
    # Step 3 is newer than every committed step: it may still be in flight, so it is not debris.
    (root / "iter_0000000" / "rank_00000").mkdir(parents=True)
    (root / "iter_0000000" / "rank_00000" / "state.flat").write_bytes(b"fresh")
    code, out = run(capsys, "gc", str(root))  # a partial step just written may be a live run's: left (--min-age)
    assert "would remove  partial step" not in out
    assert "left  partial step  tier 'target': iter_0000003  (100 B; changed " in out
    assert "newer than every committed step: a save may be writing it" in out
    assert "left  partial step  tier 'target': iter_0000000  (5 B; changed " in out  # and said why
    assert "1 left: changed less than --min-age (1 h) ago" in out and "--min-age 0 takes them too" in out
    code, out = run(capsys, "gc", str(root), "--json")
    left = json.loads(out)["left"]
    assert [(d["key"], d["left"]) for d in left if d["left"] != "younger than --min-age"] == [
        ("iter_0000003", "newer than every committed step")]  # said, never removed
    (young,) = [d for d in left if d["left"] == "younger than --min-age"]
    assert (young["what"], young["key"], young["bytes"], young["left"]) == ("partial step", "iter_0000000", 5,
                                                                           "younger than --min-age")
    assert 0 <= young["age_s"] < 3600
    os.utime(root / "iter_0000000" / "rank_00000" / "state.flat", (1, 1))
    code, out = run(capsys, "gc", str(root), "--min-age", "2d")
    assert "would remove  partial step" in out and "dry run" in out and " left" not in out
    code, out = run(capsys, "gc", str(root), "--delete")
    assert code == EXIT_OK and not temp.exists() and not (root / "iter_0000000").exists()
    assert (root / "iter_0000003").exists() and (root / "iter_0000002").exists()


def test_gc_says_a_live_run_s_tiers_are_left_alone(ckpt, tmp_path, capsys):
    """With --config and an engine of the run alive on this node, gc touches nothing on its file tiers: it says
    so (it said "nothing to remove" beside a 2-hour-old temporary file)."""
    root, cfg = ckpt
    temp = root / "iter_0000002" / ".state.flat.tmp-0123456789abcdef"
    temp.write_bytes(b"half")
    os.utime(temp, (1, 1))
    config = tmp_path / "tiers.json"
    config.write_text(json.dumps(cfg))
    with CheckpointEngine(cfg):
        code, out = run(capsys, "gc", "--config", str(config))
        assert code == EXIT_OK and "nothing to remove" not in out
        assert f"run {cfg['run_id']!r} has a live engine on this node: nothing on its file tiers is touched" in out
        code, out = run(capsys, "gc", "--config", str(config), "--json")
        assert json.loads(out) == {"deleted": False, "found": [], "left": [], "live_run": cfg["run_id"]}
    code, out = run(capsys, "gc", "--config", str(config), "--json")
    result = json.loads(out)
    assert result["live_run"] is None and [f["key"] for f in result["found"]] == [str(temp.relative_to(root))]
    assert temp.exists()


@pytest.mark.parametrize("text, seconds", [("90", 90), ("0", 0), ("45s", 45), ("30m", 1800), ("30 min", 1800),
                                           ("2h", 7200), ("1.5d", 129600), (" 2H ", 7200), ("1e3", 1000),
                                           ("inf", float("inf"))])
def test_gc_min_age_takes_a_unit(text, seconds):
    assert parse_min_age(text) == seconds


@pytest.mark.parametrize("text, says", [("-5", "cannot be negative"), ("-1h", "cannot be negative"),
                                        ("2x", "is not an age"), ("h", "is not an age"), ("nan", "is not an age"),
                                        ("-inf", "cannot be negative")])
def test_gc_min_age_refuses_what_is_not_an_age(text, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["gc", str(tmp_path), f"--min-age={text}"])
    assert exited.value.code == EXIT_USAGE and says in capsys.readouterr().err


def test_verify_takes_a_step_or_all_not_both(ckpt, capsys):
    root, _ = ckpt
    with pytest.raises(SystemExit) as exited:
        main(["verify", str(root), "--step", "1", "--all"])
    assert exited.value.code == EXIT_USAGE and "not allowed with argument" in capsys.readouterr().err


def test_gc_stale_runs(shm_root, tmp_path, capsys):
    def cfg(run_id):
        return {"run_id": run_id, "drain": {"mode": "thread"},
                "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)}]}
    dead, live = f"dead{uuid.uuid4().hex[:6]}", f"live{uuid.uuid4().hex[:6]}"
    with CheckpointEngine(cfg(dead)) as engine:
        engine.save(1, {"state": {"w": torch.ones(1000)}})
    with CheckpointEngine(cfg(live)) as engine:
        engine.save(1, {"state": {"w": torch.ones(10)}})
        code, out = run(capsys, "gc", "--stale", "--shm-path", str(shm_root), "--json")
        runs = {f["run_id"] for f in json.loads(out)["found"]}
        assert dead in runs and live not in runs
        assert run(capsys, "gc", "--stale", "--shm-path", str(shm_root), "--delete")[0] == EXIT_OK
        user_dir = next(Path(shm_root).iterdir())
        assert not (user_dir / dead).exists() and (user_dir / live).exists()
        from tiered_ckpt.housekeeping import lock_path

        assert not (user_dir / "@locks" / dead).exists()  # the dead run's lock files went with it
        assert not os.path.exists(lock_path(dead))  # and nothing was made in $TMPDIR (lock_dir() would make it)


def test_gc_stale_says_it_cannot_tell_whether_another_run_s_steps_reached_a_file_tier(shm_root, tmp_path, capsys):
    """Without that run's configuration gc cannot tell whether its snapshots are its only copy: it said only
    "would remove" (a new user's trial: a step held only in memory, after a failed drain, went unremarked)."""
    other = f"other{uuid.uuid4().hex[:6]}"
    cfg = {"run_id": other, "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": str(shm_root)},
                     {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(3, {"state": {"w": torch.ones(10)}}).wait(timeout=60)
    code, out = run(capsys, "gc", "--stale", "--shm-path", str(shm_root))
    assert code == EXIT_OK
    assert f"whether step(s) 3 reached a file tier is not known here (not this configuration's run): gc --config " \
           f"<run {other!r}'s configuration> --stale checks it" in out, out


def test_usage_errors_exit_2(capsys, tmp_path):
    assert main(["ls"]) == EXIT_USAGE
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{name: a, kind: local, path: /x, every: ten}]\n")
    assert main(["ls", "--config", str(bad)]) == EXIT_USAGE
    assert "tiers[0].every" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "empty")]) == EXIT_NOT_FOUND
    assert os.path.exists(tmp_path)


@pytest.mark.slow
def test_demo_small(tmp_path, capsys):
    code, out = run(capsys, "demo", "--workdir", str(tmp_path / "demo"), "--world", "2", "--steps", "12")
    assert code == EXIT_OK, out
    assert "OK: the resumed run matched the uninterrupted one exactly (from step 10 to 12)" in out
    assert "from tier" in out and "time to durable" in out


@pytest.mark.slow
def test_demo_at_its_fewest_steps_and_ranks_resumes_and_leaves_a_workdir_it_takes_again(tmp_path, capsys):
    """--steps 7 --world 1, the fewest the command line takes (a save at step 5, the kill at step 6), resume;
    with --json, the summary alone on stdout."""
    from tiered_ckpt.demo.run import workdir_problem

    work = tmp_path / "demo"
    code, out = run(capsys, "demo", "--workdir", str(work), "--world", "1", "--steps", "7", "--json")
    assert code == EXIT_OK, out
    summary = json.loads(out)  # --json: stdout holds the summary alone, the progress went to stderr
    assert summary["ok"] is True and summary["saved_steps"] == [5] and summary["killed"] == {"rank": 0, "step": 6}
    assert summary["resumed"]["0"]["step"] == 5 and summary["steps_compared"] == 2
    assert [t["tier"] for t in summary["tiers"]] == ["shm", "local", "remote"]
    assert summary["workdir"] == str(work.resolve())
    assert workdir_problem(work) is None  # what the demo wrote is recognised as its own


class _DemoStarted(BaseException):  # passes the CLI's catch-all for unexpected errors
    pass


@pytest.fixture
def demo_launch(monkeypatch, shm_root):
    """The demo with a fake job (``launch``) that raises _DemoStarted, and its shm tier under ``shm_root``."""
    from tiered_ckpt.demo import run as demo_run

    monkeypatch.setattr(demo_run, "SHM_PATH", os.path.join(shm_root, "tiered_ckpt"))

    def launch(world, spec, logs, **_):
        raise _DemoStarted(logs)

    monkeypatch.setattr(demo_run, "launch", launch)
    return demo_run


@pytest.mark.parametrize("argv, flag, allowed", [
    (["demo", "--world", "0"], "--world", "1 or more"),
    (["demo", "--world", "-2"], "--world", "1 or more"),
    (["demo", "--steps", "0"], "--steps", "7 or more"),
    (["demo", "--steps", "6"], "--steps", "7 or more"),  # the kill (step 6) would land on the only save (step 5)
    (["bench", "--size-mib", "0"], "--size-mib", "1 or more"),
    (["bench", "--size-mib", "-1"], "--size-mib", "1 or more"),
])
def test_demo_and_bench_refuse_numbers_out_of_range_up_front(argv, flag, allowed, demo_launch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*argv, *(["--workdir", str(tmp_path / "demo")] if argv[0] == "demo" else [])])
    err = capsys.readouterr().err
    assert exited.value.code == EXIT_USAGE, err
    assert f"argument {flag}: must be {allowed}" in err and f"got {argv[-1]}\n" in err and "Traceback" not in err
    assert not (tmp_path / "demo").exists()


def test_the_demo_takes_its_fewest_steps_and_ranks():
    from tiered_ckpt.demo import SAVE_EVERY, default_kill_step, min_steps

    args = build_parser().parse_args(["demo", "--steps", "7", "--world", "1"])
    assert (args.steps, args.world) == (7, 1)
    # 7 is the fewest steps with a save before the kill step: with 6 the kill is at the only save, step 5.
    assert [s for s in range(1, 8) if any(k < default_kill_step(s) for k in range(SAVE_EVERY, s + 1, SAVE_EVERY))
            ] == [7] == [min_steps()]


@pytest.mark.parametrize("what", ["a file of yours", "an earlier demo's files and one of yours", "a file"])
def test_demo_refuses_a_workdir_it_did_not_write(what, demo_launch, tmp_path, capsys):
    work = tmp_path / "mine"
    if what == "a file":
        work.write_text("precious")
        mine = work
    else:
        work.mkdir()
        mine = work / "notes.txt"
        mine.write_text("precious")
        if what.startswith("an earlier demo's"):
            (work / "tiers.json").write_text(json.dumps({"run_id": "demo-0123abcd", "tiers": [
                {"name": "shm"}, {"name": "local"}, {"name": "remote"}]}))
            (work / "logs").mkdir()
    code = main(["demo", "--workdir", str(work)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert f"tiered-ckpt demo: {work} " in err and "new or empty directory" in err and "--workdir" in err
    assert mine.read_text() == "precious"
    if what.startswith("an earlier demo's"):
        assert (work / "logs").is_dir() and (work / "tiers.json").exists()


def test_demo_runs_again_in_its_own_earlier_workdir(demo_launch, tmp_path, monkeypatch):
    """The default workdir (demo-run), run twice: the second run empties what the first wrote and starts."""
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "demo-run"
    with pytest.raises(_DemoStarted):
        main(["demo"])
    first = json.loads((work / "tiers.json").read_text())["run_id"]
    # What the rest of the first run would have written (the job is faked here).
    for d in ("logs/crashed", "local/iter_0000005", "remote/iter_0000005"):
        (work / d).mkdir(parents=True)
    (work / "local" / "iter_0000005" / "old.flat").write_bytes(b"x")
    (work / "events.jsonl").write_text("{}\n")
    with pytest.raises(_DemoStarted):
        main(["demo"])
    assert json.loads((work / "tiers.json").read_text())["run_id"] != first
    assert sorted(p.name for p in work.iterdir()) == ["tiers.json"]  # the job writes the rest again
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(_DemoStarted):
        main(["demo", "--workdir", str(empty)])
    assert (empty / "tiers.json").exists()


def test_demo_clean_removes_what_it_wrote_and_only_a_workdir_it_made(demo_launch, tmp_path, capsys, monkeypatch):
    def launch(world, spec, logs, **_):  # a job that trains steps 1-7, saves step 5 and resumes from it
        logs.mkdir(parents=True)
        losses = [{"rank": 0, "step": s, "loss": 1.0 / s} for s in range(1, 8)]
        if "resume" in spec:
            return [{"rank": 0, "resumed": 5, "tier": "shm", "load_s": 0.1}, *losses[5:]]
        return losses

    monkeypatch.setattr(demo_launch, "launch", launch)
    new, yours = tmp_path / "new", tmp_path / "yours"
    yours.mkdir()
    for work in (new, yours):
        code, out = run(capsys, "demo", "--workdir", str(work), "--world", "1", "--steps", "7", "--clean")
        assert code == EXIT_OK and "OK: the resumed run matched" in out, out
    assert not new.exists()
    assert yours.is_dir() and list(yours.iterdir()) == []  # an empty directory given stays, empty


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_demo_removes_its_shared_memory_when_interrupted_or_failing(stop, demo_launch, tmp_path, monkeypatch):
    from tiered_ckpt.tiers.base import _user_name

    user_dir = Path(demo_launch.SHM_PATH) / _user_name()
    other = user_dir / "demo-0123abcd"  # another run's: not the demo's own, it stays
    (other / "rank_00000").mkdir(parents=True)
    runs = []

    def launch(world, spec, logs, **_):
        if "config" not in spec:
            return []  # the reference run
        run_dir = user_dir / spec["config"]["run_id"]
        (run_dir / "rank_00000").mkdir(parents=True, exist_ok=True)  # what the ranks' shm tier writes
        (run_dir / "rank_00000" / "slot0").write_bytes(b"x" * 4096)
        runs.append(run_dir)
        raise stop("Ctrl-C" if stop is KeyboardInterrupt else "rank 1 failed")

    monkeypatch.setattr(demo_launch, "launch", launch)
    with pytest.raises(stop):
        demo_launch.run_demo(str(tmp_path / "demo"), world=2, steps=12)
    assert len(runs) == 1 and not runs[0].exists()
    assert (other / "rank_00000").is_dir()


def test_bench_refuses_a_directory_that_does_not_exist_and_creates_nothing(tmp_path, capsys):
    """A user's trial: a mistyped path was created (with its missing parents), measured, exit 0."""
    typo = tmp_path / "typo" / "deep"
    assert main(["bench", str(typo), "--size-mib", "1"]) == EXIT_NOT_FOUND
    assert "no such directory" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_bench_measures_the_machine_and_each_tier(ckpt, capsys, tmp_path):
    _, cfg = ckpt
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    code, out = run(capsys, "bench", "--config", str(path), "--size-mib", "4", "--json")
    rows = {r["what"]: r for r in json.loads(out)}
    assert code == EXIT_OK
    assert rows["copy into pre-faulted memory"]["vs_copy"] == 1.0
    assert any(w.startswith("write+fsync in ") for w in rows)
    for what in ("tier 'shm' (shm) write", "tier 'disk' (local) read"):
        assert rows[what]["bytes"] == 4 << 20 and rows[what]["gb_per_s"] > 0


def test_json_goes_before_or_after_the_command(ckpt, capsys):
    """Trial: `tiered-ckpt --json ls DIR` answered "unrecognized arguments: --json"."""
    root, _ = ckpt
    after = run(capsys, "ls", str(root), "--json")
    before = run(capsys, "--json", "ls", str(root))
    assert after[0] == before[0] == EXIT_OK
    rows = [[(r["step"], r["state"], r["bytes"]) for r in json.loads(out)] for out in (after[1], before[1])]
    assert rows[0] == rows[1] and rows[0]  # (ages move on between the two)
    code, out = run(capsys, "--json", "ls", str(root / "no-such-dir"))
    assert json.loads(out)["exit_code"] == code == 3


def test_a_step_directory_given_for_a_checkpoint_directory_says_to_give_its_parent(tmp_path, capsys, caplog):
    """Trial: `--load .../iter_0000010` (one step's directory) started from scratch in the drop-in with no hint,
    and convert said "step directories present: none; pass a step to load one of them", which cannot work."""
    from tiered_ckpt.megatron.adapter import _step_directory_hint

    step_dir = Path(__file__).parent / "data" / "megatron" / "dp4_tp1_pp1" / "iter_0000010"
    if not step_dir.is_dir():
        pytest.skip(f"{step_dir} is not here")
    code = main(["convert", str(step_dir), str(tmp_path / "out"), "--to", "rank_sharded", "--dp", "2"])
    err = capsys.readouterr().err
    assert code == 3
    assert "this is one step's directory (it holds mp_rank_* directories)" in err and "give its parent" in err, err
    assert "give its parent" in _step_directory_hint(step_dir)
    assert _step_directory_hint(step_dir.parent) == "" and _step_directory_hint(tmp_path / "missing") == ""


def test_the_cli_s_default_shm_path_is_the_shm_tier_s():
    from tiered_ckpt.cli_common import DEFAULT_SHM_PATH
    from tiered_ckpt.tiers.shm import ShmOptions

    assert DEFAULT_SHM_PATH == ShmOptions.path


def _refused(errno_, strerror):
    def mkstemp(*_a, dir=None, **_k):  # as a directory the user cannot write answers (root ignores modes)
        raise OSError(errno_, strerror, os.path.join(dir, ".tiered_ckpt-bench-abc123"))
    return mkstemp


@pytest.mark.parametrize("errno_, strerror", [(errno.EACCES, "Permission denied"),
                                               (errno.EROFS, "Read-only file system")])
def test_bench_on_a_directory_it_cannot_write(tmp_path, capsys, monkeypatch, errno_, strerror):
    from tiered_ckpt import machine_bench

    monkeypatch.setattr(machine_bench.tempfile, "mkstemp", _refused(errno_, strerror))
    code = main(["bench", str(tmp_path), "--size-mib", "1"])
    err = capsys.readouterr().err
    assert code == 4
    assert f"in {tmp_path} (the directory given): {strerror}" in err and "tiered-ckpt bench DIR" in err, err
    assert ".tiered_ckpt-bench-" not in err and "could not read" not in err and "Traceback" not in err
    code = main(["bench", str(tmp_path), "--size-mib", "1", "--json"])
    assert code == 4 and str(tmp_path) in json.loads(capsys.readouterr().out)["error"]


def test_bench_without_a_directory_says_it_writes_in_the_working_directory(tmp_path, capsys, monkeypatch):
    from tiered_ckpt import machine_bench

    monkeypatch.setattr(machine_bench.tempfile, "mkstemp", _refused(errno.EACCES, "Permission denied"))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--size-mib", "1"]) == 4
    err = capsys.readouterr().err
    assert "the current directory" in err and str(tmp_path) in err, err


def test_bench_with_too_little_room_in_dev_shm_says_so_and_goes_on(tmp_path, capsys, monkeypatch):
    """Trial (an 8 MiB tmpfs over /dev/shm): bench died of SIGBUS with no message, its fresh-file write faulting
    pages the tmpfs had no room for."""
    from tiered_ckpt import machine_bench

    real = os.statvfs

    def statvfs(path):  # /dev/shm as Docker's default 64 MiB, nearly full
        st = real(path)
        if str(path) != "/dev/shm":
            return st
        return os.statvfs_result((st.f_bsize, 4096, 16384, 512, 512, *st[5:10]))

    monkeypatch.setattr(machine_bench.os, "statvfs", statvfs)
    code = main(["bench", str(tmp_path), "--size-mib", "4", "--json"])
    captured = capsys.readouterr()
    rows = {r["what"] for r in json.loads(captured.out)}
    assert code == EXIT_OK
    assert "copy into pre-faulted memory" in rows and any(w.startswith("write+fsync in ") for w in rows)
    assert not any(w.startswith("first write into a fresh file") for w in rows)
    assert "/dev/shm has 2 MiB free and the fresh-file write needs 4 MiB" in captured.err, captured.err
    assert "--shm-size" in captured.err and "--size-mib" in captured.err
    assert not list(Path("/dev/shm").glob(".tiered_ckpt-bench-*"))


def test_inspect_of_a_damaged_newest_manifest_names_the_other_steps(ckpt, capsys):
    """A user's trial: inspect stopped at the damaged manifest of the newest step, saying nothing of the others."""
    root, _ = ckpt
    (root / "iter_0000002" / "tiered_ckpt" / "manifest.json").write_text("{ not json")
    assert main(["inspect", str(root)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "the other committed steps: 1 (inspect one with --step N)" in err and "verify" in err, err
    assert main(["inspect", str(root), "--step", "1"]) == EXIT_OK


def test_a_broken_installed_plugin_is_a_configuration_error_not_a_failed_check(ckpt, capsys, monkeypatch):
    """A plugin author's trial: with a broken plugin installed (a misspelt hook), `verify` of a healthy directory
    exited 1, which reads as "a mismatch was found"."""
    import tiered_ckpt.plugins as plugins
    from tiered_ckpt.errors import PluginError

    def broken(*a, **kw):
        raise PluginError("plugin 'mine' implements 'tiered_ckpt_register_tier', which is no hook of tiered_ckpt")

    monkeypatch.setattr(plugins, "get_plugin_manager", broken)
    root, _ = ckpt
    code, out = run(capsys, "verify", str(root), "--json")
    assert code == EXIT_USAGE and json.loads(out)["error"].startswith("plugin error: plugin 'mine'"), out


def test_gc_finds_a_temporary_file_whose_size_the_tier_will_not_tell(ckpt, capsys, monkeypatch):
    """A plugin author's trial: a tier whose size() refused temporary keys (they are no blobs) had gc skip them:
    "nothing to remove", exit 0, with a pending write's bytes there."""
    from tiered_ckpt.errors import BlobNotFoundError
    from tiered_ckpt.tiers.local import LocalTier

    root, _ = ckpt
    temp = root / "iter_0000002" / ".state.flat.tmp-0123456789abcdef"
    temp.write_bytes(b"half")
    os.utime(temp, (1, 1))
    real = LocalTier.size

    def size(self, key):
        if ".tmp-" in key:
            raise BlobNotFoundError("not a blob", tier=self.name, key=key)
        return real(self, key)

    monkeypatch.setattr(LocalTier, "size", size)
    code, out = run(capsys, "gc", str(root))
    assert code == EXIT_OK and "would remove  temporary file" in out and "size unknown" in out, out
    code, out = run(capsys, "gc", str(root), "--delete", "--json")
    assert code == EXIT_OK and not temp.exists()
    assert [(f["what"], f["bytes"]) for f in json.loads(out)["found"]] == [("temporary file", None)]


def test_plugins_lists_a_plugin_that_only_observes_events(capsys, monkeypatch):
    """A plugin author's trial: an entry point that only observes events (a logger) was nowhere in `plugins`,
    so nothing told whether it was loaded."""
    import types

    import tiered_ckpt.plugins as plugins
    from tiered_ckpt import hookimpl

    @hookimpl
    def tiered_ckpt_on_event(event):
        pass

    pm = plugins.PluginManager(load_entry_points=False, extra_plugins=(
        types.SimpleNamespace(tiered_ckpt_on_event=tiered_ckpt_on_event),))
    monkeypatch.setattr(plugins, "get_plugin_manager", lambda: pm)
    code, out = run(capsys, "plugins", "--json")
    rows = [r for r in json.loads(out) if r["type"] == "observer"]
    assert code == EXIT_OK and len(rows) == 1 and rows[0]["class"] == "types.SimpleNamespace", rows


def test_an_exception_nobody_expected_is_exit_70_with_its_traceback_never_a_failed_check(ckpt, capsys,
                                                                                       monkeypatch):
    """A plugin author's trial: a plugin tier's own exception (sqlite3.DatabaseError) ended `verify` with a bare
    traceback and exit 1, which reads as "a mismatch was found", and --json printed no JSON."""
    import sqlite3

    from tiered_ckpt.cli import EXIT_INTERNAL
    from tiered_ckpt.tiers.local import LocalTier

    def broken(self, prefix=""):
        raise sqlite3.DatabaseError("file is not a database")

    monkeypatch.setattr(LocalTier, "list", broken)
    root, _ = ckpt
    code, out = run(capsys, "verify", str(root), "--json")
    assert code == EXIT_INTERNAL == 70
    assert json.loads(out)["error"].startswith("internal error: DatabaseError: file is not a database")
    assert main(["ls", str(root)]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "sqlite3.DatabaseError" in err


def test_ls_with_config_says_a_snapshot_is_owed_to_a_tier_that_holds_nothing_yet(ckpt, capsys, tmp_path):
    """An S3 user's trial: after a crash while S3 was down, its prefix held nothing, and ls said nothing of the
    snapshots never sent there (a tier with nothing stored was left out of the comparison)."""
    _, cfg = ckpt
    cfg = {**cfg, "tiers": [*cfg["tiers"], {"name": "later", "kind": "local", "path": str(tmp_path / "later")}]}
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    code, out = run(capsys, "ls", "--config", str(path), "--json")
    states = {(r["tier"], r["step"]): r["state"] for r in json.loads(out)}
    assert code == EXIT_OK
    assert "not on 'later'" in states[("shm", 2)], states


def test_ls_of_a_directory_whose_checkpoints_are_one_level_down_names_them(ckpt, capsys, tmp_path):
    """An S3 user's trial: `ls s3://bucket` whose runs live under prefixes said "no checkpoints" and no more."""
    import shutil

    root, _ = ckpt
    top = tmp_path / "bucket"
    shutil.copytree(root, top / "run-a")
    code, out = run(capsys, "ls", str(top), "--json")
    assert code == EXIT_NOT_FOUND
    assert json.loads(out)["error"].endswith(f"it holds checkpoints one level down or more: {top}/run-a: give one "
                                             "of those")


def test_a_demo_whose_job_fails_is_a_failed_check_not_an_internal_error(demo_launch, tmp_path, capsys,
                                                                        monkeypatch):
    """A review: with the CLI's catch-all for exceptions nobody expected (exit 70), a rank of the demo failing
    read as a bug of tiered_ckpt's."""
    def launch(world, spec, logs, **_):
        if "config" not in spec:
            return []  # the reference run
        raise demo_launch.DemoFailed("rank 1 failed (exit 1):\nno space left on device")

    monkeypatch.setattr(demo_launch, "launch", launch)
    code = main(["demo", "--workdir", str(tmp_path / "demo"), "--world", "2", "--steps", "12"])
    err = capsys.readouterr().err
    assert code == EXIT_FAILED and "the demo failed: rank 1 failed" in err and "internal error" not in err, err


def test_a_tier_that_could_not_be_read_is_named_once(ckpt, capsys, monkeypatch):
    """A plugin author's trial: "could not read tier 'db': tier 'db': ..." said the tier twice."""
    from tiered_ckpt.errors import PermanentTierError
    from tiered_ckpt.tiers.local import LocalTier

    _, cfg = ckpt
    path = ckpt[0].parent / "tiers.json"
    path.write_text(json.dumps(cfg))

    def refused(self, prefix=""):
        raise PermanentTierError("listing refused", tier=self.name, key=prefix or None)

    monkeypatch.setattr(LocalTier, "list", refused)
    code, out = run(capsys, "verify", "--config", str(path), "--json")
    error = json.loads(out)["error"]
    assert code == EXIT_UNREADABLE and "tier 'disk'" in error and error.count("tier 'disk'") == 1, error
