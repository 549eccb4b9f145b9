"""Megatron's items through the engine on gloo ranks: the megatron layout's gathered files, DP changes on
restart (re-split), TP changes refused, and checkpoints written by Megatron-LM itself."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from test_multirank import run_ranks

from tiered_ckpt.megatron import safe_load

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("megatron_worker.py")
FIXTURES = Path(__file__).parent / "data" / "megatron"


def _config(tmp_path: Path, layout: str, shm_root: str, kind: str = "fsspec") -> dict:
    # fsspec: the gather at commit; local (every rank on this node): the ranks write Megatron's file in place
    tier = ({"name": "shared", "kind": "fsspec", "url": f"file://{tmp_path / 'shared'}"} if kind == "fsspec" else
            {"name": "shared", "kind": "local", "path": str(tmp_path / "shared")})
    return {"run_id": f"meg{uuid.uuid4().hex[:6]}", "layout": layout,
            "drain": {"mode": "thread", "commit_timeout_s": 30},
            "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, tier]}


def test_megatron_layout_in_place_on_a_local_tier(tmp_path, shm_root):
    """4 gloo ranks, a local tier whose commit covers the job: every rank writes its ranges of Megatron's file
    in place (no staging files, no gather); the file is Megatron's, and the step resumes at DP 4 (each rank's
    shards read back from the merged file, verified) and re-splits at DP 2."""
    from megatron_synthetic import SyntheticJob, write_checkpoint

    cfg = _config(tmp_path, "megatron", shm_root, kind="local")
    saved = run_ranks(4, {"config": cfg, "mode": "save", "job": {"dp": 4}}, worker=WORKER)
    assert all("error" not in r for r in saved.values()), saved
    step_dir = tmp_path / "shared" / "iter_0000100"
    manifest = json.loads((step_dir / "tiered_ckpt" / "manifest.json").read_text())
    # the checkpoint manifest lists exactly the step's files, each whole; the ranks' ranges of the merged file
    # are in their rank manifests, keyed by that file
    on_disk = {str(p.relative_to(tmp_path / "shared")) for p in step_dir.rglob("*")
               if p.is_file() and "tiered_ckpt" not in p.parts}
    assert {f["key"] for f in manifest["files"]} == on_disk
    optim = [f for f in manifest["files"] if f["item"] == "distrib_optim"]
    assert [f["key"] for f in optim] == ["iter_0000100/mp_rank_00/distrib_optim.pt"]
    assert optim[0]["checksum"].startswith("crc32:") and optim[0]["meta"]["written"] == "in_place"
    assert optim[0]["size"] == (step_dir / "mp_rank_00" / "distrib_optim.pt").stat().st_size
    for rank in range(4):
        ranks = json.loads((step_dir / "tiered_ckpt" / f"rank_{rank:05d}.json").read_text())
        pieces = [f for f in ranks["files"] if "in_place" in f["meta"]]
        assert [f["key"] for f in pieces] == [optim[0]["key"]]
        assert pieces[0]["meta"]["in_place"]["plan"] == optim[0]["meta"]["plan"]
    assert not list(step_dir.glob("rank_*/distrib_optim.pt")) and not list(step_dir.rglob(".*.tmp-*"))
    reference = tmp_path / "reference"
    write_checkpoint(SyntheticJob(dp=4), str(reference), layout="megatron", manifest=False)
    theirs = reference / "iter_0000100" / "mp_rank_00" / "distrib_optim.pt"
    assert (step_dir / "mp_rank_00" / "distrib_optim.pt").read_bytes() == theirs.read_bytes()
    disk_only = {**cfg, "tiers": cfg["tiers"][1:]}  # shm still holds the snapshots: read the files
    for world in (4, 2):
        again = run_ranks(world, {"config": disk_only, "mode": "load", "job": {"dp": world}}, worker=WORKER)
        for rank, r in again.items():
            assert "error" not in r, r
            assert r["step"] == 100 and r["tier"] == "shared" and r["dp_rank"] == rank
            assert r["shards"] == r["expected"], f"DP {world}, rank {rank}: shards differ from Megatron's recipe"
            assert r["model_ok"] is True


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_layout_copies_down_from_a_tier_written_in_place(tmp_path, shm_root, world):
    """shm -> local -> a shared tier, layout megatron (the stack the docs recommend): each rank copies its part
    to the shared tier from the local one, where its ranges are in Megatron's merged file, which is in place only
    once the local tier's committing rank renamed it. The other ranks read it before that and every step failed
    on the shared tier ("no such blob"); the first rank's local commit came first by chance."""
    cfg = _config(tmp_path, "megatron", shm_root)
    cfg["tiers"].insert(1, {"name": "local", "kind": "local", "path": str(tmp_path / "local")})
    saved = run_ranks(world, {"config": cfg, "mode": "steps", "steps": [100, 200], "job": {"dp": world}},
                      worker=WORKER)
    assert all(r.get("ok") == [100, 200] and "error" not in r for r in saved.values()), saved
    for tier in ("local", "shared"):
        for step in (100, 200):
            assert (tmp_path / tier / f"iter_{step:07d}" / "tiered_ckpt" / "manifest.json").is_file(), (tier, step)
    shared = (tmp_path / "shared" / "iter_0000200" / "mp_rank_00" / "distrib_optim.pt").read_bytes()
    assert shared == (tmp_path / "local" / "iter_0000200" / "mp_rank_00" / "distrib_optim.pt").read_bytes()
    shared_only = {**cfg, "tiers": [cfg["tiers"][2]]}
    again = run_ranks(world, {"config": shared_only, "mode": "load", "job": {"dp": world}}, worker=WORKER)
    for r in again.values():
        assert "error" not in r and r["step"] == 200 and r["tier"] == "shared", r
        assert r["shards"] == r["expected"] and r["model_ok"] is True, r


