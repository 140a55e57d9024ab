"""Whole-step host optimizer: one instance of the type's class over every trained param of a pipeline stage, stepped
once after the backward.

Why
    Prodigy and D-Adaptation estimate their step size d from sums over every param of the instance, so one instance
    per streamed layer would give each layer a d of its own (:mod:`.optimizer_types`). train.py builds one optimizer
    per pipeline stage (DeepSpeed builds each stage's over that stage's params), over every trainable param of it;
    DGLS builds one too, over the same params in the same order, in diffusion-pipe's param groups
    (:meth:`~.host_optimizer.HostOptimizerSpec.groups`):

    - a streamed layer's param is its fp32 host master (the object a per-layer update steps);
    - a resident param (the trainer's, on the device) is a host copy in the param's dtype: before the step the copy
      is refreshed from the param and given its gradient, which is taken off the param, so the trainer's own
      optimizer (train.py's instance of the same class) finds no gradient and changes nothing; after the step the
      copy is written back.

    The trainer hands the stage's trainable params over (:meth:`WholeStep.adopt`, in train.py's order: the stage's
    params that require grad) before its first step or checkpoint; a trainer that never does keeps its resident
    params to its own optimizer, and the instance holds the streamed layers' masters only, in layer order.

When
    Each layer's update is collected where an updater would queue it (during the backward without clipping, at the
    step with it); :meth:`WholeStep.end_step` submits one job: every layer's fp32 gradient sums (scaled by the clip
    coefficient; a whole step always sums, so no update reads landings) handed to the masters, one step of the
    instance at the step's lr, and the packed copies of the updated params rewritten. With resident copies the
    training thread waits for the job and writes them back. The cost, said at start-up: no update overlaps the
    backward, and resident params cross to the host and back every step.

Invariants
    - One instance per host training, built once: by :meth:`WholeStep.adopt`, or over the masters alone at the first
      step, checkpoint or load; an :meth:`~WholeStep.adopt` after that, or with other params, is an error, never a
      rebuild (the state would be lost). The one rebuild: the VRAM planner's plan, applied before any step, makes
      streamed layers resident (:meth:`WholeStep.released`).
    - Every layer collected in a step is in that step's job, and its ``layer.update`` is that job (a fetch of the
      layer waits for the whole step).
    - The host copies are read and written on the training thread only, before the job is submitted and after it
      was waited for; the job reads their gradients and steps them.
    - A checkpoint holds the instance's state dict with the layers and resident params it was built over;
      :meth:`WholeStep.state_problem` refuses another placement or optimizer in one line.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial

import torch

from ..errors import DGLSUserError
from ..memory.host_store import ram_short
from ..memory.layout import human_bytes
from .grad_return import StepGrads, TrainedLayer
from .host_optimizer import HostOptimizerSpec
from .jobs import Jobs
from .updaters import UpdateDone, Updater

STATE_KEY = "whole_step"  # a whole step's checkpoint: {STATE_KEY: state dict, "layers": [...], "resident": n}
Pending = tuple[TrainedLayer, StepGrads, torch.Tensor | None, float | None]  # a layer's update: grads, coef, lr


class WholeStep(Updater):
    """One instance of the type's class over every trained param, stepped after the backward (see the module doc)."""

    def __init__(self, jobs: Jobs, spec: HostOptimizerSpec, layers: dict[int, TrainedLayer]) -> None:
        super().__init__(jobs)
        self.spec = spec
        self.layers = layers
        self._optimizer: torch.optim.Optimizer | None = None
        self._adopted: list[torch.Tensor] | None = None  # the params adopt was given, in order
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (resident param, its host copy)
        self._pending: list[Pending] = []

    # ---------------------------------------------------------------- the instance
    def adopt(self, params: Iterable[torch.Tensor]) -> None:
        """The stage's trainable params in the trainer's order (those that do not require grad are left out, as
        train.py leaves them out): the instance is built over their masters and host copies. Called again with the
        same params it does nothing."""
        params = [p for p in params if p.requires_grad]
        ids = [id(p) for p in params]
        if self._optimizer is not None:
            if self._adopted is None or ids != [id(p) for p in self._adopted]:
                raise AssertionError(
                    "the whole-step optimizer was built over other params (or before the trainer handed them over)"
                )
            return
        masters = {id(tp.param): tp.master for layer in self.layers.values() for tp in layer.params}
        if not set(masters) <= set(ids):
            raise AssertionError("the trainer's params leave out host-trained params")
        resident = [p for p in params if id(p) not in masters]
        self._check_ram(resident)
        with torch.no_grad():
            self._copies = [(p, p.detach().to("cpu", copy=True)) for p in resident]
        copy_of = {id(p): copy for p, copy in self._copies}
        self._optimizer = self.spec.build([masters.get(id(p), copy_of.get(id(p))) for p in params])
        self._adopted = params

    def released(self) -> None:
        """The VRAM planner made streamed layers resident before any update (:meth:`~.host_training.HostTraining.
        release`): an instance built before holds their masters and no host copies of their params, so it is built
        again over the params it was handed (none stepped it: no state is lost)."""
        if self._optimizer is None:
            return
        if self._optimizer.state:
            raise AssertionError("the whole-step optimizer stepped before the VRAM planner's plan was applied")
        params, self._optimizer, self._adopted, self._copies = self._adopted, None, None, []
        if params is not None:
            self.adopt(params)

    def _check_ram(self, resident: list[torch.Tensor]) -> None:
        """One line when the host copies of the resident params and their optimizer state do not fit beside the
        host's reserve (the start-up check counted the streamed layers only)."""
        rates = {dtype: self.spec.state_rate(dtype) for dtype in {p.dtype for p in resident}}  # the copies' dtypes
        need = sum(p.numel() * p.element_size() + rates[p.dtype].bytes(tuple(p.shape)) for p in resident)
        if (short := ram_short(need)) is not None:
            available, reserve = short
            raise DGLSUserError(
                f"[optimizer] type = {self.spec.type!r} steps one optimizer over every param on the host, so the "
                f"resident params' host copies and optimizer state need {human_bytes(need)} of host RAM, and "
                f"{human_bytes(available)} is free, of which {human_bytes(reserve)} stays for the rest of the "
                "host: stream more layers (blocks_to_swap), free RAM, or use a per-param type such as 'adamw'"
            )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The instance; built over the streamed layers' masters alone if the trainer handed no params over."""
        if self._optimizer is None:
            self._optimizer = self.spec.build([tp.master for layer in self.layers.values() for tp in layer.params])
        return self._optimizer

    @property
    def resident(self) -> int:
        """Resident params the instance steps through host copies."""
        return len(self._copies)

    # ---------------------------------------------------------------- a step
    def take_resident_grads(self) -> None:
        """Before the trainer's optimizer steps (after clipping scaled the device grads): each resident param's
        gradient goes to its host copy, refreshed from the param, and leaves the param. With no streamed layer (none
        on this stage, or the plan kept every one) no job runs (:meth:`end_step`), so the gradients stay for the
        trainer's own instance, which then is train.py's: one over every param of the stage."""
        if not self.layers:
            return
        with torch.no_grad():
            for param, copy in self._copies:
                grad, param.grad = param.grad, None
                if grad is None:
                    copy.grad = None
                    continue
                copy.copy_(param)
                copy.grad = grad.detach().to("cpu", copy.dtype)

    def submit(self, layer, grads, coef, lr, speculated=None, undo=None) -> None:
        if speculated is not None or undo is not None:
            raise AssertionError("a whole step never speculates (it has no spares: .speculation.undo_problem)")
        if grads.direct is not None:
            raise AssertionError("a whole step reads the gradient sums, never the landings")
        self._pending.append((layer, grads, coef, lr))

    def end_step(self) -> None:
        """Every layer of the step was collected: submit the one job; write resident copies back after it."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        optimizer = self.optimizer
        written = [(param, copy) for param, copy in self._copies if copy.grad is not None]
        job = self.jobs.submit(pending[0][0].index, "update", partial(self._run, optimizer, pending))
        for layer, *_ in pending:
            layer.update = job
        if written:
            self.jobs.wait(job)
            with torch.no_grad():
                for param, copy in written:
                    param.copy_(copy)
                    copy.grad = None

    @staticmethod
    def _run(optimizer: torch.optim.Optimizer, pending: list[Pending]) -> UpdateDone:
        """The job: the masters get their layers' sums (scaled), the instance steps once (the host copies' gradients
        were given on the training thread, which clears them after writing the copies back), packed copies follow."""
        began = time.perf_counter()
        with torch.no_grad():
            for layer, grads, coef, _ in pending:
                for tp in layer.params:
                    grad = tp.acc if tp.position in grads.summed else None
                    if grad is not None and coef is not None:
                        grad.mul_(coef)
                    tp.master.grad = grad
            lr = pending[-1][3]  # the step's (early updates were given the same, read before the backward)
            if lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            optimizer.step()
            for layer, *_ in pending:
                for tp in layer.params:
                    if tp.master.grad is not None:
                        tp.master.grad = None
                        if tp.packed is not None:
                            tp.packed.copy_(tp.master)
        numel = sum(layer.numel for layer, *_ in pending)
        return UpdateDone(None, "host", numel, time.perf_counter() - began)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {STATE_KEY: self.optimizer.state_dict(), "layers": sorted(self.layers), "resident": self.resident}

    def state_problem(self, state: object) -> str | None:
        """Why ``state`` (a :meth:`state_dict` read back) cannot be loaded into this instance, or None: it must be a
        whole step's, over the same layers and resident params, with each param's state of that param's shape."""
        if not isinstance(state, dict) or not isinstance(state.get(STATE_KEY), dict):
            return (
                f"holds per-layer optimizer states, and [optimizer] type {self.spec.type!r} steps one optimizer over "
                "every param here: resume with the [optimizer] type it was saved with, or pass --reset_optimizer"
            )
        if state.get("layers") != sorted(self.layers) or state.get("resident") != self.resident:
            return (
                f"holds the optimizer state of streamed layers {state.get('layers')} and {state.get('resident')} "
                f"resident params of this pipeline stage, and this run trains layers {sorted(self.layers)} on the "
                f"host and {self.resident} resident params: resume with the placement it was saved with (the same "
                "--blocks_to_swap or --gpu_layers, and pipeline_stages)"
            )
        saved = state[STATE_KEY]
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
            return "holds no optimizer state"
        built = self.optimizer.param_groups
        if any(not set(built[0]) <= set(g) for g in groups):
            return f"holds another optimizer's state, and [optimizer] type is {self.spec.type!r} here"
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in built]:
            count = sum(len(g["params"]) for g in groups)
            return f"holds {count} params, and this stage trains {sum(len(g['params']) for g in built)}: another model?"
        per_param = saved.get("state") if isinstance(saved.get("state"), dict) else {}
        params = [p for g in built for p in g["params"]]
        for i, param in zip([i for g in groups for i in g["params"]], params):
            for key, value in per_param.get(i, {}).items():
                if isinstance(value, torch.Tensor) and value.ndim and value.shape != param.shape:
                    return (
                        f"holds {key} of shape {list(value.shape)} for a param of shape {list(param.shape)}: another "
                        "model?"
                    )
        return None

    def load_state_dict(self, state: dict, keep_hyper_parameters: bool = False) -> None:
        """Load a checked :meth:`state_dict`. ``keep_hyper_parameters`` (train.py's ``--reset_optimizer_params``): the
        param groups stay as built, every value of them (Prodigy's d too), as train.py puts its built groups back."""
        built = [dict(g) for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state[STATE_KEY])
        if keep_hyper_parameters:
            for group, kept in zip(self.optimizer.param_groups, built):
                params = group["params"]
                group.clear()
                group.update(kept, params=params)
