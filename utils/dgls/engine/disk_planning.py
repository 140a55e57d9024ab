"""Disk planning at build: the disk plan's inputs (:mod:`..planning.disk_plan`) from the layouts, the placement and
two measured bandwidths, as the chooser :func:`~..streaming.tiers.plan_tiers` calls.

- Lazy: nothing is measured unless something must spill (``over([])`` above 0): a budget that holds every master
  writes nothing to disk.
- The disk's read bandwidth: :func:`~..memory.disk_tier.probe_read_gbps` in the run's disk directory, before any
  layer is packed, through the reader the tier will use; the tier keeps the figure for its start-up line.
- The copy bandwidth: on CUDA a few timed copies of page-locked bytes (unlocked after); on the CPU the planner's
  nominal one.
- Compute: the VRAM planner measures it on step 2, after the build; here it is estimated from param counts (each
  layer computing a step for as long as its two copies take, the break-even of streaming), and the line says so;
  without a VRAM budget :mod:`..planning.disk_check` says it again after pass 2, with that pass's compute measured.
  A layer-major step (``layer_major_micro_batches`` N) computes its N micro-batches at each fetch: both choosers
  cost its uses at N times one micro-batch's compute (:func:`step_uses`, one rule for both).
  With a VRAM budget the planner's own predictions use the measured compute and the reads of the layers chosen here
  (:attr:`~..planning.planner.StepProfile.read_ms`).
- Full fine-tuning (:class:`StateChoice`): which layers' fp32 masters and optimizer state go to disk, by the state
  plan (:mod:`..planning.state_plan`), from the same probes (one of each per build), each layer's extent, and its
  host update's time from its param count at the rate of one timed step of the run's optimizer over
  ``UPDATE_PROBE_PARAMS`` params (:func:`host_update_params_per_ms`; DeepSpeed's op, built on the first update, at a
  nominal ``HOST_UPDATE_PARAMS_PER_MS``, and the line says so); the updates run after the backward under exact
  clipping (spilled layers do not speculate), else as each layer's gradients come home (``clip_mode``
  ``previous_norm`` included: from step 2 its updates start at the previous step's coefficient, and the plan is of
  the steady step, not of step 1, which waits for its own norm).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..memory.disk_tier import PROBE_BYTES, probe_read_gbps
from ..memory.layout import LayerLayout, TrainingLayout
from ..memory.pinned import page_aligned_empty, register, unregister, whole_pages
from ..planning.autoplan import CPU_BYTES_PER_MS
from ..planning.disk_plan import DiskCosts, DiskForecast, choose_spilled, forecast
from ..planning.planner import UseTiming
from ..planning.state_plan import StateCosts, StateForecast, choose_state_spilled, forecast_state
from ..streaming.placement import Placement
from ..streaming.schedule import Phase
from ..streaming.tiers import RING_BUFFERS
from ..training.disk_state import extent_pieces
from ..training.host_optimizer import HostOptimizerSpec

COPY_PROBE_BYTES = 64 * 1024 * 1024
BACKWARD_SHARE = 2.0  # an estimated backward use computes this many times its forward
HOST_UPDATE_PARAMS_PER_MS = 300_000  # a nominal host AdamW step (fp32 master, two moments): params per ms
UPDATE_PROBE_PARAMS = 2 * 1024 * 1024  # params of the timed host step (its tensors freed after)


class DiskChoice:
    """The chooser for :func:`~..streaming.tiers.plan_tiers`; after it ran, :attr:`costs` and :meth:`forecast`."""

    def __init__(
        self,
        layouts: Sequence[LayerLayout],
        placement: Placement,
        device: torch.device,
        directory,
        layer_major_micro_batches: int = 1,
        read_ahead: bool = True,
    ) -> None:
        self.layouts = layouts
        self.read_ahead = read_ahead  # the engine reads spilled layers ahead (not with full fine-tuning)
        self.placement = placement
        self.device = device
        self.directory: str | Path | None = directory
        # micro-batches a step layer-major: each use (one fetch, one read) computes all of them
        self.layer_major_micro_batches = max(1, layer_major_micro_batches)
        self.costs: DiskCosts | None = None
        self.read_gbps = 0.0
        self._probed: tuple[float, float] | None = None

    def __call__(self, candidates: Sequence[int], over: Callable[[list[int]], int]) -> list[int]:
        if over([]) <= 0:
            return []
        streamed = self.placement.streamed
        read_per_ms, copy_per_ms = self.probe()
        self.costs = DiskCosts(
            uses=step_uses(self.estimated_uses(), self.layer_major_micro_batches),
            copy_bytes={i: self.layouts[i].host_bytes for i in streamed},
            read_bytes={i: whole_pages(self.layouts[i].host_bytes) for i in streamed},
            copy_bytes_per_ms=copy_per_ms,
            read_bytes_per_ms=read_per_ms,
            prefetch=self.placement.prefetch,
            ring=RING_BUFFERS,
            read_ahead=self.read_ahead,
        )
        return choose_spilled(self.costs, [i for i in streamed if i in set(candidates)], over)

    def probe(self) -> tuple[float, float]:
        """The disk's read bandwidth and the copy bandwidth in bytes per ms, measured on the first call only."""
        if self._probed is None:
            streamed = self.placement.streamed
            sizes = [whole_pages(self.layouts[i].host_bytes) for i in streamed]
            self.read_gbps, _ = probe_read_gbps(
                self.directory,
                min(sum(sizes), PROBE_BYTES),
                pin=self.device.type == "cuda",
                request=max(sizes, default=1),
            )
            self._probed = (max(self.read_gbps, 1e-6) * 1e6, copy_bytes_per_ms(self.device))
        return self._probed

    def estimated_uses(self) -> tuple[UseTiming, ...]:
        """One micro-batch's pass of uses without a probe (:func:`estimated_uses`), computing as long as its copies of
        every streamable byte both ways take at the probed copy bandwidth."""
        step_copies_ms = 2 * sum(layout.sizes.streamable_bytes for layout in self.layouts) / self.probe()[1]
        return estimated_uses(self.layouts, step_copies_ms)

    def forecast(self, spilled: Sequence[int]) -> DiskForecast | None:
        if self.costs is None:
            return None
        return forecast(self.costs, self.placement.streamed, spilled)


