"""Training loops for layer-major accumulation tests: the same LoRA or full fine-tuning steps with a step's
micro-batches run layer-major (:func:`~utils.dgls.engine.layer_major.layer_major_step`, or
:func:`~utils.dgls.engine.layer_major.layer_major_losses` and one backward) or one after another (:func:`step`, the
one place both are written), on any device, dtype and model width."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from full_ft import SPEC, FullRecord, _weights, full_layers, params_of
from helpers import SMALL, RunRecord, checkpoint_for, loop_mode, make_layers, run_layers

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.demo.data import SyntheticLatents
from utils.dgls.demo.model import BLOCK_CLASSES
from utils.dgls.engine.layer_major import layer_major_losses, layer_major_step
from utils.dgls.memory.transport import Direction
from utils.dgls.watching.listener import Listener

CPU = torch.device("cpu")


class WeightCopies(Listener):
    """Per pass: the weight copies the transport made (prefetches a use never read included) and those a use read."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, int]] = []
        self.copies = self.used = 0

    def copied(self, copy) -> None:
        if copy.direction is Direction.WEIGHTS_IN:
            self.copies += 1

    def fetched(self, token) -> None:
        self.used += 1

    def pass_ended(self) -> None:
        self.passes.append((self.copies, self.used))
        self.copies = self.used = 0


def runners(layers, mode: str, checkpoint_fn=None) -> list:
    """The layers as run_layers runs them, one callable each (blocks under the mode's checkpoint)."""
    ckpt = checkpoint_fn or checkpoint_for(mode)
    loop = loop_mode(mode)

    def checkpointed(layer, h):
        if not torch.is_grad_enabled():
            return layer(h)
        return ckpt(lambda *xs: layer(xs), *h)

    return [
        partial(checkpointed, layer) if type(layer).__name__ in BLOCK_CLASSES and loop != "none" else layer
        for layer in layers
    ]


def batches(dtype=torch.float32, cfg=SMALL, device=CPU):
    data = SyntheticLatents(cfg, samples=8, image_tokens=12, text_tokens=5, seed=3)
    return data.batches(2, dtype, device)


def _inputs(inputs, mode):  # a reentrant checkpoint needs an input that requires grad
    return (inputs[0].requires_grad_(), *inputs[1:]) if loop_mode(mode) == "reentrant" else inputs


def _loss(out, target):
    return F.mse_loss(out.float(), target.float())


def micro_loss(micro, out, m):
    return _loss(out, micro[m][1])


def step(run, micro, mode, layer_major, swapper=None, one_backward=False) -> list:
    """One step's forward and backward over ``micro`` ((inputs, target) pairs): layer-major
    (:func:`~utils.dgls.engine.layer_major.layer_major_step`, or with ``one_backward`` ``layer_major_losses`` and one
    backward of the losses' sum over N, as a trainer's engine scales them) or one micro-batch after another (with
    ``one_backward`` each loss scaled by 1/N). Returns each micro-batch's loss, detached."""
    count = len(micro)
    inputs = [_inputs(x, mode) for x, _ in micro]
    if layer_major and one_backward:
        with layer_major_losses(run, inputs, partial(micro_loss, micro), swapper) as got:
            (sum(got) / count).backward()
        return [x.detach() for x in got]
    if layer_major:
        return layer_major_step(run, inputs, partial(micro_loss, micro), swapper)
    losses = []
    for h, (_, target) in zip(inputs, micro):
        for layer in run:
            h = layer(h)
        loss = _loss(h, target)
        (loss / count if one_backward else loss).backward()
        losses.append(loss.detach())
    return losses


def train_lora(
    mode,
    accumulate,
    layer_major,
    swap=None,
    steps=2,
    checkpoint_fn=None,
    swapper_hook=None,
    one_backward=False,
    layers=None,
    device=CPU,
    dtype=torch.float32,
    cfg=SMALL,
    log=None,
):
    """LoRA steps of ``accumulate`` micro-batches then AdamW, an eval pass between steps; ``swap``: a SwapConfig to
    stream the layers with (``swapper_hook(swapper)`` sees the swapper first). ``one_backward``: each loss scaled by
    1/N, as a trainer's engine does (sequential: ``(loss / N).backward()`` each; layer-major: ``layer_major_losses``
    and one backward of their sum over N). ``layers``: (layers, trainable) to train (default: make_layers()), moved
    to ``device`` when nothing streams; ``log``: the swapper's."""
    layers, trainable = layers if layers is not None else make_layers(dtype, cfg)
    if swap is None:
        for layer in layers:
            layer.to(device)
    swapper = LayerSwapper(layers, swap, device=device, log=log) if swap is not None else None
    try:
        if swapper is not None and swapper_hook is not None:
            swapper_hook(swapper)
        fn = swapper.checkpoint_function(checkpoint_for(mode)) if checkpoint_fn == "swapper" else checkpoint_fn
        run = runners(layers, mode, fn)
        data = batches(dtype, cfg, device)
        opt = torch.optim.AdamW(trainable, lr=1e-2)
        losses, grads, evals = [], [], []
        for _ in range(steps):
            micro = [next(data) for _ in range(accumulate)]
            losses += step(run, micro, mode, layer_major, swapper, one_backward)
            grads.append([p.grad.detach().cpu().clone() for p in trainable])
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                x, _ = next(data)
                evals.append(run_layers(layers, x, "none").cpu())
        return RunRecord([x.cpu() for x in losses], grads, [p.detach().cpu().clone() for p in trainable], evals)
    finally:
        if swapper is not None:
            swapper.remove()


def train_full(
    mode, accumulate, layer_major, dtype=torch.float32, steps=2, max_norm=None, listener=None, spec=SPEC, **settings
):
    """Full fine-tuning steps: streamed layers trained on the host (accumulation_steps N sequentially, 1 layer-major),
    the others by the trainer's optimizer; ``settings``: more SwapConfig settings (the checkpoint is the swapper's)."""
    layers = full_layers(dtype)
    steps_setting = 1 if layer_major else accumulate
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=steps_setting, **{"prefetch": 1, **settings})
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        if listener is not None:
            swapper.add_listener(listener)
        training = swapper.training
        params = params_of(layers)
        resident = [p for p in params if not training.owns(p)]
        trainer = SPEC.build(resident) if resident else None
        run = runners(layers, mode, swapper.checkpoint_function(checkpoint_for(mode)))
        data = batches(dtype)
        losses, evals = [], []
        for _ in range(steps):
            losses += step(run, [next(data) for _ in range(accumulate)], mode, layer_major, swapper)
            if max_norm is not None:
                training.clip_grad_norm_(params, max_norm)
            if trainer is not None:
                trainer.step()
                trainer.zero_grad()
            training.step()
            with torch.no_grad():
                x, _ = next(data)
                evals.append(run_layers(layers, x, "none").cpu())
        return FullRecord(losses, _weights(layers), evals)
