"""Automatic placement from a VRAM budget: probe, shortlist, measure, refine, settle.

:class:`PlacementDriver` listens to the engine: it times uses during the probe and acts at the
end of each backward pass (the step boundary the hooks detect), re-placing layers between passes
with ``apply_placement``. Nothing else drives it; reading stats never changes what it does.

Step 1 runs with every layer streamed (the smallest footprint) and warms up; step 2 is
the probe: each layer use's compute time, the copy bandwidth, the activation peak. The
planner (planner.py) predicts every candidate placement and shortlists the best of each
family (pattern x prefetch depth) predicted within 20% of its choice. Each shortlisted
plan then runs for real, in the order A B C D D C B A (one warm-up step after each
switch, ``TRIAL_STEPS`` timed steps per visit), so that a slow drift of the step time
over the minutes of measuring cancels instead of favouring the plans measured first.
DGLS keeps the fastest that stayed within the budget. The trials also measure how far
the memory model's peaks were off; when that error is smaller than the safety margin
the plans were made with, one refined plan made with the measured error instead of the
margin is measured against the winner (A B B A) and kept if it is faster and fits.
The model ranks plans that differ by a few percent less reliably than timed steps do,
so the last word goes to the measurement; the model's job is to cut thousands of
placements to a handful.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from .copier import Wait
from .errors import DGLSUserError
from .listener import Listener
from .planner import GiB, Plan, StepProfile, UseTiming, minimum_bytes, plan_for_budget, shortlist, simulate
from .schedule import Phase
from .stats import StepStats, elapsed_ms, human_bytes, timestamp

AUTO_MARGIN = 1 * GiB  # kept free under "auto": CUDA context growth, other processes, fragmentation
CPU_BYTES_PER_MS = 10e6  # no copies to time on CPU: a nominal 10 GB/s
TRIAL_STEPS = 2  # timed steps per visit of a shortlisted plan (each plan is visited twice)
SHORTLIST, SHORTLIST_WITHIN = 4, 0.20  # plans measured, and how far behind the best prediction they may be
MODEL_TOLERANCE = 1.25  # a chosen plan this much slower than predicted gets a note
# Plans aim this far below the budget (GiB, and a share of the budget): a placement's allocator
# slack differs from the probe's, which the memory model does not see (benchmarks/results/planner.md).
PEAK_MARGIN, PEAK_MARGIN_SHARE = GiB // 2, 0.04
# The refined plan's margin on top of the peak error the trials measured.
REFINE_MARGIN, REFINE_MARGIN_SHARE = GiB // 8, 0.01


class UseRecorder:
    """Marks the start of every layer use (and the waits inside it) on the compute stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[tuple[int, Phase, object]] = []
        self._waits: list[list[tuple[object, object]]] = []

    def use_started(self, layer: int, phase: Phase) -> None:
        self._marks.append((layer, phase, timestamp(self.device)))
        self._waits.append([])

    def waited(self, before, after) -> None:
        if self._waits:
            self._waits[-1].append((before, after))

    def finish(self) -> tuple[UseTiming, ...]:
        """Each use's compute time: until the next use began (or now), less its waits."""
        end = timestamp(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stamps = [m[2] for m in self._marks] + [end]
        uses = []
        for k, (layer, phase, _) in enumerate(self._marks):
            waited = sum(elapsed_ms(a, b) for a, b in self._waits[k])
            uses.append(UseTiming(layer, phase, max(0.0, elapsed_ms(stamps[k], stamps[k + 1]) - waited)))
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
class Trial:
    """A shortlisted plan and what its measured steps gave."""

    plan: Plan
    samples_ms: list[float] = field(default_factory=list)  # one per visit: mean wall time of its timed steps
    peak_reserved: int = 0

    @property
    def wall_ms(self) -> float:
        return statistics.fmean(self.samples_ms) if self.samples_ms else 0.0

    def fits(self, budget: int) -> bool:
        return self.peak_reserved <= budget


@dataclass
class PlacementDriver(Listener):
    """Drives probe -> shortlist -> measure each -> refine -> keep the fastest that fits.

    Every step is a real training step (placement never changes the numerics). A plan is
    applied between steps; the step after a switch warms it up (allocations, first
    copies) and the next ``TRIAL_STEPS`` are timed. If no shortlisted plan stayed within
    the budget, DGLS re-plans once with the measured peak error added to its memory model, and
    checks that plan; if that one too goes over, it falls back to the probe's placement
    (everything streamed, prefetch 1), which the probe showed fits. Once settled it keeps
    watching each pass's peak (CUDA): the allocator's fragmentation can grow for some steps
    past the trials, and a pass that goes over the budget gets the same treatment (re-plan
    once, then the probe's placement).
    """

    budget: int
    device: torch.device
    log: object = print
    plan_only: bool = False  # --plan: stop after planning
    copy_streams: int = 1  # each stream has its own fp8 landing buffer: counted in every plan's peak
    plan: Plan | None = None  # the plan in force
    profile: StepProfile | None = None  # the probe's
    trials: list[Trial] = field(default_factory=list)  # every measured plan, refinement round included
    done: bool = False
    replanned: bool = False
    refined: bool = False
    _phase: str = "warm"  # warm | probe | trial | check
    _next: str = "probe"  # the phase after a warm-up step
    _timed: int = 0
    _round: list[Trial] = field(default_factory=list)  # the trials being compared now
    _schedule: list[int] = field(default_factory=list)  # visits, as indices into _round
    _visit: int = 0
    _recorder: UseRecorder | None = None
    _started: float = 0.0
    _alloc_at_start: int = 0
    _offset_ms: float = 0.0
    _wall_ms: float = 0.0
    _peak_reserved: int = 0
    _sent_at_start: int = 0  # the activation offloader's count of segments sent, when the probe began
    _fallen_back: bool = False  # the probe's placement is in force: nothing smaller to go to

    _engine: object = None

    def attach(self, engine) -> None:
        """The swapper this driver places layers for."""
        self._engine = engine

    def check_static_minimum(self, sizes) -> None:
        """Before step 1: the budget must hold the essentials and two slots."""
        need = minimum_bytes(sizes, None, copy_streams=self.copy_streams)
        if need > self.budget:
            raise DGLSUserError(
                f"VRAM budget {human_bytes(self.budget)} is below the minimum {human_bytes(need)} even before "
                "activations (resident essentials + 2 x the largest layer): raise --vram_budget"
            )

    # ---------------------------------------------------------------- listener
    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        if self._recorder is not None:
            self._recorder.use_started(layer, phase)

    def waited(self, wait: Wait) -> None:
        if self._recorder is not None:
            self._recorder.waited(wait.before, wait.after)

    def pass_ended(self) -> None:
        if not self.done:
            self.step_done(self._engine, self._engine.step_stats(sync=True))
        else:
            self._watch(self._engine)

    def step_done(self, swapper, stats: StepStats) -> None:
        """At the end of every pass, until the plan is settled."""
        if self.done:
            return
        if self._phase == "warm":
            self._phase, self._timed = self._next, 0
            self._start_timing(record=self._phase == "probe")
            return
        self._timed += 1
        if self._phase == "trial" and self._timed < TRIAL_STEPS:
            return
        self._stop_timing(swapper, stats, steps=self._timed)
        if self._phase == "probe":
            self._after_probe(swapper)
        elif self._phase == "trial":
            self._after_visit(swapper)
        else:
            self._after_check(swapper)

    # ---------------------------------------------------------------- phases
    def _after_probe(self, swapper) -> None:
        profile, sizes = self.profile, swapper.placement.sizes
        current = simulate(sizes, profile, swapper.placement.streamed, swapper.config.placement.prefetch)
        self._offset_ms = max(0.0, self._wall_ms - current)
        plans = shortlist(
            sizes,
            profile,
            self._planning_budget(sizes),
            count=SHORTLIST,
            copy_streams=self.copy_streams,
            within=SHORTLIST_WITHIN,
        )
        if self.plan_only or len(plans) == 1:
            for extra in plans[1:]:
                self.log(f"  runner-up: {extra.describe(sizes)}")
            self.trials = [Trial(plans[0])]
            self._apply(swapper, plans[0])
            self.done = self.plan_only
            self._phase, self._next = "warm", "check"
            return
        self.log(f"DGLS: measuring the {len(plans)} best predicted plans on the next steps (A..Z Z..A):")
        self._start_round(swapper, [Trial(p) for p in plans])

    def _start_round(self, swapper, trials: list[Trial]) -> None:
        """Visit the trials in the order A B .. Z Z .. B A: a linear drift in step time cancels."""
        self.trials += trials
        self._round = trials
        self._schedule = list(range(len(trials))) + list(reversed(range(len(trials))))
        self._visit = -1
        self._next_visit(swapper)

    def _next_visit(self, swapper) -> None:
        self._visit += 1
        plan = self._round[self._schedule[self._visit]].plan
        if plan is self.plan:  # already in force and warm: time it straight away
            self._phase, self._timed = "trial", 0
            self._start_timing(record=False)
            return
        self._apply(swapper, plan, quiet=self._visit >= len(self._round))
        self._phase, self._next = "warm", "trial"

    def _after_visit(self, swapper) -> None:
        trial = self._round[self._schedule[self._visit]]
        trial.samples_ms.append(self._wall_ms)
        trial.peak_reserved = max(trial.peak_reserved, self._peak_reserved)
        if self._visit + 1 < len(self._schedule):
            self._next_visit(swapper)
            return
        for trial in self._round:
            self.log(
                f"  measured {trial.plan.pattern}, {len(trial.plan.streamed)} streamed, prefetch "
                f"{trial.plan.prefetch}: step {trial.wall_ms:.0f} ms (predicted "
                f"{trial.plan.predicted_ms + self._offset_ms:.0f}), peak reserved {trial.peak_reserved / GiB:.2f} GiB"
            )
        fitting = [t for t in self._round if t.fits(self.budget)]
        if not fitting:
            over = min(t.peak_reserved for t in self._round) - self.budget
            self._replan(swapper, over, max(t.peak_reserved - t.plan.predicted_peak for t in self._round))
            return
        best = min(fitting, key=lambda t: t.wall_ms)
        if not self.refined:
            self.refined = True
            refined = self._refined_plan(swapper, best.plan)
            if refined is not None:
                self.log("DGLS: the trials leave room for a refined plan; measuring it against the fastest (A B B A)")
                self.log(f"  {refined.describe(swapper.placement.sizes)}")
                first, second = (best.plan, refined) if best.plan is self.plan else (refined, best.plan)
                self._start_round(swapper, [Trial(first), Trial(second)])
                return
        if best.plan is not self.plan:
            self._apply(swapper, best.plan, quiet=True)
        self.log(
            f"DGLS: chose {best.plan.pattern}, {len(best.plan.streamed)} streamed, prefetch {best.plan.prefetch}: "
            f"{best.wall_ms:.0f} ms per step, peak reserved {best.peak_reserved / GiB:.2f} GiB"
        )
        predicted = best.plan.predicted_ms + self._offset_ms
        if best.wall_ms > MODEL_TOLERANCE * predicted:
            self.log(
                f"DGLS: steps run {best.wall_ms / predicted - 1:.0%} slower than the planner's model predicts; the "
                "plan was chosen by measurement, so it stands (--profile shows where the time goes)"
            )
        self._settle()

    def _refined_plan(self, swapper, best: Plan) -> Plan | None:
        """The plan for the budget less the peak error the trials measured (plus a small margin),
        when that is a new placement: the up-front margin may have been wider than needed."""
        sizes = swapper.placement.sizes
        measured = self.device.type == "cuda"
        error = max((t.peak_reserved - t.plan.predicted_peak if measured else 0) for t in self.trials)
        aim = self.budget - max(error, 0) - max(REFINE_MARGIN, int(REFINE_MARGIN_SHARE * self.budget))
        if (
            aim <= self._planning_budget(sizes)
            or minimum_bytes(sizes, self.profile, copy_streams=self.copy_streams) > aim
        ):
            return None
        plan = plan_for_budget(sizes, self.profile, aim, copy_streams=self.copy_streams)
        if any(plan.runs_like(t.plan) for t in self.trials):
            return None
        if plan.predicted_ms >= best.predicted_ms:
            return None
        return plan

    def _settle(self) -> None:
        """The plan is chosen: from here the peak of later passes is watched (see ``_watch``)."""
        self.done = True
        if self.device.type == "cuda":
            self._reset_peak()  # the trials' peaks are not the plan's

    def _watch(self, swapper) -> None:
        """A pass after settling went over the budget (the peak since settling, or since the trainer last
        reset it): re-plan once with the measured error, as a failed check does; after that, fall back to
        the probe's placement. Reads one counter per pass."""
        if self.device.type != "cuda" or self.plan_only or self._fallen_back or self.plan is None:
            return
        peak = self._peak_since_reset()
        if peak <= self.budget:
            return
        self.log(
            f"DGLS: a step after planning peaked at {peak / GiB:.2f} GiB reserved, over the "
            f"{self.budget / GiB:.2f} GiB budget"
        )
        self.done = False
        if not self.replanned:
            self._replan(swapper, peak - self.budget, peak - self.plan.predicted_peak)
        else:
            self._fall_back(swapper)

    def _fall_back(self, swapper, why: str = "still over budget after re-planning") -> None:
        streamed = [s.index for s in swapper.placement.sizes if s.streamable_bytes]
        self.log(f"DGLS: {why}: using the probe's placement (everything streamed, prefetch 1)")
        swapper.apply_placement(streamed, 1)
        self._fallen_back = True
        self._settle()

    def _after_check(self, swapper) -> None:
        if self.trials and self.trials[-1].plan is self.plan:
            self.trials[-1].samples_ms.append(self._wall_ms)
            self.trials[-1].peak_reserved = max(self.trials[-1].peak_reserved, self._peak_reserved)
        predicted = self.plan.predicted_ms + self._offset_ms
        self.log(
            f"DGLS plan check: step {self._wall_ms:.0f} ms (predicted {predicted:.0f}), peak reserved "
            f"{self._peak_reserved / GiB:.2f} GiB (budget {self.budget / GiB:.2f})"
        )
        over = self._peak_reserved - self.budget if self.device.type == "cuda" else 0
        if over <= 0:
            self._settle()
        elif not self.replanned:
            self._replan(swapper, over, self._peak_reserved - self.plan.predicted_peak)
        else:
            self._fall_back(swapper)

    def _replan(self, swapper, over: int, error: int) -> None:
        """Re-plan once, with the measured peak error (measured less predicted) added to the
        allocator slack: the new plan then keeps the whole margin. Adding only the overshoot past
        the budget would spend the margin on the error, and a later step's fragmentation went over.
        Where not even the refine margin fits beside the minimum, no plan but the probe's has room for
        more error: that one is taken at once (a plan filling the budget to the byte went over again)."""
        profile, sizes = self.profile, swapper.placement.sizes
        self.profile = replace(profile, reserved_overhead=profile.reserved_overhead + max(error, 0))
        self.replanned = True
        self.log(f"DGLS: the plan went {over / GiB:.2f} GiB over the budget; re-planning once")
        aim = self._planning_budget(sizes)
        if aim == self.budget:  # the full margin does not fit: keep at least the refine margin, or fall back
            aim -= max(REFINE_MARGIN, int(REFINE_MARGIN_SHARE * self.budget))
            if minimum_bytes(sizes, self.profile, copy_streams=self.copy_streams) > aim:
                self._fall_back(swapper, "no placement but the probe's leaves room for that error")
                return
        plan = plan_for_budget(sizes, self.profile, aim, copy_streams=self.copy_streams)
        self.trials.append(Trial(plan))
        self._apply(swapper, plan)
        self._phase, self._next = "warm", "check"

    def _planning_budget(self, sizes) -> int:
        """The budget less the margin, unless that would refuse a budget the minimum fits."""
        aim = self.budget - max(PEAK_MARGIN, int(PEAK_MARGIN_SHARE * self.budget))
        return aim if minimum_bytes(sizes, self.profile, copy_streams=self.copy_streams) <= aim else self.budget

    # ---------------------------------------------------------------- measuring
    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _peak_since_reset(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def _start_timing(self, record: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._reset_peak()
            self._alloc_at_start = torch.cuda.memory_allocated(self.device)
        self._recorder = UseRecorder(self.device) if record else None
        offloader = getattr(self._engine, "activations", None)
        if record and offloader is not None:
            self._sent_at_start = offloader.segments_sent
        self._started = time.perf_counter()

    def _stop_timing(self, swapper, stats: StepStats, steps: int) -> None:
        uses = self._recorder.finish() if self._recorder is not None else None
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        self._wall_ms = (time.perf_counter() - self._started) * 1000.0 / steps
        self._recorder = None
        self._peak_reserved = self._peak_since_reset() if cuda else 0
        if uses is None:  # only the probe records uses
            return
        activation = overhead = other = 0
        bytes_per_ms = CPU_BYTES_PER_MS
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            activation = max(0, peak - self._alloc_at_start)
            overhead = max(0, self._peak_reserved - peak)
            other = max(0, self._alloc_at_start - swapper.placement.predicted_device_bytes)
            if stats.copy_ms > 0:
                bytes_per_ms = stats.bytes_moved / stats.copy_ms
        offloader = getattr(swapper, "activations", None)
        sent = offloader.segments_sent - self._sent_at_start if offloader is not None else 0
        segment = offloader.largest_segment if sent else 0
        kept = offloader.keep if sent else 0
        self.profile = StepProfile(uses, activation + other, overhead, bytes_per_ms, sent, segment, kept)
        if cuda:
            offloaded = (
                f" with the inputs of {sent} checkpointed calls in host memory (up to {human_bytes(segment)} each)"
                if sent
                else ""
            )
            self.log(
                f"DGLS probe: activations {activation / GiB:.2f} GiB{offloaded}, allocator slack "
                f"{overhead / GiB:.2f} GiB, other allocations {other / GiB:.2f} GiB (device memory DGLS does not "
                f"manage: it counts against the budget), copies {bytes_per_ms / 1e6:.1f} GB/s"
            )

    def _apply(self, swapper, plan: Plan, quiet: bool = False) -> None:
        self.plan = plan
        swapper.apply_placement(plan.streamed, plan.prefetch, plan.kept_activations or None)
        if not quiet:
            self.log(f"{plan.describe(swapper.placement.sizes)} (+{self._offset_ms:.0f} ms outside the layers)")
