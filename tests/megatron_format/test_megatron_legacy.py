"""Checkpoints without our manifest (Megatron-LM's, DLRover's): detection, tracker edge cases, loading a rank."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
from megatron_fixtures import ITER_DIR, RELOADS, bits, copy_checkpoint, local_shards, truth
from megatron_synthetic import SyntheticJob, write_checkpoint

from tiered_ckpt.errors import (
    CorruptionError,
    DecodeError,
    LayoutMismatchError,
    NoCheckpointError,
    UnsafePickleError,
)
from tiered_ckpt.megatron import legacy
from tiered_ckpt.megatron.convert import convert
from tiered_ckpt.parallel import ParallelLayout
from tiered_ckpt.tiers.local import LocalOptions, LocalTier

TRACKER = "latest_checkpointed_iteration.txt"


def _tier(path: Path) -> LocalTier:
    return LocalTier("src", LocalOptions(path=str(path), fsync=False))


@pytest.fixture
def pp2(tmp_path: Path) -> Path:
    return copy_checkpoint("dp2_tp1_pp2", tmp_path / "ckpt")


def test_detect_megatron_written(pp2: Path) -> None:
    info = legacy.detect(_tier(pp2))
    assert (info.layout, info.writer, info.iteration, info.tracker, info.has_manifest) == (
        "megatron", "megatron", 10, 10, False)
    assert (info.topology.tp, info.topology.pp, info.topology.dp, info.topology.ep) == (1, 2, 2, 1)
    assert info.rank_dirs == ("mp_rank_00_000", "mp_rank_00_001") and info.has_distrib_optim
    assert isinstance(info.args, argparse.Namespace) and info.args.data_parallel_size == 2
    assert not info.verifiable and "no checksums of ours" in info.notes[0]
    assert info.to_dict()["topology"]["dp"] == 2


@pytest.mark.parametrize(("text", "iteration"), [("10", 10), ("10\n", 10), (" 10 \r\n", 10)])
def test_tracker_text_as_megatron_reads_it(pp2: Path, text: str, iteration: int) -> None:
    (pp2 / TRACKER).write_text(text)
    assert legacy.detect(_tier(pp2)).iteration == iteration


@pytest.mark.parametrize("content", [b"ten", b"", b"-10", b"\xff\xfe", b"iter_0000010"])
def test_garbage_tracker_names_the_file(pp2: Path, content: bytes) -> None:
    (pp2 / TRACKER).write_bytes(content)
    with pytest.raises(DecodeError, match=f"{TRACKER} on tier 'src'"):
        legacy.detect(_tier(pp2))


def test_missing_tracker(pp2: Path) -> None:
    (pp2 / TRACKER).unlink()
    with pytest.raises(NoCheckpointError, match=r"no tracker file.*random weights.*\[10\]"):
        legacy.detect(_tier(pp2))
    assert legacy.detect(_tier(pp2), step=10).tracker is None  # an explicit step needs no tracker


def test_tracker_naming_a_missing_step(pp2: Path) -> None:
    (pp2 / TRACKER).write_text("20")
    with pytest.raises(NoCheckpointError, match="iter_0000020.*the tracker names iteration 20.*missing"):
        legacy.detect(_tier(pp2))


def test_release_checkpoint(pp2: Path) -> None:
    (pp2 / ITER_DIR).rename(pp2 / "release")
    (pp2 / TRACKER).write_text("release")
    info = legacy.detect(_tier(pp2))
    assert (info.iteration, info.step_dir) == ("release", "release")
    assert any("release checkpoint" in n for n in info.notes)
    items = legacy.load_rank_items(_tier(pp2), None, ParallelLayout(pp=2, dp=2).coords(1))
    assert items.step == "release" and items["model_optim_rng"]["iteration"] == 10
    with pytest.raises(Exception, match="release checkpoint has no iteration"):
        convert(pp2, pp2.parent / "out", to="rank_sharded", progress=False)


def test_other_formats_are_named(pp2: Path) -> None:
    (pp2 / ITER_DIR / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(DecodeError, match="torch_dist"):
        legacy.detect(_tier(pp2))
    (pp2 / "iter_0000011").mkdir()
    (pp2 / "iter_0000011" / "x.bin").write_bytes(b"x")
    with pytest.raises(DecodeError, match="no mp_rank_"):
        legacy.detect(_tier(pp2), step=11)
    (pp2 / "iter_0000012").mkdir()  # DCP's FileSystemWriter's files, no Megatron metadata.json: not torch_dist
    (pp2 / "iter_0000012" / "__0_0.distcp").write_bytes(b"x")
    (pp2 / "iter_0000012" / ".metadata").write_bytes(b"x")
    with pytest.raises(DecodeError, match=r"a PyTorch DCP checkpoint \(\.distcp files\), not a Megatron one"):
        legacy.detect(_tier(pp2), step=12)


def test_a_checkpoint_of_ours_of_another_state_is_named(tmp_path: Path) -> None:
    """An S3 user's trial: `convert` of a plain training loop's checkpoint said only "no mp_rank_* directories: not
    a Megatron torch-format checkpoint"."""
    from tiered_ckpt import CheckpointEngine

    cfg = {"run_id": "plain", "drain": {"mode": "thread"},
           "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "ck")}]}
    with CheckpointEngine(cfg) as engine:
        engine.save(3, {"model": {"w": torch.ones(4)}}).wait(timeout=60)
    with pytest.raises(DecodeError, match="a tiered_ckpt checkpoint of a state that is not a Megatron model's.*"
                                          "CheckpointEngine.load"):
        convert(tmp_path / "ck", tmp_path / "out", to="megatron", progress=False)


@pytest.mark.parametrize(("config", "dp"), [("dp2_tp1_pp2", None), ("dp4_tp1_pp1", None), *RELOADS])
def test_load_rank_items_at_any_dp_gives_megatrons_shards(tmp_path: Path, config: str, dp: int | None) -> None:
    t = truth(config)
    tier = _tier(copy_checkpoint(config, tmp_path / "ckpt"))
    layout = ParallelLayout(tp=t["tp"], pp=t["pp"], dp=dp or t["dp"])
    for rank in range(layout.world_size):
        items = legacy.load_rank_items(tier, None, layout.coords(rank))
        assert items.verified is False and items.formats["distrib_optim"] == "rank_shard"
        (opt,) = items["distrib_optim"]["optimizers"]
        want = local_shards(config, rank, dp)
        assert list(opt["shards"]) == list(want)
        for k in want:
            assert torch.equal(bits(opt["shards"][k]), bits(want[k])), (rank, k)
        assert items["model_optim_rng"]["iteration"] == 10


def test_unverified_warning_is_logged_once(pp2: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier, layout = _tier(pp2), ParallelLayout(pp=2, dp=2)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.megatron.legacy"):
        for rank in range(4):
            legacy.load_rank_items(tier, 10, layout.coords(rank))
    warnings = [r for r in caplog.records if "no checksums of ours" in r.message]
    assert len(warnings) == 1 and str(pp2) in warnings[0].message


def test_a_damaged_model_file_is_refused_by_its_zip_crcs(pp2: Path) -> None:
    """No manifest, but each record's CRC-32 in the file's zip directory: a model file read whole is checked
    against them (torch.load, and so Megatron-LM, would load the flipped bit as a weight)."""
    path = pp2 / ITER_DIR / "mp_rank_00_001" / "model_optim_rng.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    layout = ParallelLayout(pp=2, dp=2)
    stages = {rank: layout.coords(rank).pp for rank in range(4)}
    assert sorted(stages.values()) == [0, 0, 1, 1]
    for rank, stage in stages.items():
        if stage == 1:
            with pytest.raises(CorruptionError, match=r"mp_rank_00_001/model_optim_rng\.pt.*record .*CRC-32"):
                legacy.load_rank_items(_tier(pp2), 10, layout.coords(rank))
        else:  # stage 0's file is intact
            assert legacy.load_rank_items(_tier(pp2), 10, layout.coords(rank))["model_optim_rng"]["iteration"] == 10


def test_model_parallel_changes_are_refused(pp2: Path) -> None:
    with pytest.raises(LayoutMismatchError, match="TP 1 → 2"):
        legacy.load_rank_items(_tier(pp2), None, ParallelLayout(tp=2, pp=2).coords(0))


def test_unsafe_model_file_needs_trust(pp2: Path) -> None:
    path = pp2 / ITER_DIR / "mp_rank_00_000" / "model_optim_rng.pt"
    from tiered_ckpt.megatron import safe_load
    from tiered_ckpt.megatron.torch_zip import iter_torch_save

    obj = safe_load.load(path)
    obj["args"].hook = print  # a global outside the allow-list
    # Our writer: it names the stand-ins' globals even where the installed Megatron lacks a class (the fixtures
    # come from a newer Megatron than megatron-core 0.16, which has no InferenceCudaGraphScope).
    path.write_bytes(b"".join(bytes(c) for c in iter_torch_save(obj, archive="model_optim_rng")))
    with pytest.raises(UnsafePickleError, match="builtins.print"):
        legacy.load_rank_items(_tier(pp2), None, ParallelLayout(pp=2, dp=2).coords(0))
    items = legacy.load_rank_items(_tier(pp2), None, ParallelLayout(pp=2, dp=2).coords(0), trust_pickles=True)
    assert items["model_optim_rng"]["args"].hook is print


def test_our_checkpoints_are_verified(tmp_path: Path) -> None:
    job = SyntheticJob(tp=2, pp=1, dp=2)
    write_checkpoint(job, tmp_path / "ours", layout="megatron")
    info = legacy.detect(_tier(tmp_path / "ours"))
    assert (info.layout, info.writer, info.has_manifest, info.notes) == ("megatron", "tiered_ckpt", True, ())
    items = legacy.load_rank_items(_tier(tmp_path / "ours"), None, job.parallel.coords(3))
    assert items.verified
    path = next((tmp_path / "ours").rglob("mp_rank_01/distrib_optim.pt"))
    data = bytearray(path.read_bytes())
    data[-200] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="mp_rank_01/distrib_optim.pt.*checksum mismatch"):
        legacy.load_rank_items(_tier(tmp_path / "ours"), None, job.parallel.coords(3))


def _dlrover_rank_file(job: SyntheticJob, rank: int) -> dict:
    """DLRover's per-rank distrib_optim.pt: {bucket: {group index: {group order: {param, exp_avg, exp_avg_sq}}}}."""
    from fakes import fake_rank

    opt = fake_rank(job, rank).optimizer.chained_optimizers[0]
    out: dict = {}
    for g in opt.gbuf_ranges:
        (buckets,) = g.values()
        for b, ranges in enumerate(buckets):
            for model_param in ranges["param_map"]:
                gi, go = opt.model_param_group_index_map[model_param]
                out.setdefault(b, {}).setdefault(gi, {})[go] = {
                    k: v.clone() for k, v in opt._get_main_param_and_optimizer_states(model_param).items()}
    return out


def test_dlrover_written(tmp_path: Path) -> None:
    job = SyntheticJob(tp=1, pp=2, dp=2)
    root = tmp_path / "dlrover"
    write_checkpoint(job, root, layout="megatron", manifest=False)
    for d in root.glob(f"{'iter_0000100'}/mp_rank_*/distrib_optim.pt"):
        d.unlink()
    for r in job.iter_ranks():
        (root / "iter_0000100" / f"rank_{r:05d}").mkdir()
        torch.save(_dlrover_rank_file(job, r), root / "iter_0000100" / f"rank_{r:05d}" / "distrib_optim.pt")
    info = legacy.detect(_tier(root))
    assert (info.layout, info.writer, info.rank_files) == ("dlrover", "dlrover", (0, 1, 2, 3))
    items = legacy.load_rank_items(_tier(root), None, job.parallel.coords(2))
    # keyed by bucket: stage 1 has two (the output layer gets its own)
    assert items.formats["distrib_optim"] == "dlrover" and set(items["distrib_optim"]) == {0, 1}
    with pytest.raises(LayoutMismatchError, match="only at the DP size that wrote them"):
        legacy.load_rank_items(_tier(root), None, ParallelLayout(pp=2, dp=1).coords(0))
    with pytest.raises(LayoutMismatchError, match="without bucket geometry"):
        convert(root, tmp_path / "out", to="megatron", progress=False)


def test_explicit_step_ignores_a_broken_tracker_and_uncommitted_steps_are_refused(pp2: Path) -> None:
    (pp2 / TRACKER).write_text("garbage")
    info = legacy.detect(_tier(pp2), step=10)
    assert info.tracker is None and any("tracker is unreadable" in n for n in info.notes)
    (pp2 / ITER_DIR / "tiered_ckpt").mkdir()
    (pp2 / ITER_DIR / "tiered_ckpt" / "rank_00000.json").write_text("{}")
    with pytest.raises(NoCheckpointError, match="never committed"):
        legacy.detect(_tier(pp2), step=10)
