"""Synthetic, deterministic training data for the demo: no images, no downloads.

Each sample is a "caption" embedding and a latent derived from it by a fixed random map,
so there is something to learn; flow matching adds the noise and timestep per step.
"""

from __future__ import annotations

import torch

from .model import DemoModelConfig


class SyntheticLatents:
    """A fixed set of (latent tokens, text tokens) pairs, made from a seed."""

    def __init__(
        self, cfg: DemoModelConfig, samples: int = 16, image_tokens: int = 64, text_tokens: int = 16, seed: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.text = torch.randn(samples, text_tokens, cfg.text_dim, generator=g)
        mix = torch.randn(cfg.text_dim, cfg.latent_channels, generator=g) / cfg.text_dim**0.5
        pattern = torch.randn(1, image_tokens, cfg.latent_channels, generator=g)
        self.latents = torch.tanh(self.text.mean(1, keepdim=True) @ mix + pattern)
        self.seed = seed

    def batches(self, batch_size: int, dtype: torch.dtype, device: torch.device, shard: tuple[int, int] = (0, 1)):
        """Endless (inputs, target) batches for flow matching, the same sequence for a seed. ``shard``
        (replica, replicas): each data-parallel replica takes its ``batch_size`` rows of one global batch of
        ``batch_size x replicas``, so N replicas see exactly what one process with the global batch sees."""
        g = torch.Generator().manual_seed(self.seed + 1)
        n = self.latents.shape[0]
        part, parts = shard
        rows = slice(part * batch_size, (part + 1) * batch_size)
        while True:
            idx = torch.randint(0, n, (batch_size * parts,), generator=g)
            x0, text = self.latents[idx], self.text[idx]
            noise = torch.randn(x0.shape, generator=g)
            t = torch.sigmoid(torch.randn(batch_size * parts, generator=g))
            xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
            target = noise - x0
            xt, text, t, target = xt[rows], text[rows], t[rows], target[rows]
            inputs = (xt.to(device, dtype), text.to(device, dtype), t.to(device))
            yield inputs, target.to(device, dtype)
