"""Layout: the one model of where each layer's bytes go, computed once per layer.

Every other part reads its sizes from here: the placement table, the host store (which packs
the params at these offsets), the device pool (slot size), the copier (landing buffers for fp8
storage) and the planner (predicted peak). Nothing else measures a layer.

A layer's params split three ways:

- *streamable*: frozen params owned by this layer alone (and, with the optimizer on the host, its
  trainable ones too). These are what a streamed layer keeps in host memory and copies into a
  device slot before each use.
- *fixed*: trainable params (unless trained on the host), buffers, and params shared with another
  layer (tied weights). They always stay on the device.
- Non-module entries of a layer list (plain functions between blocks, as diffusion-pipe's Chroma
  and HunyuanVideo have) have no params at all.

Slot layout of a streamed layer (one contiguous byte buffer, every param 256-byte aligned)::

    [ params copied as they are ... | fp8-stored params, in their compute dtype ... ]
      ^ host buffer has the same     ^ host buffer has their fp8 bytes; on CUDA they land in a
        bytes at the same offsets      per-stream landing buffer and are upcast into the slot

so the first ``direct_bytes`` travel host-to-slot in one copy, and only fp8 params need a second
step. ``cast_target`` pairs are applied here (:class:`~.precision.CastRules`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .precision import CastRules, dtype_of, scale_count

MB = 1024 * 1024
GiB = 1024**3
ALIGN = 256  # bytes: every packed param starts on this boundary (safe for any dtype view)


def aligned(nbytes: int) -> int:
    """Round up to the packing alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def modules_of(layers: Sequence) -> list[tuple[int, nn.Module]]:
    """(index, module) of the entries that are modules; other entries are weightless functions."""
    return [(i, layer) for i, layer in enumerate(layers) if isinstance(layer, nn.Module)]


