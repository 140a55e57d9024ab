"""Layer-major gradient accumulation: a step over N micro-batches that copies each streamed layer once a direction.

Sequential accumulation runs the whole model forward and backward once per micro-batch, so every streamed layer is
copied in N times for the forward and N times for the backward. :func:`layer_major_step` runs the same step layer by
layer instead: each layer over all N micro-batches, then the next.

Schedule
    - Forward: for each layer in order, for each micro-batch (last first), the layer runs as the trainer runs it (its
      checkpoint wrapper, if any, included) on that micro-batch's input. The layer's output is cut from the graph at
      the layer boundary: the next layer gets a detached copy of each tensor (a leaf that requires grad exactly when
      the output did), and the output itself is kept, with its graph, for the backward. So each checkpointed layer
      keeps its own inputs per micro-batch (its checkpoint saved them), and a layer that is not checkpointed keeps
      its activations per micro-batch, as N sequential micro-batches would over the step.
    - Loss: after the last layer, ``loss(output, m)`` for each micro-batch (on the cut output), and its backward,
      which leaves the gradient at the top boundary.
    - Backward: for each layer in reverse order, for each micro-batch (first first), ``torch.autograd.backward`` of
      the layer's kept outputs with the gradients its successor's input leaves got: the layer's recompute
      (checkpointed) and backward. The gradients of the layer's own input leaves are then carried to the layer
      below; a micro-batch's outputs and carried gradients are dropped once used.
    - The backward is the forward's calls in exactly reverse order (the forward takes micro-batches last first,
      the backward first first): what keeps its state as a stack over the forward's calls (activation offload's
      restores ahead, recompute offload, kept piece outputs) finds the step it expects, and each param's gradient
      still adds micro-batch 0 first.
    - The engine sees the uses ``(i, forward)`` N times in a row, then ``(i, backward)`` N times in a row: the same
      use sequence as one micro-batch, so the predictor's prefetch plan is unchanged and each streamed layer is
      fetched once per forward and once per backward of the step (uses repeated in a row are one use,
      :meth:`~.swapper.LayerSwapper.use`). The backward calls are one pass for the engine (:meth:`~..streaming.hooks.
      HookAdapter.one_pass`): the features' ``after_backward`` and the listeners' step boundary run once, at the end.
    - Swap units (a layer streamed as its child modules, :mod:`..streaming.units`): the schedule's unit is the
      caller's layer, and a layer's forward runs its units in its own order, so each micro-batch uses them again, one
      after another. :mod:`.row_keeping` keeps a layer's units in their slots over its micro-batches when they fit
      the slots (and lets the use predictor see one micro-batch's uses): each unit is then fetched once a direction
      a step, as whole layers are. A layer with more units than slots keeps as many as leave two slots to the others,
      which are fetched again per micro-batch (said once, with the bytes it adds; the planner counts it and prefers
      plans whose slots hold the units: :mod:`..planning.row_copies`). Under a VRAM budget the builder sizes the
      units for the step's micro-batches (``layer_major_micro_batches``, which the demo's and diffusion-pipe's
      start-up checks set), so that a layer's units fit the slots where a size allows (:mod:`..planning.unit_choice`).
    - Full fine-tuning (host-trained layers): each layer's gradients are summed on the device over the N
      micro-batches and go home once (:mod:`..training.device_sums`; a param without a gradient in a layer's last
      micro-batch sends its sum when the layer's micro-batches end); the host training sees one micro-batch a step,
      so the swapper must be built with ``accumulation_steps = 1``. Data parallel (:mod:`..training.data_parallel`):
      that sum is what is reduced to the layer's owner, once a step. LoRA (params on the device): autograd
      accumulates ``.grad`` as it does over sequential micro-batches.

Arithmetic against N sequential micro-batches (same layers, same inputs, same loss)
    - Bitwise the same: every layer's outputs, every loss, and every param gradient accumulated by autograd
      (``.grad``): each param's micro-batch contributions are added in micro-batch order either way, and within a
      micro-batch the gradient at a boundary tensor is summed from its consumers in the same order (a tensor a
      layer passes through unchanged, e.g. a conditioning vector every block reads, collects its consumers'
      gradients last layer first, as autograd's input buffer does in one graph).
    - Full fine-tuning in fp32: bitwise the same (the device sum is the host's sum, same order, same dtype).
      In a 16-bit compute dtype the fp32 device sum is rounded once to that dtype on its way home (at most half an
      ulp: a relative 2**-8 of each element in bf16), where sequential micro-batches keep an fp32 sum of the
      rounded per-micro-batch gradients on the host.
    - Sums that change order: none of the above. What changes is the order of random draws: a layer that draws
      random numbers (dropout) in its forward draws micro-batch by micro-batch within a layer instead of layer by
      layer within a micro-batch (checkpoints restore the RNG state for their recompute either way): equal in
      distribution, not bitwise.

Invariants
    - A layer's outputs for micro-batch m are computed from exactly the tensors micro-batch m's previous layer
      output (values and ``requires_grad``); non-tensor values pass unchanged.
    - Each micro-batch's graph of a layer is released by its backward (``retain_graph`` off): what a step holds
      between its forward and backward is, per micro-batch, what one sequential micro-batch holds, plus the
      boundary leaves (N x a layer's inputs at the layer being run).
    - With activation offload, at least the last N checkpointed calls stay on the device (:meth:`~..activations.
      activation_offload.ActivationOffloader.keeping`): the last layer's calls for every micro-batch, whose inputs
      the layer after them may read.
    - Everything that runs between the micro-batch's input and its loss is one of ``layers``: code outside them
      would be cut from the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DGLSUserError
from ..training.device_sums import DeviceSums
from ..training.training_feature import TrainingFeature
from .row_keeping import RowKeeping
from .swapper import LayerSwapper


# ---------------------------------------------------------------- the layer boundary
def _flatten(value: Any, out: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by its index in ``out`` (appended); a spec to rebuild it."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Slot(len(out) - 1)
    if isinstance(value, tuple):
        return tuple(_flatten(v, out) for v in value)
    if isinstance(value, list):
        return [_flatten(v, out) for v in value]
    if isinstance(value, dict):
        return {k: _flatten(v, out) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class _Slot:
    index: int


def _rebuild(spec: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(spec, _Slot):
        return tensors[spec.index]
    if isinstance(spec, tuple):
        return tuple(_rebuild(v, tensors) for v in spec)
    if isinstance(spec, list):
        return [_rebuild(v, tensors) for v in spec]
    if isinstance(spec, dict):
        return {k: _rebuild(v, tensors) for k, v in spec.items()}
    return spec


@dataclass
class _Cut:
    """One micro-batch's value at a layer boundary: the producing layer's outputs (with their graph, until its
    backward) and the leaves the next layer reads."""

    outputs: list[torch.Tensor]
    leaves: list[torch.Tensor]
    value: Any  # the next layer's input: ``leaves`` in the output's structure


def _cut(value: Any) -> _Cut:
    outputs: list[torch.Tensor] = []
    spec = _flatten(value, outputs)
    leaves = [t.detach().requires_grad_(True) if t.requires_grad else t for t in outputs]
    return _Cut(outputs, leaves, _rebuild(spec, leaves))


def _carried(cut: _Cut) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The boundary's (output, gradient) pairs for the producing layer's backward: outputs that require grad and
    whose leaf got a gradient from the layer above."""
    pairs = [
        (o, leaf.grad)
        for o, leaf in zip(cut.outputs, cut.leaves, strict=True)
        if o.requires_grad and leaf is not o and leaf.grad is not None
    ]
    return [o for o, _ in pairs], [g for _, g in pairs]


