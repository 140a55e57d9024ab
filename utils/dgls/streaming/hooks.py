"""Hooks: turn PyTorch's module and autograd events into ``use(layer, phase)`` and ``pass_end()``.

What counts as the start of a layer's use:

- its forward pre-hook (forward, eval, and a checkpoint's recompute inside backward);
- the gradient reaching its output (a hook on the first output that requires grad): its backward
  is about to run;
- autograd unpacking a tensor it saved from the layer's weights (see below).

The end of a backward pass is detected here, not by the caller: at the first backward use of a
pass, a callback is queued on the autograd engine (``queue_callback``, as FSDP2 does), and it
calls ``pass_end()`` once the whole backward has finished. So the step boundary does not depend
on anyone calling a getter.

Saved tensors. A layer that streams and is not checkpointed has views of its slot saved by
autograd for backward; by then the slot may hold another layer. While such a layer runs, its
saved tensors go through ``pack``: a view of a slot is replaced by a :class:`SlotRef`, and
``unpack`` makes the layer resident again and rebuilds the view in its current slot. The cases:

- no saved-tensor hooks active: DGLS's hooks are pushed for the layer's forward;
- any hooks active (torch's non-reentrant checkpoint, the user's own, ``save_on_cpu``): DGLS's
  hooks are pushed on top of them and hand every tensor that is not a slot view to the outer hooks,
  so both keep working. Under a non-reentrant checkpoint this happens in the forward and again in
  the recompute, so the same tensors bypass the checkpoint both times (its count of saved tensors
  matches) and no view of a slot is ever kept in its recomputed storage: a region may span several
  entries (a layer split into swap units, :mod:`.units`, or several whole layers), since each view
  is rebuilt in its entry's current slot when backward unpacks it. Selective checkpointing caches
  op outputs (views of a slot among them) outside saved tensors: refused with a message.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn

from ..errors import DGLSUserError
from ..memory.layout import modules_of
from ..torch_private import queue_end_of_backward, top_saved_tensors_hooks, under_selective_checkpoint
from .schedule import Phase, current_phase


@dataclass(frozen=True)
class SlotRef:
    """What autograd keeps instead of a view into a slot: enough to rebuild it in the layer's current slot."""

    layer: int
    offset: int  # in elements of ``dtype``
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class Engine(Protocol):
    """What the hooks call (implemented by :class:`~..engine.swapper.LayerSwapper`)."""

    # the entries that stream now, read on every hook call: a live container (re-placement changes it in place)
    streaming: Container[int]

    def use(self, index: int, phase: Phase) -> None: ...
    def pass_end(self) -> None: ...
    def slot_ref(self, tensor: torch.Tensor) -> SlotRef | None: ...
    def view_of(self, ref: SlotRef) -> torch.Tensor: ...


class _Outer(tuple):
    """``(value,)``: a tensor packed by outer saved-tensor hooks that DGLS's hooks sit on top of. A tuple subclass,
    so making one per saved tensor runs no Python frame (a checkpointed layer saves dozens per call)."""

    __slots__ = ()


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and dicts, in order (a list: the post-forward hook walks it twice,
    and a flat output costs one call, not a generator per element)."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect_tensors(value, found)
    return found


def _collect_tensors(value, found: list[torch.Tensor]) -> None:
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return
    for v in items:
        if isinstance(v, torch.Tensor):
            found.append(v)
        else:
            _collect_tensors(v, found)


def _is_torch_checkpoint(hooks) -> bool:
    return getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


