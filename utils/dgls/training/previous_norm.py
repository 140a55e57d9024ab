"""Clipping by the previous step's norm (``clip_mode = "previous_norm"``, opt-in, inexact): a streamed layer's update
starts as its step's gradients land, scaled by the clip coefficient of the previous step's global gradient norm.

Why
    Exact clipping scales every gradient of a step by ``clamp(max_norm / (norm + 1e-6), max=1)`` of that step's norm,
    known only when the backward ends. :mod:`.speculation` keeps exact updates off the critical path while steps do
    not clip; a run whose norm exceeds the limit at every step (common early in a fine-tune) waits for the norm at
    every step, and the whole optimizer step lands after the backward. This mode never waits (after step 1).

Why this scheme, and not ZeRO-Offload's one-step delayed update
    - Here each step's update uses that step's gradient: its direction is exact; only its scale is the previous
      step's coefficient instead of this step's (the two agree whenever neither step clips, and differ by the ratio
      of consecutive norms when both do). AdamW divides the scale out up to its epsilon and the moments' mixing of
      steps, so a slowly changing norm leaves its update nearly exact; SGD's step size changes by that ratio.
    - A delayed update (ZeRO-Offload's DPU) applies step t's gradient after step t+1's forward and backward: every
      gradient is taken at weights one step stale, a change of direction that no coefficient undoes; it also delays
      the first update and keeps a second copy of the gradients. Neither happens here.
    - The risk this mode takes: a spike (a step whose norm is far above the last) is scaled by the smaller step's
      coefficient, so clipping protects against it one step late. The norm of every step is still computed (and
      returned to the trainer, which logs it: through the engine hooks, DeepSpeed's ``get_global_grad_norm()``),
      and it clips the next step.

Arithmetic (what the tests check against a reference that clips each step with the previous step's coefficient)
    - Every param of the model, streamed or resident, is scaled by the same coefficient in a step: the previous
      step's (``applied``), so the whole model takes one scaled gradient step, as plain clipping does.
    - Step 1 has no previous norm: its updates wait for its norm and use it (exact clipping). So does the first step
      after a resume (the coefficient is not in the checkpoint), and the step after one whose norm is inf or NaN
      (its coefficient, 0 or NaN, would move the next step by momentum and weight decay only, or make it NaN).
      A step the trainer does not clip is refused (:meth:`~.host_training.HostTraining.step`): its host updates
      would be scaled, its resident params not.
    - The norm of a step is bitwise exact clipping's: the same per-param norms (device norms taken before the grads
      left, or the sums' norms the accumulate job took), summed in the trainer's param order. A layer whose update
      started early hands its norms here first (:meth:`PreviousNorm.take`), since the update scales its gradient
      in place; a sum the last micro-batch did not touch gets its norm in a job queued before the update.

What it cannot combine with (refused at start-up by the training policy, one line each): no clipping, data-parallel
full fine-tuning (each process would scale its share before the norm over all of them is known: not built), an
[optimizer] type stepping one instance over every param after the backward; and it needs a full fine-tune of streamed
layers (a LoRA has no host updates). Speculation is off in this mode (its spares are not allocated).

Threads
    - Everything here runs on the training thread; the norms job runs on the job worker and hands its result back
      through :meth:`~.jobs.Jobs.wait`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from .grad_return import GradState, StepGrads, TrainedLayer
from .jobs import Job, Jobs
from .optimizer_kernels import grad_norms

MODE = "previous_norm"


@dataclass(eq=False)
class _Norms:
    """An early layer's norms of this step: device norms by position, or a job that returns its sums' norms."""

    layer: TrainedLayer
    on_device: dict[int, torch.Tensor] = field(default_factory=dict)
    summed: Job | None = None


def _sum_norms(summing: Job | None, sums: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The norms job (after the accumulate job, before the update): the accumulate job's norms of the last
    micro-batch's sums, and those of sums it did not touch, as exact clipping takes them."""
    taken = dict(summing.result or {}) if summing is not None else {}
    for position, acc in sums.items():
        if position not in taken:
            taken[position] = grad_norms([acc])[0]
    return taken


class PreviousNorm:
    """The previous step's clip coefficient and this step's early layers' norms (see the module doc)."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.previous: torch.Tensor | None = None  # the last step's clip coefficient (None before step 1's)
        self._early: dict[int, _Norms] = {}
        self.early_updates = 0  # layer updates started before their step's norm, since start-up
        self.scaled_steps = 0  # steps whose applied coefficient was not their own (both known)
        self.not_finite = 0  # steps whose norm was inf or NaN: the next step waited for its own

    @property
    def ready(self) -> bool:
        """Updates may start before the norm: a previous step gave a coefficient."""
        return self.previous is not None

    def take(self, layer: TrainedLayer) -> StepGrads:
        """The layer's step's last batch closed: its gradients for the update starting now, its norms kept here."""
        g = layer.grads
        kept = _Norms(layer, dict(g.direct_norms))
        if g.state is GradState.SUMMED:
            sums = {tp.position: tp.acc for tp in layer.params if tp.position in g.summed}
            kept.summed = self.jobs.submit(layer.index, "accumulate", partial(_sum_norms, g.summing, sums))
        self._early[layer.index] = kept
        self.early_updates += 1
        return g.take_early()

    def norms(self) -> dict[int, tuple[torch.Tensor, bool]]:
        """The early layers' norms, as :meth:`~.grad_return.GradReturn.host_norms` gives the others'."""
        out: dict[int, tuple[torch.Tensor, bool]] = {}
        for kept in self._early.values():
            summed = self.jobs.wait(kept.summed) if kept.summed is not None else {}
            for tp in kept.layer.params:
                if tp.position in kept.on_device:
                    out[id(tp.param)] = (kept.on_device[tp.position], True)
                elif tp.position in summed:
                    out[id(tp.param)] = (summed[tp.position], False)
        return out

    def applied(self, exact: torch.Tensor | None) -> torch.Tensor | None:
        """The coefficient this step's gradients are scaled by: the previous step's, or on step 1 its own."""
        return self.previous if self.previous is not None else exact

    def step_taken(self, exact: torch.Tensor | None, finite: bool = True) -> None:
        """After the step: its own coefficient is the next step's (None: the trainer did not clip this step). A norm
        that is not ``finite`` (inf: coefficient 0; NaN) gives none: the next step waits for its own, as step 1."""
        if exact is not None:
            self.scaled_steps += self.previous is not None and not bool(self.previous == exact)
            self.previous = exact if finite else None
            self.not_finite += not finite
        self._early.clear()

    def describe(self) -> str:
        """What happened since start-up, in a few words (benchmarks, the end of a run)."""
        return (
            f"{self.early_updates} layer updates started before their step's norm, at the previous step's clip "
            f"coefficient; {self.scaled_steps} steps scaled by a coefficient other than their own; {self.not_finite} "
            f"step{'' if self.not_finite == 1 else 's'} whose norm was not finite (the next waited for its own)"
        )


def clipping_line(layers: int) -> str:
    """The start-up line of what DGLS does with clipping in this mode."""
    head = "DGLS clipping: "
    if not layers:
        return head + "no streamed layer trains on the host"
    return (
        f"{head}clip_mode {MODE} (inexact, opt-in): each streamed layer's update starts as its gradients land, "
        "scaled by the previous step's clip coefficient (every param is; this step's norm is computed, returned to "
        "the trainer and used for the next step); step 1 waits for its own norm. A step whose norm jumps above the "
        "last is clipped one step late"
    )
