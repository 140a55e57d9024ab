"""Automatic placement from a VRAM budget: probe, shortlist, measure, refine, settle.

Who does what
    - :class:`PlacementDriver` observes the engine as a listener (use starts, weight copies, pass ends: records
      only) and acts when the engine steps it (a feature's ``between_passes``): at the first use after a pass
      ended that is not inside a backward, after the loop's optimizer step, never in autograd's end-of-backward
      callback. Reading stats never changes what it does.
    - It re-places layers through a typed :class:`Placeable` (``apply_placement``); its phases are a
      :class:`DriverPhase` with transitions as methods (:class:`DriverState`).

Steps
    - Step 1 runs with every layer streamed (the smallest footprint) and warms up; step 2 is the probe: each
      layer use's compute time, the copy bandwidth, the activation peak.
    - The planner (:mod:`.planner`) predicts every candidate placement and shortlists the best of each family
      (pattern x prefetch depth) predicted within ``SHORTLIST_WITHIN`` of its choice.
    - Each shortlisted plan runs for real in the order A B C D D C B A (one warm-up step after each switch,
      ``TRIAL_STEPS`` timed steps per visit), so a slow drift of the step time cancels instead of favouring the
      plans measured first. The fastest that stayed within the budget is kept.
    - The trials also measure how far the memory model's peaks were off; when that error is smaller than the
      safety margin the plans were made with, one refined plan made with the measured error instead of the
      margin is measured against the winner (A B B A) and kept if it is faster and fits.

Disk tier (a host RAM budget, LoRA)
    - The builder chooses which of the probe's streamed layers live on disk (:mod:`.disk_plan`) and gives the driver
      their bytes and the disk's bandwidth; the probe's profile carries them, so every plan's prediction waits for
      their reads (layers on disk are the ones worth keeping resident: the planner's "disk first" resident sets),
      and the settled plan's disk floor is said.
      A full fine-tune whose training state would go to disk is refused with a VRAM budget (the builder's line).

Data parallel (:mod:`.agreement`)
    - Processes of one job that hold the same layers (data-parallel replicas: the builder finds them) decide one
      placement together: the budget is the smallest of theirs, and every measurement the driver decides from until
      the plan settles (the probe's profile, each window's step time and peak) is agreed, the largest over them, at
      the same step boundary on each (:meth:`PlacementDriver._agree`), so every driver makes the same decisions.
      Each step of data parallel runs at its slowest process's pace, and waits for it at the gradients' all-reduce:
      placements chosen apart would differ, and the slowest would set the pace. Alone, nothing is agreed. Once
      settled, each process watches its own peaks (no collective per pass; a later re-plan is its own), except with
      shared fetches (``lockstep``: :mod:`..memory.fetch_share`), where the settled plan stays and a peak over the
      budget is said, as for a full fine-tune.

Why measure at all
    - The model ranks plans that differ by a few percent less reliably than timed steps do, so the last word
      goes to the measurement; the model's job is to cut thousands of placements to a handful.

Full fine-tuning: one plan, fixed before the first update (``fixed``)
    - Why fixed: a streamed layer's params train on the host (fp32 masters, the host optimizer's state), a
      resident layer's with the trainer's optimizer on the device. Moving a layer after an update would move its
      optimizer state between two optimizers DGLS does not both own (the trainer's may be any class, 8-bit ones
      included) or drop it; so the placement is chosen once and never changed (no trials, no refinement, no
      re-plan: a later step over the budget is reported, not acted on).
    - Why not from sizes alone, before step 1: the activations (and the allocator's slack) are known only once a
      step ran, and a plan without them would fill the budget with resident layers.
    - So step 1 is the probe: it runs with every layer streamed (the smallest footprint), every layer's
      gradients go home, and no update runs before its optimizer step (the host training holds updates that
      would start during backward). Before that optimizer step (:meth:`PlacementDriver.fix_plan`, which the host
      training calls as the trainer's step begins: its clipping through DGLS, or ``before_step``, which DGLS's
      DeepSpeed hooks call), the planner picks the fastest predicted plan with the full fine-tune's device costs
      (:mod:`.planner`), and it is applied once: the layers it keeps resident take their step-1 gradients onto
      the device, where the trainer's optimizer steps them from that step on. Nothing had been updated, so the
      run is the run of the same placement given explicitly. Host RAM: step 1 allocates every layer's masters and
      landings; optimizer state that a layer's first update makes is counted then, for the layers the plan
      streams (:func:`~..training.host_training.check_deferred_state`), not at start-up.
    - A trainer that runs its optimizer step before DGLS hears of the step (a loop that neither clips through
      DGLS nor calls ``before_step``) gets the probe's placement for the run, with a line saying so.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

import torch

from ..errors import DGLSUserError, say
from ..memory.copier import Wait
from ..memory.layout import MB, LayerSizes, human_bytes
from ..memory.transport import Copy, Direction
from ..streaming.feature import Engine, Feature
from ..streaming.schedule import Phase
from ..watching.listener import Listener
from ..watching.stats import elapsed_ms, timestamp
from .agreement import PlanAgreement
from .disk_plan import forecast, profile_costs
from .planner import GiB, Plan, StepProfile, UseTiming, minimum_bytes, plan_for_budget, shortlist, simulate

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
    """Marks the start of every layer use (and the waits inside it) on the compute stream, until the pass ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[tuple[int, Phase, object]] = []
        self._waits: list[list[tuple[object, object]]] = []
        self._end: object = None  # the pass end's timestamp: the last use's compute ends there

    def use_started(self, layer: int, phase: Phase) -> None:
        if self._end is None:
            self._marks.append((layer, phase, timestamp(self.device)))
            self._waits.append([])

    def waited(self, before, after) -> None:
        if self._end is None and self._waits:
            self._waits[-1].append((before, after))

    def stop(self, at) -> None:
        """The pass ended at ``at``: the uses after it belong to the next step."""
        if self._end is None:
            self._end = at

    def finish(self) -> tuple[UseTiming, ...]:
        """Each use's compute time: until the next use began (or the pass ended), less its waits."""
        end = self._end if self._end is not None else timestamp(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stamps = [m[2] for m in self._marks] + [end]
        uses = []
        for k, (layer, phase, _) in enumerate(self._marks):
            waited = sum(elapsed_ms(a, b) for a, b in self._waits[k])
            uses.append(UseTiming(layer, phase, max(0.0, elapsed_ms(stamps[k], stamps[k + 1]) - waited)))
        return tuple(uses)


def copy_bandwidth(copies: Iterable[Copy] | None) -> float:
    """Bytes per ms of the timed copies among ``copies`` (CUDA: their start and ready events, completed); 0 when
    none was timed (``collect_timing`` off, or the CPU)."""
    timed = [c for c in copies or () if isinstance(c.start, torch.cuda.Event) and c.ready is not None]
    ms = sum(c.start.elapsed_time(c.ready) for c in timed)
    return sum(c.nbytes for c in timed) / ms if ms > 0 else 0.0


def resolve_budget(spec: float | str, device: torch.device) -> int:
    """Bytes from a ``--vram_budget`` value: a number of GiB, or ``auto``."""
    if spec == "auto":
        if device.type != "cuda":
            raise DGLSUserError("--vram_budget auto needs a CUDA device: give a number of GiB, or drop the flag on CPU")
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - AUTO_MARGIN
    return int(float(spec) * GiB)


def explicit_settings(
    sizes: Sequence[LayerSizes], plan: Plan, first_layer: int = 0, unit_bytes: int | None = None
) -> str:
    """The flags that give ``plan``'s placement without a probe (indices in the whole layer list: this process's
    layers start at ``first_layer``), or '' when no ``--gpu_layers`` names it (a layer split into swap units with
    some of them resident)."""
    streamed = set(plan.streamed)
    owners: dict[int, set[bool]] = {}
    for s in sizes:
        if s.streamable_bytes:
            owners.setdefault(s.owner, set()).add(s.index in streamed)
    if any(len(kinds) > 1 for kinds in owners.values()):
        return ""
    resident = [first_layer + owner for owner, kinds in sorted(owners.items()) if kinds == {False}]
    flags = f"--gpu_layers {','.join(map(str, resident))} " if resident else "--blocks_to_swap " + str(len(owners))
    flags = flags.rstrip() + f" --prefetch {plan.prefetch}"
    if unit_bytes:  # the swap units the plan was made with
        flags += f" --swap_unit_mb {unit_bytes / MB!r}"  # exact: MB is a power of two
    return flags + (" --offload_activations" if plan.kept_activations else "")


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


class OffloadCounters(Protocol):
    """What the driver reads of the activation offloader (:mod:`..activations.activation_offload`)."""

    @property
    def segments_sent(self) -> int:
        """Checkpointed calls whose inputs went home so far."""

    @property
    def largest_segment(self) -> int:
        """Bytes of the largest such call's inputs."""

    @property
    def keep(self) -> int:
        """Calls of a forward whose inputs stay on the device."""

    @property
    def kept_last_step(self) -> int:
        """Calls whose inputs stayed on the device in the last step (at least ``keep``; a layer-major step: at
        least its micro-batch count)."""


class PlacementView(Protocol):
    """The placement in force, as the driver reads it (:class:`~..streaming.placement.Placement`)."""

    @property
    def sizes(self) -> Sequence[LayerSizes]: ...

    @property
    def streamed(self) -> Sequence[int]: ...

    @property
    def prefetch(self) -> int: ...

    @property
    def predicted_device_bytes(self) -> int: ...

    @property
    def update_bytes(self) -> int: ...


class Placeable(Protocol):
    """What :class:`PlacementDriver` reads and calls of the engine it places layers for
    (:class:`~..engine.swapper.LayerSwapper` satisfies it):
    the layers' sizes and the placement in force, the activation offloader's counters (None without offload), and
    re-placement between passes."""

    @property
    def placement(self) -> PlacementView: ...

    @property
    def activations(self) -> OffloadCounters | None: ...

    @property
    def micro_batches(self) -> int:
        """Micro-batches the last step ran layer-major (1: one a pass)."""

    def apply_placement(self, streamed: Iterable[int], prefetch: int, kept_activations: int | None = None) -> None: ...

    def placement_table(self) -> str:
        """The placement table (with layers on disk: each streamed layer's tier)."""


class DriverPhase(Enum):
    """Where the driver is; see :class:`DriverState` for the transitions."""

    WARM = "warm"  # one untimed pass on the placement just applied (allocations, first copies)
    PROBE = "probe"  # the timed pass with every layer streamed: uses, peaks, bandwidth (full fine-tuning: step 1)
    TRIAL = "trial"  # timed passes of one visit of a shortlisted plan
    CHECK = "check"  # timed pass of a single or re-planned plan
    SETTLED = "settled"  # the plan is chosen; later passes' peaks are watched


class DriverState:
    """The driver's phase, with one method per transition; each asserts the phase it starts from::

        WARM --warmed()--> PROBE | TRIAL | CHECK      (PROBE first, then the phase ``placed`` named; timing starts)
        WARM --probe_at_once()--> PROBE                (full fine-tuning: step 1 is the probe, before any update)
        PROBE | TRIAL | CHECK | SETTLED --placed(then)--> WARM    (a plan was applied)
        TRIAL --time_again()--> TRIAL                  (the next visit's plan is in force and warm)
        PROBE | TRIAL | CHECK | SETTLED --settle()--> SETTLED     (chosen, or fallen back)

    A transition from any other phase is a bug in the driver: :class:`AssertionError`, as in
    :mod:`..streaming.residency`.
    """

    def __init__(self) -> None:
        self.phase = DriverPhase.WARM
        self.after_warm = DriverPhase.PROBE  # the phase the warm-up pass leads to
        self.timed = 0  # passes timed in the current phase

    def warmed(self) -> None:
        self._expect(DriverPhase.WARM)
        self.phase, self.timed = self.after_warm, 0

    def probe_at_once(self) -> None:
        """Full fine-tuning: no warm-up pass (the plan must be in force before step 1's updates)."""
        self._expect(DriverPhase.WARM)
        if self.after_warm is not DriverPhase.PROBE:
            raise AssertionError("only the first pass is probed without a warm-up")
        self.phase, self.timed = DriverPhase.PROBE, 0

    def placed(self, then: DriverPhase) -> None:
        self._expect(DriverPhase.PROBE, DriverPhase.TRIAL, DriverPhase.CHECK, DriverPhase.SETTLED)
        if then not in (DriverPhase.TRIAL, DriverPhase.CHECK):
            raise AssertionError(f"a plan is warmed up for a trial or a check, not for {then.value}")
        self.phase, self.after_warm = DriverPhase.WARM, then

    def time_again(self) -> None:
        self._expect(DriverPhase.TRIAL)
        self.timed = 0

    def settle(self) -> None:
        self._expect(DriverPhase.PROBE, DriverPhase.TRIAL, DriverPhase.CHECK, DriverPhase.SETTLED)
        self.phase = DriverPhase.SETTLED

    def count_pass(self, passes: int = 1) -> None:
        """Timed passes ended (in a timed phase)."""
        self._expect(DriverPhase.PROBE, DriverPhase.TRIAL, DriverPhase.CHECK)
        self.timed += passes

    def _expect(self, *phases: DriverPhase) -> None:
        if self.phase not in phases:
            allowed = " or ".join(p.value for p in phases)
            raise AssertionError(f"the placement driver is in {self.phase.value}, expected {allowed}")


@dataclass(frozen=True)
class PassEnd:
    """What the driver reads when a backward pass ends (in autograd's end-of-backward callback: a timestamp on the
    compute stream and host-side allocator counters, nothing that waits for the device)."""

    at: object  # ``timestamp(device)``: a CUDA event, or perf_counter() on the CPU
    allocated: int = 0  # memory_allocated (CUDA)
    peak_allocated: int = 0  # max_memory_allocated since the last reset (the driver's, or the trainer's)
    peak_reserved: int = 0  # max_memory_reserved likewise


@dataclass
class Window:
    """A timed stretch: from one pass end to a later one. Its peaks are the largest read at its pass ends, counted
    from where the driver reset them, when the window opened (after the loop's optimizer step); a trainer that
    resets them after each step, as DGLS's DeepSpeed wrappers do, hides no pass of it."""

    start: PassEnd
    end: PassEnd | None = None
    peak_allocated: int = 0
    peak_reserved: int = 0
    weight_copies: list[Copy] | None = None  # weights-in copies (the probe's: the copy bandwidth)

    def add(self, end: PassEnd) -> None:
        self.end = end
        self.peak_allocated = max(self.peak_allocated, end.peak_allocated)
        self.peak_reserved = max(self.peak_reserved, end.peak_reserved)


@dataclass
class PlacementDriver(Listener, Feature):
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

    Observing and acting are apart:

    - As a :class:`~..watching.listener.Listener` it only records: use starts and waits (the probe's
      :class:`UseRecorder`), weights-in copies (the transport's ``copied`` event, which the profiler
      reads for every other direction; its weight lanes draw the same copies, those the compute side
      acquired: the probe's copy bandwidth is every weights-in copy of the probe's window), and at each
      pass end a :class:`PassEnd` (a timestamp and allocator counters, no device wait). Windows run
      from pass end to pass end.
    - It acts in :meth:`step`: it waits for the device, turns the windows into measurements, moves
      its phase (:class:`DriverState`) and calls ``apply_placement`` on its :class:`Placeable`.
    - As a feature of the engine (:mod:`..streaming.feature`): ``install`` makes the engine its
      :class:`Placeable` and a listener of it; ``between_passes`` is :meth:`step`.
    - Who steps it: the engine, at the first use after a pass ended that is not inside a backward
      (the next forward, or an eval forward), before that use does anything. In every training
      loop that point comes after whatever the loop runs between passes: the optimizer step and
      ``zero_grad`` (diffusion-pipe's DeepSpeed ``train_batch``, the demo, a library user's own
      loop alike), so no loop has to call DGLS and none can forget to. It is never autograd's
      end-of-backward callback, and never inside a backward (a pipeline's consecutive backward
      passes are stepped together, at the next forward: :meth:`step` takes every pass ended since). A
      pipeline stage's micro-batches interleave (a forward before the backward of the one before): there
      the trainer runs each step in the engine's ``one_step``, and the driver is stepped as the next step
      starts, never while a micro-batch awaits its recompute.
      ``plan_finished`` steps it too (``--plan`` loops stop on the probe's decision, not a step later).
    - A pass that ends the run is never acted on: its decision would come with the next forward.

    Hazards
    - With gradient accumulation every micro-batch's backward is a pass, so the driver may act between
      micro-batches, before the optimizer step (the trainable params and their grads stay on the device
      whatever the placement, so the numbers do not change; a window's steps are passes).
    - It acts inside the call of the forward's first module (its pre-hook): the params of that layer are
      re-bound before its forward reads them, but torch has already chosen which forward to call, so a
      ``--compile`` switch of that one layer takes effect from its next call; and a checkpoint wrapper around
      that call (activation offload) entered before the new depth was set.
    """

    budget: int
    device: torch.device
    log: object = say
    plan_only: bool = False  # --plan: stop after planning
    copy_streams: int = 1  # each stream has its own fp8 landing buffer: counted in every plan's peak
    fixed: bool = False  # full fine-tuning: step 1 is the probe, its plan applied once before any update (module doc)
    first_layer: int = 0  # this process's first layer in the whole layer list (what the explicit flags count from)
    unit_bytes: int | None = None  # the swap units' size the layers were split at (None: whole layers)
    # with a host RAM budget: the layers on disk (bytes per read) and the disk's bandwidth, set by the builder once
    # the disk tier is open; the plans then count their reads (:mod:`.disk_plan`)
    disk_reads: dict[int, int] = field(default_factory=dict)
    read_bytes_per_ms: float = 0.0
    # data parallel: the processes holding these layers, which decide one placement together (:mod:`.agreement`;
    # None: this process alone, and nothing is agreed)
    agreement: PlanAgreement | None = None
    # shared fetches (:mod:`..memory.fetch_share`): the processes gather every fetch together, so the placement stays
    # as it settled (re-planning alone would change this process's fetches and leave the others' gathers waiting)
    lockstep: bool = False
    plan: Plan | None = None  # the plan in force
    profile: StepProfile | None = None  # the probe's (data parallel: as agreed)
    own_profile: StepProfile | None = None  # this process's probe, before any agreement (to tell them apart)
    trials: list[Trial] = field(default_factory=list)  # every measured plan, refinement round included
    replanned: bool = False
    refined: bool = False
    state: DriverState = field(default_factory=DriverState)
    _round: list[Trial] = field(default_factory=list)  # the trials being compared now
    _schedule: list[int] = field(default_factory=list)  # visits, as indices into _round
    _visit: int = 0
    _recorder: UseRecorder | None = None
    _window: Window | None = None
    _last_end: PassEnd | None = None
    _ended: int = 0  # passes ended since the driver was last stepped
    _offset_ms: float = 0.0
    _wall_ms: float = 0.0
    _peak_reserved: int = 0
    _sent_at_start: int = 0  # the activation offloader's count of segments sent, when the probe began
    _fallen_back: bool = False  # the probe's placement is in force: nothing smaller to go to
    _over_reported: bool = False  # fixed: a step over the budget was reported (once)

    _target: Placeable | None = None

    @property
    def done(self) -> bool:
        """The plan is settled (or, with ``plan_only``, shown)."""
        return self.state.phase is DriverPhase.SETTLED

    # ---------------------------------------------------------------- feature
    def install(self, engine: Engine) -> None:
        """The engine this driver places layers for (a :class:`Placeable`), which it listens to."""
        self._target = engine  # type: ignore[assignment]  # LayerSwapper is both
        engine.add_listener(self)
        if self.fixed:
            self.state.probe_at_once()  # the window opens at the first use

    def between_passes(self) -> None:
        self.step()

    def check_static_minimum(self, sizes, update_bytes: int = 0) -> None:
        """Before step 1: the budget must hold the essentials and two slots (and a full fine-tune's update buffers
        and the optimizer state of the params resident in every placement)."""
        need = minimum_bytes(sizes, None, copy_streams=self.copy_streams) + update_bytes
        if need > self.budget:
            training = " + the device update buffers" if update_bytes else ""
            raise DGLSUserError(
                f"VRAM budget {human_bytes(self.budget)} is below the minimum {human_bytes(need)} even before "
                f"activations (resident essentials + 2 x the largest layer{training}): raise --vram_budget"
            )

    # ---------------------------------------------------------------- listener: records only
    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        if self.fixed and self._window is None and self.state.phase is DriverPhase.PROBE and torch.is_grad_enabled():
            self._start_timing(self._target, record=True)  # full fine-tuning: step 1's first use (not an eval's)
        if self._recorder is not None:
            self._recorder.use_started(layer, phase)

    def waited(self, wait: Wait) -> None:
        if self._recorder is not None:
            self._recorder.waited(wait.before, wait.after)

    def copied(self, copy: Copy) -> None:
        """The transport's event for every copy (possibly on its worker thread: a list append)."""
        window = self._window
        if window is not None and window.weight_copies is not None and copy.direction is Direction.WEIGHTS_IN:
            window.weight_copies.append(copy)

    def pass_ended(self) -> None:
        """Autograd's end-of-backward callback: record the pass end, act later (:meth:`step`)."""
        if self.plan_only and self.done:
            return
        end = self._read_pass_end()
        self._last_end = end
        self._ended += 1
        if self._window is not None:
            self._window.add(end)
        if self._recorder is not None:
            self._recorder.stop(end.at)

    # ---------------------------------------------------------------- acting
    def step(self, target: Placeable | None = None) -> None:
        """Act on the passes ended since the last step (see the class doc for who calls this, and when)."""
        target = target if target is not None else self._target
        if self.fixed and not self.done:  # the probe ends at step 1's optimizer step (fix_plan)
            return
        passes, self._ended = self._ended, 0
        if passes == 0:
            return
        if not self.done:
            self.step_done(target, passes)
        else:
            self._watch(target)

    def step_done(self, target: Placeable, passes: int = 1) -> None:
        """After ``passes`` more passes ended, until the plan is settled."""
        if self.done:
            return
        state = self.state
        if state.phase is DriverPhase.WARM:
            state.warmed()
            self._start_timing(target, record=state.phase is DriverPhase.PROBE)
            return
        state.count_pass(passes)
        if state.phase is DriverPhase.TRIAL and state.timed < TRIAL_STEPS:
            return
        self._stop_timing(target, steps=state.timed)
        self._agree(target)
        if state.phase is DriverPhase.PROBE:
            self._after_probe(target)
        elif state.phase is DriverPhase.TRIAL:
            self._after_visit(target)
        else:
            self._after_check(target)

    def fix_plan(self, in_time: bool = True, target: Placeable | None = None) -> None:
        """Full fine-tuning (``fixed``): step 1's passes ended and its optimizer step is next. End the probe, plan,
        and apply the plan once (see the module doc). ``in_time`` False: the trainer's optimizer step may have run
        already (only the host's updates are next), so layers cannot change hands: the probe's placement stays.
        Later calls do nothing."""
        target = target if target is not None else self._target
        if not self.fixed or self.done:
            return
        if self._window is None:  # no layer was used: nothing was measured
            self.log("DGLS: the first optimizer step came before any layer ran: the probe's placement stays")
            self._settle()
            return
        passes, self._ended = max(1, self._ended), 0  # step 1's micro-batches
        self.state.count_pass(passes)
        self._stop_timing(target, steps=passes)
        self._agree(target)
        profile, sizes = self.profile, target.placement.sizes
        current = simulate(sizes, profile, target.placement.streamed, target.placement.prefetch)
        self._offset_ms = max(0.0, self._wall_ms - current)
        plan = plan_for_budget(sizes, profile, self._planning_budget(sizes), copy_streams=self.copy_streams)
        self.trials = [Trial(plan)]
        self.plan = plan
        explicit = explicit_settings(sizes, plan, self.first_layer, self.unit_bytes)
        if self.plan_only:
            self.log(f"{plan.describe(sizes)}: a full fine-tune keeps it for the run")
        elif not in_time:
            self.log(
                f"{plan.describe(sizes)}: not applied: the trainer stepped before DGLS heard of the step (call "
                "the host training's before_step(), or clip through it, before the trainer's optimizer step); a "
                "full fine-tune keeps the probe's placement (everything streamed) for the run"
            )
            self.plan = None
            self._fallen_back = True
        else:
            self._apply(target, plan, quiet=True)
            self.log(
                f"{plan.describe(sizes)} (+{self._offset_ms:.0f} ms outside the layers): fixed for the run from step "
                "1's optimizer step (a full fine-tune's resident layers train with the trainer's optimizer)"
            )
        if explicit and self.plan is not None:
            self.log(f"DGLS: the same placement without the probe (to resume this run): {explicit}")
        self._settle()

    # ---------------------------------------------------------------- phases
    def _after_probe(self, target: Placeable) -> None:
        profile, sizes = self.profile, target.placement.sizes
        current = simulate(sizes, profile, target.placement.streamed, target.placement.prefetch)
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
            self._apply(target, plans[0])
            if self.plan_only:
                self.state.settle()
                self._say_shared()
            else:
                self.state.placed(DriverPhase.CHECK)
            return
        self.log(f"DGLS: measuring the {len(plans)} best predicted plans on the next steps (A..Z Z..A):")
        self._start_round(target, [Trial(p) for p in plans])

    def _start_round(self, target: Placeable, trials: list[Trial]) -> None:
        """Visit the trials in the order A B .. Z Z .. B A: a linear drift in step time cancels."""
        self.trials += trials
        self._round = trials
        self._schedule = list(range(len(trials))) + list(reversed(range(len(trials))))
        self._visit = -1
        self._next_visit(target)

    def _next_visit(self, target: Placeable) -> None:
        self._visit += 1
        plan = self._round[self._schedule[self._visit]].plan
        if plan is self.plan:  # already in force and warm: time it straight away
            self.state.time_again()
            self._start_timing(target, record=False)
            return
        self._apply(target, plan, quiet=self._visit >= len(self._round))
        self.state.placed(DriverPhase.TRIAL)

    def _after_visit(self, target: Placeable) -> None:
        trial = self._round[self._schedule[self._visit]]
        trial.samples_ms.append(self._wall_ms)
        trial.peak_reserved = max(trial.peak_reserved, self._peak_reserved)
        if self._visit + 1 < len(self._schedule):
            self._next_visit(target)
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
            self._replan(target, over, max(t.peak_reserved - t.plan.predicted_peak for t in self._round))
            return
        best = min(fitting, key=lambda t: t.wall_ms)
        if not self.refined:
            self.refined = True
            refined = self._refined_plan(target, best.plan)
            if refined is not None:
                self.log("DGLS: the trials leave room for a refined plan; measuring it against the fastest (A B B A)")
                self.log(f"  {refined.describe(target.placement.sizes)}")
                first, second = (best.plan, refined) if best.plan is self.plan else (refined, best.plan)
                self._start_round(target, [Trial(first), Trial(second)])
                return
        if best.plan is not self.plan:
            self._apply(target, best.plan, quiet=True)
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

    def _refined_plan(self, target: Placeable, best: Plan) -> Plan | None:
        """The plan for the budget less the peak error the trials measured (plus a small margin),
        when that is a new placement: the up-front margin may have been wider than needed."""
        sizes = target.placement.sizes
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
        """The plan is chosen: from here the peak of later passes is watched (see ``_watch``), each process's own:
        data parallel, the agreement ends here (:mod:`.agreement`: no collective after settling), and a later
        re-plan or fall-back is this process's alone."""
        self.state.settle()
        self._say_shared()
        self.agreement = None
        if self.device.type == "cuda":
            self._reset_peak()  # the trials' peaks are not the plan's
        target = self._target
        if self.profile is not None and target is not None and self.disk_reads:  # the disk floor, measured compute
            placement = target.placement
            costs = profile_costs(placement.sizes, self.profile, placement.prefetch)
            self.log(target.placement_table())  # the three tiers of the plan in force
            if on_disk := set(self.disk_reads) & set(placement.streamed):
                self.log(forecast(costs, placement.streamed, on_disk).line())
            else:
                self.log(
                    f"DGLS disk plan: the plan keeps the {len(self.disk_reads)} layers on disk resident: no step "
                    "reads from disk"
                )

    def _watch(self, target: Placeable) -> None:
        """A pass after settling went over the budget (the peak since settling, or since the trainer last
        reset it): re-plan once with the measured error, as a failed check does; after that, fall back to
        the probe's placement. Reads one counter per pass."""
        if self.device.type != "cuda" or self.plan_only or self._fallen_back or self.plan is None:
            return
        peak = self._peak_since_reset()  # this process's own: the agreement ended when the plan settled
        if peak <= self.budget:
            return
        if self.fixed or self.lockstep:
            if not self._over_reported:
                self._over_reported = True
                why = (
                    "a full fine-tune's placement is fixed for the run"
                    if self.fixed
                    else "with shared fetches (--share_fetch) the placement stays as it settled"
                )
                self.log(
                    f"DGLS: a step peaked at {peak / GiB:.2f} GiB reserved, over the {self.budget / GiB:.2f} GiB "
                    f"budget; {why}: lower --vram_budget for the next run"
                )
            return
        self.log(
            f"DGLS: a step after planning peaked at {peak / GiB:.2f} GiB reserved, over the "
            f"{self.budget / GiB:.2f} GiB budget"
        )
        if not self.replanned:
            self._replan(target, peak - self.budget, peak - self.plan.predicted_peak)
        else:
            self._fall_back(target)

    def _fall_back(self, target: Placeable, why: str = "still over budget after re-planning") -> None:
        streamed = [s.index for s in target.placement.sizes if s.streamable_bytes]
        self.log(f"DGLS: {why}: using the probe's placement (everything streamed, prefetch 1)")
        target.apply_placement(streamed, 1)
        self._fallen_back = True
        self._settle()

    def _after_check(self, target: Placeable) -> None:
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
            self._replan(target, over, self._peak_reserved - self.plan.predicted_peak)
        else:
            self._fall_back(target)

    def _replan(self, target: Placeable, over: int, error: int) -> None:
        """Re-plan once, with the measured peak error (measured less predicted) added to the
        allocator slack: the new plan then keeps the whole margin. Adding only the overshoot past
        the budget would spend the margin on the error, and a later step's fragmentation went over.
        Where not even the refine margin fits beside the minimum, no plan but the probe's has room for
        more error: that one is taken at once (a plan filling the budget to the byte went over again)."""
        profile, sizes = self.profile, target.placement.sizes
        self.profile = replace(profile, reserved_overhead=profile.reserved_overhead + max(error, 0))
        self.replanned = True
        self.log(f"DGLS: the plan went {over / GiB:.2f} GiB over the budget; re-planning once")
        aim = self._planning_budget(sizes)
        if aim == self.budget:  # the full margin does not fit: keep at least the refine margin, or fall back
            aim -= max(REFINE_MARGIN, int(REFINE_MARGIN_SHARE * self.budget))
            if minimum_bytes(sizes, self.profile, copy_streams=self.copy_streams) > aim:
                self._fall_back(target, "no placement but the probe's leaves room for that error")
                return
        plan = plan_for_budget(sizes, self.profile, aim, copy_streams=self.copy_streams)
        self.trials.append(Trial(plan))
        self._apply(target, plan)
        self.state.placed(DriverPhase.CHECK)

    def _planning_budget(self, sizes) -> int:
        """The budget less the margin, unless that would refuse a budget the minimum fits."""
        aim = self.budget - max(PEAK_MARGIN, int(PEAK_MARGIN_SHARE * self.budget))
        return aim if minimum_bytes(sizes, self.profile, copy_streams=self.copy_streams) <= aim else self.budget

    # ---------------------------------------------------------------- measuring
    def _read_pass_end(self) -> PassEnd:
        """At a pass end (autograd's callback): a timestamp and host-side counters, no device wait."""
        at = timestamp(self.device)
        if self.device.type != "cuda":
            return PassEnd(at)
        return PassEnd(
            at,
            torch.cuda.memory_allocated(self.device),
            torch.cuda.max_memory_allocated(self.device),
            torch.cuda.max_memory_reserved(self.device),
        )

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _peak_since_reset(self) -> int:
        """The peak reserved read at the last pass end (since settling, or since the trainer last reset it)."""
        return self._last_end.peak_reserved if self._last_end is not None else 0

    def _start_timing(self, target: Placeable, record: bool) -> None:
        """A window opens at the last pass end (``record``: the probe's, which also records uses and copies)."""
        if self.device.type == "cuda":
            if record:  # blocks the process cached before the probe (model loading, caching, another run) would
                torch.cuda.empty_cache()  # read as this placement's peak reserved, as activations
            self._reset_peak()  # the window's pass ends read the peaks from here
        start = self._last_end if self._last_end is not None else self._read_pass_end()
        self._window = Window(start, weight_copies=[] if record else None)
        self._recorder = UseRecorder(self.device) if record else None
        offloader = target.activations
        if record and offloader is not None:
            self._sent_at_start = offloader.segments_sent

    def _stop_timing(self, target: Placeable, steps: int) -> None:
        """The window closed at the last pass end: wait for the device once, read what it measured."""
        uses = self._recorder.finish() if self._recorder is not None else None
        window, self._window, self._recorder = self._window, None, None
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        end = window.end if window.end is not None else self._read_pass_end()
        self._wall_ms = elapsed_ms(window.start.at, end.at) / steps
        self._peak_reserved = window.peak_reserved if cuda else 0
        if uses is None:  # only the probe records uses
            return
        activation = overhead = other = 0
        bytes_per_ms = CPU_BYTES_PER_MS
        if cuda:
            peak = window.peak_allocated
            alloc_at_start = window.start.allocated
            activation = max(0, peak - alloc_at_start)
            overhead = max(0, self._peak_reserved - peak)
            other = max(0, alloc_at_start - target.placement.predicted_device_bytes)
            bytes_per_ms = copy_bandwidth(window.weight_copies) or bytes_per_ms
        offloader = target.activations
        sent = offloader.segments_sent - self._sent_at_start if offloader is not None else 0
        segment = offloader.largest_segment if sent else 0
        kept = offloader.kept_last_step if sent else 0
        update = target.placement.update_bytes
        micro = target.micro_batches
        self.profile = StepProfile(
            uses, activation + other, overhead, bytes_per_ms, sent, segment, kept, update, micro,
            disk_reads=self.disk_reads, read_bytes_per_ms=self.read_bytes_per_ms,
        )  # fmt: skip
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

    def _agree(self, target: Placeable) -> None:
        """After a window's measurements: data parallel, its step time and peak, and the probe's profile, become what
        the processes holding these layers agree (:mod:`.agreement`: the largest, the slowest copies), so every
        driver decides alike; alone, nothing changes. Every member calls it at the same step boundary."""
        probe = self.state.phase is DriverPhase.PROBE
        if probe:
            self.own_profile = self.profile
        agreement = self.agreement
        if agreement is None:
            return
        self._wall_ms, self._peak_reserved = agreement.measured(self._wall_ms, self._peak_reserved)
        if probe:
            profile = self.profile = agreement.profile(self.profile, len(target.placement.sizes))
            self.log(
                f"DGLS probe agreed by the {agreement.size} data-parallel processes: the longest of each layer "
                f"use's compute ({profile.compute_ms:.0f} ms a step), the largest activations "
                f"{profile.activation_bytes / GiB:.2f} GiB and slack {profile.reserved_overhead / GiB:.2f} GiB, the "
                f"slowest copies {profile.bytes_per_ms / 1e6:.1f} GB/s; the slowest step {self._wall_ms:.0f} ms"
            )

    def _say_shared(self) -> None:
        """Data parallel, once the plan is settled: one line that every process holding these layers runs it."""
        if self.agreement is not None:
            self.log(
                f"DGLS: the placement is shared by the {self.agreement.size} data-parallel processes holding these "
                "layers (planned and measured together: each step time the slowest, each peak the largest)"
            )

    def _apply(self, target: Placeable, plan: Plan, quiet: bool = False) -> None:
        self.plan = plan
        target.apply_placement(plan.streamed, plan.prefetch, plan.kept_activations or None)
        if not quiet:
            self.log(f"{plan.describe(target.placement.sizes)} (+{self._offset_ms:.0f} ms outside the layers)")
