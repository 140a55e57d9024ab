"""LayerSwapper: the public entry point that streams a list of layers through a device pool.

Per streamed layer the frozen params are rebound (``param.data``) to one of three
places: an empty placeholder while evicted (any use fails loudly, on CPU too), a view
into a device slot while resident, or a view into the host master while a state dict is
written. Parameter objects are never replaced, so optimizers and PEFT keep working.

Ordering rule behind eviction: a layer stays pinned from the moment its use begins
(forward pre-hook, checkpoint recompute, saved-tensor unpack, or the gradient reaching
its output) until another layer's use begins. By then every kernel that reads it has
been enqueued (forward is sequential; the autograd engine runs one device's nodes in
decreasing sequence number), so an event recorded at that moment on the compute stream
is behind its last reader, and the copy stream waits on that event before reusing the slot.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .autoplan import AutoPlanner, resolve_budget
from .config import SwapConfig
from .device_pool import DevicePool, Slot
from .errors import DGLSUserError
from .host_store import GiB, HostLayer, HostStore, ParamSlot, default_pinned_budget
from .monitor import check_pinned_budget
from .placement import MB, Placement, modules_of, plan_placement, shared_param_ids
from .precision import CastRules, autocast_context, cast_trainable, check_device_support, describe
from .profiler import Profiler
from .schedule import Use, UsePredictor, current_phase
from .stats import StatsCollector, StepStats
from .transfer import CopyEngine, Fetch


@dataclass
class StreamedLayer:
    """Per-layer state of one streamed layer."""

    index: int
    module: nn.Module
    host: HostLayer
    names: dict[str, ParamSlot]  # state-dict names (relative to the layer) of streamed params
    slot: Slot | None = None
    fetch: Fetch | None = None
    waited: bool = False  # the compute stream already waits on the fetch
    bound: bool = False  # params point into the slot
    handles: list = field(default_factory=list)  # its state-dict hooks


@dataclass(frozen=True)
class SlotRef:
    """What autograd keeps instead of a view into a slot: enough to rebuild it later."""

    layer: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class LayerSwapper:
    """Keep some layers resident on ``device`` and stream the others in just before use.

    ``layers`` run one after another (a ``to_layers()`` list, an ``nn.Sequential``, a list
    of blocks). Pass them on the CPU (or anywhere): frozen params of streamed layers move
    to host memory, everything else moves to ``device``. Call :meth:`remove` (or use the
    swapper as a context manager) to put the modules back as they were.
    """

    def __init__(
        self,
        layers: Iterable[nn.Module],
        config: SwapConfig | None = None,
        device: torch.device | str | None = None,
        log=print,
    ) -> None:
        self.layers: list[nn.Module] = list(layers)
        if not self.layers:
            raise DGLSUserError("no layers to place: the layer list is empty")
        self.config = config or SwapConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._log = log or (lambda *_: None)
        self._trainable_cast = cast_trainable([m for _, m in modules_of(self.layers)], self.config.mixed_precision)
        self.autoplanner: AutoPlanner | None = None
        if self.config.vram_budget_gb is not None:
            self.config = self._start_autoplanner()
        self.placement: Placement = plan_placement(self.layers, self.config)
        if self.autoplanner is not None:
            self.autoplanner.check_static_minimum(self.placement.sizes)
        self._home: dict[int, tuple[torch.Tensor, torch.device]] = {}  # where each tensor came from
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._streamed: dict[int, StreamedLayer] = {}
        self._handles: list = []
        self._saved_hooks: list = []
        self._autocasts: list = []  # autocast contexts entered by forward pre-hooks, exited by post hooks
        self._cast_rules = CastRules.from_config(self.config)
        check_device_support(self.device, self._cast_rules)
        self._current: int | None = None
        self._last_use: Use | None = None
        self._clock = 0
        self._lock = threading.RLock()
        self._removed = False

        self.store: HostStore
        self._build_host_store()
        self._move_resident_parts()
        slot_bytes = max((sl.host.nbytes for sl in self._streamed.values()), default=0)
        self.pool = DevicePool(self.device, self.placement.slot_count, slot_bytes)
        self.store.ensure_staging(2, slot_bytes)
        self.copies = CopyEngine(
            self.device,
            self.store,
            streams=self.config.cuda_streams,
            event_sync=self.config.event_sync,
            use_thread=self.config.threading,
            timing=self.config.collect_timing,
            landing_bytes=max((sl.host.landing_bytes for sl in self._streamed.values()), default=0),
        )
        self.predictor = UsePredictor(len(self.layers))
        self.stats = StatsCollector(self.device)
        self.profiler: Profiler | None = None  # only with profile_path: costs nothing otherwise
        if self.config.profile_path:
            c = self.config
            self.profiler = Profiler(
                c.profile_path, self.device, c.profile_warmup_steps, c.profile_steps, c.cuda_streams, self._log
            )
        self._install_hooks()
        self._compiled: set[int] = set()
        self._compile_resident()
        self._log(self.placement.table())
        if self._cast_rules or self.config.autocast or self.config.mixed_precision != "auto":
            config = self.config
            self._log(describe(self._cast_rules, config.autocast, config.mixed_precision, self._trainable_cast))
        if self.store.pageable_layers:
            self._log(
                f"DGLS: the pinned-RAM budget ({self.store.pinned_budget / GiB:.1f} GiB) covers "
                f"{len(self._streamed) - len(self.store.pageable_layers)} of {len(self._streamed)} streamed "
                f"layers; the other {len(self.store.pageable_layers)} stay pageable and are staged through "
                "2 pinned buffers (slower): free RAM or raise pinned_ram_budget_gb"
            )

    # ---------------------------------------------------------------- set-up
    def _build_host_store(self) -> HostStore:
        shared = shared_param_ids(self.layers)
        streamed_params = {idx: self._streamable(idx, shared) for idx in self.placement.streamed}
        on_cpu = total = 0
        for named in streamed_params.values():
            for _, p in {id(p): (n, p) for n, p in named}.values():
                total += p.numel() * p.element_size()
                on_cpu += p.numel() * p.element_size() if p.device.type == "cpu" else 0
        budget = self.config.pinned_ram_budget_gb
        budget = int(budget * GiB) if budget is not None else default_pinned_budget(on_cpu)
        threshold = int(self.config.selective_packing * MB)
        store = HostStore(self.device, budget, threshold)
        store.check_ram(total, on_cpu)
        if store.use_pinning and (note := check_pinned_budget(min(total, budget), freed_bytes=on_cpu)):
            self._log(note)
        self.store = store
        for idx, named in streamed_params.items():
            self._stream_layer(idx, named)
        return store

    def _start_autoplanner(self) -> SwapConfig:
        """Explicit placement wins over a budget; otherwise start with everything streamed."""
        config = self.config
        explicit = [
            name
            for name in ("gpu_layers", "blocks_to_swap", "initial_gpu_layers", "final_gpu_layers")
            if getattr(config, name) is not None
        ]
        if explicit:
            self._log(
                f"DGLS: {', '.join(explicit)} given: explicit placement wins over vram_budget {config.vram_budget_gb}"
                " (the planner is off)"
            )
            return config
        budget = resolve_budget(config.vram_budget_gb, self.device)
        self.autoplanner = AutoPlanner(
            budget, self.device, self._log, plan_only=config.plan_only, copy_streams=config.cuda_streams
        )
        self._log(
            f"DGLS: planning for a {budget / GiB:.2f} GiB VRAM budget: steps 1-2 run with every layer streamed "
            "(warm-up, then the probe); then the best predicted plans are measured on the next steps (about 35), "
            "and the fastest that fits is kept"
        )
        return config.replace(gpu_layers=[], prefetch=1)

    def _streamable(self, idx: int, shared: set[int]) -> list[tuple[str, nn.Parameter]]:
        """(name, param) of the frozen, unshared params of one layer: what can stream."""
        return [
            (n, p)
            for n, p in self.layers[idx].named_parameters(remove_duplicate=False)
            if not p.requires_grad and id(p) not in shared
        ]

    def _stream_layer(self, idx: int, named: list[tuple[str, nn.Parameter]]) -> None:
        """Pack a layer's frozen params into the host store and point them at placeholders."""
        unique = list({id(p): p for _, p in named}.values())
        for p in unique:
            self._home.setdefault(id(p), (p, p.device))
        casts = self._cast_rules.plan(self.layers[idx]) if self._cast_rules else None
        host = self.store.add_layer(idx, unique, casts)
        by_param = {id(ps.param): ps for ps in host.params}
        names = {n: by_param[id(p)] for n, p in named}
        for ps in host.params:
            ps.param.data = self._placeholder(ps.dtype)
        sl = StreamedLayer(idx, self.layers[idx], host, names)
        sl.handles = [
            sl.module.register_state_dict_post_hook(partial(self._state_dict_post, sl)),
            sl.module.register_load_state_dict_pre_hook(partial(self._load_pre, sl)),
            sl.module.register_load_state_dict_post_hook(partial(self._load_post, sl)),
        ]
        self._streamed[idx] = sl

    def _unstream_layer(self, sl: StreamedLayer) -> None:
        """Make a streamed layer resident: its params get device copies of their masters."""
        for handle in sl.handles:
            handle.remove()
        with torch.no_grad():
            for ps in sl.host.params:
                ps.param.data = sl.host.value(ps).to(self.device, copy=True)
        self.store.remove_layer(sl.index)
        del self._streamed[sl.index]

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor: an evicted param points here, so any use of it fails."""
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._placeholders[dtype]

    def _move_resident_parts(self) -> None:
        streamed = {id(ps.param) for sl in self._streamed.values() for ps in sl.host.params}
        seen: set[int] = set()
        with torch.no_grad():
            for _, layer in modules_of(self.layers):
                for t in list(layer.parameters()) + list(layer.buffers()):
                    if id(t) in streamed or id(t) in seen:
                        continue
                    seen.add(id(t))
                    self._home.setdefault(id(t), (t, t.device))
                    t.data = t.data.to(self.device)

    def _install_hooks(self) -> None:
        for idx, layer in modules_of(self.layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._pre_forward, idx)))
            self._handles.append(layer.register_forward_hook(partial(self._post_forward, idx), always_call=True))

    def _compile_resident(self) -> None:
        """``compile_resident``: compile the forward of resident layers only (an instance attribute
        over the class's forward, deleted again when the layer streams or on remove()); streamed
        layers stay eager because their weights move between slots."""
        if not self.config.compile_resident:
            return
        for idx, layer in modules_of(self.layers):
            if idx in self._streamed and idx in self._compiled:
                del layer.forward
                self._compiled.discard(idx)
            elif idx not in self._streamed and idx not in self._compiled:
                layer.forward = torch.compile(layer.forward, backend=self.config.compile_backend)
                self._compiled.add(idx)

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, idx: int, module: nn.Module, args) -> None:
        self._use(idx, current_phase())
        # Entered here, exited in the post hook: a checkpoint's recompute calls the hooks again.
        autocast = autocast_context(self.device, self.config.autocast)
        if autocast is not None:
            autocast.__enter__()
        self._autocasts.append(autocast)
        hooks = None
        if (
            idx in self._streamed
            and torch.is_grad_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(True) is None
        ):
            # Not under a checkpoint: autograd would keep views of the slot for backward.
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
        self._saved_hooks.append(hooks)

    def _post_forward(self, idx: int, module: nn.Module, args, output) -> None:
        hooks = self._saved_hooks.pop() if self._saved_hooks else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        autocast = self._autocasts.pop() if self._autocasts else None
        if autocast is not None:
            autocast.__exit__(None, None, None)
        if output is None:
            return
        if idx in self._streamed:
            for t in _tensors(output):
                if self.pool.slot_of(t) is not None:
                    raise DGLSUserError(
                        f"layer {idx} ({type(module).__name__}) returns a view of its own weights, which "
                        f"would be overwritten when it is evicted: keep it resident (add {idx} to gpu_layers)"
                    )
        if torch.is_grad_enabled() and current_phase() != "B":
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._on_output_grad, idx))
                    break

    def _on_output_grad(self, idx: int, grad: torch.Tensor) -> None:
        self._use(idx, "B")

    def _pack(self, tensor: torch.Tensor):
        slot = self.pool.slot_of(tensor)
        if slot is None or slot.layer is None:
            return tensor
        return SlotRef(slot.layer, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype)

    def _unpack(self, packed):
        if not isinstance(packed, SlotRef):
            return packed
        self._use(packed.layer, current_phase())
        slot = self._streamed[packed.layer].slot
        with torch.no_grad():
            view = torch.empty(0, dtype=packed.dtype, device=self.device)
            view.set_(slot.buffer.untyped_storage(), packed.offset, packed.size, packed.stride)
        return view

    def _state_dict_post(self, sl: StreamedLayer, module, state_dict, prefix, local_metadata) -> None:
        """Write the true weights (the host masters, dequantized if fp8), not the placeholder or a slot view."""
        for name, ps in sl.names.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = sl.host.value(ps)

    def _load_pre(self, sl: StreamedLayer, module, state_dict, prefix, *args) -> None:
        """Point the params at their host masters so the loader writes the true weights."""
        self.copies.drain()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for ps in sl.host.params:
            ps.param.data = sl.host.value(ps)  # fp8 storage: a dequantized copy, re-quantized after loading

    def _load_post(self, sl: StreamedLayer, module, incompatible_keys) -> None:
        for ps in sl.host.params:
            if ps.scaled:
                sl.host.store_value(ps, ps.param.data)
        if sl.slot is not None:
            self._evict(sl)
        for ps in sl.host.params:
            ps.param.data = self._placeholder(ps.dtype)
        sl.bound = False

    # ---------------------------------------------------------------- scheduling
    def _use(self, idx: int, phase: str) -> None:
        """A use of layer ``idx`` begins: pin it, make it resident, prefetch what follows."""
        with self._lock:
            self.copies.check()
            use = (idx, phase)
            if use == self._last_use:
                return
            self._last_use = use
            self.predictor.observe(use)
            if self.autoplanner is not None and self.autoplanner.recorder is not None:
                self.autoplanner.recorder.use_started(idx, phase)
            if self.profiler is not None:
                self.profiler.use_started(idx, phase, idx in self._streamed)
            if self._current != idx:
                self._release_current()
                self._current = idx
                self._clock += 1
            sl = self._streamed.get(idx)
            if sl is not None:
                self.stats.used(missed=sl.slot is None)
                self._make_resident(sl)
            self._prefetch()

    def _release_current(self) -> None:
        """Every kernel reading the current layer is enqueued: mark its slot reusable after them."""
        sl = self._streamed.get(self._current) if self._current is not None else None
        if sl is None or sl.slot is None:
            return
        if self.device.type == "cuda" and sl.waited:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            sl.slot.released = event
        sl.slot.last_used = self._clock

    def _make_resident(self, sl: StreamedLayer) -> None:
        if sl.slot is None:
            fetch = self._new_fetch(sl, self._claim_slot(protected={sl.index}), demand=True)
            self.copies.submit([fetch])
        if not sl.waited:
            fetch = sl.fetch
            self.copies.wait_issued(fetch)
            if self.device.type == "cuda":
                compute = torch.cuda.current_stream(self.device)
                timing = self.config.collect_timing
                if timing:
                    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    before.record(compute)
                if self.config.event_sync:
                    compute.wait_event(fetch.ready)
                else:
                    fetch.ready.synchronize()
                if timing:
                    after.record(compute)
                    self.stats.waited(before, after)
                    if self.autoplanner is not None and self.autoplanner.recorder is not None:
                        self.autoplanner.recorder.waited(before, after)
                    if self.profiler is not None:
                        self.profiler.waited(sl.index, before, after)
            self.stats.fetched(fetch.nbytes, fetch.demand, fetch.start, fetch.ready)
            if self.profiler is not None:
                self.profiler.fetched(fetch)
            sl.waited = True
        if not sl.bound:
            self._bind(sl)

    def _prefetch(self) -> None:
        depth = self.config.prefetch
        if depth == 0 or not self._streamed:
            return
        wanted: list[int] = []
        seen = {self._current}
        for layer, _ in self.predictor.upcoming(limit=2 * len(self.layers) + 2):
            if layer in seen:
                continue
            seen.add(layer)
            if layer in self._streamed:
                wanted.append(layer)
                if len(wanted) == depth:
                    break
        protected = set(wanted) | {self._current}
        batch = []
        for layer in wanted:
            sl = self._streamed[layer]
            if sl.slot is None:
                slot = self._claim_slot(protected)
                if slot is None:
                    break
                batch.append(self._new_fetch(sl, slot, demand=False))
            sl.slot.last_used = self._clock
        if not batch:
            return
        if self.config.batch_move:
            self.copies.submit(batch)
        else:
            for fetch in batch:
                self.copies.submit([fetch])

    def _claim_slot(self, protected: set[int]) -> Slot | None:
        """A free slot, or the least recently used one outside ``protected`` (evicting it)."""
        slot = self.pool.free_slot()
        if slot is not None:
            return slot
        candidates = [s for s in self.pool.slots if s.layer not in protected and s.layer != self._current]
        if not candidates:
            return None
        slot = min(candidates, key=lambda s: s.last_used)
        self._evict(self._streamed[slot.layer])
        return slot

    def _new_fetch(self, sl: StreamedLayer, slot: Slot, demand: bool) -> Fetch:
        fetch = self.copies.new_fetch(sl.index, sl.host, slot, demand)
        slot.layer = sl.index
        slot.last_used = self._clock
        sl.slot, sl.fetch, sl.waited, sl.bound = slot, fetch, False, False
        return fetch

    def _evict(self, sl: StreamedLayer) -> None:
        """Drop the device copy: frozen weights never travel back, the host master is still valid."""
        for ps in sl.host.params:
            ps.param.data = self._placeholder(ps.dtype)
        sl.slot.layer = None
        sl.slot, sl.fetch, sl.waited, sl.bound = None, None, False, False

    def _bind(self, sl: StreamedLayer) -> None:
        buffer = sl.slot.buffer
        for ps in sl.host.params:
            ps.param.data = buffer[ps.offset : ps.offset + ps.nbytes].view(ps.dtype).view(ps.shape)
        sl.bound = True

    # ---------------------------------------------------------------- public
    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return self.placement.streamed

    @property
    def plan_finished(self) -> bool:
        """True once a ``plan_only`` run has printed its plan: the caller should stop training."""
        return self.autoplanner is not None and self.autoplanner.plan_only and self.autoplanner.done

    def placement_table(self) -> str:
        return self.placement.table()

    def step_stats(self, reset_peak: bool = True) -> StepStats:
        """Stats since the last call; resets the counters. Call it once per optimizer step: with a
        VRAM budget, the planner probes, plans and checks at these calls.

        Synchronises the device (to read this step's copy timings). ``peak_vram_bytes`` is
        torch's process-wide peak; with ``reset_peak`` (the default) that peak is reset so the
        next call reports one step, so pass False if you read ``max_memory_allocated`` yourself.
        """
        if self.config.sync_each_step and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats = self.stats.take(self.store.pinned_bytes, reset_peak)
        if self.profiler is not None:
            self.profiler.step_done()
        if self.autoplanner is not None:
            self.autoplanner.step_done(self, stats)
        return stats

    def apply_placement(self, streamed: Iterable[int], prefetch: int) -> None:
        """Change which layers stream and the prefetch depth, between steps.

        Layers that become resident get device copies of their masters (and give their
        host memory back); layers that become streamed are packed into host memory. The
        pool is rebuilt for the new largest streamed layer and ``prefetch + 1`` slots.
        """
        with self._lock:
            wanted = set(streamed)
            shared = shared_param_ids(self.layers)
            bad = [i for i in wanted if not 0 <= i < len(self.layers)]
            if bad:
                raise DGLSUserError(f"layers {bad} out of range: the model has {len(self.layers)} layers")
            self.evict_all()
            for idx in sorted(set(self._streamed) - wanted):
                self._unstream_layer(self._streamed[idx])
            for idx in sorted(wanted - set(self._streamed)):
                named = self._streamable(idx, shared) if isinstance(self.layers[idx], nn.Module) else []
                if named:
                    self._stream_layer(idx, named)
            self.config = self.config.replace(prefetch=prefetch)
            sizes = self.placement.sizes
            order = tuple(sorted(self._streamed))
            slot_bytes = max((sl.host.nbytes for sl in self._streamed.values()), default=0)
            landing = self.copies.landing_bytes * self.config.cuda_streams
            self.placement = Placement(sizes, order, min(len(order), prefetch + 1), slot_bytes, landing)
            self.pool.release()
            self.pool = DevicePool(self.device, self.placement.slot_count, slot_bytes)
            self.store.ensure_staging(2, slot_bytes)
            self._compile_resident()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def evict_all(self) -> None:
        """Drop every streamed layer from the device (between steps, e.g. before sampling)."""
        with self._lock:
            self.copies.drain()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for sl in self._streamed.values():
                if sl.slot is not None:
                    self._evict(sl)
            for slot in self.pool.slots:
                slot.released = slot.written = None
            self._current = None
            self._last_use = None

    def remove(self) -> None:
        """Restore every module as it was (params back on their original devices); free
        the pool, the pinned memory, the hooks and the worker thread."""
        if self._removed:
            return
        self._removed = True
        if self.profiler is not None:
            self.profiler.close()
        self.copies.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for idx in self._compiled:
            del self.layers[idx].forward
        self._compiled.clear()
        with torch.no_grad():
            for sl in list(self._streamed.values()):
                for handle in sl.handles:
                    handle.remove()
                for ps in sl.host.params:
                    # fp8-stored params come back dequantized in their compute dtype (lossy)
                    ps.param.data = sl.host.value(ps).to(self._home[id(ps.param)][1], copy=True)
            for t, device in self._home.values():
                if t.device != device:
                    t.data = t.data.to(device)
        self._home.clear()
        self._streamed.clear()
        self.pool.release()
        self.store.release()

    def __enter__(self) -> LayerSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