class StateChoice:
    """The chooser of the layers whose masters and optimizer state spill, for
    :func:`~..training.disk_state.plan_full_tiers`: the state plan over ``disk``'s probes and layouts (the module
    doc); after it ran, :attr:`costs` and :meth:`forecast`."""

    def __init__(
        self,
        disk: DiskChoice,
        trained: TrainingLayout,
        spec: HostOptimizerSpec,
        clipping: bool,
        passes: int = 1,
        layer_major_micro_batches: int = 1,
        clip_mode: str = "exact",
    ) -> None:
        self.disk = disk
        self.trained = trained
        self.spec = spec
        # layer -> bytes of its extent (whole pages): read and written back per update
        self.extents = {i: whole_pages(extent_pieces(trained, i)[1]) for i in trained.layers}
        # every update waits for the norm, after the backward: exact clipping only (previous_norm's start as their
        # gradients land, at the previous step's coefficient, from step 2)
        self.waits_for_norm = clipping and clip_mode == "exact"
        self.passes = max(1, passes)  # micro-batches a step one after another (the updates follow the last)
        # micro-batches a step layer-major: each use (one fetch) computes all of them
        self.layer_major_micro_batches = max(1, layer_major_micro_batches)
        self.costs: StateCosts | None = None

    def __call__(self, candidates: Sequence[int], over: Callable[[list[int]], int]) -> list[int]:
        if over([]) <= 0:
            return []
        d = self.disk
        read_per_ms, copy_per_ms = d.probe()
        streamed = d.placement.streamed
        rate, timed = host_update_params_per_ms(self.spec)
        self.costs = StateCosts(
            uses=self.step_uses(),
            copy_bytes={i: d.layouts[i].host_bytes for i in streamed},
            state_bytes=dict(self.extents),
            update_ms={i: place.numel / rate for i, place in self.trained.layers.items()},
            copy_bytes_per_ms=copy_per_ms,
            read_bytes_per_ms=read_per_ms,
            write_bytes_per_ms=read_per_ms,  # write-backs reach the same disk, eventually at its pace
            prefetch=d.placement.prefetch,
            after_backward=self.waits_for_norm,
            updates_timed=timed,
            speculates_in_ram=self.waits_for_norm and bool(self.trained.spares_wanted),  # before the spill turns it off
        )
        return choose_state_spilled(self.costs, streamed, candidates, over)

    def step_uses(self) -> tuple[UseTiming, ...]:
        """One step's uses (:func:`step_uses`): the updates follow the last of its sequential passes."""
        return step_uses(self.disk.estimated_uses(), self.layer_major_micro_batches, self.passes)

    def forecast(self, spilled: Sequence[int]) -> StateForecast | None:
        if self.costs is None:
            return None
        return forecast_state(self.costs, self.disk.placement.streamed, spilled)


