"""Device sums: a host-trained layer's gradients summed on the device over a step's micro-batches, sent home once.

The layer-major schedule (:mod:`..engine.layer_major`) runs each layer's backward over all of a step's micro-batches
before the next layer's. While it does, :class:`~.grad_return.GradReturn` hands each gradient of a host-trained param
here instead of sending it: the micro-batches before the layer's last are summed in fp32 on the device, and the last
one's gradient, added to that sum, goes home as the layer's one gradient of the step (so the host training sees one
micro-batch a step: ``accumulation_steps = 1``).

Arithmetic
    - The sum is the host's: :func:`~.grad_return.sum_gradient` (the one implementation) writes both: the first
      gradient copied into an fp32 sum, each later one added in fp32, in micro-batch order. In fp32 the gradient
      that goes home is bitwise the host's sum.
    - In a 16-bit compute dtype the fp32 sum is rounded once to that dtype on its way home (the landing's dtype);
      the host's sum of per-micro-batch gradients stays fp32. That rounding is the one difference: at most half a
      unit in the last place of the sum's bf16 value (a relative 2**-8 of each element; fp16: 2**-11).
    - A param without a gradient in its layer's last micro-batch (a branch one micro-batch skips) still sends the
      sum of what the others gave, as sequential micro-batches sum it on the host: the schedule calls
      :meth:`DeviceSums.flush` after each layer's micro-batches, and each such sum goes on through the ``send``
      its first gradient's hook gave (the same path as a last micro-batch's gradient). A param with no gradient in
      any micro-batch sends nothing, as sequentially.

Invariants
    - Only the training thread (the backward's hooks, the schedule) touches it.
    - ``final`` is set by the schedule for each layer's last micro-batch; after each layer's micro-batches
      :meth:`flush` sends what is left, so no sum outlives its layer's backward (a sum left at :meth:`close` would
      be a lost gradient: a bug, refused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .grad_return import sum_gradient


@dataclass
class _Sum:
    value: torch.Tensor  # fp32, on the device
    dtype: torch.dtype  # the gradients' (what goes home)
    send: Callable[[torch.Tensor], None]  # where the sum goes if its layer's last micro-batch gives none
    order: tuple[int, int]  # (layer, position in its layout): the flush's order, the same on every process
    added: int = 0  # micro-batches summed


class DeviceSums:
    """fp32 device sums of the current layer's gradients, keyed by param (see the module doc)."""

    def __init__(self) -> None:
        self._sums: dict[int, _Sum] = {}
        self.final = True  # the gradient arriving now is its layer's last of the step: it goes home

    def add(
        self, param: torch.Tensor, grad: torch.Tensor, send: Callable[[torch.Tensor], None], order: tuple[int, int]
    ) -> torch.Tensor | None:
        """``grad`` of ``param`` arrived: ``None`` while it is summed on the device, else what goes home (the
        sum, in ``grad``'s dtype, or ``grad`` itself when nothing was summed before it). ``send``: what the caller
        does with a gradient that goes home, for a sum :meth:`flush` sends; ``order``: the param's (layer, position
        in its layout), the order :meth:`flush` sends in."""
        entry = self._sums.pop(id(param), None)
        if entry is None:
            if self.final:
                return grad
            entry = _Sum(torch.empty_like(grad, dtype=torch.float32), grad.dtype, send, order)
        with torch.no_grad():
            sum_gradient(entry.value, grad, first=entry.added == 0)
        entry.added += 1
        if self.final:
            return _home(entry)
        self._sums[id(param)] = entry
        return None

    def flush(self) -> None:
        """A layer's micro-batches ended: each sum left (a param without a gradient in the last micro-batch) goes
        home through its ``send``, in (layer, position) order: the same on every process of a data-parallel job
        whatever micro-batches skipped which params there (the order of their last gradients could differ, and with
        it the order of the reductions the sums go into)."""
        left, self._sums = self._sums, {}
        for entry in sorted(left.values(), key=lambda e: e.order):
            entry.send(_home(entry))

    @property
    def pending(self) -> int:
        """Params whose sum has not gone home yet."""
        return len(self._sums)

    def close(self) -> None:
        if self._sums:
            raise RuntimeError(f"{len(self._sums)} gradient sums were never sent home (flush after each layer)")


def _home(entry: _Sum) -> torch.Tensor:
    return entry.value if entry.value.dtype == entry.dtype else entry.value.to(entry.dtype)
