"""A tiny diffusion transformer shaped like Flux: embeddings, double blocks, single blocks, output.

Layers pass a tuple of tensors to each other, as diffusion-pipe's ``to_layers()`` layers do
inside DeepSpeed's pipeline. Double blocks (separate image and text weights, joint attention)
are about twice the size of single blocks (one stream), so placement must count bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DemoModelConfig:
    latent_channels: int = 16
    text_dim: int = 32
    hidden: int = 64
    heads: int = 4
    double_blocks: int = 4
    single_blocks: int = 4
    mlp_ratio: int = 4


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Modulation(nn.Module):
    def __init__(self, hidden: int, count: int) -> None:
        super().__init__()
        self.count = count
        self.linear = nn.Linear(hidden, hidden * count)

    def forward(self, vec: torch.Tensor) -> list[torch.Tensor]:
        return self.linear(F.silu(vec))[:, None].chunk(self.count, dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = q.shape
    q, k, v = (x.view(b, -1, heads, d // heads).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, n, d)


class InitialLayer(nn.Module):
    """Project latents and text, embed the timestep: the pipeline's first layer."""

    def __init__(self, cfg: DemoModelConfig) -> None:
        super().__init__()
        self.img_in = nn.Linear(cfg.latent_channels, cfg.hidden)
        self.txt_in = nn.Linear(cfg.text_dim, cfg.hidden)
        self.time_in = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden))
        self.hidden = cfg.hidden

    def forward(self, inputs):
        latents, text, t = inputs
        vec = self.time_in(timestep_embedding(t, self.hidden).to(latents.dtype))
        return self.img_in(latents), self.txt_in(text), vec


class DoubleBlock(nn.Module):
    """Separate weights for the image and text streams, one joint attention."""

    def __init__(self, cfg: DemoModelConfig) -> None:
        super().__init__()
        h, m = cfg.hidden, cfg.hidden * cfg.mlp_ratio
        self.heads = cfg.heads
        self.img_mod, self.txt_mod = Modulation(h, 6), Modulation(h, 6)
        self.img_norm1, self.txt_norm1 = (
            nn.LayerNorm(h, elementwise_affine=False),
            nn.LayerNorm(h, elementwise_affine=False),
        )
        self.img_qkv, self.txt_qkv = nn.Linear(h, 3 * h), nn.Linear(h, 3 * h)
        self.img_proj, self.txt_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.img_norm2, self.txt_norm2 = (
            nn.LayerNorm(h, elementwise_affine=False),
            nn.LayerNorm(h, elementwise_affine=False),
        )
        self.img_mlp = nn.Sequential(nn.Linear(h, m), nn.GELU(approximate="tanh"), nn.Linear(m, h))
        self.txt_mlp = nn.Sequential(nn.Linear(h, m), nn.GELU(approximate="tanh"), nn.Linear(m, h))

    def forward(self, inputs):
        img, txt, vec = inputs
        i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = self.img_mod(vec)
        t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = self.txt_mod(vec)
        iq, ik, iv = self.img_qkv(self.img_norm1(img) * (1 + i_sc1) + i_sh1).chunk(3, dim=-1)
        tq, tk, tv = self.txt_qkv(self.txt_norm1(txt) * (1 + t_sc1) + t_sh1).chunk(3, dim=-1)
        attn = attention(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), self.heads)
        t_attn, i_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]
        img = img + i_g1 * self.img_proj(i_attn)
        img = img + i_g2 * self.img_mlp(self.img_norm2(img) * (1 + i_sc2) + i_sh2)
        txt = txt + t_g1 * self.txt_proj(t_attn)
        txt = txt + t_g2 * self.txt_mlp(self.txt_norm2(txt) * (1 + t_sc2) + t_sh2)
        return img, txt, vec


