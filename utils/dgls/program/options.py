"""The DGLS settings users can give: one table drives the CLI flags, the ``[dgls]`` TOML keys,
``--help`` and the README's flag table, so they cannot drift apart.

Values come from the defaults, then the TOML's ``[dgls]`` table, then the command line. A
placement style given on the command line (``gpu_layers``, ``blocks_to_swap``,
``initial_gpu_layers``/``final_gpu_layers`` or ``vram_budget``) replaces the TOML's keys of
the other styles, so ``--blocks_to_swap 3`` works with a TOML that keeps the ends resident;
two styles from one place are a conflict, reported with where each value came from.

Each row names the :class:`..streaming.config.SwapConfig` policy holding a field of the option's own name
(:func:`swap_config` fills it; no setting is renamed on the way), so a new engine flag is one row
here and one policy field in :mod:`..streaming.config`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ..errors import DGLSUserError
from ..spelling import did_you_mean
from ..streaming.config import CLIP_MODES, SHARE_MODES, SYNC_MODES, SwapConfig, policy_types
from ..training.host_optimizer import IMPLEMENTATIONS

AUTOCAST_MODES = ("fp32", "fp16", "bf16")
# Names --autocast takes only to refuse them with what to do instead (ComputePolicy: fp8 storage, bf16 compute).
AUTOCAST_REFUSED = ("f8_e4m3", "f8_e5m2")
MIXED_PRECISION_MODES = ("auto", "f32", "bf16", "f16")

COMMAND_LINE = "command line"


def parse_int_list(text: str) -> list[int]:
    """'0,1, 40' -> [0, 1, 40]; ValueError on anything else."""
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def _cli_int_list(text: str) -> list[int]:
    try:
        return parse_int_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 0,1,40, got {text!r}") from None


def _cli_budget(text: str) -> float | str:
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None


def _cli_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _cli_choice(option: Option):
    """The value of a choice flag that also takes ``option.refused`` names (the option's policy refuses them with
    what to do instead); --help lists only the choices."""

    def parse(text: str) -> str:
        if text in option.choices or text in option.refused:
            return text
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(option.choices)})")

    return parse


def _cli_path(text: str) -> str:
    """A path flag's value: an empty one (``--profile ""``, or a shell variable that was not set) names no file."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path such as trace.json, got ''")
    return text


def _cli_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


@dataclass(frozen=True)
class Option:
    """One setting users give, as a flag and a ``[dgls]`` key of the same name.

    - ``policy``: the :class:`..streaming.config.SwapConfig` policy with a field of this name, which
      :func:`swap_config` fills; None for a setting of the run around the engine (it is read from
      :attr:`Resolved.values` by the start-up checks and the trainer integration). Every row states it.
    """

    name: str
    kind: str  # bool | int | float | str | budget | int_list | cast_pairs | choice
    default: Any
    meaning: str
    when: str
    group: str
    choices: tuple[str, ...] = ()
    shown: str | None = None  # the default as --help and the README show it, where None means something
    refused: tuple[str, ...] = ()  # values taken only so that the policy refuses them with the alternative
    policy: str | None = field(kw_only=True)

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return "-"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)


GROUPS = {
    "placement": "which layers stay resident: one style of gpu_layers, blocks_to_swap, initial/final_gpu_layers, "
    "vram_budget; a style given here replaces the TOML's",
    "streaming": "how streamed layers are copied",
    "precision": "dtypes of streamed weights and compute",
    "training": "training loop",
    "output": "what the run prints and writes",
}

