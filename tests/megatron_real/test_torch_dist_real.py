"""Megatron's ``torch_dist`` format through the adapter, on genuine megatron-core (CPU/gloo, harness.py).

(a) our save -> Megatron's own ``dist_checkpointing.load`` (its FileSystemReader on the file tier), at the same
layout (tp1 pp1 dp2: every rank's model and full optimizer state bit-exact) and at others (tp2 pp1 dp1 and
tp1 pp2 dp1: every tensor, in checkpoint space, bit-exact); (b) Megatron's own ``dist_checkpointing.save`` (its
default save strategy and FileSystemWriterAsync, unmodified) -> our ``load_checkpoint``, at the same layouts;
(c) SIGKILL after a memory-only save: every rank resumes from shm and trains on bit-exact; (d) with a constant
structure the second save reuses the first save's plan and runs no collective (torch.distributed's collectives
raise while it runs); (e) the strategy's saves on a cached plan, collective-free, with a ShardedObject whose pickled
length changes between them: Megatron's load of the files and ours from shm and from the files give every rank
exactly what it saved, the files equal a planned save's, and a rank that fails its save leaves the step
uncommitted and the previous one loadable.

Bit-exact across layouts is checked in checkpoint space: each ShardedTensor a job's (model, optimizer)
sharded_state_dict holds equals its slice of the global tensor Megatron's ``load_plain_tensors`` reads back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import pickle
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness  # noqa: E402
import pytest
import torch
from harness import build_job, differences, fingerprint, full_state, launch, train  # noqa: E402

from tiered_ckpt import CheckpointEngine  # noqa: E402
from tiered_ckpt.megatron import adapter  # noqa: E402
from tiered_ckpt.parallel import ParallelLayout  # noqa: E402

SAVED_AT, RESUMED_TO, FLOPS = 3, 5, 4321.0
DRAIN = os.environ.get("MEGATRON_REAL_DRAIN")
SAVE_LAYOUT = (1, 1)  # (TP, PP) on 2 ranks: DP 2
OTHER_LAYOUTS = ((2, 1), (1, 2))  # TP 2 DP 1; PP 2 DP 1


def config(run_id: str, *, shm: str | None = None, files: Path | None = None) -> dict:
    tiers = []
    if shm is not None:
        tiers.append({"name": "shm", "kind": "shm", "path": shm})
    if files is not None:
        tiers.append({"name": "disk", "kind": "local", "path": str(files)})
    return {"run_id": run_id, "layout": "dcp", "tiers": tiers, **({"drain": {"mode": DRAIN}} if DRAIN else {})}


def job_at(tp: int, pp: int, seed: int = 20, *, distributed_optimizer: bool = True) -> harness.Job:
    job = build_job(tp, pp, "fp32", seed=seed, dropout=0.1, distributed_optimizer=distributed_optimizer)
    job.args.ckpt_format = "torch_dist"
    job.args.dist_ckpt_optim_fully_reshardable = True  # the optimizer reshards over TP too (Megatron's flag)
    job.args.distrib_optim_fully_reshardable_mem_efficient = False
    return job


def metadata(job: harness.Job) -> dict[str, Any]:
    from megatron.core import parallel_state

    from tiered_ckpt.megatron.adapter_dist import content_metadata

    return content_metadata(job.args, parallel_state.get_data_parallel_group(with_context_parallel=True))


def megatron_request(job: harness.Job, *, is_loading: bool) -> dict[str, Any]:
    """The sharded state dict as Megatron's generate_state_dict builds it, from Megatron's own methods."""
    md = metadata(job)
    model = adapter.unwrap(job.model[0])
    state: dict[str, Any] = {"model": model.sharded_state_dict(metadata=md)}
    state["optimizer"] = job.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=md)
    return state


def checkpoint_space(job: harness.Job) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    """Every ShardedTensor of this rank's (model, optimizer) state: key -> [(its index in the global tensor, data)]."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded, _ = save_preprocess(megatron_request(job, is_loading=False), validate_access_integrity=False)
    out: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for t in nested_values(sharded):
        if isinstance(t, ShardedTensor) and t.data is not None:
            assert t.flattened_range is None, t.key
            # the leading prepend_axis_num axes (a layer's index in its stack, say) have local size 1
            index = tuple(t.global_offset[:t.prepend_axis_num]) + tuple(
                slice(o, o + n) for o, n in zip(t.global_offset[t.prepend_axis_num:], t.data.shape, strict=True))
            out.setdefault(t.key, []).append((index, t.data.detach().clone()))
    return out


