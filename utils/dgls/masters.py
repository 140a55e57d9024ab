"""Masters: the true weights DGLS keeps in host memory, and the state-dict hooks that read and write them.

Which layers have a master (in the :class:`~.host_store.HostStore`):

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
objects: the new ones are measured and packed again (``on_adopted`` lets the engine rebuild its view of
the layer), so the layer keeps streaming instead of silently keeping the loaded tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .config import SwapConfig
from .errors import DGLSUserError
from .host_store import HostLayer, HostStore, check_ram, default_pinned_budget
from .host_training import HostTraining
from .layout import MB, LayerLayout, measure_layer
from .monitor import check_pinned_budget
from .peers import Peers, remove_orphans
from .pinned import whole_pages
from .precision import CastRules
from .stats import human_bytes

GiB = 1024**3


def has_fp8(layout: LayerLayout) -> bool:
    return any(p.scaled for p in layout.params)


class Masters:
    """The host store of a layer list, which layers have a master, and their state-dict hooks.

    ``share_group``: processes of one job that host the same layers (``""`` for every process of a
    data-parallel job; the pipeline stage when the layers are split): their masters are one copy per
    machine (:mod:`.peers`)."""

    def __init__(
        self,
        layers: list,
        layouts: list[LayerLayout],
        streamed: tuple[int, ...],
        device: torch.device,
        config: SwapConfig,
        log: Callable[[str], None],
        share_group: str = "",
    ) -> None:
        self.layers, self.layouts, self.device, self.config = layers, layouts, device, config
        hosted = [layout for layout in layouts if layout.index in streamed or has_fp8(layout)]
        on_cpu = sum(
            lay.sizes.streamable_bytes for lay in hosted if all(p.param.device.type == "cpu" for p in lay.params)
        )
        total = sum(lay.host_bytes for lay in hosted)
        budget = config.transfer.pinned_ram_budget_gb
        budget = int(budget * GiB) if budget is not None else default_pinned_budget(on_cpu)
        signature = ";".join(f"{lay.index}:{lay.sizes.class_name}:{lay.host_bytes}" for lay in hosted)
        self.peers = Peers.discover(share_group, signature, sum(whole_pages(lay.host_bytes) for lay in hosted))
        self.store = HostStore(device, budget, int(config.transfer.selective_packing * MB), self.peers)
        if self.peers.leader:
            check_ram(total - on_cpu)
            if self.store.use_pinning and (note := check_pinned_budget(min(total, budget), freed_bytes=on_cpu)):
                log(note)
        self._pack(hosted, log)
        self._handles: dict[int, list] = {}
        # Set by the engine: evict every streamed layer, say whether a layer streams, give a placeholder,
        # and rebuild a streamed layer whose Parameter objects were replaced.
        self.evict_all: Callable[[], None] = lambda: None
        self.is_streamed: Callable[[int], bool] = lambda idx: False
        self.placeholder: Callable[[torch.dtype], torch.Tensor] = lambda dtype: torch.empty(0, dtype=dtype)
        self.on_adopted: Callable[[int], None] = lambda idx: None
        self.training: HostTraining | None = None  # full fine-tuning: trainable params' fp32 masters live there

    def _pack(self, hosted: list[LayerLayout], log: Callable[[str], None]) -> None:
        """Pack the hosted layers: privately, or once per machine into shared segments (:mod:`.peers`)."""
        peers = self.peers
        if not peers.shared:
            for layout in hosted:
                self.store.add_layer(layout)
            return
        if peers.leader:
            remove_orphans()
            for layout in hosted:
                self.store.add_layer(layout, memory="create")
        peers.barrier()
        if not peers.leader:
            for layout in hosted:
                self.store.add_layer(layout, memory="attach")
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
        return self.training.master_of(p.param) if self.training is not None else None

    def _finish_updates(self) -> None:
        """Full fine-tuning: every queued host update written before the masters are read or loaded (once per hook)."""
        if self.training is not None:
            self.training.finish()

    def _state_dict_post(self, idx: int, module: nn.Module, state_dict, prefix, local_metadata) -> None:
        host = self.host(idx)
        self._finish_updates()
        for k, p in enumerate(host.layout.params):
            master = self._trained_master(p)
            for name in p.names:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = master.detach() if master is not None else host.value(k)

    def _load_pre(self, idx: int, module: nn.Module, state_dict, prefix, *args) -> None:
        self.evict_all()
        self._finish_updates()
        if self.is_streamed(idx):
            host = self.host(idx)
            for k, p in enumerate(host.layout.params):
                master = self._trained_master(p)  # full fine-tuning: load into the fp32 master
                # fp8 storage: a dequantized copy, re-quantized after loading
                p.param.data = master if master is not None else host.value(k)

    def _load_post(self, idx: int, module: nn.Module, incompatible_keys) -> None:
        host, streamed = self.host(idx), self.is_streamed(idx)
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
                p.param.data = self.placeholder(p.dtype) if streamed else self.device_value(idx, k)

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
        layout = measure_layer(self.layers, idx, CastRules.from_policy(self.config.compute))
        self.layouts[idx] = layout.of_entry(old.layer, old.part, old.holder)  # a swap unit stays labelled
        self.add(idx)
        self.on_adopted(idx)

    def release(self) -> None:
        for idx in list(self._handles):
            self.remove_hooks(idx)
        self.store.release()
        self.peers.close()
