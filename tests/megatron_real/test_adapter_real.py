"""The Megatron adapter end to end on genuine megatron-core (GPTModel, DDP, DistributedOptimizer, scheduler, RNG
tracker) trained on CPU with gloo, 4 to 8 ranks (harness.py).

Scenarios: (a) save in both layouts, resume at the same DP, continue bit-exact; (b) load at DP 1 and DP 4, full
optimizer state bit-exact; (c) every model_optim_rng.pt loads with Megatron's own weights_only allow-list, enums
intact; (d) SIGKILL after a memory-only save, every rank resumes from memory; (e) a checkpoint Megatron-LM's own
training code wrote loads into the live optimizer bit-exact.

The engines use the library's default drain (a separate process); MEGATRON_REAL_DRAIN=thread runs the same tests
with the in-process drain.
"""

from __future__ import annotations

import os
import pickletools
import shutil
import signal
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness  # noqa: E402
import pytest
import torch
from harness import build_job, differences, fingerprint, full_state, launch, train  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402
from tiered_ckpt.megatron import adapter  # noqa: E402

# The genuine Megatron-LM checkpoints kept in the repository, tests/data/megatron (its README.md says what they are)
FIXTURES = Path(__file__).parents[1] / "data" / "megatron"
SAVED_AT, RESUMED_TO, FLOPS = 3, 5, 123456.0
DRAIN = os.environ.get("MEGATRON_REAL_DRAIN")  # None: the library's default (process)


@dataclass(frozen=True)
class Spec:
    tp: int
    pp: int
    precision: str
    buckets: bool = False  # overlap_grad_reduce with 6000-element buckets (8 on the first stage), as the fixture
    distributed_optimizer: bool = True  # False: plain DDP, Megatron's default (every DP rank holds the whole state)

    @property
    def id(self) -> str:
        return (f"tp{self.tp}-pp{self.pp}-{self.precision}" + ("-buckets" if self.buckets else "")
                + ("" if self.distributed_optimizer else "-ddp"))

    def job(self) -> harness.Job:
        # Dropout draws from the CPU generator and, in attention, from the tracker's: a resume that restores
        # the wrong RNG state trains differently.
        return build_job(self.tp, self.pp, self.precision, seed=20, dropout=0.1,
                         bucket_size=6000 if self.buckets else None, overlap_grad_reduce=self.buckets,
                         distributed_optimizer=self.distributed_optimizer)


SPECS = [Spec(1, 2, "fp32", buckets=True), Spec(2, 1, "bf16"),
         pytest.param(Spec(1, 2, "bf16"), marks=pytest.mark.slow),
         pytest.param(Spec(2, 1, "fp32", buckets=True), marks=pytest.mark.slow)]


def config(run_id: str, *, shm: str | None = None, files: Path | None = None, local: Path | None = None,
           layout: str = "rank_sharded") -> dict:
    tiers = []
    if shm is not None:
        tiers.append({"name": "shm", "kind": "shm", "path": shm})
    if files is not None:
        tiers.append({"name": "shared", "kind": "fsspec", "url": f"file://{files}"})
    if local is not None:  # the local tier as configured by default: fsync, so O_DIRECT where the disk takes it
        tiers.append({"name": "disk", "kind": "local", "path": str(local)})
    cfg: dict[str, Any] = {"run_id": run_id, "layout": layout, "tiers": tiers}
    if DRAIN:
        cfg["drain"] = {"mode": DRAIN}
    return cfg


def save(job: harness.Job, engine: CheckpointEngine) -> Any:
    return adapter.save_checkpoint(job.iteration, job.model, job.optimizer, job.scheduler, FLOPS, engine=engine,
                                   args=job.args, rng_tracker=job.tracker)


def load_error(job: harness.Job, engine: CheckpointEngine) -> str | None:
    """What :func:`load` raised, as ``"Type: message"``; None when it loaded."""
    try:
        load(job, engine)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None


def load(job: harness.Job, engine: CheckpointEngine) -> tuple[int, float]:
    iteration, flops = adapter.load_checkpoint(job.model, job.optimizer, job.scheduler, engine=engine,
                                               args=job.args, rng_tracker=job.tracker)
    job.iteration = job.args.iteration = iteration
    return iteration, flops


# ------------------------------------------------------------------------------------------------------------
# what the ranks run (module level: the rank processes import this module to find them)


