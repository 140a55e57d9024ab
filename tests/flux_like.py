"""A scaled-down Flux double block's module tree, for the swap-unit choice's tests: two modulation Linears (6 d^2
each, no finer split), an attention of eight d x d projections (8 d^2, its output one in a ``ModuleList`` as in
diffusers' ``to_out``) and two MLPs of two 4 d^2 Linears in a ``ModuleList`` (8 d^2 each): 36 d^2 a block, as
diffusers' ``FluxTransformerBlock`` (at d = 3072 in bf16, d^2 is 18.9 MB)."""

from __future__ import annotations

import torch
from torch import nn


class Modulation(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, 6 * d)

    def forward(self, c):
        return self.linear(torch.nn.functional.silu(c)).chunk(6, dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        for name in ("to_q", "to_k", "to_v", "add_q", "add_k", "add_v", "to_add_out"):
            setattr(self, name, nn.Linear(d, d))
        self.to_out = nn.ModuleList([nn.Linear(d, d)])

    def forward(self, x, y):
        q = torch.cat([self.add_q(y), self.to_q(x)], dim=1)
        k = torch.cat([self.add_k(y), self.to_k(x)], dim=1)
        v = torch.cat([self.add_v(y), self.to_v(x)], dim=1)
        a = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1) @ v
        return self.to_out[0](a[:, y.shape[1] :]), self.to_add_out(a[:, : y.shape[1]])


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(d, 4 * d), nn.Linear(4 * d, d)])

    def forward(self, x):
        return self.net[1](torch.nn.functional.gelu(self.net[0](x)))


class FluxLikeBlock(nn.Module):
    """(x, y, c) -> (x, y, c); frozen weights, a trainable gain per stream (resident: what the test trains)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = Modulation(d)
        self.norm1_context = Modulation(d)
        self.attn = Attention(d)
        self.ff = FeedForward(d)
        self.ff_context = FeedForward(d)
        self.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(2, d))

    def forward(self, h):
        x, y, c = h
        sx, gx, mx, *_ = self.norm1(c)
        sy, gy, my, *_ = self.norm1_context(c)
        ax, ay = self.attn(x * (1 + sx), y * (1 + sy))
        x = x + gx * ax * self.gain[0]
        y = y + gy * ay * self.gain[1]
        x = x + self.ff(x * (1 + mx))
        y = y + self.ff_context(y * (1 + my))
        return x, y, c


def flux_like(blocks: int, d: int = 16, seed: int = 0) -> tuple[list[nn.Module], list[nn.Parameter]]:
    torch.manual_seed(seed)
    layers = [FluxLikeBlock(d) for _ in range(blocks)]
    return layers, [layer.gain for layer in layers]


def micro_batches(count: int, d: int = 16, seed: int = 1) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """(input, target) pairs: image tokens, text tokens, a conditioning vector."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x, y = torch.randn(1, 6, d, generator=g), torch.randn(1, 3, d, generator=g)
        c = torch.randn(1, 1, d, generator=g)
        out.append(((x, y, c), torch.randn(1, 6, d, generator=g)))
    return out
