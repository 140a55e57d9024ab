"""A plain training loop over a layer list, used to compare swapped and unswapped runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from utils.dgls.demo.data import SyntheticLatents
from utils.dgls.demo.model import BLOCK_CLASSES, DemoModelConfig, add_lora, build_layers
from utils.dgls.memory.precision import fake_quantize

DIST_KEYS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def child_env(*drop: str) -> dict[str, str]:
    """This process's environment for a child process, less the torch.distributed settings (an
    in-process demo run sets them, and its group still holds MASTER_PORT) and ``drop``."""
    return {k: v for k, v in os.environ.items() if k not in DIST_KEYS and k not in drop}


def skip_waits(monkeypatch, direction) -> None:
    """The mutation of every CPU ordering test: the CPU transport never lands ``direction``'s copies when
    something waits for them (``acquire``, ``land``, a later copy gated on them), so readers see NaN bytes."""
    from utils.dgls.memory.transport import Transport

    land = Transport._land

    def mutated(self, copy) -> None:
        if copy.direction is not direction:
            land(self, copy)

    monkeypatch.setattr(Transport, "_land", mutated)


SMALL = DemoModelConfig(hidden=32, heads=2, double_blocks=3, single_blocks=3, text_dim=16, latent_channels=8)


def round_as_stored(layers, rules, device) -> None:
    """The reference for fp8 storage: every param ``rules`` (a CastRules) casts rounded as DGLS stores it, the rounding
    computed on ``device`` (as the copier's upcast runs there), in place wherever the params live."""
    with torch.no_grad():
        for layer in layers:
            casts = rules.plan(layer)
            for p in layer.parameters():
                if id(p) in casts:
                    p.copy_(fake_quantize(p.to(device), casts[id(p)].stored).to(p.device))


def make_layers(dtype=torch.float32, cfg=SMALL):
    layers = build_layers(cfg, seed=0, dtype=dtype)
    trainable = add_lora(layers, rank=4, seed=1, zero_init=False)
    return layers, trainable


def run_layers(layers, inputs, mode: str, checkpoint_fn=None):
    """The layers in order, blocks checkpointed (``mode``: none, nonreentrant, reentrant) with
    ``checkpoint_fn(function, *args)`` if given (a wrapped or diffusion-pipe-style checkpoint)."""
    ckpt = checkpoint_fn or partial(checkpoint, use_reentrant=mode == "reentrant")
    h = inputs
    for layer in layers:
        if type(layer).__name__ in BLOCK_CLASSES and mode != "none" and torch.is_grad_enabled():
            h = ckpt(lambda *xs, layer=layer: layer(xs), *h)
        else:
            h = layer(h)
    return h


class _HostSavingCheckpoint(torch.autograd.Function):
    """Like diffusion-pipe's ``'unsloth'`` checkpointing: large arguments are saved as host copies, the
    layer runs without grad, and backward brings the copies back, recomputes and backpropagates."""

    @staticmethod
    def forward(ctx, function, device, *args):
        ctx.function, ctx.device = function, device
        ctx.save_for_backward(*(x.to("cpu", copy=True) if x.numel() >= 256 else x for x in args))
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = []
        for x in ctx.saved_tensors:
            x = x.to(ctx.device).detach()
            if x.is_floating_point():
                x.requires_grad_(True)
            args.append(x)
        with torch.enable_grad():
            outputs = ctx.function(*args)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad for a in args))


def host_saving_checkpoint(function, *args):
    return _HostSavingCheckpoint.apply(function, args[0].device, *args)


def checkpoint_for(mode: str):
    """The checkpoint function of a test mode: diffusion-pipe's 'unsloth' kind, or torch's (reentrant or not)."""
    return host_saving_checkpoint if mode == "unsloth" else partial(checkpoint, use_reentrant=mode == "reentrant")


def loop_mode(mode: str) -> str:
    """run_layers' mode for a test mode: the 'unsloth' kind needs an input that requires grad, as reentrant does."""
    return "reentrant" if mode == "unsloth" else mode


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
    checkpoint_fn=None,
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
            loss = F.mse_loss(run_layers(layers, inputs, mode, checkpoint_fn).float(), target.float())
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
                evals.append(run_layers(layers, inputs, mode, checkpoint_fn).cpu())
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


def slow_case(value):
    """A parametrize value whose case runs in CI's slow step, not the default run (which must stay under its
    time on 2 cores): the neighbouring values of the same test keep the default run's coverage."""
    return pytest.param(value, marks=pytest.mark.slow)
