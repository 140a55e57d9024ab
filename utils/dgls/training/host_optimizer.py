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
with the defaults of the class diffusion-pipe builds for each. Every other type is decided in
:data:`.optimizer_types.TYPES`: a per-param optimizer (8-bit AdamW, StableAdamW, Lion, schedule-free ...) runs its own
class, built once per layer on the masters with the table's values as train.py passes them (``options``) and stepped
on the CPU (``--host_adam torch``), or, for a type with a device kernel (``AdamW8bit``: bitsandbytes' own CUDA kernel,
:mod:`.bitsandbytes_kernel`; ``Lion``: the ops of its class's step, :class:`.optimizer_kernels.LionKernel`), on the
device by default (``--host_adam device``), its state streamed from host memory as AdamW's is (bitsandbytes' CPU step
ran at 15 ns a param: benchmarks/results/full_flux_small_AdamW8bit.md; Lion's class held a Flux step 93%:
benchmarks/results/host_ram_per_optimizer.md); other ``--host_adam`` values with an own class are one line. One whose
step sums over every param (Prodigy, D-Adaptation) runs its own class once over every trained param, stepped after the
backward (:mod:`.whole_step`); the others are refused by name there, never replaced by something else. ``offload``
(torchao's CPU offload of ``torch.optim.AdamW(fused=True)``) runs as ``adamw``. The masters an own class gets require
grad, as train.py's params do (Automagic skips params that do not).

``gradient_release`` (diffusion-pipe's: an optimizer per param, stepped as its gradient is ready) builds one group
without the 1-D split, as an optimizer per param gets the table's weight decay; stepped per layer, each param gets
the update its own optimizer would give it. A whole-step type is refused with it: train.py's per-param optimizers
would each estimate their own step size.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DGLSUserError
from . import optimizer_types
from .bitsandbytes_kernel import LAUNCHES
from .optimizer_kernels import OptimizerKernel, kernel_for
from .optimizer_state import StateRate, measure_rate

HOST_OPTIMIZERS = ("adamw", "sgd")
TORCHAO_KEYS = {"offload_gradients": bool, "minimal_size": int}  # CPUOffloadOptimizer's own keyword arguments
# diffusion-pipe's [optimizer] types that run on the host: what each is here, the defaults of the class
# diffusion-pipe builds for it (no "lr": the class has none), and options accepted beyond those.
# optimi's AdamW (torch-optimi) is AdamW with debiased betas; its Kahan summation acts only on bf16 or
# fp16 params, so on fp32 masters it is a no-op in optimi too, and ``kahan_sum`` is accepted.
TABLE_TYPES: dict[str, tuple[str, dict, set[str]]] = {
    "adamw": ("adamw", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}, set()),
    "adamw_optimi": ("adamw", {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 1e-2}, {"kahan_sum"}),
    "sgd": ("sgd", {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}, set()),
    # torchao's CPUOffloadOptimizer(groups, torch.optim.AdamW, fused=True, **table): AdamW's defaults; its own two
    # keys place torchao's work (train.py's, for resident params) and mean nothing for streamed layers
    "offload": ("adamw", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}, set(TORCHAO_KEYS)),
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
# [optimizer] keys train.py reads itself and never passes to the optimizer class.
TRAIN_PY_KEYS = frozenset({"beta2_half_life", "gradient_release"})
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


def _take_torchao_keys(values: dict[str, Any]) -> None:
    """``offload``: torchao's own keys (:data:`TORCHAO_KEYS`) checked and taken out; they place the work of train.py's
    CPUOffloadOptimizer, which trains the resident params, and change nothing for streamed layers."""
    for key, kind in TORCHAO_KEYS.items():
        if key in values:
            value = values.pop(key)
            if type(value) is not kind or (kind is int and value < 0):
                shape = "true or false" if kind is bool else "a whole number >= 0"
                raise DGLSUserError(f"[optimizer] {key} must be {shape}, got {value!r}")


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
    # a per-layer type (:data:`.optimizer_types.PER_LAYER`): the table's keyword arguments, passed to its class as given
    options: tuple[tuple[str, Any], ...] = ()
    # diffusion-pipe's gradient_release: every param its own optimizer, so no 1-D split of the weight decay
    gradient_release: bool = False
    # an own class's device kernel: which of its library's kernels (.bitsandbytes_kernel.LAUNCHES; library API and
    # benchmarks: "triton" is bitsandbytes' numbers but not bitwise its CUDA kernel's: .bitsandbytes_kernel's doc)
    kernel_launch: str = "cuda"

    def __post_init__(self) -> None:
        if self.implementation == "auto":  # the fastest measured for each optimizer (see the module doc)
            if self.type == "adamw":
                fastest = "split"
            elif self.own_class:
                fastest = "device" if self.class_on_device else "torch"
            else:
                fastest = "torch_fused"
            object.__setattr__(self, "implementation", fastest)
        if self.type not in HOST_OPTIMIZERS and not self.own_class:
            raise DGLSUserError(
                f"[optimizer] type = {self.type!r} cannot run on the host for streamed layers: use one of "
                f"{', '.join(HOST_OPTIMIZERS + optimizer_types.PER_LAYER + optimizer_types.WHOLE_STEP)} (full "
                "fine-tuning keeps streamed layers' optimizer on the CPU)"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise DGLSUserError(
                f"host optimizer implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                f"got {self.implementation!r}"
            )
        if self.own_class and self.implementation not in ("torch", "device" if self.class_on_device else "torch"):
            how = "one per layer" if self.per_layer else "one over every param"
            where = "on the CPU (torch) or the device (device)" if self.class_on_device else "on the CPU"
            raise DGLSUserError(
                f"--host_adam {self.implementation} picks DGLS's AdamW or SGD kernel, and [optimizer] type = "
                f"{self.type!r} steps its own class {where}, {how}: drop --host_adam, or use type = 'adamw'"
            )
        if self.kernel_launch not in LAUNCHES:
            raise DGLSUserError(f"kernel_launch must be one of {', '.join(LAUNCHES)}, got {self.kernel_launch!r}")
        if self.kernel_launch != "cuda" and not (self.type == "adamw8bit" and self.implementation == "device"):
            raise DGLSUserError(
                f"kernel_launch {self.kernel_launch!r} picks the kernel of an own class stepped on the device "
                f"(AdamW8bit with implementation 'device'), not of {self.type!r} with {self.implementation!r}"
            )
        if self.whole_step and self.gradient_release:
            raise DGLSUserError(
                f"[optimizer] gradient_release builds one {self.type} per param in train.py, each estimating its own "
                "step size, and DGLS steps one over every param after the backward (its step size is estimated over "
                "all of them): drop gradient_release, or use a per-param type such as 'adamw'"
            )
        if self.implementation == "deepspeed" and self.type != "adamw":
            raise DGLSUserError(
                f"the {self.implementation} host optimizer is AdamW: use type = 'adamw', or --host_adam torch_fused"
            )
        for name in ("lr", "eps", "weight_decay", "momentum"):
            check_value(name, getattr(self, name))
        check_betas(self.betas, 2)

    @property
    def per_layer(self) -> bool:
        """The type's own class steps each layer on the host (:mod:`.optimizer_types`), not DGLS's kernels."""
        return self.type in optimizer_types.PER_LAYER

    @property
    def whole_step(self) -> bool:
        """The type's own class, one instance over every trained param, steps once after the backward
        (:mod:`.whole_step`)."""
        return self.type in optimizer_types.WHOLE_STEP

    @property
    def class_on_device(self) -> bool:
        """The type's own class has a device kernel (:data:`.optimizer_types.TYPES`' ``on_device``)."""
        entry = optimizer_types.TYPES.get(self.type)
        return self.per_layer and entry is not None and entry.on_device

    @property
    def own_class(self) -> bool:
        """The type's own class runs on the host (per layer or whole step), not DGLS's kernels."""
        return self.per_layer or self.whole_step

    @classmethod
    def from_table(cls, table: dict, implementation: str = "auto") -> HostOptimizerSpec:
        """diffusion-pipe's ``[optimizer]`` table (type, lr, betas, weight_decay, eps; momentum for sgd). What
        the table leaves out takes the default of the class diffusion-pipe would build for its type
        (:data:`TABLE_TYPES`), so streamed layers train with the hyper-parameters resident ones get. Other types
        are looked up in :data:`.optimizer_types.TYPES`: a per-layer type keeps the table's values for its class
        (checked where they mean what they mean everywhere); a refused one is one line."""
        values = dict(table)
        given = str(values.pop("type", "adamw"))
        entry = TABLE_TYPES.get(given.lower())
        if entry is None:
            return cls._per_layer(given, values, implementation)
        kind, defaults, accepted = entry
        if (problem := optimizer_types.missing_package(given, optimizer_types.TYPES[given.lower()])) is not None:
            raise DGLSUserError(problem)
        if given.lower() == "offload":
            _take_torchao_keys(values)
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

    @classmethod
    def _per_layer(cls, given: str, values: dict[str, Any], implementation: str) -> HostOptimizerSpec:
        """A type whose own class steps on the host (:data:`.optimizer_types.PER_LAYER`, ``WHOLE_STEP``), its library
        installed."""
        name, entry = optimizer_types.lookup(given)
        if (problem := optimizer_types.missing_package(given, entry)) is not None:
            raise DGLSUserError(problem)
        if own := sorted(TRAIN_PY_KEYS & set(values)):
            raise DGLSUserError(
                f"[optimizer] {own[0]} is train.py's, not a keyword of {entry.class_name}, and the host optimizer of "
                f"streamed layers cannot take it here: drop it (give betas directly for beta2_half_life)"
            )
        for key, value in values.items():
            if key == "betas":
                check_betas(value, 2 if name in TWO_BETAS else None)
            else:
                check_value(key, value)
        if values.get("do_paramiter_swapping"):
            raise DGLSUserError(
                f"[optimizer] do_paramiter_swapping turns training off for a random share of all params at each "
                f"step, over the whole model, and DGLS builds {name!r} once per streamed layer: drop it"
            )
        options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in values.items()))
        lr = values.get("lr", cls.lr)
        return cls(type=name, lr=lr, implementation=implementation, table_type=name, options=options)

    @property
    def kernel(self) -> str:
        """The optimizer class that runs, in words (for the start-up line)."""
        if self.own_class:
            entry = optimizer_types.TYPES[self.type]
            if self.per_layer and self.on_device:
                how = "the class's own kernel" if self.type == "adamw8bit" else "the ops of the class's step"
                name = (
                    f"{entry.class_name} on the training device ({how} on its own state, streamed from host "
                    "memory), one per layer, stepped as its gradients land"
                )
            elif self.per_layer:
                name = f"{entry.class_name} on the CPU, one per layer, stepped as its gradients land"
            else:
                name = (
                    f"{entry.class_name} on the CPU, one over every trained param of the pipeline stage (streamed "
                    "layers' fp32 masters, and host copies of resident params, whose gradients go to the host and "
                    "weights back to the device each step), stepped once after the backward: each update waits for the "
                    "backward's end"
                )
            name += f" ([optimizer] type {self.type!r}"
            return name + (f": {entry.note})" if entry.note else ")")
        if self.type == "sgd":
            name = SGD_NAMES.get(self.implementation, "torch.optim.SGD")
        else:
            name = NAMES[self.implementation]
        if self.table_type == "offload":
            name += (
                " ([optimizer] type 'offload': torchao's CPUOffloadOptimizer runs torch.optim.AdamW(fused=True) on the "
                "CPU, one per param, the same arithmetic; it copies each gradient home as the backward makes it, "
                "before DeepSpeed clips, and DGLS clips streamed layers' gradients as gradient_clipping says; "
                "train.py's CPUOffloadOptimizer trains the resident params)"
            )
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

    def groups(self, params: Sequence[torch.Tensor]) -> list[dict]:
        """The param groups this spec builds: :meth:`param_groups`, or with ``gradient_release`` one group, the
        weight decay on every param (diffusion-pipe builds an optimizer per param then, with the table's values)."""
        return [{"params": list(params)}] if self.gradient_release and params else self.param_groups(params)

    def trainer_optimizer(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer a trainer steps the params it keeps (the resident ones) with, as diffusion-pipe's train.py
        builds it: the class the type names with torch's default kernel choice, these hyper-parameters and
        :meth:`param_groups`. The host's kernel (``implementation``) is the host's only."""
        groups = self.groups(params)
        if self.own_class:
            return self._class_optimizer(groups)
        if self.type == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """One optimizer over ``params`` (fp32 CPU tensors), 1-D params without weight decay."""
        groups = self.groups(params)
        if self.own_class:
            return self._class_optimizer(groups)
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

    def _class_optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        """The type's own class over ``groups`` with the table's values, as train.py builds it (with
        ``gradient_release`` it turns ``foreach`` off where the class takes it, as train.py does). Every param is
        made to require grad, as train.py's trainable params do: a class may skip the others (Automagic does), and
        the host masters are plain tensors."""
        klass = optimizer_types.load_class(self.type, optimizer_types.TYPES[self.type])
        for group in groups:
            for p in group["params"]:
                p.requires_grad_(True)
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in self.options}
        if self.gradient_release and "foreach" in inspect.signature(klass).parameters:
            kwargs["foreach"] = False
        try:
            return klass(groups, **kwargs)
        except TypeError as exc:
            raise DGLSUserError(
                f"[optimizer] type = {self.type!r}: {klass.__name__} refuses the table: {exc}"
            ) from None

    def probe(self) -> None:
        """A per-layer type's class built and stepped once on two small fp32 tensors (a 2-D one of 4096 elements,
        bitsandbytes' 8-bit threshold, and a 1-D one), before anything slow: a class that fails with this table or
        this version of its library is one line here, not a worker thread's traceback after the model loaded. What
        the class prints while built is not shown (Automagic counts its params)."""
        if not self.own_class:
            return
        params = [torch.zeros(64, 64, requires_grad=True), torch.zeros(64, requires_grad=True)]
        with contextlib.redirect_stdout(io.StringIO()):
            optimizer = self.build(params)
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            try:
                optimizer.step()
            except Exception as exc:  # any failure of a class DGLS did not write: said in one line, with its error
                raise self._step_failure(exc) from None
        if self.on_device:  # settings whose state the device kernel does not move: one line now
            self.device_kernel().check(optimizer)

    def _step_failure(self, exc: Exception) -> DGLSUserError:
        """The one line for an own class that fails a step on the CPU (``exc``: its error)."""
        entry = optimizer_types.TYPES[self.type]
        libraries = ", ".join(package for _, package in entry.packages)
        error = repr(exc) if len(repr(exc)) <= 200 else repr(exc)[:200] + "..."
        given = ", ".join(f"{key} = {value!r}" for key, value in self.options)
        if entry.library_note:  # no version of the library runs the class on the CPU, whatever the values
            what = entry.library_note + (f": use {entry.fallback}" if entry.fallback else "")
        else:
            what = (
                f"check the [optimizer] values it was given ({given or 'none'}), or install a version of {libraries} "
                "it runs with on the CPU" + (f", or use {entry.fallback}" if entry.fallback else "")
            )
        return DGLSUserError(
            f"[optimizer] type = {self.type!r}: {entry.class_name} fails a step on the CPU on a test tensor "
            f"({error}): {what}"
        )

    def state_rate(self, dtype: torch.dtype = torch.float32) -> StateRate:
        """An own class's host state per param, measured on the class :meth:`build` makes, stepped on CPU tensors of
        ``dtype`` (the host masters' fp32; a whole step's resident copies keep their params' dtype): the RAM check's
        and the start-up line's figure (:mod:`.optimizer_state`). A class that fails a step is :meth:`probe`'s line."""
        try:
            return measure_rate(self.build, dtype)
        except DGLSUserError:
            raise
        except Exception as exc:  # any failure of a class DGLS did not write
            if not self.own_class:
                raise
            raise self._step_failure(exc) from None

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
        return kernel_for(self.type, self.momentum, self.kernel_launch)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The fp32 state tensors per param, shaped as the param, that the training layout places: the device
        kernel's; none for an own class, whose state its class makes (:meth:`state_rate` counts it)."""
        if self.own_class:
            return ()
        return self.device_kernel().state_keys

    def saved_state_problem(self, idx: int, saved_groups: list[dict], built_groups: list[dict]) -> str | None:
        """Why optimizer state saved for layer ``idx`` (its param groups) is another optimizer's, or None. AdamW
        and SGD differ by ``betas``; a per-layer type's groups must hold every setting its class gives them when
        built (a class may add some at its first step, such as pytorch_optimizer's ``step``)."""
        if self.own_class:
            built = set(built_groups[0]) - {"params"} if built_groups else set()
            if any(not built <= set(g) for g in saved_groups):
                return f"holds another optimizer's state for layer {idx}, and [optimizer] type is {self.type!r} here"
            return None
        if any(("betas" in g) != (self.type == "adamw") for g in saved_groups):
            saved_kind = "AdamW" if "betas" in saved_groups[0] else "SGD"
            return f"holds {saved_kind} state for layer {idx}, and [optimizer] type is {self.type!r} here"
        return None
