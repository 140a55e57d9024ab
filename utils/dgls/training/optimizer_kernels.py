"""Optimizer kernels: the arithmetic of one optimizer step on lists of tensors, whatever device they are on.

A device update (:mod:`.device_update`) moves a chunk of masters, gradients and optimizer state onto the
device and steps it with one fused kernel; everything about that step that depends on the optimizer is
here, behind :class:`OptimizerKernel`. A second optimizer on the device is one more kernel class.

Contract of a kernel
    - ``state_keys``: the per-param fp32 tensors, shaped as the param, that the kernel reads and writes
      (the keys of ``torch.optim.<Optimizer>.state[param]``, so checkpoints are the host optimizer's).
    - ``counts_steps``: the state holds a float32 ``"step"`` scalar per param, kept on the host and
      incremented by the updater before the kernel runs.
    - :meth:`OptimizerKernel.new_state` creates a param's state as ``torch.optim.<Optimizer>(fused=True)``
      would on its first step, with the tensors from ``zeros`` (pinned by the caller on CUDA).
    - :meth:`OptimizerKernel.step` is ``torch.optim.<Optimizer>(fused=True)``'s kernel on the lists given,
      with one param group's hyper-parameters: the same numbers as that optimizer on the same device.

Kernels
    - :class:`AdamWKernel`: torch's fused AdamW kernel; two moments, a step count.
    - :class:`SGDKernel`: torch's fused SGD kernel; a momentum buffer when momentum is set, no step count.
      The buffer is created as zeros and every step runs as a later one (``is_first_step=False``): with
      dampening 0 (the only one DGLS builds), ``0 * momentum + grad`` is the first step's ``grad``, bitwise.

Private torch APIs
    - The fused kernels are private torch functions: they are called through :mod:`..torch_private`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from .. import torch_private

Zeros = Callable[[torch.Size, torch.dtype], torch.Tensor]


def grad_norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 2-norm of each of ``grads``, in one fused kernel per device (the norms clipping adds up)."""
    return torch_private.foreach_norm(grads)


def scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply each of ``tensors`` in place by the scalar tensor ``coef`` (a clip coefficient), in one kernel."""
    torch_private.foreach_mul_(tensors, coef)


class OptimizerKernel(ABC):
    """One optimizer's step on lists of tensors (see the module doc)."""

    state_keys: tuple[str, ...]
    counts_steps: bool

    def new_state(self, state: dict, shape: torch.Size, zeros: Zeros) -> None:
        """Fill a param's empty state dict as the fused torch optimizer's first step would."""
        if self.counts_steps:
            state["step"] = torch.zeros((), dtype=torch.float32)
        for key in self.state_keys:
            state[key] = zeros(shape, torch.float32)

    @abstractmethod
    def step(
        self,
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        state: list[list[torch.Tensor]],
        steps: list[torch.Tensor],
        group: dict,
        lr: float | None,
    ) -> None:
        """Step ``masters`` (fp32) in place with ``grads`` (fp32, already clipped); ``state[k]`` lists the
        ``state_keys[k]`` tensors of the params; ``steps``: their step counts after the increment (on the
        masters' device; empty when the kernel counts none). ``lr`` overrides the group's."""


class AdamWKernel(OptimizerKernel):
    """``torch.optim.AdamW(fused=True)``'s kernel."""

    state_keys = ("exp_avg", "exp_avg_sq")
    counts_steps = True

    def step(self, masters, grads, state, steps, group, lr) -> None:
        avgs, sqs = state
        beta1, beta2 = group["betas"]
        torch_private.fused_adamw_(
            masters,
            grads,
            avgs,
            sqs,
            steps,
            lr=float(group["lr"] if lr is None else lr),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
        )


class SGDKernel(OptimizerKernel):
    """``torch.optim.SGD(fused=True)``'s kernel (dampening 0, no Nesterov: what DGLS builds)."""

    counts_steps = False

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.state_keys = ("momentum_buffer",) if momentum else ()

    def step(self, masters, grads, state, steps, group, lr) -> None:
        torch_private.fused_sgd_(
            masters,
            grads,
            state[0] if self.state_keys else [],
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            lr=float(group["lr"] if lr is None else lr),
            dampening=float(group.get("dampening", 0.0)),
            nesterov=bool(group.get("nesterov", False)),
            is_first_step=False,
        )


def kernel_for(kind: str, momentum: float = 0.0) -> OptimizerKernel:
    """The kernel of a host optimizer type (:data:`~.host_optimizer.HOST_OPTIMIZERS`)."""
    if kind == "adamw":
        return AdamWKernel()
    if kind == "sgd":
        return SGDKernel(momentum)
    raise ValueError(f"no device kernel for optimizer type {kind!r}")
