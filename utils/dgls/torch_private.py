"""Every private torch API DGLS uses, named once: what it is for, and what would replace it.

Why one module
    - DGLS hooks into autograd below its public surface (which node runs, which saved-tensor hooks are
      active, the end-of-backward callback) and calls fused and batched (``_foreach``) kernels that
      ``torch.optim`` and optimizer libraries use but torch does not export. A torch release may rename any of
      them; here a reader sees the whole exposure at once, and :func:`check_torch` finds a missing one at
      start-up instead of in the middle of a step.
    - The rest of ``utils/dgls`` calls these functions and never spells ``torch._``.

Tested range
    - ``TESTED`` (torch 2.11 to 2.13): the GPU tests ran on 2.11, CI runs 2.13 on the CPU, and
      ``requirements.txt`` bounds torch to the same range.
    - A torch outside it that still has every API below starts with one notice; one that lacks any is
      refused in one line that names what is missing and the range to install.

Hazards
    - These are private for a reason: semantics may shift without a rename. The CPU and GPU ordering tests
      are what catch that; a torch outside ``TESTED`` has not been through them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial, reduce

import torch
import torch.utils.checkpoint  # the selective checkpoint's mode class: named in USED, reached from torch
from torch.autograd import Variable
from torch.autograd import profiler as autograd_profiler
from torch.utils import _python_dispatch
from torch.utils import _pytree as pytree

from .errors import DGLSUserError

TESTED = ((2, 11), (2, 13))  # (oldest, newest) major.minor tested; requirements.txt: torch>=2.11,<2.14

# re-exported: unit_checkpoints.py flattens a piece's outputs with torch's own pytree (public only as private)
TreeSpec = pytree.TreeSpec
tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten


# ---------------------------------------------------------------- autograd's state
# The hot path's reads (every hook call makes some) are the C functions themselves, or partials of them: no
# Python frame per call.

# The autograd node running on this thread, or None: not None in a backward or a checkpoint's recompute (the
# only way to tell a recompute from a forward without frames). ``torch._C._current_autograd_node``.
current_autograd_node: Callable[[], object] = torch._C._current_autograd_node


def in_backward() -> bool:
    """True while autograd's engine runs a node on this thread (a backward or a checkpoint's recompute)."""
    return current_autograd_node() is not None


# ``top_saved_tensors_hooks()``: the innermost active ``saved_tensors_hooks`` pair (pack, unpack), or None:
# DGLS stacks its own on top of a checkpoint's. ``torch._C._autograd._top_saved_tensors_default_hooks``.
top_saved_tensors_hooks: Callable[[], tuple[Callable, Callable] | None] = partial(
    torch._C._autograd._top_saved_tensors_default_hooks, True
)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass finishes (autograd's engine callback queue).
    ``Variable._execution_engine.queue_callback``: what DDP and FSDP use for the same purpose."""
    Variable._execution_engine.queue_callback(callback)


SELECTIVE_CHECKPOINT_MODE = "_CachingTorchDispatchMode"  # torch.utils.checkpoint's; a rename would pass silently


def under_selective_checkpoint() -> bool:
    """True inside ``torch.utils.checkpoint``'s selective-checkpoint caching mode, whose cached tensors DGLS
    can't swap. ``torch.utils._python_dispatch._get_current_dispatch_mode_stack``, after
    ``torch._C._len_torch_dispatch_stack``: no mode is active in a plain forward, and the list is built only when
    one is."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    stack = _python_dispatch._get_current_dispatch_mode_stack()
    return any(type(m).__name__ == SELECTIVE_CHECKPOINT_MODE for m in stack)


# ---------------------------------------------------------------- tensors and storages
def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage: the same for every view of it, and before and after a resize
    (``data_ptr`` is 0 once a storage is resized to nothing). ``UntypedStorage._cdata``."""
    return tensor.untyped_storage()._cdata


def is_view(tensor: torch.Tensor) -> bool:
    """``Tensor._is_view``: autocast caches a cast only for a leaf that is no view."""
    return tensor._is_view()


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or None. ``Tensor._base``."""
    return tensor._base


# ---------------------------------------------------------------- fused kernels of torch.optim
def foreach_norm(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The 2-norm of each tensor, one fused kernel per device (``clip_grad_norm_``'s). ``torch._foreach_norm``."""
    return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``factor`` in one kernel. ``torch._foreach_mul_``."""
    torch._foreach_mul_(list(tensors), factor)


def lion_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    decay: float,
    lr: float,
    beta1: float,
    beta2: float,
) -> None:
    """pytorch_optimizer Lion's batched step, op for op (``Lion._step_foreach``, its decoupled weight decay first):
    ``params *= decay`` (unless 1), ``update = sign(lerp(exp_avgs, grads, 1 - beta1))``, ``exp_avgs.lerp_(grads,
    1 - beta2)``, ``params += -lr * update``. ``torch._foreach_mul_``, ``_foreach_lerp``, ``_foreach_sign_``,
    ``_foreach_lerp_``, ``_foreach_add_``: the ops its class calls, so the numbers are its numbers."""
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    updates = torch._foreach_lerp(exp_avgs, grads, weight=1.0 - beta1)
    torch._foreach_sign_(updates)
    torch._foreach_lerp_(exp_avgs, grads, weight=1.0 - beta2)
    torch._foreach_add_(params, updates, alpha=-lr)


def fused_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    """One AdamW step over the lists in place: ``torch.optim.AdamW(fused=True)``'s kernel,
    ``torch._fused_adamw_``, called without the optimizer object around it (DGLS streams the state)."""
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=amsgrad,
        maximize=maximize,
    )


def fused_sgd_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    dampening: float,
    nesterov: bool,
    is_first_step: bool,
) -> None:
    """One SGD step over the lists in place: ``torch.optim.SGD(fused=True)``'s kernel, ``torch._fused_sgd_``."""
    torch._fused_sgd_(
        params,
        grads,
        momentum_buffers,
        weight_decay=weight_decay,
        momentum=momentum,
        lr=lr,
        dampening=dampening,
        nesterov=nesterov,
        maximize=False,
        is_first_step=is_first_step,
        grad_scale=None,
        found_inf=None,
    )


