"""Tiers: which streamed layers keep their master in host RAM and which in the disk tier's file.

With a host RAM budget (``host_ram_budget``: GiB, or ``auto``: the RAM the machine can spare beside its
reserve, as the pinned-RAM default reckons it), the masters DGLS keeps in RAM, plus the disk tier's staging
ring, must fit it; streamed layers that do not fit are spilled to disk (:mod:`..memory.disk_tier`).

Policy (:func:`plan_tiers`)
    - Only streamed layers spill (a resident layer with an fp8 master keeps it in RAM: re-placement reads it).
    - Which: the builder's ``choose`` (the disk plan, :mod:`..planning.disk_plan`: the layers whose reads hide behind
      the longest compute, from the step's order and the measured bandwidths), given the candidates in the order they
      run and the bytes a choice leaves over the budget. It returns a choice that fits whenever spilling every
      candidate does (:func:`~..planning.disk_plan.choose_spilled`: its greedy over every size ends with all of them),
      else every candidate (then the line below); a chooser that breaks this is a DGLS bug (an assertion), never a
      silent spill of every layer. Without one (direct callers):
    - The layers read least often per step spill first (``reads``: uses per step; every streamed layer is read
      alike by default, a LoRA step's forward and backward); among those read alike, as few as fit, spread evenly
      over the order the layers run in: each disk read then overlaps the compute and copies of the RAM layers
      before it (the reads of a contiguous run of disk layers could run only as far ahead as the staging ring).
    - The staging ring (``RING_BUFFERS`` buffers of the largest spilled layer) counts against the budget. Two: the
      engine reads the next spilled layer ahead into one while the other's is copied to the device
      (:meth:`~..engine.swapper.LayerSwapper.read_ahead`), so the disk reads on between fetches; a third would let
      the reads run further ahead over a run of spilled layers, at a layer's RAM (a copy takes a small part of a
      read's time: PCIe is many times faster than a disk). Spreading the spilled layers over the order keeps such
      runs short.
    - A budget that cannot be met with every streamed layer spilled is one clear line, before anything is packed.
    - Full fine-tuning: the layers' fp32 masters and optimizer state spill first (read once a step, by the update;
      which layers': the state plan, :mod:`..planning.state_plan`), the weights only once every state is on disk
      (:func:`~..training.disk_state.plan_full_tiers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import DGLSUserError
from ..memory.host_store import HostStore, default_pinned_budget
from ..memory.layout import GiB, LayerLayout, human_bytes
from ..memory.pinned import whole_pages

RING_BUFFERS = 2
# (candidates in run order, over(spilled): bytes over the budget) -> the layers to spill: the builder's disk plan
Chooser = Callable[[Sequence[int], Callable[[list[int]], int]], list[int]]


@dataclass(frozen=True)
class Tiers:
    """The masters' tiers: ``spilled`` (layer index -> host bytes) live on disk, the other hosted ones in RAM."""

    budget: int
    ram_bytes: int  # masters kept in RAM
    ring_count: int
    spilled: dict[int, int] = field(default_factory=dict)
    states: int = 0  # full fine-tuning: layers whose fp32 masters and optimizer state live on disk
    # the plans' lines (set by the builder): the state plan's (a full fine-tune's states on disk), then the disk plan's
    # (the disk floor against the step's compute)
    forecast: tuple[str, ...] = ()

    @property
    def ring_bytes(self) -> int:
        return self.ring_count * max((whole_pages(n) for n in self.spilled.values()), default=0)

    def line(self) -> str:
        if self.states:
            weights = (
                f"; {len(self.spilled)} streamed layers' weights ({human_bytes(sum(self.spilled.values()))}) are read "
                "from disk every time they stream"
                if self.spilled
                else "; every streamed layer's weights stay in RAM"
            )
            return (
                f"DGLS host RAM budget {human_bytes(self.budget)}: the fp32 masters and optimizer state of "
                f"{self.states} streamed layers are read from disk for their update and written back after it" + weights
            )
        if not self.spilled:
            return (
                f"DGLS host RAM budget {human_bytes(self.budget)}: every streamed layer's master fits in RAM "
                f"({human_bytes(self.ram_bytes)}); nothing is read from disk"
            )
        return (
            f"DGLS host RAM budget {human_bytes(self.budget)}: {human_bytes(self.ram_bytes)} of masters in RAM + "
            f"{human_bytes(self.ring_bytes)} of staging ring; {len(self.spilled)} streamed layers "
            f"({human_bytes(sum(self.spilled.values()))}) are read from disk every time they stream"
        )


