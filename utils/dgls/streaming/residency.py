"""Residency: where one streamed layer's weights are, as an explicit state with one method per transition.

States and transitions (each method asserts the state it starts from)::

             fetch(slot, token)            acquire(copier)
    HOST ─────────────────────► FETCHING ─────────────────► IN_USE ◄──┐
     ▲                             │                          │        │ acquire(copier)
     │          evict()            │        release(copier)   ▼        │
     └─────────────────────────────┴──────────────────────── RELEASED ─┘
                                     evict()

- HOST: no device copy. Every streamed param points at an empty placeholder, so any use of it
  fails loudly (on CPU too) instead of reading stale memory.
- FETCHING: a copy into ``slot`` is submitted (``token``); params still point at placeholders.
- IN_USE: the compute stream waits for the copy, and the params are bound to views of the slot.
  The layer's use is the current one: it is never evicted in this state.
- RELEASED: another layer's use began, so every kernel that reads this one is enqueued; the
  copier has a release marker behind them. The slot may be reclaimed (evict), or the layer used
  again without a copy (acquire).

Every transition runs inside a ``torch.profiler`` range ``DGLS layer <i> <transition>: <new state>``
(an acquire's range holds its wait for the copy and the binding), so a profiler trace shows each
layer's weight states beside the transport's copies; while no profiler records, a range is a bool read
(``_expect`` opens the range and ``_enter`` closes it: no context manager or wrapper per transition).

Binding costs one ``param.data =`` per param: the views of a layer in a slot are built the first
time it lands there and kept (``views``), and placeholders are shared per dtype. Parameter
objects are never replaced, so optimizers, PEFT and state dicts keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
from torch import nn
from torch.autograd.profiler import record_function

from ..memory.copier import Copier, Token, Wait
from ..memory.device_pool import Slot
from ..memory.host_store import HostLayer
from ..torch_private import profiler_recording


class Residency(Enum):
    HOST = "host"
    FETCHING = "fetching"
    IN_USE = "in use"
    RELEASED = "released"


LEADS_TO = {  # each transition's end state (named in its profiler range)
    "fetch": Residency.FETCHING,
    "acquire": Residency.IN_USE,
    "release": Residency.RELEASED,
    "evict": Residency.HOST,
}


class StreamedLayer:
    """One streamed layer: its module, its host master and its residency."""

    def __init__(
        self,
        module: nn.Module,
        host: HostLayer,
        placeholder: Callable[[torch.dtype, int], torch.Tensor],
    ) -> None:
        self.module = module
        self.host = host
        self.index = host.index  # the entry's index (read on every transition)
        self.params = [p.param for p in host.layout.params]
        self._placeholders = [placeholder(p.dtype, len(p.shape)) for p in host.layout.params]
        self._views: dict[int, list[torch.Tensor]] = {}  # slot index -> views in that slot
        self.state = Residency.HOST
        self.slot: Slot | None = None
        self.token: Token | None = None
        self._range: record_function | None = None  # the profiler range of the transition under way
        self._unbind()

    def fetch(self, slot: Slot, token: Token) -> None:
        """HOST -> FETCHING: the copier has a write of this layer into ``slot``."""
        self._expect(Residency.HOST, transition="fetch")
        slot.owner = self.index
        self.slot, self.token = slot, token
        self._enter(Residency.FETCHING)

    def acquire(self, copier: Copier) -> Wait | None:
        """FETCHING or RELEASED -> IN_USE: the compute stream waits for the copy; params bound."""
        self._expect(Residency.FETCHING, Residency.RELEASED, transition="acquire")
        waited = copier.acquire(self.token)
        if self.state is Residency.FETCHING:
            self._bind()
        self._enter(Residency.IN_USE)
        return waited

    def release(self, copier: Copier) -> None:
        """IN_USE -> RELEASED: a later use began; the slot is free after the reads enqueued so far."""
        self._expect(Residency.IN_USE, transition="release")
        copier.release(self.slot)
        self._enter(Residency.RELEASED)

    def evict(self) -> None:
        """FETCHING or RELEASED -> HOST: drop the device copy (frozen weights never travel back)."""
        self._expect(Residency.FETCHING, Residency.RELEASED, transition="evict")
        self._unbind()
        self.slot.owner = None
        self.slot, self.token = None, None
        self._enter(Residency.HOST)

    def show(self, values: list[torch.Tensor]) -> None:
        """HOST only: point the params at ``values`` (their true values in host memory) for code that reads
        params directly instead of through ``state_dict``; :meth:`hide` points them back at placeholders."""
        self._expect(Residency.HOST)
        for param, value in zip(self.params, values):
            param.data = value

    def hide(self) -> None:
        self._expect(Residency.HOST)
        self._unbind()

    def forget_views(self) -> None:
        """The pool was rebuilt: views into the old slots must not be reused."""
        self._views.clear()

    # ---------------------------------------------------------------- internals
    def _bind(self) -> None:
        views = self._views.get(self.slot.index)
        if views is None:
            buffer = self.slot.buffer
            views = [
                buffer[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.host.layout.params
            ]
            self._views[self.slot.index] = views
        for param, view in zip(self.params, views):
            param.data = view

    def _unbind(self) -> None:
        for param, placeholder in zip(self.params, self._placeholders):
            param.data = placeholder

    def _expect(self, *states: Residency, transition: str | None = None) -> None:
        """Assert the start state; a transition's range opens here while a profiler records (``_enter`` closes it)."""
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise AssertionError(f"layer {self.index} is {self.state.value}, expected {allowed}")
        if transition is not None and profiler_recording():
            self._close_range()  # one a failed transition left open
            self._range = record_function(f"DGLS layer {self.index} {transition}: {LEADS_TO[transition].value}")
            self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _enter(self, state: Residency) -> None:
        self.state = state
        if self._range is not None:
            self._close_range()
