"""State plan: which full fine-tuned layers keep their fp32 masters and optimizer state on disk, chosen so each one's
read (before its update) and write-back (after it) hide behind the work left in the step, and the time they add.

Why: a layer's state (AdamW: fp32 master and two moments, six times its bf16 weights) is read and written back once a
step, around its update, on one disk thread (:mod:`..training.disk_state`). Whether that costs nothing depends on
when the update runs and when its result is needed: without clipping a layer's update starts as soon as its
gradients are home, in the backward's order (the last layer first), and is needed only by the layer's fetch in the
next forward, so the state I/O of the layers the backward reaches first hides behind the rest of the backward and the
next forward up to them; the first layers' updates run last and are needed first (so do ``clip_mode``
``previous_norm``'s after step 1: they start at the previous step's coefficient). With exact clipping (spilled layers
do not speculate: :meth:`~..memory.layout.TrainingLayout.spill`) every update waits for the norm, after the backward,
and runs in layer order: only the next forward's compute up to each layer, and the updates before it, are left to
hide behind. The host RAM budget fixes how many bytes must leave RAM (:func:`~..training.disk_state.plan_full_tiers`);
this model decides which layers.

Model (:func:`simulate_state`): the step's layer uses in order, each with its compute time, replayed as
:func:`.disk_plan.simulate_reads` replays them (compute runs the uses in order; a streamed layer's copy starts once
its slot is free and the copy stream is), plus the host training:

- a trained layer's fetch in a step waits for its update of the step before (the update rewrites the packed copy the
  fetch reads); every trained layer is fetched anew in each step (the engine evicts them after each backward);
- after a trained layer's last backward use of the step, its gradients go home on one stream (its copy bytes at the
  copy bandwidth);
- ``after_backward`` False: each update is queued once its gradients are home; True: every update is queued at the
  step's end (the gradient norm), in layer order;
- the updates run one at a time, in queued order, on the job worker (``update_ms`` each);
- the disk thread runs reads and write-backs one at a time, in submission order (every gate of a read or a write is
  an earlier submission, so the order alone serializes them). At most one read is in flight ahead of its update: as
  any update starts, with none in flight, the read of the first queued spilled layer is submitted
  (:meth:`~..training.disk_state.DiskState.ahead`); and a spilled layer's update, once its own read landed, submits
  the next queued spilled layer's. Its update waits for it; its write-back is submitted when the update ends.

Choice (:func:`choose_state_spilled`): :func:`.disk_plan.choose_by_model` with this replay: candidates ranked by
their hiding window (:func:`state_windows`: how long a layer's update could be late, with nothing on disk, before the
next step's fetch of it waits), the longest first, each taken at once while its I/O adds nothing, else the least added
step time per byte freed; the ``SLOTS`` buffers of the largest spilled extent count against the budget (the caps).

Invariants
    - Pure: no I/O, no device; the same inputs give the same choice.
    - Spilling nothing predicts the step the same replay predicts with the host updates alone: the disk adds time only
      through the spilled layers' reads and the disk thread's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..memory.layout import human_bytes
from ..streaming.schedule import Phase
from .disk_plan import HIDDEN_MS, MAX_TRIED, choose_by_model
from .planner import UseTiming
from .row_copies import index_ranges

SLOTS = 2  # the disk state's buffers (training/disk_state.py): one layer updated while the next one's state is read
GREEDY_STEPS = 3  # steps replayed to rank candidates (updates of a step are needed by the next one's fetches)


@dataclass(frozen=True)
class StateCosts:
    """What the model replays: one step's uses, the bytes and update time of each trained layer, the bandwidths."""

    uses: tuple[UseTiming, ...]  # one whole step, in order (the next step repeats it)
    copy_bytes: Mapping[int, int]  # host->device bytes per fetch (and gradient bytes home), by streamed layer
    state_bytes: Mapping[int, int]  # disk bytes read and written back per update (whole pages), by trained layer
    update_ms: Mapping[int, float]  # one host update, by trained layer (its keys are the trained layers)
    copy_bytes_per_ms: float
    read_bytes_per_ms: float
    write_bytes_per_ms: float
    prefetch: int
    after_backward: bool = False  # exact clipping: every update waits for the norm, after the backward, in layer order
    measured: bool = False  # the compute times were measured, not estimated
    updates_timed: bool = False  # the update times come from a timed host step, not a nominal rate
    # clipping where the run with every state in RAM would start updates during the backward on speculation (a host
    # RAM budget that puts any state on disk turns speculation off: TrainingLayout.spill): the forecast's baseline
    speculates_in_ram: bool = False

    @property
    def compute_ms(self) -> float:
        return sum(u.compute_ms for u in self.uses)

    @property
    def updates_ms(self) -> float:
        return sum(self.update_ms.values())


@dataclass(frozen=True)
class StateTimes:
    """One predicted step in steady state."""

    step_ms: float
    disk_ms: float  # the disk thread's busy time in the step (reads and write-backs)
    disk_bytes: int  # bytes read and written back in the step
    updates: int  # updates of spilled layers in the step


