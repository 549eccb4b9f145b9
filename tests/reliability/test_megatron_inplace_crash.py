"""Crashes in the megatron layout's gather-free commit, 4 gloo ranks: on a local tier (tiered_ckpt/megatron/
inplace.py), and on S3 (moto's server; tiered_ckpt/megatron/inplace_parts.py, further below). On the local tier:
a rank killed after writing its ranges of ``distrib_optim.pt`` but before its rank manifest, and the committing
rank killed before and after the file's rename. Each time the previous committed step stays the
one loaded (verified, Megatron's shards), the half-written file is never taken for a finished one, the next
save commits, and ``gc`` removes the debris (the in-place temporary file like any other temporary file; ``ls`` and
``verify`` never count it)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_multirank import run_ranks, start_ranks  # noqa: E402

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
    procs = start_ranks(WORLD, spec, worker=WORKER, env_of={victim: {"TIERED_CKPT_CRASH_AT": point}})
    try:
        _, err = procs[victim].communicate(timeout=timeout)
        assert procs[victim].returncode == -signal.SIGKILL, f"rank {victim} was not killed at {point}:\n{err[-3000:]}"
        deadline = time.monotonic() + 30  # one while for all of them, not 30 s each
        for p in procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # a peer of a dead rank 0, stuck in gloo
    finally:
        for p in procs.values():
            p.kill()


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


# ----- S3: the ranks' parts of one multipart upload -----------------------------------------------------------
S3_MODEL = {"hidden": 256, "ddp_bucket_size": None}  # 12 MiB per optimizer record: parts of S3's minimum


def _open_uploads(tier) -> list[str]:
    bucket, prefix, _ = tier.fs.split_path(tier.root)
    return [u["Key"] for u in tier.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            .get("Uploads", [])]


@pytest.mark.parametrize(("victim", "point"), [
    (2, "megatron.parts_sent"),  # a rank: its parts sent, no rank manifest
    (0, "megatron.tail_sent"),  # the committing rank: every part sent, the upload not completed
    (0, "megatron.upload_completed"),  # the committing rank: the object is there, no checkpoint manifest
])
def test_crash_in_the_s3_parts_commit(tmp_path, capsys, s3_server, s3_bucket, victim, point):
    """Each time: the previous step is what loads from S3 (verified, Megatron's shards); the side objects the
    ranks met through are temporary files to ``gc`` (never listed as files); the next save commits, and its
    retention removes the crashed step with them, aborting the upload it left open: no part stays behind."""
    from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

    url, options = f"s3://{s3_bucket}/ckpt", s3_server.storage_options()
    s3 = {"name": "s3", "kind": "fsspec", "url": url, "options": options, "part_size": 8 << 20, "timeout_s": 10}
    shms = [tempfile.mkdtemp(prefix="tc_s3crash_", dir="/dev/shm") for _ in range(3)]
    tier = FsspecTier("check", FsspecOptions(url=url, options=options))
    job = {"dp": WORLD, "model": S3_MODEL}
    try:
        cfg = {"run_id": f"s3c{uuid.uuid4().hex[:6]}", "layout": "megatron",
               "drain": {"mode": "thread", "commit_timeout_s": 6},
               "tiers": [{"name": "shm", "kind": "shm", "path": shms[0]}, s3]}
        saved = run_ranks(WORLD, {"config": cfg, "mode": "steps", "steps": [100], "job": job}, worker=WORKER)
        assert all(r.get("ok") == [100] for r in saved.values()), saved
        _run_with_victim({"config": _with_shm(cfg, shms[1]), "mode": "steps", "steps": [200], "job": job},
                         victim, point)
        assert not tier.exists("iter_0000200/tiered_ckpt/manifest.json")
        assert tier.read_blob("latest_checkpointed_iteration.txt").numpy().tobytes().strip() == b"100"
        merged = "iter_0000200/mp_rank_00/distrib_optim.pt"
        assert tier.exists(merged) == (point == "megatron.upload_completed")
        assert _open_uploads(tier) == ([] if point == "megatron.upload_completed" else [f"ckpt/{merged}"])
        sides = tier.temp_files()
        assert sides and all(k.startswith("iter_0000200/mp_rank_00/.distrib_optim.pt.") for k in sides), sides
        assert not [k for k in tier.list("iter_0000200") if "/." in k]  # listings never show them

        s3_only = {**cfg, "tiers": [s3]}
        loaded = run_ranks(WORLD, {"config": s3_only, "mode": "load", "job": job}, worker=WORKER)
        for r in loaded.values():
            assert "error" not in r, r
            assert r["step"] == 100 and r["verified"] is True and r["shards"] == r["expected"]
        code, out = _cli(capsys, "gc", url, "--layout", "megatron", "--json", "--min-age", "0",
                         *[f"--storage-option={k}={v}" for k, v in _flat(options).items()])
        found = {(f["what"], f["key"]) for f in json.loads(out)["found"]}
        assert {("temporary file", k) for k in sides} <= found, found

        again = run_ranks(WORLD, {"config": _with_shm(cfg, shms[2]), "mode": "steps", "steps": [300], "job": job},
                          worker=WORKER)
        assert all(r.get("ok") == [300] for r in again.values()), again
        loaded = run_ranks(WORLD, {"config": s3_only, "mode": "load", "job": job}, worker=WORKER)
        assert all(r["step"] == 300 and r["shards"] == r["expected"] for r in loaded.values()), loaded
        assert not tier.exists("iter_0000200/tiered_ckpt/manifest.json") and not tier.list("iter_0000200")
        assert tier.temp_files() == [] and _open_uploads(tier) == []
    finally:
        for d in shms:
            shutil.rmtree(d, ignore_errors=True)


def _flat(options: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in options.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out
