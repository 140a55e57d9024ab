"""One backward per micro-batch on a pipeline stage that sends on several tensors: :func:`joined_backward`.

Used by the demo (:mod:`..demo.train`) and by diffusion-pipe's own ``train.py`` (:mod:`.diffusion_pipe`'s
``train_batch`` wrapper) wherever a DeepSpeed pipeline has more than one stage. With one stage there is nothing to
join (its backward is the loss's), and its steps run layer-major where that applies (:mod:`.layer_major_batches`).

Why. A stage that is not the last receives one gradient per floating tensor it sent on (Flux's and the demo's
image and text streams, the timestep vector) and runs its backward from them. DeepSpeed up to 0.18.4 (diffusion-pipe's
pin) runs one ``torch.autograd.backward(out_tensors, grad_tensors)``. From 0.18.5 (its "Fix backward for pipeline
engine", #7787) through 0.19, ``_exec_backward_pass`` runs ``out.backward(gradient=grad, retain_graph=...)`` once PER
tensor. Where the tensors all depend on the whole stage,
each of those backwards runs the whole stage's backward: every checkpointed layer is recomputed once per tensor,
and DGLS copies each streamed layer's weights to the GPU again for every recompute (the demo's first of two stages:
three backwards a micro-batch, and with ``--prefetch 1`` 12.7 MiB streamed over 3 steps where one backward
streams 6.5 MiB; the tiny two-stage Flux bench's stage 0: 1.86 MB a step where one backward copies 1.15 MB). With one
backward the demo's two stages train one process's LoRA bitwise; DeepSpeed 0.19.8's pass differs from it by about 1e-5
of the LoRA's scale after 3 steps (the leaf accumulation order).

What it replaces (an attribute of this one engine object, set on entry and deleted on exit; the class is untouched)
    - ``engine._INSTRUCTION_MAP``: the class's map with ``BackwardPass`` bound to a pass that joins the stage's
      outputs ``o_i`` into one float32 scalar (:class:`JoinedOutputs`: its value 0, its backward hands each ``o_i``
      the received ``g_i`` itself, no copy and no arithmetic), puts it in place of the outputs
      (``pipe_buffers["outputs"][buffer_id]``) with a gradient of 1 (``engine.grad_layer``, restored afterwards:
      DeepSpeed receives the next micro-batch's gradients into those buffers), and runs DeepSpeed's own pass, whose
      single-tensor branch then runs ONE backward. The gradient that reaches each ``o_i`` is ``g_i`` exactly;
      parameter gradients are the sum over the tensors as 0.18.4's single backward sums them (inside the graph, not
      one leaf accumulation per backward as the per-tensor pass does: equal up to the order of summation).

What stays DeepSpeed's: the whole pass around the backward (its assertion on the optimizer, wall-clock timers,
``_running_engine_backward``, the bf16 optimizer's ``clear_lp_grads`` before and ``update_hp_grads`` after, once
per micro-batch as with one tensor, the outputs freed), the last stage's backward of the loss (DeepSpeed's pass,
untouched: fp16 loss scaling happens there, and the gradients every earlier stage receives carry that scale,
which the joined scalar passes on unchanged), the sends and receives, reduction and the optimizer step.

Where DeepSpeed's pass runs unchanged (the replacement hands the micro-batch to it as it came)
    - the engine is not installed at all: one stage, the last stage (its backward is the loss's), a partitioned
      pipeline (``is_pipe_partitioned`` or ``is_grad_partitioned``: the outputs and gradients there are partition
      metadata and parts, rebuilt by DeepSpeed's pass), or an installed DeepSpeed whose pass already runs one
      backward (:func:`backward_per_tensor`: up to 0.18.4);
    - a micro-batch whose outputs are not a tuple, or have fewer than two floating tensors (one backward already),
      or whose floating outputs and received gradients differ in number (DeepSpeed's assertion says so), or of
      which no floating output requires a gradient (DeepSpeed's own error).

Hazards and invariants
    - A floating output that does not require a gradient is left out of the joined sum: nothing before it trains
      through it. DeepSpeed's pass (either form) would stop on it with autograd's error; the gradient sent for it
      is ignored either way.
    - The joined scalar costs no device memory beyond itself: :class:`JoinedOutputs` keeps references to the
      received buffers (not copies) until its backward, which runs inside the same pass, before the next receive.
    - Only one of this module and :mod:`.layer_major_batches` replaces an engine's map at a time (one stage or
      several): entering with the map already replaced is refused, so neither could drop the other's entry.
    - DeepSpeed's pass is looked up in the class's map when the block is entered: a version that renames
      ``BackwardPass`` or ``_exec_backward_pass`` fails there, not mid-step.
    - Detecting the per-tensor pass (:func:`backward_per_tensor`) reads the installed pass's source for
      ``retain_graph``, the argument that only a backward-per-tensor loop needs; where the source can't be read the
      pass is joined anyway (one backward is right for either version).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # deepspeed is imported when a run uses it
    from deepspeed.runtime.pipe.engine import PipelineEngine


@functools.cache
def backward_per_tensor() -> bool:
    """Whether the installed DeepSpeed's ``PipelineEngine._exec_backward_pass`` runs one backward per tensor a stage
    sends on (0.18.5 to 0.19: ``out.backward(gradient=grad, retain_graph=...)`` in a loop) rather than one for them
    all (up to 0.18.4: ``torch.autograd.backward(out_tensors, grad_tensors)``). Unreadable source: True (see the
    module doc)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    try:
        source = inspect.getsource(PipelineEngine._exec_backward_pass)
    except (OSError, TypeError):
        return True
    return "retain_graph" in source


