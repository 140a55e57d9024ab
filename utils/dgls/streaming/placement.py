"""Placement: which layers stay resident and which stream, from the settings, in bytes.

:func:`choose_streamed` applies the explicit settings (``gpu_layers``, ``blocks_to_swap``,
``initial_gpu_layers``/``final_gpu_layers``); with a VRAM budget the planner (``autoplan.py``)
chooses instead. A :class:`Placement` derives every device figure from the layout's memory model
(:mod:`..memory.layout`), the same one the planner predicts with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import DGLSUserError
from ..memory.layout import MB, LayerSizes, device_bytes, pool_bytes, resident_bytes, slot_count, training_bytes
from .config import PlacementPolicy


@dataclass(frozen=True)
class Placement:
    """Resident and streamed layers, the prefetch depth, and what that costs on the device."""

    sizes: tuple[LayerSizes, ...]
    streamed: tuple[int, ...]
    prefetch: int
    copy_streams: int = 1
    update_bytes: int = 0  # full fine-tuning's device update buffers (reserved at start-up, whatever the placement)
    reduce_bytes: int = 0  # data-parallel full fine-tuning's reduction buckets (the backward's, whatever the placement)

    @property
    def resident(self) -> tuple[int, ...]:
        streamed = set(self.streamed)
        return tuple(s.index for s in self.sizes if s.index not in streamed)

    @property
    def slot_count(self) -> int:
        return slot_count(len(self.streamed), self.prefetch)

    @property
    def slot_bytes(self) -> int:
        return max((self.sizes[i].slot_bytes for i in self.streamed), default=0)

    @property
    def landing_bytes(self) -> int:
        """One copy stream's fp8 landing buffer."""
        return max((self.sizes[i].landing_bytes for i in self.streamed), default=0)

    @property
    def resident_weight_bytes(self) -> int:
        return resident_bytes(self.sizes, self.streamed)

    @property
    def pool_bytes(self) -> int:
        return pool_bytes(self.sizes, self.streamed, self.prefetch, self.copy_streams)

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied to fetch every streamed layer once (fp8 storage copies fewer)."""
        return sum(self.sizes[i].copy_bytes for i in self.streamed)

    @property
    def saved_bytes(self) -> int:
        """Device bytes this placement saves against keeping every layer resident (negative: it costs)."""
        return sum(self.sizes[i].streamable_bytes for i in self.streamed) - self.pool_bytes

    @property
    def predicted_device_bytes(self) -> int:
        """Weights, buffers, the pool and device update buffers: what is allocated before step 1 (activations, and a
        full fine-tune's gradients and optimizer state, come on top)."""
        return device_bytes(self.sizes, self.streamed, self.prefetch, self.copy_streams) + self.update_bytes

    @property
    def training_bytes(self) -> int:
        """A full fine-tune's gradients and trainer's optimizer state on the device (:func:`~..memory.layout.
        training_bytes`): allocated by the first backward and optimizer step."""
        return training_bytes(self.sizes, self.streamed)

    def table(self, tiers: Mapping[int, str] | None = None) -> str:
        """The start-up placement table: index, class, MB, where it lives (``tiers``: where a streamed layer's
        master lives, with a host RAM budget: pinned RAM, RAM or disk)."""
        streamed = set(self.streamed)
        units = any(s.part for s in self.sizes)
        width = min(48, max(28, *(len(s.label) + 2 for s in self.sizes))) if units else 28
        lines = [f"{'idx':>4}  {'layer':<{width}} {'MB':>9}  placement"]
        for s in self.sizes:
            total = (s.streamable_bytes + s.fixed_bytes) / MB
            if s.holder:
                where = "swap units below" + (f"; {s.fixed_bytes / MB:.1f} MB of its own resident" if total else "")
            elif s.index in streamed:
                where = "streamed" if tiers is None else f"streamed from {tiers.get(s.index, 'RAM')}"
                if s.fixed_bytes:
                    where += f" ({s.fixed_bytes / MB:.1f} MB trainable/buffers resident)"
            elif not s.streamable_bytes and not s.fixed_bytes:
                where = "no weights"
            else:
                where = "resident"
            name = f"  {s.label}" if s.part else s.label
            lines.append(f"{s.index:>4}  {name[:width]:<{width}} {total:>9.1f}  {where}")
        lines.append(
            f"resident weights+buffers {self.resident_weight_bytes / MB:.1f} MB + pool "
            f"{self.slot_count} x {self.slot_bytes / MB:.1f} MB"
            + (
                f" (+ fp8 landing/scales {(self.pool_bytes - self.slot_count * self.slot_bytes) / MB:.1f} MB)"
                if self.pool_bytes > self.slot_count * self.slot_bytes
                else ""
            )
            + (f" + device update buffers {self.update_bytes / MB:.1f} MB" if self.update_bytes else "")
            + f" = {self.predicted_device_bytes / MB:.1f} MB on the device before activations"
            + (
                f" (+ {self.training_bytes / MB:.1f} MB of the trainer's gradients and optimizer state)"
                if self.training_bytes
                else ""
            )
            + (
                f" (+ {self.reduce_bytes / MB:.1f} MB of data parallel's gradient buckets during the backward)"
                if self.reduce_bytes
                else ""
            )
            + f"; {len(self.streamed)} {'layers and units' if units else 'layers'} "
            f"({self.streamed_bytes / MB:.1f} MB) stream"
        )
        return "\n".join(lines)

    def notes(self) -> list[str]:
        """Start-up warnings about this placement."""
        if self.streamed and self.saved_bytes <= 0:
            return [
                f"DGLS: streaming {len(self.streamed)} layers with prefetch {self.prefetch} needs a pool of "
                f"{self.pool_bytes / MB:.1f} MB, no less than the "
                f"{(self.pool_bytes + self.saved_bytes) / MB:.1f} MB they take resident, so it saves no VRAM: stream "
                "more layers or lower --prefetch (or stream none: --no-dynamic_swapping)"
            ]
        return []


def choose_streamed(sizes: Sequence[LayerSizes], policy: PlacementPolicy) -> list[int]:
    """Apply the explicit placement settings to the measured layers; raise on settings that don't fit.

    The settings name the caller's layers; a layer split into swap units (:mod:`.units`) streams all
    its units or none."""
    n = max(s.owner for s in sizes) + 1
    candidates = sorted({s.owner for s in sizes if s.streamable_bytes > 0})
    if policy.gpu_layers is not None:
        bad = [i for i in policy.gpu_layers if not 0 <= i < n]
        if bad:
            raise DGLSUserError(f"gpu_layers {bad} out of range: the model has {n} layers (0..{n - 1})")
        keep = set(policy.gpu_layers)
        chosen = [i for i in candidates if i not in keep]
    elif policy.blocks_to_swap is not None:
        if policy.blocks_to_swap > len(candidates):
            raise DGLSUserError(
                f"blocks_to_swap={policy.blocks_to_swap} but only {len(candidates)} of the {n} layers "
                f"have frozen weights that can stream: set blocks_to_swap <= {len(candidates)}"
            )
        keep = len(candidates) - policy.blocks_to_swap
        head = (keep + 1) // 2  # resident layers split between the two ends: they cover the turnarounds
        chosen = candidates[head : len(candidates) - (keep - head)]
    else:
        initial = 1 if policy.initial_gpu_layers is None else policy.initial_gpu_layers
        final = 1 if policy.final_gpu_layers is None else policy.final_gpu_layers
        for name, value in (("initial_gpu_layers", initial), ("final_gpu_layers", final)):
            if value > n:
                raise DGLSUserError(f"{name}={value} but the model has only {n} layers")
        chosen = [i for i in candidates if initial <= i < n - final]
    layers = set(chosen)
    return [s.index for s in sizes if s.streamable_bytes > 0 and s.owner in layers]


def plan_placement(
    sizes: Sequence[LayerSizes], policy: PlacementPolicy, copy_streams: int = 1, update_bytes: int = 0
) -> Placement:
    """The placement the explicit settings give (everything streamed under a VRAM budget: the probe);
    ``copy_streams``: the transfer policy's ``cuda_streams``; ``update_bytes``: a full fine-tune's device update
    buffers."""
    if policy.planned:
        streamed = [s.index for s in sizes if s.streamable_bytes > 0]
        return Placement(tuple(sizes), tuple(streamed), 1, copy_streams, update_bytes)
    return Placement(tuple(sizes), tuple(choose_streamed(sizes, policy)), policy.prefetch, copy_streams, update_bytes)