OPTIONS: tuple[Option, ...] = (
    Option(
        "dynamic_swapping",
        "bool",
        True,
        "stream layers with DGLS; off runs the trainer unchanged",
        "turn off to compare against the plain trainer",
        "placement",
        policy=None,
    ),
    Option(
        "gpu_id",
        "int",
        0,
        "CUDA device index to train on, in a one-process run (the deepspeed launcher picks GPUs itself)",
        "multi-GPU machines",
        "placement",
        policy=None,
    ),
    Option(
        "initial_gpu_layers",
        "int",
        None,
        "keep the first N layers resident (default 1)",
        "more VRAM left over: keep more of the ends resident",
        "placement",
        policy="placement",
    ),
    Option(
        "final_gpu_layers",
        "int",
        None,
        "keep the last N layers resident (default 1)",
        "as above",
        "placement",
        policy="placement",
    ),
    Option(
        "gpu_layers",
        "int_list",
        None,
        "explicit comma-separated list of resident layer indices (of the whole layer list, also with pipeline stages)",
        "full control over placement",
        "placement",
        policy="placement",
    ),
    Option(
        "blocks_to_swap",
        "int",
        None,
        "stream this many layers; the rest stay resident, split between both ends",
        "the knob kohya and diffusion-pipe users know",
        "placement",
        policy="placement",
    ),
    Option(
        "vram_budget",
        "budget",
        None,
        "GiB of VRAM DGLS may use on each GPU, or `auto` (free VRAM less 1 GiB): it picks which layers stay "
        "resident and the prefetch depth from a probe of the first steps (a full fine-tune: of step 1, the plan "
        "then fixed for the run)",
        "you don't want to guess blocks_to_swap",
        "placement",
        policy="placement",
    ),
    Option(
        "plan",
        "bool",
        False,
        "with vram_budget: run the 2 probe steps (1 for a full fine-tune), print the predicted plan and its "
        "runners-up, and exit without saving anything",
        "see what fits before a long run",
        "placement",
        policy="placement",
    ),
    Option(
        "prefetch",
        "int",
        2,
        "how many streamed layers ahead to copy; the pool holds prefetch+1 layers",
        "raise if compute waits on copies and VRAM allows; 0 copies on demand",
        "streaming",
        policy="placement",
    ),
    Option(
        "threading",
        "bool",
        False,
        "issue copies (and stage pageable memory) from a background thread",
        "pageable fallback in use; see Performance for measurements",
        "streaming",
        policy="transfer",
    ),
    Option(
        "offload_activations",
        "bool",
        None,
        "send the inputs that checkpointed layers keep for their recompute to host memory during the forward, "
        "and bring them back just before the recompute; on: all but those of the last --prefetch checkpointed "
        "layers, or with --vram_budget only as many as the budget needs; auto (unset): only with --vram_budget "
        "on CUDA, as many as it needs (maybe none); needs activation checkpointing",
        "activations, not weights, fill the card (long videos, large resolutions); --no-offload_activations "
        "keeps every activation on the device",
        "streaming",
        shown="auto",
        policy="activations",
    ),
    Option(
        "offload_recompute",
        "bool",
        False,
        "also send what each checkpointed layer's recompute saves for its backward (its attention's q, k, v, its "
        "norms' inputs, ...) to host memory, all but the last third of it, and bring each back just before the "
        "backward reads it; turns --offload_activations on; needs activation checkpointing",
        "one layer's backward fills the card (long videos) even with --offload_activations",
        "streaming",
        policy="activations",
    ),
    Option(
        "swap_unit_mb",
        "float",
        None,
        "stream layers larger than this many MB as several swap units, the child modules they run (a block's "
        "attention and its MLP), so each slot holds a smaller piece; 0 streams whole layers (default: whole, "
        "unless vram_budget needs smaller slots)",
        "the slots of large layers crowd a small card; a model whose layers read their children's weights "
        "themselves needs 0",
        "streaming",
        policy="placement",
    ),
    Option(
        "checkpoint_units",
        "bool",
        False,
        "run each layer's attention, MLP and modulation (its child modules at half its size, less bare Linears) "
        "under activation checkpoints of their own, so a layer's backward holds one of them at a time; each "
        "runs once more per step",
        "one layer's recompute fills the card (long videos) even with --offload_activations",
        "streaming",
        policy="activations",
    ),
    Option(
        "keep_piece_outputs",
        "bool",
        False,
        "with --checkpoint_units: send each piece's output from a checkpointed layer's forward to host memory with "
        "the layer's inputs, and let the layer's recompute take it instead of running the piece again, so "
        "--checkpoint_units costs no extra forward; their size in pinned host RAM (Wan-14B at 81 frames: about "
        "1 GB a block); turns --offload_activations on; needs activation checkpointing",
        "--checkpoint_units makes steps slower and host RAM has room",
        "streaming",
        policy="activations",
    ),
    Option(
        "batch_move",
        "bool",
        False,
        "issue the copies of several upcoming layers as one batch",
        "see Performance for measurements",
        "streaming",
        policy="transfer",
    ),
    Option(
        "cuda_streams",
        "int",
        1,
        "number of copy streams, used round-robin",
        "one stream saturates PCIe",
        "streaming",
        policy="transfer",
    ),
    Option(
        "selective_packing",
        "float",
        0.0,
        "layers smaller than this many MB are copied param by param instead of as one packed block",
        "leave at 0 (pack everything) unless measuring",
        "streaming",
        policy="transfer",
    ),
    Option(
        "event_sync",
        "bool",
        True,
        "order copies with CUDA events; off makes the host wait for every copy",
        "turn off only to debug a suspected ordering problem",
        "streaming",
        policy="transfer",
    ),
    Option(
        "device_sync_mode",
        "choice",
        "none",
        "where the host waits for the GPU: none (CUDA events only), step (once per step), layer (after every copy, "
        "= --no-event_sync)",
        "step: exact step timings and errors reported at the step that caused them; layer: debugging",
        "streaming",
        SYNC_MODES,
        policy="transfer",
    ),
    Option(
        "share_fetch",
        "choice",
        "auto",
        "data-parallel processes on one machine each copy 1/N of every streamed layer from host memory and gather the "
        "rest from the others' GPUs: auto where that gather (measured at start-up) is fast enough to pay (NVLink); "
        "every process must then run every forward (no forward on one process alone), and a VRAM budget's placement "
        "stays as it settled",
        "off: a forward on one process alone between steps; on: to measure",
        "streaming",
        SHARE_MODES,
        policy="transfer",
    ),
    Option(
        "pinned_ram_budget_gb",
        "float",
        None,
        "most host RAM to page-lock (default: available RAM less a reserve)",
        "WSL, or machines shared with other jobs",
        "streaming",
        policy="transfer",
    ),
    Option(
        "host_ram_budget",
        "budget",
        None,
        "GiB of host RAM for streamed layers, or `auto` (available RAM less a reserve): what does not fit stays in a "
        "file in --disk_dir: a full fine-tune's fp32 masters and optimizer state first (read for each update, written "
        "back after it; host updates: --host_adam torch_fused), then weights (read each time they stream, ahead of "
        "their turn as far as a ring of two staging buffers allows: those whose reads hide behind the longest compute; "
        "the start-up line says the disk floor against the step's compute, estimated; without --vram_budget a line "
        "after the second pass says it again with the compute measured)",
        "the model is larger than the RAM the machine can spare",
        "streaming",
        policy="transfer",
    ),
    Option(
        "disk_dir",
        "str",
        None,
        "directory on a local disk for the layers --host_ram_budget does not hold (an unnamed file, gone when the "
        "run ends); checked for room and writability at start-up",
        "the system temp directory is small, slow or RAM (tmpfs)",
        "streaming",
        shown="system temp",
        policy="transfer",
    ),
    Option(
        "compile",
        "bool",
        False,
        "torch.compile the forward of resident layers (streamed layers stay eager: their weights move)",
        "many layers resident and a working compiler toolchain",
        "streaming",
        policy="compute",
    ),
    Option(
        "cast_target",
        "cast_pairs",
        None,
        "FROM TO (f32, bf16, f16, f8_e4m3, f8_e5m2): store frozen params of dtype FROM as TO, in every layer (so "
        "placement never changes the numbers); an fp8 TO is kept and copied as fp8 with per-row scales and upcast to "
        "FROM on the GPU just before use; repeat the flag for more pairs",
        "copies limit the step (PCIe gen3/4, pageable memory, little RAM): fp8 halves the bytes",
        "precision",
        policy="compute",
    ),
    Option(
        "cast_norms",
        "bool",
        False,
        "let cast_target cast norm layers too (they are left alone by default)",
        "rarely: norm weights are tiny",
        "precision",
        policy="compute",
    ),
    Option(
        "autocast",
        "choice",
        None,
        "run every layer's forward under torch.autocast with this dtype: fp32, fp16 or bf16 (torch.autocast has "
        "no fp8 compute: for fp8 weights use cast_target bf16 f8_e4m3 with autocast bf16)",
        "the trainer does not autocast itself (diffusion-pipe does)",
        "precision",
        AUTOCAST_MODES,
        refused=AUTOCAST_REFUSED,
        policy="compute",
    ),
    Option(
        "mixed_precision",
        "choice",
        "auto",
        "dtype of the trainable params (auto: leave them); they get their own dtype back when DGLS is removed",
        "force float32 LoRA params under a bf16 model",
        "precision",
        MIXED_PRECISION_MODES,
        policy="compute",
    ),
    Option(
        "lazy_lora_steps",
        "int",
        1,
        "apply the optimizer every N micro-batches, with gradients accumulated in between (multiplies "
        "gradient_accumulation_steps by N)",
        "larger effective batch at the same VRAM; the streamed bytes per optimizer step grow N-fold",
        "training",
        policy=None,
    ),
    Option(
        "layer_major",
        "bool",
        True,
        "run each layer over all of a step's micro-batches before the next (one pipeline stage, DeepSpeed 0.19 or "
        "newer): each streamed layer copied once a direction a step, the numbers of one micro-batch after another",
        "turn off to run micro-batches one after another (several pipeline stages always do)",
        "training",
        policy=None,
    ),
    Option(
        "host_adam",
        "choice",
        "auto",
        "where and how a full fine-tune's streamed layers take their AdamW step: auto (split for AdamW, the "
        "fastest measured; the CPU for SGD), torch_fused (on the CPU, "
        "torch.optim.AdamW(fused=True)), deepspeed (on the CPU, DeepSpeedCPUAdam, built on first use), torch (on the "
        "CPU, the single-tensor loop: bitwise what an unstreamed CPU run gives), device (on the GPU, torch's fused "
        "kernel, each layer's master and moments streamed in from host memory and back), or split (each layer on "
        "the GPU or the CPU, whichever would finish it sooner at the rates measured on earlier steps)",
        "compare a full fine-tune with an unstreamed CPU run bitwise (torch); let the GPU take the steps (device), "
        "or the GPU and the CPU together (split)",
        "training",
        IMPLEMENTATIONS,
        policy=None,
    ),
    Option(
        "clip_mode",
        "choice",
        "exact",
        "how a full fine-tune's gradient clipping scales the streamed layers' updates: exact (each update uses this "
        "step's norm: where steps clip, updates wait for the end of the backward), or previous_norm (inexact, "
        "opt-in: each update starts as its gradients land, scaled by the previous step's clip coefficient; step 1 "
        "waits)",
        "steps that clip most of the time leave updates on the critical path (see the README's clipping note for "
        "the measured effect on the loss)",
        "training",
        CLIP_MODES,
        policy="training",
    ),
    Option(
        "profile",
        "str",
        None,
        "write a Chrome-trace JSON (and a PNG timeline if matplotlib is installed) of per-layer copies and compute "
        "for a few steps after warm-up to this path",
        "see where compute waits on copies",
        "output",
        policy="observe",
    ),
    Option(
        "verbose",
        "bool",
        False,
        "print swap stats every step, and a windowed summary with ETA",
        "tuning",
        "output",
        policy=None,
    ),
    Option(
        "verbose_every", "int", 10, "steps per windowed summary under --verbose", "long runs", "output", policy=None
    ),
)

