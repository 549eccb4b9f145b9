"""A small GPT in plain torch, with Megatron-LM's parameter names, for the demo and benchmarks."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = nn.ModuleDict({
            "linear_qkv": nn.Linear(hidden, 3 * hidden),
            "linear_proj": nn.Linear(hidden, hidden),
        })
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.ModuleDict({
            "linear_fc1": nn.Linear(hidden, 4 * hidden),
            "linear_fc2": nn.Linear(4 * hidden, hidden),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.self_attention["linear_qkv"](self.input_layernorm(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.self_attention["linear_proj"](y)
        return x + self.mlp["linear_fc2"](F.gelu(self.mlp["linear_fc1"](self.pre_mlp_layernorm(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.embedding = nn.ModuleDict({"word_embeddings": nn.Embedding(vocab, hidden),
                                        "position_embeddings": nn.Embedding(seq, hidden)})
        self.decoder = nn.ModuleDict({"layers": nn.ModuleList(Block(hidden, heads) for _ in range(layers)),
                                      "final_layernorm": nn.LayerNorm(hidden)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])
        x = self.embedding["word_embeddings"](tokens) + self.embedding["position_embeddings"](pos)
        for block in self.decoder["layers"]:
            x = block(x)
        x = self.decoder["final_layernorm"](x)
        return x @ self.embedding["word_embeddings"].weight.t()  # tied output layer

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(step: int, rank: int, *, size: int = 8, seq: int = 32, vocab: int = 128) -> torch.Tensor:
    """Deterministic data: the batch of (step, rank) is the same in every run."""
    g = torch.Generator().manual_seed(step * 1_000 + rank)
    # A learnable pattern: each sequence counts up from a random start, modulo the vocabulary.
    start = torch.randint(0, vocab, (size, 1), generator=g)
    return (start + torch.arange(seq + 1)) % vocab