def mismatches(space: dict[str, list[tuple[tuple, torch.Tensor]]], plain: dict[str, torch.Tensor]
               ) -> list[str]:
    """The tensors of ``space`` that are not bit for bit their slice of the global tensors in ``plain``."""
    bad = []
    for key, pieces in space.items():
        if key not in plain:
            bad.append(f"{key}: not in the checkpoint")
            continue
        for offset, data in pieces:
            piece = plain[key][offset]
            if piece.dtype != data.dtype or piece.shape != data.shape or not torch.equal(
                    piece.reshape(-1).view(torch.uint8), data.reshape(-1).view(torch.uint8)):
                bad.append(f"{key} at {offset}: differs")
    return sorted(bad)


def rank_plain_tensors(rank: int, world: int, ckpt: str) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing import load_plain_tensors

    return {k: v for k, v in load_plain_tensors(ckpt).items() if isinstance(v, torch.Tensor)}


def plain_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist step directory, whole, read by Megatron's own load_plain_tensors (one rank)."""
    (tensors,) = launch(rank_plain_tensors, 1, str(ckpt))
    assert tensors, ckpt
    return tensors


def save(job: harness.Job, engine: CheckpointEngine, *, persistent: bool = True) -> Any:
    return adapter.save_checkpoint(job.iteration, job.model, job.optimizer, job.scheduler, FLOPS, engine=engine,
                                   args=job.args, rng_tracker=job.tracker, non_persistent_ckpt=not persistent)


def load(job: harness.Job, engine: CheckpointEngine) -> tuple[int, float]:
    loaded = adapter.load_checkpoint(job.model, job.optimizer, job.scheduler, engine=engine, args=job.args,
                                     rng_tracker=job.tracker)
    job.iteration = job.args.iteration = loaded[0]
    return loaded


# ------------------------------------------------------------------------------------------------------------
# what the ranks run


def rank_save_ours(rank: int, world: int, cfg: dict, saves: int) -> dict[str, Any]:
    """Train to SAVED_AT, save through the adapter (``saves`` times: the later ones reuse the plan), train on."""
    job = job_at(*SAVE_LAYOUT)
    job.args.ckpt_assume_constant_structure = saves > 1
    train(job, SAVED_AT - (saves - 1))
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        for _ in range(saves):
            if job.iteration < SAVED_AT:
                save(job, engine)
                train(job, job.iteration + 1)
        # (d): the save on the cached plan runs no collective, from Megatron's dist_checkpointing steps
        # (torch_dist.save) to the drain's commit. Building the state is Megatron's own and gathers (its
        # distributed optimizer's fully reshardable state goes through DP rank 0): that part is not refused.
        from tiered_ckpt.megatron import torch_dist

        with refusing_collectives_in(torch_dist, "save") if saves > 1 else contextlib.nullcontext([]) as calls:
            handle = save(job, engine)
            with no_collectives() if saves > 1 else contextlib.nullcontext([]) as waiting:
                handle.wait(timeout=120)
        saved = {"full_state": full_state(job), "space": checkpoint_space(job), "collectives": calls + waiting}
        strategy = next(iter(adapter_strategies(engine).values()))
        planned = strategy.planned_saves
    train(job, RESUMED_TO)
    return {**saved, "fingerprint": fingerprint(job), "planned": planned}