# ---------------------------------------------------------------- the step
class _Run:
    """One step's forward (kept: each layer's outputs per micro-batch, and the losses with their graphs) and the
    backward that consumes it."""

    def __init__(self, layers: Sequence[Callable[[Any], Any]], micro_batches: Sequence[Any], engine: _Engine) -> None:
        self.layers, self.count = layers, len(micro_batches)
        self.sums, self.rows = engine.sums, engine.rows
        self.cuts: list[list[_Cut]] = []  # per layer, per micro-batch: the boundary above the layer
        self.values = list(micro_batches)  # after forward: the last layer's (cut) outputs
        self.losses: list[torch.Tensor] = []

    def forward(self, loss: Callable[[Any, int], torch.Tensor]) -> list[torch.Tensor]:
        for i, layer in enumerate(self.layers):
            row: list[_Cut] = [None] * self.count  # type: ignore[list-item]
            # the backward runs 0..N-1: the step mirrors itself (module doc)
            for position, m in enumerate(reversed(range(self.count))):
                if self.rows is not None:
                    self.rows.micro_batch(i, position)
                row[m] = _cut(layer(self.values[m]))
            self.cuts.append(row)
            self.values = [c.value for c in row]
        if self.rows is not None:
            self.rows.close()
        self.losses = [loss(value, m) for m, value in enumerate(self.values)]
        return self.losses

    def backward(self, seeds: Sequence[torch.Tensor | None]) -> None:
        """The losses' backward (``seeds``: their gradients; ``None``: none), then every layer's, last first."""
        losses, self.losses, self.values = self.losses, [], []
        for result, seed in zip(losses, seeds, strict=True):
            if result.requires_grad and seed is not None:
                result.backward(seed)
        del losses
        for i in reversed(range(len(self.cuts))):
            row = self.cuts[i]
            for m, cut in enumerate(row):
                if self.sums is not None:
                    self.sums.final = m == self.count - 1
                if self.rows is not None:
                    self.rows.micro_batch(i, m, backward=True)
                outputs, grads = _carried(cut)
                row[m] = None  # type: ignore[call-overload]  # the outputs' graph and the leaves' grads go with it
                if outputs:
                    torch.autograd.backward(outputs, grads)
                del outputs, grads, cut
            if self.sums is not None:  # params the layer's last micro-batch gave no gradient send their sums
                self.sums.flush()
        if self.rows is not None:
            self.rows.close()
        self.cuts.clear()


