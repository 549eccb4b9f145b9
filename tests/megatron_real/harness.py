"""Genuine megatron-core (GPTModel, DDP, DistributedOptimizer, OptimizerParamScheduler) on CPU with gloo, or on
CUDA with NCCL (``launch(..., device="cuda")``, one rank per GPU).

* :func:`launch` runs ``fn(rank, world, *args)`` in ``world`` fresh processes joined by ``torch.distributed``.
* :func:`build_job` builds, inside a rank, what Megatron's ``setup_model_and_optimizer`` builds: the DDP-wrapped
  model chunks, the (Chained)DistributedOptimizer, the scheduler, the RNG tracker and an ``args`` Namespace.
* :func:`train` runs Megatron's forward/backward schedule and the optimizer and scheduler steps;
  :func:`fingerprint` / :func:`full_state` are what a resume must reproduce bit for bit.

megatron-core is CUDA-only in places; :func:`patch_megatron_for_cpu` maps those calls to the CPU (each patch is
documented where it is made). It is applied in CPU rank processes only, never in the process that runs pytest.
:func:`patch_megatron_bugs` (five megatron-core bugs on the torch-optimizer path) is applied on both devices.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import logging
import multiprocessing as mp
import os
import pickle
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rank_procs import PRELOAD  # one fork server per process: the multi-rank tests' list includes megatron's

# ------------------------------------------------------------------------------------------------------------
# CPU patches

_PATCHED = False
_BUGS_PATCHED = False
DEVICE = "cpu"  # what this rank process trains on: set by _rank_main from launch(device=...)
_TENSOR_TYPES = {torch.float32: "FloatTensor", torch.float16: "HalfTensor", torch.bfloat16: "BFloat16Tensor",
                 torch.float64: "DoubleTensor", torch.int64: "LongTensor", torch.int32: "IntTensor",
                 torch.uint8: "ByteTensor", torch.bool: "BoolTensor"}


def _cpu_device(device: Any) -> Any:
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return make


def patch_megatron_for_cpu() -> None:
    """Make megatron-core 0.16 run on CPU, and fix five of its bugs on the torch-optimizer path and MoE router (no
    TransformerEngine/Apex). Everything goes through the patched functions alike: our adapter and Megatron's own
    checkpoint code call the same DistributedOptimizer methods."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import megatron.core.tensor_parallel.random as mrandom

    cuda = torch.cuda
    # Devices: "the current CUDA device" is the CPU; tensors made for device="cuda" are made on the CPU.
    cuda.current_device = lambda: torch.device("cpu")
    for name in ("tensor", "zeros"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    # tensor.cuda() moves nothing.
    torch.Tensor.cuda = lambda self, *a, **k: self
    # Megatron checks param.type() against "torch.cuda.FloatTensor" etc.: CPU tensors report the CUDA type name.
    type_ = torch.Tensor.type

    def cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or self.dtype not in _TENSOR_TYPES:
            return type_(self, *args, **kwargs)
        return f"torch.cuda.{_TENSOR_TYPES[self.dtype]}"

    torch.Tensor.type = cuda_type_name
    # Synchronisation and the caching allocator: nothing to do (CPU ops run in order).
    cuda.synchronize = cuda.empty_cache = lambda *a, **k: None
    # CUDA RNG: the device is the CPU, so its default generator is CPU's. The tracker's fork() then swaps the
    # generator the CPU dropout really draws from, as it swaps CUDA's on a GPU.
    gen = torch.default_generator
    cuda.manual_seed = lambda seed: gen.manual_seed(int(seed))
    cuda.get_rng_state = lambda device="cuda": gen.get_state()
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: gen.get_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: gen.set_state(new_state)
    # ... which makes fork() warn on every dropout that the CPU generator moved: expected here, silenced.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    patch_megatron_bugs()


def patch_megatron_bugs() -> None:
    """Five megatron-core 0.16 bugs on the torch-optimizer path and the MoE router (no TransformerEngine/Apex), on
    any device."""
    global _BUGS_PATCHED
    if _BUGS_PATCHED:
        return
    _BUGS_PATCHED = True
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # Megatron bug 1 (fp32): _set_main_param_and_optimizer_states copy_()s into main params that are leaves
    # requiring grad, outside no_grad ("a leaf Variable that requires grad is being used in an in-place op").
    # Megatron bug 2 (bf16 and fp32): it also copies torch AdamW's per-param "step", which its callers do not
    # pass (KeyError: 'step'; the step comes with the param groups, through load_state_dict).
    # Fixed: copy under no_grad, and keep the param's own "step" when the caller passes none.
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" not in tensors and "step" in state:
            tensors = {**tensors, "step": state["step"]}
        with torch.no_grad():
            set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states

    # Megatron bug 3: DistributedOptimizer.load_state_dict gives every param's state the same "step" tensor,
    # which torch AdamW then increments once per param per step. Fixed: each param gets its own copy.
    load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict_own_steps(self: Any, state_dict: Any) -> None:
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict_own_steps

    # Megatron bug 4 (torch_dist loads): on the torch-optimizer path, DistributedOptimizer.state_dict() asserts
    # that the params' states hold one "step", so before the first step (no state yet) it fails, and a job cannot
    # build its torch_dist load request (optimizer.sharded_state_dict calls state_dict()). Fixed: an optimizer
    # without any state gets the state torch's Adam would create on its first step (zero moments, step 0), which
    # the load then overwrites. Only that case changes (it used to raise).
    state_dict = DistributedOptimizer.state_dict

    def state_dict_before_first_step(self: Any) -> Any:
        inner = self.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        if params and all(len(inner.state[p]) == 0 for p in params):
            for p in params:
                inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                      exp_avg_sq=torch.zeros_like(p.data))
        return state_dict(self)

    DistributedOptimizer.state_dict = state_dict_before_first_step

    # Megatron bug 5 (MoE without TransformerEngine): RouterGatingLinearFunction tests ``te_general_gemm is not
    # None``, a name moe_utils imports only from TransformerEngine (NameError in every MoE router's forward).
    # Fixed: the name exists and is None, so the router takes its torch.mm/addmm path, as written for that case.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ------------------------------------------------------------------------------------------------------------
