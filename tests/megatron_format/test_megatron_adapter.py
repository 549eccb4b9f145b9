"""The Megatron adapter: save_checkpoint/load_checkpoint through real CheckpointEngines, with Megatron's objects
faked as docs/megatron-format.md describes them (fakes.py), then the saved checkpoint converted to Megatron's own
layout."""

from __future__ import annotations

import inspect
import random
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakes import fake_rank, fingerprint, scramble
from helpers import assert_same
from megatron_fixtures import model_path, truth
from megatron_synthetic import ModelSpec, SyntheticJob

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.errors import ConfigError, LayoutMismatchError
from tiered_ckpt.megatron import adapter, safe_load
from tiered_ckpt.megatron.convert import convert
from tiered_ckpt.megatron.distrib_optim import merge_shards
from tiered_ckpt.megatron.rank_shard import dp_group
from tiered_ckpt.parallel import ParallelLayout

JOBS = {
    "tp2-pp2-dp2": SyntheticJob(ModelSpec(), tp=2, pp=2, dp=2, seed=3),
    "moe-ep2-dp2": SyntheticJob(ModelSpec(num_experts=4), tp=1, pp=1, dp=2, ep=2, seed=4),
}


def _config(run_id: str, shm: str, shared: Path, *names: str) -> dict:
    tiers = {"shm": {"name": "shm", "kind": "shm", "path": shm},
             "shared": {"name": "shared", "kind": "fsspec", "url": f"file://{shared}"}}
    return {"run_id": run_id, "layout": "rank_sharded", "drain": {"mode": "thread"},
            "tiers": [tiers[n] for n in names]}


def _engines(job: SyntheticJob, cfg: dict) -> list[CheckpointEngine]:
    return [CheckpointEngine(cfg, job.parallel, rank=r) for r in job.iter_ranks()]


@pytest.mark.parametrize("name", list(JOBS))
def test_save_load_bit_exact_then_megatron_layout(tmp_path: Path, shm_root: str, name: str) -> None:
    job = JOBS[name]
    shared, run_id = tmp_path / "shared", f"a{uuid.uuid4().hex[:8]}"
    ranks = [fake_rank(job, r) for r in job.iter_ranks()]
    want = [fingerprint(r) for r in ranks]
    engines = _engines(job, _config(run_id, shm_root, shared, "shm", "shared"))
    try:
        rng_before = []
        handles = []
        for r, rank, engine in zip(job.iter_ranks(), ranks, engines, strict=True):
            random.seed(r)
            rng_before.append(random.getstate())
            handles.append(adapter.save_checkpoint(job.iteration, rank.model, rank.optimizer, rank.scheduler, 12345,
                                                   engine=engine, args=rank.args, rng_tracker=rank.rng_tracker))
        for h in handles:
            h.wait(timeout=60)
        # From memory: DP rank 0 has the model file in its snapshot, the others read it from the shared tier.
        for rank, engine in zip(ranks, engines, strict=True):
            scramble(rank)
            assert adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                           rng_tracker=rank.rng_tracker) == (job.iteration, 12345)
        for r, rank in enumerate(ranks):
            assert fingerprint(rank) == want[r], r
    finally:
        for e in engines:
            e.close()
    # A fresh job that only has the shared tier.
    engines = _engines(job, _config(run_id, shm_root, shared, "shared"))
    try:
        for r, (rank, engine) in enumerate(zip(ranks, engines, strict=True)):
            scramble(rank)
            adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                    rng_tracker=rank.rng_tracker)
            assert fingerprint(rank) == want[r], r
    finally:
        for e in engines:
            e.close()

    # What the engine wrote is exactly the synthetic job's state, and converts to Megatron's layout.
    step_dir = f"iter_{job.iteration:07d}"
    for r in job.iter_ranks():
        assert_same(job.rank_shard(r), torch.load(shared / step_dir / f"rank_{r:05d}" / "distrib_optim.pt",
                                                  weights_only=True))
    convert(shared, tmp_path / "megatron", to="megatron", progress=False)
    fixture_keys = list(safe_load.load(model_path("dp4_tp1_pp1", "mp_rank_00")))
    for shard in job.shards():
        d = tmp_path / "megatron" / step_dir / job.mp_dir(shard)
        saved = safe_load.load(d / "model_optim_rng.pt")
        assert list(saved) == fixture_keys  # Megatron's keys, in Megatron's order
        expected = job.model_optim_rng(shard)
        for key in ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler"):
            assert_same(expected[key], saved[key], key)
        assert saved["num_floating_point_operations_so_far"] == 12345
        (rng,) = saved["rng_state"]
        assert rng["random_rng_state"] == rng_before[job.writer_rank(shard)]
        assert_same(expected["rng_state"][0]["rng_tracker_states"], rng["rng_tracker_states"])
        got = torch.load(d / "distrib_optim.pt", weights_only=True)
        states = got if isinstance(got, list) else [got]
        for i, kind in enumerate(job.kinds()):
            group = dp_group(job.topology, job.writer_rank(shard), kind)
            if job.topology.rank_dir(group[0]) != job.mp_dir(shard):
                assert states[i] is None
                continue
            assert_same(merge_shards([job.local_shards(r, kind) for r in group], job.geometry(shard, kind)),
                        states[i])