def rank_train_save_continue(rank: int, world: int, spec: Spec, cfgs: list[dict]) -> dict[str, Any]:
    """Train to SAVED_AT, save through the adapter into each config, train on to RESUMED_TO (the reference)."""
    job = spec.job()
    train(job, SAVED_AT)
    engines = [CheckpointEngine(cfg, job.layout, rank=rank) for cfg in cfgs]
    handles = [save(job, e) for e in engines]
    saved, at_save = full_state(job), fingerprint(job)
    train(job, RESUMED_TO)
    for h in handles:
        h.wait(timeout=120)
    for e in engines:
        e.close()
    return {"coords": harness.coords(), "full_state": saved, "at_save": at_save, "fingerprint": fingerprint(job)}


def rank_resume(rank: int, world: int, spec: Spec, cfgs: list[dict]) -> list[Any]:
    """For each config: a new job loads the checkpoint and trains to RESUMED_TO."""
    out = []
    for cfg in cfgs:
        job = spec.job()
        with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
            loaded = load(job, engine)
        train(job, RESUMED_TO)
        out.append((loaded, fingerprint(job)))
    return out


def rank_resume_checked(rank: int, world: int, spec: Spec, cfgs: list[dict]) -> list[Any]:
    """:func:`rank_resume`, also taking this rank's state right after the load: a difference after training then
    tells a load that was not exact from training that went another way."""
    out = []
    for cfg in cfgs:
        job = spec.job()
        with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
            loaded = load(job, engine)
        after_load = fingerprint(job)
        train(job, RESUMED_TO)
        out.append((loaded, after_load, fingerprint(job)))
    return out


def rank_load_full_state(rank: int, world: int, spec: Spec, cfgs: list[dict]) -> dict[str, Any]:
    out = []
    for cfg in cfgs:
        job = spec.job()
        with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
            loaded = load(job, engine)
        out.append((loaded, full_state(job)))
    return {"coords": harness.coords(), "loads": out}


def rank_load_without_optimizer(rank: int, world: int, spec: Spec, cfg: dict) -> float:
    """A job started from another seed loads only the model (no_load_optim): the largest difference between
    each fp32 main param and the loaded weight it shadows (0 when the main params follow the weights)."""
    job = build_job(spec.tp, spec.pp, spec.precision, seed=99, dropout=0.1)
    job.args.no_load_optim = True
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        load(job, engine)
    worst = 0.0
    for opt in harness.distributed_optimizers(job):
        for by_dtype in opt.gbuf_ranges:
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        main = opt._get_main_param_and_optimizer_states(param)["param"].reshape(-1)
                        r = ranges["param"]
                        weight = param.detach().reshape(-1)[r.start:r.end].float()
                        worst = max(worst, float((main.float() - weight).abs().max()) if main.numel() else 0.0)
    return worst


def rank_save_to_memory_and_die(rank: int, world: int, spec: Spec, cfg: dict) -> None:
    job = spec.job()
    train(job, SAVED_AT)
    engine = CheckpointEngine(cfg, job.layout, rank=rank)
    save(job, engine).wait(timeout=120)
    harness.kill_self()


def rank_load_fixture(rank: int, world: int, ckpt: Path, run_id: str) -> dict[str, Any]:
    # The fixture's model (its args): 4 layers, hidden 64, FFN 256, 4 heads, seq 16, vocab 128, tied embeddings,
    # micro batch 1 x 6 micro-batches x DP 2 = global batch 12, ddp_bucket_size 6000 with overlap_grad_reduce.
    job = build_job(1, 2, "fp32", seed=1234, micro_batch=1, global_batch=12, bucket_size=6000,
                    overlap_grad_reduce=True)
    cfg = {"run_id": run_id, "tiers": [{"name": "megatron", "kind": "fsspec", "url": f"file://{ckpt}"}],
           **({"drain": {"mode": DRAIN}} if DRAIN else {})}
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        loaded = load(job, engine)
    model = {k: v.clone() for k, v in adapter.unwrap(job.model[0]).state_dict_for_save_checkpoint().items()
             if isinstance(v, torch.Tensor)}
    return {"loaded": loaded, "shards": harness.local_shards(job), "model": model,
            "consumed_train_samples": job.args.consumed_train_samples}


def rank_load_fixture_without_its_optimizer_state(rank: int, world: int, ckpt: Path, run_id: str) -> dict[str, Any]:
    """The fixture's job loads a copy of it whose distrib_optim.pt files are gone: first as is, then with
    --no-load-optim."""
    job = build_job(1, 2, "fp32", seed=1234, micro_batch=1, global_batch=12, bucket_size=6000,
                    overlap_grad_reduce=True)
    cfg = {"run_id": run_id, "tiers": [{"name": "megatron", "kind": "fsspec", "url": f"file://{ckpt}"}],
           **({"drain": {"mode": DRAIN}} if DRAIN else {})}
    out: dict[str, Any] = {}
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        out["error"] = load_error(job, engine)
        job.args.no_load_optim = True
        out["loaded"] = load(job, engine)[0]
    return out


