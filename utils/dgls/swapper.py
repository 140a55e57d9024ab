"""LayerSwapper: keep some layers of a list resident on the device and stream the others in just before use.

Layout
    Host: one packed master per streamed layer (:mod:`.host_store`, laid out by :mod:`.layout`).
    Device: the resident layers' weights, the trainable params and buffers of every layer, and
    ``prefetch + 1`` slots of the largest streamed layer (:mod:`.device_pool`), plus fp8 landing
    buffers (:mod:`.copier`). Every streamed param points at an empty placeholder, or at a view of
    its layer's slot while the layer is on the device (:mod:`.residency`).

Mechanics
    :mod:`.hooks` calls :meth:`LayerSwapper.use` when a layer's use begins (forward, recompute,
    backward, saved-tensor unpack) and :meth:`LayerSwapper.pass_end` when a backward finishes.
    ``use(i)`` releases the layer used before (the copier puts a marker behind its kernels), makes
    layer ``i`` resident (a demand copy if no copy was on its way), then prefetches: it walks the
    uses the predictor (:mod:`.schedule`) expects and starts copies of the next ``prefetch``
    streamed layers, each into a free slot or else the least recently used slot that no protected
    layer (the current one and those being prefetched) holds. ``pass_end`` hands the step boundary
    to the listeners: stats (:mod:`.stats`), the profiler, and the VRAM-budget planner
    (:mod:`.autoplan`), which may re-place layers there, between passes.

Hazards handled
    - Slot reuse. A layer's use lasts from its start until another layer's use begins. By then every
      kernel that reads it is enqueued (forward runs layers in order; the autograd engine runs one
      device's nodes in decreasing sequence number), so the release marker is behind its last
      reader, and the copier writes the slot only after that marker (and refuses to write a slot
      that was not released: :class:`~.copier.OrderingError`).
    - Saved tensors of layers that are not checkpointed would keep views of a slot: :mod:`.hooks`
      swaps them for references that are re-resolved in backward.
    - State dicts read and write the host masters (true weights wherever a layer lives);
      ``load_state_dict(assign=True)`` new Parameter objects are adopted, not silently dropped.
    - ``cast_target`` applies wherever a layer lives (fp8-stored layers keep their fp8 master even
      while resident), so placement, and re-placement by the planner, never changes the numbers.
    - :meth:`remove` puts every param and buffer back on its original device in its original dtype
      (fp8-stored values come back dequantized: the full-precision originals are not kept).
    - Full fine-tuning (``host_optimizer``): trainable params of streamed layers stream too, and are
      trained on the host (:mod:`.host_training`): a fetch waits for its layer's update, a gradient
      arriving is a use of its layer, and every host-trained layer is evicted at the end of each
      backward (its slot copy is older than its next update). Placement is then fixed. With
      ``host_optimizer.on_device`` the update runs on the device (:mod:`.device_update`) and a fetch
      waits for it there, through the copier's gate.
    - ``offload_activations``: the trainer's checkpoint function, wrapped by :meth:`checkpoint_function`,
      sends checkpointed layers' inputs home (:mod:`.activation_offload`); weights and activations move
      on separate streams and never share a buffer. With a VRAM budget (on CUDA, unless it is False) the
      probe sends all but the last ``prefetch`` home and each plan keeps as many on the device as the
      budget has room for (:meth:`apply_placement`'s ``kept_activations``). ``offload_recompute`` (which turns
      it on) also sends home what each recompute saves for its layer's backward (:mod:`.recompute_offload`);
      ``keep_piece_outputs`` (which turns it on too) sends home the outputs of ``checkpoint_units``' pieces
      with their layer's inputs, and the layer's recompute takes them instead of running the pieces
      (:mod:`.unit_checkpoints`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from .activation_offload import ActivationOffloader
from .autoplan import PlacementDriver, resolve_budget
from .config import SwapConfig
from .copier import CudaCopier, DeferredCopier
from .device_pool import DevicePool, Slot
from .device_update import DeviceUpdater
from .errors import DGLSUserError
from .forward_patches import ForwardPatches
from .hooks import HookAdapter, SlotRef
from .host_store import HostStore
from .host_training import HostTraining, check_host_training
from .layout import MB, LayerLayout, measure, modules_of
from .listener import Listener
from .masters import Masters
from .placement import Placement, plan_placement
from .planner import unit_bytes_for_budget
from .precision import CastRules, cast_trainable, check_device_support, describe, name_of
from .profiler import Profiler
from .residency import Residency, StreamedLayer
from .schedule import Phase, UsePredictor, current_phase
from .stats import StatsCollector, StepStats, human_bytes
from .transport import CudaTransport, Direction, make_transport
from .unit_checkpoints import UnitCheckpoints
from .units import Entry, pieces_to_checkpoint, split_layers, split_note


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
        log=print,
        share_group: str = "",
    ) -> None:
        given = list(layers)
        if not given:
            raise DGLSUserError("no layers to place: the layer list is empty")
        self.config = config or SwapConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._log = log or (lambda *_: None)
        self._removed = False
        # Checks first: nothing is changed before every setting is known to fit the model.
        cast_rules = CastRules.from_policy(self.config.compute)
        check_device_support(self.device, cast_rules)
        host_trained = self.config.training.host_optimizer is not None
        self.driver = self._start_driver()
        # The engine's entries: the layers, some split into swap units (units.py); indices below are theirs.
        self.unit_bytes = self._unit_bytes(given, cast_rules, host_trained)
        self.entries: list[Entry] = split_layers(given, self.unit_bytes, trainable_streams=host_trained)
        self.layers: list = [entry.value for entry in self.entries]
        self.pieces = (
            pieces_to_checkpoint(self.entries, host_trained) if self.config.activations.checkpoint_units else []
        )
        if self.config.activations.checkpoint_units and not self.pieces:
            raise DGLSUserError(
                "checkpoint_units checkpoints the child modules of each layer, and no layer has child modules with "
                "params: drop checkpoint_units"
            )
        UnitCheckpoints.check(self.pieces)
        self._piece_entries = {piece.entry for piece in self.pieces}  # never compiled (_runs_eager)
        self._home = {
            id(t): (t, t.device, t.dtype)
            for _, module in modules_of(self.layers)
            for t in (*module.parameters(), *module.buffers())
        }
        measured = measure(self.layers, cast_rules, self.config.compute.mixed_precision, host_trained=host_trained)
        self.layouts: list[LayerLayout] = [
            layout.of_entry(entry.layer, entry.part, entry.holder) for layout, entry in zip(measured, self.entries)
        ]
        self._check_casts_match(cast_rules)
        sizes = tuple(layout.sizes for layout in self.layouts)
        self.placement: Placement = plan_placement(sizes, self.config.placement, self.config.transfer.cuda_streams)
        if self.driver is not None:
            self.driver.check_static_minimum(sizes)
        self._training_note = ""
        if host_trained:
            self._training_note = check_host_training(
                self.layouts,
                self.placement.streamed,
                self.config.training.host_optimizer,
                self.config.training.accumulation_steps,
            )
        try:
            self._build(share_group)
        except BaseException:
            self.remove()  # a half-built swapper puts back what it changed
            raise
        self._report_start(cast_rules)

    def _build(self, share_group: str) -> None:
        """Pack the masters, move the rest to the device, make the pool and the copier, install the hooks."""
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._streamed: dict[int, StreamedLayer] = {}
        self.masters = Masters(
            self.layers, self.layouts, self.placement.streamed, self.device, self.config, self._log, share_group
        )
        c = self.config
        # weight copies are timed for the stats (collect_timing); the other directions only for --profile
        timed = {d for d in Direction if d is not Direction.WEIGHTS_IN} if c.observe.profile else set()
        timed |= {Direction.WEIGHTS_IN} if c.observe.collect_timing else set()
        self.transport = make_transport(self.device, weight_lanes=c.transfer.cuda_streams, timed=timed)
        self.training: HostTraining | None = None
        self.activations: ActivationOffloader | None = None
        if self._offloads_activations():
            self.activations = ActivationOffloader(
                self.device,
                keep=max(1, self.config.placement.prefetch),
                recompute=self.config.activations.offload_recompute,
                transport=self.transport,
            )
        if self.config.training.host_optimizer is not None:
            self._start_training()
        for idx in self.placement.streamed:
            self._stream(idx)
        self._place_resident_parts()
        self.masters.evict_all, self.masters.is_streamed = self.evict_all, self.is_streamed
        self.masters.placeholder, self.masters.on_adopted = self._placeholder, self._adopted
        if self.training is not None:
            self.masters.training = self.training
            self.training.install(lambda idx: self.use(idx, current_phase()))
        for idx in self.store.layers:
            self.masters.install_hooks(idx)
        self.pool = DevicePool(self.device, self.placement.slot_count, self.placement.slot_bytes)
        self.store.ensure_staging(2, self.placement.slot_bytes)
        if isinstance(self.transport, CudaTransport):
            self.copier = CudaCopier(
                self.transport,
                self.store,
                event_sync=self.config.transfer.ordered_by_events,
                use_thread=self.config.transfer.threading,
                landing_bytes=self.placement.landing_bytes,
            )
        else:
            self.copier = DeferredCopier(
                self.store, use_thread=self.config.transfer.threading, transport=self.transport
            )
        self.predictor = UsePredictor(len(self.layers))
        self.stats = StatsCollector(self.device, lambda: self.pinned_bytes)
        self.profiler: Profiler | None = None
        self._listeners: list[Listener] = []
        self.add_listener(self.stats)
        if self.config.observe.profile:
            c = self.config
            self.profiler = Profiler(
                c.observe.profile,
                self.device,
                c.observe.profile_warmup_steps,
                c.observe.profile_steps,
                c.transfer.cuda_streams,
                self._log,
            )
            self.add_listener(self.profiler)
        if self.driver is not None:
            self.driver.attach(self)
            self.add_listener(self.driver)
        self._current: int | None = None
        self._last_use: tuple[int, Phase] | None = None
        self._plans: dict[tuple, tuple[int, ...]] = {}  # prefetch targets per (previous, current) use
        self._plans_version = -1
        self._clock = 0
        self._lock = threading.RLock()
        owners, holders = [e.layer for e in self.entries], [i for i, e in enumerate(self.entries) if e.holder]
        self._hooks = HookAdapter(self.layers, self, owners, holders)
        self._hooks.install()
        self._unit_checkpoints: UnitCheckpoints | None = None
        if self.pieces:
            hooks, offloader = self._hooks, self.activations
            calling = (lambda: offloader.calling) if self.config.activations.keep_piece_outputs else None
            self._unit_checkpoints = UnitCheckpoints(
                self.pieces, hooks.saved_tensor_hooks, hooks.use_inside, self.device, calling
            )
            self._unit_checkpoints.install()
            hooks.replays = self._unit_checkpoints.replays
        compile_backend = self.config.compute.compile_backend if self.config.compute.compile else None
        self._patches = ForwardPatches(self.layers, self.device, self.config.compute.autocast, compile_backend)
        self._patches.placement_changed(self._runs_eager)
        # Last: a cast is lossy, and nothing after it can fail.
        self._trainable_cast = cast_trainable(
            [m for _, m in modules_of(self.layers)], self.config.compute.mixed_precision
        )

    @property
    def store(self) -> HostStore:
        """The packed host masters of the streamed layers (owned by :attr:`masters`)."""
        return self.masters.store

    # ---------------------------------------------------------------- set-up
    def _start_training(self) -> None:
        """Full fine-tuning: fp32 masters, gradient landings and the optimizer of streamed layers on the host."""
        if self.masters.peers.shared:
            raise DGLSUserError(
                "full fine-tuning of streamed layers runs one process per set of layers: data parallel "
                "processes would each update the shared host masters; use pipeline_stages = number of GPUs, "
                "or train a LoRA"
            )
        cuda = self.device.type == "cuda"
        hosts = {idx: self.masters.host(idx) for idx in self.placement.streamed}
        spec = self.config.training.host_optimizer
        self.training = HostTraining(
            hosts,
            spec,
            self.transport,
            pin=cuda,
            threaded=cuda or self.config.transfer.threading,
            accumulation_steps=self.config.training.accumulation_steps,
            clipping=self.config.training.clip_grads,
            updater=DeviceUpdater(self.transport) if spec.on_device else None,
        )

    def _offloads_activations(self) -> bool:
        """``offload_activations`` resolved: unset means offload what a VRAM budget needs, on CUDA (on the CPU
        there is no device memory to save, and the planner measures none)."""
        wanted = self.config.activations.offload_activations
        if self.config.activations.offload_recompute or self.config.activations.keep_piece_outputs:
            return True
        if wanted is None:
            return self.driver is not None and self.device.type == "cuda"
        return wanted

    def _unit_bytes(self, layers: list, rules: CastRules | None, host_trained: bool) -> int | None:
        """The largest swap unit in bytes (None: whole layers): ``swap_unit_mb`` if given, else the planner's
        choice for the VRAM budget (from the whole layers' sizes)."""
        given = self.config.placement.swap_unit_mb
        if given is not None:  # rounded up: any size above 0, however small, splits (0 alone means whole layers)
            return math.ceil(given * MB) or None
        if self.driver is None:
            return None
        whole = measure(layers, rules, self.config.compute.mixed_precision, host_trained=host_trained)
        unit = unit_bytes_for_budget([layout.sizes for layout in whole], self.driver.budget)
        if unit is not None:
            self._log(
                f"DGLS: two slots of the largest layer would take over a quarter of the budget: layers over "
                f"{human_bytes(unit)} stream as swap units (--swap_unit_mb to choose, 0 for whole layers)"
            )
        return unit

    def _start_driver(self) -> PlacementDriver | None:
        config = self.config
        if config.placement.vram_budget is None:
            return None
        if config.training.host_optimizer is not None and not config.placement.explicit:
            raise DGLSUserError(
                "full fine-tuning places layers once, at start-up (the optimizer state of a streamed layer lives "
                "on the host), and the VRAM-budget planner re-places layers while training: give blocks_to_swap "
                "or gpu_layers instead of vram_budget"
            )
        if config.placement.explicit:
            self._log(
                f"DGLS: {', '.join(config.placement.explicit)} given: explicit placement wins over vram_budget "
                f"{config.placement.vram_budget} (the planner is off)"
            )
            return None
        budget = resolve_budget(config.placement.vram_budget, self.device)
        self._log(
            f"DGLS: planning for a {human_bytes(budget)} VRAM budget: steps 1-2 run with every layer streamed "
            "(warm-up, then the probe); then the best predicted plans are measured on the next steps (about 35), "
            "and the fastest that fits is kept"
        )
        return PlacementDriver(
            budget, self.device, self._log, plan_only=config.placement.plan, copy_streams=config.transfer.cuda_streams
        )

    def _check_casts_match(self, rules: CastRules | None) -> None:
        """Refuse a cast_target pair that casts nothing: never report a cast that does not happen."""
        if rules is None:
            return
        cast_from = {p.param.dtype for layout in self.layouts for p in layout.params if p.stored != p.param.dtype}
        unused = [(a, b) for a, b in rules.pairs if a not in cast_from]
        if unused:
            present = sorted({name_of(p.param.dtype) for layout in self.layouts for p in layout.params})
            pairs = ", ".join(f"{name_of(a)} {name_of(b)}" for a, b in unused)
            raise DGLSUserError(
                f"cast_target {pairs} casts nothing: no frozen param of a layer is {name_of(unused[0][0])} (they are "
                f"{', '.join(present) or 'absent'}; norm layers only count with --cast_norms): drop the pair"
            )

    def _stream(self, idx: int) -> None:
        """Make a layer streamed: its master is in the store; its params now point at placeholders."""
        layer = StreamedLayer(self.layers[idx], self.masters.host(idx), self._placeholder)
        self._streamed[idx] = layer

    def _unstream(self, idx: int) -> None:
        """Make a streamed layer resident: its params get device copies of the master's values."""
        layer = self._streamed.pop(idx)
        with torch.no_grad():
            for k, param in enumerate(layer.params):
                param.data = self.masters.device_value(idx, k)
        self.masters.became_resident(idx)

    def _adopted(self, idx: int) -> None:
        """``load_state_dict(assign=True)`` replaced a layer's Parameter objects (see :mod:`.masters`)."""
        for t in (*self.layers[idx].parameters(), *self.layers[idx].buffers()):
            self._home.setdefault(id(t), (t, t.device, t.dtype))
        if self._streamed.pop(idx, None) is not None:
            self._stream(idx)
        else:
            with torch.no_grad():
                for k, p in enumerate(self.layouts[idx].params):
                    p.param.data = self.masters.device_value(idx, k)

    def _place_resident_parts(self) -> None:
        """Every param and buffer that does not stream goes to the device; the streamable params of
        resident layers take their cast (fp8 ones the values of their master)."""
        streamed = {id(p) for layer in self._streamed.values() for p in layer.params}
        cast = {
            id(p.param): (layout.index, k, p)
            for layout in self.layouts
            if layout.index not in self._streamed
            for k, p in enumerate(layout.params)
        }
        with torch.no_grad():
            for t, _, _ in self._home.values():
                if id(t) in streamed:
                    continue
                if id(t) in cast:
                    idx, k, p = cast[id(t)]
                    has = self.masters.has(idx)
                    t.data = self.masters.device_value(idx, k) if has else t.data.to(self.device, p.dtype)
                else:
                    t.data = t.data.to(self.device)

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor: an evicted param points here, so any use of it fails."""
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._placeholders[dtype]

    def _report_start(self, cast_rules: CastRules | None) -> None:
        self._log(self.placement.table())
        if split_note(self.entries, self.unit_bytes):
            self._log(split_note(self.entries, self.unit_bytes))
        if self.pieces:
            layers = len({self.entries[piece.entry].layer for piece in self.pieces})
            cost = (
                "their outputs wait in host memory for their layer's recompute"
                if self.config.activations.keep_piece_outputs
                else "each piece's forward runs once more per step"
            )
            self._log(
                f"DGLS: checkpoint_units: {len(self.pieces)} swap units or child modules of {layers} layers run "
                f"under checkpoints of their own (a layer's backward holds one piece's activations; {cost})"
            )
        if self._training_note:
            scratch = self.training.device_bytes
            on_device = f" ({human_bytes(scratch)} of device buffers)" if scratch else ""
            kernel = self.training.implementation
            self._log(f"{self._training_note}; optimizer of the streamed layers: {kernel}{on_device}")
        for note in self.placement.notes():
            self._log(note)
        config = self.config
        if cast_rules or config.compute.autocast or config.compute.mixed_precision != "auto":
            self._log(
                describe(cast_rules, config.compute.autocast, config.compute.mixed_precision, self._trainable_cast)
            )
        pageable = self.store.pageable_layers
        if pageable:
            self._log(
                f"DGLS: the pinned-RAM budget ({human_bytes(self.store.pinned_budget)}) covers "
                f"{len(self.store.layers) - len(pageable)} of {len(self.store.layers)} streamed layers; the other "
                f"{len(pageable)} stay pageable and are staged through 2 pinned buffers (slower): free RAM or raise "
                "pinned_ram_budget_gb"
            )

    # ---------------------------------------------------------------- what the hooks call
    def use(self, idx: int, phase: Phase) -> None:
        """A use of layer ``idx`` begins: release the previous one, make this one resident, prefetch."""
        with self._lock:
            self.copier.check()
            if (idx, phase) == self._last_use:
                return
            self._last_use = (idx, phase)
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

    def pass_end(self) -> None:
        """A backward pass finished: the listeners' step boundary (the planner may re-place here). With
        host training, every host-trained layer is evicted: its slot copy is older than its next update."""
        with self._lock:
            if self.training is not None:
                self.training.backward_done()
                self._evict(self.training.layers)
            if self.config.transfer.sync_each_step and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for listener in list(self._listeners):
                listener.pass_ended()

    def is_streamed(self, idx: int) -> bool:
        return idx in self._streamed

    def _runs_eager(self, idx: int) -> bool:
        """Never compiled: streamed entries (their weights move), holders (they run streamed units) and
        entries with checkpointed pieces (:mod:`.unit_checkpoints`)."""
        return idx in self._streamed or self.entries[idx].holder or idx in self._piece_entries

    def slot_ref(self, tensor: torch.Tensor) -> SlotRef | None:
        slot = self.pool.slot_of(tensor)
        if slot is None or slot.owner is None:
            return None
        return SlotRef(slot.owner, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype)

    def view_of(self, ref: SlotRef) -> torch.Tensor:
        """A saved view, rebuilt in its layer's current slot (making the layer resident first)."""
        self.use(ref.layer, current_phase())
        buffer = self._streamed[ref.layer].slot.buffer.view(ref.dtype)
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
            self._fetch([(layer, self._claim_slot(layer.index, {layer.index}))], demand=True)
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
        protected = set(wanted) | {self._current}
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
        if self.config.transfer.batch_move:
            self._fetch(requests, demand=False)
        else:
            for request in requests:
                self._fetch([request], demand=False)

    def _wanted(self, depth: int) -> tuple[int, ...]:
        """The next ``depth`` streamed layers the predictor expects after the current use, cached per
        (previous, current) use until the predictor learns something new (a table lookup per use)."""
        predictor = self.predictor
        if self._plans_version != predictor.version:
            self._plans.clear()
            self._plans_version = predictor.version
        key = (predictor.previous, predictor.current)
        wanted = self._plans.get(key)
        if wanted is None:
            found: list[int] = []
            seen = {self._current}
            for idx, _ in predictor.upcoming(limit=2 * len(self.layers) + 2):
                if idx not in seen:
                    seen.add(idx)
                    if idx in self._streamed:
                        found.append(idx)
                        if len(found) == depth:
                            break
            wanted = self._plans[key] = tuple(found)
        return wanted

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
        after = None
        if self.training is not None:  # the packed copy must hold the layer's latest update
            after = [self.training.wait_update(layer.index) for layer, _ in requests]
        tokens = self.copier.submit([(slot, layer.host, demand) for layer, slot in requests], after)
        for (layer, slot), token in zip(requests, tokens):
            layer.fetch(slot, token)

    # ---------------------------------------------------------------- public
    @property
    def pinned_bytes(self) -> int:
        """Host memory DGLS page-locked: packed copies, and with full fine-tuning the gradient landings
        (and, for device updates, the masters and moments); offloaded activations' buffers."""
        training, activations = self.training, self.activations
        return (
            self.store.pinned_bytes
            + (training.pinned_bytes() if training is not None else 0)
            + (activations.pinned_bytes() if activations is not None else 0)
        )

    def checkpoint_function(self, checkpoint: Callable) -> Callable:
        """The trainer's checkpoint function (``checkpoint(function, *args, **kwargs)``), with activation
        offload around it when activations are offloaded (``offload_activations``, or a VRAM budget on CUDA
        unless it is False); unchanged otherwise."""
        if self.activations is None:
            return checkpoint
        return self.activations.wrap(checkpoint)

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return self.placement.streamed

    @property
    def plan_finished(self) -> bool:
        """True once a ``plan_only`` run has shown its plan: the caller should stop (an explicit
        placement is shown at construction, so there is nothing to train for)."""
        if not self.config.placement.plan:
            return False
        return self.driver is None or self.driver.done

    def placement_table(self) -> str:
        return self.placement.table()

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
            if self.training is not None:
                raise DGLSUserError(
                    "full fine-tuning places layers once: the optimizer state of streamed layers lives on the host"
                )
            wanted = set(streamed)
            bad = [i for i in wanted if not 0 <= i < len(self.layers)]
            if bad:
                raise DGLSUserError(f"layers {bad} out of range: the model has {len(self.layers)} layers")
            wanted = {i for i in wanted if self.layouts[i].sizes.streamable_bytes}
            self.evict_all()
            for idx in sorted(set(self._streamed) - wanted):
                self._unstream(idx)
            for idx in sorted(wanted - set(self._streamed)):
                if not self.masters.has(idx):
                    self.masters.add(idx)
                self._stream(idx)
            sizes = tuple(layout.sizes for layout in self.layouts)
            self.placement = Placement(
                sizes, tuple(sorted(self._streamed)), prefetch, self.config.transfer.cuda_streams
            )
            self.config = self.config.replace(prefetch=prefetch)
            if self.activations is not None:  # restores ahead: as deep as weights; kept: at least as many
                depth = max(1, prefetch)
                self.activations.set_depth(max(depth, kept_activations or 0), depth)
            self._plans.clear()
            self.pool.release()
            self.pool = DevicePool(self.device, self.placement.slot_count, self.placement.slot_bytes)
            self.copier.forget_slots()
            self.copier.resize(self.placement.landing_bytes)
            self.store.ensure_staging(2, self.placement.slot_bytes)
            for layer in self._streamed.values():
                layer.forget_views()
            self._patches.placement_changed(self._runs_eager)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def evict_all(self) -> None:
        """Drop every streamed layer from the device (between passes, e.g. before sampling)."""
        with self._lock:
            self.copier.drain()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._evict(self._streamed)

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        """Inside the block, streamed params point at their true values in host memory (the fp32 masters of
        host-trained params): for code that reads params directly rather than through ``state_dict`` (a
        saver). Nothing may run the layers meanwhile."""
        with self._lock:
            self.evict_all()
            if self.training is not None:
                self.training.finish()
            for layer in self._streamed.values():
                layer.show(self._true_values(layer, self.training))
            try:
                yield
            finally:
                for layer in self._streamed.values():
                    layer.hide()

    @staticmethod
    def _true_values(layer: StreamedLayer, training: HostTraining | None) -> list[torch.Tensor]:
        """A streamed layer's params as they truly are: the fp32 masters of host-trained ones, the host
        copy's values of the others (fp8-stored ones dequantized)."""
        masters = [training.master_of(p) if training is not None else None for p in layer.params]
        return [m if m is not None else layer.host.value(k) for k, m in enumerate(masters)]

    def _evict(self, indices: Iterable[int]) -> None:
        """Release the current use and drop these layers' device copies (the release markers keep the
        slots from being rewritten before the kernels that read them, so the host need not wait)."""
        self._release_current()
        for idx in indices:
            layer = self._streamed[idx]
            if layer.state is not Residency.HOST:
                layer.evict()
        self._current = None
        self._last_use = None

    def remove(self) -> None:
        """Put every module back as it was (params and buffers on their original devices, in their
        original dtypes); free the pool, the pinned memory, the hooks and the transport's worker threads. Also undoes
        a swapper whose construction failed half-way (the parts it did not get to are skipped). Values
        ``cast_target`` rounded (fp8, or a 16-bit TO) come back rounded: the originals are not kept, since
        keeping them would double the host RAM a large model needs."""
        if self._removed:
            return
        self._removed = True
        built = self.__dict__
        if built.get("profiler") is not None:
            self.profiler.close()
        if built.get("training") is not None:
            self.training.close()
        if built.get("activations") is not None:
            self.activations.synchronize()
        if "copier" in built:
            self.copier.close()
        if "transport" in built:
            self.transport.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for part in ("_hooks", "_patches", "_unit_checkpoints"):
            if built.get(part) is not None:
                built[part].remove()
        with torch.no_grad():
            streamed = set()
            training = built.get("training")
            for layer in built.get("_streamed", {}).values():
                for param, value in zip(layer.params, self._true_values(layer, training)):
                    _, device, dtype = self._home[id(param)]
                    param.data = value.to(device, dtype, copy=True)
                    streamed.add(id(param))
            for t, device, dtype in self._home.values():
                if id(t) not in streamed and (t.device != device or t.dtype != dtype):
                    t.data = t.data.to(device, dtype)
                if isinstance(t, nn.Parameter) and t.grad is not None and t.grad.dtype != dtype:
                    t.grad = t.grad.to(dtype)
        built.get("_streamed", {}).clear()
        if "pool" in built:
            self.pool.release()
        if "masters" in built:
            self.masters.release()

    def __enter__(self) -> LayerSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
