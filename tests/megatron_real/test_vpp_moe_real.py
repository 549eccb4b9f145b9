"""The Megatron adapter on two more genuine megatron-core configurations, 4 gloo ranks on CPU (harness.py):

* virtual pipeline parallelism: PP 2 x 2 virtual stages (two DDP-wrapped GPTModel chunks per rank, built with
  ``vp_stage``; one DistributedOptimizer over both), DP 2, trained with Megatron's interleaved schedule;
* MoE with expert parallelism: 4 experts (local spec, SequentialMLP), EP 2, expert-DP 2 (dense DP 4), the
  ChainedOptimizer [dense, expert].

Each trains to step 3, saves through the adapter into a local tier in both layouts (and shm), resumes in new
processes and trains to 5 bit for bit like the run that never stopped: from each local tier, from Megatron's own
loading code reading the ``megatron`` layout's files (what Megatron-LM's legacy ``load_checkpoint`` does, on the
genuine objects), and after a SIGKILL from memory alone; loaded at half the DP size, the full optimizer state is
the saved one; a copy of the megatron layout's files without our manifests (as Megatron-LM would have written
them) converts to exactly the rank files of the rank_sharded save.
"""

from __future__ import annotations

import random
import shutil
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch
from harness import build_job, differences, fingerprint, full_state, launch, train
from test_adapter_real import (
    FLOPS,
    RESUMED_TO,
    SAVED_AT,
    config,
    rank_resume,
    rank_save_to_memory_and_die,
    rank_train_save_continue,
)

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.megatron import adapter
from tiered_ckpt.parallel import ParallelLayout


