"""bench_full.py's methods beside DGLS and the all-resident reference: what diffusion-pipe users run today.

- ``torchao-offload``: diffusion-pipe's ``[optimizer] type = 'offload'`` as its train.py builds it:
  ``CPUOffloadOptimizer(param_groups, torch.optim.AdamW, fused=True, **table)`` over the model's own params (the
  compute dtype: no fp32 masters), the param groups split as train.py splits them (1-D params without weight decay).
  torchao keeps a pinned host copy of each param of 4096 elements or more and its gradient, copies each gradient home
  in a post-accumulate-grad hook during the backward (every micro-batch: the device keeps the running sum unless
  ``offload_gradients``), steps torch's fused AdamW on the CPU, and copies the params back. Smaller params stay with
  an AdamW on the device. Clipping is DeepSpeed's in diffusion-pipe (the engine clips the device gradients before the
  optimizer step): here too, after torchao's copies home were queued, so the host updates do not see it.
- ``dp-recipe``: diffusion-pipe's 24 GB full fine-tune recipe, everything on the device: ``type = 'adamw8bitkahan'``
  with ``gradient_release = true``. As train.py builds it: one optimizer per param (betas to the power ``1 / N``
  with N micro-batches a step, ``foreach`` off where the class takes it, ``p.add_`` writing ``p.data``), each stepped
  and zeroed in its param's post-accumulate-grad hook, so every micro-batch steps every param and nothing clips.
  AdamW8bitKahan is diffusion-pipe's own class (its ``optimizers/adamw_8bit.py``, from ``--dp_checkout`` or
  DGLS_DIFFUSION_PIPE). Its ``update_step`` reads the config keys ``percentile_clipping`` and ``block_wise``, which
  bitsandbytes 0.50 dropped (KeyError 'percentile_clipping'); where its first step fails so, it runs as a subclass
  whose ``get_config`` restores them at the values bitsandbytes had by default before (100: no percentile clipping;
  blockwise, the only 8-bit update 0.50 has), and the row says so. Without a checkout, or if that fails too,
  bitsandbytes' own AdamW8bit (the same blockwise 8-bit moments, no Kahan summation of the bf16 weights and no
  buffer for it) runs instead, and the row says so.

A method that cannot run here raises :class:`Skip` with the reason (a library missing, no CUDA): its row says it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from utils.dgls.memory.transport import Direction
from utils.dgls.watching.listener import Listener


class Skip(Exception):
    """A method that cannot run on this machine: the row's ``skipped`` reason."""


def require(module: str, package: str, what: str) -> None:
    """Skip unless ``module`` imports (``what`` needs it; ``package``: what pip installs)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise Skip(f"{what} needs {package}, which is not installed here ({exc}): pip install {package}") from None


def forward_backward(bench, scale: float = 1.0) -> None:
    """One micro-batch: the layers (checkpointed as the bench says), the loss times ``scale``, its backward."""
    h = bench.inputs
    for i, layer in enumerate(bench.layers):
        h = checkpoint(layer, h, use_reentrant=False) if i in bench.checkpointed else layer(h)
    (F.mse_loss(h.float(), bench.target.float()) * scale).backward()


def host_pinned_bytes(device: torch.device) -> int:
    """Page-locked bytes torch's caching host allocator holds (``pin_memory`` tensors: torchao's host copies,
    DeepSpeed's buffers; its cached free blocks included, since they stay page-locked); 0 off CUDA."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return 0
    try:
        stats = torch.cuda.host_memory_stats()
    except RuntimeError:  # a torch without the caching host allocator's statistics
        return 0
    return int(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)))


