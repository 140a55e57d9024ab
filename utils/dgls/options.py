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
    Option("verbose", bool, False, "print swap stats every step", "tuning"),
)

OPTION_BY_NAME = {o.name: o for o in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option as a flag whose default is None, so given flags can be told apart."""
    group = parser.add_argument_group("DGLS")
    for o in OPTIONS:
        if o.kind is bool:
            group.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=None, help=o.meaning)
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
    )
    return SwapConfig(**{k: values[k] for k in keys})


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