@dataclass(frozen=True)
class Spec:
    id: str
    pp: int
    options: tuple[tuple[str, Any], ...]  # build_job's keyword arguments

    def job(self) -> harness.Job:
        return build_job(1, self.pp, "fp32", seed=20, dropout=0.1, **dict(self.options))

    def model_parallel_coords(self, rank: int, world: int) -> tuple[int, int, int]:
        """(tp, pp, ep) of ``rank`` in a job of ``world`` ranks (Megatron's rank order, as Job.layout)."""
        ep = dict(self.options).get("expert_parallel", 1)
        c = ParallelLayout(tp=1, pp=self.pp, dp=world // self.pp // ep, ep=ep).coords(rank)
        return c.tp, c.pp, c.ep


# overlap_grad_reduce with 6000-element buckets, as Megatron-LM runs them: several buckets where Megatron keeps
# bucketing (VPP: stage 0's first chunk only; MoE: dense and expert buffers), one bucket elsewhere
BUCKETS = (("bucket_size", 6000), ("overlap_grad_reduce", True))
VPP = Spec("tp1-pp2-vpp2-dp2", 2, (("virtual_pipeline", 2), *BUCKETS))
MOE = Spec("tp1-pp1-ep2-dp2-experts4", 1, (("num_experts", 4), ("expert_parallel", 2), *BUCKETS))


# ------------------------------------------------------------------------------------------------------------
# what the ranks run


def megatron_rank_dir() -> str:
    """Megatron-LM's ``get_checkpoint_name`` for this rank: mp_rank_TT[_PPP][_EEE]."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return name


def rank_load_as_megatron(rank: int, world: int, spec: Spec, step_dir: Path) -> dict[str, Any]:
    """Megatron-LM's legacy ``load_checkpoint`` (``--ckpt-format torch --use-distributed-optimizer``) on the
    genuine objects, without the adapter: this rank's ``model_optim_rng.pt`` read with Megatron's allow-list, each
    chunk's ``load_state_dict`` (``model`` / ``model<i>``), ``optimizer.load_state_dict``, the optimizer's own
    ``load_parameter_state`` from ``distrib_optim.pt``, scheduler, args' counters and RNG; then train to 5."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    from tiered_ckpt.megatron.adapter import unwrap

    job = spec.job()
    rank_dir = step_dir / megatron_rank_dir()
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        state = torch.load(rank_dir / "model_optim_rng.pt", weights_only=True)
        if len(job.model) == 1:
            unwrap(job.model[0]).load_state_dict(state["model"], strict=True)
        else:
            for i, chunk in enumerate(job.model):
                unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
        job.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():  # (fp32: Megatron copies into main params that are views of leaf params)
            job.optimizer.load_parameter_state(str(rank_dir / "distrib_optim.pt"))
    job.scheduler.load_state_dict(state["opt_param_scheduler"])
    job.iteration = job.args.iteration = state["iteration"]
    job.args.consumed_train_samples = state["args"].consumed_train_samples
    rng = state["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    job.tracker.set_states(rng["rng_tracker_states"])
    train(job, RESUMED_TO)
    return {"rank_dir": rank_dir.name, "loaded": (state["iteration"], state["num_floating_point_operations_so_far"]),
            "fingerprint": fingerprint(job)}


def rank_load_full_state(rank: int, world: int, spec: Spec, cfgs: list[dict]) -> list[Any]:
    """For each config: a new job (at this world size) loads the checkpoint; its full optimizer state."""
    out = []
    for cfg in cfgs:
        job = spec.job()
        assert adapter.layout_from_args(job.args) == job.layout  # the drop-in's own engine would get this layout
        with CheckpointEngine(cfg, job.layout, rank=rank) as engine:
            loaded = adapter.load_checkpoint(job.model, job.optimizer, job.scheduler, engine=engine, args=job.args,
                                             rng_tracker=job.tracker)
        out.append((loaded, full_state(job)))
    return out


# ------------------------------------------------------------------------------------------------------------
# the scenario


def resume_everywhere(spec: Spec, tmp_path: Path, shm_root: str) -> tuple[list[dict[str, Any]], Path]:
    """Save step 3 into shm + local (rank_sharded) and local (megatron); resume from each local tier, from
    Megatron's own loader, and from memory after a SIGKILL; every rank bit-exact at step 5; at half the DP size
    the full optimizer state is the saved one. Returns the reference ranks and the megatron layout's step
    directory."""
    cfgs = [config(f"real-{spec.id}-{uuid.uuid4().hex[:8]}", shm=shm_root, local=tmp_path / "rank_sharded"),
            config(f"real-{spec.id}-{uuid.uuid4().hex[:8]}", local=tmp_path / "megatron", layout="megatron")]
    ranks = launch(rank_train_save_continue, 4, spec, cfgs)
    assert all(any(k.endswith("/exp_avg_sq") for k in r["fingerprint"]) for r in ranks)

    files = [config(cfg["run_id"], local=Path(cfg["tiers"][-1]["path"]), layout=cfg["layout"]) for cfg in cfgs]
    for rank, per_config in enumerate(launch(rank_resume, 4, spec, files)):
        for cfg, (loaded, got) in zip(files, per_config, strict=True):
            assert loaded == (SAVED_AT, FLOPS)
            assert differences(ranks[rank]["fingerprint"], got) == [], f"rank {rank}, layout {cfg['layout']}"

    # at half the DP size (VPP: DP 1; MoE: dense DP 2, expert-DP 1), both layouts: every param's full optimizer
    # state is the saved one (re-split from the rank files and from Megatron's gathered files)
    reference = {spec.model_parallel_coords(r, 4): ranks[r]["full_state"] for r in range(4)}
    for rank, per_config in enumerate(launch(rank_load_full_state, 2, spec, files)):
        for cfg, (loaded, got) in zip(files, per_config, strict=True):
            assert loaded == (SAVED_AT, FLOPS)
            want = reference[spec.model_parallel_coords(rank, 2)]
            assert differences(want, got) == [], f"DP / 2, rank {rank}, layout {cfg['layout']}"

    step_dir = tmp_path / "megatron" / f"iter_{SAVED_AT:07d}"
    for rank, res in enumerate(launch(rank_load_as_megatron, 4, spec, step_dir)):
        assert res["loaded"] == (SAVED_AT, FLOPS) and (step_dir / res["rank_dir"]).is_dir(), rank
        assert differences(ranks[rank]["fingerprint"], res["fingerprint"]) == [], f"rank {rank}, Megatron's load"

    check_megatron_copy_converts(tmp_path)

    memory = config(f"real-{spec.id}-mem-{uuid.uuid4().hex[:8]}", shm=shm_root)
    assert launch(rank_save_to_memory_and_die, 4, spec, memory, expect_kill=True) == [-signal.SIGKILL] * 4
    for rank, [(loaded, got)] in enumerate(launch(rank_resume, 4, spec, [memory])):
        assert loaded == (SAVED_AT, FLOPS)
        assert differences(ranks[rank]["fingerprint"], got) == [], f"rank {rank} from memory"
    return ranks, step_dir


def check_megatron_copy_converts(tmp_path: Path) -> None:
    """The megatron layout's files alone, as Megatron-LM writes them (tracker, mp_rank_*, no manifest): the bucket
    geometry recomputed from model_optim_rng.pt (model0/model1, expert params, the buckets Megatron keeps) re-splits
    them into exactly the rank files the rank_sharded save wrote."""
    from tiered_ckpt.megatron.convert import convert

    step = f"iter_{SAVED_AT:07d}"
    bare = tmp_path / "as-megatron-wrote-it"
    (bare / step).mkdir(parents=True)
    for d in (tmp_path / "megatron" / step).glob("mp_rank_*"):
        shutil.copytree(d, bare / step / d.name)
    shutil.copy(tmp_path / "megatron" / "latest_checkpointed_iteration.txt", bare)
    report = convert(bare, tmp_path / "converted", to="rank_sharded", progress=False)
    assert not report.source_verified
    ours = sorted((tmp_path / "rank_sharded" / step).glob("rank_*"))
    assert len(ours) == 4
    for d in ours:
        want = torch.load(d / "distrib_optim.pt", weights_only=True)
        got = torch.load(tmp_path / "converted" / step / d.name / "distrib_optim.pt", weights_only=True)
        for i, (w, g) in enumerate(zip(want["optimizers"], got["optimizers"], strict=True)):
            assert differences(w["shards"], g["shards"]) == [], (d.name, i)
            assert [b["numel_unpadded"] for b in w["buffers"]] == [b["numel_unpadded"] for b in g["buffers"]]


def megatron_files(step_dir: Path) -> dict[str, dict[str, Any]]:
    """mp_rank_* directory -> its model_optim_rng.pt (Megatron's allow-list) and distrib_optim.pt (torch.load)."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    out = {}
    for d in sorted(step_dir.glob("mp_rank_*")):
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            out[d.name] = {"model_optim_rng": torch.load(d / "model_optim_rng.pt", weights_only=True),
                           "distrib_optim": torch.load(d / "distrib_optim.pt", weights_only=True)}
    return out


# ------------------------------------------------------------------------------------------------------------
# tests


def test_virtual_pipeline_resumes_bit_exact_from_every_tier(tmp_path: Path, shm_root: str) -> None:
    """PP 2 with 2 virtual stages (interleaved schedule), DP 2: every rank's two model chunks, the optimizer over
    both and the RNG resume bit-exact from both layouts' local tiers, through Megatron's own loader, and from
    memory; Megatron's files hold ``model0``/``model1`` per stage."""
    ranks, step_dir = resume_everywhere(VPP, tmp_path, shm_root)
    assert all(any(k.startswith("param/model1.") for k in r["fingerprint"]) for r in ranks)  # both chunks compared
    files = megatron_files(step_dir)
    assert sorted(files) == ["mp_rank_00_000", "mp_rank_00_001"]
    for name, f in files.items():
        state = f["model_optim_rng"]
        assert "model" not in state and state["model0"] and state["model1"], (name, sorted(state))
        assert state["iteration"] == SAVED_AT and state["args"].virtual_pipeline_model_parallel_size == 2
        # one DistributedOptimizer over both chunks: Megatron's single-optimizer file, one buffer per chunk
        assert isinstance(f["distrib_optim"], dict) and f["distrib_optim"]["buckets_coalesced"], name
        assert sorted(k for k in f["distrib_optim"] if isinstance(k, int)) == [0, 1], name
    # Megatron's chunk placement: the embedding in stage 0's chunk 0, the output layer in stage 1's chunk 1, one
    # transformer layer in each chunk
    def outside_layers(stage: int, chunk: int) -> list[str]:
        return sorted(k for k in files[f"mp_rank_00_{stage:03d}"]["model_optim_rng"][f"model{chunk}"]
                      if not k.startswith("decoder.layers.0."))

    assert outside_layers(0, 0) == ["embedding.position_embeddings.weight", "embedding.word_embeddings.weight"]
    assert outside_layers(0, 1) == outside_layers(1, 0) == []
    assert "output_layer.weight" in outside_layers(1, 1) and "embedding.word_embeddings.weight" not in \
        outside_layers(1, 1)


def test_moe_expert_parallel_resumes_bit_exact_from_every_tier(tmp_path: Path, shm_root: str) -> None:
    """4 experts over EP 2, expert-DP 2 (dense DP 4): the ChainedOptimizer [dense, expert] resumes bit-exact from
    both layouts' local tiers, through Megatron's own loader, and from memory; Megatron's files are one
    ``mp_rank_00_EEE`` per expert rank, each ``distrib_optim.pt`` the list Megatron's ChainedOptimizer writes
    (the dense state only in expert rank 0's, whose DP rank 0 holds it)."""
    ranks, step_dir = resume_everywhere(MOE, tmp_path, shm_root)
    assert all(any(k.startswith("optim1/") for k in r["fingerprint"]) for r in ranks)  # the expert optimizer too
    files = megatron_files(step_dir)
    assert sorted(files) == ["mp_rank_00_000", "mp_rank_00_001"]
    for ep, (name, f) in enumerate(files.items()):
        state = f["model_optim_rng"]
        assert state["iteration"] == SAVED_AT and state["args"].expert_model_parallel_size == 2
        experts = sorted({k.split(".local_experts.")[1].split(".")[0] for k in state["model"]
                          if ".local_experts." in k})
        assert experts == ["0", "1"], (name, experts)  # each expert rank's 2 local experts
        distrib = f["distrib_optim"]
        assert isinstance(distrib, list) and len(distrib) == 2, (name, type(distrib))
        assert (distrib[0] is not None) == (ep == 0), name  # dense: written by dense DP rank 0 (global rank 0)
        assert distrib[1] is not None and distrib[1]["buckets_coalesced"], name
