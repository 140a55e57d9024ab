"""Flux-dev-size training step: DGLS against all-resident, diffusion-pipe's built-in swap and a naive swap.

diffusers' FluxTransformer2DModel built from its config (19 double + 38 single blocks, hidden
3072; random bf16 weights, no download), LoRA rank 16 on the blocks' Linear layers,
non-reentrant checkpointing per block, 1024x1024 (4096 image + 512 text tokens), batch 1.
Every method runs in this one process on the same model and inputs (benchmarks/common.py has
the methods). Writes benchmarks/results/flux_dev.json, .md (with the peer table and the
issue's targets) and (with matplotlib) .png. Same as ``bench_models.py --model flux``.

    python benchmarks/bench_flux.py                 # H100: about 7 minutes
    python benchmarks/bench_flux.py --tiny          # smoke test on CPU, seconds
    DGLS_DIFFUSION_PIPE=/path/to/diffusion-pipe python benchmarks/bench_flux.py   # with the dp baseline
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402, F401  (GiB, gpu_details, pinned_bandwidth: bench_fp8/bench_planner use them from here)
    Bench,
    DPGroup,
    GiB,
    add_lora,
    gpu_details,
    materialize,
    params_on_meta,
    pinned_bandwidth,
)

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
TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
# --tiny of this benchmark: enough blocks that diffusion-pipe's split (blocks_to_swap // 2 double,
# the rest x 2 + 1 single, each at most count - 2) can swap something.
TINY_BENCH = dict(TINY, num_layers=4, num_single_layers=6)


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


def flux_layers(cfg: dict, dtype, device) -> list[nn.Module]:
    """The model as a diffusion-pipe-style layer list, random weights on ``device``, LoRA r16 on the blocks."""
    from diffusers import FluxTransformer2DModel

    with params_on_meta():
        model = FluxTransformer2DModel(**cfg)
    layers = [
        Embed(model),
        *(Block(b) for b in model.transformer_blocks),
        *(Block(b) for b in model.single_transformer_blocks),
        Final(model),
    ]
    materialize(layers, device, dtype)
    add_lora(layers, list(range(1, len(layers) - 1)), dtype)
    return layers


def build_layers(cfg: dict, dtype, init_device) -> list[nn.Module]:
    """The layer list with its weights on the CPU (initialised on ``init_device``: fast on a GPU)."""
    layers = flux_layers(cfg, dtype, init_device)
    for layer in layers:
        layer.to("cpu")
    return layers


def make_inputs(cfg: dict, image_tokens_side: int, text_tokens: int, device, dtype):
    g = torch.Generator().manual_seed(1)
    n = image_tokens_side**2
    latents = torch.randn(1, n, cfg["in_channels"], generator=g)
    text = torch.randn(1, text_tokens, cfg["joint_attention_dim"], generator=g)
    pooled = torch.randn(1, cfg["pooled_projection_dim"], generator=g)
    rows, cols = torch.meshgrid(torch.arange(image_tokens_side), torch.arange(image_tokens_side), indexing="ij")
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


def dp_flux_split(double: list[int], single: list[int]):
    """models/flux.py enable_block_swap: blocks_to_swap // 2 double blocks and (the rest) x 2 + 1 single
    blocks, each offloader swapping at most its block count - 2."""

    def split(n: int) -> list[DPGroup]:
        d = n // 2
        return [DPGroup("DoubleBlock", double, d), DPGroup("SingleBlock", single, (n - d) * 2 + 1)]

    def valid(n: int) -> bool:
        return all(g.swap <= len(g.layers) - 2 for g in split(n))

    return split, max((n for n in range(1, len(double) + len(single)) if valid(n)), default=0)


def flux_bench(tiny: bool, device, dtype, args=None) -> Bench:
    cfg, side, text_tokens = (TINY_BENCH, 8, 8) if tiny else (FLUX_DEV, 64, 512)
    layers = flux_layers(cfg, dtype, device)
    inputs, target = make_inputs(cfg, side, text_tokens, device, dtype)
    double = list(range(1, 1 + cfg["num_layers"]))
    single = list(range(1 + cfg["num_layers"], len(layers) - 1))
    split, dp_max = dp_flux_split(double, single)
    return Bench(
        model="flux",
        name="flux_dev",
        title="Flux-dev-size LoRA training step",
        shape=f"{side * 16}x{side * 16} image: {side * side} image + {text_tokens} text tokens",
        config=cfg,
        layers=layers,
        inputs=inputs,
        target=target,
        checkpointed=frozenset(range(1, len(layers) - 1)),
        blocks=list(range(1, len(layers) - 1)),
        dp_split=split,
        dp_max=dp_max,
        defaults={
            "gib": "" if tiny else "9.6,19",
            "dp_swaps": "max" if tiny else "9.6GiB,19GiB",
            "naive": "0.5" if tiny else "19GiB",
            "budgets": "auto,1" if tiny else "auto,10",
        },
    )


# ---------------------------------------------------------------- kept for bench_planner.py / bench_fp8.py
def train_step(layers, inputs, target, optimizer):
    """One LoRA step with the first and last layer un-checkpointed and every block checkpointed."""
    common.train_step(layers, inputs, target, optimizer, frozenset(range(1, len(layers) - 1)))


def measure(layers, inputs, target, device, steps, warmup) -> list[float]:
    optimizer = torch.optim.AdamW([p for layer in layers for p in layer.parameters() if p.requires_grad], lr=1e-5)
    return common.time_steps(lambda: train_step(layers, inputs, target, optimizer), device, warmup, steps)[0]


def blocks_to_swap_for(layers, gib: float) -> int:
    """The blocks_to_swap whose streamed bytes come closest to ``gib`` (layers holding their weights)."""
    from utils.dgls import SwapConfig
    from utils.dgls.placement import plan_placement

    probe = SwapConfig(blocks_to_swap=0)
    sizes = plan_placement(layers, probe).sizes
    candidates = sum(1 for s in sizes if s.streamable_bytes)
    return min(
        range(candidates + 1),
        key=lambda n: abs(plan_placement(layers, probe.replace(blocks_to_swap=n)).streamed_bytes / GiB - gib),
    )


def main(argv=None) -> None:
    common.main(sys.argv[1:] if argv is None else argv, {"flux": flux_bench}, "flux", __doc__)


if __name__ == "__main__":
    main()