# ---------------------------------------------------------------- tests' delays
def sleep_on_stream(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles: the transport's one delay hook
    for the GPU ordering tests (:attr:`~.memory.transport.Transport.delay`). ``torch.cuda._sleep``.
    Test-only, so :func:`check_torch` does not require it."""
    torch.cuda._sleep(cycles)


# ---------------------------------------------------------------- the profiler
# ``profiler_recording()``: True while a ``torch.profiler`` (or ``torch.autograd.profiler``) records: the check
# ``record_function`` itself makes, without its cost when nothing records. It reads
# ``torch.autograd.profiler._is_profiler_enabled`` (a module bool the profilers set on start and stop) at each
# call; a partial of ``getattr``, so the read costs no Python frame (it runs per layer transition).
profiler_recording: Callable[[], bool] = partial(getattr, autograd_profiler, "_is_profiler_enabled")


# ---------------------------------------------------------------- torch-function modes
# Used by trainers/file_backed_casts.py, whose mode makes the load's casts in a scratch file.


def tensor_method(name: str) -> Callable:
    """Torch's own tensor method ``name`` (``torch._C.TensorBase``'s): the object a torch-function mode is handed for
    it while nothing has put another function in ``torch.Tensor.<name>``'s place."""
    return getattr(torch._C.TensorBase, name)


# ``parse_to(*args, **kwargs)``: (device, dtype, non_blocking, memory_format) of ``Tensor.to``'s arguments (no
# ``copy``), as ``Module.to`` parses them; raises TypeError on arguments ``Tensor.to`` would refuse.
# ``torch._C._nn._parse_to``.
parse_to: Callable[..., tuple] = torch._C._nn._parse_to


def function_mode_depth() -> int:
    """How many torch-function modes are on this thread's stack. ``torch._C._len_torch_function_stack``."""
    return torch._C._len_torch_function_stack()


def take_off_function_mode_stack(mode: object) -> None:
    """``mode`` off this thread's torch-function mode stack wherever it is on it; the modes above it stay, in order
    (``TorchFunctionMode.__exit__`` pops the top only). ``torch._C._pop_torch_function_stack`` and
    ``_push_on_torch_function_stack``."""
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


# ---------------------------------------------------------------- the start-up check
USED = (
    "torch._C._current_autograd_node",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C._len_torch_dispatch_stack",
    "torch.autograd.Variable._execution_engine",
    "torch._foreach_norm",
    "torch._foreach_mul_",
    "torch._foreach_lerp",
    "torch._foreach_lerp_",
    "torch._foreach_sign_",
    "torch._foreach_add_",
    "torch._fused_adamw_",
    "torch._fused_sgd_",
    "torch.autograd.profiler._is_profiler_enabled",
    "torch.cuda._sleep",
    "torch.Tensor._is_view",
    "torch.Tensor._base",
    "torch.UntypedStorage._cdata",
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
    f"torch.utils.checkpoint.{SELECTIVE_CHECKPOINT_MODE}",
    "torch.utils._pytree.TreeSpec",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_unflatten",
    "torch._C.TensorBase",
    "torch._C._nn._parse_to",
    "torch._C._len_torch_function_stack",
    "torch._C._pop_torch_function_stack",
    "torch._C._push_on_torch_function_stack",
)


def missing_apis(root: object = torch) -> list[str]:
    """The names in :data:`USED` that ``root`` (torch) lacks."""
    missing = []
    for name in USED:
        try:
            reduce(getattr, name.split(".")[1:], root)
        except AttributeError:
            missing.append(name)
    return missing


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(version: str | None = None, root: object = torch) -> str:
    """Refuse a torch that lacks a private API DGLS calls; return a one-line notice (empty in the tested range)
    for a torch outside the tested range that has them all."""
    version = version or torch.__version__
    low, high = (".".join(map(str, v)) for v in TESTED)
    missing = missing_apis(root)
    if missing:
        raise DGLSUserError(
            f"torch {version} lacks {', '.join(missing)}, which DGLS calls (utils/dgls/torch_private.py): "
            f"install torch {low} to {high} (pip install 'torch>={low},<{TESTED[1][0]}.{TESTED[1][1] + 1}')"
        )
    if TESTED[0] <= _version(version) <= TESTED[1]:
        return ""
    return (
        f"DGLS: torch {version} is outside the tested range ({low} to {high}); the private torch APIs DGLS uses "
        "are all present, but if training fails or its numbers look wrong, install a tested torch"
    )