# ------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    """Like the plugin's ``shm_root``, for the module: a fresh directory on /dev/shm."""
    path = tempfile.mkdtemp(prefix="tiered-ckpt-test-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class SavedRun:
    spec: Spec
    files: dict[str, Path]  # layout -> the file tier's directory
    run_ids: dict[str, str]
    ranks: list[dict[str, Any]]  # rank_train_save_continue's results
    local: dict[str, Path] = field(default_factory=dict)  # layout -> the local tier's directory (same saves)

    def reference(self, coords: tuple[int, int, int]) -> dict[str, Any]:
        return next(r for r in self.ranks if r["coords"] == coords)


@pytest.fixture(scope="module", params=SPECS, ids=lambda s: s.id)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, shm_dir: str) -> SavedRun:
    spec: Spec = request.param
    root = tmp_path_factory.mktemp(spec.id)
    layouts = ("rank_sharded", "megatron")
    files = {lay: root / lay for lay in layouts}
    local = {lay: root / f"{lay}-local" for lay in layouts}
    run_ids = {lay: f"real-{lay}-{uuid.uuid4().hex[:8]}" for lay in layouts}
    cfgs = [config(run_ids["rank_sharded"], shm=shm_dir, files=files["rank_sharded"], local=local["rank_sharded"]),
            config(run_ids["megatron"], files=files["megatron"], local=local["megatron"], layout="megatron")]
    ranks = launch(rank_train_save_continue, 4, spec, cfgs)
    return SavedRun(spec, files, run_ids, ranks, local)


def file_configs(run: SavedRun) -> list[dict]:
    """New engines with the file tier only (nothing in memory)."""
    return [config(run.run_ids[lay], files=run.files[lay], layout=lay) for lay in run.files]


# ------------------------------------------------------------------------------------------------------------
# tests


def test_resume_same_dp_bit_exact(saved: SavedRun) -> None:
    """(a) Both layouts: a new job loads step 3 from the file tier and trains to 5 exactly like the run that
    never stopped."""
    results = launch(rank_resume_checked, 4, saved.spec, file_configs(saved))
    for rank, per_layout in enumerate(results):
        for layout, (loaded, after_load, got) in zip(saved.files, per_layout, strict=True):
            check_resumed(saved, rank, layout, loaded, after_load, got)


def check_resumed(saved: SavedRun, rank: int, layout: str, loaded: Any, after_load: dict, got: dict) -> None:
    assert loaded == (SAVED_AT, FLOPS)
    assert differences(saved.ranks[rank]["at_save"], after_load) == [], f"rank {rank}, layout {layout}: the load"
    diverged = differences(saved.ranks[rank]["fingerprint"], got)
    assert diverged == [], (f"rank {rank}, layout {layout}: loaded bit-exact, then training went another way than "
                            f"in the run that never stopped: {diverged}")


def test_resume_from_the_local_tier_bit_exact(saved: SavedRun) -> None:
    """(a) again from the local tier (O_DIRECT, with writes from the snapshot left running while the drain makes
    the next piece), both layouts: Megatron's files load with its allow-list, and a new job resumes exactly."""
    check_model_files(saved, saved.local)
    cfgs = [config(saved.run_ids[lay], local=saved.local[lay], layout=lay) for lay in saved.local]
    results = launch(rank_resume_checked, 4, saved.spec, cfgs)
    for rank, per_layout in enumerate(results):
        for layout, (loaded, after_load, got) in zip(saved.local, per_layout, strict=True):
            check_resumed(saved, rank, layout, loaded, after_load, got)


@pytest.mark.parametrize("dp", [1, 4])
def test_load_at_other_dp_full_state(saved: SavedRun, dp: int) -> None:
    """(b) At DP 1 and DP 4 (same TP/PP), both layouts: every param's full optimizer state is the saved one."""
    world = saved.spec.tp * saved.spec.pp * dp
    results = launch(rank_load_full_state, world, saved.spec, file_configs(saved))
    for rank, res in enumerate(results):
        tp, pp, _ = res["coords"]
        want = saved.reference((tp, pp, 0))["full_state"]
        for layout, (loaded, got) in zip(saved.files, res["loads"], strict=True):
            assert loaded == (SAVED_AT, FLOPS)
            assert differences(want, got) == [], f"DP {dp} rank {rank}, layout {layout}"


