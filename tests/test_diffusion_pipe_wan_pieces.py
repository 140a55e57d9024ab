"""diffusion-pipe's own Wan block (``models/wan/model.py`` of a checkout) under ``checkpoint_units`` and
``keep_piece_outputs`` on the CPU: the pieces DGLS finds are its self-attention, cross-attention and MLP, the
blocks' recomputes take their outputs instead of running them, and the output and input gradient equal plain
per-block checkpointing bitwise, for non-reentrant and reentrant checkpoints. diffusion-pipe's attention
needs CUDA and flash-attn; an SDPA stand-in takes its place here (the sequences are unpadded). Needs
``DGLS_DIFFUSION_PIPE`` pointing at a checkout."""

from __future__ import annotations

import importlib
import os
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.activations.unit_checkpoints import UnitCheckpoints

CHECKOUT = os.environ.get("DGLS_DIFFUSION_PIPE")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set DGLS_DIFFUSION_PIPE to a diffusion-pipe checkout")
DIM, HEADS, GRID = 64, 2, (2, 2, 3)


def sdpa_attention(q, k, v, q_lens=None, k_lens=None, window_size=(-1, -1), **_):
    """flash_attention's contract ([B, L, heads, head dim] in and out) over full-length sequences."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


@pytest.fixture
def wan(monkeypatch):
    monkeypatch.syspath_prepend(CHECKOUT)
    model = importlib.import_module("models.wan.model")
    monkeypatch.setattr(model, "flash_attention", sdpa_attention)
    return model


class Layer(nn.Module):
    """diffusion-pipe's pipeline calls each block with one tuple and passes one on."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs):
        x, e, seq_lens, grid_sizes, freqs, context = inputs
        x = self.block(x, e, seq_lens, grid_sizes, freqs, context, None)
        return x, e, seq_lens, grid_sizes, freqs, context


def block_inputs(wan) -> tuple:
    """A Wan block's arguments at the test's size: hidden states (a leaf that requires grad), modulation, sequence
    lengths, the token grid, rotary frequencies, context."""
    d = DIM // HEADS
    freqs = torch.cat(
        [
            wan.rope_params(1024, d - 4 * (d // 6)),
            wan.rope_params(1024, 2 * (d // 6)),
            wan.rope_params(1024, 2 * (d // 6)),
        ],
        dim=1,
    )
    tokens = GRID[0] * GRID[1] * GRID[2]
    x = torch.randn(1, tokens, DIM, requires_grad=True)
    return x, torch.randn(1, 1, 6, DIM), torch.tensor([tokens]), torch.tensor([GRID]), freqs, torch.randn(1, 8, DIM)


def run(wan, mode: str, keep: bool):
    torch.manual_seed(0)
    layers = [Layer(wan.WanAttentionBlock("default", DIM, 2 * DIM, HEADS)) for _ in range(3)]
    for p in (p for layer in layers for p in layer.parameters()):
        p.requires_grad_(False)
    inputs = block_inputs(wan)
    x = inputs[0]
    ckpt = partial(checkpoint, use_reentrant=mode == "reentrant")
    config = SwapConfig.of(prefetch=1, checkpoint_units=True, keep_piece_outputs=True, offload_recompute=True)
    with LayerSwapper(layers, config, device=torch.device("cpu"), log=None) if keep else nullcontext() as swapper:
        if keep:
            block = layers[0].block
            assert {p.module for p in swapper.pieces if p.entry == 0} == {block.self_attn, block.cross_attn, block.ffn}
            ckpt = swapper.checkpoint_function(ckpt)
        h = inputs
        for layer in layers:
            h = ckpt(lambda *xs, layer=layer: layer(xs), *h)
        h[0].square().sum().backward()
        if keep:
            assert swapper.feature(UnitCheckpoints).replayed == 3 * len(layers)
    return h[0].detach(), x.grad


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_diffusion_pipes_wan_block_with_kept_piece_outputs_is_bitwise_plain_checkpointing(wan, mode):
    (out, grad), (kept_out, kept_grad) = run(wan, mode, False), run(wan, mode, True)
    assert torch.equal(out, kept_out) and torch.equal(grad, kept_grad)