def object_state(step: int, rank: int, world: int, *, loading: bool = False) -> dict[str, Any]:
    """A sharded state of Megatron's classes: two ShardedTensors split over the ranks, and per rank a ShardedObject
    whose pickled length changes with the step (its bytes come first in the rank's .distcp: the tensors' offsets
    move with it)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * rank + step
    b = torch.full((5,), float(10 * step + rank), dtype=torch.bfloat16)
    obj = {"note": "x" * (1000 * step + rank), "step": step, "rank": rank}  # torch.save pads: > 64 B
    if loading:
        w, b, obj = torch.zeros_like(w), torch.zeros_like(b), None
    return {"iteration": step,
            "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
            "b": ShardedTensor.from_rank_offsets("b", b, (0, rank, world)),
            "obj": ShardedObject("obj", obj, (world,), (rank,), replica_id=0)}


def plain_values(state: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return {k: (v.data if isinstance(v, ShardedBase) else v) for k, v in state.items()}


def loaded_values(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()
            if k in ("iteration", "w", "b", "obj")}


def our_torch_dist_load(engine: CheckpointEngine, rank: int, world: int, step: int | None = None
                        ) -> dict[str, Any]:
    from tiered_ckpt.megatron import torch_dist

    reader, common = torch_dist.open_step(engine, step)
    state = torch_dist.load(reader, common, object_state(0, rank, world, loading=True))
    return {"step": reader.step, "sources": dict(reader.sources), "verified": reader.verified,
            "state": loaded_values(state)}


def rank_cached_saves(rank: int, world: int, cfg: dict, files_cfg: dict, files: str) -> dict[str, Any]:
    """(e): the strategy (no adapter): a planned save of step 1, then on its cached plan steps 2 and 3 (another
    ShardedObject length each) and 4 (rank 1's structure changed: it raises), all with every collective refused;
    loads from shm (the newest step) and from the files (step 3); a planned save (a fresh strategy) of step 3's
    state as step 5."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tiered_ckpt.errors import TieredCkptError
    from tiered_ckpt.handles import SaveError
    from tiered_ckpt.megatron import torch_dist

    out: dict[str, Any] = {}
    layout = ParallelLayout(dp=world)
    with CheckpointEngine(cfg, layout, rank=rank) as engine:
        strategy = torch_dist.TieredSaveShardedStrategy(engine, cache_plan=True)
        torch_dist.save(engine, 1, object_state(1, rank, world), strategy).wait(timeout=120)
        with no_collectives() as calls:
            for step in (2, 3):
                torch_dist.save(engine, step, object_state(step, rank, world), strategy,
                                validate_access_integrity=False).wait(timeout=120)
            state = object_state(4, rank, world)
            if rank == 1:
                state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.ones(2), (0, 0, 1))
            try:
                torch_dist.save(engine, 4, state, strategy, validate_access_integrity=False).wait(timeout=120)
            except (TieredCkptError, SaveError) as exc:
                out["failed_4"] = f"{type(exc).__name__}: {exc}"
        out.update(collectives=calls, planned=strategy.planned_saves, cached=strategy.cached_saves)
        out["from_shm"] = our_torch_dist_load(engine, rank, world)
        fresh = torch_dist.TieredSaveShardedStrategy(engine)  # plans every save
        torch_dist.save(engine, 5, object_state(3, rank, world), fresh).wait(timeout=120)
    with CheckpointEngine(files_cfg, layout, rank=rank) as engine:
        out["from_files"] = our_torch_dist_load(engine, rank, world, 3)  # the cached plan's (5 is newer)
    for step in (2, 3):
        got = dist_checkpointing.load(object_state(0, rank, world, loading=True), f"{files}/iter_{step:07d}")
        out[f"megatron_{step}"] = loaded_values(got)
    out["expected"] = {step: plain_values(object_state(step, rank, world)) for step in (2, 3)}
    return out


# torch.distributed's collectives and point-to-point calls: none may run in a save on a cached plan
COLLECTIVES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "all_to_all",
               "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather",
               "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "scatter", "scatter_object_list", "send")