def _pickle_globals(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found


def test_model_files_load_with_megatron_allow_list(saved: SavedRun) -> None:
    """(c) Every model_optim_rng.pt the engine wrote loads with torch's weights_only loader and the globals
    Megatron registers (megatron/core/safe_globals.py), its enums are Megatron's, and no global names us."""
    check_model_files(saved)


def check_model_files(saved: SavedRun, dirs: dict[str, Path] | None = None) -> None:
    """Megatron's files in ``dirs`` (layout -> a file tier's directory; default: ``saved.files``)."""
    from megatron.core.enums import ModelType
    from megatron.core.safe_globals import SAFE_GLOBALS
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    dirs = saved.files if dirs is None else dirs
    paths = sorted(p for d in dirs.values() for p in d.rglob("model_optim_rng.pt"))
    assert len(paths) == 2 * saved.spec.tp * saved.spec.pp, paths
    for path in paths:
        names = _pickle_globals(path)
        assert not [n for n in names if n.startswith("tiered_ckpt")], (path, sorted(names))
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            state = torch.load(path, weights_only=True)
        args = state["args"]
        assert args.model_type is ModelType.encoder_or_decoder, (path, args.model_type)
        assert args.attention_backend is AttnBackend.auto, (path, args.attention_backend)
        assert args.cuda_graph_scope == [CudaGraphScope.attn] and args.exit_signal is signal.SIGTERM, path
        assert args.params_dtype == (torch.bfloat16 if saved.spec.precision == "bf16" else torch.float32)
        assert state["iteration"] == SAVED_AT and state["num_floating_point_operations_so_far"] == FLOPS
    # and `tiered-ckpt verify` (checksums, plus the same check of Megatron's loader) passes them
    from tiered_ckpt.cli import main as cli_main

    for d in dirs.values():
        assert cli_main(["verify", str(d)]) == 0, d


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (one rank on GPU 0, NCCL)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_job_on_cuda_resumes_bit_exact_in_both_layouts(tmp_path: Path, shm_dir: str, precision: str) -> None:
    """(a), (b) and (c) on a GPU: the genuine Megatron job on CUDA (one rank, NCCL, dropout drawing from the CUDA
    generator through the RNG tracker) saves step 3 through the adapter into tiers gpu + shm + file
    (rank_sharded) and a file tier (megatron), and trains on to 5. New jobs that load either file tier train to 5
    bit-exactly like it; the full optimizer state they load is the saved one; the model files load with
    Megatron's allow-list."""
    spec = Spec(1, 1, precision)
    layouts = ("rank_sharded", "megatron")
    files = {lay: tmp_path / lay for lay in layouts}
    run_ids = {lay: f"real-cuda-{lay}-{uuid.uuid4().hex[:8]}" for lay in layouts}
    cfgs = [config(run_ids["rank_sharded"], shm=shm_dir, files=files["rank_sharded"]),
            config(run_ids["megatron"], files=files["megatron"], layout="megatron")]
    cfgs[0]["tiers"].insert(0, {"name": "hbm", "kind": "gpu", "device": "cuda"})  # the snapshot on the device
    [reference] = launch(rank_train_save_continue, 1, spec, cfgs, device="cuda")
    run = SavedRun(spec, files, run_ids, [reference])
    [resumed] = launch(rank_resume, 1, spec, file_configs(run), device="cuda")
    for layout, (loaded, got) in zip(files, resumed, strict=True):
        assert loaded == (SAVED_AT, FLOPS), layout
        assert "rng/cuda" in got and differences(reference["fingerprint"], got) == [], layout
    [full] = launch(rank_load_full_state, 1, spec, file_configs(run), device="cuda")
    for layout, (loaded, got) in zip(files, full["loads"], strict=True):
        assert loaded == (SAVED_AT, FLOPS) and differences(reference["full_state"], got) == [], layout
    check_model_files(run)


def test_load_without_the_optimizer_keeps_main_params_on_the_loaded_weights(saved: SavedRun) -> None:
    """--no-load-optim (or --finetune) with mixed precision: the optimizer's fp32 main params follow the weights
    just loaded (Megatron's reload_model_params), or the first step would restore the new job's random init."""
    cfg = file_configs(saved)[0]
    worst = launch(rank_load_without_optimizer, 4, saved.spec, cfg)
    assert max(worst) == 0.0, worst  # (fp32: the main params are the weights themselves)


@pytest.mark.slow
def test_sigkill_after_memory_only_save_resumes_every_rank(saved: SavedRun, shm_root: str) -> None:
    """(d) Only the shm tier: save, wait, SIGKILL every rank; a new set of ranks with the same run_id and shm
    path resumes every rank (DP rank > 0 included) from memory, and continues bit-exact."""
    cfg = config(f"real-mem-{uuid.uuid4().hex[:8]}", shm=shm_root)
    codes = launch(rank_save_to_memory_and_die, 4, saved.spec, cfg, expect_kill=True)
    assert codes == [-signal.SIGKILL] * 4
    results = launch(rank_resume, 4, saved.spec, [cfg])
    for rank, [(loaded, got)] in enumerate(results):
        assert loaded == (SAVED_AT, FLOPS)
        assert differences(saved.ranks[rank]["fingerprint"], got) == [], f"rank {rank}"


def test_megatron_written_checkpoint_loads_bit_exact(tmp_path: Path) -> None:
    """(e) The fixture dp2_tp1_pp2 (legacy torch format, written by Megatron-LM's own save_checkpoint) loads
    through the adapter into the genuine model and DistributedOptimizer at DP 2: every rank's local shards and
    model tensors are Megatron's, bit for bit."""
    src = FIXTURES / "dp2_tp1_pp2"
    if not src.is_dir():
        pytest.skip(f"{src} is not here")
    ckpt = tmp_path / "dp2_tp1_pp2"
    shutil.copytree(src, ckpt, ignore=shutil.ignore_patterns("reload_dp*", "local_shards", "truth.json"))
    results = launch(rank_load_fixture, 4, ckpt, f"real-fixture-{uuid.uuid4().hex[:8]}")
    from tiered_ckpt.megatron import safe_load

    for rank, res in enumerate(results):
        assert res["loaded"] == (10, safe_load.load(ckpt / "iter_0000010/mp_rank_00_000/model_optim_rng.pt")[
            "num_floating_point_operations_so_far"])
        assert res["consumed_train_samples"] == 120
        want = torch.load(src / "local_shards" / f"rank_{rank:05d}.pt", weights_only=True)
        assert differences(want, res["shards"]) == [], f"rank {rank}"
        stage = rank // 2  # rank = tp + TP * (dp + DP * pp)
        model = safe_load.load(ckpt / f"iter_0000010/mp_rank_00_{stage:03d}/model_optim_rng.pt")["model"]
        want_model = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
        assert differences(want_model, res["model"]) == [], f"rank {rank}"


def test_a_checkpoint_without_the_distributed_optimizer_state_is_refused_unless_no_load_optim(tmp_path: Path) -> None:
    """Trial: a Megatron-written checkpoint whose distrib_optim.pt is gone loaded without a word, the optimizer
    moments not restored (and in bf16/fp16 the main params left on the new job's init). Megatron-LM stops there
    (unless --no-load-optim); so does the adapter, saying what is missing and how to go on."""
    src = FIXTURES / "dp2_tp1_pp2"
    if not src.is_dir():
        pytest.skip(f"{src} is not here")
    ckpt = tmp_path / "dp2_tp1_pp2"
    shutil.copytree(src, ckpt, ignore=shutil.ignore_patterns("reload_dp*", "local_shards", "truth.json",
                                                            "distrib_optim.pt"))
    assert not list(ckpt.rglob("distrib_optim.pt"))
    results = launch(rank_load_fixture_without_its_optimizer_state, 4, ckpt, f"real-noopt-{uuid.uuid4().hex[:8]}")
    for rank, res in enumerate(results):
        assert res["error"] is not None and "LayoutMismatchError" in res["error"], (rank, res)
        assert "no distributed-optimizer state (Megatron's distrib_optim.pt)" in res["error"], (rank, res)
        assert "--no-load-optim" in res["error"], (rank, res)
        assert res["loaded"] == 10, (rank, res)  # with --no-load-optim: the weights, as Megatron would


def test_plain_ddp_at_dp_2_resumes_bit_exact_from_every_tier(tmp_path: Path, shm_root: str) -> None:
    """Megatron's default optimizer (no --use-distributed-optimizer) at DP 2: DP rank 0 of each model-parallel group
    holds everything (model_optim_rng.pt, the optimizer's state inside), the DP rank 1s nothing of their own. Every
    rank saves through the drop-in; a new job resumes bit-exact from the file tiers of both layouts and, after a
    SIGKILL, from memory alone (DP rank 1 reading its holder's snapshot)."""
    spec = Spec(1, 2, "fp32", distributed_optimizer=False)
    cfgs = [config(f"real-ddp-{uuid.uuid4().hex[:8]}", shm=shm_root, local=tmp_path / "rank_sharded"),
            config(f"real-ddp-{uuid.uuid4().hex[:8]}", local=tmp_path / "megatron", layout="megatron")]
    ranks = launch(rank_train_save_continue, 4, spec, cfgs)
    assert any(k.endswith("/exp_avg_sq") for k in ranks[1]["fingerprint"])  # the comparison covers Adam's state
    files = [config(cfg["run_id"], local=Path(cfg["tiers"][-1]["path"]), layout=cfg["layout"]) for cfg in cfgs]
    for rank, per_config in enumerate(launch(rank_resume, 4, spec, files)):
        for cfg, (loaded, got) in zip(files, per_config, strict=True):
            assert loaded == (SAVED_AT, FLOPS)
            assert differences(ranks[rank]["fingerprint"], got) == [], f"rank {rank}, layout {cfg['layout']}"
    for dp in (1, 4):  # at another DP size every rank reads its stage's model_optim_rng.pt
        for rank, res in enumerate(launch(rank_load_full_state, 2 * dp, spec, files)):
            want = next(r for r in ranks if r["coords"][:2] == res["coords"][:2])["full_state"]
            for cfg, (loaded, got) in zip(files, res["loads"], strict=True):
                assert loaded == (SAVED_AT, FLOPS)
                assert differences(want, got) == [], f"DP {dp} rank {rank}, layout {cfg['layout']}"
    # plain Megatron's files: one model_optim_rng.pt per stage, holding the optimizer's state; no distrib_optim.pt
    step_dir = tmp_path / "megatron" / f"iter_{SAVED_AT:07d}"
    assert sorted(p.name for p in step_dir.glob("mp_rank_*")) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert not list(step_dir.rglob("distrib_optim.pt"))
    from tiered_ckpt.megatron import safe_load

    state = safe_load.load(step_dir / "mp_rank_00_000" / "model_optim_rng.pt")
    assert state["iteration"] == SAVED_AT and state["optimizer"]["state"]  # FP32Optimizer: torch Adam's dict
    # rank_sharded -> megatron: nothing to merge, the model files as they are
    from tiered_ckpt.cli import main as cli_main

    assert cli_main(["convert", str(tmp_path / "rank_sharded"), str(tmp_path / "converted"), "--to", "megatron"]) == 0
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):
        converted = tmp_path / "converted" / f"iter_{SAVED_AT:07d}" / stage / "model_optim_rng.pt"
        assert converted.read_bytes() == (step_dir / stage / "model_optim_rng.pt").read_bytes(), stage

    memory = config(f"real-ddp-mem-{uuid.uuid4().hex[:8]}", shm=shm_root)
    assert launch(rank_save_to_memory_and_die, 4, spec, memory, expect_kill=True) == [-signal.SIGKILL] * 4
    for rank, [(loaded, got)] in enumerate(launch(rank_resume, 4, spec, [memory])):
        assert loaded == (SAVED_AT, FLOPS)
        assert differences(ranks[rank]["fingerprint"], got) == [], f"rank {rank} from memory"


