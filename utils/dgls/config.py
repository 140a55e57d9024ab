"""Swap settings: one dataclass, validated once, shared by the CLI, TOML and library API."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from .errors import DGLSUserError
from .host_optimizer import HostOptimizerSpec
from .precision import validate_autocast, validate_cast_target, validate_mixed_precision

PLACEMENT_KEYS = ("gpu_layers", "blocks_to_swap", "initial_gpu_layers", "final_gpu_layers")


def _finite(value) -> bool:
    """A real number: not a bool, not NaN, not infinite (NaN passes every ``< 0`` check)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SwapConfig:
    """How layers are placed and streamed.

    Placement (at most one style): ``gpu_layers`` (explicit resident indices),
    ``blocks_to_swap`` (how many layers stream), or ``initial_gpu_layers`` /
    ``final_gpu_layers`` (resident at the two ends). Without any of them the first
    and last layer stay resident and the rest stream.
    """

    initial_gpu_layers: int | None = None
    final_gpu_layers: int | None = None
    gpu_layers: list[int] | None = None
    blocks_to_swap: int | None = None
    prefetch: int = 2
    threading: bool = False
    batch_move: bool = False
    cuda_streams: int = 1
    selective_packing: float = 0.0
    event_sync: bool = True
    pinned_ram_budget_gb: float | None = None
    vram_budget_gb: float | str | None = None  # GiB, or "auto": the planner chooses placement and prefetch
    plan_only: bool = False  # stop after planning (``--plan``)
    sync_each_step: bool = False  # the host waits for the device at the end of every backward pass
    compile_resident: bool = False  # torch.compile the forward of resident layers
    compile_backend: str = "inductor"
    # Precision (utils/dgls/precision.py has the rules): cast streamed frozen params FROM -> TO
    # (fp8 TO: stored and copied as fp8, upcast to FROM on the device), norms only with cast_norms;
    # autocast around each layer's forward; dtype of the trainable params ("auto": leave them).
    cast_target: list[tuple[str, str]] | None = None
    cast_norms: bool = False
    autocast: str | None = None
    mixed_precision: str = "auto"
    collect_timing: bool = True
    profile_path: str | None = None  # Chrome-trace JSON (+ PNG) of copies and compute after warm-up
    profile_warmup_steps: int = 2
    profile_steps: int = 3
    # Full fine-tuning: streamed layers' trainable params stream too, and this optimizer updates their fp32
    # masters on the host (utils/dgls/host_training.py). None: trainable params stay on the device.
    host_optimizer: HostOptimizerSpec | None = None
    accumulation_steps: int = 1  # micro-batches per optimizer step (the host takes grad norms on the last)
    clip_grads: bool = True  # False: no clipping, so host updates start during backward (see host_training.py)
    # Checkpointed layers' inputs wait in host memory between forward and recompute
    # (utils/dgls/activation_offload.py). True: all but those of the last max(1, prefetch) checkpointed calls
    # of a forward, or with a VRAM budget as many as the planner needs; None (auto): with a VRAM budget on
    # CUDA, as many as the planner needs (perhaps none), otherwise none; False: none.
    offload_activations: bool | None = None
    # What each checkpointed layer's recompute saves for its backward waits in host memory too, all but the
    # last third of it (utils/dgls/recompute_offload.py); turns offload_activations on.
    offload_recompute: bool = False
    # Layers holding more than this many MB of params stream as several swap units, their child modules
    # (utils/dgls/units.py). None: whole layers, unless the VRAM-budget planner needs smaller slots; 0: never.
    swap_unit_mb: float | None = None
    # Each layer's pieces (its attention, its MLP, ...) run under checkpoints of their own
    # (utils/dgls/unit_checkpoints.py): a layer's backward holds one piece's activations at a time, for one
    # more forward of each piece per step.
    checkpoint_units: bool = False
    # With checkpoint_units: each piece's output from a checkpointed layer's forward waits in host memory with the
    # layer's inputs, and the layer's recompute takes it instead of running the piece (checkpoint_units' extra
    # forward is gone, for the outputs' size in pinned host RAM); turns offload_activations on.
    keep_piece_outputs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject values that can never work, with a message that says what to change."""
        for name in ("initial_gpu_layers", "final_gpu_layers", "blocks_to_swap"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise DGLSUserError(f"{name} must be a whole number >= 0, got {value!r}")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise DGLSUserError(f"prefetch must be a whole number >= 0, got {self.prefetch!r}")
        steps = self.profile_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise DGLSUserError(f"profile_steps must be a whole number >= 1, got {steps!r}")
        if not isinstance(self.profile_warmup_steps, int) or self.profile_warmup_steps < 0:
            raise DGLSUserError(f"profile_warmup_steps must be a whole number >= 0, got {self.profile_warmup_steps!r}")
        steps = self.accumulation_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise DGLSUserError(f"accumulation_steps must be a whole number >= 1, got {steps!r}")
        if not isinstance(self.cuda_streams, int) or self.cuda_streams < 1:
            raise DGLSUserError(f"cuda_streams must be a whole number >= 1, got {self.cuda_streams!r}")
        if not _finite(self.selective_packing) or self.selective_packing < 0:
            raise DGLSUserError(f"selective_packing is a size in MB >= 0, got {self.selective_packing!r}")
        for name in ("offload_recompute", "keep_piece_outputs"):
            if getattr(self, name) and self.offload_activations is False:
                raise DGLSUserError(
                    f"{name} sends its tensors home with the activation offload: drop offload_activations = false "
                    f"(--no-offload_activations), or drop {name}"
                )
        if self.keep_piece_outputs and not self.checkpoint_units:
            raise DGLSUserError(
                "keep_piece_outputs keeps the outputs of the pieces checkpoint_units checkpoints: turn "
                "checkpoint_units on (--checkpoint_units), or drop keep_piece_outputs"
            )
        unit = self.swap_unit_mb
        if unit is not None and (not _finite(unit) or unit < 0):
            raise DGLSUserError(f"swap_unit_mb is a size in MB >= 0 (0: never split a layer), got {unit!r}")
        budget = self.pinned_ram_budget_gb
        if budget is not None and (not _finite(budget) or budget < 0):
            raise DGLSUserError(f"pinned_ram_budget_gb must be a number of GiB >= 0, got {budget!r}")
        if self.cast_target is not None:
            self.cast_target = validate_cast_target(self.cast_target) or None
        self.autocast = validate_autocast(self.autocast)
        self.mixed_precision = validate_mixed_precision(self.mixed_precision)
        budget = self.vram_budget_gb
        if budget is not None and budget != "auto":
            if not _finite(budget) or budget <= 0:
                raise DGLSUserError(f"vram_budget must be a number of GiB > 0 or 'auto', got {budget!r}")
        if self.gpu_layers is not None:
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.gpu_layers):
                raise DGLSUserError(f"gpu_layers must be a list of layer indices, got {self.gpu_layers!r}")
            others = (self.blocks_to_swap, self.initial_gpu_layers, self.final_gpu_layers)
            if any(v is not None for v in others):
                raise DGLSUserError(
                    "gpu_layers lists the resident layers itself: drop initial_gpu_layers, final_gpu_layers "
                    "and blocks_to_swap, or drop gpu_layers"
                )
        if self.blocks_to_swap is not None and (
            self.initial_gpu_layers is not None or self.final_gpu_layers is not None
        ):
            raise DGLSUserError(
                "blocks_to_swap chooses the resident layers itself: use either blocks_to_swap or "
                "initial_gpu_layers/final_gpu_layers, not both"
            )

    @property
    def explicit_placement(self) -> list[str]:
        """The placement settings given (they win over a VRAM budget)."""
        return [name for name in PLACEMENT_KEYS if getattr(self, name) is not None]

    def check_layer_count(self, count: int, model: str = "the model", label: Callable[[str], str] = str) -> None:
        """Placement settings that cannot fit a model of ``count`` layers (the whole layer list, every pipeline
        stage together) stop the run; ``model`` describes it, ``label`` names a setting as the user wrote it.
        A necessary check only: with pipeline stages, blocks_to_swap and the ends count each stage's layers,
        and which layers have weights to stream is known once they are built (placement.choose_streamed)."""
        if self.gpu_layers is not None:
            bad = sorted({i for i in self.gpu_layers if not 0 <= i < count})
            if bad:
                shown = f"layer {bad[0]}" if len(bad) == 1 else f"layers {', '.join(map(str, bad))}"
                raise DGLSUserError(
                    f"{label('gpu_layers')} names {shown}, but {model} has {count} layers: indices run 0-{count - 1}"
                )
        for name in ("blocks_to_swap", "initial_gpu_layers", "final_gpu_layers"):
            value = getattr(self, name)
            if value is not None and value > count:
                raise DGLSUserError(
                    f"{label(name)} is {value}, but {model} has only {count} layers: set {name} <= {count}"
                )

    def for_stage(self, start: int, stop: int, count: int) -> SwapConfig:
        """The settings of a pipeline stage holding layers ``start..stop-1`` of ``count``: ``gpu_layers`` name
        layers of the whole list, so a stage keeps those in its range (as its own indices), after every index
        was checked against the whole list (none is dropped unseen); the other placement settings
        (blocks_to_swap, the ends, a VRAM budget) apply to each stage's own layers."""
        self.check_layer_count(count)
        if self.gpu_layers is None or (start == 0 and stop == count):
            return self
        return self.replace(gpu_layers=[i - start for i in self.gpu_layers if start <= i < stop])

    def replace(self, **changes) -> SwapConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)
