"""Masters: the true weights DGLS keeps in host memory, and the state-dict hooks that read and write them.

Which layers have a master (in the :class:`~..memory.host_store.HostStore`):

- every streamed layer: its params point at placeholders or slot views, so the master *is* the weight;
- every layer with fp8-stored params, resident ones too: the device copy is the master's dequantized
  value, and keeping the master means a re-placement never quantizes a second time (which would round
  again and change the numbers).

A resident layer without fp8 has no master: its device params are the weights.

State dicts: ``state_dict()`` of a mastered layer returns the master values (dequantized for fp8), never
a placeholder or a slot view. ``load_state_dict()`` first evicts every streamed layer (the engine's
``evict_all``), points a streamed layer's params at its master (fp8: at a dequantized copy) so the loader
writes there, then re-quantizes fp8 values and points the params back at their placeholders (resident
fp8 layers take the new dequantized value). ``load_state_dict(assign=True)`` replaces Parameter
objects: the new ones are measured and packed again (the engine's ``adopted`` rebuilds its view of
the layer), so the layer keeps streaming instead of silently keeping the loaded tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
from torch import nn

from ..errors import DGLSUserError
from ..memory.disk_tier import DiskTier
from ..memory.host_store import HostLayer, HostStore, check_ram, default_pinned_budget
from ..memory.layout import MB, LayerLayout, human_bytes, measure_layer
from ..memory.monitor import check_pinned_budget
from ..memory.peers import Peers, remove_orphans
from ..memory.pinned import whole_pages
from ..memory.precision import CastRules

GiB = 1024**3
VERSIONS = "versions"  # the shared segment of the layers' versions (:attr:`Masters.versions`)
VERSION_BYTES = 8  # one int64 a layer


def has_fp8(layout: LayerLayout) -> bool:
    return any(p.scaled for p in layout.params)


class MastersEngine(Protocol):
    """What the state-dict hooks ask the engine (:class:`~..engine.swapper.LayerSwapper`), given in
    :meth:`Masters.install`."""

    def evict_all(self) -> None: ...
    def is_streamed(self, idx: int) -> bool: ...
    def placeholder(self, dtype: torch.dtype, ndim: int = 1) -> torch.Tensor: ...
    def adopted(self, idx: int) -> None:
        """A layer's Parameter objects were replaced and packed again: rebuild the engine's view of it."""

    def true_value(self, param: torch.Tensor) -> torch.Tensor | None:
        """A param's true value where a feature keeps it (full fine-tuning's fp32 master), else ``None``."""

    def flush(self) -> None:
        """Write pending updates to the true values (full fine-tuning's queued host updates)."""


class Masters:
    """The host store of a layer list, which layers have a master, and their state-dict hooks.

    ``share_group``: processes of one job that host the same layers (``""`` for every process of a
    data-parallel job; the pipeline stage when the layers are split): their masters are one copy per
    machine (:mod:`..memory.peers`). With ``versioned`` (data-parallel full fine-tuning) :attr:`versions` is beside
    them: per layer index, the step whose update the shared copy holds (int64 in shared memory, zero at start;
    written by the layers' owners, :mod:`..training.data_parallel`); None otherwise (a LoRA's shared copy never
    changes)."""

    def __init__(
        self,
        layers: list,
        layouts: list[LayerLayout],
        streamed: tuple[int, ...],
        device: torch.device,
        cast_rules: CastRules | None,
        pinned_budget_gb: float | None,
        packing_threshold_mb: float,
        log: Callable[[str], None],
        share_group: str = "",
        disk: DiskTier | None = None,
        versioned: bool = False,
    ) -> None:
        self.layers, self.layouts, self.device, self.cast_rules = layers, layouts, device, cast_rules
        hosted = [layout for layout in layouts if layout.index in streamed or has_fp8(layout)]
        on_cpu = sum(
            lay.sizes.streamable_bytes for lay in hosted if all(p.param.device.type == "cpu" for p in lay.params)
        )
        spilled = disk.spilled if disk is not None else frozenset()
        total = sum(lay.host_bytes for lay in hosted if lay.index not in spilled)  # the disk tier holds the rest
        budget = int(pinned_budget_gb * GiB) if pinned_budget_gb is not None else default_pinned_budget(on_cpu)
        signature = ";".join(f"{lay.index}:{lay.sizes.class_name}:{lay.host_bytes}" for lay in hosted)
        self.peers = Peers.discover(share_group, signature, sum(whole_pages(lay.host_bytes) for lay in hosted))
        self.store = HostStore(device, budget, int(packing_threshold_mb * MB), self.peers)
        self.versions: torch.Tensor | None = None  # shared: per layer, the step whose update the copy holds
        if disk is not None:
            if self.peers.shared:
                raise DGLSUserError(
                    f"host_ram_budget spills layers to disk, and the {self.peers.local_ranks} processes on this "
                    "machine share one copy of the masters in RAM: the two do not combine yet; drop host_ram_budget"
                )
            self.store.attach_disk(disk)
        if self.peers.leader:
            check_ram(total - on_cpu)
            if self.store.use_pinning and (note := check_pinned_budget(min(total, budget), freed_bytes=on_cpu)):
                log(note)
        self._pack(hosted, log, versioned)
        self._handles: dict[int, list] = {}
        self._engine: MastersEngine | None = None  # from install(), before any state-dict hook exists

    def _pack(self, hosted: list[LayerLayout], log: Callable[[str], None], versioned: bool) -> None:
        """Pack the hosted layers: privately, or once per machine into shared segments (:mod:`..memory.peers`), with
        the versions segment where ``versioned``."""
        peers = self.peers
        if not peers.shared:
            for layout in hosted:
                self.store.add_layer(layout)
            return
        versions = VERSION_BYTES * (max((layout.index for layout in self.layouts), default=0) + 1)
        if peers.leader:
            remove_orphans()
            for layout in hosted:
                self.store.add_layer(layout, memory="create")
            if versioned:
                self.versions = peers.create(VERSIONS, versions).view(torch.int64)
        peers.barrier()
        if not peers.leader:
            for layout in hosted:
                self.store.add_layer(layout, memory="attach")
            if versioned:
                self.versions = peers.attach(VERSIONS, versions).view(torch.int64)
        peers.barrier()
        if peers.leader:
            peers.unlink_created()
            total = sum(layout.host_bytes for layout in hosted)
            log(
                f"DGLS host memory: {human_bytes(total)} of masters, one copy shared by the {peers.local_ranks} "
                f"processes on this machine ({human_bytes(peers.local_ranks * total)} if each kept its own)"
            )

    def host(self, idx: int) -> HostLayer:
        return self.store.layers[idx]

    def has(self, idx: int) -> bool:
        return idx in self.store.layers

    def add(self, idx: int) -> HostLayer:
        """Pack a layer from its params' current values (a resident layer about to stream)."""
        host = self.store.add_layer(self.layouts[idx])
        self.install_hooks(idx)
        return host

    def device_value(self, idx: int, k: int) -> torch.Tensor:
        """Param ``k`` of layer ``idx`` as the device holds it: the master's value, dequantized there."""
        return self.host(idx).value(k, self.device).to(self.device, copy=True)

    def became_resident(self, idx: int) -> None:
        """The layer's params now hold device copies: drop the master unless it is fp8 (an exact copy
        needs no master; an fp8 one is kept so that re-streaming never quantizes again) or shared (the
        other processes of the machine may still stream it)."""
        if not has_fp8(self.layouts[idx]) and not self.peers.shared:
            self.remove_hooks(idx)
            self.store.remove_layer(idx)

    # ---------------------------------------------------------------- state-dict hooks
    def install(self, engine: MastersEngine) -> None:
        """The state-dict hooks of every layer with a master, asking ``engine`` what only it knows."""
        self._engine = engine
        for idx in self.store.layers:
            self.install_hooks(idx)

    def install_hooks(self, idx: int) -> None:
        module = self.layers[idx]
        self._handles[idx] = [
            module.register_state_dict_post_hook(partial(self._state_dict_post, idx)),
            module.register_load_state_dict_pre_hook(partial(self._load_pre, idx)),
            module.register_load_state_dict_post_hook(partial(self._load_post, idx)),
        ]

    def remove_hooks(self, idx: int) -> None:
        for handle in self._handles.pop(idx, []):
            handle.remove()

    def _trained_master(self, p) -> torch.Tensor | None:
        return self._engine.true_value(p.param)

    def _finish_updates(self) -> None:
        """Full fine-tuning: every queued host update written before the masters are read or loaded (once per hook)."""
        self._engine.flush()

    def _state_dict_post(self, idx: int, module: nn.Module, state_dict, prefix, local_metadata) -> None:
        host = self.host(idx)
        self._finish_updates()
        for k, p in enumerate(host.layout.params):
            master = self._trained_master(p)
            for name in p.names:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = master.detach() if master is not None else host.value(k)

    def _load_pre(self, idx: int, module: nn.Module, state_dict, prefix, *args) -> None:
        self._engine.evict_all()
        self._finish_updates()
        if self._engine.is_streamed(idx):
            host = self.host(idx)
            for k, p in enumerate(host.layout.params):
                master = self._trained_master(p)  # full fine-tuning: load into the fp32 master
                # fp8 storage: a dequantized copy, re-quantized after loading
                p.param.data = master if master is not None else host.value(k)

    def _load_post(self, idx: int, module: nn.Module, incompatible_keys) -> None:
        host, streamed = self.host(idx), self._engine.is_streamed(idx)
        if any(module.get_parameter(p.names[0]) is not p.param for p in host.layout.params):
            self._adopt(idx)
            return
        with torch.no_grad():
            for k, p in enumerate(host.layout.params):
                master = self._trained_master(p)
                if master is not None and master.data_ptr() != host.master_view(k).data_ptr():
                    host.store_value(k, master)  # the streamed copy of the loaded fp32 master
                elif p.scaled or not streamed:  # a streamed direct param was loaded into the master itself
                    host.store_value(k, p.param.data)
                if streamed:
                    p.param.data = self._engine.placeholder(p.dtype, len(p.shape))
                else:
                    p.param.data = self.device_value(idx, k)

    def _adopt(self, idx: int) -> None:
        """``assign=True`` put new Parameter objects in: measure and pack them in place of the old ones."""
        module = self.layers[idx]
        for p in self.layouts[idx].params:
            if module.get_parameter(p.names[0]).requires_grad:
                raise DGLSUserError(
                    f"load_state_dict(assign=True) made {p.names[0]} of layer {idx} trainable while DGLS stores it: "
                    "load without assign=True, or remove the swapper first"
                )
        self.remove_hooks(idx)
        self.store.remove_layer(idx)
        old = self.layouts[idx].sizes
        layout = measure_layer(self.layers, idx, self.cast_rules)
        self.layouts[idx] = layout.of_entry(old.layer, old.part, old.holder)  # a swap unit stays labelled
        self.add(idx)
        self._engine.adopted(idx)

    def release(self) -> None:
        for idx in list(self._handles):
            self.remove_hooks(idx)
        self.store.release()
        self.peers.close()