def layer_major_step(
    layers: Sequence[Callable[[Any], Any]],
    micro_batches: Sequence[Any],
    loss: Callable[[Any, int], torch.Tensor],
    swapper: LayerSwapper | None = None,
) -> list[torch.Tensor]:
    """Forward and backward of one step's ``micro_batches``, layer-major (see the module doc); returns each
    micro-batch's loss, detached. Param gradients accumulate as over sequential micro-batches (``.grad``, or for
    host-trained layers the host training's one gradient of the step); the caller's optimizer step follows.

    ``layers``: callables run in order, each given the previous one's output (the first, a micro-batch): the layer
    list as the trainer runs it, checkpoint wrappers included. ``loss(output, m)``: micro-batch ``m``'s loss from the
    last layer's output, scaled as the caller wants (e.g. by ``1 / len(micro_batches)``). ``swapper``: the engine
    that streams ``layers`` (``None``: nothing streams; the schedule alone)."""
    if not micro_batches:
        raise DGLSUserError("a layer-major step needs at least one micro-batch")
    with _engine_step(swapper, layers, len(micro_batches)) as engine:
        run = _Run(layers, micro_batches, engine)
        losses = [result.detach() for result in run.forward(loss)]
        run.backward([torch.ones_like(result) for result in losses])  # what a sequential ``loss.backward()`` seeds
        return losses


@contextlib.contextmanager
def layer_major_losses(
    layers: Sequence[Callable[[Any], Any]],
    micro_batches: Sequence[Any],
    loss: Callable[[Any, int], torch.Tensor],
    swapper: LayerSwapper | None = None,
) -> Iterator[list[torch.Tensor]]:
    """The layer-major forward of ``micro_batches``; yields each micro-batch's loss, whose backward (one call over
    all of them, e.g. of their sum: a trainer's ``backward(loss)``) runs the layer-major backward. The backward must
    run inside the block; the first that reaches any loss runs the whole step's (each loss gets the gradient that
    call gives it, ``None`` if it gives none). Arguments as :func:`layer_major_step`."""
    if not micro_batches:
        raise DGLSUserError("a layer-major step needs at least one micro-batch")
    with _engine_step(swapper, layers, len(micro_batches)) as engine:
        run = _Run(layers, micro_batches, engine)
        losses = run.forward(loss)
        if any(x.requires_grad for x in losses):
            anchor = torch.zeros((), requires_grad=True)  # the node's one input: the losses' graphs stay its own
            losses = list(_Backward.apply(run, anchor, *(x.detach() for x in losses)))
        yield losses


class _Backward(torch.autograd.Function):
    """The losses' values as one autograd node whose backward runs the whole layer-major backward: a trainer's
    single ``backward(loss)`` reaches it once, with every loss's gradient (reentrant, as a reentrant checkpoint's
    backward: the nested calls accumulate the param gradients). Its one input is an anchor, not the losses: the
    losses' own graphs are run by the nested calls only."""

    @staticmethod
    def forward(ctx, run: _Run, anchor: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.run = run
        return tuple(x.clone() for x in values)

    @staticmethod
    def backward(ctx, *seeds: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("a layer-major step's backward ran twice")
        with torch.enable_grad():
            run.backward(seeds)
        return (None,) * (2 + len(seeds))


@dataclass(frozen=True)
class _Engine:
    """The engine's parts a step's schedule drives (``None``: nothing streams, or no host training)."""

    sums: DeviceSums | None = None
    rows: RowKeeping | None = None


@contextlib.contextmanager
def _engine_step(swapper: LayerSwapper | None, layers: Sequence[Any], count: int) -> Iterator[_Engine]:
    """The engine's side of a step of ``count`` micro-batches: one backward pass, the host-trained layers' device sums,
    each layer's swap units kept over its micro-batches (:mod:`.row_keeping`), and with activation offload the last
    layer's ``count`` checkpointed calls kept on the device."""
    if swapper is None:
        yield _Engine()
        return
    swapper.micro_batches = count
    training = swapper.training
    sums = shared = None
    if training is not None:
        if training.accumulation_steps != 1:
            raise DGLSUserError(
                f"a layer-major step sums each layer's gradients over its micro-batches on the device, so the host "
                f"training sees one micro-batch a step: build the swapper with accumulation_steps = 1, not "
                f"{training.accumulation_steps}"
            )
        sums = training.grads.device_sums = DeviceSums()
        feature = swapper.feature(TrainingFeature)
        shared = feature.shared if feature is not None else None
        if shared is not None:  # data parallel: each layer's device sum is reduced to its owner once
            shared.device_sums = sums
    offloader = swapper.activations
    kept = offloader.keeping(count) if offloader is not None else contextlib.nullcontext()
    rows = RowKeeping(swapper, len(layers), count)
    try:
        with swapper.hooks.one_pass(), kept:
            yield _Engine(sums, rows)
        if sums is not None:
            sums.close()
        rows.report()
    finally:
        rows.close()
        if training is not None:
            training.grads.device_sums = None
            if shared is not None:
                shared.device_sums = None
