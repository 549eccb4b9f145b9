"""convert(): Megatron's checkpoints <-> rank_sharded, re-split at other DP sizes, bit for bit against Megatron."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from megatron_fixtures import (
    CONFIGS,
    ITER_DIR,
    RELOADS,
    bits,
    copy_checkpoint,
    fixture_rank_shard,
    local_shards,
    oracle_split,
    truth,
)
from megatron_synthetic import ModelSpec, SyntheticJob, write_checkpoint

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.errors import ConfigError, CorruptionError
from tiered_ckpt.file_streams import checked_pieces
from tiered_ckpt.megatron import convert as convert_module
from tiered_ckpt.megatron import legacy
from tiered_ckpt.megatron.convert import convert
from tiered_ckpt.megatron.distrib_optim import merge_shards
from tiered_ckpt.megatron.rank_shard import dp_group
from tiered_ckpt.parallel import ParallelLayout
from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier
from tiered_ckpt.tiers.local import LocalOptions, LocalTier


def _rank_file(root: Path, step_dir: str, rank: int) -> dict:
    return torch.load(root / step_dir / f"rank_{rank:05d}" / "distrib_optim.pt", weights_only=True)


def _assert_committed(root: Path, step: int, files: int) -> None:
    """Our manifest lists every file with a checksum that matches, and the tracker names the step."""
    tier = LocalTier("check", LocalOptions(path=str(root)))
    info = legacy.detect(tier)
    assert info.has_manifest and info.iteration == step and (root / "latest_checkpointed_iteration.txt").read_text() \
        == str(step)
    from tiered_ckpt.manifest import load_checkpoint

    manifest = load_checkpoint((root / info.step_dir / "tiered_ckpt" / "manifest.json").read_bytes())
    assert len(manifest.files) == files
    for entry in manifest.files:
        for _ in checked_pieces(tier, entry.key, entry):  # raises on a mismatch
            pass


def _megatron_files_identical(root: Path, config: str) -> None:
    for key, meta in truth(config)["files"].items():
        if key.startswith(ITER_DIR):
            assert hashlib.sha256((root / key).read_bytes()).hexdigest() == meta["sha256"], key


# ------------------------------------------------------------------------------------------------------------
# Megatron's own checkpoints


@pytest.mark.parametrize("config", CONFIGS)
def test_fixture_to_rank_sharded_and_back(tmp_path: Path, config: str) -> None:
    t = truth(config)
    src = copy_checkpoint(config, tmp_path / "megatron")
    report = convert(src, tmp_path / "rs", to="rank_sharded", progress=False)
    assert (report.source_layout, report.source_writer, report.source_verified) == ("megatron", "megatron", False)
    assert report.source_checked == "zip CRC-32s" and any("no checksums of ours" in n for n in report.notes)
    for rank in range(t["world_size"]):
        got = _rank_file(tmp_path / "rs", ITER_DIR, rank)
        assert_same(fixture_rank_shard(config, rank), got)  # exactly Megatron's local shards, and its geometry
    items = legacy.load_rank_items(LocalTier("rs", LocalOptions(path=str(tmp_path / "rs"))), 10,
                                   ParallelLayout(tp=t["tp"], pp=t["pp"], dp=t["dp"]).coords(1))
    assert items.verified and isinstance(items["model_optim_rng"]["args"], argparse.Namespace)
    _assert_committed(tmp_path / "rs", 10, len(report.files))
    back = convert(tmp_path / "rs", tmp_path / "back", to="megatron", progress=False)
    assert back.source_verified and back.source_layout == "rank_sharded"
    _megatron_files_identical(tmp_path / "back", config)  # distrib_optim.pt and model_optim_rng.pt, byte for byte
    _assert_committed(tmp_path / "back", 10, len(back.files))
    # The job it is meant for (same DP) loads every rank's optimizer shard from it, in either engine layout (a
    # new-user trial: load() returned no distrib_optim item, and Megatron trained on uninitialised state)
    layout = ParallelLayout(tp=t["tp"], pp=t["pp"], dp=t["dp"])
    for engine_layout in ("megatron", "rank_sharded"):
        for rank in range(t["world_size"]):
            cfg = {"run_id": f"back-{uuid.uuid4().hex[:8]}", "layout": engine_layout,
                   "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "back")}]}
            with CheckpointEngine(cfg, layout, rank=rank) as engine:
                loaded = engine.load()
            assert loaded.verified, (engine_layout, rank)
            assert_same(fixture_rank_shard(config, rank), loaded.items["distrib_optim"])


@pytest.mark.parametrize(("config", "dp"), RELOADS)
def test_fixture_resplit_gives_megatrons_reload(tmp_path: Path, config: str, dp: int) -> None:
    src = copy_checkpoint(config, tmp_path / "megatron")
    report = convert(src, tmp_path / "rs", to="rank_sharded", dp=dp, progress=False)
    assert report.topology["dp"] == dp
    for rank in range(dp * truth(config)["pp"]):
        (opt,) = _rank_file(tmp_path / "rs", ITER_DIR, rank)["optimizers"]
        want = local_shards(config, rank, dp)
        assert list(opt["shards"]) == list(want)
        for k in want:
            assert torch.equal(bits(opt["shards"][k]), bits(want[k])), (rank, k)
    convert(tmp_path / "rs", tmp_path / "back", to="megatron", progress=False)
    _megatron_files_identical(tmp_path / "back", config)


def test_megatron_to_megatron_is_a_verified_copy(tmp_path: Path) -> None:
    convert(copy_checkpoint("dp4_tp1_pp1", tmp_path / "m"), tmp_path / "ours", to="megatron", progress=False)
    report = convert(tmp_path / "ours", tmp_path / "copy", to="megatron", dp=2, progress=False)
    assert report.source_verified and report.topology["dp"] == 2
    _megatron_files_identical(tmp_path / "copy", "dp4_tp1_pp1")  # DP does not change Megatron's files
    geometry = json.loads((tmp_path / "copy" / ITER_DIR / "tiered_ckpt" / "manifest.json").read_text())
    optim = next(f for f in geometry["files"] if f["item"] == "distrib_optim")
    unpadded = truth("dp4_tp1_pp1")["ranks"]["0"]["per_bucket_numel_unpadded"][0]["float32,float32"]
    assert optim["meta"]["optimizers"][0]["geometry"]["buffers"][0]["numel_unpadded"] == unpadded
    path = tmp_path / "ours" / ITER_DIR / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="mp_rank_00/model_optim_rng.pt.*checksum mismatch"):
        convert(tmp_path / "ours", tmp_path / "copy2", to="megatron", progress=False)
    assert not (tmp_path / "copy2" / ITER_DIR / "tiered_ckpt" / "manifest.json").exists()
    assert not (tmp_path / "copy2" / ITER_DIR / "mp_rank_00" / "model_optim_rng.pt").exists()


# ------------------------------------------------------------------------------------------------------------
# synthetic jobs: a grid of layouts, against Megatron's load recipe written out in the test


GRID = [dict(tp=1, pp=4, dp=2), dict(tp=2, pp=2, dp=2), dict(tp=2, pp=1, dp=1, ep=2)]


def _job(cfg: dict) -> SyntheticJob:
    spec = ModelSpec(num_layers=4, hidden=64, num_experts=4 if cfg.get("ep") else None)
    return SyntheticJob(spec, seed=7, **cfg)


@pytest.mark.parametrize("cfg", GRID, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_grid_save_merge_and_resplit(tmp_path: Path, cfg: dict) -> None:
    job = _job(cfg)
    write_checkpoint(job, tmp_path / "saved")  # what the adapter leaves: rank_sharded with our manifest
    convert(tmp_path / "saved", tmp_path / "megatron", to="megatron", progress=False)
    step_dir = f"iter_{job.iteration:07d}"
    worlds = {}
    for shard in job.shards():
        d = job.mp_dir(shard)
        got = torch.load(tmp_path / "megatron" / step_dir / d / "distrib_optim.pt", weights_only=True)
        states = got if isinstance(got, list) else [got]
        for i, kind in enumerate(job.kinds()):
            group = dp_group(job.topology, job.writer_rank(shard), kind)
            if job.topology.rank_dir(group[0]) != d:
                assert states[i] is None
                continue
            want = merge_shards([job.local_shards(r, kind) for r in group], job.geometry(shard, kind))
            assert_same(want, states[i])
            worlds[(d, kind)] = states[i]
    for dp in (1, 2, 4):
        if dp % job.ep:
            continue
        out = tmp_path / f"dp{dp}"
        report = convert(tmp_path / "megatron", out, to="rank_sharded", dp=dp, progress=False)
        topo = legacy.detect(LocalTier("o", LocalOptions(path=str(out)))).topology
        assert topo.dp * topo.ep == dp and report.source_verified
        for rank in range(topo.world_size):
            obj = _rank_file(out, step_dir, rank)
            for i, kind in enumerate(job.kinds()):
                sub = obj["optimizers"][i]
                group = dp_group(topo, rank, kind)
                assert (sub["kind"], sub["group"], sub["dp_rank"]) == (kind, group, group.index(rank))
                owner = topo.rank_dir(group[0])
                geo = job.geometry(job.shard_of(job.topology.rank_of(**{
                    d: getattr(topo.position(rank), d) for d in ("tp", "pp", "ep")})), kind)
                for g, buf in enumerate(geo.buffers):
                    (dtype_key, entry), = worlds[(owner, kind)][g].items()
                    unpadded = [k.numel_unpadded for k in buf.buckets]
                    for key in geo.state_keys:
                        parts = oracle_split(entry[key], unpadded, len(group), group.index(rank))
                        for b, part in enumerate(parts):
                            assert torch.equal(bits(sub["shards"][f"gbuf{g}/bucket{b}/{key}"]), bits(part)), \
                                (dp, rank, kind, g, b, key)


def test_other_items_go_along_at_the_same_dp_and_are_named_when_left_out(tmp_path: Path) -> None:
    """A rank's own item besides Megatron's (a dataloader's position) is copied by every conversion that keeps
    the DP size, both ways; at another DP it has no new owner, and the report says it was left out."""
    job = _job(dict(tp=1, pp=1, dp=2))
    write_checkpoint(job, tmp_path / "saved", extra=lambda r: {"position": torch.tensor([r, 7]), "epoch": 3})
    step_dir = f"iter_{job.iteration:07d}"
    names = [f"{step_dir}/rank_{r:05d}/extra.flat" for r in range(2)]
    report = convert(tmp_path / "saved", tmp_path / "m", to="megatron", progress=False)
    assert sorted(f["key"] for f in report.files if f["item"] == "extra") == names
    back = convert(tmp_path / "m", tmp_path / "rs", to="rank_sharded", progress=False)
    assert back.source_verified and sorted(f["key"] for f in back.files if f["item"] == "extra") == names
    for name in names:  # the flat encoding is deterministic: copied as it was, twice
        assert (tmp_path / "rs" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes()
    manifest = json.loads((tmp_path / "rs" / step_dir / "tiered_ckpt" / "manifest.json").read_text())
    assert {f["codec"] for f in manifest["files"] if f["item"] == "extra"} == {"flat"}

    resplit = convert(tmp_path / "saved", tmp_path / "dp1", to="rank_sharded", dp=1, progress=False)
    assert not any(f["item"] == "extra" for f in resplit.files)
    assert any("not converted: extra" in n and "DP 2" in n for n in resplit.notes), resplit.notes


def test_rank_sharded_resplit_without_megatron_files(tmp_path: Path) -> None:
    """rank_sharded -> rank_sharded at a new DP reads the rank files as Megatron's world tensors directly."""
    job = _job(dict(tp=1, pp=2, dp=2))
    write_checkpoint(job, tmp_path / "saved")
    convert(tmp_path / "saved", tmp_path / "direct", to="rank_sharded", dp=4, progress=False)
    convert(tmp_path / "saved", tmp_path / "m", to="megatron", progress=False)
    convert(tmp_path / "m", tmp_path / "via", to="rank_sharded", dp=4, progress=False)
    for rank in range(8):
        assert_same(_rank_file(tmp_path / "via", "iter_0000100", rank),
                    _rank_file(tmp_path / "direct", "iter_0000100", rank))


def test_megatron_written_moe_geometry_is_recomputed(tmp_path: Path) -> None:
    job = _job(dict(tp=2, pp=2, dp=1, ep=2))
    write_checkpoint(job, tmp_path / "m", layout="megatron", manifest=False)  # as Megatron-LM would
    report = convert(tmp_path / "m", tmp_path / "rs", to="rank_sharded", progress=False)
    assert not report.source_verified
    for rank in job.iter_ranks():
        assert_same(job.rank_shard(rank), _rank_file(tmp_path / "rs", "iter_0000100", rank))


def test_any_tier(tmp_path: Path) -> None:
    url = f"memory://convert-test/{uuid.uuid4().hex}"
    convert(copy_checkpoint("dp2_tp1_pp2", tmp_path / "m"), url, to="rank_sharded", dp=4, progress=False)
    tier = FsspecTier("mem", FsspecOptions(url=url))
    assert legacy.detect(tier).has_manifest
    convert(tier, tmp_path / "back", to="megatron", progress=False)
    _megatron_files_identical(tmp_path / "back", "dp2_tp1_pp2")


def test_refusals(tmp_path: Path) -> None:
    src = copy_checkpoint("dp2_tp1_pp2", tmp_path / "m")
    with pytest.raises(ConfigError, match="to: expected one of"):
        convert(src, tmp_path / "x", to="torch_dist")
    with pytest.raises(ConfigError, match="dp: expected a positive integer"):
        convert(src, tmp_path / "x", to="megatron", dp=0)
    convert(src, tmp_path / "x", to="megatron", progress=False)
    with pytest.raises(ConfigError, match="already exists"):
        convert(src, tmp_path / "x", to="megatron", progress=False)
    with pytest.raises(ConfigError, match="not a multiple of EP=2"):
        job = _job(dict(tp=1, pp=1, dp=1, ep=2))
        write_checkpoint(job, tmp_path / "moe")
        convert(tmp_path / "moe", tmp_path / "y", to="rank_sharded", dp=3, progress=False)


def _flip_a_tensor_byte(path: Path) -> None:
    """Flip one byte inside a tensor record (well past the pickle), as a bad disk or a bad copy would."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_megatron_written_source_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    """A Megatron-LM checkpoint has no manifest, but torch writes each record's CRC-32 into the file's zip directory
    (torch.load checks none of them): convert checks them first, so that a flipped bit never leaves with our
    checksums vouching for it (a Megatron user's trial: the damaged file was converted, then passed verify)."""
    src = copy_checkpoint("dp4_tp1_pp1", tmp_path / "m")
    _flip_a_tensor_byte(src / ITER_DIR / "mp_rank_00" / "distrib_optim.pt")
    with pytest.raises(CorruptionError, match=r"mp_rank_00/distrib_optim\.pt: record .*CRC-32.*nothing was converted"):
        convert(src, tmp_path / "rs", to="rank_sharded", dp=2, progress=False)
    assert not (tmp_path / "rs").exists() or not any((tmp_path / "rs").rglob("*.pt"))
    assert cli_main(["convert", str(src), str(tmp_path / "rs2"), "--to", "megatron"]) == 1
    assert "do not match the CRC-32" in capsys.readouterr().err
    assert not (tmp_path / "rs2").exists() or not any((tmp_path / "rs2").rglob("*.pt"))


@pytest.mark.parametrize("lost", ["mp_rank_01", "mp_rank_01/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"])
def test_an_incomplete_megatron_written_step_is_refused_by_convert_and_failed_by_verify(
        tmp_path: Path, capsys: pytest.CaptureFixture, lost: str) -> None:
    """A user's trial: a TP=2 checkpoint Megatron-LM wrote, with one TP rank's directory (or one of its files) gone
    (a copy cut short). The names alone passed for TP=1, and a missing distrib_optim.pt was skipped: convert wrote
    half a model (or no optimizer state for a TP rank), exit 0, our checksums vouching for it; verify said OK. The
    args' TP size and the files every mp_rank_* directory holds now tell it incomplete."""
    import shutil

    src = tmp_path / "m"
    write_checkpoint(SyntheticJob(tp=2, dp=2, iteration=100), src, layout="megatron", manifest=False)
    lost_path = src / "iter_0000100" / lost
    shutil.rmtree(lost_path) if lost_path.is_dir() else lost_path.unlink()
    want = "missing mp_rank_01" if lost == "mp_rank_01" else f"incomplete checkpoint, missing {lost}"
    for to in ("megatron", "rank_sharded"):
        dst = tmp_path / f"to_{to}"
        assert cli_main(["convert", str(src), str(dst), "--to", to]) == 1
        err = capsys.readouterr().err
        assert want in err and "iter_0000100" in err, err
        assert not dst.exists() or not any(dst.rglob("*.pt"))
    assert cli_main(["verify", str(src)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and want in out, out


def test_convert_of_a_step_that_is_not_there_names_the_steps_that_are(tmp_path: Path, capsys) -> None:
    src = tmp_path / "m"
    write_checkpoint(SyntheticJob(tp=1, dp=2, iteration=100), src, layout="megatron", manifest=False)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", "rank_sharded", "--step", "99"]) == 3
    assert "step 99 was asked for, but this step directory is missing or empty (step directories there: 100)" \
        in capsys.readouterr().err


def test_a_failed_convert_leaves_no_directory_it_created_and_a_good_one_says_nothing_of_mounts(
        tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """A user's trial: a convert refused (a damaged source) left the destination's new directories behind."""
    import logging

    src = copy_checkpoint("dp4_tp1_pp1", tmp_path / "m")
    good = tmp_path / "good"
    write_checkpoint(SyntheticJob(tp=1, dp=2, iteration=100), good, layout="megatron", manifest=False)
    _flip_a_tensor_byte(src / ITER_DIR / "mp_rank_00" / "distrib_optim.pt")
    (tmp_path / "kept").mkdir()
    for dst in (tmp_path / "new" / "a" / "b", tmp_path / "kept" / "a"):
        assert cli_main(["convert", str(src), str(dst), "--to", "rank_sharded"]) == 1
    assert not (tmp_path / "new").exists() and list((tmp_path / "kept").iterdir()) == []
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert cli_main(["convert", str(good), str(tmp_path / "new" / "a" / "b"), "--to", "rank_sharded"]) == 0
    assert not [r for r in caplog.records if "mounted" in r.getMessage()]
    assert (tmp_path / "new" / "a" / "b" / "latest_checkpointed_iteration.txt").exists()


def test_a_source_written_without_crcs_is_converted_and_said_unchecked(tmp_path: Path) -> None:
    write_checkpoint(_job(dict(tp=1, pp=1, dp=2)), tmp_path / "m", layout="megatron", manifest=False)
    from torch.utils.serialization import config as serialization

    was = serialization.save.compute_crc32
    serialization.save.compute_crc32 = False  # every record's CRC-32 written as 0
    try:
        for path in (tmp_path / "m").rglob("*.pt"):
            torch.save(torch.load(path, weights_only=False), path)
    finally:
        serialization.save.compute_crc32 = was
    report = convert(tmp_path / "m", tmp_path / "rs", to="rank_sharded", progress=False)
    assert (report.source_verified, report.source_checked) == (False, "")
    assert any("without CRC-32s" in n for n in report.notes)


# ------------------------------------------------------------------------------------------------------------
# Megatron's side: plain torch.load with Megatron's allow-list, Megatron not installed

_PLAIN_LOAD = """
import argparse, json, sys
import numpy as np, torch
from numpy._core.multiarray import _reconstruct
sys.modules["megatron"] = None  # a reader without Megatron (megatron-core is a test dependency here)
# What megatron.core registers (docs/megatron-format.md, "What Megatron pickles (safe loading)"), minus its own classes:
# these files hold none.
torch.serialization.add_safe_globals([argparse.Namespace, _reconstruct, np.ndarray, np.dtype,
                                      type(np.dtype("uint32"))])
out = {}
for path in sys.argv[1:]:
    obj = torch.load(path, map_location="cpu")  # Megatron's call; weights_only=True by default on torch >= 2.6
    if "args" in obj:
        bad = {k: type(v).__name__ for k, v in vars(obj["args"]).items()
               if not isinstance(v, (int, float, str, bool, type(None), torch.dtype, list, tuple))}
        out[path] = {"keys": list(obj), "bad_args": bad, "ns": type(obj["args"]).__name__}
    else:
        out[path] = {"keys": [str(k) for k in (obj if isinstance(obj, dict) else obj[0] or obj[1])]}
print(json.dumps(out))
"""


def test_megatron_layout_loads_with_plain_torch_load(tmp_path: Path) -> None:
    job = _job(dict(tp=2, pp=1, dp=1, ep=2))
    write_checkpoint(job, tmp_path / "rs")
    convert(tmp_path / "rs", tmp_path / "m", to="megatron", progress=False)
    files = sorted(str(p) for p in (tmp_path / "m").rglob("*.pt"))
    proc = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, *files], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    models = [v for k, v in result.items() if k.endswith("model_optim_rng.pt")]
    assert len(models) == 4 and all(m["ns"] == "Namespace" and not m["bad_args"] for m in models)
    assert models[0]["keys"] == ["args", "checkpoint_version", "iteration", "model", "optimizer",
                                 "opt_param_scheduler", "rng_state", "num_floating_point_operations_so_far"]
    assert all(v["keys"][0] == "buckets_coalesced" for k, v in result.items() if k.endswith("distrib_optim.pt"))


# ------------------------------------------------------------------------------------------------------------
# the command line


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = copy_checkpoint("dp4_tp1_pp1", tmp_path / "m")
    assert cli_main(["convert", str(src), str(tmp_path / "rs"), "--to", "rank_sharded", "--dp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["to"], report["source_layout"], report["source_verified"],
            report["source_checked"]) == (10, "rank_sharded", "megatron", False, "zip CRC-32s")
    assert report["topology"]["dp"] == 2 and len(report["files"]) == 3
    assert cli_main(["convert", str(tmp_path / "rs"), str(tmp_path / "back"), "--to", "megatron"]) == 0
    text = capsys.readouterr().out
    assert "verified against its manifest" in text and "DP 2 -> 2" in text
    _megatron_files_identical(tmp_path / "back", "dp4_tp1_pp1")
    assert cli_main(["convert", str(src), str(tmp_path / "rs"), "--to", "rank_sharded"]) == 2  # not empty
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "z"), "--to", "megatron"]) == 3
    assert not (tmp_path / "nowhere").exists()
    (src / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert cli_main(["convert", str(src), str(tmp_path / "z"), "--to", "megatron"]) == 1
    assert "expected an iteration number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["convert", str(src), str(tmp_path / "z"), "--to", "zarr"])


@pytest.mark.parametrize("dp", [1, 2, 8])
def test_rank_sharded_to_megatron_at_another_dp_with_pipeline_stages(tmp_path: Path, dp: int) -> None:
    """rank_sharded at DP 4 (PP 2) to Megatron's files for DP ``dp``: each merged file belongs to the target's
    writer of its directory (was the source's rank: a KeyError below DP 4), and a job at DP ``dp`` loads the
    same optimizer shards from it as from Megatron's original."""
    job = SyntheticJob(ModelSpec(num_layers=4, hidden=64), tp=1, pp=2, dp=2)
    write_checkpoint(job, tmp_path / "megatron", layout="megatron", manifest=False)
    convert(tmp_path / "megatron", tmp_path / "rs4", to="rank_sharded", dp=4, progress=False)
    report = convert(tmp_path / "rs4", tmp_path / "back", to="megatron", dp=dp, progress=False)
    assert sorted({f["rank"] for f in report.files}) == [0, dp]  # DP rank 0 of each pipeline stage
    layout = ParallelLayout(pp=2, dp=dp)
    for rank in range(layout.world_size):
        loads = []
        for root in ("megatron", "back"):
            cfg = {"run_id": f"dp-{uuid.uuid4().hex[:8]}", "layout": "megatron",
                   "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / root)}]}
            with CheckpointEngine(cfg, layout, rank=rank) as engine:
                loads.append(engine.load().items["distrib_optim"])
        assert_same(loads[0], loads[1])


def test_items_carried_by_convert_load_beside_the_merged_optimizer(tmp_path: Path) -> None:
    """convert --to megatron at the same DP carries a rank's other items (a dataloader's state); a load that splits
    the merged distrib_optim.pt returns them too (a review: they were dropped without a word)."""
    job = SyntheticJob(ModelSpec(num_layers=2, hidden=32), tp=1, pp=1, dp=1)
    items = dict(job.rank_items(0))
    items["dataloader"] = {"pos": torch.tensor([7, 8, 9])}
    cfg = {"run_id": f"carry-{uuid.uuid4().hex[:8]}", "layout": "rank_sharded", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "src")}]}
    with CheckpointEngine(cfg, job.parallel) as engine:
        engine.save(job.iteration, items).wait(timeout=60)
    convert(tmp_path / "src", tmp_path / "dst", to="megatron", progress=False)
    for engine_layout in ("megatron", "rank_sharded"):
        cfg = {"run_id": f"carry-{uuid.uuid4().hex[:8]}", "layout": engine_layout,
               "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "dst")}]}
        with CheckpointEngine(cfg, job.parallel) as engine:
            loaded = engine.load()
        assert sorted(loaded.items) == ["dataloader", "distrib_optim", "model_optim_rng"], engine_layout
        assert loaded.verified
        assert torch.equal(loaded.items["dataloader"]["pos"], torch.tensor([7, 8, 9]))


def test_convert_sizes_the_source_once_and_only_for_a_bar(tmp_path, monkeypatch):
    calls = []
    real = convert_module._estimate
    monkeypatch.setattr(convert_module, "_estimate", lambda tier, info: calls.append(1) or real(tier, info))
    src = copy_checkpoint("dp2_tp1_pp2", tmp_path / "megatron")  # Megatron-LM's files: checked, then converted
    convert_module.convert(src, tmp_path / "quiet", to="rank_sharded", progress=False)
    assert calls == []  # HEAD: 2 (the check's bar and the convert's, neither drawn)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    convert_module.convert(src, tmp_path / "bar", to="rank_sharded", progress=True)
    assert len(calls) == 1  # HEAD: 2
