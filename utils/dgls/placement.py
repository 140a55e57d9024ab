"""Placement: which layers stay resident on the device and which stream, in bytes."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .config import SwapConfig
from .errors import DGLSUserError
from .precision import CastRules, scale_count

MB = 1024 * 1024
ALIGN = 256  # bytes: every packed param starts on this boundary (safe for any dtype view)


def aligned(nbytes: int) -> int:
    """Round up to the packing alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LayerSizes:
    """Byte sizes of one layer, measured from its tensors (layers are never assumed equal)."""

    index: int
    class_name: str
    streamable_bytes: int  # frozen params owned by this layer alone (as they are: what a resident layer holds)
    fixed_bytes: int  # trainable params, buffers and shared params: always resident
    # When streamed with cast_target (None: no cast, same as streamable_bytes):
    cast_slot_bytes: int | None = None  # the slot it needs (params in their compute dtypes)
    cast_copy_bytes: int | None = None  # bytes copied per fetch (stored dtypes: fp8 halves bf16)
    landing_bytes: int = 0  # fp8 bytes that land in a copy-stream buffer before their upcast
    scale_bytes: int = 0  # fp32 fp8 scales, resident on the device

    @property
    def slot_bytes(self) -> int:
        """Device slot bytes of this layer when it streams."""
        return self.streamable_bytes if self.cast_slot_bytes is None else self.cast_slot_bytes

    @property
    def copy_bytes(self) -> int:
        """Bytes moved host-to-device per fetch when it streams."""
        return self.streamable_bytes if self.cast_copy_bytes is None else self.cast_copy_bytes