def test_apply_megatron_gathered_and_dlrover_state() -> None:
    """A rank handed Megatron's gathered dict, or DLRover's per-param fragments, restores the same bits."""
    from test_megatron_legacy import _dlrover_rank_file

    job = SyntheticJob(ModelSpec(), tp=1, pp=2, dp=2, seed=5)
    coords = job.parallel.coords(3)
    rank = fake_rank(job, 3)
    want = fingerprint(rank)
    shard = job.shard_of(3)
    gathered = merge_shards([job.local_shards(r, "dense") for r in dp_group(job.topology, 3, "dense")],
                            job.geometry(shard, "dense"))
    for state in (gathered, [gathered], _dlrover_rank_file(job, 3), job.rank_shard(3)):
        scramble(rank)
        adapter.apply_distrib_optim(rank.optimizer, state, coords)
        assert fingerprint(rank)["optim"] == want["optim"]


def test_mismatches_are_named() -> None:
    job = SyntheticJob(ModelSpec(), tp=1, pp=1, dp=2, seed=6)
    rank = fake_rank(job, 1)
    other = SyntheticJob(ModelSpec(), tp=1, pp=1, dp=4, seed=6)
    with pytest.raises(LayoutMismatchError, match=r"DP group is \[0, 1\].*would be \[0, 1, 2, 3\]"):
        adapter.rank_shard_item(rank.optimizer, other.topology, 1)
    bigger = SyntheticJob(ModelSpec(hidden=128), tp=1, pp=1, dp=2, seed=6)
    with pytest.raises(LayoutMismatchError, match="differ from the job's dense buckets"):
        adapter.apply_distrib_optim(rank.optimizer, bigger.rank_shard(1), job.parallel.coords(1))
    four = SyntheticJob(ModelSpec(), tp=1, pp=1, dp=4, seed=6)
    with pytest.raises(LayoutMismatchError, match=r"DP rank 1 of 4, this rank is 1 of 2.*convert --dp"):
        adapter.apply_distrib_optim(rank.optimizer, four.rank_shard(1), job.parallel.coords(1))
    with pytest.raises(ConfigError, match="pass Megatron's args"):
        adapter.save_checkpoint(1, rank.model, rank.optimizer, rank.scheduler, 0,
                                engine=SimpleNamespace(coords=job.parallel.coords(1)))


def test_finetune_and_no_load_flags(tmp_path: Path, shm_root: str) -> None:
    job = SyntheticJob(ModelSpec(num_layers=2), tp=1, pp=1, dp=1, seed=8)
    rank = fake_rank(job, 0)
    want = fingerprint(rank)
    cfg = _config(f"f{uuid.uuid4().hex[:8]}", shm_root, tmp_path / "shared", "shm")
    with CheckpointEngine(cfg, ParallelLayout(), rank=0) as engine:
        adapter.save_checkpoint(job.iteration, rank.model, rank.optimizer, rank.scheduler, 7, engine=engine,
                                args=rank.args, rng_tracker=rank.rng_tracker).wait(timeout=60)
        scramble(rank)
        rank.args.finetune = True
        assert adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                       rng_tracker=rank.rng_tracker)[0] == 0
        got = fingerprint(rank)
        assert got["model"] == want["model"] and got["optim"] != want["optim"] and got["tracker"] == {}
        # bf16: the optimizer's main params follow the loaded weights, as Megatron's load does
        assert getattr(rank.optimizer, "reloads", 0) == (1 if rank.args.bf16 else 0)
        rank.args.finetune, rank.args.no_load_optim, rank.args.no_load_rng = False, True, True
        assert adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                       rng_tracker=rank.rng_tracker)[0] == job.iteration
        assert fingerprint(rank)["optim"] != want["optim"] and rank.args.consumed_train_samples == 800