def rank_save_model_only(rank: int, world: int, spec: Spec, cfg: dict) -> dict[str, Any]:
    """Megatron's upcycling save: ``save_checkpoint(..., optimizer=None, opt_param_scheduler=None)`` on every rank."""
    job = spec.job()
    train(job, SAVED_AT)
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        adapter.save_checkpoint(job.iteration, job.model, None, None, FLOPS, engine=engine, args=job.args,
                                rng_tracker=job.tracker).wait(timeout=120)
    return {k: v for k, v in fingerprint(job).items() if k.startswith("param/")}


def rank_load_model_only(rank: int, world: int, spec: Spec, cfg: dict) -> dict[str, Any]:
    job = build_job(spec.tp, spec.pp, spec.precision, seed=99, distributed_optimizer=spec.distributed_optimizer)
    job.args.no_load_optim = True
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        loaded = load(job, engine)
    return {"loaded": loaded, "params": {k: v for k, v in fingerprint(job).items() if k.startswith("param/")}}


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distopt", "ddp"])
def test_a_model_only_save_at_dp_2_loads_the_weights(tmp_path: Path, distributed_optimizer: bool) -> None:
    """Megatron's upcycling path saves without an optimizer (optimizer=None) on every rank: DP rank 1 has nothing
    of its own and takes part in the commit; a job loading with --no-load-optim gets the weights bit-exact."""
    spec = Spec(1, 2, "fp32", distributed_optimizer=distributed_optimizer)
    cfg = config(f"real-model-only-{uuid.uuid4().hex[:8]}", local=tmp_path / "megatron", layout="megatron")
    saved = launch(rank_save_model_only, 4, spec, cfg)
    assert not list((tmp_path / "megatron").rglob("distrib_optim.pt"))
    for rank, res in enumerate(launch(rank_load_model_only, 4, spec, cfg)):
        assert res["loaded"] == (SAVED_AT, FLOPS)
        assert differences(saved[rank], res["params"]) == [], f"rank {rank}"