@dataclass(frozen=True)
class Placement:
    """The result of planning: resident and streamed layer indices plus the pool size."""

    sizes: tuple[LayerSizes, ...]
    streamed: tuple[int, ...]
    slot_count: int
    slot_bytes: int
    landing_bytes: int = 0  # all copy streams' fp8 landing buffers together

    @property
    def resident(self) -> tuple[int, ...]:
        streamed = set(self.streamed)
        return tuple(s.index for s in self.sizes if s.index not in streamed)

    @property
    def resident_weight_bytes(self) -> int:
        streamed = set(self.streamed)
        weights = sum(s.fixed_bytes + (0 if s.index in streamed else s.streamable_bytes) for s in self.sizes)
        return weights + sum(self.sizes[i].scale_bytes for i in self.streamed)

    @property
    def pool_bytes(self) -> int:
        return self.slot_count * self.slot_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied to fetch every streamed layer once (after cast_target)."""
        return sum(self.sizes[i].copy_bytes for i in self.streamed)

    @property
    def predicted_device_bytes(self) -> int:
        """Weights + buffers + pool (+ fp8 landing buffers): known before step 1 (activations come on top)."""
        return self.resident_weight_bytes + self.pool_bytes + self.landing_bytes

    def table(self) -> str:
        """The start-up placement table: index, class, MB, where it lives."""
        streamed = set(self.streamed)
        lines = [f"{'idx':>4}  {'layer':<28} {'MB':>9}  placement"]
        for s in self.sizes:
            total = (s.streamable_bytes + s.fixed_bytes) / MB
            if s.index in streamed:
                where = "streamed"
                if s.fixed_bytes:
                    where += f" ({s.fixed_bytes / MB:.1f} MB trainable/buffers resident)"
            else:
                where = "resident"
            lines.append(f"{s.index:>4}  {s.class_name[:28]:<28} {total:>9.1f}  {where}")
        lines.append(
            f"resident weights+buffers {self.resident_weight_bytes / MB:.1f} MB + pool "
            f"{self.slot_count} x {self.slot_bytes / MB:.1f} MB = {self.predicted_device_bytes / MB:.1f} MB "
            f"on the device before activations; {len(self.streamed)} layers "
            f"({self.streamed_bytes / MB:.1f} MB) stream"
        )
        return "\n".join(lines)


def measure_layer(index: int, layer: nn.Module, shared: set[int], rules: CastRules | None = None) -> LayerSizes:
    """Split a layer's bytes into what can stream (frozen, unshared params) and what stays;
    with ``rules`` also what it takes when streamed after cast_target (as host_store lays it out)."""
    streamable = fixed = slot = copy = landing = scales = 0
    casts = rules.plan(layer) if rules else {}
    for p in layer.parameters():
        nbytes = p.numel() * p.element_size()
        if p.requires_grad or id(p) in shared:
            fixed += nbytes
            continue
        streamable += aligned(nbytes)
        cast = casts.get(id(p))
        if cast is None:
            slot += aligned(nbytes)
            copy += aligned(nbytes)
            continue
        stored = aligned(p.numel() * cast.stored.itemsize)
        slot += aligned(p.numel() * cast.dtype.itemsize)
        copy += stored
        if cast.scaled:
            landing += stored
            scales += 4 * scale_count(p.shape)
    for b in layer.buffers():
        fixed += b.numel() * b.element_size()
    if not casts:
        return LayerSizes(index, type(layer).__name__, streamable, fixed)
    return LayerSizes(index, type(layer).__name__, streamable, fixed, slot, copy, landing, scales)


def modules_of(layers: list) -> list[tuple[int, nn.Module]]:
    """(index, module) of the entries that are modules: a layer list may hold plain functions between
    blocks (diffusion-pipe's Chroma and HunyuanVideo concatenate streams in one); they have no weights."""
    return [(i, layer) for i, layer in enumerate(layers) if isinstance(layer, nn.Module)]


def shared_param_ids(layers: list) -> set[int]:
    """Params that appear in more than one layer (tied weights) must stay resident."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, layer in modules_of(layers):
        for p in layer.parameters():
            if owner.setdefault(id(p), i) != i:
                shared.add(id(p))
    return shared


def choose_streamed(sizes: list[LayerSizes], config: SwapConfig) -> list[int]:
    """Apply the placement settings to the measured layers; raise on settings that don't fit."""
    n = len(sizes)
    candidates = [s.index for s in sizes if s.streamable_bytes > 0]
    if config.gpu_layers is not None:
        bad = [i for i in config.gpu_layers if not 0 <= i < n]
        if bad:
            raise DGLSUserError(f"gpu_layers {bad} out of range: the model has {n} layers (0..{n - 1})")
        keep = set(config.gpu_layers)
        return [i for i in candidates if i not in keep]
    if config.blocks_to_swap is not None:
        if config.blocks_to_swap > len(candidates):
            raise DGLSUserError(
                f"blocks_to_swap={config.blocks_to_swap} but only {len(candidates)} of the {n} layers "
                f"have frozen weights that can stream: set blocks_to_swap <= {len(candidates)}"
            )
        keep = len(candidates) - config.blocks_to_swap
        head = (keep + 1) // 2  # resident layers split between the two ends: they cover the turnarounds
        return candidates[head : len(candidates) - (keep - head)]
    initial = 1 if config.initial_gpu_layers is None else config.initial_gpu_layers
    final = 1 if config.final_gpu_layers is None else config.final_gpu_layers
    for name, value in (("initial_gpu_layers", initial), ("final_gpu_layers", final)):
        if value > n:
            raise DGLSUserError(f"{name}={value} but the model has only {n} layers")
    return [i for i in candidates if initial <= i < n - final]


def plan_placement(layers: list[nn.Module], config: SwapConfig) -> Placement:
    """Measure the layers and decide placement and pool size."""
    shared = shared_param_ids(layers)
    rules = CastRules.from_config(config)
    sizes = [
        measure_layer(i, layer, shared, rules)
        if isinstance(layer, nn.Module)
        else LayerSizes(i, getattr(layer, "__name__", type(layer).__name__), 0, 0)
        for i, layer in enumerate(layers)
    ]
    streamed = choose_streamed(sizes, config)
    slot_bytes = max((sizes[i].slot_bytes for i in streamed), default=0)
    slot_count = min(len(streamed), config.prefetch + 1)
    landing = max((sizes[i].landing_bytes for i in streamed), default=0) * config.cuda_streams
    return Placement(tuple(sizes), tuple(streamed), slot_count, slot_bytes, landing)
