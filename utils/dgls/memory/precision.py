"""Precision: dtype names, which frozen params ``cast_target`` casts, fp8 scaling, autocast.

Rules for ``cast_target FROM TO`` (applied at start-up to every layer, wherever it lives, so that
placement never changes the numbers):

- a frozen param whose dtype is FROM is cast to TO; trainable params (``requires_grad``)
  never are, and params of norm layers (``LayerNorm``, ``RMSNorm``, ``GroupNorm``, any class
  whose name contains ``Norm``) only with ``cast_norms``;
- each param is cast once, by the pair whose FROM is its dtype (pairs do not chain);
- TO of 16 or 32 bits: the param becomes TO (its host master, its slot and its visible dtype);
- TO of 8 bits (fp8): only storage and transfer are fp8. The param keeps FROM as its visible
  (compute) dtype; the host master holds fp8 bytes plus fp32 scales, and the device upcasts
  them just before use. Scales are per output row for weights of 2 or more dims (so small rows
  keep their precision) and per tensor for 1-D params; they stay on the device (4 bytes a row).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import DGLSUserError

if TYPE_CHECKING:  # config.py imports this module's validators
    from ..streaming.config import ComputePolicy

# Name -> dtype; the float8 dtypes exist from torch 2.1, looked up by name so older torch only loses them.
_DTYPES: dict[str, str] = {
    "f32": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "f8_e4m3": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
}
CAST_NAMES = ("f32", "bf16", "f16", "f8_e4m3", "f8_e5m2")
AUTOCAST_NAMES = ("fp32", "fp16", "bf16", "f8_e4m3", "f8_e5m2")
MIXED_PRECISION_NAMES = ("auto", "f32", "bf16", "f16")
_CANONICAL = {"fp32": "f32", "fp16": "f16"}
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def canonical(name: str) -> str:
    """'fp32' -> 'f32', 'fp16' -> 'f16'; other names unchanged."""
    return _CANONICAL.get(name, name)


def dtype_of(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype of a DGLS dtype name; a clear error for unknown names or a torch without fp8."""
    if name not in _DTYPES:
        raise DGLSUserError(f"{what}: unknown dtype {name!r}; use one of {', '.join(CAST_NAMES)}")
    dtype = getattr(torch, _DTYPES[name], None)
    if dtype is None:
        raise DGLSUserError(
            f"{what}: this torch ({torch.__version__}) has no {_DTYPES[name]}; upgrade torch to 2.1 or newer "
            "or drop the fp8 setting"
        )
    return dtype


def name_of(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16' (for messages)."""
    torch_name = str(dtype).removeprefix("torch.")
    return next((k for k in CAST_NAMES if _DTYPES[k] == torch_name), torch_name)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES) or "Norm" in type(module).__name__


def validate_cast_target(pairs) -> list[tuple[str, str]]:
    """Normalise ``cast_target`` to a list of (FROM, TO) names, or raise saying what to change."""
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, (list, tuple)):
        raise DGLSUserError(
            f"cast_target must be a list of [FROM, TO] pairs such as [['bf16', 'f8_e4m3']], got {pairs!r}"
        )
    out: list[tuple[str, str]] = []
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise DGLSUserError(f"cast_target entries are [FROM, TO] pairs such as ['bf16', 'f8_e4m3'], got {pair!r}")
        source, target = (canonical(str(x)) for x in pair)
        src_dtype, dst_dtype = dtype_of(source, "cast_target"), dtype_of(target, "cast_target")
        if source == target:
            raise DGLSUserError(f"cast_target {source} {target} casts a dtype to itself: drop that pair")
        if is_fp8(dst_dtype) and is_fp8(src_dtype):
            raise DGLSUserError(
                f"cast_target {source} {target}: fp8 storage needs a 16- or 32-bit FROM dtype to compute in"
            )
        if any(s == source for s, _ in out):
            raise DGLSUserError(f"cast_target names FROM {source} twice: keep one pair per FROM dtype")
        out.append((source, target))
    return out


def validate_autocast(name):
    """Normalise ``autocast``; fp8 compute is refused: torch.autocast has no fp8."""
    if name is None:
        return None
    if name not in AUTOCAST_NAMES + ("f32", "f16"):
        usable = ", ".join(n for n in AUTOCAST_NAMES if not n.startswith("f8"))
        raise DGLSUserError(f"autocast must be one of {usable}, got {name!r}")
    if name.startswith("f8"):
        raise DGLSUserError(
            f"autocast {name} is not supported (torch.autocast has no fp8 compute); for fp8 weights use "
            f"cast_target bf16 {name} (fp8 storage and transfer) with autocast bf16"
        )
    return canonical(name)


def validate_mixed_precision(name) -> str:
    if canonical(str(name)) not in MIXED_PRECISION_NAMES:
        raise DGLSUserError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION_NAMES)}, got {name!r}")
    return canonical(str(name))


# ---------------------------------------------------------------- which params are cast
@dataclass(frozen=True)
class ParamCast:
    """How one frozen param is kept: ``dtype`` is what the layer computes with, ``stored`` what is kept and copied."""

    dtype: torch.dtype
    stored: torch.dtype

    @property
    def scaled(self) -> bool:
        """Stored as fp8 with scales, upcast on the device."""
        return is_fp8(self.stored) and self.stored != self.dtype


