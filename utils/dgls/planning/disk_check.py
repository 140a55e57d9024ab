"""The disk plan checked on a measured step: its forecast again, with the step's compute measured instead of
estimated.

Why: which layers spill is chosen at the build, before any step ran (:mod:`..engine.disk_planning`). Without a VRAM
budget nothing has measured the compute by then, so the start-up line estimates it from param counts, as long as the
step's copies. That is the break-even of streaming, and far off where the activations are large: for Wan2.1-14B at
81 frames it estimated about 1 s of compute for a step of 21 s, and said the reads would add 9 s to a step they
added 3.4 s to. (With a VRAM budget the planner's probe measures the compute and its settled plan says the disk's
line with it: this check is for the runs without one.)

Mechanics: a :class:`~..watching.listener.Listener` and a :class:`~..streaming.feature.Feature` of the engine.
From the first use with grad enabled after the first pass ended (step 2, or a sequential step's second micro-batch;
not an eval forward between them, whose uses are no part of a training pass: the rule the VRAM planner's fixed probe
keeps) to the next pass end, it records each use's start and its waits (the VRAM planner's
:class:`~.autoplan.UseRecorder`), so each use's compute is its time less the compute stream's stalls for copies and
reads (:class:`~..memory.copier.Wait`). At the next ``between_passes`` it waits for the device once, replays the disk
plan's model (:func:`~.disk_plan.forecast`) over those uses with the build's layers on disk, and says one line,
``DGLS disk plan, measured: ... (measured on pass 2) ...`` (a pass: one micro-batch's forward and backward). The
placement stays: the spilled layers' bytes are in the disk file, and moving them is a re-placement this check does
not make.

Invariants
    - It records one training pass and speaks once (:attr:`uses` set); after that its hooks do nothing.
    - It never changes what runs: it reads timestamps, and waits for the device only when it speaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..memory.copier import Wait
from ..streaming.feature import Engine, Feature
from ..streaming.schedule import Phase
from ..watching.listener import Listener
from ..watching.stats import timestamp
from .autoplan import UseRecorder
from .disk_plan import DiskCosts, forecast
from .planner import UseTiming


class DiskPlanCheck(Listener, Feature):
    """The disk plan's line again after one measured pass (the module doc)."""

    def __init__(
        self,
        costs: DiskCosts,
        streamed: Sequence[int],
        spilled: Sequence[int],
        device: torch.device,
        log: Callable[[str], None],
    ) -> None:
        self.costs = costs  # the build's: the bandwidths, bytes, prefetch and ring it chose with
        self.streamed = tuple(streamed)
        self.spilled = tuple(spilled)
        self.device = device
        self.log = log
        self._recorder: UseRecorder | None = None  # while recording, and until it spoke
        self._passes = 0  # passes ended
        self._recorded: int | None = None  # the pass the recorder stopped at: the next step boundary speaks
        self.uses: tuple[UseTiming, ...] | None = None  # what it measured, once it spoke

    def install(self, engine: Engine) -> None:
        engine.add_listener(self)

    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        if self.uses is None and self._recorder is None and self._passes and torch.is_grad_enabled():
            self._recorder = UseRecorder(self.device)  # a training pass's first use after the first pass
        if self._recorder is not None:
            self._recorder.use_started(layer, phase)

    def waited(self, wait: Wait) -> None:
        if self._recorder is not None:
            self._recorder.waited(wait.before, wait.after)

    def pass_ended(self) -> None:
        self._passes += 1
        if self._recorder is not None and self._recorded is None:
            self._recorder.stop(timestamp(self.device))
            self._recorded = self._passes

    def between_passes(self) -> None:
        if self._recorded is None or self.uses is not None:
            return
        self.uses = self._recorder.finish()
        self._recorder = None
        if self.uses:
            self.log(self.line(self.uses, self._recorded))

    def line(self, uses: Sequence[UseTiming], on_pass: int) -> str:
        """The forecast's line over ``uses`` (pass ``on_pass``'s, compute measured)."""
        costs = dataclasses.replace(self.costs, uses=tuple(uses), measured=True, measured_on=f"on pass {on_pass}")
        return forecast(costs, self.streamed, self.spilled).line()
