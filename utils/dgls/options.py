"""The DGLS settings users can give: one table drives the CLI flags, the ``[dgls]`` TOML keys
and the README's flag table, so the three cannot drift apart."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from .config import SwapConfig
from .errors import DGLSUserError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 0,1,40, got {text!r}") from None


def _budget(text: str) -> float | str:
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None


def _choice(*names: str):
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
        return text

    parse.__name__ = "/".join(names)
    return parse


SYNC_MODES = _choice("none", "step", "layer")
AUTOCAST_MODES = _choice("fp32", "fp16", "bf16", "f8_e4m3", "f8_e5m2")
MIXED_PRECISION_MODES = _choice("auto", "f32", "bf16", "f16")


def _cast_pairs(value: Any) -> list[list[str]]:
    """TOML form of ``cast_target``: one [FROM, TO] pair or a list of them (the CLI repeats the flag)."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(x, str) for x in value):
        return [value]
    return value


@dataclass(frozen=True)
class Option:
    name: str
    kind: Any  # int, float, bool, or a parser function
    default: Any
    meaning: str
    when: str

    @property
    def flag(self) -> str:
        return f"--{self.name}"


OPTIONS: tuple[Option, ...] = (
    Option(
        "dynamic_swapping",
        bool,
        True,
        "stream layers with DGLS; off runs the trainer unchanged",
        "turn off to compare against the plain trainer",
    ),
    Option("gpu_id", int, 0, "CUDA device index DGLS places layers on", "multi-GPU machines"),
    Option(
        "initial_gpu_layers",
        int,
        None,
        "keep the first N layers resident (default 1)",
        "more VRAM left over: keep more of the ends resident",
    ),
    Option("final_gpu_layers", int, None, "keep the last N layers resident (default 1)", "as above"),
    Option(
        "gpu_layers",
        _int_list,
        None,
        "explicit comma-separated list of resident layer indices",
        "full control over placement",
    ),
    Option(
        "blocks_to_swap",
        int,
        None,
        "stream this many layers; the rest stay resident, split between both ends",
        "the knob kohya and diffusion-pipe users know",
    ),
    Option(
        "prefetch",
        int,
        2,
        "how many streamed layers ahead to copy; the pool holds prefetch+1 layers",
        "raise if compute waits on copies and VRAM allows; 0 copies on demand",
    ),
    Option(
        "threading",
        bool,
        False,
        "issue copies (and stage pageable memory) from a background thread",
        "pageable fallback in use; see Performance for measurements",
    ),
    Option(
        "batch_move",
        bool,
        False,
        "issue the copies of several upcoming layers as one batch",
        "see Performance for measurements",
    ),
    Option("cuda_streams", int, 1, "number of copy streams, used round-robin", "one stream saturates PCIe"),
    Option(
        "selective_packing",
        float,
        0.0,
        "layers smaller than this many MB are copied param by param instead of as one packed block",
        "leave at 0 (pack everything) unless measuring",
    ),
    Option(
        "event_sync",
        bool,
        True,
        "order copies with CUDA events; off makes the host wait for every copy",
        "turn off only to debug a suspected ordering problem",
    ),
    Option(
        "pinned_ram_budget_gb",
        float,
        None,
        "most host RAM to page-lock (default: available RAM less a reserve)",
        "WSL, or machines shared with other jobs",
    ),
    Option(
        "vram_budget",
        _budget,
        None,
        "GiB of VRAM DGLS may use, or `auto` (free VRAM less 1 GiB): it picks which layers stay resident "
        "and the prefetch depth from a probe of the first steps",
        "you don't want to guess blocks_to_swap; explicit placement flags override it",
    ),
    Option(
        "plan",
        bool,
        False,
        "with vram_budget: run the 2 probe steps, print the predicted plan and its runners-up, "
        "and exit without saving anything",
        "see what fits before a long run",
    ),
    Option(
        "device_sync_mode",
        SYNC_MODES,
        "none",
        "where the host waits for the GPU: none (CUDA events only), step (once per step), layer (after every copy, "
        "= --no-event_sync)",
        "step: exact step timings and errors reported at the step that caused them; layer: debugging",
    ),
    Option(
        "sync_only_on_resume",
        bool,
        False,
        "accepted for compatibility: DGLS already synchronises only where correctness needs it (loading a "
        "checkpoint into the host masters, evicting before sampling)",
        "never needed",
    ),
    Option(
        "async_zero_grad",
        bool,
        False,
        "accepted for compatibility: trainable (LoRA) params are always resident and the trainer frees their "
        "gradients (set to None), so there is no zeroing to overlap",
        "never needed",
    ),
    Option(
        "lazy_lora_steps",
        int,
        1,
        "apply the optimizer every N micro-batches, with gradients accumulated in between (multiplies "
        "gradient_accumulation_steps by N)",
        "larger effective batch at the same VRAM; the streamed bytes per optimizer step grow N-fold",
    ),
    Option(
        "compile",
        bool,
        False,
        "torch.compile the forward of resident layers (streamed layers stay eager: their weights move)",
        "many layers resident and a working compiler toolchain",
    ),
    Option(
        "cast_target",
        _cast_pairs,
        None,
        "FROM TO (f32, bf16, f16, f8_e4m3, f8_e5m2): store streamed frozen params of dtype FROM as TO; an fp8 TO "
        "is copied as fp8 and upcast to FROM on the GPU just before use; repeat the flag for more pairs",
        "copies limit the step (PCIe gen3/4, pageable memory, little RAM): fp8 halves the bytes",
    ),
    Option(
        "cast_norms",
        bool,
        False,
        "let cast_target cast norm layers too (they are left alone by default)",
        "rarely: norm weights are tiny",
    ),
    Option(
        "autocast",
        AUTOCAST_MODES,
        None,
        "run every layer's forward under torch.autocast with this dtype; fp8 modes are refused (torch.autocast "
        "has no fp8 compute) with the cast_target alternative",
        "the trainer does not autocast itself (diffusion-pipe does)",
    ),
    Option(
        "mixed_precision",
        MIXED_PRECISION_MODES,
        "auto",
        "dtype of the trainable params (auto: leave them); DGLS's gradient clipping is one global norm in "
        "float32 over params of any dtype",
        "force float32 LoRA params under a bf16 model",
    ),
    Option(
        "profile",
        str,
        None,
        "write a Chrome-trace JSON (and a PNG timeline if matplotlib is installed) of per-layer copies and compute "
        "for a few steps after warm-up to this path",
        "see where compute waits on copies",
    ),
    Option("verbose", bool, False, "print swap stats every step, and a windowed summary with ETA", "tuning"),
    Option("verbose_every", int, 10, "steps per windowed summary under --verbose", "long runs"),
)

