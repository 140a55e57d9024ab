"""Forward patches: how a layer's forward runs, apart from where its weights are.

- ``autocast``: each layer's forward runs under ``torch.autocast`` (entered in a forward pre-hook,
  left in the forward hook; a checkpoint's recompute runs the hooks again, so the contexts are a
  stack).
- ``compile`` (``--compile``): the forward of each resident layer is replaced by ``torch.compile`` of it,
  as an instance attribute over the class's forward. Streamed layers stay eager (their weights move
  between slots), so :meth:`ForwardPatches.placement_changed` compiles or un-compiles layers when
  placement changes.

Both are installed by :meth:`ForwardPatches.install` and undone by :meth:`ForwardPatches.remove` (hooks
removed, instance ``forward`` deleted).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ..memory.layout import modules_of
from ..memory.precision import autocast_context
from .feature import Engine, Feature

if TYPE_CHECKING:
    from .placement import Placement


class ForwardPatches(Feature):
    """``eager``: entries never compiled whatever the placement (holders of swap units, which run streamed
    units, and entries with checkpointed pieces, :mod:`..activations.unit_checkpoints`); streamed entries are eager
    too."""

    def __init__(
        self,
        layers: list,
        device: torch.device,
        autocast: str | None,
        compile_backend: str | None,
        eager: Collection[int] = (),
    ) -> None:
        self.layers = layers
        self.device = device
        self.autocast = autocast
        self.compile_backend = compile_backend  # None: no compile
        self.eager = set(eager)
        self._handles: list = []
        self._contexts: list = []
        self._compiled: set[int] = set()

    def install(self, engine: Engine) -> None:
        if self.autocast is not None:
            for _, module in modules_of(self.layers):
                self._handles.append(module.register_forward_pre_hook(self._enter_autocast))
                self._handles.append(module.register_forward_hook(self._exit_autocast, always_call=True))
        self.placement_changed(engine.placement, None)

    def _enter_autocast(self, module, args) -> None:
        context = autocast_context(self.device, self.autocast)
        context.__enter__()
        self._contexts.append(context)

    def _exit_autocast(self, module, args, output) -> None:
        self._contexts.pop().__exit__(None, None, None)

    @property
    def compiled(self) -> set[int]:
        return set(self._compiled)

    def placement_changed(self, placement: Placement, kept_activations: int | None) -> None:
        """Compile the forwards of the layers that may be compiled (resident ones), un-compile those that
        must run eager (streamed ones, and :attr:`eager`)."""
        if self.compile_backend is None:
            return
        streamed = set(placement.streamed)
        for idx, module in modules_of(self.layers):
            eager = idx in streamed or idx in self.eager
            if eager and idx in self._compiled:
                del module.forward
                self._compiled.discard(idx)
            elif not eager and idx not in self._compiled:
                module.forward = torch.compile(module.forward, backend=self.compile_backend)
                self._compiled.add(idx)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for idx in self._compiled:
            del self.layers[idx].forward
        self._compiled.clear()

    def close(self) -> None:
        self.remove()
