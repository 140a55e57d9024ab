"""Automatic placement from a VRAM budget: probe, plan, apply, check, re-plan once.

Step 1 runs with every layer streamed (the smallest footprint) and warms up; step 2 is
the probe: each layer use's compute time, the copy bandwidth, the activation peak. The
planner then picks the placement and prefetch depth; step 3 warms the new placement up
and step 4 checks it: if its peak went over the budget or its step time is far from the
prediction, DGLS re-plans once from what step 4 measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .errors import DGLSUserError
from .planner import GiB, Plan, StepProfile, UseTiming, minimum_bytes, plan_for_budget, predict_peak, simulate
from .stats import StepStats

AUTO_MARGIN = 1 * GiB  # kept free under "auto": CUDA context growth, other processes, fragmentation
CPU_BYTES_PER_MS = 10e6  # no copies to time on CPU: a nominal 10 GB/s
TIME_TOLERANCE = 0.15  # a measured step this far from the prediction triggers the one re-plan


class UseRecorder:
    """Marks the start of every layer use (and the waits inside it) on the compute stream."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._marks: list[tuple[int, str, object]] = []
        self._waits: list[list[tuple[object, object]]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000.0

    def use_started(self, layer: int, phase: str) -> None:
        self._marks.append((layer, phase, self._now()))
        self._waits.append([])

    def waited(self, before, after) -> None:
        if self._waits and self.cuda:
            self._waits[-1].append((before, after))

    def finish(self) -> tuple[UseTiming, ...]:
        """Each use's compute time: until the next use began (or now), less its waits."""
        end = self._now()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        stamps = [m[2] for m in self._marks] + [end]
        uses = []
        for k, (layer, phase, _) in enumerate(self._marks):
            waited = sum(self._ms(a, b) for a, b in self._waits[k])
            uses.append(UseTiming(layer, phase, max(0.0, self._ms(stamps[k], stamps[k + 1]) - waited)))
        return tuple(uses)


def resolve_budget(spec: float | str, device: torch.device) -> int:
    """Bytes from a ``--vram_budget`` value: a number of GiB, or ``auto``."""
    if spec == "auto":
        if device.type != "cuda":
            raise DGLSUserError("--vram_budget auto needs a CUDA device: give a number of GiB, or drop the flag on CPU")
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - AUTO_MARGIN
    return int(float(spec) * GiB)


@dataclass
class AutoPlanner:
    """Drives probe -> plan -> check -> (one) re-plan over the first steps of a run."""

    budget: int
    device: torch.device
    log: object = print
    plan_only: bool = False  # --plan: stop after planning
    plan: Plan | None = None
    profile: StepProfile | None = None  # the latest probe
    done: bool = False
    replanned: bool = False
    _step: int = 0
    _recorder: UseRecorder | None = None
    _step_started: float = 0.0
    _alloc_at_start: int = 0
    _offset_ms: float = 0.0

    @property
    def recorder(self) -> UseRecorder | None:
        return self._recorder

    def check_static_minimum(self, sizes) -> None:
        """Before step 1: the budget must hold the essentials and two slots."""
        need = minimum_bytes(sizes, None)
        if need > self.budget:
            raise DGLSUserError(
                f"VRAM budget {self.budget / GiB:.2f} GiB is below the minimum {need / GiB:.2f} GiB even before "
                "activations (resident essentials + 2 x the largest layer): raise --vram_budget"
            )

    def step_done(self, swapper, stats: StepStats) -> None:
        """Called at the end of every step (``step_stats``); acts during the first four."""
        if self.done:
            return
        self._step += 1
        if self._step in (1, 3):
            self._start_recording()
        elif self._step == 2:
            profile = self._finish_recording(swapper, stats)
            current = simulate(swapper.placement.sizes, profile, swapper.placement.streamed, swapper.config.prefetch)
            self._offset_ms = max(0.0, self._wall_ms - current)
            self._apply(swapper, plan_for_budget(swapper.placement.sizes, profile, self.budget))
        elif self._step == 4:
            profile = self._finish_recording(swapper, stats)
            self._check(swapper, profile)

    # ---------------------------------------------------------------- steps
    def _start_recording(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._alloc_at_start = torch.cuda.memory_allocated(self.device)
        self._recorder = UseRecorder(self.device)
        self._step_started = time.perf_counter()

    def _finish_recording(self, swapper, stats: StepStats) -> StepProfile:
        uses = self._recorder.finish()
        self._recorder = None
        self._wall_ms = (time.perf_counter() - self._step_started) * 1000.0
        activation = overhead = other = 0
        bytes_per_ms = CPU_BYTES_PER_MS
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            activation = max(0, peak - self._alloc_at_start)
            overhead = max(0, torch.cuda.max_memory_reserved(self.device) - peak)
            other = max(0, self._alloc_at_start - swapper.placement.predicted_device_bytes)
            if stats.copy_ms > 0:
                bytes_per_ms = stats.bytes_moved / stats.copy_ms
        self._peak_reserved = torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0
        self.profile = StepProfile(uses, activation + other, overhead, bytes_per_ms)
        return self.profile

    def _apply(self, swapper, plan: Plan) -> None:
        self.plan = plan
        swapper.apply_placement(plan.streamed, plan.prefetch)
        self.log(f"{plan.describe(swapper.placement.sizes)} (+{self._offset_ms:.0f} ms outside the layers)")
        if self.plan_only:
            self.done = True

    def _check(self, swapper, profile: StepProfile) -> None:
        plan = self.plan
        predicted = plan.predicted_ms + self._offset_ms
        over = self._peak_reserved - self.budget if self.device.type == "cuda" else 0
        slow = self._wall_ms > predicted * (1 + TIME_TOLERANCE)
        self.log(
            f"DGLS plan check: step {self._wall_ms:.0f} ms (predicted {predicted:.0f}), peak reserved "
            f"{self._peak_reserved / GiB:.2f} GiB (budget {self.budget / GiB:.2f})"
        )
        self.done = True
        if over <= 0 and not slow:
            return
        # Re-plan once, from what this step measured under the new placement.
        sizes = swapper.placement.sizes
        if over > 0:
            profile = StepProfile(
                profile.uses, profile.activation_bytes, profile.reserved_overhead + over, profile.bytes_per_ms
            )
        measured = simulate(sizes, profile, swapper.placement.streamed, swapper.config.prefetch)
        self._offset_ms = max(0.0, self._wall_ms - measured)
        replan = plan_for_budget(sizes, profile, self.budget)
        self.replanned = True
        reason = "over budget" if over > 0 else "slower than predicted"
        self.log(f"DGLS: the plan was {reason}; re-planning once")
        self._apply(swapper, replan)
        assert predict_peak(sizes, profile, replan.streamed, replan.prefetch) <= self.budget
