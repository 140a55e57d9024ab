"""Feature: the lifecycle every optional part of the engine follows (full fine-tuning, activation offload,
unit checkpoints, forward patches, the profiler, the planner, the trainable params' cast).

The builder (:mod:`..engine.build`) makes the features from the configuration and hands the engine
(:class:`~..engine.swapper.LayerSwapper`) their list; the engine calls each hook on every feature, in list order
(``close`` in reverse), and never asks which features there are. A hook a feature does not need keeps the
no-op default here.

What the engine promises
    - ``install(engine)``: once, at construction, after the engine's own parts exist (layers streamed or
      placed, masters' state-dict hooks and the module hooks installed), on the constructing thread. A feature
      changes the model (hooks, patched forwards) only here, so a failed construction has nothing else to undo.
    - ``fetch_gates(idx)``: on the thread that runs the layers, under the engine lock, each time a copy of
      streamed layer ``idx`` into a slot is submitted: what the copy must wait for (a transport
      :class:`~..memory.transport.Copy`, or a :class:`~..memory.transport.Marker`). Called on the hot path: keep it a
      lookup.
    - ``after_backward()``: under the engine lock, from autograd's end-of-backward callback, before the
      listeners hear ``pass_ended`` (a distinct name: a part may be a feature and a listener at once).
    - ``between_passes()``: under the engine lock, at the first use after a backward ended that is not inside
      a backward (the next forward or eval forward), before that use does anything: after whatever the loop
      ran between passes (the optimizer step; with gradient accumulation, between micro-batches), never in
      autograd's callback, and never inside :meth:`~..engine.swapper.LayerSwapper.one_step` (micro-batches that
      interleave): at the first use after the block, or as the next block starts. The planner acts here.
    - ``before_placement()`` / ``placement_changed(placement, kept_activations)``: under the engine lock,
      between passes, around a re-placement (:meth:`~..engine.swapper.LayerSwapper.apply_placement`).
      ``before_placement`` runs before anything changes and may refuse with a :class:`~..errors.DGLSUserError`;
      ``placement_changed`` runs once the new placement is in force (not at construction: ``install`` sees
      the first placement as ``engine.placement``).
    - ``wrap_checkpoint(checkpoint)``: when the trainer asks for its checkpoint function
      (:meth:`~..engine.swapper.LayerSwapper.checkpoint_function`); returns it, or a wrapper around it.
    - ``true_value(param)`` / ``flush()``: when true weights are read or loaded (state dicts, ``true_weights``,
      ``remove``), with no layer running: ``flush`` first writes pending updates, then ``true_value`` gives the
      param's value if this feature keeps it (full fine-tuning's fp32 masters), else ``None``.
    - ``pinned_bytes()``: whenever asked (stats, the memory monitor): page-locked host bytes it holds now.
    - ``describe()``: once, after ``install``: lines for the start-up report (none by default).
    - ``close()``: once, from :meth:`~..engine.swapper.LayerSwapper.remove`, or from the builder when a part made after
      the feature fails; so also without ``install``. Before the transport closes: finish in-flight work, undo
      what ``install`` changed, free memory.

Invariants
    - A feature gets what it needs at construction (from the builder) or through ``engine`` in ``install``:
      nothing assigns callbacks into it, or into the engine's parts, afterwards.
    - Hooks called under the engine lock must not take another lock that a copy worker waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..watching.listener import Listener
    from .hooks import HookAdapter
    from .placement import Placement
    from .schedule import Phase


class Engine(Protocol):
    """What a feature may use of the engine (:class:`~..engine.swapper.LayerSwapper`)."""

    device: torch.device
    placement: Placement
    hooks: HookAdapter  # saved-tensor hooks and uses of an entry from inside it (:mod:`..activations.unit_checkpoints`)

    def use(self, idx: int, phase: Phase) -> None: ...
    def evict(self, indices: Iterable[int]) -> None: ...
    def add_listener(self, listener: Listener) -> None: ...
    def apply_placement(self, streamed: Iterable[int], prefetch: int, kept_activations: int | None = None) -> None: ...


class Feature:
    """A part of the engine with a lifecycle (see the module docstring for when each hook runs)."""

    def install(self, engine: Engine) -> None:
        """Join the engine: hooks, patched forwards, listeners."""

    def fetch_gates(self, idx: int) -> list:
        """What a copy of streamed layer ``idx`` into its slot must wait for."""
        return []

    def after_backward(self) -> None:
        """A backward pass finished (before the listeners hear it)."""

    def between_passes(self) -> None:
        """A backward ended and the next use that is not inside a backward begins (after the loop's optimizer
        step, outside autograd): act on the step boundary (the planner re-places layers here)."""

    def before_placement(self) -> None:
        """A re-placement is about to start: raise :class:`~..errors.DGLSUserError` to refuse it."""

    def placement_changed(self, placement: Placement, kept_activations: int | None) -> None:
        """A re-placement is in force."""

    def wrap_checkpoint(self, checkpoint: Callable) -> Callable:
        """The trainer's checkpoint function, or a wrapper around it."""
        return checkpoint

    def true_value(self, param: torch.Tensor) -> torch.Tensor | None:
        """The param's true value if this feature keeps it, else ``None``."""
        return None

    def flush(self) -> None:
        """Write pending updates to the true values (before they are read or loaded)."""

    def pinned_bytes(self) -> int:
        return 0

    def describe(self) -> list[str]:
        """Lines for the start-up report."""
        return []

    def close(self) -> None:
        """Finish in-flight work, undo ``install``, free memory (also without ``install``)."""


def overrides(feature: Feature, hook: str) -> bool:
    """``feature`` does something in ``hook`` (the engine calls hot-path hooks only on those that do)."""
    return getattr(type(feature), hook) is not getattr(Feature, hook)