@dataclass
class _Replay:
    """One replay's timeline: per step, when it ended; per trained layer and step, its update's end and the time its
    next fetch could have started without waiting for it."""

    step_end: list[float]
    disk_ms: list[float]
    disk_bytes: list[int]
    updates: list[int]
    update_end: list[dict[int, float]]
    fetch_ready: list[dict[int, float]]  # in step s: when each trained layer's fetch could start but for its update


def _replay(costs: StateCosts, streamed: Iterable[int], spilled: Iterable[int], steps: int) -> _Replay:
    streamed, spilled = set(streamed), set(spilled)
    trained = set(costs.update_ms) & streamed
    spilled &= trained
    uses = costs.uses
    last_backward = {use.layer: k for k, use in enumerate(uses) if use.phase is Phase.BACKWARD and use.layer in trained}
    slots = max(costs.prefetch, 0) + 1
    out = _Replay([], [0.0] * steps, [0] * steps, [0] * steps, [], [])
    hold_end: list[float] = []  # per copy: when its layer's run of consecutive uses ends
    copy_free = grad_free = t = 0.0
    host = _Host(costs)
    done: dict[int, float] = {}  # trained layer -> its latest update's end
    for s in range(steps):
        ready: dict[int, float] = {}
        queue: list[tuple[float, int]] = []  # (queued at, layer), in queued order
        for k, use in enumerate(uses):
            layer = use.layer
            before = uses[k - 1] if k > 0 else uses[-1] if s > 0 and layer not in trained else None
            continues = before is not None and before.layer == layer  # trained layers are evicted after backward
            if layer in streamed and not continues:
                issue = hold_end[-slots] if len(hold_end) >= slots else 0.0
                start = max(issue, copy_free)
                if layer in trained:
                    ready.setdefault(layer, start)
                    start = max(start, done.get(layer, 0.0))
                copy_free = start + costs.copy_bytes.get(layer, 0) / costs.copy_bytes_per_ms
                t = max(t, copy_free)
                hold_end.append(0.0)
            t += use.compute_ms
            if layer in streamed:
                hold_end[-1] = t
            if last_backward.get(layer) == k:
                grad_free = max(t, grad_free) + costs.copy_bytes.get(layer, 0) / costs.copy_bytes_per_ms
                if not costs.after_backward:
                    queue.append((grad_free, layer))
        if costs.after_backward:
            norm = max(t, grad_free)
            queue = [(norm, layer) for layer in sorted(last_backward)]
        out.step_end.append(t)
        out.fetch_ready.append(ready)
        ends = host.run(queue, spilled)  # the job worker and the disk thread, for this step's updates
        for layer, end in ends.items():
            done[layer] = end
        out.disk_ms[s], out.disk_bytes[s], out.updates[s] = host.disk_ms, host.disk_bytes, host.updates
        out.update_end.append(ends)
    return out


class _Host:
    """The job worker and the disk thread across steps (the module doc): their free times carry over."""

    def __init__(self, costs: StateCosts) -> None:
        self.costs = costs
        self.worker_free = self.disk_free = 0.0
        self.issued: dict[int, float] = {}  # spilled layer -> when its read lands (one in flight at most)
        self.disk_ms, self.disk_bytes, self.updates = 0.0, 0, 0

    def read(self, layer: int, at: float) -> None:
        self.disk_free = max(at, self.disk_free) + self.costs.state_bytes.get(layer, 0) / self.costs.read_bytes_per_ms
        self.issued[layer] = self.disk_free

    def run(self, queue: list[tuple[float, int]], spilled: set[int]) -> dict[int, float]:
        """One step's updates, ``queue`` (queued at, layer) in queued order: each one's end."""
        c = self.costs
        waiting = [(q, layer) for q, layer in queue if layer in spilled]  # spilled, not yet brought in
        self.disk_ms, self.disk_bytes, self.updates = 0.0, 0, 0
        ends: dict[int, float] = {}
        for q, layer in queue:
            begin = max(q, self.worker_free)
            if not self.issued and waiting and waiting[0][0] <= begin:  # ahead: the first queued spilled layer's
                self.read(waiting[0][1], begin)
            if layer in spilled:
                nbytes = c.state_bytes.get(layer, 0)
                landed = max(begin, self.issued.pop(layer))
                waiting.pop(0)
                if waiting and waiting[0][0] <= begin:  # queued when this update began: its read is issued now
                    self.read(waiting[0][1], landed)
                end = landed + c.update_ms[layer]
                self.disk_free = max(end, self.disk_free) + nbytes / c.write_bytes_per_ms
                self.disk_ms += nbytes / c.read_bytes_per_ms + nbytes / c.write_bytes_per_ms
                self.disk_bytes += 2 * nbytes
                self.updates += 1
            else:
                end = begin + c.update_ms[layer]
            self.worker_free = ends[layer] = end
        return ends


