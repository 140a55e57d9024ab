"""Training costs: what a full fine-tune keeps on the device beyond the weights, for the VRAM planner.

Each figure comes from the object that allocates it, not from a second estimate:

- A resident layer's trainable params train with the trainer's optimizer on the device: autograd's gradients,
  in the dtype the layout gives the params (:class:`~..memory.layout.ParamLayout`), and the optimizer's state.
  The state is measured on the class the trainer builds
  (:meth:`~..training.host_optimizer.HostOptimizerSpec.trainer_optimizer`, the [optimizer] type's class, as
  diffusion-pipe's train.py and the demo build it): built on CPU tensors of the params' dtype and stepped once,
  its state tensors are what it keeps for a param of each shape (quantization maps, fp32 copies, factored
  moments), by the rule the host's RAM check counts with (:class:`~..training.optimizer_state.StateRate`).
- Params resident in every placement (shared ones, a swap-unit holder's own) keep their optimizer state on the
  device whatever the plan (``fixed_state_bytes``); their gradients are in the probe's measurement.
- The device update buffers (``--host_adam device`` or ``split``): the size
  :meth:`~..training.device_update.DeviceUpdater.reserve` allocates for the training layout of the probe's
  placement (:func:`~..training.host_training.update_buffer_bytes`), which is reserved at start-up and kept.
- A streamed layer's gradients wait on the device in groups before they go home: the probe streams every
  layer, so they are in its activation peak.

Hazards
    - diffusion-pipe builds optimi's AdamW for ``adamw_optimi``, which on bf16 params keeps a Kahan buffer
      beside its moments; the trainer the demo builds (and the host) run torch's AdamW. It is measured on
      optimi's class when optimi is installed, so the demo's figure errs high by that buffer.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import DGLSUserError
from ..memory.layout import LayerLayout, LayerSizes, modules_of, ownership
from ..memory.precision import dtype_of
from ..training.host_optimizer import HostOptimizerSpec
from ..training.optimizer_state import Build, StateRate, measure_rate


def trainer_class(spec: HostOptimizerSpec) -> Build:
    """What builds the trainer's optimizer over a param list: the [optimizer] type's class (see the hazard)."""
    if spec.table_type == "adamw_optimi" and importlib.util.find_spec("optimi") is not None:
        import optimi

        return lambda params: optimi.AdamW(
            spec.groups(params), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )
    return spec.trainer_optimizer


def state_rate(spec: HostOptimizerSpec, dtype: torch.dtype) -> StateRate:
    """The trainer's optimizer state for params of ``dtype``, measured on CPU tensors (the host's rule,
    :mod:`..training.optimizer_state`); an optimizer that cannot step them on the CPU is one line (give the placement
    explicitly)."""
    try:
        return measure_rate(trainer_class(spec), dtype)
    except Exception as exc:  # any failure of a class DGLS did not write
        raise DGLSUserError(
            f"--vram_budget counts the device memory of the trainer's optimizer ([optimizer] type {spec.type!r}) by "
            f"stepping it on {dtype} tensors on the CPU, which fails ({type(exc).__name__}: {str(exc)[:120]}): give "
            "the placement instead (--blocks_to_swap or --gpu_layers)"
        ) from None


def _fixed_trainable(layers: Sequence, layouts: Sequence[LayerLayout]) -> dict[int, list[nn.Parameter]]:
    """Per entry, its trainable params that stay on the device whatever the placement (not laid out to stream:
    shared, or a holder's own), each under the first entry that owns it."""
    held = ownership(layers).held
    seen: set[int] = set()
    fixed: dict[int, list[nn.Parameter]] = {}
    for index, module in modules_of(layers):
        laid = {id(p.param) for p in layouts[index].params}
        inner = held.get(index, frozenset())
        for p in module.parameters():
            if p.requires_grad and id(p) not in laid and id(p) not in inner and id(p) not in seen:
                seen.add(id(p))
                fixed.setdefault(index, []).append(p)
    return fixed


def with_training_costs(
    layers: Sequence, layouts: list[LayerLayout], spec: HostOptimizerSpec, mixed_precision: str
) -> list[LayerLayout]:
    """``layouts`` with each entry's ``trained_bytes`` (gradients and the trainer's optimizer state of its streamable
    trainable params, while resident) and ``fixed_state_bytes`` (the state of its trainable params resident in every
    placement) set; a LoRA's entries (nothing trainable streams) keep 0."""
    trainable = dtype_of(mixed_precision, "mixed_precision") if mixed_precision != "auto" else None
    rates: dict[torch.dtype, StateRate] = {}

    def state(shape: tuple[int, ...], dtype: torch.dtype) -> int:
        if dtype not in rates:
            rates[dtype] = state_rate(spec, dtype)
        return rates[dtype].bytes(shape)

    fixed = _fixed_trainable(layers, layouts)
    out = []
    for layout in layouts:
        trained = [p for p in layout.params if p.param.requires_grad]
        grads = sum(p.nbytes for p in trained)
        states = sum(state(tuple(p.shape), p.dtype) for p in trained)
        own = sum(state(tuple(p.shape), trainable or p.dtype) for p in fixed.get(layout.index, []))
        sizes: LayerSizes = dataclasses.replace(layout.sizes, trained_bytes=grads + states, fixed_state_bytes=own)
        out.append(dataclasses.replace(layout, sizes=sizes))
    return out