@contextlib.contextmanager
def no_collectives() -> Iterator[list[str]]:
    """Every collective of torch.distributed (both its module and distributed_c10d) raises, and is recorded in the
    list yielded (a call on another thread, whose error someone might swallow, is still seen)."""
    import torch.distributed.distributed_c10d as c10d

    calls: list[str] = []
    saved = []

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            calls.append(name)
            raise AssertionError(f"torch.distributed.{name} called during a save on a cached plan")
        return call

    for module in (torch.distributed, c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refuse(name))
    try:
        yield calls
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


@contextlib.contextmanager
def refusing_collectives_in(module: Any, name: str) -> Iterator[list[str]]:
    """``module.name`` runs under :func:`no_collectives` while this lasts; yields the collectives it tried."""
    real = getattr(module, name)
    calls: list[str] = []

    def guarded(*args: Any, **kwargs: Any) -> Any:
        with no_collectives() as seen:
            try:
                return real(*args, **kwargs)
            finally:
                calls.extend(seen)

    setattr(module, name, guarded)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def adapter_strategies(engine: CheckpointEngine) -> dict[bool, Any]:
    from tiered_ckpt.megatron import adapter_dist

    return adapter_dist._strategies[engine]


def rank_megatron_load(rank: int, world: int, tp: int, pp: int, ckpt: str, distributed_optimizer: bool = True
                       ) -> dict[str, Any]:
    """Megatron's own dist_checkpointing.load (its default strategy, FileSystemReader) into a fresh job."""
    from megatron.core import dist_checkpointing

    job = job_at(tp, pp, seed=77, distributed_optimizer=distributed_optimizer)
    state = dist_checkpointing.load(megatron_request(job, is_loading=True), ckpt)
    adapter.unwrap(job.model[0]).load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    return {"coords": harness.coords(), "full_state": full_state(job), "space": checkpoint_space(job)}


# Megatron's default torch_dist save strategy writes with its FileSystemWriterAsync: each rank forks one writer
# process per file, and waits in count_queue.join() until every writer has called task_done(). A writer calls
# _process_memory() (psutil's RSS, for a debug log line) *before* its try block, so without psutil it raises
# RuntimeError, puts no result, never calls task_done(), and the rank waits forever (the stacks: the rank in
# JoinableQueue.join, write_preloaded_data_multiproc; its writers dead with "psutil is not installed"). psutil is
# in every Megatron-LM training environment, and in our test extra, but megatron-core 0.16's package metadata does
# not declare it. Neither the harness's fork server nor the spawn-context Manager that collects the results is
# involved: with psutil importable, Megatron's unmodified save completes in a harness rank.
NO_PSUTIL = ("psutil is not installed (the test extra has it): Megatron's FileSystemWriterAsync writer processes "
             "raise before they report, and dist_checkpointing.save would wait for them forever")


