"""Host optimizer: which optimizer updates the host-trained params, and how it is built.

Full fine-tuning with streamed layers keeps each streamed layer's trainable params as fp32 masters
in host memory and updates them there (:mod:`.host_training`). This module only describes that
optimizer (:class:`HostOptimizerSpec`) and builds one per layer (:meth:`HostOptimizerSpec.build`):

- ``adamw``, by ``implementation`` (``"auto"``, the default, is ``"split"``: the fastest of the three side by
  side in the SDXL full fine-tune, benchmarks/results/full_sdxl_default.md):

  - ``"torch_fused"``: ``torch.optim.AdamW(fused=True)`` on the CPU. As fast as DeepSpeed's kernel in the
    SDXL full fine-tune (benchmarks/results/full_sdxl.md), and it needs no compiler;
  - ``"deepspeed"``: DeepSpeed's ``DeepSpeedCPUAdam`` (AVX kernels, built on first use);
  - ``"torch"``: ``torch.optim.AdamW`` as it runs on CPU tensors by default (the single-tensor loop):
    the same arithmetic as a trainer's own ``torch.optim.AdamW`` on CPU, so a CPU run can be compared
    bitwise with one that never streams;
  - ``"device"``: the step runs on the training device, ``torch.optim.AdamW(fused=True)``'s kernel, with
    each layer's master and moments streamed in and back out (:mod:`.device_update`); the state still
    lives in host memory between steps.
  - ``"split"``: both at once: each layer's step runs on the device or on the CPU (torch's fused kernel),
    whichever would finish it sooner at the rates measured on earlier steps (:mod:`.update_split`); the
    two kernels do the same arithmetic, so the split changes the speed only.
- ``sgd``: ``torch.optim.SGD`` (momentum as given) on the CPU (``"auto"`` is ``"torch_fused"``); ``"device"`` and
  ``"split"`` run ``torch.optim.SGD(fused=True)``'s kernel on the device as for AdamW, and build the host's SGD
  fused too (on the CPU the fused and the single-tensor SGD give the same numbers, bitwise).

The device's arithmetic is an :class:`~.optimizer_kernels.OptimizerKernel` per type
(:meth:`HostOptimizerSpec.device_kernel`): a type with a kernel there runs on the device; DeepSpeed's CPU Adam is
AdamW only.

Param groups follow diffusion-pipe's rule: 1-D params (biases, norm scales) get no weight decay.
One optimizer per layer gives each param exactly the update one optimizer over all params gives it
(AdamW and SGD keep per-param state and step counts), so a test can compare against a reference that
builds the same optimizer over every param (:meth:`build` accepts any param list).

:meth:`HostOptimizerSpec.from_table` reads diffusion-pipe's ``[optimizer]`` table: ``adamw``, ``sgd``, and
``adamw_optimi`` (diffusion-pipe's example), which is AdamW on fp32 masters (:data:`TABLE_TYPES` says why),
with the defaults of the class diffusion-pipe builds for each. Optimizers DGLS cannot run on the host
(8-bit states, Prodigy, schedule-free ...) are refused by name there, never replaced by something else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DGLSUserError
from .optimizer_kernels import OptimizerKernel, kernel_for

HOST_OPTIMIZERS = ("adamw", "sgd")
# diffusion-pipe's [optimizer] types that run on the host: what each is here, the defaults of the class
# diffusion-pipe builds for it (no "lr": the class has none), and options accepted beyond those.
# optimi's AdamW (torch-optimi) is AdamW with debiased betas; its Kahan summation acts only on bf16 or
# fp16 params, so on fp32 masters it is a no-op in optimi too, and ``kahan_sum`` is accepted.
TABLE_TYPES: dict[str, tuple[str, dict, set[str]]] = {
    "adamw": ("adamw", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}, set()),
    "adamw_optimi": ("adamw", {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 1e-2}, {"kahan_sum"}),
    "sgd": ("sgd", {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}, set()),
}
IMPLEMENTATIONS = ("auto", "torch_fused", "deepspeed", "torch", "device", "split")
NAMES = {
    "deepspeed": "DeepSpeedCPUAdam",
    "torch_fused": "torch.optim.AdamW(fused=True)",
    "torch": "torch.optim.AdamW (single-tensor)",
    "device": "torch's fused AdamW kernel on the training device, state streamed from host memory",
    "split": "AdamW split between the training device (state streamed) and the CPU (torch.optim.AdamW(fused=True))",
}
SGD_NAMES = {
    "device": "torch's fused SGD kernel on the training device, state streamed from host memory",
    "split": "SGD split between the training device (state streamed) and the CPU (torch.optim.SGD(fused=True))",
}


# What each hyper-parameter must be, for any optimizer that takes it: lr, eps and weight_decay of infinity
# or NaN, and momentum of NaN, are accepted by torch and train to a model of NaN or of the initial weights.
VALUE_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "lr": ("a finite number > 0", lambda v: v > 0),
    "eps": ("a finite number > 0", lambda v: v > 0),
    "weight_decay": ("a finite number >= 0", lambda v: v >= 0),
    "momentum": ("a number in [0, 1)", lambda v: 0 <= v < 1),
}
# diffusion-pipe's [optimizer] types whose betas are AdamW's two (the others may take another number).
TWO_BETAS = frozenset({"adamw", "adamw_optimi", "adamw8bit", "adamw8bitkahan", "stableadamw", "offload"})


def is_finite_number(value: Any) -> bool:
    """A TOML number (not a bool, not a string), neither infinite nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_value(name: str, value: Any) -> None:
    """One line naming ``[optimizer] name`` and its range when ``value`` is outside it (names without a rule pass)."""
    rule = VALUE_RULES.get(name)
    if rule is not None and not (is_finite_number(value) and rule[1](value)):
        raise DGLSUserError(f"[optimizer] {name} must be {rule[0]}, got {value!r}")