def shared_param_ids(layers: Sequence) -> set[int]:
    """Params that appear in more than one layer (tied weights): they must stay resident."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, layer in modules_of(layers):
        for p in layer.parameters():
            if owner.setdefault(id(p), i) != i:
                shared.add(id(p))
    return shared


@dataclass(frozen=True)
class ParamLayout:
    """Where one streamable param lives: ``offset``/``nbytes`` in the slot (``dtype``, what the layer
    computes with) and ``host_offset``/``host_nbytes`` in the host master (``stored``, what is copied).
    ``names`` are its state-dict names relative to the layer (a param can have several)."""

    param: nn.Parameter
    names: tuple[str, ...]
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    stored: torch.dtype
    host_offset: int
    host_nbytes: int

    @property
    def scaled(self) -> bool:
        """Stored as fp8 with per-row fp32 scales, upcast on the device."""
        return self.stored != self.dtype


@dataclass(frozen=True)
class LayerSizes:
    """A layer's byte sizes: what the placement table and the planner reason about.

    Built from a :class:`LayerLayout` (``layout.sizes``); the planner's tests build them directly.
    ``cast_target`` applies wherever a layer lives, so its streamable params take the same device
    bytes resident or in a slot (``streamable_bytes``); only fp8 storage copies fewer bytes.
    """

    index: int
    class_name: str
    streamable_bytes: int  # frozen unshared params in their compute dtypes: device bytes, resident or in a slot
    fixed_bytes: int  # trainable params, buffers and shared params: always resident
    copy: int | None = None  # bytes copied per fetch (None: same as streamable_bytes)
    landing_bytes: int = 0  # fp8 bytes that land in a copy-stream buffer before their upcast
    scale_bytes: int = 0  # fp32 fp8 scales, resident on the device while the layer streams

    @property
    def slot_bytes(self) -> int:
        return self.streamable_bytes

    @property
    def copy_bytes(self) -> int:
        return self.streamable_bytes if self.copy is None else self.copy


@dataclass(frozen=True)
class LayerLayout:
    """One layer: its streamable params laid out for the host buffer and the slot, and its sizes."""

    sizes: LayerSizes
    params: tuple[ParamLayout, ...]  # streamable params, direct ones first, then fp8-stored ones
    direct_bytes: int  # the prefix copied straight into the slot

    @property
    def index(self) -> int:
        return self.sizes.index

    @property
    def slot_bytes(self) -> int:
        return self.sizes.slot_bytes

    @property
    def host_bytes(self) -> int:
        return self.sizes.copy_bytes

    @property
    def landing_bytes(self) -> int:
        return self.sizes.landing_bytes


def measure(
    layers: Sequence, rules: CastRules | None = None, trainable_dtype: str = "auto", host_trained: bool = False
) -> list[LayerLayout]:
    """The layout of every entry of a layer list (functions get an empty one). ``trainable_dtype``: the
    ``mixed_precision`` the trainable params will have ("auto": as they are). ``host_trained``: trainable
    params stream too (full fine-tuning with the optimizer on the host, :mod:`.host_training`)."""
    shared = shared_param_ids(layers)
    return [_measure_one(i, layer, shared, rules, trainable_dtype, host_trained) for i, layer in enumerate(layers)]


def measure_layer(layers: Sequence, index: int, rules: CastRules | None = None) -> LayerLayout:
    """The layout of one entry (after its params changed), with tied weights judged over the whole list."""
    return _measure_one(index, layers[index], shared_param_ids(layers), rules, "auto")


def _measure_one(
    index: int, layer, shared: set[int], rules: CastRules | None, trainable_dtype: str, host_trained: bool = False
) -> LayerLayout:
    if not isinstance(layer, nn.Module):
        name = getattr(layer, "__name__", type(layer).__name__)
        return LayerLayout(LayerSizes(index, name, 0, 0), (), 0)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    fixed = 0
    trainable = dtype_of(trainable_dtype, "mixed_precision") if trainable_dtype != "auto" else None
    trainable_size = trainable.itemsize if trainable is not None else None
    for name, p in layer.named_parameters(remove_duplicate=False):
        if id(p) in names:
            names[id(p)].append(name)
            continue
        names[id(p)] = [name]
        if p.requires_grad and (not host_trained or id(p) in shared):
            fixed += p.numel() * (trainable_size or p.element_size())
        elif id(p) in shared:
            fixed += p.numel() * p.element_size()
        else:
            params[id(p)] = p
    fixed += sum(b.numel() * b.element_size() for b in layer.buffers())
    casts = rules.plan(layer) if rules else {}
    direct = [p for p in params.values() if not (id(p) in casts and casts[id(p)].scaled)]
    scaled = [p for p in params.values() if id(p) in casts and casts[id(p)].scaled]
    laid: list[ParamLayout] = []
    offset = 0
    for p in direct:  # same bytes at the same offsets in host buffer and slot
        dtype = casts[id(p)].dtype if id(p) in casts else (trainable or p.dtype) if p.requires_grad else p.dtype
        nbytes = p.numel() * dtype.itemsize
        laid.append(ParamLayout(p, tuple(names[id(p)]), offset, nbytes, dtype, p.shape, dtype, offset, nbytes))
        offset += aligned(nbytes)
    direct_bytes = host_offset = offset
    scales = 0
    for p in scaled:
        cast = casts[id(p)]
        nbytes, host_nbytes = p.numel() * cast.dtype.itemsize, p.numel() * cast.stored.itemsize
        laid.append(
            ParamLayout(
                p, tuple(names[id(p)]), offset, nbytes, cast.dtype, p.shape, cast.stored, host_offset, host_nbytes
            )
        )
        offset += aligned(nbytes)
        host_offset += aligned(host_nbytes)
        scales += 4 * scale_count(p.shape)
    sizes = LayerSizes(
        index,
        type(layer).__name__,
        offset,
        fixed,
        copy=host_offset if host_offset != offset else None,
        landing_bytes=host_offset - direct_bytes,
        scale_bytes=scales,
    )
    return LayerLayout(sizes, tuple(laid), direct_bytes)


# ---------------------------------------------------------------- the device-memory model
def pool_bytes(sizes: Sequence[LayerSizes], streamed: Iterable[int], prefetch: int, copy_streams: int = 1) -> int:
    """Device bytes streaming needs: ``prefetch + 1`` slots of the largest streamed layer (never more
    slots than streamed layers), each copy stream's fp8 landing buffer, and the fp8 scales."""
    streamed = list(streamed)
    if not streamed:
        return 0
    slots = slot_count(len(streamed), prefetch) * max(sizes[i].slot_bytes for i in streamed)
    landing = copy_streams * max(sizes[i].landing_bytes for i in streamed)
    return slots + landing + sum(sizes[i].scale_bytes for i in streamed)


def slot_count(streamed: int, prefetch: int) -> int:
    """The pool holds the layer in use plus ``prefetch`` ahead, and never more than what streams."""
    return min(streamed, prefetch + 1)


def resident_bytes(sizes: Sequence[LayerSizes], streamed: Iterable[int]) -> int:
    """Weights and buffers that stay on the device: fixed bytes everywhere, streamable bytes of resident layers."""
    streamed = set(streamed)
    return sum(s.fixed_bytes + (0 if s.index in streamed else s.streamable_bytes) for s in sizes)


def device_bytes(sizes: Sequence[LayerSizes], streamed: Iterable[int], prefetch: int, copy_streams: int = 1) -> int:
    """Device memory DGLS places before any activation: resident weights and buffers plus the pool."""
    streamed = list(streamed)
    return resident_bytes(sizes, streamed) + pool_bytes(sizes, streamed, prefetch, copy_streams)