OPTION_BY_NAME = {o.name: o for o in OPTIONS}

# Flags of earlier versions that had nothing left to do: refused with what DGLS does instead.
RETIRED = {
    "sync_only_on_resume": "DGLS synchronises only where correctness needs it (loading a checkpoint into the host "
    "masters, evicting before sampling)",
    "async_zero_grad": "trainable (LoRA) params are always resident and the trainer frees their gradients (sets "
    "them to None), so there is no zeroing to overlap",
}

# Which placement style each placement key belongs to.
PLACEMENT_STYLE = {
    "gpu_layers": "gpu_layers",
    "blocks_to_swap": "blocks_to_swap",
    "initial_gpu_layers": "initial/final_gpu_layers",
    "final_gpu_layers": "initial/final_gpu_layers",
    "vram_budget": "vram_budget",
}

# Options that mean something with --no-dynamic_swapping; the rest only steer DGLS's streaming.
USED_WITHOUT_SWAPPING = frozenset({"dynamic_swapping", "gpu_id", "lazy_lora_steps"})

_CLI_TYPES = {"int": _cli_int, "float": _cli_float, "str": _cli_path, "budget": _cli_budget, "int_list": _cli_int_list}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag whose default is None (so given flags can be told apart); the help
    line carries the default and the choices."""
    groups = {name: parser.add_argument_group(f"DGLS {name}", text) for name, text in GROUPS.items()}
    for o in OPTIONS:
        group = groups[o.group]
        text = o.meaning.replace("%", "%%") + (
            f" (default: {o.shown_default()})" if o.default is not None or o.shown else ""
        )
        if o.kind == "bool":
            group.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif o.kind == "cast_pairs":
            group.add_argument(o.flag, nargs=2, action="append", metavar=("FROM", "TO"), default=None, help=text)
        elif o.kind == "choice" and o.refused:
            metavar = "{" + ",".join(o.choices) + "}"
            group.add_argument(o.flag, type=_cli_choice(o), default=None, metavar=metavar, help=text)
        elif o.kind == "choice":
            group.add_argument(o.flag, choices=o.choices, default=None, help=text)
        else:
            metavar = {"int_list": "I,J,..", "budget": "GIB|auto", "str": "PATH"}.get(o.kind, o.kind.upper())
            group.add_argument(o.flag, type=_CLI_TYPES[o.kind], default=None, metavar=metavar, help=text)


def refuse_retired(args: list[str], where: str = COMMAND_LINE) -> None:
    """A retired flag (or [dgls] key) stops the run with what DGLS does instead."""
    for arg in args:
        name = arg.split("=", 1)[0].removeprefix("--").removeprefix("no-")
        if arg.startswith("--") and name in RETIRED:
            shown = f"--{name}" if where == COMMAND_LINE else f"[dgls] {name} in {where}"
            raise DGLSUserError(f"{shown} was removed, as it had nothing to do: {RETIRED[name]}; drop it")


class _Unfit(Exception):
    """A [dgls] value not of its option's kind; the argument says what the key needs ("a whole number")."""


