"""Flux blocks that autocast inside their forward, and a training loop over them: what ``keep_piece_outputs`` must
train bitwise as all-resident training does (the CPU and GPU tests of test_units_cpu.py and test_units_gpu.py).

Each layer is a Flux block, diffusers' own (``FluxTransformerBlock``, ``FluxSingleTransformerBlock``) or the demo
model's Flux-shaped one, after a Wan-style modulation of the timestep embedding. The layer's forward runs under
``torch.autocast(dtype=bfloat16)`` and calls the modulation inside a nested float32 region, as Wan's reference code
does (``amp.autocast(dtype=torch.float32)``; on the CPU, whose autocast has no float32, a region with autocast
off, which is what CPU autocast makes of float32). The residual stream is float32, so the pieces' inputs are too,
and every projection in a piece casts its input to bf16. PEFT LoRA (random B, so every LoRA param trains from
step 1) on every Linear, in float32 over bf16 weights, as diffusion-pipe keeps it.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

BF16 = torch.bfloat16


@dataclass(frozen=True)
class FluxShape:
    heads: int = 24  # Flux: 24 heads of 128, a width of 3072
    head_dim: int = 128
    double_blocks: int = 2
    single_blocks: int = 2
    image_side: int = 16  # image tokens: a side x side grid
    text_tokens: int = 64
    batch: int = 1
    lora_rank: int = 16

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


def fp32_region(device_type: str) -> AbstractContextManager:
    """Wan's ``amp.autocast(dtype=torch.float32)``: float32 compute inside a bf16 region (CPU autocast has no
    float32 and would turn itself off with a warning: off it is, without the warning)."""
    if device_type == "cpu":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(device_type, dtype=torch.float32)


class TimeModulation(nn.Module):
    """Wan-style: a learned table plus a projection of the timestep embedding. Its params are float32, as
    diffusion-pipe keeps Wan's ``modulation`` (its layer calls it inside a float32 region)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, dim) / dim**0.5)
        self.linear = nn.Linear(dim, dim)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return temb + self.table + self.linear(F.silu(temb))


class AutocastFluxLayer(nn.Module):
    """One pipeline layer (a tuple in, a tuple out) under bf16 autocast: the modulation, called inside a nested
    float32 region, then the block (diffusers' with Flux's rotary embedding, or the demo model's)."""

    def __init__(self, block: nn.Module, dim: int, diffusers: bool) -> None:
        super().__init__()
        self.modulation = TimeModulation(dim)
        self.block = block
        self.diffusers = diffusers

    def forward(self, inputs):
        img, txt, temb, *rotary = inputs
        device_type = img.device.type
        with torch.autocast(device_type, dtype=BF16):
            with fp32_region(device_type):
                vec = self.modulation(temb)
            if self.diffusers:
                txt, img = self.block(img, txt, vec, image_rotary_emb=tuple(rotary))
            else:
                img, txt, _ = self.block((img, txt, vec))
        return img, txt, temb, *rotary


def blocks(shape: FluxShape, diffusers: bool) -> list[nn.Module]:
    """Flux's double then single blocks: diffusers' own, or the demo model's Flux-shaped ones."""
    count = shape.double_blocks + shape.single_blocks
    if diffusers:
        from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

        kinds = [FluxTransformerBlock] * shape.double_blocks + [FluxSingleTransformerBlock] * shape.single_blocks
        return [kind(shape.dim, shape.heads, shape.head_dim) for kind in kinds]
    from utils.dgls.demo.model import DemoModelConfig, DoubleBlock, SingleBlock

    cfg = DemoModelConfig(hidden=shape.dim, heads=shape.heads)
    return [(DoubleBlock if i < shape.double_blocks else SingleBlock)(cfg) for i in range(count)]


def build_layers(shape: FluxShape, diffusers: bool, seed: int = 0) -> list[nn.Module]:
    """The layers on the CPU: the blocks' weights bf16 and frozen, the modulations' float32 and frozen, float32
    LoRA on every Linear (trainable)."""
    from peft import LoraConfig, inject_adapter_in_model

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for block in blocks(shape, diffusers):
        layer = AutocastFluxLayer(block.to(BF16), shape.dim, diffusers).requires_grad_(False)
        names = [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
        config = LoraConfig(
            r=shape.lora_rank, lora_alpha=shape.lora_rank, init_lora_weights=False, target_modules=names
        )
        inject_adapter_in_model(config, layer)
        for name, p in layer.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
                p.requires_grad_(True)
        layers.append(layer)
    torch.random.set_rng_state(state)
    return layers


def fresh(template: list[nn.Module], device: torch.device | None) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """A copy of the layers (on ``device`` if given; a swapper moves them itself) and its trainable params."""
    layers = copy.deepcopy(template)
    if device is not None:
        for layer in layers:
            layer.to(device)
    return layers, [p for layer in layers for p in layer.parameters() if p.requires_grad]


def rotary(shape: FluxShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux's rotary embedding of text (all-zero ids) then image tokens (row, column ids)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    side, d = shape.image_side, shape.head_dim
    axes = (d - 2 * (3 * d // 8), 3 * d // 8, 3 * d // 8)  # Flux: (16, 56, 56) of 128
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    image = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
    ids = torch.cat([torch.zeros(shape.text_tokens, 3, dtype=image.dtype), image]).float()
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(ids)
    return cos.to(device), sin.to(device)


@dataclass
class Record:
    losses: list[torch.Tensor]
    params: list[torch.Tensor]


def train(
    layers: list[nn.Module],
    trainable: list[nn.Parameter],
    shape: FluxShape,
    device: torch.device,
    reentrant: bool,
    checkpoint_fn=None,
    steps: int = 3,
) -> Record:
    """``steps`` AdamW steps (lr 1e-3) of one micro-batch each, every layer under a checkpoint (torch's, reentrant
    or not, or ``checkpoint_fn``); the losses and the LoRA params after the last step."""
    ckpt = checkpoint_fn or partial(checkpoint, use_reentrant=reentrant)
    generator = torch.Generator().manual_seed(3)
    diffusers = any(getattr(layer, "diffusers", False) for layer in layers)
    extra = rotary(shape, device) if diffusers else ()
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    losses = []
    for _ in range(steps):
        img, target = (torch.randn(shape.batch, shape.image_side**2, shape.dim, generator=generator) for _ in "it")
        txt = torch.randn(shape.batch, shape.text_tokens, shape.dim, generator=generator)
        temb = torch.randn(shape.batch, shape.dim, generator=generator)
        h = (img.to(device).requires_grad_(reentrant), txt.to(device), temb.to(device), *extra)
        for layer in layers:
            h = ckpt(lambda *xs, layer=layer: layer(xs), *h)
        loss = F.mse_loss(h[0].float(), target.to(device))
        loss.backward()
        losses.append(loss.detach().cpu())
        opt.step()
        opt.zero_grad()
    return Record(losses, [p.detach().cpu().clone() for p in trainable])


def assert_same(expected: Record, got: Record) -> None:
    for step, (a, b) in enumerate(zip(expected.losses, got.losses, strict=True)):
        assert torch.equal(a, b), f"step {step + 1}: loss {b.item()!r}, all-resident {a.item()!r}"
    differ = [(a - b).abs().max().item() for a, b in zip(expected.params, got.params, strict=True)]
    assert max(differ) == 0, f"{sum(d > 0 for d in differ)} of {len(differ)} LoRA params differ, by up to {max(differ)}"