# processes


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Connection,
               stacks: str, stacks_after: float, device: str = "cpu") -> None:
    # A rank still running after ``stacks_after`` seconds writes every thread's stack to ``stacks`` (and goes
    # on): launch() puts it in its timeout report, so a hang says where it waits.
    stacks_file = open(stacks, "w")  # open for the life of the process: faulthandler writes to it
    faulthandler.dump_traceback_later(stacks_after, file=stacks_file)
    global DEVICE
    DEVICE = device
    try:
        if device == "cuda":
            patch_megatron_bugs()
            # Bit-exact resumes need the same sums in the same order (embedding backward's atomics, cuBLAS's
            # split reductions): deterministic kernels, warning where an op has none (a resume then differs).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl"
        else:
            patch_megatron_for_cpu()
            # Bit-exact resumes need the same sums in the same order: CPU kernels split their reductions by the
            # intra-op thread count, which a rank forked from the fork server does not always get the same
            # (training then went another way in one rank of a CI run now and then); one thread per rank, always.
            torch.set_num_threads(1)
            backend = "gloo"
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = _on_host(fn(rank, world, *args))
        # Plain pickle: multiprocessing's would pass tensors as shared memory that dies with this process.
        out.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        out.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        faulthandler.cancel_dump_traceback_later()
        out.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _on_host(obj: Any) -> Any:
    """``obj`` with every CUDA tensor in its dicts, lists and tuples copied to the CPU (the parent compares them)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_on_host(v) for v in obj)
    return obj


class LaunchError(RuntimeError):
    pass




def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0,
           expect_kill: bool = False, device: str = "cpu") -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` new processes (gloo on 127.0.0.1, a port free at run time; with
    ``device="cuda"``, NCCL and rank ``r`` on GPU ``r``); returns their results by rank, tensors on the CPU.
    Raises :class:`LaunchError` with every failed rank's traceback if one fails or the run exceeds ``timeout``
    seconds. ``expect_kill``: the ranks end themselves with SIGKILL; returns their exit codes instead (and fails
    if one returned normally)."""
    # A fork server that has imported torch and megatron once: each rank starts from it in well under a second
    # (a spawned process spends ~5 s of CPU importing them) and still inherits no state from this process.
    # On CUDA, spawned: the preloaded modules touch CUDA at import, and a forked child could not use it then.
    ctx = mp.get_context("spawn" if device == "cuda" else "forkserver")
    if device != "cuda":
        ctx.set_forkserver_preload(PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    stacks_dir = tempfile.TemporaryDirectory(prefix="megatron-real-stacks-")
    stacks = [os.path.join(stacks_dir.name, f"rank{rank}") for rank in range(world)]
    procs, pipes = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, rank, world, store.port, args, send, stacks[rank],
                                                 max(1.0, timeout - 5), device), name=f"rank{rank}")
        p.start()
        send.close()
        procs.append(p)
        pipes.append(recv)
    results: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", result) / ("error", traceback) / ("died", code)
    deadline = time.monotonic() + timeout
    try:
        pending = dict(enumerate(pipes))
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic())):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    results[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:  # died without a word (SIGKILL, segfault)
                    procs[rank].join(5)
                    results[rank] = ("died", procs[rank].exitcode)
                del pending[rank]
            if any(kind == "error" for kind, _ in results.values()):
                deadline = min(deadline, time.monotonic() + 5)  # the others are likely stuck in a collective
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()) + 1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for conn in pipes:
            conn.close()
        hung = {r: Path(f).read_text() for r, f in enumerate(stacks) if r not in results and os.path.exists(f)}
        stacks_dir.cleanup()
    codes = [p.exitcode for p in procs]
    if expect_kill:
        survivors = [r for r in range(world) if results.get(r, ("died",))[0] != "died"]
        if survivors:
            raise LaunchError(_report(results, codes, f"ranks {survivors} did not die"))
        return codes
    if any(kind != "ok" for kind, _ in results.values()):
        raise LaunchError(_report(results, codes, "a rank failed"))
    if len(results) < world:
        raise LaunchError(_report(results, codes, f"timed out after {timeout:.0f} s", hung))
    return [results[r][1] for r in range(world)]