def rank_save_two_steps(rank: int, world: int, spec: Spec, cfg: dict) -> dict[str, Any]:
    """Save step SAVED_AT and SAVED_AT + 1, train on to RESUMED_TO (the reference)."""
    job = spec.job()
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        for step in (SAVED_AT, SAVED_AT + 1):
            train(job, step)
            save(job, engine).wait(timeout=120)
        train(job, RESUMED_TO)
    return fingerprint(job)


def rank_load_ckpt_step(rank: int, world: int, spec: Spec, cfg: dict) -> dict[str, Any]:
    """args.ckpt_step (Megatron's --ckpt-step) = SAVED_AT, then train to RESUMED_TO; then a step no tier holds."""
    job = spec.job()
    job.args.ckpt_step = SAVED_AT
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        loaded = load(job, engine)
    train(job, RESUMED_TO)
    out: dict[str, Any] = {"loaded": loaded, "fingerprint": fingerprint(job)}
    job = spec.job()
    job.args.ckpt_step = 7
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        try:
            out["missing"] = load(job, engine)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["missing"] = type(exc).__name__
    return out


def test_ckpt_step_loads_that_step_and_resumes_bit_exact(tmp_path: Path) -> None:
    """Trial: --ckpt-step (args.ckpt_step) was ignored by the drop-in: the newest step was loaded instead of the one
    asked for. Now it picks the step, as Megatron's _load_base_checkpoint does, and a step no tier holds is an error
    (never a fresh start)."""
    spec = Spec(1, 2, "fp32")
    cfg = config(f"real-ckpt-step-{uuid.uuid4().hex[:8]}", local=tmp_path / "megatron", layout="megatron")
    reference = launch(rank_save_two_steps, 4, spec, cfg)
    for rank, res in enumerate(launch(rank_load_ckpt_step, 4, spec, cfg)):
        assert res["loaded"] == (SAVED_AT, FLOPS), (rank, res["loaded"])
        assert differences(reference[rank], res["fingerprint"]) == [], f"rank {rank}"
        assert res["missing"] == "StepNotFoundError", (rank, res["missing"])