def test_megatron_layout_uploads_its_parts_on_s3(tmp_path, shm_root, s3_server, s3_bucket):
    """4 gloo ranks, an S3 tier (moto's server): every rank uploads its parts of one multipart upload of
    Megatron's file, the committing rank completes it (no staging files, no gather); the object is Megatron's
    file byte for byte, and the step resumes from S3 at DP 4 (each rank's shards read back from the object,
    verified) and re-splits at DP 2."""
    from megatron_synthetic import ModelSpec, SyntheticJob, write_checkpoint

    from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

    model = {"hidden": 256, "ddp_bucket_size": None}  # 12 MiB per optimizer record: 3 MiB a rank, grouped in parts
    url = f"s3://{s3_bucket}/run"
    s3 = {"name": "shared", "kind": "fsspec", "url": url, "options": s3_server.storage_options(),
          "part_size": 8 << 20, "timeout_s": 10}
    cfg = {"run_id": f"meg{uuid.uuid4().hex[:6]}", "layout": "megatron",
           "drain": {"mode": "thread", "commit_timeout_s": 60},
           "tiers": [{"name": "shm", "kind": "shm", "path": shm_root}, s3]}
    saved = run_ranks(4, {"config": cfg, "mode": "save", "job": {"dp": 4, "model": model}}, worker=WORKER)
    assert all("error" not in r for r in saved.values()), saved
    tier = FsspecTier("check", FsspecOptions(url=url, options=s3_server.storage_options()))
    manifest = json.loads(tier.read_blob("iter_0000100/tiered_ckpt/manifest.json").numpy().tobytes())
    optim = [f for f in manifest["files"] if f["item"] == "distrib_optim"]
    assert [f["key"] for f in optim] == ["iter_0000100/mp_rank_00/distrib_optim.pt"]
    assert optim[0]["meta"]["written"] == "in_place"
    sent, uploads = [], set()
    for rank in range(4):  # each rank's spans and the parts it sent (a rank whose spans all went loose: none)
        ranks = json.loads(tier.read_blob(f"iter_0000100/tiered_ckpt/rank_{rank:05d}.json").numpy().tobytes())
        facts = [f["meta"]["in_place"] for f in ranks["files"] if "in_place" in f["meta"]]
        assert len(facts) == 1 and facts[0]["pieces"]
        sent += [p["PartNumber"] for p in facts[0]["parts"]]
        uploads.add(facts[0]["upload"])
    assert len(uploads) == 1 and sorted(sent) == list(range(1, len(sent) + 1))
    assert not [k for k in tier.list("iter_0000100") if "/rank_" in k and k.endswith("distrib_optim.pt")]
    assert tier.temp_files() == []
    reference = tmp_path / "reference"
    write_checkpoint(SyntheticJob(spec=ModelSpec(**model), dp=4), str(reference), layout="megatron",
                     manifest=False)
    theirs = (reference / "iter_0000100" / "mp_rank_00" / "distrib_optim.pt").read_bytes()
    assert tier.read_blob(optim[0]["key"]).numpy().tobytes() == theirs
    s3_only = {**cfg, "tiers": cfg["tiers"][1:]}  # shm still holds the snapshots: read the object
    for world in (4, 2):
        again = run_ranks(world, {"config": s3_only, "mode": "load", "job": {"dp": world, "model": model}},
                          worker=WORKER)
        for rank, r in again.items():
            assert "error" not in r, r
            assert r["step"] == 100 and r["tier"] == "shared" and r["dp_rank"] == rank
            assert r["shards"] == r["expected"], f"DP {world}, rank {rank}: shards differ from Megatron's recipe"
            assert r["model_ok"] is True