def resolve_ram_budget(value: float | str, on_cpu: int) -> int:
    """``host_ram_budget`` in bytes: GiB as given, or ``auto`` (available RAM, plus what packing the model's CPU
    params gives back, less the reserve: :func:`~..memory.host_store.default_pinned_budget`)."""
    if value == "auto":
        return default_pinned_budget(on_cpu)
    return int(float(value) * GiB)


def plan_tiers(
    layouts: Sequence[LayerLayout],
    hosted: Sequence[int],
    streamed: Sequence[int],
    budget: int,
    ring_count: int,
    reads: Mapping[int, int] | None = None,
    choose: Chooser | None = None,
) -> Tiers:
    """Spill streamed layers until the RAM masters and the ring fit ``budget``: those ``choose`` picks, or without it
    the least read first, spread over the order."""
    size = {i: layouts[i].host_bytes for i in hosted}
    ram = sum(whole_pages(n) for n in size.values())
    candidates = [i for i in sorted(streamed) if size.get(i, 0) > 0]  # the order they run in
    reads = reads or {}

    def tiers_for(spilled: list[int]) -> Tiers:
        left = ram - sum(whole_pages(size[i]) for i in spilled)
        return Tiers(budget, left, ring_count, {i: size[i] for i in sorted(spilled)})

    def over(spilled: list[int]) -> int:
        tiers = tiers_for(spilled)
        return tiers.ram_bytes + tiers.ring_bytes - budget

    tiers, fixed = tiers_for([]), []
    if choose is not None:
        chosen = choose(candidates, over)
        if over(chosen) > 0 and over(candidates) <= 0:  # not the user's to fix: the chooser broke its contract
            raise AssertionError(
                f"the disk plan chose {len(chosen)} of {len(candidates)} streamed layers to spill, "
                f"{human_bytes(over(chosen))} over the host RAM budget, where spilling all of them fits it: a "
                "chooser's choice must fit whenever spilling every candidate does"
            )
        tiers = tiers_for(chosen if over(chosen) <= 0 else candidates)  # nothing fits: refused below
    for level in sorted({reads.get(i, 1) for i in candidates}) if choose is None else ():
        group = [i for i in candidates if reads.get(i, 1) == level]
        for k in range(len(group) + 1):
            tiers = tiers_for(fixed + spread(group, k))
            if tiers.ram_bytes + tiers.ring_bytes <= budget:
                return tiers
        fixed += group
    if tiers.ram_bytes + tiers.ring_bytes > budget:
        need = tiers.ram_bytes + tiers.ring_bytes
        least = math.ceil(need / GiB * 100) / 100
        raise DGLSUserError(
            f"host_ram_budget {human_bytes(budget)} is too small: with every streamed layer on disk DGLS still "
            f"keeps {human_bytes(need)} in RAM ({ring_count} staging buffers of the largest layer"
            + (f", {human_bytes(tiers.ram_bytes)} of resident layers' fp8 masters" if tiers.ram_bytes else "")
            + f"): raise host_ram_budget to at least {least:.2f}"
        )
    return tiers


def spread(order: Sequence[int], k: int) -> list[int]:
    """``k`` of ``order``, evenly spaced (the middle of each of ``k`` equal stretches)."""
    return [order[int((j + 0.5) * len(order) / k)] for j in range(k)] if k else []


def tier_labels(store: HostStore) -> dict[int, str]:
    """Where each hosted layer's master lives, for the placement table: disk, pinned RAM or (pageable) RAM."""
    return {i: "disk" if h.on_disk else "pinned RAM" if h.pinned else "RAM" for i, h in store.layers.items()}
