"""Micro-batches that interleave, as a pipeline stage's schedule runs them: re-placed between steps only.

DeepSpeed's 1F1B schedule on the first of two stages runs micro-batch 2's forward before micro-batch 1's
backward. The VRAM planner acts between passes (it measures other placements: swap units checkpointed or not,
other layers resident); acting after micro-batch 0's backward re-places layers while micro-batch 1 awaits its
recompute, which then runs under another placement than its forward. Inside ``LayerSwapper.one_step`` the planner
acts as the next step starts (utils/dgls/engine/swapper.py; the DeepSpeed trainers enter it with several stages:
utils/dgls/trainers/interleaved_steps.py). The two-stage demo under the launcher: tests/test_multi_process.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL, make_layers, run_layers

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.demo.data import SyntheticLatents

ORDER = "FFBFBFBB"  # four micro-batches, two in flight: the first stage's part of a 2-stage 1F1B step
STEPS = 8  # the planner's probe at steps 1-2, then a trial placement each step


def interleaved_steps(layers, trainable, swapper: LayerSwapper | None, in_one_step: bool):
    """``STEPS`` AdamW steps of ``ORDER``'s passes (torch's non-reentrant checkpoint around each block); each step
    inside ``swapper.one_step()`` if ``in_one_step``. Every loss and the trained params."""
    batches = SyntheticLatents(SMALL, samples=8, image_tokens=12, text_tokens=5, seed=3).batches(
        2, torch.float32, torch.device("cpu")
    )
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(STEPS):
        with swapper.one_step() if in_one_step else contextlib.nullcontext():
            waiting = []
            for op in ORDER:
                if op == "F":
                    inputs, target = next(batches)
                    waiting.append(F.mse_loss(run_layers(layers, inputs, "nonreentrant").float(), target.float()))
                else:
                    loss = waiting.pop(0)
                    loss.backward()
                    losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in trainable]


def swapped(lines: list[str]) -> tuple[list, list, LayerSwapper]:
    """The small model's layers under a VRAM budget of half their bytes, split into swap units (several of the
    planner's trial placements fit)."""
    layers, trainable = make_layers()
    total = sum(
        p.numel() * p.element_size()
        for layer in layers
        if isinstance(layer, torch.nn.Module)
        for p in layer.parameters()
    )
    config = SwapConfig.of(vram_budget=0.5 * total / 2**30, swap_unit_mb=0.02)
    return layers, trainable, LayerSwapper(layers, config, device="cpu", log=lines.append)


def test_in_one_step_the_planner_re_places_between_steps_and_the_numbers_stay_bitwise():
    reference = interleaved_steps(*make_layers(), None, in_one_step=False)
    lines: list[str] = []
    layers, trainable, swapper = swapped(lines)
    try:
        losses, params = interleaved_steps(layers, trainable, swapper, in_one_step=True)
    finally:
        swapper.remove()
    assert sum(line.startswith("DGLS plan (") for line in lines) >= 2, lines  # it did re-place, between steps
    assert all(torch.equal(a, b) for a, b in zip(losses, reference[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, reference[1], strict=True))


def test_without_one_step_a_re_placement_lands_between_a_forward_and_its_recompute():
    """The control: the same loop, each step not in ``one_step``, fails or trains other numbers (the planner's first
    trial re-places layers while micro-batch 1 awaits its backward)."""
    reference = interleaved_steps(*make_layers(), None, in_one_step=False)
    layers, trainable, swapper = swapped([])
    try:
        losses, params = interleaved_steps(layers, trainable, swapper, in_one_step=False)
    except Exception:  # noqa: BLE001  # whichever part meets the other placement first
        return
    finally:
        swapper.remove()
    pairs = zip(losses + params, reference[0] + reference[1], strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs), "re-placed mid-step, yet trained what the reference trains"


def test_one_step_does_not_nest():
    layers, _, swapper = swapped([])
    try:
        with swapper.one_step(), pytest.raises(RuntimeError, match="already active"), swapper.one_step():
            pass
    finally:
        swapper.remove()