def check_betas(value: Any, count: int | None) -> None:
    """``betas``: a list of ``count`` numbers (any number of them if None), each in [0, 1)."""
    ok = isinstance(value, (list, tuple)) and (count is None or len(value) == count) and len(value) > 0
    if not (ok and all(is_finite_number(b) and 0 <= b < 1 for b in value)):
        shape = "a list of two numbers" if count == 2 else "a list of numbers"
        shown = list(value) if isinstance(value, tuple) else value
        raise DGLSUserError(f"[optimizer] betas must be {shape}, each in [0, 1) (like [0.9, 0.99]), got {shown!r}")


def check_table_values(table: dict[str, Any]) -> None:
    """The hyper-parameters of an ``[optimizer]`` table that train.py itself builds (a LoRA, or a full fine-tune
    without DGLS): those with a meaning in every optimizer (:data:`VALUE_RULES`, betas) are checked where given;
    other keys are the optimizer class's own and pass untouched, as train.py passes them."""
    kind = str(table.get("type", "")).lower()
    for name, value in table.items():
        if name == "betas":
            check_betas(value, 2 if kind in TWO_BETAS else None)
        else:
            check_value(name, value)
    if "beta2_half_life" in table:  # train.py replaces betas[1] with 0.5 ** (batch / beta2_half_life)
        half_life = table["beta2_half_life"]
        if not (is_finite_number(half_life) and half_life > 0):
            raise DGLSUserError(f"[optimizer] beta2_half_life must be a finite number > 0, got {half_life!r}")
        if "betas" not in table:
            raise DGLSUserError("[optimizer] beta2_half_life sets the second of betas: give betas, like [0.9, 0.99]")