def rank_load_pretrained(rank: int, world: int, empty: Path, pretrained: Path, run_id: str) -> dict[str, Any]:
    """A job whose tiers hold nothing, with args.pretrained_checkpoint (Megatron's --pretrained-checkpoint)."""
    job = build_job(1, 2, "fp32", seed=99, micro_batch=1, global_batch=12, bucket_size=6000,
                    overlap_grad_reduce=True)
    job.args.load, job.args.pretrained_checkpoint = str(empty), str(pretrained)
    cfg = config(run_id, local=empty, layout="megatron")
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        loaded = load(job, engine)
    model = {k: v.clone() for k, v in adapter.unwrap(job.model[0]).state_dict_for_save_checkpoint().items()
             if isinstance(v, torch.Tensor)}
    return {"loaded": loaded, "finetune": job.args.finetune, "model": model,
            "consumed_train_samples": job.args.consumed_train_samples, "scheduler_steps": job.scheduler.num_steps}


def test_pretrained_checkpoint_is_finetuned_from_when_no_tier_holds_a_checkpoint(tmp_path: Path) -> None:
    """Trial: with --pretrained-checkpoint and nothing in --load yet (Megatron-LM's finetuning start), the drop-in
    started from random weights, its warning calling that Megatron's behaviour. Megatron loads the pretrained
    checkpoint with --finetune semantics; so does the adapter now (here a checkpoint Megatron-LM wrote)."""
    src = FIXTURES / "dp2_tp1_pp2"
    if not src.is_dir():
        pytest.skip(f"{src} is not here")
    pretrained = tmp_path / "pretrained"
    shutil.copytree(src, pretrained, ignore=shutil.ignore_patterns("reload_dp*", "local_shards", "truth.json"))
    (tmp_path / "run").mkdir()
    results = launch(rank_load_pretrained, 4, tmp_path / "run", pretrained, f"real-pre-{uuid.uuid4().hex[:8]}")
    from tiered_ckpt.megatron import safe_load

    for rank, res in enumerate(results):
        stage = rank // 2  # rank = tp + TP * (dp + DP * pp)
        want = safe_load.load(pretrained / f"iter_0000010/mp_rank_00_{stage:03d}/model_optim_rng.pt")
        assert res["loaded"] == (0, want["num_floating_point_operations_so_far"]), (rank, res["loaded"])
        assert res["finetune"] is True and res["consumed_train_samples"] == 0 and res["scheduler_steps"] == 0, rank
        want_model = {k: v for k, v in want["model"].items() if isinstance(v, torch.Tensor)}
        assert differences(want_model, res["model"]) == [], f"rank {rank}"