def test_fixture_model_file_loads_into_a_chunk() -> None:
    """Megatron's own model_optim_rng.pt goes through the adapter's model path (names, shapes)."""
    from fakes import FakeModelChunk

    state = safe_load.load(model_path("dp4_tp1_pp1", "mp_rank_00"))
    chunk = FakeModelChunk(state["model"])
    scrambled = {k: (v * 0 if isinstance(v, torch.Tensor) else v) for k, v in state["model"].items()}
    chunk.load_state_dict(scrambled)
    chunk.load_state_dict(state["model"])
    out = adapter.unwrap(chunk).state_dict_for_save_checkpoint()
    assert_same(dict(state["model"]), dict(out))
    assert truth("dp4_tp1_pp1")["iteration"] == state["iteration"]


def test_megatron_layout_through_the_commit_hook(tmp_path: Path, shm_root: str) -> None:
    """Layout megatron: every rank stages its shard file; merge_step_on_tier then writes Megatron's files (what the
    commit path runs before the checkpoint manifest), and they join the manifest."""
    from dataclasses import replace

    from tiered_ckpt.manifest import dump_checkpoint, load_checkpoint
    from tiered_ckpt.megatron.convert import open_store
    from tiered_ckpt.megatron.merge import merge_step_on_tier
    from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier

    job = SyntheticJob(ModelSpec(), tp=2, pp=1, dp=2, seed=9)
    shared = tmp_path / "shared"
    cfg = {**_config(f"m{uuid.uuid4().hex[:8]}", shm_root, shared, "shm", "shared"), "layout": "megatron"}
    ranks = [fake_rank(job, r) for r in job.iter_ranks()]
    engines = _engines(job, cfg)
    try:
        handles = [adapter.save_checkpoint(job.iteration, r.model, r.optimizer, r.scheduler, 1, engine=e,
                                           args=r.args, rng_tracker=r.rng_tracker)
                   for r, e in zip(ranks, engines, strict=True)]
        for h in handles:
            h.wait(timeout=60)
    finally:
        for e in engines:
            e.close()
    step_dir = f"iter_{job.iteration:07d}"
    assert sorted(p.name for p in (shared / step_dir).iterdir() if p.name.startswith("rank_")) == [
        f"rank_{r:05d}" for r in job.iter_ranks()]
    tier = FsspecTier("shared", FsspecOptions(url=f"file://{shared}"))
    key = f"{step_dir}/tiered_ckpt/manifest.json"
    manifest = load_checkpoint(bytes(tier.read_blob(key).numpy()))
    entries = merge_step_on_tier(open_store(tier, "megatron", "shared"), job.iteration, topology=job.parallel,
                                 entries=manifest.files)
    assert [e.key for e in entries] == [f"{step_dir}/mp_rank_0{t}/distrib_optim.pt" for t in (0, 1)]
    tier.publish(key, dump_checkpoint(replace(manifest, files=manifest.files + tuple(entries))))
    for shard in job.shards():
        got = torch.load(shared / step_dir / job.mp_dir(shard) / "distrib_optim.pt", weights_only=True)
        group = dp_group(job.topology, job.writer_rank(shard), "dense")
        assert_same(merge_shards([job.local_shards(r, "dense") for r in group], job.geometry(shard, "dense")), got)
    from tiered_ckpt.megatron import legacy

    items = legacy.load_rank_items(tier, None, ParallelLayout(tp=2, dp=1).coords(1))  # verified, re-split to DP 1
    assert items.verified and items.layout == "megatron"
    assert_same(SyntheticJob(ModelSpec(), tp=2, pp=1, dp=1, seed=9).rank_shard(1), items["distrib_optim"])