def _report(results: dict[int, tuple[str, Any]], codes: list[int | None], what: str,
            stacks: dict[int, str] | None = None) -> str:
    failed = [r for r, (kind, _) in results.items() if kind != "ok"]  # in the order they failed
    lines = [f"launch of {len(codes)} ranks: {what}" + (f" (rank {failed[0]} first)" if failed else "")]
    for rank, code in enumerate(codes):
        kind, value = results.get(rank, ("no answer", None))
        lines.append(f"--- rank {rank}: {kind}, exit code {code}")
        if kind == "error":
            lines.append(value)
        if (stacks or {}).get(rank):
            lines.append(f"its threads, 5 s before the timeout:\n{stacks[rank]}")
    return "\n".join(lines)


def kill_self() -> None:
    """End this rank as a crash would: SIGKILL, no clean-up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------------------------------------
# the job


@dataclass
class Job:
    tp: int
    pp: int
    dp: int
    precision: str
    seed: int
    model: list[Any]
    optimizer: Any
    scheduler: Any
    tracker: Any
    args: argparse.Namespace
    config: Any
    num_microbatches: int
    iteration: int = 0
    losses: list[float] = field(default_factory=list)
    ep: int = 1  # expert_model_parallel_size; ``dp`` is Megatron's (dense) data_parallel_size, expert ranks included

    @property
    def layout(self) -> Any:
        from tiered_ckpt.parallel import ParallelLayout

        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp // self.ep, ep=self.ep)


def megatron_args(**overrides: Any) -> argparse.Namespace:
    """An ``args`` Namespace shaped like Megatron-LM's (the attributes its checkpoint code and the adapter read,
    with Megatron's own types: real enums, torch dtypes, a signal)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    args = dict(
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        cuda_graph_impl="none", cuda_graph_scope=[CudaGraphScope.attn], exit_signal=signal.SIGTERM,
        num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=16,
        num_query_groups=None, group_query_attention=False, seq_length=16, max_position_embeddings=16,
        padded_vocab_size=128, vocab_size=None, make_vocab_size_divisible_by=128, vocab_file=None,
        tokenizer_type="NullTokenizer", add_position_embedding=True, position_embedding_type="learned_absolute",
        normalization="LayerNorm", layernorm_epsilon=1e-5, untie_embeddings_and_output_weights=False,
        add_bias_linear=True, swiglu=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        transformer_impl="local", use_cpu_initialization=True, perform_initialization=True,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=1, data_parallel_size=1,
        world_size=1, rank=0, distributed_backend="gloo", sequence_parallel=False, num_experts=None,
        micro_batch_size=2, global_batch_size=4, rampup_batch_size=None, train_iters=20, train_samples=None,
        optimizer="adam", lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_decay_iters=20,
        lr_warmup_iters=2, lr_warmup_init=0.0, lr_warmup_fraction=None, lr_warmup_samples=0,
        lr_decay_samples=None, lr_wsd_decay_iters=None, lr_wsd_decay_style="exponential",
        weight_decay=0.01, start_weight_decay=0.01, end_weight_decay=0.01, weight_decay_incr_style="constant",
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, decoupled_lr=None, decoupled_min_lr=None,
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
        fp16=False, bf16=False, params_dtype=torch.float32, main_grads_dtype=torch.float32,
        main_params_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        accumulate_allreduce_grads_in_fp32=False, loss_scale=None, initial_loss_scale=2**32,
        use_distributed_optimizer=True, use_precision_aware_optimizer=False, overlap_grad_reduce=False,
        overlap_param_gather=False, align_grad_reduce=True, align_param_gather=False, ddp_bucket_size=None,
        ddp_num_buckets=None, ddp_pad_buckets_for_high_nccl_busbw=False, ddp_average_in_collective=False,
        check_for_nan_in_loss_and_grad=True, data_parallel_random_init=False, use_megatron_fsdp=False,
        use_torch_fsdp2=False, seed=1234,
        save=None, load=None, ckpt_format="torch", use_dist_ckpt=False, auto_detect_ckpt_format=False,
        async_save=False, ckpt_fully_parallel_save=True, ckpt_fully_parallel_load=False, ckpt_step=None,
        ckpt_assume_constant_structure=False, dist_ckpt_strictness="assume_ok_unexpected",
        non_persistent_ckpt_type=None, exit_on_missing_checkpoint=False, retro_add_retriever=False,
        no_save_optim=False, no_load_optim=False, no_save_rng=False, no_load_rng=False, finetune=False,
        use_checkpoint_args=False, use_mp_args_from_checkpoint_args=False, iteration=0,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
        num_floating_point_operations_so_far=0,
    )
    unknown = set(overrides) - set(args)
    if unknown:
        raise TypeError(f"not Megatron args here: {sorted(unknown)}")
    args.update(overrides)
    return argparse.Namespace(**args)