class CopyCounter(Listener):
    """Bytes the DGLS transport copied, per direction, since the last :meth:`take`."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def copied(self, copy) -> None:
        self.bytes[copy.direction.value] = self.bytes.get(copy.direction.value, 0) + copy.nbytes

    def take(self) -> dict[str, int]:
        taken, self.bytes = self.bytes, {}
        return taken


WEIGHTS_IN, GRADS_HOME = Direction.WEIGHTS_IN.value, Direction.GRADS_HOME.value


# ---------------------------------------------------------------- torchao's CPU offload optimizer
def cpu_offload_class():
    """torchao's CPUOffloadOptimizer (diffusion-pipe imports it from ``torchao.prototype.low_bit_optim``, which newer
    torchao releases moved to ``torchao.optim``)."""
    require("torchao", "torchao", "torchao-offload (diffusion-pipe's 'offload' optimizer type)")
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            return importlib.import_module(module).CPUOffloadOptimizer
        except (ImportError, AttributeError):
            continue
    raise Skip("this torchao has no CPUOffloadOptimizer (neither torchao.optim nor torchao.prototype.low_bit_optim)")


def train_py_param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """train.py's groups for an optimizer without gradient_release: 1-D params without weight decay."""
    decayed = [p for p in params if p.ndim != 1]
    plain = [p for p in params if p.ndim == 1]
    groups = [{"params": decayed, "weight_decay": weight_decay}] if decayed else []
    return groups + ([{"params": plain, "weight_decay": 0.0}] if plain else [])


def torchao_offload_step(
    bench, device: torch.device, clip: float, accumulation: int, offload_gradients: bool, hyper: dict
) -> tuple[Callable[[], None], dict, Callable[[], dict]]:
    """The step of diffusion-pipe's 'offload' optimizer type over ``bench``'s layers (on ``device``), ``accumulation``
    micro-batches a step; returns the step, the row's fixed figures and a function giving the bytes copied since its
    last call."""
    klass = cpu_offload_class()
    if device.type != "cuda":
        raise Skip("torchao's CPUOffloadOptimizer runs on CUDA (or XPU) only: no CUDA device here")
    if offload_gradients and accumulation > 1:
        raise Skip("torchao: offload_gradients is not compatible with gradient accumulation (its docstring)")
    params = [p for layer in bench.layers for p in layer.parameters() if p.requires_grad]
    groups = train_py_param_groups(params, hyper["weight_decay"])
    kwargs = {"lr": hyper["lr"], "betas": hyper["betas"], "eps": hyper["eps"], "fused": True}
    optimizer = klass(groups, torch.optim.AdamW, offload_gradients=offload_gradients, **kwargs)
    offloaded = list(optimizer.param_d2h_map)
    copied = {"grads home": 0, "params in": 0}

    def counted(p: torch.Tensor) -> None:  # after torchao's own hook (registered first): its copy home
        copied["grads home"] += p.numel() * p.element_size()

    for p in offloaded:
        p.register_post_accumulate_grad_hook(counted)
    offloaded_bytes = sum(p.numel() * p.element_size() for p in offloaded)

    def step() -> None:
        for _ in range(accumulation):
            forward_backward(bench, 1.0 / accumulation)
        if clip:  # as DeepSpeed's engine in diffusion-pipe: the device gradients, after the copies home
            torch.cuda.current_stream().wait_stream(optimizer.stream)  # (no race with the copies reading them)
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        copied["params in"] += offloaded_bytes

    def take() -> dict:
        taken = dict(copied)
        copied.update({k: 0 for k in copied})
        return taken

    figures = {
        "optimizer": f"{klass.__module__}.{klass.__name__}(torch.optim.AdamW, fused=True, "
        f"offload_gradients={offload_gradients}) over the {describe_dtype(params)} params (no fp32 masters)",
        "offloaded_params_b": sum(p.numel() for p in offloaded) / 1e9,
        "clipping": "on the device gradients after their copies home (as DeepSpeed in diffusion-pipe: the host "
        "updates are not clipped)"
        if clip
        else "none",
    }
    return step, figures, take


def describe_dtype(params: list[torch.Tensor]) -> str:
    return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))


# ---------------------------------------------------------------- diffusion-pipe's 24 GB recipe
def kahan_class(checkout: str | None):
    """diffusion-pipe's AdamW8bitKahan from ``checkout`` (or DGLS_DIFFUSION_PIPE); None, with why, without one."""
    checkout = checkout or os.environ.get("DGLS_DIFFUSION_PIPE")
    if not checkout or not (Path(checkout) / "optimizers" / "adamw_8bit.py").is_file():
        return None, "no diffusion-pipe checkout (--dp_checkout or DGLS_DIFFUSION_PIPE) to take AdamW8bitKahan from"
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    try:
        return importlib.import_module("optimizers.adamw_8bit").AdamW8bitKahan, ""
    except Exception as exc:  # noqa: BLE001 - any failure to import is a fallback with its reason
        return None, f"diffusion-pipe's optimizers/adamw_8bit.py did not import ({type(exc).__name__}: {exc})"


