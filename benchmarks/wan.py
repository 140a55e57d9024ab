"""Wan2.1-14B size (40 blocks, hidden 5120) as a benchmark model, on a short 480x832 clip.

3 latent frames (9 video frames) = 3x60x104 latents = 4680 tokens (about Flux-dev's 4608), 512 text
tokens. ``--latent_frames 5`` (17 frames, 7800 tokens) is about 1.8 s a resident step on an H100
(estimated from Flux-dev's step and the FLOPs): too slow for every method in one 9-minute call.
"""

from __future__ import annotations

import torch
from models import Bench, DPGroup, add_lora, materialize, params_on_meta
from torch import nn

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
# toml/wan_lora_long_video.toml's [dgls] (benchmarks/results/wan_fit_81f_keep_cap8.md: 8 GiB at 81 frames), every
# block streamed (blocks_to_swap: the bench's block count); run under ``cap_device_memory`` as an 8 GiB card holds it,
# with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as the config's command line sets (without it the cap runs
# out on the allocator's unused reserved blocks: measured on 2x H200, 1.1 GiB reserved but unallocated at the
# failing request)
WAN_RECIPE = dict(
    prefetch=1,
    swap_unit_mb=256,
    offload_activations=True,
    checkpoint_units=True,
    offload_recompute=True,
    keep_piece_outputs=True,
)
RECIPE_ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def recipe(blocks: int, tiny: bool) -> dict:
    """WAN_RECIPE with ``blocks`` blocks streamed, every one of a model or a pipeline stage (tiny: units small enough
    to split its blocks)."""
    return dict(WAN_RECIPE, blocks_to_swap=blocks, swap_unit_mb=0.05 if tiny else WAN_RECIPE["swap_unit_mb"])


def runs_recipe(args) -> bool:
    """A bench's Wan job without --vram_budget runs :data:`WAN_RECIPE` under a device-memory cap (bench_scaling,
    bench_disk)."""
    return args.model == "wan" and args.vram_budget is None


def cap_device_memory(device, gib: float | None) -> None:
    """This process may hold at most ``gib`` of ``device``'s memory from here (``None``: all of it again), as a card
    of that size would (methods.memory_cap): the allocator's cache is emptied first, or the segments that held the
    model before DGLS took its layers home would stay reserved past the cap (it binds only at new requests)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # "cuda": the current one
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gib is None else gib * 2**30 / total, index)


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


def build(tiny: bool, device, dtype, args=None, on_meta: bool = False) -> Bench:
    """``on_meta``: weights (and LoRA) left on the meta device, for a pipeline stage to give only its own layers
    weights (scaling_pipeline.py); inputs and target are on ``device`` either way."""
    from diffusers import WanTransformer3DModel

    cfg = WAN_TINY if tiny else WAN_14B
    latent_frames = getattr(args, "latent_frames", 3)
    frames, height, width, tokens = (2, 8, 8, 8) if tiny else (latent_frames, 60, 104, 512)
    with params_on_meta():
        model = WanTransformer3DModel(**cfg)
    pt, ph, pw = cfg["patch_size"]
    grid = (frames // pt, height // ph, width // pw)
    layers = [WanEmbed(model), *(WanBlock(b) for b in model.blocks), WanOut(model, grid)]
    if not on_meta:
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