def build_job(tp: int, pp: int, precision: str = "fp32", seed: int = 1234, *, num_layers: int = 4,
              hidden: int = 64, ffn_hidden: int = 256, heads: int = 4, vocab: int = 128, seq: int = 16,
              micro_batch: int = 2, global_batch: int = 8, bucket_size: int | None = None,
              overlap_grad_reduce: bool = False, dropout: float = 0.0, distributed_optimizer: bool = True,
              virtual_pipeline: int | None = None, num_experts: int | None = None, expert_parallel: int = 1) -> Job:
    """Inside a rank: Megatron's initialisation (model parallel groups, seeds), model, optimizer, scheduler and
    args for a GPT with the local layer spec, as ``megatron.training`` builds them.

    ``virtual_pipeline``: Megatron's ``--virtual-pipeline-model-parallel-size`` (PP > 1): each rank holds that many
    model chunks, built with ``vp_stage`` and wrapped one DDP each as Megatron-LM's ``get_model`` does (bucketing
    off from the second chunk on), and :func:`train` runs the interleaved schedule. ``num_experts`` /
    ``expert_parallel``: MoE layers (the local spec's SequentialMLP experts, allgather dispatcher) over
    ``expert_parallel`` expert-parallel ranks; the optimizer is then Megatron's ChainedOptimizer [dense, expert]."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    assert precision in ("fp32", "bf16"), precision
    world = dist.get_world_size()
    dp = world // (tp * pp)
    assert virtual_pipeline is None or pp > 1, "virtual pipeline stages need PP > 1"
    assert dp % expert_parallel == 0 and (num_experts or 0) % expert_parallel == 0, (dp, expert_parallel, num_experts)
    num_microbatches, rest = divmod(global_batch, micro_batch * dp)  # Megatron keeps the global batch at any DP
    assert num_microbatches and not rest, f"global batch {global_batch} for micro batch {micro_batch} x DP {dp}"
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=virtual_pipeline,
                                             expert_model_parallel_size=expert_parallel)
    bf16 = precision == "bf16"
    params_dtype = torch.bfloat16 if bf16 else torch.float32
    args = megatron_args(
        num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=ffn_hidden, num_attention_heads=heads,
        kv_channels=hidden // heads, seq_length=seq, max_position_embeddings=seq, padded_vocab_size=vocab,
        make_vocab_size_divisible_by=vocab, hidden_dropout=dropout, attention_dropout=dropout,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp, world_size=world,
        rank=dist.get_rank(), micro_batch_size=micro_batch, global_batch_size=global_batch,
        distributed_backend=dist.get_backend(),
        bf16=bf16, params_dtype=params_dtype, accumulate_allreduce_grads_in_fp32=bf16, seed=seed,
        overlap_grad_reduce=overlap_grad_reduce, ddp_bucket_size=bucket_size,
        use_distributed_optimizer=distributed_optimizer, virtual_pipeline_model_parallel_size=virtual_pipeline,
        num_experts=num_experts, expert_model_parallel_size=expert_parallel)

    # Megatron's _set_random_seed: one seed per pipeline stage, the tracker's per TP rank.
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=ffn_hidden, num_attention_heads=heads,
        kv_channels=hidden // heads, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype, params_dtype=params_dtype, bf16=bf16, use_cpu_initialization=True,
        perform_initialization=True, init_method_std=0.02, hidden_dropout=dropout, attention_dropout=dropout,
        add_bias_linear=True, normalization="LayerNorm", layernorm_epsilon=1e-5, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, deallocate_pipeline_outputs=True,
        sequence_parallel=False, virtual_pipeline_model_parallel_size=virtual_pipeline,
        **(dict(num_moe_experts=num_experts, expert_model_parallel_size=expert_parallel, moe_grouped_gemm=False,
                moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
           if num_experts else {}))
    layer_spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="LayerNorm")
    models = []
    for vp_stage in range(virtual_pipeline or 1):  # Megatron-LM's get_model: one chunk per virtual stage
        stage = vp_stage if virtual_pipeline else None
        model = GPTModel(config, layer_spec, vocab_size=vocab, max_sequence_length=seq,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                         parallel_output=True, share_embeddings_and_output_weights=True,
                         position_embedding_type="learned_absolute", vp_stage=stage)
        if DEVICE == "cuda":
            model.cuda(torch.cuda.current_device())  # as Megatron-LM's get_model() does after a CPU initialisation
        if bf16:
            model = Float16Module(config, model)
        models.append(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer, check_for_nan_in_grad=True, bucket_size=bucket_size)
    # (Megatron-LM turns bucketing off for model chunks 2 onwards: their communication overlaps compute anyway)
    chunks = [DistributedDataParallel(config, ddp_config, model, disable_bucketing=i > 0)
              for i, model in enumerate(models)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                        clip_grad=args.clip_grad, bf16=bf16, params_dtype=params_dtype,
                        use_distributed_optimizer=distributed_optimizer),
        chunks)
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)
    # What Megatron's train() sets up before its first step.
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync
    return Job(tp, pp, dp, precision, seed, chunks, optimizer, scheduler, tensor_parallel.get_cuda_rng_tracker(),
               args, config, num_microbatches, ep=expert_parallel)


# ------------------------------------------------------------------------------------------------------------
# training


def batch(job: Job, iteration: int, microbatch: int) -> dict[str, torch.Tensor]:
    """The synthetic micro-batch ``microbatch`` of ``iteration`` for this rank's DP rank: a function of
    (seed, iteration, DP rank, micro-batch) only, so a resumed run sees the data an uninterrupted one saw."""
    from megatron.core import parallel_state

    key = f"{job.seed}/{iteration}/{parallel_state.get_data_parallel_rank()}/{microbatch}".encode()
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    seq, mbs = job.args.seq_length, job.args.micro_batch_size
    text = torch.randint(0, job.args.padded_vocab_size, (mbs, seq + 1), generator=gen)
    out = {"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
           "loss_mask": torch.ones(mbs, seq), "position_ids": torch.arange(seq).expand(mbs, seq).contiguous(),
           "attention_mask": torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)}
    return {k: v.to(DEVICE) for k, v in out.items()}


def _loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output.view(-1).float() * mask)
    return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def _forward_step(data: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Callable]:
    b = next(data)
    output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return output, partial(_loss, b["loss_mask"])


def train(job: Job, iterations: int) -> None:
    """Megatron's train_step up to iteration ``iterations``: forward/backward over the micro-batches (the
    pipeline schedule when PP > 1), optimizer step, scheduler step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    n_micro = job.num_microbatches
    while job.iteration < iterations:
        for chunk in job.model:
            chunk.zero_grad_buffer()
        job.optimizer.zero_grad()
        batches = [batch(job, job.iteration, m) for m in range(n_micro)]
        # the interleaved schedule takes one data iterator per model chunk (as Megatron-LM's train_step gets them)
        data = iter(batches) if len(job.model) == 1 else [iter(batches) for _ in job.model]
        losses = forward_backward(forward_step_func=_forward_step, data_iterator=data, model=job.model,
                                  num_microbatches=n_micro, seq_length=job.args.seq_length,
                                  micro_batch_size=job.args.micro_batch_size, forward_only=False)
        ok, _, _ = job.optimizer.step()
        assert ok, f"iteration {job.iteration}: the optimizer skipped its step"
        job.scheduler.step(increment=job.args.global_batch_size)
        job.iteration += 1
        job.args.iteration = job.iteration
        job.args.consumed_train_samples += job.args.global_batch_size
        job.losses.extend(float(x["lm loss"][0] / x["lm loss"][1]) for x in losses)


