"""Crashes in the megatron layout's gather-free commit (tiered_ckpt/megatron/inplace.py), 4 gloo ranks on a local
tier: a rank killed after writing its ranges of ``distrib_optim.pt`` but before its rank manifest, and the
committing rank killed before and after the file's rename. Each time the previous committed step stays the
one loaded (verified, Megatron's shards), the half-written file is never taken for a finished one, the next
save commits, and ``gc`` removes the debris (the in-place temporary file like any other temporary file; ``ls`` and
``verify`` never count it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_multirank import free_port, run_ranks  # noqa: E402

from tiered_ckpt.cli import main as cli_main  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parents[1] / "megatron_worker.py"
WORLD = 4


def _config(root: Path, shm: str) -> dict:
    return {"run_id": f"ip{uuid.uuid4().hex[:6]}", "layout": "megatron",
            "drain": {"mode": "thread", "commit_timeout_s": 6},
            "tiers": [{"name": "shm", "kind": "shm", "path": shm},
                      {"name": "local", "kind": "local", "path": str(root)}]}


def _with_shm(cfg: dict, shm: str) -> dict:
    """``cfg`` with another shm directory: no later run recovers this one's snapshots."""
    return {**cfg, "tiers": [{**cfg["tiers"][0], "path": shm}, *cfg["tiers"][1:]]}


def _run_with_victim(spec: dict, victim: int, point: str, timeout: float = 120) -> None:
    """Start the ranks, ``victim`` armed to die at ``point``; once it is dead, the others get a while to finish
    (with rank 0 gone, gloo may not let them), then the ones left are killed."""
    port = free_port()
    procs = {}
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        if rank == victim:
            env["TIERED_CKPT_CRASH_AT"] = point
        procs[rank] = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = procs[victim].communicate(timeout=timeout)
        assert procs[victim].returncode == -signal.SIGKILL, f"rank {victim} was not killed at {point}:\n{err[-3000:]}"
        for p in procs.values():
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()  # a peer of a dead rank 0, stuck in gloo
                p.communicate()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = cli_main(list(argv))
    return code, capsys.readouterr().out


def _files(d: Path) -> list[Path]:
    """The step directory's files as a listing shows them: no temporary file, no manifest."""
    return [p for p in d.rglob("*") if p.is_file() and not p.name.startswith(".") and "tiered_ckpt" not in p.parts]


@pytest.mark.parametrize(("victim", "point"), [
    (2, "megatron.pieces_written"),  # a rank: its ranges written and synced, no rank manifest
    (0, "megatron.in_place_complete"),  # the committing rank: the file complete, not renamed
    (0, "megatron.in_place_renamed"),  # the committing rank: the file in place, no checkpoint manifest
])
def test_crash_in_the_in_place_commit(tmp_path, capsys, victim, point):
    root = tmp_path / "local"
    shms = [tempfile.mkdtemp(prefix="tc_ipcrash_", dir="/dev/shm") for _ in range(3)]
    try:
        cfg = _config(root, shms[0])
        saved = run_ranks(WORLD, {"config": cfg, "mode": "steps", "steps": [100], "job": {"dp": WORLD}},
                          worker=WORKER)
        assert all(r.get("ok") == [100] for r in saved.values()), saved
        _run_with_victim({"config": _with_shm(cfg, shms[1]), "mode": "steps", "steps": [200], "job": {"dp": WORLD}},
                         victim, point)
        step_dir = root / "iter_0000200"
        assert not (step_dir / "tiered_ckpt" / "manifest.json").exists()
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "100"
        merged = step_dir / "mp_rank_00" / "distrib_optim.pt"
        temps = list(step_dir.rglob(".distrib_optim.pt.tmp-*"))
        assert merged.exists() == (point == "megatron.in_place_renamed") and len(temps) == (not merged.exists())

        # the previous step is what loads, from the disk, verified, each rank's shards Megatron's
        disk = {**cfg, "tiers": cfg["tiers"][1:]}
        loaded = run_ranks(WORLD, {"config": disk, "mode": "load", "job": {"dp": WORLD}}, worker=WORKER)
        for r in loaded.values():
            assert "error" not in r, r
            assert r["step"] == 100 and r["verified"] is True and r["shards"] == r["expected"]

        # ls and verify see the committed step's files only, never the temporary file
        code, out = _cli(capsys, "ls", str(root), "--layout", "megatron", "--json")
        rows = {r["step"]: r for r in json.loads(out)}
        listed = json.loads((root / "iter_0000100/tiered_ckpt/manifest.json").read_text())["files"]
        assert code == 0 and rows[100]["state"] == "committed" and rows[100]["files"] == len(listed), rows
        assert rows[100]["ranks"] == list(range(WORLD)), rows
        on_disk = _files(root / "iter_0000100")
        assert {f["key"] for f in listed} == {str(p.relative_to(root)) for p in on_disk}
        assert rows[100]["bytes"] == sum(f["size"] for f in listed) == sum(p.stat().st_size for p in on_disk)
        assert rows[200]["state"] == "partial", rows
        code, out = _cli(capsys, "verify", str(root), "--layout", "megatron", "--json")
        assert code == 0, out
        # step 200 is newer than every commit (it may still be in flight): only the temporary file is debris
        code, out = _cli(capsys, "gc", str(root), "--layout", "megatron", "--json", "--min-age", "0")
        found = {(f["what"], f["key"]) for f in json.loads(out)["found"]}
        assert found == {("temporary file", str(t.relative_to(root))) for t in temps}

        # the next save commits (its retention removes step 200's files) and is what loads
        again = run_ranks(WORLD, {"config": _with_shm(cfg, shms[2]), "mode": "steps", "steps": [300],
                                  "job": {"dp": WORLD}}, worker=WORKER)
        assert all(r.get("ok") == [300] for r in again.values()), again
        loaded = run_ranks(WORLD, {"config": disk, "mode": "load", "job": {"dp": WORLD}}, worker=WORKER)
        assert all(r["step"] == 300 and r["shards"] == r["expected"] for r in loaded.values()), loaded
        assert not _files(step_dir)
        code, out = _cli(capsys, "gc", str(root), "--layout", "megatron", "--delete", "--min-age", "0")
        assert code == 0 and not list(root.rglob(".*.tmp-*")) and not step_dir.exists(), out
    finally:
        for d in shms:
            shutil.rmtree(d, ignore_errors=True)
