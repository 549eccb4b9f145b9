"""The command line as a new user meets it: read-only commands that create nothing, exit codes as README says,
JSON errors, a quiet SIGPIPE and Ctrl-C, a fast --help, truthful snapshot states, storage options for URLs."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import make_items

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREADABLE,
    EXIT_USAGE,
    build_parser,
    main,
    storage_options,
)
from tiered_ckpt.errors import TieredCkptError
from tiered_ckpt.housekeeping import lock_path

ROOT = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).parent / "tiered-ckpt"  # the installed console script, as a user runs it
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "tiered_ckpt.cli"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def saved(root: Path, shm: str, steps=(1, 2), run_id: str | None = None) -> dict:
    """A run with committed ``steps`` on a local tier (and their snapshots in shm); the engine closed cleanly."""
    cfg = {"run_id": run_id or f"c{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm}, {"name": "disk", "kind": "local", "path": str(root)}]}
    with CheckpointEngine(cfg) as engine:
        for step in steps:
            engine.save(step, make_items(step)).wait(timeout=60)
    return cfg


# ----- 1. read-only commands ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["ls"], ["inspect"], ["verify"], ["verify", "--all"], ["gc"]])
def test_read_only_commands_on_a_missing_directory_create_nothing_and_exit_3(command, tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir"
    code, out, err = run(capsys, *command, str(missing))
    assert code == EXIT_NOT_FOUND
    assert err.strip() == f"tiered-ckpt {command[0]}: {missing}: no such directory"
    assert not (tmp_path / "no").exists()


def test_ls_of_a_configuration_whose_directories_do_not_exist_creates_nothing(tmp_path, capsys):
    run_id = f"fresh{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(json.dumps({"run_id": run_id, "tiers": [
        {"name": "host", "kind": "shm", "path": str(tmp_path / "shm")},
        {"name": "disk", "kind": "local", "path": str(tmp_path / "ckpt")}]}))
    code, out, err = run(capsys, "ls", "--config", str(cfg))
    assert code == EXIT_NOT_FOUND
    # the tier's directory named: a tier name alone does not say where it looked (a new user's trial)
    assert f"no checkpoints on any tier (tier 'disk': no such directory ({tmp_path / 'ckpt'}))" in err
    assert sorted(os.listdir(tmp_path)) == ["tiers.yaml"]
    assert not os.path.exists(lock_path(run_id))  # liveness is read from lock files, never by creating them
    code, out, err = run(capsys, "gc", "--config", str(cfg), "--stale")
    assert code == EXIT_OK and "nothing to remove" in out
    assert sorted(os.listdir(tmp_path)) == ["tiers.yaml"] and not os.path.exists(lock_path(run_id))


def test_an_empty_directory_is_nothing_found_not_success(tmp_path, capsys):
    code, out, err = run(capsys, "ls", str(tmp_path))
    assert code == EXIT_NOT_FOUND and err.strip() == f"tiered-ckpt ls: no checkpoints in {tmp_path}"
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == EXIT_NOT_FOUND and err.strip() == f"tiered-ckpt inspect: {tmp_path} holds no committed checkpoint"
    assert os.listdir(tmp_path) == []


def test_one_step_s_directory_given_for_the_checkpoint_directory_is_told_to_give_its_parent(tmp_path, shm_root,
                                                                                            capsys):
    saved(tmp_path, shm_root, steps=(1,))
    step_dir = tmp_path / "iter_0000001"
    advice = f"{step_dir} is one step's directory; give its parent, {tmp_path}, the directory that holds the iter_*"
    for command in ("ls", "inspect", "verify"):
        code, out, err = run(capsys, command, str(step_dir))
        assert code == EXIT_NOT_FOUND and advice in err, (command, err)
    code, out, err = run(capsys, "gc", str(step_dir))
    assert code == EXIT_OK and advice in out
    code, out, err = run(capsys, "verify", str(tmp_path))  # the parent is the checkpoint
    assert code == EXIT_OK, err


def test_a_file_given_as_the_directory_is_a_usage_error_that_says_so(tmp_path, capsys):
    db = tmp_path / "some.db"
    db.write_bytes(b"x")
    code, out, err = run(capsys, "ls", str(db))
    assert code == EXIT_USAGE
    assert f"{db} is a file, not a checkpoint directory; give the directory that holds the checkpoints" in err
    yaml_file = tmp_path / "tiers.yaml"
    yaml_file.write_text("tiers: []\n")
    code, out, err = run(capsys, "ls", str(yaml_file))
    assert code == EXIT_USAGE and f"to read it as a configuration: --config {yaml_file}" in err
    assert "cannot create" not in err


def test_a_bucket_that_does_not_exist_or_cannot_be_reached_is_not_no_checkpoints(s3_server, s3_bucket, capsys,
                                                                                  monkeypatch):
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    creds = ["-o", f"key={s3_server.access_key}", "-o", f"secret={s3_server.secret_key}",
             "-o", f"client_kwargs.region_name={s3_server.region}"]
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    code, out, err = run(capsys, "ls", f"s3://{bucket}/x", "--endpoint-url", s3_server.endpoint, *creds)
    assert code == EXIT_NOT_FOUND and err.strip() == f"tiered-ckpt ls: s3://{bucket}/x: no such bucket {bucket!r}"
    assert bucket not in {b["Name"] for b in s3_server.client().list_buckets()["Buckets"]}
    code, out, err = run(capsys, "ls", f"s3://{s3_bucket}/x", "--endpoint-url", s3_server.endpoint, *creds)
    assert code == EXIT_NOT_FOUND and "nothing stored under this prefix" in err
    # Nobody answers there: "could not look", with the tier and the reason; never "no checkpoints".
    code, out, err = run(capsys, "ls", f"s3://{s3_bucket}/x", "--endpoint-url", "http://127.0.0.1:9", *creds,
                         "--json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == EXIT_UNREADABLE
    assert doc["error"].startswith(f"could not read s3://{s3_bucket}/x: ") and "127.0.0.1:9" in doc["error"]
    assert s3_server.secret_key not in out


# ----- 2. --json errors -----------------------------------------------------------------------------------
def test_json_errors_are_json_on_stdout_with_the_exit_code(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    cases = [
        (["ls", missing], EXIT_NOT_FOUND, f"{missing}: no such directory"),
        (["inspect", str(tmp_path)], EXIT_NOT_FOUND, f"{tmp_path} holds no committed checkpoint"),
        (["verify", missing], EXIT_NOT_FOUND, f"{missing}: no such directory"),
        (["gc", missing], EXIT_NOT_FOUND, f"{missing}: no such directory"),
        (["ls"], EXIT_USAGE, "configuration error: give a checkpoint directory or URL, or --config tiers.yaml"),
        (["convert", missing, str(tmp_path / "dst"), "--to", "megatron"], EXIT_NOT_FOUND,
         f"{missing}: no such directory"),
        (["ls", "--no-such-flag"], EXIT_USAGE, "tiered-ckpt: unrecognized arguments: --no-such-flag"),
        (["verify", "--step", "x"], EXIT_USAGE, "tiered-ckpt verify: argument --step: invalid int value: 'x'"),
    ]
    for argv, code, message in cases:
        if argv[-1] in ("--no-such-flag", "x"):
            with pytest.raises(SystemExit) as info:
                main([*argv, "--json"])
            got, out, err = info.value.code, *capsys.readouterr()
        else:
            got, out, err = run(capsys, *argv, "--json")
        assert got == code, argv
        assert json.loads(out) == {"error": message, "exit_code": code}, argv
        assert err == "", argv
    assert not os.path.exists(missing) and not (tmp_path / "dst").exists()


# ----- 3. SIGPIPE -----------------------------------------------------------------------------------------
def test_a_reader_that_goes_away_gets_no_traceback(tmp_path, shm_root):
    root = tmp_path / "ckpt"
    saved(root, shm_root)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: every write meets EPIPE
    try:
        proc = subprocess.run([*CLI, "inspect", str(root)], stdout=write_end, stderr=subprocess.PIPE, timeout=120,
                              cwd=ROOT)
    finally:
        os.close(write_end)
    assert proc.stderr.decode() == ""
    assert proc.returncode == EXIT_BROKEN_PIPE
    # The everyday form: `| head -1` (the rest of the table goes nowhere).
    shell = subprocess.run(["bash", "-c", f"{' '.join(CLI)} inspect {root} | head -1"], capture_output=True,
                           timeout=120, cwd=ROOT)
    assert shell.stdout.decode().startswith("tier 'target'") and shell.stderr.decode() == ""


# ----- 4. --help -----------------------------------------------------------------------------------------
def test_help_and_argument_errors_do_not_import_torch():
    script = textwrap.dedent("""
        import sys
        from tiered_ckpt.cli import main
        for argv in (["--help"], ["ls", "--help"], ["convert", "--help"], ["verify", "--no-such-flag"]):
            try:
                main(argv)
            except SystemExit:
                pass
        heavy = sorted(m for m in ("torch", "numpy", "tiered_ckpt.engine", "tiered_ckpt.pipeline") if m in sys.modules)
        print("HEAVY", heavy, file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stderr


def test_help_texts_show_no_rst_markup(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    texts = [parser.format_help()] + [p.format_help() for p in commands.values()]
    for text in texts:
        assert "``" not in text and ":class:" not in text and ":func:" not in text
    assert "exit status: 0 success" in texts[0]


def test_the_exit_codes_agree_in_help_readme_and_the_docstring():
    """--help's epilog, README's table and cli.py's docstring list the same exit codes: the ones main() returns."""
    from tiered_ckpt import cli

    codes = {cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_NOT_FOUND, cli.EXIT_UNREADABLE,
             cli.EXIT_INTERNAL, cli.EXIT_INTERRUPTED, cli.EXIT_BROKEN_PIPE}
    assert codes == {0, 1, 2, 3, 4, 70, 130, 141}
    epilog = " ".join(build_parser().format_help().split()).split("exit status: ")[1].split(". With --json")[0]
    docstring = " ".join(cli.__doc__.split()).split("Exit codes: ")[1].split(". With ``--json``")[0]
    table = (ROOT / "README.md").read_text().split("| exit status | meaning |")[1].split("\n\n")[0]
    assert {int(n) for n in re.findall(r"(?:^|, )(\d+) ", epilog)} == codes, epilog
    assert {int(n) for n in re.findall(r"(?:^|; )(\d+) ", docstring)} == codes, docstring
    assert {int(n) for n in re.findall(r"^\| (\d+) \|", table, re.M)} == codes, table
    assert "141 the reader of the output went away" in epilog


# ----- 5. gc --stale with a configuration; snapshot states in ls ------------------------------------------
def test_gc_stale_with_a_configuration_looks_in_its_shm_path(tmp_path, shm_root, capsys):
    dead = f"dead{uuid.uuid4().hex[:6]}"
    with CheckpointEngine({"run_id": dead, "drain": {"mode": "thread"},
                           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}]}) as engine:
        engine.save(4, {"state": {"w": torch.ones(100)}}).wait(timeout=60)
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(json.dumps({"run_id": "other", "tiers": [{"name": "host", "kind": "shm", "path": shm_root}]}))
    code, out, _ = run(capsys, "gc", "--config", str(cfg), "--stale", "--json")
    runs = {f["run_id"]: f for f in json.loads(out)["found"]}
    assert code == EXIT_OK and dead in runs and runs[dead]["steps"] == [4]
    code, out, _ = run(capsys, "gc", "--config", str(cfg), "--stale")
    assert f"would remove  shared memory of run {dead!r} (closed, steps 4)" in out