@pytest.mark.parametrize("layout", ["megatron", "rank_sharded"])
def test_dp_halved_restart(tmp_path, shm_root, layout):
    cfg = _config(tmp_path, layout, shm_root)
    saved = run_ranks(4, {"config": cfg, "mode": "save", "job": {"dp": 4}}, worker=WORKER)
    assert all("error" not in r for r in saved.values()), saved
    step_dir = tmp_path / "shared" / "iter_0000100"
    manifest = json.loads((step_dir / "tiered_ckpt" / "manifest.json").read_text())
    keys = {f["key"] for f in manifest["files"]}
    assert "iter_0000100/mp_rank_00/model_optim_rng.pt" in keys
    assert ("iter_0000100/mp_rank_00/distrib_optim.pt" in keys) == (layout == "megatron")

    again = run_ranks(2, {"config": cfg, "mode": "load", "job": {"dp": 2}}, worker=WORKER)
    for rank, r in again.items():
        assert "error" not in r, r
        assert r["step"] == 100 and r["tier"] == "shared" and r["dp_rank"] == rank
        assert r["shards"] == r["expected"], f"rank {rank}: re-split shards differ from Megatron's recipe"
        assert r["model_ok"] is True


def test_megatron_layout_files_are_megatrons_own(tmp_path, shm_root):
    """The gathered distrib_optim.pt equals what Megatron's writer produces, and loads with only Megatron's
    allow-list, without Megatron installed."""
    from megatron_synthetic import SyntheticJob, write_checkpoint

    cfg = _config(tmp_path, "megatron", shm_root)
    run_ranks(2, {"config": cfg, "mode": "save", "job": {"dp": 2}}, worker=WORKER)
    ours = tmp_path / "shared" / "iter_0000100" / "mp_rank_00" / "distrib_optim.pt"
    reference = tmp_path / "reference"
    write_checkpoint(SyntheticJob(dp=2), str(reference), layout="megatron", manifest=False)
    theirs = reference / "iter_0000100" / "mp_rank_00" / "distrib_optim.pt"
    assert ours.read_bytes() == theirs.read_bytes()
    model = "iter_0000100/mp_rank_00/model_optim_rng.pt"  # the same content, keys and types as Megatron's
    assert_same(safe_load.load(reference / model), safe_load.load(tmp_path / "shared" / model))
    check = textwrap.dedent(f"""
        import sys, torch
        assert "megatron" not in sys.modules
        state = torch.load({str(ours)!r}, weights_only=True)
        assert isinstance(state, dict) and state
    """)
    subprocess.run([sys.executable, "-c", check], check=True, cwd="/")


def test_tp_change_refused_for_megatron_items(tmp_path, shm_root):
    cfg = _config(tmp_path, "rank_sharded", shm_root)
    run_ranks(4, {"config": cfg, "mode": "save", "job": {"tp": 2, "dp": 2}}, worker=WORKER)
    again = run_ranks(4, {"config": cfg, "mode": "load", "job": {"tp": 1, "dp": 4}}, worker=WORKER)
    for r in again.values():
        assert "LayoutMismatchError" in r["error"] and "TP 2 → 1" in r["error"], r