def _toml_bool(value: Any, option: Option) -> bool:
    if not isinstance(value, bool):
        raise _Unfit("true or false")
    return value


def _toml_int(value: Any, option: Option) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Unfit("a whole number")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _toml_float(value: Any, option: Option) -> float:
    if not _is_number(value):
        raise _Unfit("a number")
    return float(value)


def _toml_str(value: Any, option: Option) -> str:
    if not isinstance(value, str) or not value:
        raise _Unfit("a path in quotes")
    return value


def _toml_choice(value: Any, option: Option) -> str:
    if value not in option.choices and value not in option.refused:
        raise _Unfit(f"one of {', '.join(option.choices)}")
    return value


def _toml_budget(value: Any, option: Option) -> float | str:
    if value == "auto":
        return value
    if not _is_number(value):
        raise _Unfit("a number of GiB or 'auto'")
    return float(value)


def _toml_int_list(value: Any, option: Option) -> list[int]:
    if isinstance(value, str):
        try:
            return parse_int_list(value)
        except ValueError:
            raise _Unfit("layer indices like [0, 1, 40] or '0,1,40'") from None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise _Unfit("a list of layer indices like [0, 1, 40]")
    return value


def _toml_cast_pairs(value: Any, option: Option) -> Any:
    """One [FROM, TO] pair or a list of them; ComputePolicy checks the names (and refuses anything else)."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(x, str) for x in value):
        return [value]
    return value


# Each option kind's [dgls] value in the option's type, or _Unfit with what the key needs. Ranges (>= 0, > 0, known
# dtypes) are checked later, as for a flag: by the option's policy, or by check() for a setting of the run.
_TOML_TYPES = {
    "bool": _toml_bool,
    "int": _toml_int,
    "float": _toml_float,
    "str": _toml_str,
    "choice": _toml_choice,
    "budget": _toml_budget,
    "int_list": _toml_int_list,
    "cast_pairs": _toml_cast_pairs,
}


def _coerce(option: Option, value: Any, where: str) -> Any:
    """A [dgls] value in the option's type, or one line saying what the key needs."""
    try:
        return _TOML_TYPES[option.kind](value, option)
    except _Unfit as unfit:
        raise DGLSUserError(f"[dgls] {option.name} in {where} must be {unfit}, got {value!r}") from None