# ------------------------------------------------------------------------------------------------------------
# state to compare


def distributed_optimizers(job: Job) -> list[Any]:
    """The job's DistributedOptimizers (none when it trains with plain DDP: every DP rank holds the whole state)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = list(getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer])
    return [o for o in optimizers if isinstance(o, DistributedOptimizer)]


def _replicated_optimizer_state(job: Job) -> dict[str, torch.Tensor]:
    """Plain DDP's optimizer (fp32 here): per model param, its Adam state, the same on every DP rank."""
    out: dict[str, torch.Tensor] = {}
    names = {p: n for n, p in _named_params(job)}
    if distributed_optimizers(job):
        return out
    for i, opt in enumerate(getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]):
        for param, state in opt.optimizer.state.items():
            for k, v in state.items():
                out[f"optim{i}/{names[param]}/{k}"] = torch.as_tensor(v).detach().clone()
        for g, group in enumerate(opt.optimizer.param_groups):
            for k in ("lr", "weight_decay"):
                out[f"optim{i}/group{g}/{k}"] = torch.tensor(group[k], dtype=torch.float64)
    return out


def _named_params(job: Job) -> Iterator[tuple[str, torch.Tensor]]:
    from tiered_ckpt.megatron.adapter import unwrap

    for i, chunk in enumerate(job.model):
        for name, p in unwrap(chunk).named_parameters():
            yield f"model{i}.{name}", p


