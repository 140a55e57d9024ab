"""Schedule: the phase of a layer use, and which uses come next, learned from the order observed.

A use is ``(layer, phase)``. The predictor remembers, for each pair of consecutive uses, what came
next; that covers forward/backward turnarounds, checkpoint recompute, eval passes and any layer
layout (UNet skips, double/single blocks) without guessing from call stacks. Before anything was
observed it falls back to "forward goes up, backward goes down".
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum

import torch

from ..torch_private import current_autograd_node


class Phase(Enum):
    FORWARD = "F"  # forward with grad
    NO_GRAD = "N"  # forward without grad: eval, sampling, or a reentrant checkpoint's first pass
    BACKWARD = "B"  # inside backward: checkpoint recompute, saved-tensor unpack, or the output's gradient

    # Uses are dict keys on every hook call (the predictor's tables, the prefetch plans): members are
    # singletons, so identity hashing is correct, and it runs no Python frame (``Enum.__hash__`` does).
    __hash__ = object.__hash__

    def __str__(self) -> str:
        return self.name.lower().replace("_", " ")


Use = tuple[int, Phase]


def current_phase() -> Phase:
    """The phase of a use happening now, from autograd's state (never from Python frames)."""
    if current_autograd_node() is not None:  # in a backward or a checkpoint's recompute
        return Phase.BACKWARD
    return Phase.FORWARD if torch.is_grad_enabled() else Phase.NO_GRAD


class UsePredictor:
    """Successor tables learned online from the stream of uses."""

    def __init__(self, layer_count: int) -> None:
        self.layer_count = layer_count
        self._after_pair: dict[tuple[Use, Use], Use] = {}
        self._after_one: dict[Use, Use] = {}
        self.previous: Use | None = None
        self.current: Use | None = None
        self.version = 0  # grows whenever a prediction changes: what was derived from the tables is stale
        self._row_before: Use | None = None  # the use before a repeated run began (begin_row)
        self._restarting = False  # a repeat began: the next relocate follows _row_before

    def observe(self, use: Use) -> None:
        if self.current is not None:
            if self._after_one.get(self.current) != use:
                self._after_one[self.current] = use
                self.version += 1
            if self.previous is not None and self._after_pair.get((self.previous, self.current)) != use:
                self._after_pair[(self.previous, self.current)] = use
                self.version += 1
        self.previous, self.current = self.current, use

    def begin_row(self) -> None:
        """A run of uses begins that may be repeated (a layer-major step's first micro-batch of one layer,
        :mod:`..engine.row_keeping`): remember the use before it."""
        self._row_before, self._restarting = self.current, False

    def repeat_row(self) -> None:
        """The run begun at :meth:`begin_row` starts again: the next :meth:`relocate` follows the use before it."""
        self._restarting = True

    def relocate(self, use: Use) -> None:
        """Move on to ``use`` without learning from it (a repeat of uses already observed): the tables stay those of
        one run, and predict from where the repeat is, as they did in the first run."""
        previous = self._row_before if self._restarting else self.current
        self._restarting = False
        self.previous, self.current = previous, use

    def upcoming(self, limit: int) -> Iterator[Use]:
        """Predicted uses after the current one, at most ``limit``."""
        previous, current = self.previous, self.current
        for _ in range(limit):
            if current is None:
                return
            nxt = self._after_pair.get((previous, current)) if previous is not None else None
            if nxt is None:
                nxt = self._after_one.get(current)
            if nxt is None:
                nxt = self._guess(current)
            if nxt is None:
                return
            yield nxt
            previous, current = current, nxt

    def _guess(self, use: Use) -> Use | None:
        layer, phase = use
        last = self.layer_count - 1
        if phase is Phase.BACKWARD:
            return (layer - 1, phase) if layer > 0 else None
        if layer < last:
            return (layer + 1, phase)
        return (last, Phase.BACKWARD) if phase is Phase.FORWARD else (0, Phase.NO_GRAD)