@dataclass
class Resolved:
    """Option values, where each came from, and start-up lines about how they were combined."""

    values: dict[str, Any]
    sources: dict[str, str]  # name -> 'default' | 'command line' | the TOML path
    notes: list[str] = field(default_factory=list)

    def given(self, name: str) -> bool:
        return self.sources[name] != "default"

    def label(self, name: str) -> str:
        """How the user wrote this setting: '--prefetch' or '[dgls] prefetch in x.toml'."""
        if self.sources[name] in (COMMAND_LINE, "default"):
            return OPTION_BY_NAME[name].flag
        return f"[dgls] {name} in {self.sources[name]}"


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def resolve(table: Any, cli: argparse.Namespace, where: str = "the config") -> Resolved:
    """Defaults, then the TOML ``[dgls]`` table (``where`` names it), then the command line."""
    if table is None:
        table = {}
    if not isinstance(table, dict):
        raise DGLSUserError(f"{where}: dgls = {table!r} must be a [dgls] table of DGLS settings")
    refuse_retired([f"--{k}" for k in table], where)
    from_toml = {}
    for key, value in table.items():
        if key not in OPTION_BY_NAME:
            hint = did_you_mean(key, OPTION_BY_NAME) or f" (known keys: {', '.join(sorted(OPTION_BY_NAME))})"
            raise DGLSUserError(f"unknown [dgls] key '{key}' in {where}{hint}")
        from_toml[key] = _coerce(OPTION_BY_NAME[key], value, where)
    from_cli = {o.name: getattr(cli, o.name) for o in OPTIONS if getattr(cli, o.name, None) is not None}
    notes = []
    cli_styles = {PLACEMENT_STYLE[k] for k in from_cli if k in PLACEMENT_STYLE}
    if cli_styles:
        dropped = [k for k in from_toml if k in PLACEMENT_STYLE and PLACEMENT_STYLE[k] not in cli_styles]
        if "vram_budget" in cli_styles and "prefetch" in from_toml and "prefetch" not in from_cli:
            dropped.append("prefetch")  # the planner picks the prefetch depth
        if dropped:
            given = ", ".join(f"--{k} {_shown(from_cli[k])}" for k in from_cli if k in PLACEMENT_STYLE)
            replaced = ", ".join(f"{k} = {_shown(from_toml.pop(k))}" for k in dropped)
            notes.append(f"DGLS: {given} on the command line replaces {replaced} from {where}")
    values = {o.name: o.default for o in OPTIONS}
    sources = dict.fromkeys(values, "default")
    for source, given in ((where, from_toml), (COMMAND_LINE, from_cli)):
        values.update(given)
        sources.update(dict.fromkeys(given, source))
    resolved = Resolved(values, sources, notes)
    styles: dict[str, list[str]] = {}
    for key, style in PLACEMENT_STYLE.items():
        if values[key] is not None:
            styles.setdefault(style, []).append(resolved.label(key))
    if len(styles) > 1:
        named = " and ".join(labels[0] for labels in styles.values())
        raise DGLSUserError(
            f"{named} both choose which layers stay resident: keep one placement style "
            "(gpu_layers, blocks_to_swap, initial/final_gpu_layers or vram_budget)"
        )
    if "vram_budget" in styles and resolved.given("prefetch"):
        budget, prefetch = resolved.label("vram_budget"), resolved.label("prefetch")
        raise DGLSUserError(f"{budget} lets the planner choose the prefetch depth: drop {prefetch}")
    return resolved