# ------------------------------------------------------------------------------------------------------------
# Megatron's call signatures (megatron/training/checkpointing.py at the fixtures' commit) and training.py's calls

MEGATRON_SAVE = [
    ("iteration", inspect.Parameter.empty), ("model", inspect.Parameter.empty), ("optimizer", inspect.Parameter.empty),
    ("opt_param_scheduler", inspect.Parameter.empty),
    ("num_floating_point_operations_so_far", inspect.Parameter.empty), ("checkpointing_context", None),
    ("pipeline_rank", None), ("expert_rank", None), ("tensor_rank", None), ("pipeline_parallel", None),
    ("expert_parallel", None), ("non_persistent_ckpt", False), ("train_data_iterator", None),
    ("preprocess_common_state_dict_fn", None), ("release", False), ("tp_group", None), ("pp_group", None),
    ("dp_cp_group", None), ("dp_group", None), ("expt_dp_group", None), ("rng_state_key_prefix", ""),
]
MEGATRON_LOAD = [
    ("ddp_model", inspect.Parameter.empty), ("optimizer", inspect.Parameter.empty),
    ("opt_param_scheduler", inspect.Parameter.empty), ("load_arg", "load"), ("strict", True),
    ("checkpointing_context", None), ("skip_load_to_model_and_opt", False), ("tp_group", None), ("pp_group", None),
    ("dp_cp_group", None), ("dp_group", None), ("expt_dp_group", None), ("rng_state_key_prefix", ""),
]


@pytest.mark.parametrize(("func", "megatron"), [(adapter.save_checkpoint, MEGATRON_SAVE),
                                                (adapter.load_checkpoint, MEGATRON_LOAD)], ids=["save", "load"])
def test_signatures_are_megatrons(func, megatron) -> None:
    params = [p for p in inspect.signature(func).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in params] == megatron  # same names, order and defaults
    assert all(p.default is not inspect.Parameter.empty for p in inspect.signature(func).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY)  # ours come after, all optional