def rank_megatron_save(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Megatron's own dist_checkpointing.save with its default save strategy, untouched (TorchDistSaveShardedStrategy,
    FileSystemWriterAsync's forked writers), and Megatron's tracker file."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    job = job_at(*SAVE_LAYOUT)
    train(job, SAVED_AT)
    md = metadata(job)
    state = {"args": job.args, "checkpoint_version": 3.0, "iteration": job.iteration,
             **megatron_request(job, is_loading=False), "opt_param_scheduler": job.scheduler.state_dict(),
             "rng_state": ShardedObject("rng_state", adapter.rng_state(job.args, job.tracker), (1, 1), (0, 0),
                                        replica_id=harness.coords()[2]),
             "num_floating_point_operations_so_far": FLOPS}
    step_dir = Path(ckpt) / f"iter_{job.iteration:07d}"
    if rank == 0:
        step_dir.mkdir(parents=True)
    torch.distributed.barrier()
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    strategy = get_default_save_sharded_strategy()  # what dist_checkpointing.save takes when given none
    dist_checkpointing.save(state, str(step_dir), sharded_strategy=strategy,
                            content_metadata=_clean_metadata_for_serialization(md))
    if rank == 0:
        (Path(ckpt) / "latest_checkpointed_iteration.txt").write_text(str(job.iteration))
    saved = {"full_state": full_state(job), "space": checkpoint_space(job), "strategy": type(strategy).__name__}
    train(job, RESUMED_TO)
    return {**saved, "fingerprint": fingerprint(job)}


def rank_our_load(rank: int, world: int, tp: int, pp: int, cfg: dict, cont: bool) -> dict[str, Any]:
    # the saving job's seed: its data (harness.batch) depends on it; its weights are the load's to restore
    job = job_at(tp, pp)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tiered_ckpt").addHandler(handler)
    try:
        with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
            loaded = load(job, engine)
    finally:
        logging.getLogger("tiered_ckpt").removeHandler(handler)
    out = {"coords": harness.coords(), "loaded": loaded, "full_state": full_state(job),
           "space": checkpoint_space(job), "warnings": warnings}
    if cont:
        train(job, RESUMED_TO)
        out["fingerprint"] = fingerprint(job)
    return out


def rank_plain_ddp_save(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """Megatron's default optimizer (plain DDP, no distributed optimizer) at DP 2: save through the adapter, train
    on to RESUMED_TO (the reference)."""
    job = job_at(*SAVE_LAYOUT, distributed_optimizer=False)
    train(job, SAVED_AT)
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        save(job, engine).wait(timeout=120)
    saved = {"full_state": full_state(job)}
    train(job, RESUMED_TO)
    return {**saved, "fingerprint": fingerprint(job)}


def rank_plain_ddp_resume(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    job = job_at(*SAVE_LAYOUT, distributed_optimizer=False)
    with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
        loaded = load(job, engine)
    train(job, RESUMED_TO)
    return {"loaded": loaded, "fingerprint": fingerprint(job)}


def rank_save_to_memory_and_die(rank: int, world: int, cfg: dict) -> None:
    job = job_at(*SAVE_LAYOUT)
    train(job, SAVED_AT)
    engine = CheckpointEngine(cfg, job.layout, rank=rank)
    save(job, engine, persistent=False).wait(timeout=120)
    harness.kill_self()


# ------------------------------------------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tiered-ckpt-test-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_our_save_loads_in_megatron_at_same_and_other_layout(tmp_path: Path, shm_dir: str) -> None:
    """(a) + (d): saved at tp1 pp1 dp2 through shm and disk (twice, the second save on the cached plan); Megatron's
    dist_checkpointing.load of the disk's step directory gives every rank its state bit for bit, at tp1 dp2,
    tp2 dp1 and pp2 dp1; our own load at the same layout resumes and trains on bit-exact."""
    files = tmp_path / "disk"
    cfg = config(f"td-ours-{uuid.uuid4().hex[:8]}", shm=shm_dir, files=files)
    saved = launch(rank_save_ours, 2, cfg, 2)
    assert [r["planned"] for r in saved] == [1, 1]  # the second save reused the first one's plan
    assert [r["collectives"] for r in saved] == [[], []]  # ... and ran no collective (they would have raised)
    step_dir = files / f"iter_{SAVED_AT:07d}"
    names = {p.name for p in step_dir.iterdir()}
    assert {"metadata.json", "common.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= names, names
    plain = plain_tensors(step_dir)
    for rank, res in enumerate(saved):
        assert mismatches(res["space"], plain) == [], f"saved rank {rank}"

    same = launch(rank_megatron_load, 2, *SAVE_LAYOUT, str(step_dir))
    for rank, res in enumerate(same):
        assert differences(saved[rank]["full_state"], res["full_state"]) == [], f"Megatron's load, rank {rank}"
    for tp, pp in OTHER_LAYOUTS:
        other = launch(rank_megatron_load, 2, tp, pp, str(step_dir))
        for rank, res in enumerate(other):
            assert res["coords"][:2] == ((rank, 0) if tp == 2 else (0, rank))  # (TP rank, PP rank)
            assert mismatches(res["space"], plain) == [], f"Megatron's load at tp{tp} pp{pp}, rank {rank}"

    ours = launch(rank_our_load, 2, *SAVE_LAYOUT, config(cfg["run_id"], files=files), True)
    for rank, res in enumerate(ours):
        assert res["loaded"] == (SAVED_AT, FLOPS)
        assert differences(saved[rank]["full_state"], res["full_state"]) == [], f"our load, rank {rank}"
        assert differences(saved[rank]["fingerprint"], res["fingerprint"]) == [], f"our load, rank {rank}"
    from tiered_ckpt.cli import main as cli_main

    assert cli_main(["verify", str(files)]) == 0


def test_megatron_saved_checkpoint_loads_through_the_adapter(tmp_path: Path) -> None:
    """(b): Megatron's dist_checkpointing.save at tp1 pp1 dp2 (no manifest of ours), with Megatron's default save
    strategy and writer, unmodified; the adapter loads it from a file tier at tp1 dp2 (resumes bit-exact, RNG
    included), at tp2 dp1 and at pp2 dp1 (every tensor bit-exact). Megatron's writer needs psutil (see NO_PSUTIL)."""
    if importlib.util.find_spec("psutil") is None:
        pytest.fail(NO_PSUTIL)
    ckpt = tmp_path / "megatron"
    saved = launch(rank_megatron_save, 2, str(ckpt))
    assert {r["strategy"] for r in saved} == {"TorchDistSaveShardedStrategy"}
    plain = plain_tensors(ckpt / f"iter_{SAVED_AT:07d}")
    cfg = config(f"td-megatron-{uuid.uuid4().hex[:8]}", files=ckpt)
    same = launch(rank_our_load, 2, *SAVE_LAYOUT, cfg, True)
    for rank, res in enumerate(same):
        assert res["loaded"] == (SAVED_AT, FLOPS)
        assert differences(saved[rank]["full_state"], res["full_state"]) == [], f"rank {rank}"
        assert differences(saved[rank]["fingerprint"], res["fingerprint"]) == [], f"rank {rank}"
    for tp, pp in OTHER_LAYOUTS:
        other = launch(rank_our_load, 2, tp, pp, cfg, False)
        for rank, res in enumerate(other):
            assert res["coords"][:2] == ((rank, 0) if tp == 2 else (0, rank))  # (TP rank, PP rank)
            assert res["loaded"] == (SAVED_AT, FLOPS)
            assert mismatches(res["space"], plain) == [], f"tp{tp} pp{pp} rank {rank}"
            # the RNG state is left out at another TP/PP, said once, and not taken for a --no-save-rng checkpoint
            assert [w for w in res["warnings"] if "RNG state" in w or "--no-save-rng" in w] == [
                f"step {SAVED_AT}: (TP, PP) (1, 1) -> ({tp}, {pp}): the RNG state is not loaded (Megatron's "
                "behaviour)"], res["warnings"]


def test_sigkill_after_memory_only_save_resumes_from_shm(shm_dir: str, tmp_path: Path) -> None:
    """(c): a non-persistent save goes to shm only; every rank is SIGKILLed; new ranks load it from shm (no file
    tier holds it) and train on exactly like the run that never stopped."""
    reference = launch(rank_save_ours, 2, config(f"td-ref-{uuid.uuid4().hex[:8]}", files=tmp_path / "ref"), 1)
    cfg = config(f"td-mem-{uuid.uuid4().hex[:8]}", shm=shm_dir, files=tmp_path / "disk")
    codes = launch(rank_save_to_memory_and_die, 2, cfg, expect_kill=True)
    assert codes == [-signal.SIGKILL] * 2
    assert not (tmp_path / "disk" / f"iter_{SAVED_AT:07d}").exists()
    results = launch(rank_our_load, 2, *SAVE_LAYOUT, cfg, True)
    for rank, res in enumerate(results):
        assert res["loaded"] == (SAVED_AT, FLOPS)
        assert differences(reference[rank]["fingerprint"], res["fingerprint"]) == [], f"rank {rank}"


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_saves_on_a_cached_plan_run_no_collective_and_load_exactly(tmp_path: Path, shm_dir: str) -> None:
    """(e): see rank_cached_saves. No collective ran in the cached saves; step 4 (rank 1 failed) is not committed
    and every load takes step 3, each rank exactly its state (the ShardedObject too, whose pickled length changed),
    from shm (the .metadata merged from the snapshots) and from the files; Megatron's own load of the files of
    steps 2 and 3 gives each rank its state; step 3's files equal those of a planned save of the same state."""
    files = tmp_path / "disk"
    run_id = f"td-cached-{uuid.uuid4().hex[:8]}"
    cfg = config(run_id, shm=shm_dir, files=files)
    cfg["drain"] = {**cfg.get("drain", {}), "commit_timeout_s": 5}  # step 4 waits for rank 1's files that long
    out = launch(rank_cached_saves, 2, cfg, config(run_id, files=files), str(files), timeout=400)
    for rank, res in enumerate(out):
        assert res["collectives"] == [], rank
        assert (res["planned"], res["cached"]) == (1, 3), rank
        expected = res["expected"]
        for name, tier in (("from_shm", "shm"), ("from_files", "disk")):
            got = res[name]
            assert got["step"] == 3 and set(got["sources"].values()) == {tier} and got["verified"], (rank, name, got)
            bad = [k for k, v in expected[3].items() if not same(v, got["state"][k])]
            assert not bad, (rank, name, bad)
        for step in (2, 3):
            bad = [k for k, v in expected[step].items() if not same(v, res[f"megatron_{step}"][k])]
            assert not bad, (rank, step, bad)
    assert "structure changed" in out[1]["failed_4"]
    assert "SaveError" in out[0]["failed_4"]  # rank 0's part of step 4 was never committed
    assert not (files / "iter_0000004" / "tiered_ckpt" / "manifest.json").exists()
    assert not (files / "iter_0000004" / ".metadata").exists()
    assert (files / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    lengths = set()
    for rank in range(2):  # the ShardedObject's bytes moved the tensors: the offsets differ between the steps
        name = f"__{rank}_0.distcp"
        assert (files / "iter_0000003" / name).read_bytes() == (files / "iter_0000005" / name).read_bytes()
        lengths.add(tuple((files / f"iter_{s:07d}" / name).stat().st_size for s in (2, 3)))
    assert all(a != b for a, b in lengths)
    cached, planned = (pickle.loads((files / f"iter_{s:07d}" / ".metadata").read_bytes()) for s in (3, 5))
    assert cached.storage_data == planned.storage_data
    assert list(cached.storage_data) == list(planned.storage_data)  # in the same order
    assert cached.state_dict_metadata == planned.state_dict_metadata
    assert (cached.planner_data, cached.version) == (planned.planner_data, planned.version)
    assert cached.storage_meta.checkpoint_id == "iter_0000003"
    from tiered_ckpt.cli import main as cli_main

    assert cli_main(["verify", str(files)]) == 0


def test_plain_ddp_saves_load_in_megatron_and_resume_bit_exact(tmp_path: Path, shm_dir: str) -> None:
    """Megatron's default optimizer (no --use-distributed-optimizer) at DP 2, torch_dist: Megatron's own
    dist_checkpointing.load of our step gives every rank its model and optimizer state bit for bit, and our load
    resumes and trains on bit-exact."""
    files = tmp_path / "disk"
    cfg = config(f"td-ddp-{uuid.uuid4().hex[:8]}", shm=shm_dir, files=files)
    saved = launch(rank_plain_ddp_save, 2, cfg)
    assert any(k.endswith("/exp_avg_sq") for k in saved[1]["full_state"])  # the comparison covers Adam's state
    step_dir = files / f"iter_{SAVED_AT:07d}"
    megatron = launch(rank_megatron_load, 2, *SAVE_LAYOUT, str(step_dir), False)
    for rank, res in enumerate(megatron):
        assert differences(saved[rank]["full_state"], res["full_state"]) == [], f"Megatron's load, rank {rank}"
    ours = launch(rank_plain_ddp_resume, 2, config(cfg["run_id"], files=files))
    for rank, res in enumerate(ours):
        assert res["loaded"] == (SAVED_AT, FLOPS)
        assert differences(saved[rank]["fingerprint"], res["fingerprint"]) == [], f"our load, rank {rank}"