@pytest.mark.parametrize("kind", ["local", "shm"])
def test_a_file_as_a_tier_path_names_the_configuration_key_in_the_engine_and_the_cli(tmp_path, capsys, kind):
    """It was "cannot create the directory ...: File exists" (engine) and, for shm, exit 4 "Not a directory"
    (CLI), and the CLI told a user who had given --config to give --config (new-user trial)."""
    not_a_dir = tmp_path / "not-a-dir"
    not_a_dir.write_text("x")
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(json.dumps({"run_id": "r", "drain": {"mode": "thread"},
                               "tiers": [{"name": "t", "kind": kind, "path": str(not_a_dir)}]}))
    with pytest.raises(TieredCkptError, match=f"{not_a_dir} is a file, not a directory") as info:
        CheckpointEngine(str(cfg))
    if kind == "local":
        assert str(info.value).startswith(f"{cfg}: tiers[0].path: ")
    code, _, err = run(capsys, "ls", "--config", str(cfg))
    assert code == EXIT_USAGE and f"set {cfg}: tiers[0].path to the tier's directory" in err, err
    assert "--config tiers.yaml" not in err and not_a_dir.read_text() == "x"


def test_gc_stale_in_a_path_that_is_not_a_directory_is_not_found(tmp_path, capsys):
    """A mistyped shm path was "nothing to remove", exit 0 (new-user trial)."""
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "file"):
        code, _, err = run(capsys, "gc", "--stale", "--shm-path", str(path))
        assert code == EXIT_NOT_FOUND and f"--shm-path {path}: no such directory" in err
    cfg = tmp_path / "tiers.yaml"
    typo = {"name": "host", "kind": "shm", "path": str(tmp_path / "typo")}
    cfg.write_text(json.dumps({"run_id": "r", "tiers": [typo]}))
    code, out, _ = run(capsys, "gc", "--config", str(cfg), "--stale")  # no engine of it ran yet: said, not an error
    assert code == EXIT_OK and f"nothing to remove (no shared memory at {tmp_path / 'typo'})" in out
    (tmp_path / "typo").write_text("x")
    code, _, err = run(capsys, "gc", "--config", str(cfg), "--stale")
    assert code == EXIT_NOT_FOUND and f"{cfg}: shm tier path {tmp_path / 'typo'}: no such directory" in err


