"""The SDXL UNet (2.6B params) as a benchmark model, 1024x1024 (128x128x4 latents), 77 text tokens x 2048.

Layers as diffusion-pipe cuts it: each resnet (+ its attention) of the down/mid/up blocks, the down-
and upsamplers, plus the embedding and output layers: 23 layers of very uneven size (a 320-channel
resnet is ~4 MiB, a 1280-channel resnet with 10 transformer blocks ~700 MiB), with skip connections.
"""

from __future__ import annotations

import torch
from baselines import dp_checkout
from models import Bench, add_lora, materialize, params_on_meta
from torch import nn

SDXL = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048,
    transformer_layers_per_block=(1, 2, 10),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,  # 1280 pooled + 6 x 256 time ids
    norm_num_groups=32,
)
SDXL_TINY = dict(
    SDXL,
    sample_size=16,
    block_out_channels=(32, 64, 64),
    attention_head_dim=(2, 2, 4),
    cross_attention_dim=32,
    transformer_layers_per_block=(1, 1, 2),
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8,
)


class SdxlEmbed(nn.Module):
    """Timestep + pooled text + size conditioning, conv_in; starts the skip-connection tuple."""

    def __init__(self, unet):
        super().__init__()
        self.time_proj, self.time_embedding = unet.time_proj, unet.time_embedding
        self.add_time_proj, self.add_embedding = unet.add_time_proj, unet.add_embedding
        self.conv_in = unet.conv_in

    def forward(self, inputs):
        sample, timestep, context, pooled, time_ids = inputs
        emb = self.time_embedding(self.time_proj(timestep).to(sample.dtype))
        time_embeds = self.add_time_proj(time_ids.flatten()).reshape(sample.shape[0], -1)
        emb = emb + self.add_embedding(torch.cat([pooled, time_embeds], -1).to(emb.dtype))
        h = self.conv_in(sample)
        return h, emb, context, (h,)


class SdxlDown(nn.Module):
    """One resnet of a down block and its attention (if any); its output joins the skips."""

    def __init__(self, resnet, attn):
        super().__init__()
        self.resnet, self.attn = resnet, attn

    def forward(self, inputs):
        h, emb, context, skips = inputs
        h = self.resnet(h, emb)
        if self.attn is not None:
            h = self.attn(h, encoder_hidden_states=context, return_dict=False)[0]
        return h, emb, context, (*skips, h)


class SdxlResample(nn.Module):
    """A down block's downsampler (its output joins the skips) or an up block's upsampler."""

    def __init__(self, samplers, joins_skips: bool):
        super().__init__()
        self.samplers, self.joins_skips = samplers, joins_skips

    def forward(self, inputs):
        h, emb, context, skips = inputs
        for sampler in self.samplers:
            h = sampler(h)
        return h, emb, context, ((*skips, h) if self.joins_skips else skips)


class SdxlMid(nn.Module):
    """The mid block's first resnet, or an (attention, resnet) pair after it."""

    def __init__(self, attn, resnet):
        super().__init__()
        self.attn, self.resnet = attn, resnet

    def forward(self, inputs):
        h, emb, context, skips = inputs
        if self.attn is not None:
            h = self.attn(h, encoder_hidden_states=context, return_dict=False)[0]
        return self.resnet(h, emb), emb, context, skips


class SdxlUp(nn.Module):
    """One resnet of an up block (on the last skip concatenated) and its attention (if any)."""

    def __init__(self, resnet, attn):
        super().__init__()
        self.resnet, self.attn = resnet, attn

    def forward(self, inputs):
        h, emb, context, skips = inputs
        h = self.resnet(torch.cat([h, skips[-1]], dim=1), emb)
        if self.attn is not None:
            h = self.attn(h, encoder_hidden_states=context, return_dict=False)[0]
        return h, emb, context, skips[:-1]


class SdxlOut(nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.conv_norm_out, self.conv_act, self.conv_out = unet.conv_norm_out, unet.conv_act, unet.conv_out

    def forward(self, inputs):
        h = inputs[0]
        return self.conv_out(self.conv_act(self.conv_norm_out(h)))


def sdxl_layers(unet) -> tuple[list[nn.Module], set[int]]:
    """The layer list and the indices diffusion-pipe checkpoints (the resnet/attention layers)."""
    layers: list[nn.Module] = [SdxlEmbed(unet)]
    inner: set[int] = set()
    for block in unet.down_blocks:
        attns = getattr(block, "attentions", None) or [None] * len(block.resnets)
        for resnet, attn in zip(block.resnets, attns):
            inner.add(len(layers))
            layers.append(SdxlDown(resnet, attn))
        if block.downsamplers is not None:
            layers.append(SdxlResample(block.downsamplers, joins_skips=True))
    mid = unet.mid_block
    inner.add(len(layers))
    layers.append(SdxlMid(None, mid.resnets[0]))
    for attn, resnet in zip(mid.attentions, mid.resnets[1:]):
        inner.add(len(layers))
        layers.append(SdxlMid(attn, resnet))
    for block in unet.up_blocks:
        attns = getattr(block, "attentions", None) or [None] * len(block.resnets)
        for resnet, attn in zip(block.resnets, attns):
            inner.add(len(layers))
            layers.append(SdxlUp(resnet, attn))
        if block.upsamplers is not None:
            layers.append(SdxlResample(block.upsamplers, joins_skips=False))
    layers.append(SdxlOut(unet))
    return layers, inner


def build(tiny: bool, device, dtype, args=None, lora: bool = True) -> Bench:
    """The SDXL UNet bench (LoRA on the blocks; ``lora=False``: every weight frozen, for a full fine-tune
    to make trainable)."""
    from diffusers import UNet2DConditionModel

    cfg = SDXL_TINY if tiny else SDXL
    with params_on_meta():
        unet = UNet2DConditionModel(**cfg)
    layers, inner = sdxl_layers(unet)
    materialize(layers, device, dtype)
    blocks = list(range(1, len(layers) - 1))
    if lora:
        add_lora(layers, blocks, dtype)
    side, tokens = cfg["sample_size"], (8 if tiny else 77)
    pooled_dim = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    g = torch.Generator().manual_seed(1)
    size = side * 8
    inputs = (
        torch.randn(1, cfg["in_channels"], side, side, generator=g).to(device, dtype),
        torch.tensor([500.0], device=device),
        torch.randn(1, tokens, cfg["cross_attention_dim"], generator=g).to(device, dtype),
        torch.randn(1, pooled_dim, generator=g).to(device, dtype),
        torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32, device=device),
    )
    target = torch.randn(1, cfg["out_channels"], side, side, generator=g).to(device, dtype)
    checkout = dp_checkout()
    sdxl_py = checkout / "models" / "sdxl.py" if checkout else None
    has_swap = sdxl_py is not None and sdxl_py.is_file() and "enable_block_swap" in sdxl_py.read_text()
    return Bench(
        model="sdxl",
        name="sdxl",
        title="SDXL-UNet LoRA training step",
        shape=f"{size}x{size} image ({side}x{side}x{cfg['in_channels']} latents), {tokens} text tokens",
        config={k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        layers=layers,
        inputs=inputs,
        target=target,
        checkpointed=frozenset(inner),
        blocks=blocks,
        dp_split=None,
        dp_note=(
            "diffusion-pipe has no block swap for SDXL (models/sdxl.py defines no enable_block_swap)"
            if not has_swap
            else "the checkout's models/sdxl.py has a block swap: this benchmark does not drive it yet"
        ),
        defaults={"gib": "", "naive": "0.5", "budgets": "auto,0.01" if tiny else "auto,5"},
    )
