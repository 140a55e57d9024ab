"""Bindings: what every param and buffer of the engine's layers points at, and where it came from.

Layout
    - A streamed layer (:class:`~.residency.StreamedLayer`): its params point at an empty placeholder of their
      dtype and number of dimensions (shared per both, so any use of an evicted param fails, and a trainer that
      sorts params by ``ndim`` when it builds its optimizer, as diffusion-pipe's weight decay groups do, sorts a
      streamed param as it is), or at views of its slot.
    - Everything else: on the device. A resident layer's streamable params take their cast (fp8-stored ones
      the dequantized value of their master, which stays: :mod:`.masters`).
    - Home: the device and dtype every param and buffer had before the engine, to put it back.

Hazards handled
    - ``cast_target`` applies wherever a layer lives, so re-placement never changes the numbers.
    - A layer whose Parameter objects ``load_state_dict(assign=True)`` replaced is bound anew (:meth:`adopted`).
    - :meth:`restore` puts every param and buffer back on its home device in its home dtype; a streamed param
      takes its true value (a feature's, such as full fine-tuning's fp32 master, else the master's, fp8 ones
      dequantized: the full-precision originals are not kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..memory.layout import LayerLayout, modules_of
from .masters import Masters
from .residency import StreamedLayer


class Bindings:
    """The streamed layers (:attr:`streamed`), the placeholders, and the home of every param and buffer."""

    def __init__(
        self,
        layers: list,
        layouts: list[LayerLayout],
        masters: Masters,
        device: torch.device,
        true_value: Callable[[torch.Tensor], torch.Tensor | None],
    ) -> None:
        self.layers, self.layouts, self.masters, self.device = layers, layouts, masters, device
        self.true_value = true_value  # a feature's value of a param (full fine-tuning's fp32 master), else None
        self.streamed: dict[int, StreamedLayer] = {}
        self._placeholders: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._home = {
            id(t): (t, t.device, t.dtype)
            for _, module in modules_of(layers)
            for t in (*module.parameters(), *module.buffers())
        }

    def placeholder(self, dtype: torch.dtype, ndim: int = 1) -> torch.Tensor:
        """An empty tensor with ``ndim`` dimensions (at least one: a 0-d tensor holds a value): an evicted param
        points here, so any use of it fails."""
        key = (dtype, max(ndim, 1))
        if key not in self._placeholders:
            self._placeholders[key] = torch.empty((0,) * key[1], dtype=dtype, device=self.device)
        return self._placeholders[key]

    def stream(self, idx: int) -> None:
        """Make a layer streamed: its master is in the store; its params now point at placeholders."""
        self.streamed[idx] = StreamedLayer(self.layers[idx], self.masters.host(idx), self.placeholder)

    def unstream(self, idx: int) -> None:
        """Make a streamed layer resident: its params get device copies of the master's values."""
        layer = self.streamed.pop(idx)
        with torch.no_grad():
            for k, param in enumerate(layer.params):
                param.data = self.masters.device_value(idx, k)
        self.masters.became_resident(idx)

    def place_resident_parts(self) -> None:
        """Every param and buffer that does not stream goes to the device; the streamable params of
        resident layers take their cast (fp8 ones the values of their master)."""
        streamed = {id(p) for layer in self.streamed.values() for p in layer.params}
        cast = {
            id(p.param): (layout.index, k, p)
            for layout in self.layouts
            if layout.index not in self.streamed
            for k, p in enumerate(layout.params)
        }
        with torch.no_grad():
            for t, _, _ in self._home.values():
                if id(t) in streamed:
                    continue
                if id(t) in cast:
                    idx, k, p = cast[id(t)]
                    has = self.masters.has(idx)
                    t.data = self.masters.device_value(idx, k) if has else t.data.to(self.device, p.dtype)
                else:
                    t.data = t.data.to(self.device)

    def adopted(self, idx: int) -> None:
        """``load_state_dict(assign=True)`` replaced a layer's Parameter objects (see :mod:`.masters`)."""
        for t in (*self.layers[idx].parameters(), *self.layers[idx].buffers()):
            self._home.setdefault(id(t), (t, t.device, t.dtype))
        if self.streamed.pop(idx, None) is not None:
            self.stream(idx)
        else:
            with torch.no_grad():
                for k, p in enumerate(self.layouts[idx].params):
                    p.param.data = self.masters.device_value(idx, k)

    def true_values(self, layer: StreamedLayer) -> list[torch.Tensor]:
        """A streamed layer's params as they truly are: a feature's value (the fp32 masters of host-trained
        ones), else the host copy's (fp8-stored ones dequantized)."""
        kept = [self.true_value(p) for p in layer.params]
        return [m if m is not None else layer.host.value(k) for k, m in enumerate(kept)]

    def restore(self) -> None:
        """Every param and buffer back on its home device in its home dtype (grads cast to it too). A layer on the
        disk tier that comes home to the CPU keeps its values in the file's mapping (read on demand: the model may
        be larger than RAM), instead of a copy of them all."""
        with torch.no_grad():
            streamed = set()
            for layer in self.streamed.values():
                for param, value in zip(layer.params, self.true_values(layer)):
                    _, device, dtype = self._home[id(param)]
                    in_place = layer.host.on_disk and value.device == device and value.dtype == dtype
                    param.data = value if in_place else value.to(device, dtype, copy=True)
                    streamed.add(id(param))
            for t, device, dtype in self._home.values():
                if id(t) not in streamed and (t.device != device or t.dtype != dtype):
                    t.data = t.data.to(device, dtype)
                if isinstance(t, nn.Parameter) and t.grad is not None and t.grad.dtype != dtype:
                    t.grad = t.grad.to(dtype)
        self.streamed.clear()
