"""Stand-ins for Megatron-LM's training objects, shaped as docs/megatron-format.md describes them ("model_optim_rng.pt",
"The optimizer entry", "Buckets and their sizes", "Local shards: what each DP rank holds"), built from a
SyntheticJob: what the adapter sees of a real Megatron run, without Megatron.

* :class:`FakeDistributedOptimizer`: ``buffers[g].buckets[b]`` (``grad_data`` of N_b elements, ``numel_unpadded``),
  ``gbuf_ranges[g][(param_dtype, grad_dtype)][b]["param_map"]`` (model param -> Megatron's four ranges),
  ``model_param_group_index_map``, an inner torch-like ``optimizer`` whose ``param_groups[i]["params"]`` are the
  fp32 main-param fragments this DP rank owns and whose ``state`` holds their Adam moments,
  ``_get/_set_main_param_and_optimizer_states``, ``state_dict()`` without tensors, ``data_parallel_group``;
* :class:`FakeChainedOptimizer`: ``chained_optimizers``; ``state_dict()`` is the single dict or the list;
* :class:`FakeModelChunk` (wrapped in :class:`DistributedDataParallel`, as Megatron's model list is) with
  ``state_dict_for_save_checkpoint()`` / ``load_state_dict()``;
* :class:`FakeScheduler` and :class:`FakeRNGTracker`.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import torch
from megatron_synthetic import STATE_KEYS, SyntheticJob

from tiered_ckpt.megatron import rank_shard


class Range:
    """Megatron's ``Range``: ``start``, ``end``, ``size``."""

    def __init__(self, start: int, end: int):
        self.start, self.end, self.size = start, end, end - start


class FakeGroup:
    """A process group as far as the adapter looks: its ranks (by group rank), ``rank()`` and ``size()``."""

    def __init__(self, ranks: list[int], me: int):
        self.ranks, self._me = ranks, me

    def rank(self) -> int:
        return self.ranks.index(self._me)

    def size(self) -> int:
        return len(self.ranks)