def step_uses(
    pass_uses: Sequence[UseTiming], layer_major_micro_batches: int = 1, passes: int = 1
) -> tuple[UseTiming, ...]:
    """One step's uses from one micro-batch's pass: each use computing for all of a layer-major step's micro-batches
    (one fetch serves them), the pass repeated for micro-batches one after another (each fetches again).

    - The disk plan (:class:`DiskChoice`) costs one pass (``passes`` 1): its step repeats whole, so a sequential
      pass repeats it as the next step does; the state plan's updates follow the last pass, so it counts them all."""
    uses = tuple(pass_uses)
    if layer_major_micro_batches > 1:
        uses = tuple(UseTiming(u.layer, u.phase, u.compute_ms * layer_major_micro_batches) for u in uses)
    return uses * max(1, passes)


def host_update_params_per_ms(spec: HostOptimizerSpec) -> tuple[float, bool]:
    """Params a host update steps per ms, and whether it was timed: one step of ``spec``'s optimizer over
    ``UPDATE_PROBE_PARAMS`` fp32 params timed after a first one (which makes its state); DeepSpeed's CPU Adam (a C++
    op built on its first use, said then) at the nominal rate."""
    if spec.implementation == "deepspeed":
        return HOST_UPDATE_PARAMS_PER_MS, False
    master = torch.zeros(UPDATE_PROBE_PARAMS)
    master.grad = torch.full_like(master, 1e-3)
    optimizer = spec.build([master])
    optimizer.step()
    began = time.perf_counter()
    optimizer.step()
    ms = (time.perf_counter() - began) * 1000
    return (UPDATE_PROBE_PARAMS / ms if ms > 0 else HOST_UPDATE_PARAMS_PER_MS), True


def estimated_uses(layouts: Sequence[LayerLayout], scale_ms: float) -> tuple[UseTiming, ...]:
    """A step's uses without a probe: every layer forward in order, then backward in reverse, each computing in
    proportion to its params (a backward ``BACKWARD_SHARE`` times its forward), scaled so the step computes for
    ``scale_ms``."""
    params = [sum(p.param.numel() for p in layout.params) for layout in layouts]
    weight = sum(params) * (1 + BACKWARD_SHARE) or 1
    per = scale_ms / weight
    forward = [UseTiming(i, Phase.FORWARD, n * per) for i, n in enumerate(params)]
    backward = [UseTiming(i, Phase.BACKWARD, n * per * BACKWARD_SHARE) for i, n in reversed(list(enumerate(params)))]
    return tuple(forward + backward)


def copy_bytes_per_ms(device: torch.device) -> float:
    """Host-to-device bytes per ms: a few timed copies of pinned bytes on CUDA; the planner's nominal figure on the
    CPU (no copies to time)."""
    if device.type != "cuda":
        return CPU_BYTES_PER_MS
    src = page_aligned_empty(COPY_PROBE_BYTES)  # page-locked here and unlocked after (torch's pinned cache would
    pointers = register(src)  # keep it for the run, RAM the host RAM budget counts on)
    try:
        dst = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        del dst
    finally:
        unregister(pointers)
    return 3 * COPY_PROBE_BYTES / ms if ms > 0 else CPU_BYTES_PER_MS