def test_the_drop_in_called_before_torch_distributed_is_initialised_refuses(tmp_path: Path, shm_root: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A Megatron user's trial: load_checkpoint called once before init_process_group (WORLD_SIZE=2) built the
    drop-in's engine without the process group and kept it: the ranks resumed at different steps, and each
    committed steps alone. The drop-in refuses instead, and builds nothing."""
    import yaml

    job = SyntheticJob(ModelSpec(num_layers=2), tp=1, pp=1, dp=1, seed=9)
    rank = fake_rank(job, 0)
    cfg = _config(f"t{uuid.uuid4().hex[:8]}", shm_root, tmp_path / "shared", "shm", "shared")
    (tmp_path / "tiers.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv(adapter.CONFIG_ENV, str(tmp_path / "tiers.yaml"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(adapter, "_default_engine", None)
    with pytest.raises(ConfigError, match=r"before torch.distributed.init_process_group \(a world of 2 ranks"):
        adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, checkpointing_context={},
                                args=rank.args, rng_tracker=rank.rng_tracker)
    assert adapter._default_engine is None
    # a launcher that sets no WORLD_SIZE: Megatron's args say how many ranks (a second trial)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(rank.args, "world_size", 4, raising=False)
    with pytest.raises(ConfigError, match=r"\(a world of 4 ranks: WORLD_SIZE, args.world_size\)"):
        adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, checkpointing_context={},
                                args=rank.args, rng_tracker=rank.rng_tracker)
    assert adapter._default_engine is None


def test_training_py_calls_work_verbatim(tmp_path: Path, shm_root: str, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """The calls Megatron's training.py makes (save_checkpoint_and_time, the resume in setup_model_and_optimizer),
    keyword for keyword, with the engine built from TIERED_CKPT_CONFIG and kept in checkpointing_context."""
    import yaml

    job = SyntheticJob(ModelSpec(num_layers=2), tp=1, pp=1, dp=1, seed=9)
    rank = fake_rank(job, 0)
    want = fingerprint(rank)
    cfg = _config(f"t{uuid.uuid4().hex[:8]}", shm_root, tmp_path / "shared", "shm", "shared")
    (tmp_path / "tiers.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv(adapter.CONFIG_ENV, str(tmp_path / "tiers.yaml"))
    monkeypatch.setattr(adapter, "_default_engine", None)
    rank.args.data_parallel_size = 1
    rank.args.save = rank.args.load = str(tmp_path / "elsewhere")  # not where the tiers write: a warning says so
    checkpointing_context: dict = {}
    try:
        for non_persistent in (False, True):  # a persistent save, then a non-persistent one (memory only)
            it = job.iteration + int(non_persistent)
            handle = adapter.save_checkpoint(
                it, rank.model, rank.optimizer, rank.scheduler, 55.0, checkpointing_context,
                non_persistent_ckpt=non_persistent, train_data_iterator=iter([]),
                preprocess_common_state_dict_fn=lambda sd: sd, tp_group=None, pp_group=None, dp_cp_group=None,
                dp_group=None, expt_dp_group=None, rng_state_key_prefix="", args=rank.args,
                rng_tracker=rank.rng_tracker)
            handle.wait(timeout=60)
        engine = checkpointing_context[adapter.CONTEXT_KEY]
        assert engine is adapter._default_engine
        said = [r.getMessage() for r in caplog.records if "args.save=" in r.getMessage()]
        assert said and "elsewhere" in said[0]
        assert str(tmp_path / "shared") in said[0] and shm_root not in said[0]  # shm is no file tier's directory
        assert engine.available_steps() == {"shm": [job.iteration, job.iteration + 1], "shared": [job.iteration]}
        scramble(rank)
        got = adapter.load_checkpoint(
            rank.model, rank.optimizer, rank.scheduler, checkpointing_context=checkpointing_context,
            skip_load_to_model_and_opt=False, tp_group=None, pp_group=None, dp_cp_group=None, dp_group=None,
            expt_dp_group=None, rng_state_key_prefix="", args=rank.args, rng_tracker=rank.rng_tracker)
        assert got == (job.iteration + 1, 55.0)  # the newer, non-persistent step wins, as in Megatron
        assert fingerprint(rank) == want
        with pytest.raises(ConfigError, match="release=True"):
            adapter.save_checkpoint(1, rank.model, rank.optimizer, rank.scheduler, 0, checkpointing_context,
                                    release=True, args=rank.args, rng_tracker=rank.rng_tracker)
        with pytest.raises(ConfigError, match="tensor_rank=1"):
            adapter.save_checkpoint(1, rank.model, rank.optimizer, rank.scheduler, 0, checkpointing_context,
                                    tensor_rank=1, args=rank.args, rng_tracker=rank.rng_tracker)
    finally:
        if adapter._default_engine is not None:
            adapter._default_engine.close()
    # ls says what the non-persistent snapshot is (no "the next engine drains it")
    import contextlib
    import io
    import json

    from tiered_ckpt.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(["ls", "--config", str(tmp_path / "tiers.yaml"), "--json"])
    rows = {(r["tier"], r["step"]): r["state"] for r in json.loads(out.getvalue())}
    assert "non-persistent: memory only" in rows[("shm", job.iteration + 1)], rows
    # The next job's engine recovers what shm holds, but never drains the non-persistent step to a file tier.
    with CheckpointEngine(cfg, ParallelLayout(), rank=0) as engine:
        engine.wait(timeout=60)
        assert engine.available_steps() == {"shm": [job.iteration, job.iteration + 1], "shared": [job.iteration]}


def test_no_checkpoint_anywhere_is_iteration_zero_but_an_unreachable_tier_is_an_error(
        tmp_path: Path, shm_root: str) -> None:
    from tiered_ckpt.errors import NoCheckpointError

    job = SyntheticJob(ModelSpec(num_layers=2), tp=1, pp=1, dp=1, seed=10)
    rank = fake_rank(job, 0)
    cfg = _config(f"z{uuid.uuid4().hex[:8]}", shm_root, tmp_path / "shared", "shm", "shared")
    with CheckpointEngine(cfg, ParallelLayout(), rank=0) as engine:
        assert adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                       rng_tracker=rank.rng_tracker) == (0, 0)
        rank.args.exit_on_missing_checkpoint = True
        with pytest.raises(NoCheckpointError):
            adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                    rng_tracker=rank.rng_tracker)
    # A tier that cannot be looked at is never "no checkpoint": not (0, 0), an error naming it, on every rank.
    from tiered_ckpt.errors import TierUnavailableError

    cfg["tiers"].append({"name": "remote", "kind": "fsspec", "url": f"s3://bucket/{uuid.uuid4().hex[:8]}",
                         "timeout_s": 2, "retry": {"attempts": 2, "initial_s": 0.05, "max_s": 0.1},
                         "options": {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}})
    cfg["run_id"] = f"z{uuid.uuid4().hex[:8]}"
    rank.args.exit_on_missing_checkpoint = False
    with CheckpointEngine(cfg, ParallelLayout(), rank=0) as engine:
        with pytest.raises(TierUnavailableError, match="remote"):
            adapter.load_checkpoint(rank.model, rank.optimizer, rank.scheduler, engine=engine, args=rank.args,
                                    rng_tracker=rank.rng_tracker)


@pytest.mark.slow
def test_every_rank_resumes_from_memory_across_nodes(tmp_path: Path, shm_root: str) -> None:
    """TP 2 x DP 2 on two "nodes" with a shm each, memory tier only, every process dead after the save: rank 2's
    holder (rank 0) is on the other node (gloo), rank 3's (rank 1) on its own (its shm)."""
    from test_multirank import run_ranks

    node_of = {0: "a", 1: "b", 2: "b", 3: "b"}
    for node in "ab":
        (Path(shm_root) / node).mkdir()
    cfg = {"run_id": f"n{uuid.uuid4().hex[:8]}", "layout": "rank_sharded",
           "tiers": [{"name": "shm", "kind": "shm", "path": "${NODE_SHM}"}]}
    spec = {"config": cfg, "job": {"tp": 2, "pp": 1, "dp": 2, "seed": 11}}
    env_of = {r: {"NODE_SHM": str(Path(shm_root) / n)} for r, n in node_of.items()}
    worker = Path(__file__).with_name("adapter_worker.py")
    run_ranks(4, {**spec, "mode": "save"}, node_of=node_of, env_of=env_of, worker=worker)
    resumed = run_ranks(4, {**spec, "mode": "load"}, node_of=node_of, env_of=env_of, worker=worker)
    for rank, r in resumed.items():
        assert "error" not in r, (rank, r)
        assert r["same"] and r["result"] == [SyntheticJob(**spec["job"]).iteration, 3.0], (rank, r)
    sources = {rank: r["source"][0].rsplit("(model_optim_rng from ", 1)[1] for rank, r in resumed.items()}
    assert sources == {0: "shm)", 1: "shm)", 2: "rank 0 over gloo)", 3: "shm of rank 1)"}


def test_a_checkpoint_of_another_model_is_named_with_its_step_tier_and_the_likely_cause(tmp_path: Path,
                                                                                      shm_root: str) -> None:
    """A Megatron user's trial: a run_id reused for a bigger model failed with "optimizer 0: the checkpoint's dense
    buckets [...] differ from the job's [...]", naming neither the step, nor the tier, nor what to do."""
    job = SyntheticJob(ModelSpec(num_layers=2), tp=1, pp=1, dp=1, seed=9)
    rank = fake_rank(job, 0)
    cfg = _config(f"t{uuid.uuid4().hex[:8]}", shm_root, tmp_path / "shared", "shm", "shared")
    with CheckpointEngine(cfg, job.parallel) as engine:
        adapter.save_checkpoint(job.iteration, rank.model, rank.optimizer, rank.scheduler, 1.0, engine=engine,
                                args=rank.args, rng_tracker=rank.rng_tracker).wait(timeout=60)
    bigger = fake_rank(SyntheticJob(ModelSpec(num_layers=2, hidden=128), tp=1, pp=1, dp=1, seed=9), 0)
    with CheckpointEngine(cfg, job.parallel) as engine, pytest.raises(LayoutMismatchError) as err:
        adapter.load_checkpoint(bigger.model, bigger.optimizer, bigger.scheduler, engine=engine,
                                skip_load_to_model_and_opt=True,  # (the fake model refuses other shapes)
                                args=bigger.args, rng_tracker=bigger.rng_tracker)
    assert str(err.value).startswith(f"step {job.iteration} from tier 'shm': optimizer 0: the checkpoint's")
    assert "give it a run_id of its own and an empty checkpoint directory" in str(err.value)