@pytest.mark.parametrize("world", [4, 2])
def test_checkpoint_written_by_megatron_loads_at_any_dp(tmp_path, shm_root, world):
    """The fixture was written by Megatron-LM (no manifest): it loads, re-split to DP=world, unverified."""
    import shutil

    ckpt = tmp_path / "megatron-ckpt"
    shutil.copytree(FIXTURES / "dp4_tp1_pp1" / "iter_0000010", ckpt / "iter_0000010")
    shutil.copy(FIXTURES / "dp4_tp1_pp1" / "latest_checkpointed_iteration.txt", ckpt)
    cfg = {"run_id": f"leg{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(ckpt)}]}
    results = run_ranks(world, {"config": cfg, "mode": "legacy"}, worker=WORKER)
    expected_dir = FIXTURES / "dp4_tp1_pp1" / ("local_shards" if world == 4 else f"reload_dp{world}/local_shards")
    for rank, r in results.items():
        assert "error" not in r, r
        assert r["step"] == 10 and r["verified"] is False
        want = torch.load(expected_dir / f"rank_{rank:05d}.pt", weights_only=True)
        assert r["shards"] == {k: _sha(v) for k, v in sorted(want.items())}


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_saving_into_the_directory_megatron_wrote_keeps_its_checkpoint(tmp_path, capsys):
    """A job that switches to tiered_ckpt keeps its --save directory: Megatron-LM's own iter_0000010 (no manifest
    of ours) is not debris to retention or gc however many steps are committed after it, and ls says who wrote
    it. A partial step of ours (a rank manifest, no checkpoint manifest) older than the newest commit still goes."""
    import shutil

    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.cli import main

    ckpt = tmp_path / "megatron-ckpt"
    shutil.copytree(FIXTURES / "dp4_tp1_pp1" / "iter_0000010", ckpt / "iter_0000010")
    shutil.copy(FIXTURES / "dp4_tp1_pp1" / "latest_checkpointed_iteration.txt", ckpt)
    theirs = sorted(p.relative_to(ckpt) for p in (ckpt / "iter_0000010").rglob("*"))
    assert main(["inspect", str(ckpt)]) == 3  # nothing of ours to inspect: say what is there instead
    err = capsys.readouterr().err
    assert "no committed checkpoint of tiered_ckpt, only step(s) 10 written by Megatron-LM or DLRover" in err, err
    assert main(["verify", str(ckpt), "--json"]) == 0  # checked as far as Megatron's files allow
    report = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["ok"], r["files"]) for r in report] == [(10, True, 2)], report
    assert report[0]["checked_against"].startswith("zip CRC-32s"), report
    ours_partial = ckpt / "iter_0000015" / "tiered_ckpt" / "rank_00000.json"
    ours_partial.parent.mkdir(parents=True)
    ours_partial.write_text("{}")
    cfg = {"run_id": f"mix{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(ckpt), "keep": 1}]}
    with CheckpointEngine(cfg) as engine:
        for step in (20, 30, 40):
            engine.save(step, {"state": {"w": torch.full((8,), float(step))}}).wait(timeout=60)
        engine.wait(60)
    assert sorted(p.relative_to(ckpt) for p in (ckpt / "iter_0000010").rglob("*")) == theirs
    assert not (ckpt / "iter_0000015").exists() and not (ckpt / "iter_0000020").exists()
    assert main(["ls", str(ckpt), "--json"]) == 0
    rows = {r["step"]: r["state"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {10: "megatron, no manifest (written by Megatron-LM or DLRover)",
                    40: "committed"}, rows
    assert main(["gc", str(ckpt), "--json", "--min-age", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["found"] == []


def test_a_save_that_failed_before_its_rank_manifest_is_debris(tmp_path, monkeypatch):
    """A save that failed once its Megatron-named model file was in place, before any manifest, left a directory
    that passed for Megatron-LM's and was kept for ever. Each rank's marker under tiered_ckpt/, written before its
    first file, makes it ours: the next commit's retention removes it."""
    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.file_store import FileStore
    from tiered_ckpt.layouts.foreign import foreign_step_dirs
    from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

    publish_rank = FileStore._publish_rank

    def fail_step_20(self, step, coords, entries, *rest):
        if step == 20:
            raise OSError("the disk went away after the model file")
        return publish_rank(self, step, coords, entries, *rest)

    monkeypatch.setattr(FileStore, "_publish_rank", fail_step_20)
    cfg = {"run_id": f"fail{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path), "keep": 1}]}
    with CheckpointEngine(cfg) as engine:
        with pytest.raises(Exception, match="the disk went away"):
            engine.save(20, {"model_optim_rng": {"w": torch.ones(8)}}).wait(timeout=60)
        failed = tmp_path / "iter_0000020"
        assert (failed / "mp_rank_00" / "model_optim_rng.pt").is_file()
        assert (failed / "tiered_ckpt" / "rank_00000.started").is_file()
        assert not foreign_step_dirs(FsspecTier("t", FsspecOptions(url=str(tmp_path))).list(""))
        engine.save(30, {"model_optim_rng": {"w": torch.zeros(8)}}).wait(timeout=60)
        with pytest.raises(Exception, match="step 20 on tier 'disk'"):  # reported again, never lost
            engine.wait(60)
    assert not failed.exists()
    assert (tmp_path / "iter_0000030" / "tiered_ckpt" / "manifest.json").is_file()


def test_a_failed_save_of_ours_under_megatron_names_is_still_debris(tmp_path):
    """Our layouts use Megatron's file names: a step directory without any manifest is ours (debris) when its
    rank file has our rank-shard format or an unfinished write of ours is there, Megatron's or DLRover's when not."""
    from tiered_ckpt.layouts.foreign import MEGATRON_STATE, foreign_step_dirs
    from tiered_ckpt.megatron import rank_shard
    from tiered_ckpt.tiers._files import temp_name
    from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

    def put(rel: str, obj: object) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)

    put("iter_0000010/mp_rank_00/model_optim_rng.pt", {"iteration": 10})  # ours: rank file in our format
    put("iter_0000010/rank_00000/distrib_optim.pt", {"format": rank_shard.FORMAT})
    put("iter_0000020/mp_rank_00/model_optim_rng.pt", {"iteration": 20})  # DLRover's: another rank format
    put("iter_0000020/rank_00000/distrib_optim.pt", {"optimizer": {"state": {}}})
    put("iter_0000030/mp_rank_00/model_optim_rng.pt", {"iteration": 30})  # ours: an unfinished write beside it
    (tmp_path / "iter_0000030" / "mp_rank_00" / temp_name("distrib_optim.pt")).write_bytes(b"x")
    put("iter_0000040/mp_rank_00/model_optim_rng.pt", {"iteration": 40})  # Megatron-LM's
    put("iter_0000050/rank_00000/distrib_optim.pt", {"optimizer": {"state": {}}})  # damaged: cannot tell, kept
    damaged = tmp_path / "iter_0000050" / "rank_00000" / "distrib_optim.pt"
    damaged.write_bytes(damaged.read_bytes()[:-30])
    tier = FsspecTier("t", FsspecOptions(url=str(tmp_path)))
    keys = tier.list("")
    kept = ("iter_0000020", "iter_0000040", "iter_0000050")
    assert foreign_step_dirs(keys, tier) == dict.fromkeys(kept, MEGATRON_STATE)
    assert set(foreign_step_dirs(keys)) == {f"iter_00000{n}0" for n in range(1, 6)}


@pytest.mark.parametrize("dp", [1, 4])
def test_per_rank_items_are_refused_on_a_dp_change_never_dropped(tmp_path, dp):
    """A dataloader's state saved per rank has no meaning at another DP size (users lost it silently on a DP
    shrink elsewhere): the load is refused, naming the item and the change, on every rank."""
    from tiered_ckpt import CheckpointEngine, ParallelLayout
    from tiered_ckpt.errors import LayoutMismatchError

    def cfg() -> dict:
        return {"run_id": f"dp{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread", "commit_timeout_s": 20},
                "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path), "fsync": False}]}

    saving = cfg()
    engines = [CheckpointEngine(saving, ParallelLayout(dp=2), rank=r) for r in range(2)]
    handles = [e.save(5, {"dataloader": {"consumed": torch.tensor(100 + r)}}) for r, e in enumerate(engines)]
    for h in handles:
        h.wait(timeout=60)
    for e in engines:
        e.close()
    for rank in sorted({0, dp - 1}):
        with CheckpointEngine(cfg(), ParallelLayout(dp=dp), rank=rank) as engine:
            with pytest.raises(LayoutMismatchError) as info:
                engine.load()
            msg = str(info.value)
            assert f"DP 2 → {dp}" in msg and "items ['dataloader'] were saved per rank" in msg, msg


@pytest.mark.parametrize(("layout", "ckpt_format", "warned"), [("rank_sharded", "torch", True),
                                                                 ("megatron", "torch", False),
                                                                 ("dcp", "torch_dist", False)])
def test_the_drop_in_says_when_plain_megatron_cannot_load_what_it_writes(tmp_path, caplog, layout, ckpt_format,
                                                                         warned):
    """Trial: with the default layout the drop-in wrote rank_RRRRR/distrib_optim.pt and Megatron-LM's own load
    failed on mp_rank_00/distrib_optim.pt, with no word from us at start."""
    import argparse

    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.megatron.adapter import _warn_if_elsewhere

    save = tmp_path / "ckpt"
    cfg = {"run_id": f"w{uuid.uuid4().hex[:8]}", "layout": layout, "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(save)}]}
    args = argparse.Namespace(save=str(save), load=str(save), ckpt_format=ckpt_format)
    with CheckpointEngine(cfg) as engine, caplog.at_level("WARNING", logger="tiered_ckpt"):
        _warn_if_elsewhere(engine, args)
    said = [r.getMessage() for r in caplog.records if "plain Megatron-LM does not" in r.getMessage()]
    assert bool(said) == warned, caplog.text
    if warned:
        assert "Set layout: megatron" in said[0] and "tiered-ckpt convert --to megatron" in said[0]
    assert "is not the directory of any file tier" not in caplog.text  # --save is the tier's directory


def test_a_pipeline_size_change_is_refused_with_advice_about_the_layout_not_the_tier(tmp_path):
    """Trial: loading a PP 2 checkpoint Megatron-LM wrote (no manifest of ours) in a PP 1 job said what changed,
    then advised "Some reads failed with the tier's errors, not proven damage: load again once the tier
    answers", which no retry would ever fix."""
    from megatron_synthetic import SyntheticJob, write_checkpoint

    ckpt = tmp_path / "theirs"
    write_checkpoint(SyntheticJob(dp=1, pp=2), str(ckpt), layout="megatron", manifest=False)
    cfg = {"run_id": f"meg{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "megatron", "kind": "fsspec", "url": f"file://{ckpt}"}]}
    again = run_ranks(2, {"config": cfg, "mode": "legacy"}, worker=WORKER)  # PP 1, DP 2
    for rank, r in again.items():
        error = r.get("error", "")
        assert "CheckpointUnreadableError" in error and "PP 2 → 1" in error, (rank, r)
        assert "saved with another parallel layout than this job's" in error, (rank, r)
        assert "load again once the tier answers" not in error, (rank, r)


def _megatron_dir(tmp_path: Path) -> Path:
    import shutil

    ckpt = tmp_path / "megatron-ckpt"
    shutil.copytree(FIXTURES / "dp2_tp1_pp2" / "iter_0000010", ckpt / "iter_0000010")
    shutil.copy(FIXTURES / "dp2_tp1_pp2" / "latest_checkpointed_iteration.txt", ckpt)
    return ckpt


def test_verify_checks_a_step_megatron_wrote_against_its_zip_crcs(tmp_path, capsys):
    """A step Megatron-LM wrote has no manifest of ours: verify said only that (exit 3), though torch writes a
    CRC-32 for every record of its files. It checks those now, and Megatron's allow-list on each pickle: a byte
    flipped in a tensor, or a file cut short, fails the step and names the file and record."""
    from tiered_ckpt.cli import main

    ckpt = _megatron_dir(tmp_path)
    assert main(["verify", str(ckpt)]) == 0
    assert "OK  tier" in capsys.readouterr().out
    optim = ckpt / "iter_0000010" / "mp_rank_00_001" / "distrib_optim.pt"
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0x10
    optim.write_bytes(data)
    model = ckpt / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    model.write_bytes(model.read_bytes()[:-4096])
    assert main(["verify", str(ckpt), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["step"] == 10 and not report["ok"] and report["files"] == 3, report  # one could not be read
    assert any("mp_rank_00_001/distrib_optim.pt: record distrib_optim/data/" in p and "CRC-32" in p
               for p in report["problems"]), report
    assert any("mp_rank_00_000/model_optim_rng.pt: not a readable torch file" in p for p in report["problems"]), report


def test_verify_all_checks_megatron_s_steps_beside_ours_and_says_when_a_file_has_no_crcs(tmp_path, capsys):
    """A job that switched to tiered_ckpt in Megatron's --save directory: --all verifies both kinds, --step picks
    either. A torch file written without CRC-32s (torch's config.save.compute_crc32 = False) is checked for its
    structure and pickle, with a note, not failed."""
    from torch.utils.serialization import config as serialization_config

    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.cli import main

    ckpt = _megatron_dir(tmp_path)
    cfg = {"run_id": f"mix{uuid.uuid4().hex[:6]}", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(ckpt)}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(20, {"state": {"w": torch.full((8,), 20.0)}}).wait(timeout=60)
    optim = ckpt / "iter_0000010" / "mp_rank_00_000" / "distrib_optim.pt"
    content = torch.load(optim, weights_only=True)
    before = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        torch.save(content, optim)
    finally:
        serialization_config.save.compute_crc32 = before
    assert main(["verify", str(ckpt), "--all", "--json"]) == 0
    report = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(report) == [10, 20] and report[20]["checked_against"] == "manifest", report
    assert report[10]["ok"] and report[10]["files"] == 4, report[10]
    assert "written without CRC-32s" in report[10]["notes"][0] and "mp_rank_00_000" in report[10]["notes"][0]
    assert main(["verify", str(ckpt), "--json"]) == 0  # the newest of ours, as load() would read
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [20]
    assert main(["verify", str(ckpt), "--step", "10", "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [10]


def test_a_step_of_unverified_origin_loads_unverified_at_another_dp_size_too(tmp_path):
    """Files drained from a snapshot whose checksums were never taken (its process died first) carry
    ``origin: unverified``, and loads of them say verified=False. A load at another DP size re-splits them and
    said verified=True (found by a review)."""
    from megatron_synthetic import SyntheticJob, write_checkpoint

    from tiered_ckpt import CheckpointEngine
    from tiered_ckpt.manifest import dump_with_digest
    from tiered_ckpt.parallel import ParallelLayout

    write_checkpoint(SyntheticJob(dp=2), tmp_path, layout="rank_sharded", manifest=True)
    cfg = {"run_id": f"o{uuid.uuid4().hex[:6]}", "layout": "rank_sharded", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path)}]}
    with CheckpointEngine(cfg, ParallelLayout(dp=1), rank=0) as engine:
        assert engine.load().verified  # as written: every file checked against its manifest
    key = tmp_path / "iter_0000100" / "tiered_ckpt" / "manifest.json"
    doc = json.loads(key.read_text())
    doc.pop("digest")
    doc["files"][0]["meta"] = {**doc["files"][0].get("meta", {}), "origin": "unverified"}  # one old rank's file
    key.write_bytes(dump_with_digest(doc))
    with CheckpointEngine(cfg, ParallelLayout(dp=1), rank=0) as engine:
        got = engine.load()
        assert got.step == 100 and not got.verified


def test_verify_checks_the_step_megatron_s_tracker_names(tmp_path):
    """Megatron-LM writes its tracker last: a newer directory whose save it never finished is not the step load()
    reads. verify without --step checks the tracker's step (found by a review)."""
    import shutil

    from tiered_ckpt.cli import main

    ckpt = _megatron_dir(tmp_path)
    shutil.copytree(ckpt / "iter_0000010", ckpt / "iter_0000020")
    optim = next((ckpt / "iter_0000020").rglob("distrib_optim.pt"))
    optim.write_bytes(optim.read_bytes()[:1000])  # the crash
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert main(["verify", str(ckpt)]) == 0
    assert main(["verify", str(ckpt), "--step", "20"]) == 1
    assert main(["verify", str(ckpt), "--all"]) == 1
