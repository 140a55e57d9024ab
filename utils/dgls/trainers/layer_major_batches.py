"""Layer-major batches in DeepSpeed's pipeline engine: ``train_batch`` runs a step's micro-batches layer-major.

Used by the demo (:mod:`..demo.train`) and by diffusion-pipe's own ``train.py`` (:mod:`.diffusion_pipe`'s
``train_batch`` wrapper), where ``--layer_major`` (the default) applies: one pipeline stage, several micro-batches.

DeepSpeed's ``TrainSchedule`` runs a one-stage step as N times (load, forward, backward), then reduce and step.
While :func:`layer_major_batches` is active, the engine runs N loads, one :class:`LayerMajorPass`, then the same
reduce and step: the pass runs the stage's layers layer-major over the N micro-batches
(:func:`~..engine.layer_major.layer_major_losses`), so each streamed layer is fetched once a direction a step.

What it replaces (attributes of this one engine object, set on entry and deleted on exit; the class is untouched)
    - ``engine._exec_schedule``: the class's, given :class:`LayerMajorSchedule` in place of the ``TrainSchedule``
      that ``train_batch`` makes (the loads, the pass, then ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``,
      as ``TrainSchedule`` ends a one-stage step); other schedules (``eval_batch``'s) pass through. Not
      ``engine._train_schedule``: DeepSpeed 0.18 has no such hook (``train_batch`` builds ``TrainSchedule``
      itself), and replacing it there would leave the step one micro-batch after another, silently.
    - ``engine._INSTRUCTION_MAP``: the class's map and :class:`LayerMajorPass`.

What stays DeepSpeed's, as in a sequential step
    - The loads (``_exec_load_micro_batch``: clones, ``requires_grad`` for reentrant checkpointing), the inputs'
      clone that ``_exec_forward_pass`` makes, the module's loss function, the losses it records
      (``fwd_outputs``, ``total_loss``: the same values, added in micro-batch order) and averages.
    - The backward: one ``DeepSpeedEngine.backward`` of the losses' sum (it scales by the accumulation steps, as it
      scales each loss in a sequential step, so each micro-batch's loss gets the same gradient), its prologue and
      epilogue once a step; gradient reduction, clipping, the optimizer step and the LR schedule.
    - The layers as ``PipelineModule.forward`` runs them: each under ``activation_checkpoint_func`` when
      checkpointable (interval 1), or plainly.

Refused before the first step (one line each): more than one pipeline stage (a stage's layer-major pass would need
DeepSpeed's sends and receives per layer), a checkpoint interval above 1 (a checkpointed run of several layers
would fetch each of them once per micro-batch), ``seed_layers`` (per-layer seeds keyed to the micro-batch order), fp16
(its loss scaling runs per backward), and bf16 without ``immediate_grad_update`` (its fp32 sums would then add one
bf16 sum of the N micro-batches instead of each micro-batch's gradient). What the TOML and the flags decide (the
stages, the DeepSpeed version) is refused earlier, by dgls_train.py's start-up checks (``program/validate.py``), and
only ever reaches :func:`refusal` from the library; the rest is the engine that train.py's own code builds, which
those checks cannot read: diffusion-pipe's train.py builds none of them (its DeepSpeed config has no fp16 or bf16,
its checkpoint interval is 1, no ``seed_layers``), and the demo builds its engine to fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..engine.layer_major import layer_major_losses
from ..engine.swapper import LayerSwapper
from ..errors import DGLSUserError

if TYPE_CHECKING:  # deepspeed is imported when a run uses it
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule


def _schedule_classes():
    """DeepSpeed's schedule classes, and this module's on top of them (deepspeed is imported when a run uses it)."""
    from deepspeed.runtime.pipe import schedule

    class LayerMajorPass(schedule.PipeInstruction):
        """Forward and backward of the step's ``micro_batches`` (buffers 0..N-1), layer-major."""

    class LayerMajorSchedule(schedule.TrainSchedule):
        def steps(self):
            for buffer_id in range(self.micro_batches):
                yield [schedule.LoadMicroBatch(buffer_id=buffer_id)]
            yield [LayerMajorPass(micro_batches=self.micro_batches)]
            yield [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]

        def num_pipe_buffers(self) -> int:
            return max(2, self.micro_batches)

    return LayerMajorPass, LayerMajorSchedule


