"""A plain training loop over a layer list, used to compare swapped and unswapped runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from utils.dgls.demo.data import SyntheticLatents
from utils.dgls.demo.model import BLOCK_CLASSES, DemoModelConfig, add_lora, build_layers

DIST_KEYS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def child_env(*drop: str) -> dict[str, str]:
    """This process's environment for a child process, less the torch.distributed settings (an
    in-process demo run sets them, and its group still holds MASTER_PORT) and ``drop``."""
    return {k: v for k, v in os.environ.items() if k not in DIST_KEYS and k not in drop}


SMALL = DemoModelConfig(hidden=32, heads=2, double_blocks=3, single_blocks=3, text_dim=16, latent_channels=8)


def make_layers(dtype=torch.float32, cfg=SMALL):
    layers = build_layers(cfg, seed=0, dtype=dtype)
    trainable = add_lora(layers, rank=4, seed=1, zero_init=False)
    return layers, trainable


def run_layers(layers, inputs, mode: str):
    h = inputs
    for layer in layers:
        if type(layer).__name__ in BLOCK_CLASSES and mode != "none" and torch.is_grad_enabled():
            h = checkpoint(lambda *xs, layer=layer: layer(xs), *h, use_reentrant=mode == "reentrant")
        else:
            h = layer(h)
    return h


@dataclass
class RunRecord:
    losses: list
    grads: list
    params: list
    eval_outputs: list


def train(
    layers,
    trainable,
    device,
    mode="none",
    steps=2,
    accumulate=2,
    eval_between=True,
    dtype=torch.float32,
    cfg=SMALL,
    on_step=None,
):
    """Steps of (accumulate x forward/backward) then AdamW, with forward-only passes between;
    ``on_step(step)`` runs after each optimizer step (a step boundary)."""
    data = SyntheticLatents(cfg, samples=8, image_tokens=12, text_tokens=5, seed=3)
    batches = data.batches(2, dtype, device)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses, grads, evals = [], [], []
    for _ in range(steps):
        for _ in range(accumulate):
            inputs, target = next(batches)
            if mode == "reentrant":
                inputs = (inputs[0].requires_grad_(), *inputs[1:])
            loss = F.mse_loss(run_layers(layers, inputs, mode).float(), target.float())
            loss.backward()
            losses.append(loss.detach().cpu())
        grads.append([p.grad.detach().cpu().clone() for p in trainable])
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(len(grads))
        if eval_between:
            with torch.no_grad():
                inputs, _ = next(batches)
                evals.append(run_layers(layers, inputs, mode).cpu())
    return RunRecord(losses, grads, [p.detach().cpu().clone() for p in trainable], evals)


def assert_bitwise_equal(a: RunRecord, b: RunRecord):
    assert len(a.losses) == len(b.losses)
    for x, y in zip(a.losses, b.losses):
        assert torch.equal(x, y), (x, y)
    for step_a, step_b in zip(a.grads, b.grads):
        for x, y in zip(step_a, step_b):
            assert torch.equal(x, y)
    for x, y in zip(a.params, b.params):
        assert torch.equal(x, y)
    for x, y in zip(a.eval_outputs, b.eval_outputs):
        assert torch.equal(x, y)