def bnb_050_compatible(klass):
    """``klass`` (AdamW8bitKahan) with the config keys bitsandbytes 0.50 dropped, at their old defaults."""

    class Compatible(klass):
        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            config.setdefault("percentile_clipping", 100)  # 100: no percentile clipping (the old default)
            config.setdefault("block_wise", True)  # the old default, and 0.50's only 8-bit update
            return config

    Compatible.__name__ = Compatible.__qualname__ = f"{klass.__name__}(bitsandbytes 0.50 config keys restored)"
    return Compatible


def _first_step_fails(klass, device: torch.device, dtype: torch.dtype, kwargs: dict) -> str:
    """Why one step of ``klass`` on a small param fails (bitsandbytes >= 0.50: KeyError 'percentile_clipping'), or
    ''. The param has 4096 elements: bitsandbytes' smallest with 8-bit state."""
    p = torch.nn.Parameter(torch.zeros(4096, device=device, dtype=dtype))
    p.grad = torch.ones_like(p)
    try:
        klass([p], **kwargs).step()
    except Exception as exc:  # noqa: BLE001 - the reason is the row's note
        return f"{type(exc).__name__}: {exc}"
    return ""


def dp_recipe_step(
    bench, device: torch.device, accumulation: int, checkout: str | None, hyper: dict
) -> tuple[Callable[[], None], dict]:
    """diffusion-pipe's adamw8bitkahan + gradient_release over ``bench``'s layers (on ``device``, in their dtype):
    the step and the row's figures."""
    require("bitsandbytes", "bitsandbytes", "dp-recipe (adamw8bitkahan, and its fallback AdamW8bit)")
    import bitsandbytes

    params = [p for layer in bench.layers for p in layer.parameters() if p.requires_grad]
    # train.py's gradient_release: betas (and momentum) scaled so that a step per micro-batch decays as one a step
    kwargs = {
        "lr": hyper["lr"],
        "betas": tuple(b ** (1 / accumulation) for b in hyper["betas"]),
        "eps": hyper["eps"],
        "weight_decay": hyper["weight_decay"],
    }
    klass, why = kahan_class(checkout)
    note = "diffusion-pipe's optimizers.adamw_8bit.AdamW8bitKahan, gradient_release"
    if klass is not None:
        failed = _first_step_fails(klass, device, params[0].dtype, kwargs)
        if failed:
            compatible = bnb_050_compatible(klass)
            why = f"AdamW8bitKahan fails its first step with bitsandbytes {bitsandbytes.__version__} ({failed})"
            if not _first_step_fails(compatible, device, params[0].dtype, kwargs):
                klass = compatible
                note += f" ({why}: run with percentile_clipping = 100 and block_wise = True, the keys' old defaults)"
            else:
                klass = None
    if klass is None:
        klass = bitsandbytes.optim.AdamW8bit
        note = f"bitsandbytes.optim.AdamW8bit, gradient_release (fallback from adamw8bitkahan: {why})"
    if "foreach" in inspect.signature(klass).parameters:
        kwargs["foreach"] = False

    def add_(self, *args, **kw):  # train.py: in-place updates that autograd's version counters do not see
        self.data.add_(*args, **kw)

    optimizers = {}
    for p in params:
        p.add_ = add_.__get__(p)
        optimizers[p] = klass([p], **kwargs)

    def hook(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def step() -> None:  # every micro-batch's backward steps every param; the trainer's step() is a no-op
        for _ in range(accumulation):
            forward_backward(bench, 1.0 / accumulation)

    figures = {
        "optimizer": f"{note}, over the {describe_dtype(params)} params (no fp32 masters)",
        "optimizer_steps_per_step": accumulation,
        "clipping": "none (gradient_release: each param steps in its gradient hook)",
    }
    return step, figures