def refusal(engine: PipelineEngine) -> str | None:
    """Why this engine's steps can't run layer-major (None: they can)."""
    module = engine.module
    if engine.num_stages != 1:
        return (
            f"layer-major accumulation runs one pipeline stage, and this run has {engine.num_stages}: set "
            "pipeline_stages = 1, or accumulate micro-batches one after another (layer_major = false)"
        )
    if module.activation_checkpoint_interval > 1:
        return (
            f"layer-major accumulation checkpoints one layer at a time, and the checkpoint interval is "
            f"{module.activation_checkpoint_interval}: use an interval of 1 (or 0), or layer_major = false"
        )
    if module.seed_layers:
        return "layer-major accumulation can't keep PipelineModule's seed_layers order: set layer_major = false"
    if engine.fp16_enabled():
        return "layer-major accumulation does not run with fp16 loss scaling: use bf16, or layer_major = false"
    if engine.bfloat16_enabled() and not engine._config.bfloat16_config.immediate_grad_update:
        return (
            "layer-major accumulation with DeepSpeed's bf16 optimizer needs bf16.immediate_grad_update = true "
            "(each micro-batch's gradient then goes into the fp32 sum on its own): set it, or layer_major = false"
        )
    return None


def stage_layers(module: PipelineModule) -> list[Callable[[Any], Any]]:
    """The stage's layers as ``PipelineModule.forward`` runs them with a checkpoint interval of 0 or 1, one callable
    each (a tuple is passed unpacked to the checkpoint function, and a 1-tuple unwrapped for the layer)."""
    funcs = list(module.forward_funcs)
    interval = module.activation_checkpoint_interval
    checkpointed = list(module.is_checkpointable_results) if interval else [False] * len(funcs)

    def plain(layer, x):
        return layer(x)

    def under_checkpoint(layer, x):
        if not isinstance(x, tuple):
            x = (x,)

        def run(*inputs):
            return layer(inputs[0] if len(inputs) == 1 else inputs)

        return module.activation_checkpoint_func(run, *x)

    return [
        (lambda x, layer=layer: under_checkpoint(layer, x)) if ckpt else (lambda x, layer=layer: plain(layer, x))
        for layer, ckpt in zip(funcs, checkpointed, strict=True)
    ]


def _clone_inputs(inputs):
    """What ``_exec_forward_pass`` hands the module: a clone of the loaded buffer."""
    return tuple(t.clone() for t in inputs) if isinstance(inputs, tuple) else inputs.clone()


def _exec_layer_major(engine: PipelineEngine, micro_batches: int, swapper: LayerSwapper | None) -> None:
    """The :class:`LayerMajorPass` instruction (see the module doc)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    module = engine.module
    inputs = [_clone_inputs(engine.pipe_buffers["inputs"][b]) for b in range(micro_batches)]
    labels = [engine.pipe_buffers["labels"][b] for b in range(micro_batches)]
    engine.tput_timer.start()
    with layer_major_losses(
        stage_layers(module), inputs, lambda out, m: module.loss_fn(out, labels[m]), swapper
    ) as losses:
        for loss in losses:  # as _exec_forward_pass records each micro-batch's loss
            engine.fwd_outputs.append(loss.detach())
            if engine.total_loss is None:
                engine.total_loss = torch.zeros_like(loss)
            engine.total_loss += loss.detach()
        engine.loss = losses[-1]
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        DeepSpeedEngine.backward(engine, total)  # scaled by the accumulation steps, as each sequential loss is


@contextlib.contextmanager
def layer_major_batches(engine: PipelineEngine, swapper: LayerSwapper | None) -> Iterator[None]:
    """``engine.train_batch`` runs its micro-batches layer-major inside the block (see the module doc); refused in
    one line where it can't (:func:`refusal`)."""
    why = refusal(engine)
    if why is not None:
        raise DGLSUserError(why)
    LayerMajorPass, LayerMajorSchedule = _schedule_classes()

    from deepspeed.runtime.pipe import schedule

    exec_schedule = type(engine)._exec_schedule

    def layer_major_schedule(pipe_schedule) -> None:
        if type(pipe_schedule) is schedule.TrainSchedule:  # train_batch's: its steps, layer-major
            pipe_schedule = LayerMajorSchedule(
                micro_batches=pipe_schedule.micro_batches, stages=pipe_schedule.stages, stage_id=pipe_schedule.stage_id
            )
        exec_schedule(engine, pipe_schedule)

    def exec_pass(self, micro_batches: int) -> None:
        _exec_layer_major(self, micro_batches, swapper)

    if "_INSTRUCTION_MAP" in vars(engine):  # joined_backward, or a block already open: one replacement at a time
        raise AssertionError("the engine's instruction map is replaced already: one replacement at a time")
    engine._exec_schedule = layer_major_schedule
    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, LayerMajorPass: exec_pass}
    try:
        yield
    finally:
        del engine._exec_schedule
        del engine._INSTRUCTION_MAP