def fingerprint(job: Job) -> dict[str, torch.Tensor]:
    """What must be bit-identical after a resume, as this rank holds it: model params, each optimizer's fp32
    main params, Adam moments and step (per model param, this rank's shard), scheduler, RNG states."""
    out: dict[str, torch.Tensor] = {}
    names = {p: n for n, p in _named_params(job)}
    for n, p in _named_params(job):
        out[f"param/{n}"] = p.detach().clone()
    for i, opt in enumerate(distributed_optimizers(job)):
        for ranges in opt.gbuf_ranges:
            for buckets in ranges.values():
                for bucket in buckets:
                    for model_param in bucket["param_map"]:
                        for k, v in opt._get_main_param_and_optimizer_states(model_param).items():
                            out[f"optim{i}/{names[model_param]}/{k}"] = torch.as_tensor(v).detach().clone()
        for g, group in enumerate(opt.optimizer.param_groups):
            for k in ("lr", "weight_decay"):
                out[f"optim{i}/group{g}/{k}"] = torch.tensor(group[k], dtype=torch.float64)
    out.update(_replicated_optimizer_state(job))
    for k, v in job.scheduler.state_dict().items():
        if isinstance(v, int | float):
            out[f"scheduler/{k}"] = torch.tensor(v, dtype=torch.float64)
    out["rng/python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    out["rng/numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    out["rng/torch"] = torch.get_rng_state()  # CUDA's generator too, on CPU (see patch_megatron_for_cpu)
    if DEVICE == "cuda":
        out["rng/cuda"] = torch.cuda.get_rng_state()
    for k, v in job.tracker.get_states().items():
        out[f"rng/tracker/{k}"] = v.clone()
    out["iteration"] = torch.tensor(job.iteration)
    out["args/consumed_train_samples"] = torch.tensor(job.args.consumed_train_samples)
    return out


def full_state(job: Job) -> dict[str, torch.Tensor]:
    """Model params and, per param, the full (DP-gathered, unpadded) fp32 main param, Adam moments and step of
    this rank's model-parallel shard: the same at any DP size. Each DistributedOptimizer's shards are gathered
    over its own DP group (with EP, the expert optimizer's is the expert-data-parallel group: the same expert
    names on other EP ranks are other experts)."""
    names = {p: n for n, p in _named_params(job)}
    out = {f"param/{n}": p.detach().clone() for n, p in _named_params(job)}
    numel = {n: p.numel() for n, p in _named_params(job)}
    for i, opt in enumerate(distributed_optimizers(job)):
        mine: dict[str, tuple[int, int, dict[str, torch.Tensor]]] = {}  # name -> (start, end, this rank's slices)
        for ranges in opt.gbuf_ranges:
            for buckets in ranges.values():
                for bucket in buckets:
                    for model_param, r in bucket["param_map"].items():
                        tensors = opt._get_main_param_and_optimizer_states(model_param)
                        mine[f"optim{i}/{names[model_param]}"] = (
                            r["param"].start, r["param"].end,
                            {k: torch.as_tensor(v).detach().clone() for k, v in tensors.items()})
        group = opt.data_parallel_group
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for shards in everyone:
            for key, (start, end, tensors) in shards.items():
                for k, v in tensors.items():
                    if k == "step":
                        out.setdefault(f"{key}/step", v)
                        continue
                    full = out.setdefault(f"{key}/{k}", torch.full((numel[key.split("/", 1)[1]],), float("nan")))
                    full[start:end] = v.reshape(-1)
    out.update(_replicated_optimizer_state(job))
    holes = [k for k, v in out.items() if v.is_floating_point() and bool(v.isnan().any())]
    assert not holes, f"not covered by any DP rank (or NaN): {holes}"
    return out


def local_shards(job: Job) -> dict[str, torch.Tensor]:
    """Each DistributedOptimizer bucket's contiguous fp32 local shard on this rank, as Megatron's
    ``get_parameter_state_dp_zero`` builds it before its gather: ``"[optim<i>/]gbuf<g>/bucket<b>/<key>"``,
    ``N_b / DP`` elements, each param's slice at its ``gbuf_local`` range, zeros elsewhere."""
    out: dict[str, torch.Tensor] = {}
    opts = distributed_optimizers(job)
    for i, opt in enumerate(opts):
        prefix = f"optim{i}/" if len(opts) > 1 else ""
        dp = opt.data_parallel_group.size()
        for g, ranges in enumerate(opt.gbuf_ranges):
            for buckets in ranges.values():
                for b, bucket in enumerate(buckets):
                    numel = opt.buffers[g].buckets[b].grad_data.numel() // dp
                    shard = {k: torch.zeros(numel, dtype=torch.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
                    for model_param, r in bucket["param_map"].items():
                        tensors = opt._get_main_param_and_optimizer_states(model_param)
                        for k, t in shard.items():
                            t[r["gbuf_local"].start:r["gbuf_local"].end] = tensors[k].detach().reshape(-1)
                    out.update({f"{prefix}gbuf{g}/bucket{b}/{k}": t for k, t in shard.items()})
    return out


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The keys whose tensors are not bit-identical (dtype, shape and every byte), or missing on one side."""
    out = [f"{k}: missing" for k in want if k not in got] + [f"{k}: unexpected" for k in got if k not in want]
    for k in want.keys() & got.keys():
        a, b = torch.as_tensor(want[k]), torch.as_tensor(got[k])
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            out.append(f"{k}: values differ")
    return sorted(out)


def coords() -> tuple[int, int, int]:
    """(tp, pp, dp) rank of this process in Megatron's groups."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
