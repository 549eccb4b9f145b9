"""A distributed Adam in Megatron-LM's shape (ZeRO-1): one gradient buffer laid out with Megatron's bucket rules,
each DP rank owning a contiguous shard of every bucket's fp32 main params and Adam moments.

Its ``local_shards()`` are exactly what Megatron's DistributedOptimizer holds in memory
(``gbuf<g>/bucket<b>/<param|exp_avg|exp_avg_sq>``), so the demo's checkpoints are Megatron-shaped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..megatron.geometry import BufferGeometry, ParamSpec, compute_buffer_geometry

KEYS = ("param", "exp_avg", "exp_avg_sq")


class DistributedAdam:
    def __init__(self, model: torch.nn.Module, *, dp_rank: int, dp_size: int, lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, bucket_size: int | None = 40_000):
        self.params = dict(model.named_parameters())
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.lr, self.betas, self.eps = lr, betas, eps
        self.step_count = 0
        specs = [ParamSpec(n, tuple(p.shape)) for n, p in self.params.items()]
        self.geometry: BufferGeometry = compute_buffer_geometry(specs, dp_size=dp_size, bucket_size=bucket_size)
        self.ranges = {r.name: r for r in self.geometry.params()}
        self.buffer = torch.zeros(self.geometry.numel)
        self._fill_buffer_from_params()
        self.shards: dict[str, torch.Tensor] = {}
        for b in self.geometry.buckets:
            lo, n = self._shard_span(b.index)
            self.shards[f"gbuf0/bucket{b.index}/param"] = self.buffer[lo:lo + n].clone()
            self.shards[f"gbuf0/bucket{b.index}/exp_avg"] = torch.zeros(n)
            self.shards[f"gbuf0/bucket{b.index}/exp_avg_sq"] = torch.zeros(n)

    def _shard_span(self, bucket: int) -> tuple[int, int]:
        b = self.geometry.buckets[bucket]
        n = b.numel // self.dp_size
        return b.offset + self.dp_rank * n, n

    def _fill_buffer_from_params(self) -> None:
        for name, p in self.params.items():
            r = self.ranges[name]
            self.buffer[r.start:r.end].copy_(p.detach().reshape(-1))

    def step(self) -> None:
        grads = torch.zeros(self.geometry.numel)
        for name, p in self.params.items():
            r = self.ranges[name]
            grads[r.start:r.end].copy_(p.grad.reshape(-1))
        dist.all_reduce(grads)
        grads /= self.dp_size
        self.step_count += 1
        b1, b2 = self.betas
        for b in self.geometry.buckets:
            lo, n = self._shard_span(b.index)
            g = grads[lo:lo + n]
            m, v = self.shards[f"gbuf0/bucket{b.index}/exp_avg"], self.shards[f"gbuf0/bucket{b.index}/exp_avg_sq"]
            main = self.shards[f"gbuf0/bucket{b.index}/param"]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat = m / (1 - b1 ** self.step_count)
            v_hat = v / (1 - b2 ** self.step_count)
            main.addcdiv_(m_hat, v_hat.sqrt().add_(self.eps), value=-self.lr)
            # Every rank gathers every other rank's updated shard of this bucket.
            parts = [torch.empty(n) for _ in range(self.dp_size)]
            dist.all_gather(parts, main)
            self.buffer[b.offset:b.offset + b.numel].copy_(torch.cat(parts))
        with torch.no_grad():
            for name, p in self.params.items():
                r = self.ranges[name]
                p.copy_(self.buffer[r.start:r.end].view_as(p))

    # ----- checkpointing ----------------------------------------------------------------------------------------
    def local_shards(self) -> dict[str, torch.Tensor]:
        return self.shards

    def load_local_shards(self, shards: dict[str, torch.Tensor]) -> None:
        for key, t in self.shards.items():
            t.copy_(shards[key])

    def state_dict(self) -> dict:
        """The small part Megatron keeps in ``model_optim_rng.pt``'s ``optimizer`` entry."""
        return {"param_groups": [{"lr": self.lr, "betas": self.betas, "eps": self.eps, "step": self.step_count}]}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["param_groups"][0]["step"])