class JoinedOutputs(torch.autograd.Function):
    """One float32 scalar standing for a stage's outputs: its value 0 (nothing reads it), its backward hands each
    output its received gradient as it came (DeepSpeed's receive buffer: no copy, no cast, no product)."""

    @staticmethod
    def forward(ctx, received: tuple, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.received = received
        return outputs[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _one: torch.Tensor):
        received, ctx.received = ctx.received, None
        return (None, *received)


def applies(engine: PipelineEngine) -> bool:
    """Whether :func:`joined_backward` replaces this engine's backward pass (see the module doc)."""
    return (
        engine.num_stages > 1
        and not engine.is_last_stage()
        and not engine.is_pipe_partitioned
        and not engine.is_grad_partitioned
        and backward_per_tensor()
    )


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


class SaidOnce:
    """A stage's log for a block entered every step: :attr:`log` is the log until the joined backward said its line
    through it, then ``None``, so the line is said once a run rather than once a step (the trainers, the bench)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self._log, self.said = log, False

    def _say(self, line: str) -> None:
        self.said = True
        self._log(line)

    @property
    def log(self) -> Callable[[str], None] | None:
        return None if self.said else self._say


@contextlib.contextmanager
def joined_backward(engine: PipelineEngine, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Inside the block, this engine's stage runs one backward per micro-batch for all the tensors it sent on (see
    the module doc); nothing changes where that does not apply (:func:`applies`). ``log``: the stage's log, told
    once per block, at its first joined backward, how many tensors the one backward stands for (a trainer that
    enters the block every step passes :attr:`SaidOnce.log`: told once a run)."""
    if not applies(engine):
        yield
        return
    from deepspeed.runtime.pipe import schedule

    if "_INSTRUCTION_MAP" in vars(engine):  # layer_major_batches, or a block already open (module doc)
        raise AssertionError("the engine's instruction map is replaced already: one replacement at a time")
    table = type(engine)._INSTRUCTION_MAP
    deepspeeds = table[schedule.BackwardPass]
    told = False

    def backward_once(self, buffer_id):
        nonlocal told
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if not isinstance(outputs, tuple):
            return deepspeeds(self, buffer_id)
        received = self.grad_layer
        floats = [t for t in outputs if t.is_floating_point()]
        if len(floats) < 2 or received is None or len(floats) != len(received):
            return deepspeeds(self, buffer_id)
        pairs = [(o, g) for o, g in zip(floats, received, strict=True) if o.requires_grad]
        if not pairs:
            return deepspeeds(self, buffer_id)
        if log is not None and not told:
            told = True
            log(
                f"DGLS: this stage's backward runs once for the {len(floats)} tensors it sends on (DeepSpeed "
                f"{_deepspeed_version()}'s pass would run one backward per tensor, each recomputing the stage and "
                "copying its layers again)"
            )
        outs, grads = zip(*pairs, strict=True)
        joined = JoinedOutputs.apply(tuple(grads), *outs)
        self.pipe_buffers["outputs"][buffer_id] = joined
        self.grad_layer = torch.ones_like(joined)
        try:
            return deepspeeds(self, buffer_id)
        finally:
            self.grad_layer = received  # DeepSpeed receives the next micro-batch's gradients into these buffers

    engine._INSTRUCTION_MAP = {**table, schedule.BackwardPass: backward_once}
    try:
        yield
    finally:
        del engine._INSTRUCTION_MAP
