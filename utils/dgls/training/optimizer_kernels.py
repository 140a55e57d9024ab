"""Optimizer kernels: the arithmetic of one optimizer step on lists of tensors, whatever device they are on.

A device update (:mod:`.device_update`) moves a chunk of masters, gradients and optimizer state onto the device and
steps it with one fused kernel (or an own class's few batched ops); everything about that step that depends on the
optimizer is here, behind :class:`OptimizerKernel`. A second optimizer on the device is one more kernel class.

Contract of a kernel
    - ``state_keys``: the per-param fp32 tensors, shaped as the param, that the kernel reads and writes
      (the keys of ``torch.optim.<Optimizer>.state[param]``, so checkpoints are the host optimizer's); a flat
      layer's buffers (:class:`~.device_update.FlatLayer`) hold them, where ``flat`` is true.
    - :meth:`OptimizerKernel.keys_of`: the keys of one param's state tensors that the updater moves in and out,
      in slot order (``state_keys`` by default); one per slot at most, the tensor in slot k of at most
      ``slot_bytes[k]`` bytes per element of the param (what a :class:`~.device_update.Scratch` slot holds).
    - ``counts_steps``: the state holds a ``"step"`` count per param (a float32 scalar for torch's kernels, a
      Python int for bitsandbytes' class), kept on the host and incremented by the updater before the kernel runs.
    - :meth:`OptimizerKernel.new_state` creates a param's state as ``torch.optim.<Optimizer>(fused=True)``
      would on its first step, with the tensors from ``zeros`` (pinned by the caller on CUDA).
    - :meth:`OptimizerKernel.step` is ``torch.optim.<Optimizer>(fused=True)``'s kernel on the lists given,
      with one param group's hyper-parameters: the same numbers as that optimizer on the same device.
      :meth:`OptimizerKernel.step_params` is what the updater calls: it hands each param's state tensors to
      ``step`` by slot, or (a kernel of an optimizer's own class) steps each param as that class would.

Kernels
    - :class:`AdamWKernel`: torch's fused AdamW kernel; two moments, a step count.
    - :class:`SGDKernel`: torch's fused SGD kernel; a momentum buffer when momentum is set, no step count.
      The buffer is created as zeros and every step runs as a later one (``is_first_step=False``): with
      dampening 0 (the only one DGLS builds), ``0 * momentum + grad`` is the first step's ``grad``, bitwise.
    - :class:`~.bitsandbytes_kernel.Bitsandbytes8bitKernel`: bitsandbytes' own AdamW8bit step
      (``[optimizer] type = 'AdamW8bit'``) on the tensors of the class's own state: not flat, its step count a
      Python int.
    - :class:`LionKernel`: ``pytorch_optimizer.Lion``'s step (``[optimizer] type = 'Lion'``), written out with the
      torch ops its class runs, on the class's own state (one fp32 momentum): not flat, no step count.

Private torch APIs
    - The fused kernels are private torch functions: they are called through :mod:`..torch_private`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from .. import torch_private
from ..errors import DGLSUserError

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
    flat = True  # its state can live in a flat layer's fp32 buffers (``state_keys``, shaped as the param)
    steps_on_device = True  # step counts reach the kernel as fp32 scalars on the device (else as Python ints)

    @property
    def slot_bytes(self) -> tuple[int, ...]:
        """Per slot, the most bytes its tensor takes per element of the param (4: fp32 shaped as the param)."""
        return (4,) * len(self.state_keys)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise one line if ``optimizer`` (built as the run builds it) has settings this kernel does not step."""
        return None

    def check_device(self, device: torch.device) -> None:
        """Raise one line if this kernel cannot step on ``device`` (the updater's, when it reserves its buffers)."""
        return None

    def keys_of(self, state: dict) -> tuple[str, ...]:
        """The keys of one param's state tensors that move to the device and home, in slot order."""
        return self.state_keys

    def create_state(self, optimizer: torch.optim.Optimizer, master: torch.Tensor, zeros: Zeros) -> None:
        """Fill ``master``'s empty state in ``optimizer`` as the optimizer's first step would (tensors from
        ``zeros``: pinned by the caller on CUDA)."""
        self.new_state(optimizer.state[master], master.shape, zeros)

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per update of a layer (its optimizer's step), before any of its params: what the optimizer's
        ``step()`` does besides the params (an own class's group counts). Nothing by default."""
        return None

    def step_params(
        self,
        optimizer: torch.optim.Optimizer,
        hosts: list[torch.Tensor],
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[list[torch.Tensor]],
        steps: list,
        group: dict,
        lr: float | None,
    ) -> None:
        """Step ``masters`` (the device's copies of ``hosts``, the optimizer's keys) with ``grads``; ``states[i]``:
        param i's state tensors (:meth:`keys_of`) on the device; ``steps``: their counts after the increment
        (device scalars, or Python ints where ``steps_on_device`` is false). By default :meth:`step` over the
        tensors by slot."""
        self.step(masters, grads, [list(slot) for slot in zip(*states)] if states else [], steps, group, lr)

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


class LionKernel(OptimizerKernel):
    """``pytorch_optimizer.Lion``'s step on the device, on its class's own state (``[optimizer] type = 'Lion'``).

    Why: the class steps a param with four elementwise passes (decay, interpolate and sign, interpolate, add); on the
    host, Flux-dev's widths at 3.18B params took 3.975 s a step, 3.78 s of it the class's updates, the training thread
    waiting 93% of the step (benchmarks/results/host_ram_per_optimizer.md), where the device does it in passes over
    memory it reads at hundreds of GB/s. What runs: the class's batched step (``_step_foreach``, which it takes for real
    params with dense gradients unless ``foreach = false``), op for op, over a chunk's params (the updater's chunks are
    of one param group each) with that group's settings: the decoupled weight decay ``p *= 1 - weight_decay * lr``,
    ``update = lerp(exp_avg, grad, 1 - beta1).sign_()``, ``exp_avg.lerp_(grad, 1 - beta2)``, ``p += -lr * update`` (its
    per-param path runs the same ops one tensor at a time). The same numbers as the class on the same device: bitwise on
    the CPU (tests). Its state is the class's ``exp_avg`` (fp32 as the param), made at a param's first update and
    page-locked; checkpoints are the class's. The class counts steps in every group (``group["step"]``, read by nothing
    in its arithmetic) at each ``step()``: :meth:`begin_step`, once per layer update. Refused by :meth:`check` (the
    start-up probe, and each param's first update): what changes the arithmetic beyond this (``maximize``, ``use_gc``,
    ``adanorm``, ``cautious``, coupled weight decay, complex params), a tensor lr (the class computes its decay in the
    tensor's dtype), and pytorch_optimizer before 4 (its step uses ``mul_`` and ``add_`` where 4's uses ``lerp``: other
    last bits)."""

    state_keys = ()  # its class's state, not the training layout's
    counts_steps = False
    flat = False
    steps_on_device = False
    slot_bytes = (4,)
    REFUSED = ("maximize", "use_gc", "adanorm", "cautious")

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        if not hasattr(type(optimizer), "_step_foreach"):  # before pytorch_optimizer 4: other ops (mul_, add_)
            raise DGLSUserError(
                "Lion's device step runs the ops of pytorch_optimizer 4's Lion, and the installed version's step is "
                "another: pip install -U 'pytorch-optimizer>=4', or step Lion on the CPU (--host_adam torch)"
            )
        groups = optimizer.param_groups
        if any(isinstance(g["lr"], torch.Tensor) for g in groups):
            raise DGLSUserError(
                "Lion's device step takes lr as a number, not a tensor: give a float, or step Lion on the CPU "
                "(--host_adam torch)"
            )
        found = [k for k in self.REFUSED if getattr(optimizer, k, False) or any(g.get(k) for g in groups)]
        if any(not g.get("weight_decouple", True) and g["weight_decay"] for g in groups):
            found.append("weight_decouple = false")
        if found:
            raise DGLSUserError(
                f"Lion's device step runs its plain update, not {', '.join(found)}: drop it from [optimizer], or "
                "step Lion on the CPU (--host_adam torch)"
            )

    def keys_of(self, state: dict) -> tuple[str, ...]:
        return ("exp_avg",)

    def new_state(self, state: dict, shape: torch.Size, zeros: Zeros) -> None:
        state["exp_avg"] = zeros(shape, torch.float32)

    def create_state(self, optimizer: torch.optim.Optimizer, master: torch.Tensor, zeros: Zeros) -> None:
        self.check(optimizer)  # the start-up probe's check, again for a class built elsewhere (the library API)
        if torch.is_complex(master):
            raise DGLSUserError("Lion's device step takes real params: step Lion on the CPU (--host_adam torch)")
        self.new_state(optimizer.state[master], master.shape, zeros)

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:  # the class's step(): init_group, then the count, every group
            group["step"] = group.get("step", 0) + 1

    def step(self, masters, grads, state, steps, group, lr) -> None:
        rate = float(group["lr"] if lr is None else lr)
        beta1, beta2 = group["betas"]
        decay = group["weight_decay"]
        torch_private.lion_step_(
            masters,
            grads,
            state[0],
            decay=1.0 - decay * (1.0 if group["fixed_decay"] else rate) if decay != 0.0 else 1.0,
            lr=rate,
            beta1=float(beta1),
            beta2=float(beta2),
        )


def kernel_for(kind: str, momentum: float = 0.0, launch: str = "cuda") -> OptimizerKernel:
    """The kernel of a host optimizer type (:data:`~.host_optimizer.HOST_OPTIMIZERS`), or of an own class's type
    that has one on the device (:data:`~.optimizer_types.TYPES`' ``on_device``; ``launch``: which of its library's
    kernels, :data:`~.bitsandbytes_kernel.LAUNCHES`)."""
    if kind == "adamw":
        return AdamWKernel()
    if kind == "sgd":
        return SGDKernel(momentum)
    if kind == "adamw8bit":
        from .bitsandbytes_kernel import Bitsandbytes8bitKernel

        return Bitsandbytes8bitKernel(launch)
    if kind == "Lion":  # pytorch_optimizer's exact name (optimizer_types.TYPES)
        return LionKernel()
    raise ValueError(f"no device kernel for optimizer type {kind!r}")