def check(resolved: Resolved) -> None:
    """Settings that make no sense together, or that would be ignored, stop the run here."""
    v, label = resolved.values, resolved.label
    for name, low in (("gpu_id", 0), ("lazy_lora_steps", 1), ("verbose_every", 1)):
        if v[name] < low:
            raise DGLSUserError(f"{label(name)} must be a whole number >= {low}, got {v[name]}")
    if not v["dynamic_swapping"]:
        unused = [label(o.name) for o in OPTIONS if o.name not in USED_WITHOUT_SWAPPING and resolved.given(o.name)]
        cli_unused = [x for x in unused if x.startswith("--")]
        if cli_unused:
            raise DGLSUserError(
                f"{', '.join(cli_unused)} {'has' if len(cli_unused) == 1 else 'have'} no effect with "
                "--no-dynamic_swapping (the trainer runs unchanged): drop them, or drop --no-dynamic_swapping"
            )
        if unused:
            resolved.notes.append(f"DGLS: dynamic swapping is off: {', '.join(unused)} not used")
    if resolved.given("disk_dir") and v["host_ram_budget"] is None:
        raise DGLSUserError(
            f"{label('disk_dir')} is where {label('host_ram_budget')} keeps the layers that do not fit in RAM, and "
            "no host_ram_budget is set: add one (GiB, or auto), or drop disk_dir"
        )
    if v["plan"]:
        if v["vram_budget"] is None:
            raise DGLSUserError(f"{label('plan')} plans from a VRAM budget: add --vram_budget (GiB, or auto)")
        if v["profile"] is not None:
            raise DGLSUserError(
                f"{label('plan')} stops after the probe steps, before {label('profile')} records anything: "
                "drop one of them"
            )


def swap_config(values: dict[str, Any]) -> SwapConfig:
    """The engine settings from resolved option values: each option's value in the field of its name of the
    policy its row names (the fields no option sets keep their defaults)."""
    settings: dict[str, dict[str, Any]] = {}
    for o in OPTIONS:
        if o.policy is not None:
            settings.setdefault(o.policy, {})[o.name] = values[o.name]
    kinds = policy_types()
    return SwapConfig(**{policy: kinds[policy](**fields) for policy, fields in settings.items()})


def markdown_table() -> str:
    """The README's flag table."""
    rows = ["| flag / `[dgls]` key | default | meaning | when to use |", "|---|---|---|---|"]
    for o in OPTIONS:
        listed = all(c in o.meaning for c in o.choices)
        choices = f" ({', '.join(o.choices)})" if o.choices and not listed else ""
        rows.append(f"| `{o.flag}` | {o.shown_default()} | {o.meaning}{choices} | {o.when} |")
    return "\n".join(rows)