@dataclass(frozen=True)
class HostOptimizerSpec:
    """The optimizer of the host-trained params (see the module doc)."""

    type: str = "adamw"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.01
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    implementation: str = "auto"
    table_type: str = ""  # the [optimizer] type it was read from, when that is another name for ``type``

    def __post_init__(self) -> None:
        if self.implementation == "auto":  # the fastest measured for each optimizer (see the module doc)
            object.__setattr__(self, "implementation", "split" if self.type == "adamw" else "torch_fused")
        if self.type not in HOST_OPTIMIZERS:
            raise DGLSUserError(
                f"[optimizer] type = {self.type!r} cannot run on the host for streamed layers: use one of "
                f"{', '.join(HOST_OPTIMIZERS)} (full fine-tuning keeps streamed layers' optimizer on the CPU)"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise DGLSUserError(
                f"host optimizer implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                f"got {self.implementation!r}"
            )
        if self.implementation == "deepspeed" and self.type != "adamw":
            raise DGLSUserError(
                f"the {self.implementation} host optimizer is AdamW: use type = 'adamw', or --host_adam torch_fused"
            )
        for name in ("lr", "eps", "weight_decay", "momentum"):
            check_value(name, getattr(self, name))
        check_betas(self.betas, 2)

    @classmethod
    def from_table(cls, table: dict, implementation: str = "auto") -> HostOptimizerSpec:
        """diffusion-pipe's ``[optimizer]`` table (type, lr, betas, weight_decay, eps; momentum for sgd). What
        the table leaves out takes the default of the class diffusion-pipe would build for its type
        (:data:`TABLE_TYPES`), so streamed layers train with the hyper-parameters resident ones get."""
        values = dict(table)
        given = str(values.pop("type", "adamw"))
        entry = TABLE_TYPES.get(given.lower())
        if entry is None:
            hint = " (fp32 masters on the host need no Kahan summation)" if "adamw" in given.lower() else ""
            raise DGLSUserError(
                f"[optimizer] type = {given!r} cannot run on the host, where DGLS trains the streamed layers of a "
                f"full fine-tune: use one of {', '.join(repr(t) for t in TABLE_TYPES)}{hint}, or train a LoRA"
            )
        kind, defaults, accepted = entry
        kahan_sum = values.pop("kahan_sum", None)
        if kahan_sum is not None and given.lower() != "adamw_optimi":
            raise DGLSUserError(f"[optimizer] kahan_sum is an option of 'adamw_optimi', not of {given!r}: drop it")
        if kahan_sum is not None and not isinstance(kahan_sum, bool):
            raise DGLSUserError(f"[optimizer] kahan_sum must be true or false, got {kahan_sum!r}")
        known = {"lr", *defaults}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DGLSUserError(
                f"[optimizer] {', '.join(unknown)} cannot be passed to the host optimizer of streamed layers "
                f"(type {given!r} takes {', '.join(sorted(known | accepted))}): drop them"
            )
        if "lr" not in values and "lr" not in defaults:
            raise DGLSUserError(f"[optimizer] type {given!r} needs lr (its class has no default)")
        for name, value in values.items():  # before they meet the dataclass (betas = 0.9 is no sequence)
            if name == "betas":
                check_betas(value, 2)
            else:
                check_value(name, value)
        values = {**defaults, **values}
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(type=kind, **values, implementation=implementation, table_type=given.lower())

    @property
    def kernel(self) -> str:
        """The optimizer class that runs, in words (for the start-up line)."""
        if self.type == "sgd":
            name = SGD_NAMES.get(self.implementation, "torch.optim.SGD")
        else:
            name = NAMES[self.implementation]
        if self.table_type == "adamw_optimi":
            name += (
                " ([optimizer] type 'adamw_optimi': optimi's AdamW is AdamW, its moments kept debiased; its Kahan "
                "summation is for bf16 or fp16 weights, and the masters are fp32)"
            )
        return name

    @staticmethod
    def param_groups(params: Sequence[torch.Tensor]) -> list[dict]:
        """diffusion-pipe's param groups: the params of 2 or more dims, then the 1-D ones without weight decay."""
        decay = [p for p in params if p.ndim > 1]
        plain = [p for p in params if p.ndim <= 1]
        return [g for g in ({"params": decay}, {"params": plain, "weight_decay": 0.0}) if g["params"]]

    def trainer_optimizer(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer a trainer steps the params it keeps (the resident ones) with, as diffusion-pipe's train.py
        builds it: the class the type names with torch's default kernel choice, these hyper-parameters and
        :meth:`param_groups`. The host's kernel (``implementation``) is the host's only."""
        groups = self.param_groups(params)
        if self.type == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """One optimizer over ``params`` (fp32 CPU tensors), 1-D params without weight decay."""
        groups = self.param_groups(params)
        if self.type == "sgd":  # device and split: the kernel the device runs (.optimizer_kernels), on the host too
            fused = {"fused": True} if self.on_device else {}
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, **fused)
        if self.implementation == "deepspeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            from .jit_ops import before_loading

            before_loading("CPUAdamBuilder")  # compiled on first use: said first; a stale build lock refused
            return DeepSpeedCPUAdam(
                groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, adamw_mode=True
            )
        # "device": the optimizer holds the state and hyper-parameters; its kernel runs in .device_update
        flags = {"foreach": False} if self.implementation == "torch" else {"fused": True}
        return torch.optim.AdamW(
            groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, **flags
        )

    @property
    def on_device(self) -> bool:
        """Steps run on the training device (:mod:`.device_update`): all of them, or a share (``split``)."""
        return self.implementation in ("device", "split")

    @property
    def split(self) -> bool:
        """Steps run on the device and on the CPU at once (:mod:`.update_split`)."""
        return self.implementation == "split"

    def device_kernel(self) -> OptimizerKernel:
        """The arithmetic of this optimizer as the device runs it (and what the training layout gives state)."""
        return kernel_for(self.type, self.momentum)

    @property
    def state_bytes_per_param(self) -> int:
        """Host bytes of optimizer state per param (fp32 moments)."""
        return 4 * len(self.device_kernel().state_keys)
