"""Real architectures, random weights: a LoRA training step per method, one model per invocation.

Models are built from their diffusers configs (no download), cut into diffusion-pipe-style layer
lists, LoRA rank 16 on the blocks' Linear layers, non-reentrant checkpointing per block, batch 1:

- ``flux``: Flux-dev size (19 double + 38 single blocks, hidden 3072), 1024x1024: see bench_flux.py.
- ``sdxl``: the SDXL UNet (2.6B params), 1024x1024 (128x128x4 latents), 77 text tokens x 2048. Layers
  as diffusion-pipe cuts them: each resnet (+ its attention) of the down/mid/up blocks, the down- and
  upsamplers, plus the embedding and output layers: 23 layers of very uneven size (a 320-channel
  resnet is ~4 MiB, a 1280-channel resnet with 10 transformer blocks ~700 MiB), skip connections.
- ``wan``: Wan2.1-14B size (40 blocks, hidden 5120, 40 heads, ffn 13824, in/out 16 channels, text_dim
  4096, patch (1,2,2)), a short 480x832 clip: 3 latent frames (9 video frames) = 3x60x104 latents =
  4680 tokens (about Flux-dev's 4608; estimated ~1 s a resident step on an H100 from Flux-dev's 0.84 s
  and the FLOPs), 512 text tokens. ``--latent_frames 5`` (17 frames, 7800 tokens) is ~1.8 s a step by the
  same estimate: too slow for every method in one 9-minute call.

Methods (``--methods``, default all; benchmarks/common.py): resident, dgls (0/25/50/75/100% of the
blocks streamed), dp (diffusion-pipe's built-in block swap, from the checkout in
$DGLS_DIFFUSION_PIPE), auto (DGLS vram_budget auto and a fixed GiB budget), naive (synchronous
.to()). Writes benchmarks/results/<name>.json, .md and .png (name: flux_dev, sdxl, wan).

    python benchmarks/bench_models.py --model sdxl            # H100: about 2 minutes (estimate)
    python benchmarks/bench_models.py --model wan             # H100: about 6-7 minutes (estimate)
    python benchmarks/bench_models.py --model flux            # H100: about 6-7 minutes (= bench_flux.py)
    python benchmarks/bench_models.py --model wan --tiny      # smoke test on CPU, seconds

Every run stops starting methods at --deadline_s (480 s after start; a running timed loop then stops
at 3 steps, the naive swap times as many steps as are left), so one invocation stays under 9 minutes;
results are written after every method.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_flux import flux_bench  # noqa: E402
from common import Bench, DPGroup, add_lora, materialize, params_on_meta  # noqa: E402

# ---------------------------------------------------------------- SDXL UNet
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


def sdxl_bench(tiny: bool, device, dtype, args=None) -> Bench:
    from diffusers import UNet2DConditionModel

    cfg = SDXL_TINY if tiny else SDXL
    with params_on_meta():
        unet = UNet2DConditionModel(**cfg)
    layers, inner = sdxl_layers(unet)
    materialize(layers, device, dtype)
    blocks = list(range(1, len(layers) - 1))
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
    checkout = common.dp_checkout()
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


# ---------------------------------------------------------------- Wan2.1-14B size
WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
WAN_TINY = dict(
    WAN_14B,
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=6,
    rope_max_seq_len=64,
)


class WanEmbed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = (
            model.rope,
            model.patch_embedding,
            model.condition_embedder,
        )

    def forward(self, inputs):
        latents, timestep, text = inputs
        cos, sin = self.rope(latents)
        h = self.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
        temb, tproj, context, _ = self.condition_embedder(timestep, text, None)
        return h, context, tproj.unflatten(1, (6, -1)), temb, cos, sin


class WanBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        h, context, tproj, temb, cos, sin = inputs
        h = self.block(h, context, tproj, (cos, sin))  # positional, as diffusion-pipe's Wan layer calls its block
        return h, context, tproj, temb, cos, sin


class WanOut(nn.Module):
    def __init__(self, model, grid):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out
        self.scale_shift_table = model.scale_shift_table
        self.patch, self.grid = model.config.patch_size, grid

    def forward(self, inputs):
        h, _context, _tproj, temb, _cos, _sin = inputs
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        h = (self.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        h = self.proj_out(h)
        (pt, ph, pw), (f, hh, ww) = self.patch, self.grid
        h = h.reshape(h.shape[0], f, hh, ww, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def wan_bench(tiny: bool, device, dtype, args=None) -> Bench:
    from diffusers import WanTransformer3DModel

    cfg = WAN_TINY if tiny else WAN_14B
    latent_frames = getattr(args, "latent_frames", 3)
    frames, height, width, tokens = (2, 8, 8, 8) if tiny else (latent_frames, 60, 104, 512)
    with params_on_meta():
        model = WanTransformer3DModel(**cfg)
    pt, ph, pw = cfg["patch_size"]
    grid = (frames // pt, height // ph, width // pw)
    layers = [WanEmbed(model), *(WanBlock(b) for b in model.blocks), WanOut(model, grid)]
    materialize(layers, device, dtype)
    blocks = list(range(1, len(layers) - 1))
    add_lora(layers, blocks, dtype)
    g = torch.Generator().manual_seed(1)
    inputs = (
        torch.randn(1, cfg["in_channels"], frames, height, width, generator=g).to(device, dtype),
        torch.tensor([500.0], device=device),
        torch.randn(1, tokens, cfg["text_dim"], generator=g).to(device, dtype),
    )
    target = torch.randn(1, cfg["out_channels"], frames, height, width, generator=g).to(device, dtype)
    n = len(blocks)
    video_frames = (frames - 1) * 4 + 1
    return Bench(
        model="wan",
        name="wan",
        title="Wan2.1-14B-size LoRA training step",
        shape=(
            f"{height * 8}x{width * 8} x {video_frames} video frames ({frames}x{height}x{width} latents, "
            f"{grid[0] * grid[1] * grid[2]} tokens), {tokens} text tokens"
        ),
        config={k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        layers=layers,
        inputs=inputs,
        target=target,
        checkpointed=frozenset(blocks),
        blocks=blocks,
        # models/wan/wan.py enable_block_swap: one offloader over the blocks, at most count - 2 swapped
        dp_split=lambda k: [DPGroup("TransformerBlock", blocks, k)],
        dp_max=n - 2,
        defaults={"gib": "", "dp_swaps": "0.5,max", "naive": "0.5", "budgets": "auto,0.01" if tiny else "auto,12"},
    )


BUILDERS = {"flux": flux_bench, "sdxl": sdxl_bench, "wan": wan_bench}


def main(argv=None) -> None:
    common.main(sys.argv[1:] if argv is None else argv, BUILDERS, None, __doc__)


if __name__ == "__main__":
    main()