def simulate_state(
    costs: StateCosts, streamed: Iterable[int], spilled: Iterable[int], steps: int = GREEDY_STEPS
) -> StateTimes:
    """The last of ``steps`` replayed steps with the states of ``spilled`` (trained layers) on disk (the module
    doc)."""
    replay = _replay(costs, streamed, spilled, steps)
    last = steps - 1
    step = replay.step_end[last] - replay.step_end[last - 1] if steps > 1 else replay.step_end[last]
    return StateTimes(step, replay.disk_ms[last], replay.disk_bytes[last], replay.updates[last])


def state_windows(costs: StateCosts, streamed: Iterable[int]) -> dict[int, float]:
    """Per trained layer, with nothing on disk: how long after its update's end (in a steady step) its fetch in the
    next step could start, but for that update (negative: the fetch waits for it already)."""
    replay = _replay(costs, streamed, (), GREEDY_STEPS)
    ends, ready = replay.update_end[-2], replay.fetch_ready[-1]
    return {layer: ready[layer] - end for layer, end in ends.items() if layer in ready}


def update_order(costs: StateCosts, streamed: Iterable[int]) -> list[int]:
    """The trained layers in the order their updates run (the backward's, or layer order after it)."""
    streamed = set(streamed)
    trained = set(costs.update_ms) & streamed
    if costs.after_backward:
        return sorted(trained)
    order: list[int] = []
    for use in reversed(costs.uses):  # each layer's last backward use, in the order they end
        if use.phase is Phase.BACKWARD and use.layer in trained and use.layer not in order:
            order.append(use.layer)
    return order[::-1]


def choose_state_spilled(
    costs: StateCosts,
    streamed: Sequence[int],
    candidates: Iterable[int],
    over: Callable[[list[int]], int],
    tried: int = MAX_TRIED,
) -> list[int]:
    """Trained layers (of ``candidates``) whose state goes to disk, until ``over(chosen)`` (bytes over the host RAM
    budget with ``chosen`` spilled, the ``SLOTS`` buffers included) is no more than 0 (the module doc). Returns every
    candidate when no choice fits (the caller spills weights too, or refuses)."""
    wanted = set(candidates)
    order = [i for i in update_order(costs, streamed) if i in wanted and costs.state_bytes.get(i, 0) > 0]

    def score(chosen: list[int]) -> tuple[float, int]:
        times = simulate_state(costs, streamed, chosen)
        return times.step_ms, times.disk_bytes

    position = {layer: k for k, layer in enumerate(order)}
    windows = state_windows(costs, streamed)
    return choose_by_model(order, windows, costs.state_bytes, score, over, position, 1, tried, spread_tries=True)


@dataclass(frozen=True)
class StateForecast:
    """The prediction the start-up line says: which layers' state is on disk, the disk floor, the time added."""

    costs: StateCosts
    spilled: tuple[int, ...]
    trained: int
    with_disk: StateTimes
    in_ram: StateTimes

    @property
    def floor_ms(self) -> float:
        """The disk thread's busy time a step (reads and write-backs): no step is faster."""
        return self.with_disk.disk_ms

    @property
    def added_ms(self) -> float:
        return self.with_disk.step_ms - self.in_ram.step_ms

    @property
    def hides(self) -> bool:
        return self.added_ms <= HIDDEN_MS + 0.01 * self.in_ram.step_ms

    def line(self) -> str:
        c = self.costs
        compute = "compute measured" if c.measured else "compute estimated from param counts"
        compute += ", updates from a timed host step" if c.updates_timed else ", updates at a nominal rate"
        when = "during the backward"
        if c.after_backward:
            unspeculated = "; no layer speculates with states on disk" if c.speculates_in_ram else ""
            when = f"after the backward (clipping{unspeculated})"
        said = (
            f"DGLS disk state plan: the fp32 masters and optimizer state of {len(self.spilled)} of {self.trained} "
            f"trained layers on disk (layers {index_ranges(self.spilled)}), "
            f"{human_bytes(self.with_disk.disk_bytes // 2)} read and written back a step at "
            f"{c.read_bytes_per_ms / 1e6:.2f} GB/s: disk floor {_ms(self.floor_ms)} "
            f"against {_ms(c.compute_ms)} of compute and {_ms(c.updates_ms)} of host updates a step ({compute}; the "
            f"updates run {when}); predicted step {_ms(self.with_disk.step_ms)}, {_ms(self.in_ram.step_ms)} with "
            "every state in RAM" + (" (speculating)" if c.after_backward and c.speculates_in_ram else "")
        )
        if self.hides:
            return said + ": the state's reads and write-backs hide behind the step"
        return said + f": they add {_ms(self.added_ms)} (raise --host_ram_budget)"


def forecast_state(costs: StateCosts, streamed: Sequence[int], spilled: Iterable[int]) -> StateForecast:
    spilled = tuple(sorted(set(spilled)))
    trained = len(set(costs.update_ms) & set(streamed))
    in_ram = dataclasses.replace(costs, after_backward=False) if costs.speculates_in_ram else costs
    return StateForecast(
        costs, spilled, trained, simulate_state(costs, streamed, spilled), simulate_state(in_ram, streamed, ())
    )


def _ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 100 else f"{value:.3g} ms"
