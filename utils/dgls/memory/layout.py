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

An entry can hold other entries (a layer split into swap units, :mod:`..streaming.units`): a param belongs to the
innermost entry that has it, and every param a holder keeps for itself is fixed (the holder runs its
parts, so its own params are read between their uses).

Slot layout of a streamed layer (one contiguous byte buffer, every param 256-byte aligned)::

    [ params copied as they are ... | fp8-stored params, in their compute dtype ... ]
      ^ host buffer has the same     ^ host buffer has their fp8 bytes; on CUDA they land in a
        bytes at the same offsets      per-stream landing buffer and are upcast into the slot

so the first ``direct_bytes`` travel host-to-slot in one copy, and only fp8 params need a second
step. ``cast_target`` pairs are applied here (:class:`~.precision.CastRules`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .precision import CastRules, dtype_of, scale_count

MB = 1024 * 1024
GiB = 1024**3
ALIGN = 256  # bytes: every packed param starts on this boundary (safe for any dtype view)


def human_bytes(n: float) -> str:
    """GiB for large amounts, MiB for small ones (the demo moves a few MiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def aligned(nbytes: int) -> int:
    """Round up to the packing alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def modules_of(layers: Sequence) -> list[tuple[int, nn.Module]]:
    """(index, module) of the entries that are modules; other entries are weightless functions."""
    return [(i, layer) for i, layer in enumerate(layers) if isinstance(layer, nn.Module)]


@dataclass(frozen=True)
class Ownership:
    """Which entry owns each param: the innermost entry that has it."""

    shared: frozenset[int]  # param ids owned by more than one entry (tied weights): they stay resident
    held: dict[int, frozenset[int]]  # holder entry -> ids of the params and buffers its nested entries have

    @property
    def holders(self) -> frozenset[int]:
        return frozenset(self.held)


def ownership(layers: Sequence) -> Ownership:
    """Tied weights and nesting of a layer list (entries that are submodules of other entries)."""
    modules = modules_of(layers)
    index_of = {id(module): i for i, module in modules}
    inside: dict[int, list[int]] = {}  # holder -> entries nested in it
    for i, module in modules:
        nested = [index_of[id(m)] for m in module.modules() if m is not module and id(m) in index_of]
        if nested:
            inside[i] = nested
    params = {i: {id(p) for p in module.parameters()} for i, module in modules}
    tensors = {i: params[i] | {id(b) for b in module.buffers()} for i, module in modules}
    held = {i: frozenset().union(*(tensors[j] for j in nested)) for i, nested in inside.items()}
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, ids in params.items():
        for pid in ids - held.get(i, frozenset()):
            if owner.setdefault(pid, i) != i:
                shared.add(pid)
    return Ownership(frozenset(shared), held)


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
    layer: int = -1  # the caller's layer this entry is, or is a part of (-1: the same as index)
    part: str = ""  # a swap unit's path inside that layer ('' for a whole layer or a holder; see units.py)
    holder: bool = False  # split into swap units: its own params stay resident
    # Full fine-tuning (0 for a LoRA): what the trainer's optimizer keeps on the device for this entry's params,
    # counted by the builder from the objects that allocate it (:mod:`..engine.training_costs`).
    trained_bytes: int = 0  # gradients and optimizer state of its streamable trainable params, while it is resident
    fixed_state_bytes: int = 0  # optimizer state of its fixed trainable params, resident in every placement

    @property
    def owner(self) -> int:
        """The caller's layer index (placement settings name these)."""
        return self.index if self.layer < 0 else self.layer

    @property
    def label(self) -> str:
        """How the placement table names the entry: its class, or a swap unit's path in its layer."""
        return f"{self.owner}.{self.part} {self.class_name}" if self.part else self.class_name

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

    # index and host_bytes are read per fetch: cached (the layout is frozen)
    @functools.cached_property
    def index(self) -> int:
        return self.sizes.index

    @property
    def slot_bytes(self) -> int:
        return self.sizes.slot_bytes

    @functools.cached_property
    def host_bytes(self) -> int:
        return self.sizes.copy_bytes

    @property
    def landing_bytes(self) -> int:
        return self.sizes.landing_bytes

    @functools.cached_property
    def scaled_params(self) -> tuple[tuple[int, ParamLayout], ...]:
        """(position, param) of the fp8-stored params (the upcast walks only these, once per fetch)."""
        return tuple((k, p) for k, p in enumerate(self.params) if p.scaled)

    def of_entry(self, layer: int, part: str, holder: bool) -> LayerLayout:
        """The same layout, labelled as an entry of the caller's ``layer`` (see :mod:`..streaming.units`)."""
        sizes = dataclasses.replace(self.sizes, layer=layer, part=part, holder=holder)
        return dataclasses.replace(self, sizes=sizes)


def measure(
    layers: Sequence, rules: CastRules | None = None, trainable_dtype: str = "auto", host_trained: bool = False
) -> list[LayerLayout]:
    """The layout of every entry of a layer list (functions get an empty one). ``trainable_dtype``: the
    ``mixed_precision`` the trainable params will have ("auto": as they are). ``host_trained``: trainable
    params stream too (full fine-tuning with the optimizer on the host, :mod:`..training.host_training`)."""
    owned = ownership(layers)
    return [_measure_one(i, layer, owned, rules, trainable_dtype, host_trained) for i, layer in enumerate(layers)]


def measure_layer(layers: Sequence, index: int, rules: CastRules | None = None) -> LayerLayout:
    """The layout of one entry (after its params changed), with tied weights judged over the whole list."""
    return _measure_one(index, layers[index], ownership(layers), rules, "auto")


def _measure_one(
    index: int, layer, owned: Ownership, rules: CastRules | None, trainable_dtype: str, host_trained: bool = False
) -> LayerLayout:
    if not isinstance(layer, nn.Module):
        name = getattr(layer, "__name__", type(layer).__name__)
        return LayerLayout(LayerSizes(index, name, 0, 0), (), 0)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    fixed = 0
    trainable = dtype_of(trainable_dtype, "mixed_precision") if trainable_dtype != "auto" else None
    trainable_size = trainable.itemsize if trainable is not None else None
    held = owned.held.get(index, frozenset())
    holder = index in owned.held
    shared = owned.shared
    for name, p in layer.named_parameters(remove_duplicate=False):
        if id(p) in held:
            continue  # a nested entry's
        if id(p) in names:
            names[id(p)].append(name)
            continue
        names[id(p)] = [name]
        if p.requires_grad and (not host_trained or id(p) in shared):
            fixed += p.numel() * (trainable_size or p.element_size())
        elif id(p) in shared or holder:
            fixed += p.numel() * p.element_size()
        else:
            params[id(p)] = p
    fixed += sum(b.numel() * b.element_size() for b in layer.buffers() if id(b) not in held)
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


def training_bytes(sizes: Sequence[LayerSizes], streamed: Iterable[int]) -> int:
    """Full fine-tuning's device bytes beyond the weights that depend on the placement: the trainer's gradients and
    optimizer state of resident entries' params, and its optimizer state of the params resident everywhere (0 for
    a LoRA). A streamed entry's trainable params train on the host: its gradients go home in groups (measured with
    the activations: the probe streams every layer) and its optimizer state stays there."""
    streamed = set(streamed)
    return sum(s.fixed_state_bytes + (0 if s.index in streamed else s.trained_bytes) for s in sizes)


# ---------------------------------------------------------------- the training layout (full fine-tuning)
Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # an empty host tensor (pinned or not)


@dataclass(frozen=True)
class TrainedParamPlace:
    """Where one host-trained param's training state lives in its layer's buffers."""

    position: int  # in its layer's ``LayerLayout.params``
    param: ParamLayout
    landing: int  # its gradient landing: a byte offset in the layer's landing buffer (an element offset if flat)
    flat: int = -1  # flat layers: its element offset in the flat masters and state buffers

    @property
    def numel(self) -> int:
        return math.prod(self.param.shape)  # the param itself may be streamed out (an empty placeholder)

    @property
    def own_master(self) -> bool:
        """It has an fp32 master of its own (for fp32 compute outside a flat layer, the packed copy is the master)."""
        return self.flat >= 0 or self.param.dtype != torch.float32


@dataclass(frozen=True)
class TrainedLayerPlace:
    """One streamed layer's training state: its trained params (layout order) and its buffers' sizes."""

    index: int
    params: tuple[TrainedParamPlace, ...]
    flat: bool  # masters, state and landings back to back in the optimizer's order (device updates, bf16/fp16)
    landing_bytes: int

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(eq=False)
class TrainedBuffers:
    """What :meth:`TrainingLayout.allocate` gives one layer, per param in layout order (None: not held)."""

    masters: list[torch.Tensor | None]  # fp32, uninitialized (None: the packed copy is the master)
    landings: list[torch.Tensor]  # compute dtype, views of ``landing``
    sums: list[torch.Tensor | None]  # fp32 zeros (None: no sums, one micro-batch a step)
    landing: torch.Tensor  # the layer's landing buffer (flat layers: in the compute dtype)
    flat_masters: torch.Tensor | None = None  # flat layers: fp32, the masters' storage
    flat_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # flat layers: key -> fp32 zeros
    # layers with a spare (speculative updates under clipping): fp32 masters and state of the layer, uninitialized,
    # the params at ``TrainingLayout.spare_offsets``
    spare_masters: torch.Tensor | None = None
    spare_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class TrainingLayout:
    """Where the training state of host-trained (streamed) layers goes in host memory, and how much it takes.

    Layout (per streamed layer with trainable params)
        - an fp32 master per param; for fp32 compute the packed copy in the host store is the master;
        - a gradient landing per param in the compute dtype, 256-byte aligned in one buffer a layer (what the
          device-to-host copy writes; page-locked on CUDA);
        - an fp32 gradient sum per param when a step has several micro-batches (``sums``);
        - the optimizer state: ``state_keys``, fp32 tensors shaped as the param (AdamW's two moments, SGD's
          momentum buffer); or, for a class whose state its own step makes (8-bit moments, factored ones, Kahan
          buffers ...), ``state_bytes(shape)``: what the class keeps for a param of that shape, measured on it
          (:mod:`..training.optimizer_state`).
        - a spare for the layers in :attr:`spares` (speculative updates under clipping,
          :mod:`..training.speculation`): one more fp32 master and state per param, where an update that starts
          before the gradient norm is known keeps the old values (or writes the new ones) until the step
          confirms it. Which layers may have one (``spares``): ``"all"``, ``"flat"`` (device updates, which
          speculate on flat layers only) or ``"none"``; how many do is the RAM check's (:meth:`limit_spares`).
        - Flat layers (``device_updates`` and one compute dtype, bf16 or fp16): masters, each state tensor and
          landings are one buffer each, the params back to back in the optimizer's order, so a device update
          moves a chunk with a few copies (:class:`~..training.device_update.FlatLayer`): 2-D and larger
          first, then the 1-D ones (diffusion-pipe's param groups), or with ``one_group`` (its
          gradient_release: one group) in layout order.

    Mechanics
        - :meth:`allocate` hands out exactly the bytes :meth:`parts` counts (the RAM check's figure), except
          the optimizer state of layers that are not flat (or whose class makes its own), which the optimizer
          (host) or the device updater (per-param, pinned) creates on its first step, at the size counted here
          (:meth:`deferred_state`; under a VRAM budget, counted once the plan is fixed).
        - Page-locked: the landings always (``pinned``); masters, sums and state only with device updates,
          whose copies in are asynchronous (``plain`` otherwise).

    Hazards
        - A sum allocated later (a second micro-batch in a step told to have one) is outside this figure.
    """

    def __init__(
        self,
        layouts: Mapping[int, LayerLayout],
        *,
        state_keys: Sequence[str],
        sums: bool,
        state_bytes: Callable[[tuple[int, ...]], int] | None = None,
        device_updates: bool,
        spares: str = "none",
        one_group: bool = False,
        state_at_start: bool = False,
    ) -> None:
        if spares not in ("none", "flat", "all"):
            raise ValueError(f"spares must be 'none', 'flat' or 'all', got {spares!r}")
        self.state_keys = tuple(state_keys)
        self.state_bytes = state_bytes  # an own class's state per param shape (None: the state_keys' fp32 tensors)
        self.sums = sums
        self.device_updates = device_updates
        self.one_group = one_group  # the optimizer's params in one group, in layout order (flat layers' order)
        # every layer's state made before its first update: at start-up (split updates: either side's), or loaded
        self.state_at_start = state_at_start
        self.layers: dict[int, TrainedLayerPlace] = {}
        for idx in sorted(layouts):
            place = self._place(idx, layouts[idx])
            if place is not None:
                self.layers[idx] = place
        # the layers that may have a spare, in layer order, and those that have one (all, unless the RAM check
        # kept fewer: :meth:`limit_spares`, whose budget is kept for the start-up line)
        self.spares_wanted = tuple(i for i, p in self.layers.items() if spares == "all" or spares == "flat" and p.flat)
        self.spares = frozenset(self.spares_wanted)
        self.spare_budget: int | None = None
        self.packed_bytes = sum(layout.host_bytes for layout in layouts.values())  # the streamed layers' own copies
        self.on_disk: frozenset[int] = frozenset()  # layers whose masters and state live on disk (:meth:`spill`)

    def spill(self, indices) -> None:
        """Layers ``indices`` keep their masters and optimizer state on disk (:mod:`..training.disk_state`): they
        leave the RAM figure, and no layer keeps a spare (a host RAM budget holds; speculation would take more)."""
        self.on_disk = frozenset(indices)
        self.spares_wanted = ()
        self.spares = frozenset()

    def _place(self, idx: int, layout: LayerLayout) -> TrainedLayerPlace | None:
        chosen = [(k, p) for k, p in enumerate(layout.params) if p.param.requires_grad]
        if not chosen:
            return None
        dtypes = {p.dtype for _, p in chosen}
        if self.device_updates and len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}:
            order = chosen  # the optimizer's order: one group, or diffusion-pipe's two (2-D and larger first)
            if not self.one_group:
                order = [kp for kp in chosen if len(kp[1].shape) > 1] + [kp for kp in chosen if len(kp[1].shape) <= 1]
            flat, offset = {}, 0
            for k, p in order:
                flat[k] = offset
                offset += math.prod(p.shape)
            params = tuple(TrainedParamPlace(k, p, flat[k], flat[k]) for k, p in chosen)
            return TrainedLayerPlace(idx, params, True, offset * chosen[0][1].dtype.itemsize)
        places, offset = [], 0
        for k, p in chosen:
            places.append(TrainedParamPlace(k, p, offset))
            offset += aligned(p.nbytes)
        return TrainedLayerPlace(idx, tuple(places), False, offset)

    def parts(self) -> dict[str, int]:
        """Host bytes of the training state beyond the packed copies: masters, gradients (landings and sums),
        optimizer state, and the spares of speculative updates where there are any (the start-up line and the
        RAM check)."""
        masters = gradients = optimizer = 0
        for layer in self.layers.values():
            gradients += layer.landing_bytes
            spilled = layer.index in self.on_disk
            for p in layer.params:
                masters += 4 * p.numel if p.own_master and not spilled else 0
                gradients += 4 * p.numel if self.sums else 0
                optimizer += self._state(p) if not spilled else 0
        parts = {"masters": masters, "gradients": gradients, "optimizer": optimizer}
        if self.spares:
            parts["speculation"] = sum(self.spare_bytes(idx) for idx in self.spares)
        return parts

    def deferred_state(self) -> int:
        """Host bytes of the optimizer state :meth:`allocate` does not make: every layer's but a flat layer's fp32
        state tensors (``state_keys``), which the optimizer or the device updater creates on the layer's first
        update. Under a VRAM budget that update comes after the plan is fixed, so only the layers the plan streams
        ever hold it (the RAM check counts it then: :func:`~..training.host_training.check_deferred_state`). 0
        with ``state_at_start`` (split updates make every layer's state at start-up, for either side to find; a
        loaded checkpoint's is there already)."""
        if self.state_at_start:
            return 0
        return sum(
            self._state(p)
            for layer in self.layers.values()
            if layer.index not in self.on_disk and not (layer.flat and self.state_bytes is None)
            for p in layer.params
        )

    def _state(self, p: TrainedParamPlace) -> int:
        """Host bytes of ``p``'s optimizer state: ``state_bytes`` of its shape, or an fp32 tensor per state key."""
        if self.state_bytes is not None:
            return self.state_bytes(tuple(p.param.shape))
        return 4 * p.numel * len(self.state_keys)

    def spare_bytes(self, idx: int) -> int:
        """Layer ``idx``'s spare: an fp32 master and each state tensor per param."""
        return 4 * self.layers[idx].numel * (1 + len(self.state_keys))

    def limit_spares(self, budget: int) -> None:
        """Keep the spares of the first layers (in layer order) that fit ``budget`` bytes together: the first
        layers in the forward, whose gradients land last (:mod:`..training.speculation` says why)."""
        kept, used = [], 0
        for idx in self.spares_wanted:
            used += self.spare_bytes(idx)
            if used > budget:
                break
            kept.append(idx)
        self.spares = frozenset(kept)
        self.spare_budget = budget

    def spare_offsets(self, idx: int) -> dict[int, int]:
        """Each param's element offset in layer ``idx``'s spare, by position: a flat layer's flat offsets (its
        spare swaps with its buffers), otherwise the params back to back in layout order."""
        layer = self.layers[idx]
        if layer.flat:
            return {p.position: p.flat for p in layer.params}
        offsets, offset = {}, 0
        for p in layer.params:
            offsets[p.position] = offset
            offset += p.numel
        return offsets

    def allocate(self, idx: int, pinned: Allocate, plain: Allocate) -> TrainedBuffers:
        """Layer ``idx``'s buffers (see the class doc for which are page-locked); state tensors only if flat."""
        buffers = self._allocate(idx, pinned, plain)
        if idx in self.spares:  # page-locked with device updates, whose copies home may write into it
            held = pinned if self.device_updates else plain
            total = self.layers[idx].numel
            buffers.spare_masters = held((total,), torch.float32)
            buffers.spare_state = {key: held((total,), torch.float32) for key in self.state_keys}
        return buffers

    def _allocate(self, idx: int, pinned: Allocate, plain: Allocate) -> TrainedBuffers:
        layer = self.layers[idx]
        held = pinned if self.device_updates else plain
        if layer.flat:
            total = layer.numel
            dtype = layer.params[0].param.dtype
            masters, landing = held((total,), torch.float32), pinned((total,), dtype)
            state = {key: held((total,), torch.float32).zero_() for key in self.state_keys}
            views = [(p.flat, p.numel, p.param.shape) for p in layer.params]  # ParamLayout shapes
            return TrainedBuffers(
                [masters[o : o + n].view(shape) for o, n, shape in views],
                [landing[o : o + n].view(shape) for o, n, shape in views],
                [held((n,), torch.float32).zero_().view(shape) if self.sums else None for _, n, shape in views],
                landing,
                masters,
                state,
            )
        landing = pinned((layer.landing_bytes,), torch.uint8)
        landings = [landing[p.landing : p.landing + p.param.nbytes] for p in layer.params]
        return TrainedBuffers(
            [held(tuple(p.param.shape), torch.float32) if p.own_master else None for p in layer.params],
            [raw.view(p.param.dtype).view(p.param.shape) for raw, p in zip(landings, layer.params)],
            [held(tuple(p.param.shape), torch.float32).zero_() if self.sums else None for p in layer.params],
            landing,
        )
