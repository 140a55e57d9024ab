"""LayerSwapper: keep some layers of a list resident on the device and stream the others in just before use.

Layout
    - Host: one packed master per streamed layer (:mod:`..streaming.masters`, laid out by :mod:`..memory.layout`).
    - Device: the resident layers' weights, the trainable params and buffers of every layer, and
      ``prefetch + 1`` slots of the largest streamed layer (:mod:`..memory.device_pool`), plus fp8 landing buffers
      (:mod:`..memory.copier`). What each param points at, and its home: :mod:`..streaming.bindings`.
    - The parts and the list of features (:mod:`..streaming.feature`) come from the builder (:mod:`.build`); the engine
      iterates over the features and never asks which there are.

Mechanics
    - :mod:`..streaming.hooks` calls :meth:`LayerSwapper.use` when a layer's use begins (forward, recompute, backward,
      saved-tensor unpack) and :meth:`LayerSwapper.pass_end` when a backward finishes.
    - ``use(i)`` releases the layer used before (the copier puts a marker behind its kernels), makes layer
      ``i`` resident (a demand copy if no copy was on its way), then prefetches: it walks the uses the
      predictor (:mod:`..streaming.schedule`) expects and starts copies of the next ``prefetch`` streamed layers, each
      into a free slot or else the least recently used slot that no protected layer (the current one and
      those being prefetched) holds. A copy also waits behind the features' fetch gates.
    - A layer-major step's micro-batches of one layer (:mod:`.row_keeping`, :meth:`LayerSwapper.keep_for_repeats`):
      no prefetch evicts that layer's swap units before its last micro-batch, and the uses of its later
      micro-batches move the predictor without teaching it.
    - ``pass_end`` runs the features' ``after_backward``, then hands the step boundary to the listeners
      (stats, the profiler, the planner: they record it).
    - The first use after a pass ended that is not inside a backward runs the features' ``between_passes``
      first: it comes after whatever the loop ran between passes (the optimizer step; with gradient
      accumulation, between micro-batches), outside autograd's callback. The planner acts there (and may
      re-place layers: :meth:`apply_placement`). A loop whose micro-batches interleave (a pipeline stage's forward
      of one before the backward of the one before it) runs each step in :meth:`one_step`: the features act
      at the first use after the block or as the next block starts, never inside it.

Hazards handled
    - Slot reuse. A layer's use lasts from its start until another layer's use begins. By then every kernel
      that reads it is enqueued (forward runs layers in order; the autograd engine runs one device's nodes in
      decreasing sequence number), so the release marker is behind its last reader, and the copier writes the
      slot only after that marker (and refuses to write a slot that was not released:
      :class:`~..memory.copier.OrderingError`).
    - Saved tensors of layers that are not checkpointed would keep views of a slot: :mod:`..streaming.hooks` swaps them
      for references that are re-resolved in backward.
    - A re-placement while a micro-batch awaits its backward. Its checkpointed forward ran under one placement and
      its recompute would run under another (other swap units checkpointed, other inputs kept), so the recompute
      saves other tensors (torch's ``CheckpointError``), or a saved view names a layer no longer streamed. Loops
      that interleave micro-batches say where their step ends (:meth:`one_step`); the others end each pass with its
      backward.
    - State dicts read and write the true weights wherever a layer lives (:mod:`..streaming.masters`); :meth:`remove`
      puts every param and buffer back as it was (:mod:`..streaming.bindings`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from ..errors import DGLSUserError, say
from ..memory.device_pool import DevicePool, Slot
from ..memory.host_store import HostStore
from ..streaming.bindings import Bindings
from ..streaming.config import SwapConfig
from ..streaming.feature import Feature, overrides
from ..streaming.hooks import HookAdapter, SlotRef
from ..streaming.placement import Placement
from ..streaming.residency import Residency, StreamedLayer
from ..streaming.schedule import Phase, UsePredictor, current_phase
from ..streaming.tiers import tier_labels
from ..watching.listener import Listener
from ..watching.stats import StatsCollector, StepStats
from .build import build, resolve_device, start_report

F = TypeVar("F", bound=Feature)


class LayerSwapper:
    """Keep some layers resident on ``device`` and stream the others in just before use.

    ``layers`` run one after another (a ``to_layers()`` list, an ``nn.Sequential``, a list of
    blocks; plain functions between them are fine). Pass them on the CPU (or anywhere): frozen
    params of streamed layers move to host memory, everything else moves to ``device``. Call
    :meth:`remove` (or use the swapper as a context manager) to put the modules back.

    In a ``torch.distributed`` job every process builds its swapper at the same point; processes
    that host the same layers (the same ``share_group``: pass the pipeline stage when the layers are
    split across processes) keep one copy of the masters per machine.
    """

    def __init__(
        self,
        layers: Iterable,
        config: SwapConfig | None = None,
        device: torch.device | str | None = None,
        log=say,
        share_group: str = "",
    ) -> None:
        self.config = config or SwapConfig()
        self.device = resolve_device(device)
        log = log or (lambda *_: None)
        self._removed = False
        p = build(list(layers), self.config, self.device, log, share_group)  # checks first; the model is unchanged
        self.entries, self.layouts, self.pieces, self.unit_bytes = p.entries, p.layouts, p.pieces, p.unit_bytes
        self.layers, self.placement = p.layers, p.placement
        self.masters, self.transport, self.pool, self.copier = p.masters, p.transport, p.pool, p.copier
        self.features = p.features
        # the hot path and each use ask only the features that do something there
        self._gate_fetches = [f for f in p.features if overrides(f, "fetch_gates")]
        # the disk tier the engine reads ahead from (:meth:`read_ahead`): none with fetch gates
        self._read_ahead_from = p.masters.store.disk if not self._gate_fetches else None
        self._act_between_passes = [f for f in p.features if overrides(f, "between_passes")]
        self._act_after_backward = [f for f in p.features if overrides(f, "after_backward")]
        self._pass_ended = False  # a backward ended and no use outside a backward began since
        self._in_step = False  # inside :meth:`one_step`: the features do not act between passes
        self.micro_batches = 1  # of the last step, run layer-major (:mod:`.layer_major` sets it; the planner reads it)
        self._kept: frozenset[int] = frozenset()  # entries no prefetch evicts (:meth:`keep_for_repeats`)
        self._repeating = False  # uses repeat ones observed: the predictor moves without learning
        self._within: frozenset[int] | None = None  # the only entries a prefetch takes (None: any; keep_for_repeats)
        self.row_memory: Listener | None = None  # :mod:`.row_keeping`'s record of each row's uses, over steps
        self.log = log  # for lines the engine says after start-up (:mod:`.row_keeping`'s, once)
        self.driver, self.training, self.activations = p.driver, p.training, p.activations  # for readers only
        self._batch_move, self._sync_each_step = p.batch_move, p.sync_each_step
        self._copy_streams, self._plan_finished = p.copy_streams, p.plan_finished
        self.bindings = Bindings(self.layers, self.layouts, self.masters, self.device, self.true_value)
        self._streamed = self.bindings.streamed  # the slot policy's view: index -> StreamedLayer
        self.streaming = self._streamed  # the hooks' view (live: re-placement changes it in place)
        self.predictor = UsePredictor(len(self.layers))
        self.stats = StatsCollector(self.device, lambda: self.pinned_bytes)
        self._listeners: list[Listener] = []
        self._current: int | None = None
        self._last_use: tuple[int, Phase] | None = None
        self._plans: dict[tuple, tuple[int, ...]] = {}  # prefetch targets per (previous, current) use
        self._reads_ahead: dict[tuple, tuple[int, ...]] = {}  # the disk tier's read-ahead targets, likewise
        self._plans_version = -1
        self._clock = 0
        self._lock = threading.RLock()
        owners, holders = [e.layer for e in self.entries], [i for i, e in enumerate(self.entries) if e.holder]
        self.hooks = HookAdapter(self.layers, self, owners, holders, p.replays)
        try:
            self._start()
        except BaseException:
            self.remove()  # a half-built swapper puts back what it changed
            raise
        for line in start_report(p):
            log(line)

    def _start(self) -> None:
        """Stream and place the layers, install the state-dict and module hooks, then the features."""
        for idx in self.placement.streamed:
            self.bindings.stream(idx)
        self.bindings.place_resident_parts()
        self.masters.install(self)
        self.add_listener(self.stats)
        self.hooks.install()
        for feature in self.features:
            feature.install(self)

    @property
    def store(self) -> HostStore:
        """The packed host masters of the streamed layers (owned by :attr:`masters`)."""
        return self.masters.store

    def feature(self, kind: type[F]) -> F | None:
        """The feature of this type, if it was built (tests and tools)."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    # ---------------------------------------------------------------- what the hooks call
    def use(self, idx: int, phase: Phase) -> None:
        """A use of layer ``idx`` begins: release the previous one, make this one resident, prefetch."""
        with self._lock:
            if self._pass_ended and phase is not Phase.BACKWARD and not self._in_step:  # after the optimizer step
                self._between_passes()
            self.copier.check()
            if (idx, phase) == self._last_use:
                return
            self._last_use = (idx, phase)
            if self._repeating:
                self.predictor.relocate((idx, phase))
            else:
                self.predictor.observe((idx, phase))
            if idx != self._current:
                self._release_current()
                self._current = idx
                self._clock += 1
            layer = self._streamed.get(idx)
            missed = layer is not None and layer.state is Residency.HOST
            for listener in self._listeners:
                listener.use_started(idx, phase, layer is not None, missed)
            if layer is not None:
                self._make_resident(layer)
            self._prefetch()
            self.read_ahead()

    def pass_end(self) -> None:
        """A backward pass finished: the features' ``after_backward`` (full fine-tuning evicts its layers
        there), then the listeners' step boundary (they record it; the planner acts at the next use)."""
        with self._lock:
            for feature in self._act_after_backward:
                feature.after_backward()
            if self._sync_each_step and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for listener in list(self._listeners):
                listener.pass_ended()
            self._pass_ended = True

    def is_streamed(self, idx: int) -> bool:
        return idx in self._streamed

    def slot_ref(self, tensor: torch.Tensor) -> SlotRef | None:
        slot = self.pool.slot_of(tensor)
        if slot is None or slot.owner is None:
            return None
        return SlotRef(slot.owner, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype)

    def view_of(self, ref: SlotRef) -> torch.Tensor:
        """A saved view, rebuilt in its layer's current slot (making the layer resident first)."""
        self.use(ref.layer, current_phase())
        buffer = self._streamed[ref.layer].slot.buffer.view(ref.dtype)
        if not torch.is_grad_enabled():  # in a backward proper: no context to enter
            return torch.as_strided(buffer, ref.size, ref.stride, ref.offset)
        with torch.no_grad():
            return torch.as_strided(buffer, ref.size, ref.stride, ref.offset)

    # ---------------------------------------------------------------- slot policy
    def _release_current(self) -> None:
        layer = self._streamed.get(self._current) if self._current is not None else None
        if layer is not None and layer.state is Residency.IN_USE:
            layer.release(self.copier)
            layer.slot.last_used = self._clock

    def _make_resident(self, layer: StreamedLayer) -> None:
        if layer.state is Residency.IN_USE:  # the same layer again in another phase (the turnaround)
            return
        if layer.state is Residency.HOST:
            # a kept entry is evicted only when every other slot is in use (:meth:`keep_for_repeats`)
            slot = self._claim_slot(layer.index, {layer.index} | self._kept) if self._kept else None
            if slot is None:
                slot = self._claim_slot(layer.index, {layer.index})
            self._fetch([(layer, slot)], demand=True)
        first = layer.state is Residency.FETCHING
        wait = layer.acquire(self.copier)
        for listener in self._listeners:
            if first:
                listener.fetched(layer.token)
            if wait is not None:
                listener.waited(wait)

    def _prefetch(self) -> None:
        depth = self.placement.prefetch
        if depth == 0 or not self._streamed:
            return
        wanted = self._wanted(depth)
        if self._within is not None:
            wanted = tuple(i for i in wanted if i in self._within)
        protected = set(wanted) | {self._current} | self._kept
        requests = []
        for idx in wanted:
            layer = self._streamed[idx]
            if layer.state is not Residency.HOST:
                layer.slot.last_used = self._clock
                continue
            slot = self._claim_slot(idx, protected)
            if slot is None:
                break
            requests.append((layer, slot))
        if self._batch_move:
            self._fetch(requests, demand=False)
        else:
            for request in requests:
                self._fetch([request], demand=False)

    def _between_passes(self) -> None:
        """The features act on the passes ended since they last did (under the engine lock)."""
        self._pass_ended = False
        for feature in self._act_between_passes:
            feature.between_passes()

    @contextlib.contextmanager
    def one_step(self) -> Iterator[None]:
        """The passes inside the block are one step whose micro-batches interleave (DeepSpeed's pipeline schedule
        runs a stage's forward of micro-batch 2 before the backward of micro-batch 1): the features act on the
        passes ended before (the planner re-places layers) as the block starts, and not inside it, so never while a
        micro-batch awaits its backward (see the module doc's hazards). Each pass still ends at its backward (the
        features' ``after_backward``, the listeners' pass end). Not nested."""
        with self._lock:
            if self._in_step:
                raise RuntimeError("one_step() is already active")
            if self._pass_ended:  # the step before ended: act before this one starts
                self._between_passes()
            self._in_step = True
        try:
            yield
        finally:
            with self._lock:
                self._in_step = False

    def keep_for_repeats(self, kept: frozenset[int], repeating: bool, within: frozenset[int] | None = None) -> None:
        """Until called again: no prefetch evicts the entries ``kept`` (a demand fetch only when no other slot is free
        to take), a prefetch takes only entries ``within`` (None: any), and with ``repeating`` the uses repeat those
        since the last call without it (the predictor moves as it did then, without learning). Called by
        :mod:`.row_keeping` at each of a layer-major step's micro-batches of one layer."""
        with self._lock:
            self._kept, self._repeating, self._within = kept, repeating, within
            if repeating:
                self.predictor.repeat_row()
            else:
                self.predictor.begin_row()

    def _wanted(self, depth: int) -> tuple[int, ...]:
        """The next ``depth`` streamed layers the predictor expects after the current use, cached per
        (previous, current) use until the predictor learns something new (a table lookup per use)."""
        return self._upcoming(self._plans, depth, self._streamed, skip_current=True)

    def _upcoming(self, cache: dict, depth: int, among, skip_current: bool) -> tuple[int, ...]:
        """The next ``depth`` layers of ``among`` (but the current one, with ``skip_current``) the predictor expects
        after the current use, each at its next use (``cache``: per (previous, current) use, cleared when the
        predictor learns something new)."""
        predictor = self.predictor
        if self._plans_version != predictor.version:
            self._plans.clear()
            self._reads_ahead.clear()
            self._plans_version = predictor.version
        key = (predictor.previous, predictor.current)
        wanted = cache.get(key)
        if wanted is None:
            found: list[int] = []
            seen = {self._current} if skip_current else set()
            for idx, _ in predictor.upcoming(limit=2 * len(self.layers) + 2):
                if idx not in seen:
                    seen.add(idx)
                    if idx in among:
                        found.append(idx)
                        if len(found) == depth:
                            break
            wanted = cache[key] = tuple(found)
        return wanted

    def read_ahead(self) -> None:
        """The disk tier's reads ahead (:meth:`~..memory.disk_tier.DiskTier.stage`) for the spilled layers the step
        uses next, in order, while a ring buffer is free: the disk keeps reading during the compute and copies
        before them, not only from each layer's fetch (``prefetch`` layers ahead), which hid little of a read that
        takes longer than a layer's compute. Not with fetch gates (full fine-tuning: a layer's packed bytes may
        still change with its update before its fetch, and the read must come after it: the fetch reads)."""
        disk = self._read_ahead_from
        if disk is None:
            return
        # as many as the ring holds, past those the slots may hold already
        depth = len(disk.ring.buffers) + self.placement.slot_count
        for idx in self._upcoming(self._reads_ahead, depth, disk.spilled, skip_current=False):
            layer = self._streamed.get(idx)
            if idx == self._current:
                break  # its next use (a later pass's) may find it evicted: a read past it could take its buffer
            if layer is None or layer.state is not Residency.HOST:
                continue  # resident now (re-placed), or fetched for its next use already
            if not disk.stage(self.copier.transport, idx, layer.host.nbytes):
                break  # the ring holds reads ahead no copy took yet

    def _claim_slot(self, idx: int, protected: set[int]) -> Slot | None:
        """A free slot, or the victim among slots whose layer is neither protected nor in use (evicted
        now); reserved for layer ``idx``."""
        slot = self.pool.free_slot()
        if slot is None:
            candidates = [
                s
                for s in self.pool.slots
                if s.owner not in protected and self._streamed[s.owner].state is not Residency.IN_USE
            ]
            if not candidates:
                return None
            slot = self._victim(candidates)
            self._streamed[slot.owner].evict()
        slot.owner = idx
        slot.last_used = self._clock
        return slot

    def _victim(self, candidates: list[Slot]) -> Slot:
        """The least recently used slot (tests replace this to vary slot assignment)."""
        return min(candidates, key=lambda s: s.last_used)

    def _fetch(self, requests: list[tuple[StreamedLayer, Slot]], demand: bool) -> None:
        if not requests:
            return
        gating = self._gate_fetches  # e.g. full fine-tuning: the packed copy must hold the layer's latest update
        after = [[g for f in gating for g in f.fetch_gates(layer.index)] for layer, _ in requests] if gating else None
        tokens = self.copier.submit([(slot, layer.host, demand) for layer, slot in requests], after)
        for (layer, slot), token in zip(requests, tokens):
            layer.fetch(slot, token)

    # ---------------------------------------------------------------- what the masters and features ask
    def placeholder(self, dtype: torch.dtype, ndim: int = 1) -> torch.Tensor:
        return self.bindings.placeholder(dtype, ndim)

    def adopted(self, idx: int) -> None:
        self.bindings.adopted(idx)

    def true_value(self, param: torch.Tensor) -> torch.Tensor | None:
        """The value a feature keeps for ``param`` (full fine-tuning's fp32 master), else ``None``."""
        return next((v for f in self.features if (v := f.true_value(param)) is not None), None)

    def flush(self) -> None:
        for feature in self.features:
            feature.flush()

    def evict(self, indices: Iterable[int]) -> None:
        """Release the current use and drop these layers' device copies (the release markers keep the
        slots from being rewritten before the kernels that read them, so the host need not wait). A feature
        calls it (under the engine lock already); the lock is taken again for any other caller."""
        with self._lock:
            self._release_current()
            for idx in indices:
                layer = self._streamed[idx]
                if layer.state is not Residency.HOST:
                    layer.evict()
            self._current = None
            self._last_use = None

    # ---------------------------------------------------------------- public
    @property
    def pinned_bytes(self) -> int:
        """Host memory DGLS page-locked: packed copies, and what features hold (full fine-tuning's gradient
        landings, and for device updates masters and moments; offloaded activations' buffers)."""
        return self.store.pinned_bytes + sum(feature.pinned_bytes() for feature in self.features)

    def checkpoint_function(self, checkpoint: Callable) -> Callable:
        """The trainer's checkpoint function (``checkpoint(function, *args, **kwargs)``), wrapped by the features
        (activation offload, when activations are offloaded); unchanged otherwise."""
        for feature in self.features:
            checkpoint = feature.wrap_checkpoint(checkpoint)
        return checkpoint

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return self.placement.streamed

    @property
    def plan_finished(self) -> bool:
        """True once a ``plan_only`` run has shown its plan: the caller should stop (an explicit
        placement is shown at construction, so there is nothing to train for)."""
        return self._plan_finished()

    def placement_table(self) -> str:
        """Where each layer lives; with layers on disk, each streamed layer's tier too (pinned RAM, RAM or disk)."""
        return self.placement.table(tier_labels(self.store) if self.store.disk is not None else None)

    def step_stats(self, sync: bool = False) -> StepStats:
        """The most recent finished backward pass (a pure read). Timings of copies still in flight are
        left out (``pending``) unless ``sync`` waits for the device."""
        return self.stats.last_pass(sync)

    def total_stats(self, sync: bool = False) -> StepStats:
        """Everything since construction (a pure read); ``later.since(earlier)`` gives a stretch."""
        return self.stats.total(sync)

    def add_listener(self, listener: Listener) -> None:
        """``listener`` hears the engine's events and the transport's copies (every direction)."""
        self._listeners.append(listener)
        self.transport.listeners.append(listener)

    def apply_placement(self, streamed: Iterable[int], prefetch: int, kept_activations: int | None = None) -> None:
        """Change which layers stream and the prefetch depth, between passes.

        Layers that become resident get device copies of their masters; layers that become streamed
        are packed into host memory (fp8-stored ones already are). The pool, the fp8 landing
        buffers and the staging buffers are sized anew from the layouts. With activation offload, the
        inputs of the last ``kept_activations`` checkpointed calls of a forward stay on the device
        (default and least: ``max(1, prefetch)``), and restores run ``prefetch`` calls ahead.
        """
        with self._lock:
            for feature in self.features:
                feature.before_placement()
            wanted = set(streamed)
            bad = [i for i in wanted if not 0 <= i < len(self.layers)]
            if bad:
                raise DGLSUserError(f"layers {bad} out of range: the model has {len(self.layers)} layers")
            wanted = {i for i in wanted if self.layouts[i].sizes.streamable_bytes}
            self.evict_all()
            for idx in sorted(set(self._streamed) - wanted):
                self.bindings.unstream(idx)
            for idx in sorted(wanted - set(self._streamed)):
                if not self.masters.has(idx):
                    self.masters.add(idx)
                self.bindings.stream(idx)
            sizes = tuple(layout.sizes for layout in self.layouts)
            update = self.placement.update_bytes
            self.placement = Placement(sizes, tuple(sorted(self._streamed)), prefetch, self._copy_streams, update)
            self.config = self.config.replace(prefetch=prefetch)
            self._plans.clear()
            self._reads_ahead.clear()
            self.pool.release()
            slot_bytes = self.placement.slot_bytes + self.copier.slot_padding  # a shared fetch's gather rounds up
            self.pool = DevicePool(self.device, self.placement.slot_count, slot_bytes)
            self.copier.forget_slots()
            self.copier.resize(self.placement.landing_bytes)
            self.store.ensure_staging(2, self.placement.slot_bytes)
            for layer in self._streamed.values():
                layer.forget_views()
            for feature in self.features:
                feature.placement_changed(self.placement, kept_activations)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def evict_all(self) -> None:
        """Drop every streamed layer from the device (between passes, e.g. before sampling)."""
        with self._lock:
            self.copier.drain()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.evict(self._streamed)

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        """Inside the block, streamed params point at their true values in host memory (the fp32 masters of
        host-trained params): for code that reads params directly rather than through ``state_dict`` (a
        saver). Nothing may run the layers meanwhile."""
        with self._lock:
            self.evict_all()
            self.flush()
            for layer in self._streamed.values():
                layer.show(self.bindings.true_values(layer))
            try:
                yield
            finally:
                for layer in self._streamed.values():
                    layer.hide()

    def remove(self) -> None:
        """Put every module back as it was (params and buffers on their original devices, in their
        original dtypes); close the features; free the pool, the pinned memory, the hooks and the transport's
        worker threads. Also undoes a swapper whose construction failed half-way (what it did not get to is
        left as it was). Values ``cast_target`` rounded (fp8, or a 16-bit TO) come back rounded: the originals
        are not kept, since keeping them would double the host RAM a large model needs."""
        if self._removed:
            return
        self._removed = True
        for feature in reversed(self.features):
            feature.close()
        self.copier.close()
        self.transport.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.hooks.remove()
        self.bindings.restore()
        self.pool.release()
        self.masters.release()

    def __enter__(self) -> LayerSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