def rank_save_without_optimizer_and_rng(rank: int, world: int, spec: Spec, cfg: dict) -> dict[str, Any]:
    """Save step SAVED_AT with --no-save-optim and --no-save-rng; then a new job loads it: as is, and with
    --no-load-optim (the RNG warning is looked for on the way)."""
    import logging

    job = spec.job()
    job.args.no_save_optim = job.args.no_save_rng = True
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        train(job, SAVED_AT)
        save(job, engine).wait(timeout=120)
    out: dict[str, Any] = {}
    job = spec.job()
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        out["error"] = load_error(job, engine)
        job.args.no_load_optim = True
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("tiered_ckpt").addHandler(handler)
        try:
            out["loaded"] = load(job, engine)
        finally:
            logging.getLogger("tiered_ckpt").removeHandler(handler)
        out["rng_warning"] = [m for m in seen if "no RNG state" in m]
    return out


def test_a_checkpoint_saved_without_optimizer_or_rng_says_so_on_load(tmp_path: Path) -> None:
    """Trial: a checkpoint saved with --no-save-optim was refused with advice to save with
    --use-distributed-optimizer (it was); one saved with --no-save-rng loaded without a word, where Megatron-LM
    stops. The refusal now says the optimizer state was not saved, and a missing RNG state is a warning."""
    spec = Spec(1, 2, "fp32")
    cfg = config(f"real-nosave-{uuid.uuid4().hex[:8]}", local=tmp_path / "megatron", layout="megatron")
    for rank, res in enumerate(launch(rank_save_without_optimizer_and_rng, 4, spec, cfg)):
        assert res["error"] is not None and "holds no optimizer state (saved with --no-save-optim" in res["error"], \
            (rank, res["error"])
        assert "--no-load-optim" in res["error"] and "--use-distributed-optimizer" not in res["error"], rank
        assert res["loaded"] == (SAVED_AT, FLOPS), (rank, res["loaded"])
        assert res["rng_warning"] and "--no-load-rng" in res["rng_warning"][0], (rank, res["rng_warning"])


def rank_save_to_a_tier_that_fails(rank: int, world: int, spec: Spec, cfg: dict) -> dict[str, Any]:
    """Two saves through the drop-in into shm + a tier whose every write fails; the first is waited for."""
    job = spec.job()
    train(job, SAVED_AT)
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        first = save(job, engine)
        try:
            first.wait(timeout=120)
        except Exception as exc:  # noqa: BLE001 - expected: the tier refuses every write
            first_error = type(exc).__name__
        train(job, RESUMED_TO)
        try:
            save(job, engine)
            second = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            second = f"{type(exc).__name__}: {exc}"
        return {"first": first_error, "second": second, "held": engine.available_steps().get("shm", [])}


def test_a_save_that_reached_no_durable_tier_stops_the_job_at_the_next_save(tmp_path: Path, shm_root: str) -> None:
    """A Megatron user's trial: with the --save directory gone, every save failed on the disk tier (a warning
    each) and the job trained to its end, exit 0, with no checkpoint on disk: Megatron ignores what
    save_checkpoint returns. The next save takes its snapshot, then raises, naming the step and the tier."""
    cfg = config(f"real-lost-{uuid.uuid4().hex[:8]}", shm=shm_root)
    cfg["tiers"].append({"name": "disk", "kind": "faulty", "inner": {"kind": "local", "path": str(tmp_path / "d")},
                         "permanent_error": True, "retry": {"attempts": 1}})
    (res,) = launch(rank_save_to_a_tier_that_fails, 1, Spec(1, 1, "fp32"), cfg)
    assert res["first"] == "SaveError", res
    assert res["second"] is not None and res["second"].startswith(
        f"SavesFailedError: step(s) {SAVED_AT} reached no durable tier (step {SAVED_AT}: 'disk': "), res
    assert "Stopping rather than training on with no checkpoint on disk" in res["second"]
    assert res["held"] == [SAVED_AT, RESUMED_TO]  # the second save's snapshot was taken before the error