class FakeDistributedOptimizer:
    def __init__(self, job: SyntheticJob, rank: int, kind: str, params: dict[str, torch.nn.Parameter]):
        shard = job.shard_of(rank)
        self.kind = kind
        geo = job.geometry(shard, kind)
        group = rank_shard.dp_group(job.topology, rank, kind)
        dp_rank = group.index(rank)
        self.data_parallel_group = FakeGroup(group, rank)
        self.ddp_config = SimpleNamespace(pad_buckets_for_high_nccl_busbw=False)
        self.buffers = [
            SimpleNamespace(param_dtype=b.param_dtype, grad_dtype=b.grad_dtype, numel=b.numel,
                            numel_unpadded=b.numel_unpadded,
                            buckets=[SimpleNamespace(grad_data=torch.zeros(1).expand(k.numel),
                                                     numel_unpadded=k.numel_unpadded) for k in b.buckets])
            for b in geo.buffers
        ]
        by_name = {p.spec.name: p for p in job.params(shard)}
        groups = job.param_groups(kind)
        param_groups = [{**g, "params": []} for g in groups]
        self.optimizer = SimpleNamespace(param_groups=param_groups, state={})
        self.model_param_group_index_map: dict[Any, tuple[int, int]] = {}
        self.gbuf_ranges = []
        for buf in geo.buffers:
            per_bucket = []
            for ranges in buf.local_param_ranges(dp_rank):
                param_map = {}
                for r in ranges:
                    model_param = params[r.name]
                    param_map[model_param] = {"gbuf_world": Range(*r.gbuf_world),
                                              "gbuf_world_in_bucket": Range(*r.gbuf_world_in_bucket),
                                              "gbuf_local": Range(*r.gbuf_local), "param": Range(*r.param)}
                    full = job.main_state(shard, by_name[r.name])
                    main = full["param"][r.param[0]:r.param[1]].clone()
                    gi = 0 if model_param.dim() > 1 else 1  # weight decay on matrices only, as Megatron's default
                    self.model_param_group_index_map[model_param] = (gi, len(param_groups[gi]["params"]))
                    param_groups[gi]["params"].append(main)
                    self.optimizer.state[main] = {k: full[k][r.param[0]:r.param[1]].clone() for k in STATE_KEYS[1:]}
                    self.optimizer.state[main]["step"] = torch.tensor(float(job.iteration))
                per_bucket.append({"param_map": param_map})
            self.gbuf_ranges.append({buf.dtype_key: per_bucket})

    def _main(self, model_param: Any) -> torch.Tensor:
        gi, go = self.model_param_group_index_map[model_param]
        return self.optimizer.param_groups[gi]["params"][go]

    def _get_main_param_and_optimizer_states(self, model_param: Any) -> dict[str, torch.Tensor]:
        main = self._main(model_param)
        return {"param": main, **self.optimizer.state[main]}

    def _set_main_param_and_optimizer_states(self, model_param: Any, tensors: dict[str, torch.Tensor]) -> None:
        main = self._main(model_param)
        for key, value in tensors.items():
            (main if key == "param" else self.optimizer.state[main][key]).copy_(value)

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"optimizer": {"param_groups": copy.deepcopy(groups)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for live, saved in zip(self.optimizer.param_groups, state["optimizer"]["param_groups"], strict=True):
            live.update({k: v for k, v in saved.items() if k != "params"})

    # ----- for tests -------------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """Every main-param fragment and moment, in a fixed order."""
        out = []
        for g in self.optimizer.param_groups:
            for main in g["params"]:
                out.append(main)
                out.extend(self.optimizer.state[main][k] for k in STATE_KEYS[1:])
        return out


class FakeChainedOptimizer:
    def __init__(self, optimizers: list[FakeDistributedOptimizer]):
        self.chained_optimizers = optimizers

    def state_dict(self) -> Any:
        states = [o.state_dict() for o in self.chained_optimizers]
        return states[0] if len(states) == 1 else states

    def load_state_dict(self, state: Any) -> None:
        states = state if isinstance(state, list) else [state]
        for o, s in zip(self.chained_optimizers, states, strict=True):
            o.load_state_dict(s)

    def reload_model_params(self) -> None:
        """Megatron's: copy the model's weights into the fp32 main params (counted here; the fakes keep no
        link between the two)."""
        self.reloads = getattr(self, "reloads", 0) + 1


class FakeModelChunk(torch.nn.Module):
    """A model chunk holding the shard's params (bf16) under Megatron's names, plus ``_extra_state`` entries."""

    def __init__(self, state: OrderedDict[str, Any]):
        super().__init__()
        self.names = list(state)
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                self.params[name] = torch.nn.Parameter(value.clone())
        for i, p in enumerate(self.params.values()):
            self.register_parameter(f"p{i}", p)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> OrderedDict[str, Any]:
        out: OrderedDict[str, Any] = OrderedDict()
        for name in self.names:
            out[name] = self.params[name].detach().clone() if name in self.params else None
        return out

    def load_state_dict(self, state: Any, strict: bool = True) -> Any:  # type: ignore[override]
        missing = [n for n in self.params if n not in state]
        if strict and missing:
            raise RuntimeError(f"missing keys {missing[:3]}")
        with torch.no_grad():
            for name, p in self.params.items():
                if name in state:
                    p.copy_(state[name])
        return SimpleNamespace(missing_keys=missing, unexpected_keys=[])


class DistributedDataParallel(torch.nn.Module):
    """Megatron's DDP wrapper, as far as ``unwrap_model`` goes: the chunk is ``.module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


class FakeScheduler:
    def __init__(self, state: dict[str, Any]):
        self.state = dict(state)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


class FakeRNGTracker:
    """Megatron's CudaRNGStatesTracker: named generator states (ByteTensors)."""

    def __init__(self, states: dict[str, torch.Tensor]):
        self.states = {k: v.clone() for k, v in states.items()}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def fake_rank(job: SyntheticJob, rank: int) -> SimpleNamespace:
    """Everything Megatron's training loop holds on ``rank``: model list, optimizer, scheduler, RNG tracker, args."""
    shard = job.shard_of(rank)
    chunk = FakeModelChunk(job.model_state(shard))
    opts = [FakeDistributedOptimizer(job, rank, kind, chunk.params) for kind in job.kinds()]
    return SimpleNamespace(
        model=[DistributedDataParallel(chunk)],
        chunk=chunk,
        optimizer=FakeChainedOptimizer(opts),
        scheduler=FakeScheduler(job.scheduler_state()),
        rng_tracker=FakeRNGTracker(job.rng_state(shard)[0]["rng_tracker_states"]),
        args=job.args(),
    )


def scramble(r: SimpleNamespace) -> None:
    """Overwrite every bit of training state a load must restore."""
    with torch.no_grad():
        for p in r.chunk.params.values():
            p.fill_(7.0)
        for opt in r.optimizer.chained_optimizers:
            for t in opt.tensors():
                t.fill_(-1.0)
            for g in opt.optimizer.param_groups:
                g["lr"], g["step"] = 0.0, 0
    r.scheduler.state = {}
    r.rng_tracker.states = {}


def fingerprint(r: SimpleNamespace) -> dict[str, Any]:
    """Everything a load restores, as raw bits, for bit-exact comparisons."""
    def raw(t: torch.Tensor) -> bytes:
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    return {
        "model": {n: raw(p) for n, p in r.chunk.params.items()},
        "optim": [[raw(t) for t in o.tensors()] for o in r.optimizer.chained_optimizers],
        "groups": [o.state_dict() for o in r.optimizer.chained_optimizers],
        "scheduler": r.scheduler.state_dict(),
        "tracker": {k: raw(v) for k, v in r.rng_tracker.states.items()},
    }