# Flags that have nothing left to do in this design: start-up says what they map to.
COMPATIBILITY_ONLY = ("sync_only_on_resume", "async_zero_grad")

OPTION_BY_NAME = {o.name: o for o in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option as a flag whose default is None, so given flags can be told apart."""
    group = parser.add_argument_group("DGLS")
    for o in OPTIONS:
        if o.kind is bool:
            group.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=None, help=o.meaning)
        elif o.kind is _cast_pairs:
            group.add_argument(o.flag, nargs=2, action="append", metavar=("FROM", "TO"), default=None, help=o.meaning)
        else:
            group.add_argument(o.flag, type=o.kind, default=None, help=o.meaning)


def _coerce(option: Option, value: Any) -> Any:
    if option.kind is bool:
        if not isinstance(value, bool):
            raise DGLSUserError(f"[dgls] {option.name} must be true or false, got {value!r}")
        return value
    if option.kind is _int_list:
        if isinstance(value, str):
            return _int_list(value)
        if not isinstance(value, list):
            raise DGLSUserError(f"[dgls] {option.name} must be a list of layer indices, got {value!r}")
        return value
    if option.kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if option.kind is _cast_pairs:
        return value  # SwapConfig validates the pairs
    if option.kind in (_budget, SYNC_MODES, AUTOCAST_MODES, MIXED_PRECISION_MODES):
        try:
            return option.kind(value if isinstance(value, str) else str(value))
        except argparse.ArgumentTypeError as exc:
            raise DGLSUserError(f"[dgls] {option.name}: {exc}") from None
    if not isinstance(value, option.kind) or isinstance(value, bool):
        raise DGLSUserError(f"[dgls] {option.name} must be {option.kind.__name__}, got {value!r}")
    return value


def resolve(table: dict[str, Any] | None, cli: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the TOML ``[dgls]`` table, then the command line."""
    values = {o.name: o.default for o in OPTIONS}
    for key, value in (table or {}).items():
        if key not in OPTION_BY_NAME:
            known = ", ".join(sorted(OPTION_BY_NAME))
            raise DGLSUserError(f"unknown [dgls] key '{key}' (known keys: {known})")
        values[key] = _coerce(OPTION_BY_NAME[key], value)
    for o in OPTIONS:
        given = getattr(cli, o.name, None)
        if given is not None:
            values[o.name] = given
    return values


def swap_config(values: dict[str, Any]) -> SwapConfig:
    """The engine settings from resolved option values."""
    keys = (
        "initial_gpu_layers",
        "final_gpu_layers",
        "gpu_layers",
        "blocks_to_swap",
        "prefetch",
        "threading",
        "batch_move",
        "cuda_streams",
        "selective_packing",
        "event_sync",
        "pinned_ram_budget_gb",
        "verbose",
        "cast_target",
        "cast_norms",
        "autocast",
        "mixed_precision",
        "verbose_every",
    )
    config = {k: values[k] for k in keys}
    config["profile_path"] = values["profile"]
    config["vram_budget_gb"] = values["vram_budget"]
    config["plan_only"] = values["plan"]
    config["event_sync"] = values["event_sync"] and values["device_sync_mode"] != "layer"
    config["sync_each_step"] = values["device_sync_mode"] == "step"
    config["compile_resident"] = values["compile"]
    return SwapConfig(**config)


def startup_notes(values: dict[str, Any]) -> list[str]:
    """What the compatibility-only flags map to, and other settings worth a line at start-up."""
    notes = []
    for name in COMPATIBILITY_ONLY:
        if values[name]:
            notes.append(f"DGLS: --{name} has nothing to do here: {OPTION_BY_NAME[name].meaning.split(': ', 1)[1]}")
    if values["lazy_lora_steps"] < 1:
        raise DGLSUserError(f"lazy_lora_steps must be a whole number >= 1, got {values['lazy_lora_steps']}")
    if values["plan"] and values["vram_budget"] is None:
        raise DGLSUserError("--plan needs --vram_budget (a number of GiB, or auto)")
    return notes


def markdown_table() -> str:
    """The README's flag table."""
    rows = ["| flag / `[dgls]` key | default | meaning | when to use |", "|---|---|---|---|"]
    for o in OPTIONS:
        default = (
            {True: "on", False: "off", None: "-"}.get(o.default, o.default)
            if not isinstance(o.default, (int, float)) or isinstance(o.default, bool)
            else o.default
        )
        rows.append(f"| `{o.flag}` | {default} | {o.meaning} | {o.when} |")
    return "\n".join(rows)
