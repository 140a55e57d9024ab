"""Device sums: a host-trained layer's gradients summed on the device over a step's micro-batches, sent home once.

The layer-major schedule (:mod:`..engine.layer_major`) runs each layer's backward over all of a step's micro-batches
before the next layer's. While it does, :class:`~.grad_return.GradReturn` hands each gradient of a host-trained param
here instead of sending it: the micro-batches before the layer's last are summed in fp32 on the device, and the last
one's gradient, added to that sum, goes home as the layer's one gradient of the step (so the host training sees one
micro-batch a step: ``accumulation_steps = 1``).

Arithmetic
    - The sum is the host's (:func:`~.grad_return._accumulate`): the first gradient in fp32 (as it came, or its
      fp32 copy), each later one added in fp32, in micro-batch order. In fp32 the gradient that goes home is
      bitwise the host's sum.
    - In a 16-bit compute dtype the fp32 sum is rounded once to that dtype on its way home (the landing's dtype);
      the host's sum of per-micro-batch gradients stays fp32. That rounding is the one difference: at most half a
      unit in the last place of the sum's bf16 value (a relative 2**-8 of each element; fp16: 2**-11).

Invariants
    - Only the training thread (the backward's hooks, the schedule) touches it.
    - ``final`` is set by the schedule for each layer's last micro-batch; after it no sum is left (a sum left over
      at :meth:`close` is a bug: refused, it would be a lost gradient).
"""

from __future__ import annotations

import torch


class DeviceSums:
    """fp32 device sums of the current layer's gradients, keyed by param (see the module doc)."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}
        self.final = True  # the gradient arriving now is its layer's last of the step: it goes home

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` of ``param`` arrived: ``None`` while it is summed on the device, else what goes home (the
        sum, in ``grad``'s dtype, or ``grad`` itself when nothing was summed before it)."""
        acc = self._sums.pop(id(param), None)
        with torch.no_grad():
            if acc is None:
                if self.final:
                    return grad
                acc = grad if grad.dtype == torch.float32 else grad.float()
            else:
                acc.add_(grad)
            if self.final:
                return acc if acc.dtype == grad.dtype else acc.to(grad.dtype)
        self._sums[id(param)] = acc
        return None

    @property
    def pending(self) -> int:
        """Params whose sum has not gone home yet."""
        return len(self._sums)

    def close(self) -> None:
        if self._sums:
            raise RuntimeError(f"{len(self._sums)} gradient sums were never sent home (a layer's last micro-batch)")