@dataclass(frozen=True)
class CastRules:
    """The ``cast_target`` pairs as dtypes, and whether norm layers are included."""

    pairs: tuple[tuple[torch.dtype, torch.dtype], ...]
    cast_norms: bool = False

    @classmethod
    def from_policy(cls, policy: ComputePolicy) -> CastRules | None:
        """The rules of a compute policy's ``cast_target`` and ``cast_norms``; None: nothing is cast."""
        if not policy.cast_target:
            return None
        pairs = tuple((dtype_of(a), dtype_of(b)) for a, b in policy.cast_target)
        return cls(pairs, bool(policy.cast_norms))

    def plan(self, layer: nn.Module) -> dict[int, ParamCast]:
        """``id(param) -> ParamCast`` for the frozen params of ``layer`` that these rules cast."""
        mapping = dict(self.pairs)
        skipped: set[int] = set()
        if not self.cast_norms:
            for module in layer.modules():
                if is_norm(module):
                    skipped.update(id(p) for p in module.parameters(recurse=False))
        casts: dict[int, ParamCast] = {}
        for p in layer.parameters():
            if p.requires_grad or id(p) in skipped or p.dtype not in mapping or p.numel() == 0:
                continue
            target = mapping[p.dtype]
            casts[id(p)] = ParamCast(p.dtype, target) if is_fp8(target) else ParamCast(target, target)
        return casts


def scale_count(shape: torch.Size) -> int:
    """Number of fp32 scales of an fp8-stored param: one per output row, one for 1-D params."""
    return shape[0] if len(shape) >= 2 else 1


# ---------------------------------------------------------------- fp8 scaling
def quantize(tensor: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and fp32 scales with ``tensor ~= fp8_values * scale`` (per row for >= 2-D, else per tensor).

    The scale maps each row's largest magnitude to the format's largest value, so small rows
    keep fp8's full relative precision instead of underflowing. All-zero rows get scale 1.
    """
    x = tensor.detach().float()
    rows = x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)
    amax = rows.abs().amax(dim=1) if rows.numel() else torch.zeros(rows.shape[0], device=x.device)
    scale = torch.where(amax > 0, amax / torch.finfo(fp8).max, torch.ones_like(amax))
    limit = torch.finfo(fp8).max
    q = (rows / scale[:, None]).clamp_(-limit, limit).to(fp8)
    return q.reshape(tensor.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
    """``q * scale`` rounded once to ``dtype``; written into ``out`` when given.

    Two kernels and no temporary: fp8 -> ``dtype`` is exact (every fp8 value is a bf16, f16
    and f32 value), and the in-place multiply by the fp32 scale computes in fp32 and rounds
    once, so this equals ``(q.float() * scale).to(dtype)`` bit for bit at 7 bytes of memory
    traffic per element (3x less than going through an fp32 copy).
    """
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    out.copy_(q)
    rows = out.view(out.shape[0], -1) if out.dim() >= 2 else out.view(1, -1)
    rows.mul_(scale[:, None])
    return out


def fake_quantize(tensor: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """What fp8 storage makes of ``tensor``, in its own dtype: the reference for tests and error figures."""
    q, scale = quantize(tensor, fp8)
    return dequantize(q, scale, tensor.dtype)


def check_device_support(device: torch.device, rules: CastRules | None) -> None:
    """Try each cast on a tiny tensor on ``device`` now, so an unsupported one fails before step 1."""
    if rules is None:
        return
    for source, target in rules.pairs:
        cast = ParamCast(source, target) if is_fp8(target) else ParamCast(target, target)
        try:
            x = torch.linspace(-1, 1, 64, dtype=torch.float32).reshape(4, 16).to(source)
            if cast.scaled:
                q, scale = quantize(x.to(device), target)
                back = dequantize(q.cpu().to(device), scale, source)
            else:
                back = x.to(target).to(device).to(torch.float32)
            err = (back.float().cpu() - x.float()).abs().max().item()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DGLSUserError(
                f"cast_target {name_of(source)} {name_of(target)} does not run on {device} with torch "
                f"{torch.__version__} ({reason}): drop that pair or upgrade torch"
            ) from exc
        if not err <= 0.1:
            raise DGLSUserError(
                f"cast_target {name_of(source)} {name_of(target)} gives wrong values on {device} "
                f"(error {err:.3g} on a test tensor): drop that pair"
            )


# ---------------------------------------------------------------- compute and trainable dtypes
def autocast_context(device: torch.device, name: str | None) -> AbstractContextManager | None:
    """A fresh autocast context for one layer's forward; 'f32' turns autocast off inside the layer."""
    if name is None:
        return None
    if name == "f32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype_of(name, "autocast"))


def cast_trainable(layers: Iterable[nn.Module], mixed_precision: str) -> int:
    """Cast the trainable params (and any grads) to the ``mixed_precision`` dtype; return how many changed."""
    if mixed_precision == "auto":
        return 0
    dtype = dtype_of(mixed_precision, "mixed_precision")
    changed, seen = 0, set()
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                if not p.requires_grad or id(p) in seen or p.dtype == dtype:
                    continue
                seen.add(id(p))
                p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = p.grad.to(dtype)
                changed += 1
    return changed


def describe(rules: CastRules | None, autocast: str | None, mixed_precision: str, trainable_cast: int) -> str:
    """One start-up line saying which precisions run."""
    parts = []
    if rules:
        pairs = []
        for source, target in rules.pairs:
            if is_fp8(target):
                pairs.append(
                    f"{name_of(source)}->{name_of(target)} (stored and copied as fp8 with per-row scales, upcast to "
                    f"{name_of(source)} on the device)"
                )
            else:
                pairs.append(f"{name_of(source)}->{name_of(target)}")
        norms = "norm layers included" if rules.cast_norms else "norm layers and trainable params kept"
        parts.append(f"streamed frozen weights {', '.join(pairs)}; {norms}")
    if autocast:
        parts.append("layer compute: autocast off" if autocast == "f32" else f"layer compute: autocast {autocast}")
    if mixed_precision != "auto":
        parts.append(f"trainable params {mixed_precision} ({trainable_cast} cast)")
    return "DGLS precision: " + ("; ".join(parts) if parts else "unchanged")