def test_gc_stale_on_a_node_where_no_engine_ran_is_not_an_error(tmp_path, capsys, monkeypatch):
    """The default shm path does not exist before an engine ran there: an epilog's ``gc DIR --stale --delete``
    still cleans DIR (found in review)."""
    monkeypatch.setattr("tiered_ckpt.cli_maintain.DEFAULT_SHM_PATH", str(tmp_path / "never-made"))
    code, out, _ = run(capsys, "gc", "--stale")
    assert code == EXIT_OK and f"nothing to remove (no shared memory at {tmp_path / 'never-made'})" in out


def _crashed_run(shm: str, run_id: str, step: int, persistent: bool = True) -> None:
    """A process that put ``step`` into shared memory and died without close() (os._exit: no clean-up)."""
    script = textwrap.dedent(f"""
        import os, torch
        from tiered_ckpt import CheckpointEngine
        engine = CheckpointEngine({{"run_id": {run_id!r}, "drain": {{"mode": "thread"}},
                                   "tiers": [{{"name": "shm", "kind": "shm", "path": {shm!r}}}]}})
        engine.save({step}, {{"state": {{"w": torch.ones(10)}}}}, persistent={persistent}).wait(timeout=60)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=ROOT)


def test_ls_counts_a_snapshot_owed_only_to_the_tiers_its_save_was_due_on(tmp_path, shm_root, capsys):
    """A snapshot a tier's ``every`` skipped is not reported as waiting for that tier (a restart does not drain it
    there either)."""
    cfg = {"run_id": f"e{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "local")},
                     {"name": "sparse", "kind": "local", "path": str(tmp_path / "sparse"), "every": 10}]}
    with CheckpointEngine(cfg) as engine:
        for step in range(1, 12):  # saves 1 and 11 are due on `sparse`; shm keeps 10 and 11 at close
            engine.save(step, make_items(step))
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "ls", "--config", str(path), "--json")
    states = {r["step"]: r["state"] for r in json.loads(out) if r["tier"] == "shm" and r.get("run_id") == cfg["run_id"]}
    assert code == EXIT_OK
    assert states == {10: "snapshot (closed; on every file tier its save was due on)",
                      11: "snapshot (closed; on every file tier)"}


def test_gc_stale_does_not_keep_a_run_for_a_tier_whose_every_skipped_its_snapshots(tmp_path, shm_root, capsys):
    """gc --stale keeps a run whose snapshots are the only copy for some tier; a tier that was never to take them
    (its `every`) does not make them that."""
    cfg = {"run_id": f"g{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "local", "kind": "local", "path": str(tmp_path / "local")},
                     {"name": "sparse", "kind": "local", "path": str(tmp_path / "sparse"), "every": 10}]}
    with CheckpointEngine(cfg) as engine:
        for step in range(1, 6):  # `sparse` takes step 1 only; shm keeps 4 and 5, both on `local`
            engine.save(step, make_items(step))
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "gc", "--config", str(path), "--stale", "--json")
    mine = {f["run_id"]: f for f in json.loads(out)["found"]}[cfg["run_id"]]
    assert code == EXIT_OK and mine["kept"] is False and mine["undrained"] is None, mine
    assert mine["steps"] == [4, 5]


def test_ls_tells_live_closed_and_stale_snapshots_apart_and_prints_no_step_minus_one(tmp_path, shm_root, capsys):
    root = tmp_path / "ckpt"
    cfg = saved(root, shm_root)  # closed cleanly: whatever is left in memory is on disk too
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "ls", "--config", str(path), "--json")
    rows = json.loads(out)
    mine = [r for r in rows if r["tier"] == "shm" and r.get("run_id") == cfg["run_id"]]
    assert code == EXIT_OK
    assert all(r["state"] == "snapshot (closed; on every file tier)" for r in mine)
    assert all(r["step"] is None or r["step"] >= 0 for r in rows)
    # The same run_id dies after a save that never reached the disk: that snapshot is stale.
    _crashed_run(shm_root, cfg["run_id"], 7)
    other = f"other{uuid.uuid4().hex[:6]}"
    _crashed_run(shm_root, other, 5)
    code, out, _ = run(capsys, "ls", "--config", str(path), "--json")
    rows = json.loads(out)
    states = {(r["run_id"], r["step"]): r["state"] for r in rows if r["tier"] == "shm"}
    assert states[(cfg["run_id"], 7)] == ("snapshot (stale: its process ended without close(); not on 'disk': the "
                                         f"next engine of run {cfg['run_id']!r} drains it)")
    assert states[(other, 5)] == f"run {other!r}: stale: its process ended without close(); gc --stale removes it"
    # gc --stale keeps the snapshot that is the only copy of step 7, and says so; the other run's goes
    code, out, _ = run(capsys, "gc", "--config", str(path), "--stale", "--delete")
    assert code == EXIT_OK and f"kept  shared memory of run {cfg['run_id']!r} (stale, steps 2, 7)" in out, out
    assert "step 7 is not on 'disk' yet: the next engine" in out and "--force removes it anyway" in out
    assert f"removed  shared memory of run {other!r}" in out
    code, out, _ = run(capsys, "gc", "--config", str(path), "--stale", "--tier", "shm", "--delete")  # all file tiers
    assert code == EXIT_OK and f"kept  shared memory of run {cfg['run_id']!r}" in out, out
    code, out, _ = run(capsys, "ls", "--config", str(path), "--json")
    states = {(r["run_id"], r["step"]): r["state"] for r in json.loads(out) if r["tier"] == "shm"}
    assert "not on 'disk'" in states[(cfg["run_id"], 7)] and (other, 5) not in states
    with CheckpointEngine(cfg) as engine:  # a live engine (it drains step 7 as it starts)
        engine.wait(timeout=60)
        code, out, _ = run(capsys, "ls", "--config", str(path))
        assert "snapshot (live engine)" in out
        assert " -1 " not in out
    code, out, _ = run(capsys, "ls", "--config", str(path), "--json")
    states = {(r.get("run_id"), r["step"]): r["state"] for r in json.loads(out)}
    assert states[(None, 7)] == "committed"
    assert "stale" not in states.get((cfg["run_id"], 7), "")
    # a non-persistent snapshot is memory only: no file tier will ever take it, so it does not keep the run
    _crashed_run(shm_root, cfg["run_id"], 8, persistent=False)
    code, out, _ = run(capsys, "gc", "--config", str(path), "--stale", "--json")
    mine = {f["run_id"]: f for f in json.loads(out)["found"]}[cfg["run_id"]]
    assert mine["kept"] is False and mine["undrained"] is None and 8 in mine["steps"], mine
    # --force removes a snapshot no file tier has, when asked to
    _crashed_run(shm_root, cfg["run_id"], 9)
    code, out, _ = run(capsys, "gc", "--config", str(path), "--stale", "--json")
    mine = {f["run_id"]: f for f in json.loads(out)["found"]}[cfg["run_id"]]
    assert mine["kept"] is True and mine["undrained"] == {"steps": [9], "tiers": ["disk"]}, mine
    code, out, _ = run(capsys, "gc", "--config", str(path), "--stale", "--delete", "--force")
    assert code == EXIT_OK and f"removed  shared memory of run {cfg['run_id']!r}" in out
    assert "removed anyway (--force)" in out
    code, out, _ = run(capsys, "ls", "--config", str(path), "--json")
    assert not [r for r in json.loads(out) if r["tier"] == "shm" and r.get("run_id") == cfg["run_id"]]


# ----- 6. storage options ---------------------------------------------------------------------------------
def test_storage_option_values():
    assert storage_options(["anon=true", "block=8", "client_kwargs.region_name=eu-west-1", 'token="123"',
                            "profile=dev", "empty="], "http://localhost:9000") == {
        "anon": True, "block": 8, "client_kwargs": {"region_name": "eu-west-1"}, "token": "123", "profile": "dev",
        "empty": "", "endpoint_url": "http://localhost:9000"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        storage_options(["anon"], None)


def test_storage_options_and_endpoint_reach_the_url_tier(s3_server, s3_bucket, shm_root, tmp_path, capsys,
                                                         monkeypatch):
    url = f"s3://{s3_bucket}/run"
    cfg = {"run_id": f"s{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                     {"name": "s3", "kind": "fsspec", "url": url, "options": s3_server.storage_options()}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(3, make_items(3)).wait(timeout=120)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    flags = ["--endpoint-url", s3_server.endpoint, "--storage-option", f"key={s3_server.access_key}",
             "--storage-option", f"secret={s3_server.secret_key}",
             "--storage-option", f"client_kwargs.region_name={s3_server.region}"]
    code, out, _ = run(capsys, "ls", url, *flags, "--json")
    assert code == EXIT_OK and [(r["step"], r["state"]) for r in json.loads(out)] == [(3, "committed")]
    code, out, _ = run(capsys, "verify", url, *flags, "--json")
    assert code == EXIT_OK and [r["ok"] for r in json.loads(out)] == [True]
    code, out, _ = run(capsys, "inspect", url, *flags)
    assert code == EXIT_OK and f"fsspec {url} at {s3_server.endpoint}" in out
    # With a configuration: the flags are added to its fsspec tiers' own options.
    bare = {**cfg, "tiers": [{"name": "s3", "kind": "fsspec", "url": url}]}
    path = tmp_path / "tiers.yaml"
    path.write_text(json.dumps(bare))
    code, out, _ = run(capsys, "ls", "--config", str(path), *flags, "--json")
    assert code == EXIT_OK and [r["step"] for r in json.loads(out)] == [3]
    code, out, err = run(capsys, "ls", str(tmp_path), "--endpoint-url", s3_server.endpoint)
    assert code == EXIT_USAGE and "are for URLs" in err


# ----- 7. progress and Ctrl-C -----------------------------------------------------------------------------
def test_verify_progress_bar_has_a_total_and_ends_at_100_percent(tmp_path, shm_root):
    from tiered_ckpt.cli import _config_for_target
    from tiered_ckpt.inventory import verify_step
    from tiered_ckpt.parallel import RankCoords
    from tiered_ckpt.pipeline import build_stores
    from tiered_ckpt.plugins import get_plugin_manager

    root = tmp_path / "ckpt"
    saved(root, shm_root, steps=(1,))
    config = _config_for_target(str(root), "rank_sharded")
    store = build_stores(config, get_plugin_manager(), RankCoords(rank=0), 0, ["target"], lambda e: None)["target"]
    total = sum(f.size for f in store.read_manifest(1).files)
    bar = io.StringIO()
    report = verify_step(store, 1, progress=bar)
    last = bar.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    done = re.search(r"(\S+)/(\S+) \[", last)
    assert report.ok and total > 0
    assert "100%" in last and done and done.group(1) == done.group(2), last


def _as_from_a_terminal() -> None:
    # What a shell gives a command: SIGINT at its default and unblocked. The pytest process may not be in that
    # state after the tests before this one (seen in full-suite runs only), and children inherit it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _ctrl_c(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """Ctrl-C to ``proc`` until it ends; its stdout and stderr. On a loaded machine the first SIGINT was seen lost
    once in a while (cause not found yet; torch's native thread is ruled out, it blocks SIGINT): press it again, as
    a user would, a few times."""
    for _ in range(12):
        proc.send_signal(signal.SIGINT)
        try:
            return proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    return b"", b""


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, as_json):
    """With --json, stdout also gets the failure object a script reading it was promised (it got nothing)."""
    fifo = tmp_path / "tiers.yaml"
    os.mkfifo(fifo)
    proc = subprocess.Popen([*CLI, "ls", "--config", str(fifo), *(["--json"] if as_json else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, preexec_fn=_as_from_a_terminal)
    out = err = b""
    try:
        with open(fifo, "w"):  # returns once the command opened the file to read it: it is inside the command
            out, err = _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED
    lines = err.decode().splitlines()
    assert lines.count("tiered-ckpt ls: interrupted") == 1 and not any("Traceback" in ln for ln in lines), lines
    assert (json.loads(out) == {"error": "interrupted", "exit_code": EXIT_INTERRUPTED}) if as_json else out == b""


@pytest.mark.slow
def test_ctrl_c_during_the_demo_leaves_no_shared_memory_and_no_rank_behind(tmp_path):
    """Ctrl-C in the middle of the demo (sent to the demo's own process, as ``kill -INT`` does: its ranks get no
    signal): the job is stopped and the shared memory of the demo's run removed; another run's stays."""
    from tiered_ckpt.demo.run import SHM_PATH
    from tiered_ckpt.tiers.base import _user_name

    if not os.path.isdir(os.path.dirname(SHM_PATH)):
        pytest.skip("no /dev/shm")
    user_dir = Path(SHM_PATH) / _user_name()
    other = user_dir / f"demo-{uuid.uuid4().hex[:8]}"  # another run's (not this demo's): it stays
    other.mkdir(parents=True)
    work = tmp_path / "demo"

    proc = subprocess.Popen([*CLI, "demo", "--workdir", str(work), "--world", "2", "--steps", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, preexec_fn=_as_from_a_terminal)
    run_dir, err = None, b""
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if run_dir is None and (work / "tiers.json").exists():
                run_dir = user_dir / json.loads((work / "tiers.json").read_text())["run_id"]
            if run_dir is not None and run_dir.exists():
                break  # the ranks of the checkpointing run have written their shared memory
            time.sleep(0.02)
        assert run_dir is not None and run_dir.exists(), proc.communicate()
        err = _ctrl_c(proc)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        other_stayed = other.is_dir()
        shutil.rmtree(other, ignore_errors=True)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert other_stayed
    assert "tiered-ckpt demo: interrupted" in err.decode()
    assert not run_dir.exists()
    ranks = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, run_dir.name)]
    assert ranks == []  # no rank of the demo's run lives on (to write its shared memory again)


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_verify_with_a_configuration_says_it_skips_memory_snapshots(tmp_path, shm_root, capsys):
    cfg = saved(tmp_path / "ckpt", shm_root)
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "verify", "--config", str(path), "--all")
    assert code == EXIT_OK and "OK  tier 'disk' step 2" in out
    assert "tier 'shm' holds memory snapshots, which this command does not verify" in err, err
    code, out, err = run(capsys, "verify", "--config", str(path), "--tier", "disk")
    assert code == EXIT_OK and "memory snapshots" not in err


def test_a_refused_convert_creates_no_destination(tmp_path, shm_root, capsys):
    saved(tmp_path / "ckpt", shm_root)  # our flat items: not a Megatron torch-format checkpoint
    dst = tmp_path / "converted"
    code, out, err = run(capsys, "convert", str(tmp_path / "ckpt"), str(dst), "--to", "megatron")
    assert code != EXIT_OK and "mp_rank_" in err, err
    assert not dst.exists()


def _in_terminal(argv: list[str], size: tuple[int, int] | None, program: list[str] = CLI) -> tuple[int, str]:
    """Run the command line (or ``program``) in a real pseudo-terminal (``size``: columns, rows; None leaves it
    0x0, as ``script`` does without one) and return its exit code and everything it printed."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    proc = subprocess.Popen([*program, *argv], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=120), out.decode(errors="replace")


@pytest.mark.parametrize("size", [None, (100, 30)], ids=["no size", "100x30"])
def test_verify_draws_its_progress_bar_in_a_terminal(tmp_path, size):
    """In a terminal, verify shows each step's bar, finished at 100%; a terminal of no known size (``script``)
    printed an empty line in its place."""
    cfg = {"run_id": f"pty{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path)}]}
    with CheckpointEngine(cfg) as engine:
        for step in (1, 2):
            engine.save(step, {"m": {"w": torch.ones(4096)}}).wait(timeout=60)
    code, out = _in_terminal(["verify", str(tmp_path), "--all"], size)
    assert code == 0, out
    lines = [line.rsplit("\r", 1)[-1] for line in out.replace("\r\n", "\n").split("\n") if line.strip()]
    bars = [line for line in lines if line.startswith("verify ")]
    assert len(bars) == 2 and all("100%" in b for b in bars), out
    assert sum(line.startswith("OK ") for line in lines) == 2, out
    assert not [line for line in out.strip().replace("\r\n", "\n").split("\n") if not line.strip("\r ")], out


@pytest.mark.parametrize("size", [None, (100, 30)], ids=["no size", "100x30"])
def test_engine_wait_draws_its_progress_bar_in_a_terminal(tmp_path, size):
    """A user's trial: engine.wait(progress=True) drew nothing in a terminal of no known size (the command
    line's bars already had 80x24 for it)."""
    script = textwrap.dedent(f"""
        import torch
        from tiered_ckpt import CheckpointEngine
        cfg = {{"run_id": "bar{uuid.uuid4().hex[:6]}", "drain": {{"mode": "thread"}},
               "tiers": [{{"name": "shm", "kind": "shm", "path": {str(tmp_path / "shm")!r}}},
                         {{"name": "slow", "kind": "faulty", "latency_s": 0.4,
                          "inner": {{"kind": "local", "path": {str(tmp_path / "disk")!r}}}}}]}}
        with CheckpointEngine(cfg) as engine:
            engine.save(1, {{"m": {{"w": torch.ones(16)}}}})
            engine.wait(progress=True)
        print("DONE")
        """)
    code, out = _in_terminal(["-c", script], size, program=[sys.executable])
    assert code == 0 and "DONE" in out, out
    assert "rank 0 drain" in out and "deliveries" in out, out


def test_the_demo_names_a_command_line_that_runs(monkeypatch):
    """``make demo`` runs .venv/bin/tiered-ckpt, which need not be on PATH: its "explore:" hint names a command
    that the shell finds."""
    from tiered_ckpt.demo.run import _cli_command

    bindir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    outside = _cli_command()
    assert subprocess.run([*outside.split(), "--help"], capture_output=True).returncode == 0
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    if (Path(bindir) / "tiered-ckpt").exists():
        assert _cli_command() == "tiered-ckpt"


def test_missing_tier_directories_of_a_configuration_are_named_for_every_kind(tmp_path, capsys):
    """A user's trial: a missing fsspec tier's directory was "no such directory" with no URL (a local tier's has
    its path), and verify said "no file tier to look at" though the configuration has two."""
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(f"run_id: miss\ntiers:\n  - {{name: nvme, kind: local, path: {tmp_path / 'a'}}}\n"
                   f"  - {{name: remote, kind: fsspec, url: 'file://{tmp_path / 'b'}'}}\n")
    code, out, err = run(capsys, "ls", "--config", str(cfg))
    assert code == EXIT_NOT_FOUND and f"tier 'remote': no such directory (fsspec file://{tmp_path / 'b'})" in err
    code, out, err = run(capsys, "verify", "--config", str(cfg))
    assert code == EXIT_NOT_FOUND and "no file tier holds anything yet" in err, err
