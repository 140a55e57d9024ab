"""Tiers: which streamed layers keep their master in host RAM and which in the disk tier's file.

With a host RAM budget (``host_ram_budget``: GiB, or ``auto``: the RAM the machine can spare beside its
reserve, as the pinned-RAM default reckons it), the masters DGLS keeps in RAM, plus the disk tier's staging
ring, must fit it; streamed layers that do not fit are spilled to disk (:mod:`..memory.disk_tier`).

Policy (:func:`plan_tiers`)
    - Only streamed layers spill (a resident layer with an fp8 master keeps it in RAM: re-placement reads it).
    - The layers read least often per step spill first (``reads``: uses per step; every streamed layer is read
      once per pass by default, a LoRA step's forward and backward alike), then the largest (fewer layers
      spilled for the same bytes), then the later ones; spilling stops as soon as the rest fits.
    - The staging ring (``ring_count`` buffers of the largest spilled layer) counts against the budget.
    - A budget that cannot be met with every streamed layer spilled is one clear line, before anything is packed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import DGLSUserError
from ..memory.host_store import default_pinned_budget
from ..memory.layout import GiB, LayerLayout, human_bytes
from ..memory.pinned import whole_pages


@dataclass(frozen=True)
class Tiers:
    """The masters' tiers: ``spilled`` (layer index -> host bytes) live on disk, the other hosted ones in RAM."""

    budget: int
    ram_bytes: int  # masters kept in RAM
    ring_count: int
    spilled: dict[int, int] = field(default_factory=dict)

    @property
    def ring_bytes(self) -> int:
        return self.ring_count * max((whole_pages(n) for n in self.spilled.values()), default=0)

    def line(self) -> str:
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
) -> Tiers:
    """Spill streamed layers (the least read, then the largest) until the RAM masters and the ring fit ``budget``."""
    size = {i: layouts[i].host_bytes for i in hosted}
    ram = sum(whole_pages(n) for n in size.values())
    candidates = sorted(
        (i for i in streamed if size.get(i, 0) > 0),
        key=lambda i: ((reads or {}).get(i, 1), -size[i], -i),
    )
    spilled: dict[int, int] = {}
    tiers = Tiers(budget, ram, ring_count)
    for i in candidates:
        if tiers.ram_bytes + tiers.ring_bytes <= budget:
            return tiers
        spilled[i] = size[i]
        ram -= whole_pages(size[i])
        tiers = Tiers(budget, ram, ring_count, dict(spilled))
    if tiers.ram_bytes + tiers.ring_bytes > budget:
        need = tiers.ram_bytes + tiers.ring_bytes
        least = math.ceil(need / GiB * 100) / 100
        raise DGLSUserError(
            f"host_ram_budget {human_bytes(budget)} is too small: with every streamed layer on disk DGLS still "
            f"keeps {human_bytes(need)} in RAM ({ring_count} staging buffers of the largest layer"
            + (f", {human_bytes(tiers.ram_bytes)} of resident layers' fp8 masters" if tiers.ram_bytes else "")
            + f"): raise host_ram_budget to at least {least:.2f}, or lower --prefetch (fewer staging buffers)"
        )
    return tiers


def tier_labels(store) -> dict[int, str]:
    """Where each hosted layer's master lives, for the placement table: disk, pinned RAM or (pageable) RAM."""
    return {i: "disk" if h.on_disk else "pinned RAM" if h.pinned else "RAM" for i, h in store.layers.items()}
