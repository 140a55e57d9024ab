"""Flux-dev size (19 double + 38 single blocks, hidden 3072) as a benchmark model, 1024x1024, batch 1.

diffusers' FluxTransformer2DModel built from its config with random weights, cut into the layers
diffusion-pipe cuts it into: an embedding layer, one layer per block, a final layer.
"""

from __future__ import annotations

import torch
from models import Bench, DPGroup, add_lora, materialize, params_on_meta
from torch import nn

FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# Enough blocks that diffusion-pipe's split (blocks_to_swap // 2 double, the rest x 2 + 1 single,
# each at most count - 2) can swap something.
TINY = dict(
    FLUX_DEV,
    in_channels=16,
    num_layers=4,
    num_single_layers=6,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    axes_dims_rope=(4, 6, 6),
)


class Embed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.pos_embed = model.time_text_embed, model.pos_embed

    def forward(self, inputs):
        latents, text, pooled, t, guidance, img_ids, txt_ids = inputs
        h = self.x_embedder(latents)
        temb = self.time_text_embed(t.to(h.dtype) * 1000, guidance.to(h.dtype) * 1000, pooled)
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), 0))
        return h, self.context_embedder(text), temb, cos, sin


class Block(nn.Module):
    """One double or single block; both take and return the two streams in diffusers >= 0.35."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        h, e, temb, cos, sin = inputs
        e, h = self.block(hidden_states=h, encoder_hidden_states=e, temb=temb, image_rotary_emb=(cos, sin))
        return h, e, temb, cos, sin


class Final(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, inputs):
        h, _e, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(h, temb))


def make_inputs(cfg: dict, side: int, text_tokens: int, device, dtype) -> tuple[tuple, torch.Tensor]:
    """Random latents, text, pooled text and position ids for ``side`` x ``side`` image tokens; the target."""
    g = torch.Generator().manual_seed(1)
    n = side**2
    latents = torch.randn(1, n, cfg["in_channels"], generator=g)
    text = torch.randn(1, text_tokens, cfg["joint_attention_dim"], generator=g)
    pooled = torch.randn(1, cfg["pooled_projection_dim"], generator=g)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros(n), rows.flatten().float(), cols.flatten().float()], -1)
    txt_ids = torch.zeros(text_tokens, 3)
    target = torch.randn(1, n, cfg["in_channels"], generator=g)
    inputs = (
        latents.to(device, dtype),
        text.to(device, dtype),
        pooled.to(device, dtype),
        torch.tensor([0.5], device=device),
        torch.tensor([1.0], device=device),
        img_ids.to(device),
        txt_ids.to(device),
    )
    return inputs, target.to(device, dtype)


def dp_split(double: list[int], single: list[int]):
    """diffusion-pipe's models/flux.py enable_block_swap: blocks_to_swap // 2 double blocks and (the rest)
    x 2 + 1 single blocks, each offloader swapping at most its block count - 2; and the largest valid count."""

    def split(n: int) -> list[DPGroup]:
        d = n // 2
        return [DPGroup("DoubleBlock", double, d), DPGroup("SingleBlock", single, (n - d) * 2 + 1)]

    def valid(n: int) -> bool:
        return all(g.swap <= len(g.layers) - 2 for g in split(n))

    return split, max((n for n in range(1, len(double) + len(single)) if valid(n)), default=0)


def build(
    tiny: bool,
    device,
    dtype,
    args=None,
    side: int | None = None,
    lora: bool = True,
    depth: tuple[int, int] | None = None,
    on_meta: bool = False,
) -> Bench:
    """``side``: latent side (64: 1024x1024, the default; 32: 512x512). ``lora=False``: every weight frozen,
    for a full fine-tune to make trainable. ``depth``: (double, single) blocks instead of Flux-dev's 19 and 38,
    at the same widths. ``on_meta``: weights (and LoRA) left on the meta device, for a pipeline stage to give only
    its own layers weights (scaling_pipeline.py); inputs and target are on ``device`` either way."""
    from diffusers import FluxTransformer2DModel

    cfg, default_side, text_tokens = (TINY, 8, 8) if tiny else (FLUX_DEV, 64, 512)
    if depth is not None:
        cfg = dict(cfg, num_layers=depth[0], num_single_layers=depth[1])
    side = side or default_side
    with params_on_meta():
        model = FluxTransformer2DModel(**cfg)
    layers = [
        Embed(model),
        *(Block(b) for b in model.transformer_blocks),
        *(Block(b) for b in model.single_transformer_blocks),
        Final(model),
    ]
    blocks = list(range(1, len(layers) - 1))
    if not on_meta:
        materialize(layers, device, dtype)
    if lora:
        add_lora(layers, blocks, dtype)
    inputs, target = make_inputs(cfg, side, text_tokens, device, dtype)
    split, dp_max = dp_split(blocks[: cfg["num_layers"]], blocks[cfg["num_layers"] :])
    return Bench(
        model="flux",
        name="flux_dev",
        title="Flux-dev-size LoRA training step",
        shape=f"{side * 16}x{side * 16} image: {side * side} image + {text_tokens} text tokens",
        config=cfg,
        layers=layers,
        inputs=inputs,
        target=target,
        checkpointed=frozenset(blocks),
        blocks=blocks,
        dp_split=split,
        dp_max=dp_max,
        defaults={
            "gib": "" if tiny else "9.6,19",
            "dp_swaps": "max" if tiny else "9.6GiB,19GiB",
            "naive": "0.5" if tiny else "19GiB",
            "budgets": "auto,1" if tiny else "auto,10",
        },
    )
