"""What the engine tells the parts that watch it (stats, the profiler, the planner's probe).

The engine calls these on its hot path, so a listener's methods must be cheap: record events and
numbers, resolve and format later. Every method is optional.
"""

from __future__ import annotations

from ..memory.copier import Token, Wait
from ..memory.transport import Copy
from ..streaming.schedule import Phase


class Listener:
    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        """A layer's use begins (``missed``: it streams and no copy of it was on its way)."""

    def fetched(self, token: Token) -> None:
        """The compute side acquired a copy for the first time (each copy is reported once)."""

    def waited(self, wait: Wait) -> None:
        """The compute stream waited for a copy (CUDA, timing on): events before and after the wait."""

    def acquired(self, copy: Copy, before, after) -> None:
        """The compute stream waited for ``copy`` (CUDA, its direction timed): the events recorded on the compute
        stream before and after its wait, resolved later. Weight copies come through :meth:`waited` too (with their
        layer); this hook is the one for every other direction (activation restores)."""

    def copied(self, copy: Copy) -> None:
        """The transport enqueued (CUDA) or submitted (CPU) a copy, of any direction: its ``direction`` and
        ``nbytes`` (possibly on the worker thread: record, do not compute)."""

    def pass_ended(self) -> None:
        """A backward pass finished (autograd's end-of-backward callback)."""
