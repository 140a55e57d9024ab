"""diffusion-pipe's own Wan block as Wan2.1's configs build it (``cross_attn_norm``), LoRA on its Linears, each
block under bf16 autocast on the CPU: with ``keep_piece_outputs`` the output, the input gradient and the LoRA
gradients equal plain per-block checkpointing bitwise, non-reentrant and reentrant. The pieces' inputs are float32
(diffusion-pipe keeps Wan's hidden states and modulation in float32), which each LoRA Linear reads twice. Needs
``DGLS_DIFFUSION_PIPE`` pointing at a checkout (see test_diffusion_pipe_wan_pieces.py for the attention stand-in).
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext
from functools import partial

import pytest
import torch
from test_diffusion_pipe_wan_pieces import CHECKOUT, DIM, HEADS, Layer, block_inputs, sdpa_attention
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.activations.unit_checkpoints import UnitCheckpoints

pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set DGLS_DIFFUSION_PIPE to a diffusion-pipe checkout")


@pytest.fixture
def wan_model(monkeypatch):
    monkeypatch.syspath_prepend(CHECKOUT)
    model = importlib.import_module("models.wan.model")
    monkeypatch.setattr(model, "flash_attention", sdpa_attention)
    return model


class AutocastLayer(Layer):
    def forward(self, inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(inputs)


def build(wan) -> list[nn.Module]:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        block = wan.WanAttentionBlock("default", DIM, 2 * DIM, HEADS, cross_attn_norm=True)
        block.requires_grad_(False)
        names = [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=names), block)
        layers.append(AutocastLayer(block))
    return layers


def run(wan, mode: str, keep: bool):
    layers = build(wan)
    lora = [p for layer in layers for name, p in layer.named_parameters() if "lora_" in name]
    assert lora and all(p.requires_grad for p in lora)
    inputs = block_inputs(wan)
    x = inputs[0]
    ckpt = partial(checkpoint, use_reentrant=mode == "reentrant")
    config = SwapConfig.of(prefetch=1, checkpoint_units=True, keep_piece_outputs=True)
    with LayerSwapper(layers, config, device=torch.device("cpu"), log=None) if keep else nullcontext() as swapper:
        ckpt = swapper.checkpoint_function(ckpt) if keep else ckpt
        h = inputs
        for layer in layers:
            h = ckpt(lambda *xs, layer=layer: layer(xs), *h)
        h[0].float().square().sum().backward()
        if keep:
            assert swapper.feature(UnitCheckpoints).replayed == 3 * len(layers)
    return [h[0].detach(), x.grad, *(p.grad for p in lora)]


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_wan_blocks_under_autocast_with_kept_piece_outputs_are_bitwise_plain_checkpointing(wan_model, mode):
    expected, got = run(wan_model, mode, False), run(wan_model, mode, True)
    names = ["the output", "the input gradient"] + [f"LoRA gradient {i}" for i in range(len(expected) - 2)]
    differ = [name for name, a, b in zip(names, expected, got, strict=True) if not torch.equal(a, b)]
    assert not differ, f"{', '.join(differ)} differ from plain checkpointing"