class HookAdapter:
    """Installs the hooks on every module of a layer list; :meth:`remove` takes them all off."""

    def __init__(
        self,
        layers: list,
        engine: Engine,
        owners: Sequence[int] | None = None,
        holders: Iterable[int] = (),
        replays: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        self.layers = layers
        self.engine = engine
        self._streaming = engine.streaming
        # the caller's layer of each entry, and the entries split into swap units (:mod:`.units`)
        self.owners = list(owners) if owners is not None else list(range(len(layers)))
        self.holders = set(holders)
        self._handles: list = []
        self._saved_hooks: list = []  # pushed in a pre-hook, popped in the post hook (recompute nests them)
        self._queued = False
        self._holding = False  # a schedule runs one step as several backward calls: one pass_end, at its end
        self._held_end = False  # a backward ended while holding
        # A module whose next call runs nothing of its own (a piece whose layer's recompute takes its kept
        # output, :meth:`~..activations.unit_checkpoints.UnitCheckpoints.replays`): no use starts. None: none
        # ever does (no unit checkpoints), and the pre-hook asks nothing.
        self.replays: Callable[[nn.Module], bool] | None = replays
        self._output_grad_hooks: dict[int, Callable[[torch.Tensor], None]] = {}  # per entry, made once

    def install(self) -> None:
        for idx, module in modules_of(self.layers):
            self._output_grad_hooks[idx] = partial(self._on_output_grad, idx)
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_forward, idx)))
            self._handles.append(module.register_forward_hook(partial(self._post_forward, idx), always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---------------------------------------------------------------- module hooks
    def _pre_forward(self, idx: int, module: nn.Module, args) -> None:
        if self.replays is not None and self.replays(module):
            self._saved_hooks.append(None)
            return
        phase = current_phase()
        self.engine.use(idx, phase)
        if phase is Phase.BACKWARD and not self._queued:
            self._queue_pass_end()
        pushed = None
        if idx in self._streaming and torch.is_grad_enabled():
            outer = top_saved_tensors_hooks()
            if outer is not None and _is_torch_checkpoint(outer) and under_selective_checkpoint():
                raise DGLSUserError(
                    f"layer {self.owners[idx]} streams under selective activation checkpointing, which caches op "
                    "outputs (views of its weights among them) until backward: use plain checkpointing or keep it "
                    "resident (gpu_layers)"
                )
            pushed = self._push_saved_tensor_hooks(outer)
        self._saved_hooks.append(pushed)

    def _post_forward(self, idx: int, module: nn.Module, args, output) -> None:
        pushed = self._saved_hooks.pop() if self._saved_hooks else None
        if pushed is not None:
            pushed.__exit__(None, None, None)
        if output is None:
            failure = sys.exc_info()[1]  # always_call: this hook also runs when the forward raised
            if idx in self.holders and failure is not None and not getattr(failure, "_dgls_noted", False):
                failure._dgls_noted = True
                failure.add_note(
                    f"DGLS: layer {self.owners[idx]} ({type(module).__name__}) runs as swap units, each streamed "
                    "in only for its own forward; if the error above reads a unit's weights outside it (a tensor "
                    "of 0 elements), set swap_unit_mb = 0 (--swap_unit_mb 0) to stream whole layers"
                )
            return
        tensors = tensors_in(output)
        if idx in self._streaming:
            for t in tensors:
                if self.engine.slot_ref(t) is not None:
                    raise DGLSUserError(
                        f"layer {self.owners[idx]} ({type(module).__name__}) returns a view of its own weights, which "
                        f"would be overwritten when it is evicted: keep it resident (add {self.owners[idx]} to "
                        "gpu_layers)"
                    )
        if torch.is_grad_enabled() and current_phase() is not Phase.BACKWARD:
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._output_grad_hooks[idx])
                    break

    def _on_output_grad(self, idx: int, grad: torch.Tensor) -> None:
        self.engine.use(idx, Phase.BACKWARD)
        if not self._queued:
            self._queue_pass_end()

    # ---------------------------------------------------------------- end of backward
    def _queue_pass_end(self) -> None:
        if not self._queued:
            queue_end_of_backward(self._on_backward_end)
            self._queued = True

    def _on_backward_end(self) -> None:
        self._queued = False
        if self._holding:
            self._held_end = True
        else:
            self.engine.pass_end()

    @contextmanager
    def one_pass(self) -> Iterator[None]:
        """The backward calls inside the ``with`` are one pass: ``pass_end()`` once, when the block ends (if any
        backward ran), not at the end of each call (:mod:`..engine.layer_major` runs a step's backward as one call
        per layer and micro-batch). Not nested."""
        if self._holding:
            raise RuntimeError("one_pass() is already active")
        self._holding, self._held_end = True, False
        try:
            yield
        finally:
            self._holding = False
            ended, self._held_end = self._held_end, False
            if ended:
                self.engine.pass_end()

    # ---------------------------------------------------------------- saved tensors
    def _push_saved_tensor_hooks(self, outer):
        """DGLS's hooks for one streamed layer's forward, on top of ``outer`` hooks if there are any."""
        if outer is None:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(
                partial(self._pack_over, outer), partial(self._unpack_over, outer)
            )
        hooks.__enter__()
        return hooks

    @contextmanager
    def saved_tensor_hooks(self, idx: int) -> Iterator[None]:
        """DGLS's saved-tensor hooks for entry ``idx`` above whatever hooks are active now, for the code inside
        the ``with``: :mod:`..activations.unit_checkpoints` puts them above a unit's own checkpoint."""
        pushed = None
        if idx in self._streaming and torch.is_grad_enabled():
            pushed = self._push_saved_tensor_hooks(top_saved_tensors_hooks())
        try:
            yield
        finally:
            if pushed is not None:
                pushed.__exit__(None, None, None)

    @contextmanager
    def use_inside(self, idx: int) -> Iterator[None]:
        """A child module of entry ``idx`` runs on its own (a checkpointed piece's rerun in backward,
        :mod:`..activations.unit_checkpoints`): a use of the entry, with its saved-tensor hooks for the code inside."""
        phase = current_phase()
        self.engine.use(idx, phase)
        if phase is Phase.BACKWARD and not self._queued:
            self._queue_pass_end()
        with self.saved_tensor_hooks(idx):
            yield

    def _pack(self, tensor: torch.Tensor):
        ref = self.engine.slot_ref(tensor)
        return tensor if ref is None else ref

    def _unpack(self, packed):
        return self.engine.view_of(packed) if isinstance(packed, SlotRef) else packed

    def _pack_over(self, outer, tensor: torch.Tensor):
        ref = self.engine.slot_ref(tensor)
        return _Outer((outer[0](tensor),)) if ref is None else ref

    def _unpack_over(self, outer, packed):
        return self.engine.view_of(packed) if isinstance(packed, SlotRef) else outer[1](packed[0])