class SingleBlock(nn.Module):
    """One stream over the concatenated text and image tokens, attention and MLP in parallel."""

    def __init__(self, cfg: DemoModelConfig) -> None:
        super().__init__()
        h, m = cfg.hidden, cfg.hidden * cfg.mlp_ratio
        self.heads, self.hidden = cfg.heads, h
        self.mod = Modulation(h, 3)
        self.norm = nn.LayerNorm(h, elementwise_affine=False)
        self.linear1 = nn.Linear(h, 3 * h + m)
        self.linear2 = nn.Linear(h + m, h)

    def forward(self, inputs):
        img, txt, vec = inputs
        x = torch.cat([txt, img], 1)
        shift, scale, gate = self.mod(vec)
        qkv, mlp = self.linear1(self.norm(x) * (1 + scale) + shift).split(
            [3 * self.hidden, self.linear1.out_features - 3 * self.hidden], -1
        )
        q, k, v = qkv.chunk(3, dim=-1)
        x = x + gate * self.linear2(torch.cat([attention(q, k, v, self.heads), F.gelu(mlp, approximate="tanh")], -1))
        return x[:, txt.shape[1] :], x[:, : txt.shape[1]], vec


class FinalLayer(nn.Module):
    """Norm and project back to latent channels: the pipeline's last layer."""

    def __init__(self, cfg: DemoModelConfig) -> None:
        super().__init__()
        self.mod = Modulation(cfg.hidden, 2)
        self.norm = nn.LayerNorm(cfg.hidden, elementwise_affine=False)
        self.proj = nn.Linear(cfg.hidden, cfg.latent_channels)

    def forward(self, inputs):
        img, _txt, vec = inputs
        shift, scale = self.mod(vec)
        return self.proj(self.norm(img) * (1 + scale) + shift)


BLOCK_CLASSES = ("DoubleBlock", "SingleBlock")


def lora_param_count(cfg: DemoModelConfig, rank: int) -> int:
    """Params :func:`add_lora` adds (rank x (in + out) per targeted Linear), known before anything is
    built: the demo checks the output folder has room for them before training."""
    h, m = cfg.hidden, cfg.hidden * cfg.mlp_ratio
    double = 2 * ((h + 3 * h) + (h + h) + (h + m) + (m + h))  # qkv, proj, mlp.0, mlp.2 of both streams
    single = (h + 3 * h + m) + (h + m + h)  # linear1, linear2
    return rank * (cfg.double_blocks * double + cfg.single_blocks * single)


def param_count(cfg: DemoModelConfig) -> int:
    """Params of the whole model (a full fine-tune saves all of them), known before anything is built."""
    with torch.device("meta"):
        layers = [InitialLayer(cfg), DoubleBlock(cfg), SingleBlock(cfg), FinalLayer(cfg)]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return counts[0] + cfg.double_blocks * counts[1] + cfg.single_blocks * counts[2] + counts[3]


def layer_count(cfg: DemoModelConfig) -> int:
    """Layers :func:`build_layers` returns, known before anything is built: the input layer, the double and
    single blocks, the output layer."""
    return 1 + cfg.double_blocks + cfg.single_blocks + 1


def build_layers(cfg: DemoModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """The model as an ordered layer list (:func:`layer_count` of them), deterministic for a seed, all params
    frozen."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = [InitialLayer(cfg)]
    layers += [DoubleBlock(cfg) for _ in range(cfg.double_blocks)]
    layers += [SingleBlock(cfg) for _ in range(cfg.single_blocks)]
    layers.append(FinalLayer(cfg))
    torch.random.set_rng_state(gen_state)
    for layer in layers:
        layer.to(dtype).requires_grad_(False)
    return layers


def add_lora(
    layers: list[nn.Module], rank: int, alpha: float | None = None, seed: int = 0, zero_init: bool = True
) -> list[nn.Parameter]:
    """PEFT LoRA on every nn.Linear inside the blocks, as diffusion-pipe configures it."""
    from peft import LoraConfig, inject_adapter_in_model

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or rank,
        lora_dropout=0.0,
        init_lora_weights=zero_init,
        target_modules=[
            "img_qkv",
            "txt_qkv",
            "img_proj",
            "txt_proj",
            "img_mlp.0",
            "img_mlp.2",
            "txt_mlp.0",
            "txt_mlp.2",
            "linear1",
            "linear2",
        ],
    )
    for layer in layers:
        if type(layer).__name__ in BLOCK_CLASSES:
            inject_adapter_in_model(config, layer)
    torch.random.set_rng_state(gen_state)
    dtype = next(layers[0].parameters()).dtype
    trainable = []
    for layer in layers:
        for name, p in layer.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(dtype)
                p.requires_grad_(True)
                trainable.append(p)
    return trainable
