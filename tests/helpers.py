"""Shared helpers for the engine tests: realistic items, bit-exact comparison, the CLI in-process, a config."""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import uuid
from pathlib import Path

import numpy as np
import torch

from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.events import Event
from tiered_ckpt.hookspecs import hookimpl


def make_items(seed: int = 0, scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {
        "embedding.weight": torch.randn(64 * scale, 32, generator=g),
        "layers.0.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layers.0.bias": torch.randn(32, generator=g).half(),
        "mask": torch.rand(16, generator=g) > 0.5,
        "counts": torch.randint(0, 1000, (8,), generator=g, dtype=torch.int64),
        "transposed": torch.randn(8, 4, generator=g).t(),  # non-contiguous
    }
    optim = {
        "state": {0: {"exp_avg": torch.randn(100 * scale, generator=g), "step": torch.tensor(float(seed))}},
        "param_groups": [{"lr": 1e-3 * (seed + 1), "betas": (0.9, 0.95), "params": [0]}],
    }
    rng = {"python": random.Random(seed).getstate(), "numpy": np.random.RandomState(seed).get_state(),
           "torch": torch.Generator().manual_seed(seed).get_state()}
    args = argparse.Namespace(iteration=seed, lr=1e-3, name="gpt")
    return {"state": {"model": model, "optimizer": optim, "rng": rng, "args": args, "iteration": seed}}


def assert_same(a, b, path="items"):
    """Bit-exact equality of nested structures (tensors compared by bytes, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        raw_a, raw_b = (t.reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
        assert torch.equal(raw_a, raw_b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, argparse.Namespace):
        assert isinstance(b, argparse.Namespace), path
        assert_same(vars(a), vars(b), path)
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


class Recorder:
    """An event observer plugin that keeps every event."""

    def __init__(self):
        self.events: list[Event] = []

    @hookimpl
    def tiered_ckpt_on_event(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self, kind: str, tier: str | None = None) -> list[Event]:
        return [e for e in self.events if e.kind == kind and (tier is None or e.tier == tier)]


def cli(*argv: str, stderr: bool = False) -> tuple[int, str]:
    """``tiered-ckpt argv...`` in this process: its exit code and what it printed (stdout; and stderr if asked)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), (contextlib.redirect_stderr(out) if stderr else contextlib.nullcontext()):
        code = cli_main(list(argv))
    return code, out.getvalue()


def shm_local_config(shm_root: str, tmp_path: Path, run_id: str | None = None, *, prefix: str = "run") -> dict:
    """A thread-drained run on ``shm_root`` (shm) and ``tmp_path/local`` (local, no fsync)."""
    return {"run_id": run_id or f"{prefix}-{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"},
            "tiers": [{"name": "shm", "kind": "shm", "path": shm_root},
                      {"name": "local", "kind": "local", "path": str(tmp_path / "local"), "fsync": False}]}
