"""Swap settings as policies, in the manner of FSDP2's ``fully_shard(mp_policy=..., offload_policy=...)``.

- Each policy is a frozen dataclass of the settings one concern of the engine reads, and checks (and normalises)
  its own fields when it is built: a value that can never work stops the run with one line that names the setting
  as users write it and says what to change. A policy that exists is valid.
- :class:`SwapConfig` holds one of each policy; a part of the engine is handed the policy it uses.
- A field's name is the option's name (``--prefetch`` -> ``PlacementPolicy.prefetch``), unique across the
  policies; each row of :data:`..program.options.OPTIONS` names the policy that holds it. No setting is renamed on
  the way.
- A new setting is one field here (its check in the field's metadata, or in the policy's ``_check_together``)
  and, if users give it, one option row.

Which field lives where (the reader of each is named in the policy's docstring):

- :class:`PlacementPolicy`: which layers stay resident, the prefetch depth and the swap-unit size.
- :class:`TransferPolicy`: how streamed bytes are copied and how the host waits for the copies.
- :class:`ComputePolicy`: the dtypes layers store and compute in, and torch.compile of resident layers.
- :class:`ActivationPolicy`: which activations wait in host memory, and how finely layers are checkpointed.
- :class:`TrainingPolicy`: full fine-tuning of streamed layers on the host.
- :class:`ObservePolicy`: timing and the ``--profile`` trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from ..errors import DGLSUserError
from ..memory.fetch_share import MODES as SHARE_MODES
from ..memory.precision import validate_autocast, validate_cast_target, validate_mixed_precision
from ..spelling import did_you_mean

if TYPE_CHECKING:  # a TrainingPolicy holds the spec the trainer built; the engine's settings never build one
    from ..training.host_optimizer import HostOptimizerSpec

PLACEMENT_KEYS = ("gpu_layers", "blocks_to_swap", "initial_gpu_layers", "final_gpu_layers")
SYNC_MODES = ("none", "step", "layer")
CLIP_MODES = ("exact", "previous_norm")  # how clipping scales streamed layers' updates (..training.previous_norm)

Check = Callable[[str, Any], Any]  # (field name, value) -> the value to keep; raises DGLSUserError


def _finite(value) -> bool:
    """A real number: not a bool, not NaN, not infinite (NaN passes every ``< 0`` check)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _checked(default: Any, check: Check) -> Any:
    """A field whose value ``check`` accepts (run by :meth:`_Policy.__post_init__`)."""
    return field(default=default, metadata={"check": check})


def _whole(default: int | None, low: int) -> Any:
    """A whole number >= ``low``; None too where the default is None."""

    def check(name: str, value: Any) -> Any:
        if value is None and default is None:
            return value
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise DGLSUserError(f"{name} must be a whole number >= {low}, got {value!r}")
        return value

    return _checked(default, check)


def _size(default: float | None, wanted: str) -> Any:
    """A finite number >= 0 (``wanted`` says what it is in the message); None too where the default is None."""

    def check(name: str, value: Any) -> Any:
        if value is None and default is None:
            return value
        if not _finite(value) or value < 0:
            raise DGLSUserError(f"{name} {wanted}, got {value!r}")
        return value

    return _checked(default, check)


def _vram_budget(name: str, value: Any) -> Any:
    if value is not None and value != "auto" and (not _finite(value) or value <= 0):
        raise DGLSUserError(f"{name} must be a number of GiB > 0 or 'auto', got {value!r}")
    return value


def _layer_list(name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise DGLSUserError(f"{name} must be a list of layer indices, got {value!r}")
    return list(value)


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise DGLSUserError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _path(name: str, value: Any) -> str | None:
    """A path as given, with ``~`` expanded (it is written by this process, not a shell)."""
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value):
        raise DGLSUserError(f"{name} must be a file path, got {value!r}")
    return str(Path(value).expanduser())


@dataclass(frozen=True)
class _Policy:
    """Checks each field that has a check in its metadata, in field order, then :meth:`_check_together`.

    - A check may normalise its value (``'fp16'`` -> ``'f16'``); the policy keeps what the check returns.
    """

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if (check := f.metadata.get("check")) is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """Settings of this policy that make no sense together."""

    def replace(self, **changes: Any) -> Self:
        """A checked copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class PlacementPolicy(_Policy):
    """Which layers stay resident, how many streamed layers are copied ahead, and how large a swap unit is: what
    the VRAM-budget planner chooses when given a budget.

    - Placement styles (at most one): ``gpu_layers`` (explicit resident indices), ``blocks_to_swap`` (how many
      layers stream), or ``initial_gpu_layers`` / ``final_gpu_layers`` (resident at the two ends). Without any of
      them and without ``vram_budget`` the first and last layer stay resident and the rest stream.
    - ``vram_budget`` (GiB, or ``"auto"``): the planner chooses placement and prefetch from a probe; ``plan``
      stops after planning.
    - ``swap_unit_mb``: layers holding more MB of params stream as several swap units, their child modules
      (:mod:`.units`); None: whole layers unless the planner needs smaller slots; 0: never.
    - ``first_layer``: where this process's layers start in the whole list (a pipeline stage's, set by
      :meth:`for_stage`; no option): the planner names resident layers by their index in the whole list.
    - ``layer_major_micro_batches``: the micro-batches each step runs layer-major (:mod:`..engine.layer_major`; 1:
      one a pass, or one after another), set by the start-up checks where layer-major applies (no option): the
      builder sizes swap units so a layer's units can stay over them (:mod:`..planning.unit_choice`).
    - Read by the builder (:mod:`..engine.build`: placement, swap units, the planner) and :mod:`.placement`.
    """

    gpu_layers: list[int] | None = _checked(None, _layer_list)
    blocks_to_swap: int | None = _whole(None, 0)
    initial_gpu_layers: int | None = _whole(None, 0)
    final_gpu_layers: int | None = _whole(None, 0)
    vram_budget: float | str | None = _checked(None, _vram_budget)
    plan: bool = False
    prefetch: int = _whole(2, 0)
    swap_unit_mb: float | None = _size(None, "is a size in MB >= 0 (0: never split a layer)")
    first_layer: int = _whole(0, 0)
    layer_major_micro_batches: int = _whole(1, 1)

    def _check_together(self) -> None:
        ends = self.initial_gpu_layers is not None or self.final_gpu_layers is not None
        if self.gpu_layers is not None and (self.blocks_to_swap is not None or ends):
            raise DGLSUserError(
                "gpu_layers lists the resident layers itself: drop initial_gpu_layers, final_gpu_layers "
                "and blocks_to_swap, or drop gpu_layers"
            )
        if self.blocks_to_swap is not None and ends:
            raise DGLSUserError(
                "blocks_to_swap chooses the resident layers itself: use either blocks_to_swap or "
                "initial_gpu_layers/final_gpu_layers, not both"
            )

    @property
    def explicit(self) -> list[str]:
        """The placement settings given (they win over a VRAM budget)."""
        return [name for name in PLACEMENT_KEYS if getattr(self, name) is not None]

    @property
    def planned(self) -> bool:
        """The VRAM-budget planner chooses the placement (a budget and no explicit placement)."""
        return self.vram_budget is not None and not self.explicit

    def check_layer_count(self, count: int, model: str = "the model", label: Callable[[str], str] = str) -> None:
        """Placement settings that cannot fit a model of ``count`` layers (the whole layer list, every pipeline
        stage together) stop the run; ``model`` describes it, ``label`` names a setting as the user wrote it.

        - A necessary check only: with pipeline stages, blocks_to_swap and the ends count each stage's layers,
          and which layers have weights to stream is known once they are built (placement.choose_streamed).
        """
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

    def for_stage(self, start: int, stop: int, count: int) -> PlacementPolicy:
        """The placement of a pipeline stage holding layers ``start..stop-1`` of ``count``.

        - ``gpu_layers`` name layers of the whole list: a stage keeps those in its range, as its own indices,
          after every index was checked against the whole list (none is dropped unseen).
        - The other settings (blocks_to_swap, the ends, a VRAM budget) apply to each stage's own layers.
        """
        self.check_layer_count(count)
        start, stop = int(start), int(stop)  # DeepSpeed's stage bounds are numpy integers
        if start == 0 and stop == count:
            return self
        if self.gpu_layers is None:
            return self.replace(first_layer=start)
        return self.replace(gpu_layers=[i - start for i in self.gpu_layers if start <= i < stop], first_layer=start)


@dataclass(frozen=True)
class TransferPolicy(_Policy):
    """How streamed bytes are copied between host and device memory, and where the host waits for the device.

    - ``device_sync_mode``: ``none`` (CUDA events only), ``step`` (the host waits at the end of every backward
      pass), ``layer`` (the host waits for every copy, as ``event_sync`` off does); read through
      :attr:`ordered_by_events` and :attr:`sync_each_step`, which combine it with ``event_sync``.
    - ``pinned_ram_budget_gb`` and ``selective_packing`` shape the host store of streamed weights (:mod:`.masters`).
    - ``share_fetch``: data-parallel processes on one machine each copy a share of every streamed layer and gather
      the rest from the others (``auto``: where the GPUs' gather is fast enough to pay: :mod:`..memory.fetch_share`).
    - ``host_ram_budget`` (GiB, or ``"auto"``): streamed layers whose masters do not fit stay in a file in
      ``disk_dir`` (default: the system temp directory) and are read from disk each time they stream
      (:mod:`.tiers`, :mod:`..memory.disk_tier`).
    - Read by the builder (:mod:`..engine.build`), which hands the values to the copier, the transport, the host
      store (:mod:`.masters`) and the planner (``cuda_streams``).
    """

    threading: bool = False
    batch_move: bool = False
    cuda_streams: int = _whole(1, 1)
    selective_packing: float = _size(0.0, "is a size in MB >= 0")
    event_sync: bool = True
    device_sync_mode: str = _checked("none", _one_of(SYNC_MODES))
    pinned_ram_budget_gb: float | None = _size(None, "must be a number of GiB >= 0")
    host_ram_budget: float | str | None = _checked(None, _vram_budget)
    disk_dir: str | None = _checked(None, _path)
    share_fetch: str = _checked("auto", _one_of(SHARE_MODES))

    @property
    def ordered_by_events(self) -> bool:
        """Copies are ordered with CUDA events (else the host waits for each copy)."""
        return self.event_sync and self.device_sync_mode != "layer"

    @property
    def sync_each_step(self) -> bool:
        """The host waits for the device at the end of every backward pass."""
        return self.device_sync_mode == "step"


@dataclass(frozen=True)
class ComputePolicy(_Policy):
    """The dtypes layers store and compute in, and torch.compile of resident layers (:mod:`..memory.precision` has
    the rules).

    - ``cast_target``: cast streamed frozen params FROM -> TO; an fp8 TO is stored and copied as fp8 and upcast
      to FROM on the device. Norm layers only with ``cast_norms``.
    - ``autocast``: torch.autocast around each layer's forward; ``mixed_precision``: the dtype of the trainable
      params (``"auto"``: leave them).
    - ``compile``: torch.compile the forward of resident layers with ``compile_backend``.
    - Read by :class:`..memory.precision.CastRules`, the host store (:mod:`.masters`) and the forward patches.
    """

    cast_target: list[tuple[str, str]] | None = _checked(
        None, lambda name, pairs: None if pairs is None else validate_cast_target(pairs) or None
    )
    cast_norms: bool = False
    autocast: str | None = _checked(None, lambda name, value: validate_autocast(value))
    mixed_precision: str = _checked("auto", lambda name, value: validate_mixed_precision(value))
    compile: bool = False
    compile_backend: str = "inductor"


@dataclass(frozen=True)
class ActivationPolicy(_Policy):
    """Which activations of checkpointed layers wait in host memory, and how finely layers are checkpointed.

    - ``offload_activations``: the inputs checkpointed layers keep for their recompute go to host memory. True:
      all but those of the last max(1, prefetch) checkpointed calls of a forward, or with a VRAM budget as many
      as the planner needs; None (auto): with a VRAM budget on CUDA, as many as the planner needs (perhaps
      none), otherwise none; False: none (:mod:`..activations.activation_offload`).
    - ``offload_recompute``: what each checkpointed layer's recompute saves for its backward goes home too, all
      but the last third of it (:mod:`..activations.recompute_offload`); turns offload_activations on.
    - ``checkpoint_units``: each layer's pieces (its attention, its MLP, ...) run under checkpoints of their own
      (:mod:`..activations.unit_checkpoints`): a layer's backward holds one piece's activations at a time, for one more
      forward of each piece per step.
    - ``keep_piece_outputs``: with checkpoint_units, each piece's output waits in host memory with the layer's
      inputs and the recompute takes it instead of running the piece; turns offload_activations on.
    - Read by the builder (:mod:`..engine.build`): activation offload and unit checkpoints.
    """

    offload_activations: bool | None = None
    offload_recompute: bool = False
    checkpoint_units: bool = False
    keep_piece_outputs: bool = False

    def _check_together(self) -> None:
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


@dataclass(frozen=True)
class TrainingPolicy(_Policy):
    """Full fine-tuning of streamed layers: their trainable params stream too, and ``host_optimizer`` updates
    their fp32 masters on the host (:mod:`..training.host_training`).

    - ``host_optimizer`` None: trainable params stay on the device (a LoRA).
    - ``accumulation_steps``: micro-batches per optimizer step (the host takes grad norms on the last).
    - ``clip_grads`` False: no clipping, so host updates start during backward.
    - ``speculate_clipping`` (with clipping): updates start during backward at coefficient 1 and are redone in a
      step that clips, exactly (:mod:`..training.speculation`); False: they wait for the gradient norm, and the
      host RAM of their old values is not taken.
    - ``clip_mode`` (with clipping): ``exact`` (the default); ``previous_norm`` (opt-in, inexact): each update starts
      as its gradients land, scaled by the previous step's clip coefficient (:mod:`..training.previous_norm`).
    - ``data_parallel``: every process of the ``torch.distributed`` job holds these layers (data parallel, one
      machine): each updates its share of them, gradients reduced to each layer's owner, over the one host copy the
      processes share (:mod:`..training.data_parallel`).
    - Set by the start-up checks from the trainer's config (no option row: ``--host_adam`` and
      ``--lazy_lora_steps`` reach it through them; ``speculate_clipping`` is a library and benchmark setting). Read
      by the builder (:mod:`..engine.build`: host training).
    """

    host_optimizer: HostOptimizerSpec | None = None
    accumulation_steps: int = _whole(1, 1)
    clip_grads: bool = True
    speculate_clipping: bool = True
    data_parallel: bool = False
    clip_mode: str = _checked("exact", _one_of(CLIP_MODES))

    @property
    def speculates(self) -> bool:
        """Updates speculate under clipping (exact clipping only: :mod:`..training.previous_norm` needs no spares)."""
        return self.speculate_clipping and self.clip_mode == "exact"

    def _check_together(self) -> None:
        if self.clip_mode == "exact":
            return
        mode = f"clip_mode {self.clip_mode}"
        if not self.clip_grads:
            raise DGLSUserError(
                f"{mode} scales each update by the previous step's clip coefficient, and this run does not clip "
                "(gradient_clipping = 0, clip_grads = False): its updates already start as their gradients land; "
                "drop clip_mode"
            )
        if self.data_parallel:
            raise DGLSUserError(
                f"{mode} is not built for data-parallel full fine-tuning (each process updates a share of the "
                "layers): use clip_mode exact, or one process per pipeline stage"
            )
        if self.host_optimizer is not None and self.host_optimizer.whole_step:
            raise DGLSUserError(
                f"{mode}: [optimizer] type {self.host_optimizer.type!r} steps one instance over every param after "
                "the backward, so no update can start earlier: use clip_mode exact"
            )


@dataclass(frozen=True)
class ObservePolicy(_Policy):
    """What the run measures and records.

    - ``collect_timing``: time weight copies and the compute stream's waits for them and for activation restores
      (the step stats' copy times and waits).
    - ``profile``: a Chrome-trace JSON (and PNG) of copies and compute for ``profile_steps`` steps after
      ``profile_warmup_steps``; ``~`` expanded.
    - Read by the builder (:mod:`..engine.build`: the transport's timing, the profiler), and by the trainer
      integration (which steps record).
    """

    collect_timing: bool = True
    profile: str | None = _checked(None, _path)
    profile_warmup_steps: int = _whole(2, 0)
    profile_steps: int = _whole(3, 1)


@dataclass(frozen=True)
class SwapConfig:
    """How layers are placed, streamed, computed, trained and observed: one policy of each.

    - Build it from policies (``SwapConfig(placement=PlacementPolicy(blocks_to_swap=20))``), or from settings
      by name with :meth:`of`; the engine hands each part the policy it reads.
    - Every policy checks itself when built, so a SwapConfig is valid as a whole: no check spans policies.
    """

    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    transfer: TransferPolicy = field(default_factory=TransferPolicy)
    compute: ComputePolicy = field(default_factory=ComputePolicy)
    activations: ActivationPolicy = field(default_factory=ActivationPolicy)
    training: TrainingPolicy = field(default_factory=TrainingPolicy)
    observe: ObservePolicy = field(default_factory=ObservePolicy)

    def __post_init__(self) -> None:
        for name, kind in policy_types().items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"SwapConfig {name} must be a {kind.__name__}, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, **settings: Any) -> SwapConfig:
        """A config from settings by field name, each put in the policy that has a field of that name:
        ``SwapConfig.of(blocks_to_swap=20, prefetch=1, cast_target=[("bf16", "f8_e4m3")])``.

        Why a flat constructor next to the policies:
        - Tests, benchmarks and library users name a few settings and care which part reads each only when
          they hand a part its policy; spelled as policies, most of the 150-odd constructions would grow a
          policy name per setting and say nothing more.
        - The field names are unique across the policies (checked at import), so the routing is read off the
          dataclasses (:func:`setting_owners`): a new field needs no table.
        - A policy may be given whole by its name too (``training=TrainingPolicy(...)``); settings named
          beside it change that policy.
        """
        return cls().replace(**settings)

    def replace(self, **changes: Any) -> SwapConfig:
        """A checked copy with some settings changed, named as in :meth:`of` (by field, or a whole policy)."""
        kinds, owners = policy_types(), setting_owners()
        policies = {name: changes.pop(name) for name in list(changes) if name in kinds}
        by_policy: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name not in owners:
                hint = did_you_mean(name, list(owners) + list(kinds))
                raise TypeError(f"SwapConfig has no setting {name!r}{hint}")
            by_policy.setdefault(owners[name], {})[name] = value
        for policy, fields in by_policy.items():
            base = policies.get(policy, getattr(self, policy))
            policies[policy] = dataclasses.replace(base, **fields)
        return dataclasses.replace(self, **policies)

    def for_stage(self, start: int, stop: int, count: int) -> SwapConfig:
        """The settings of a pipeline stage holding layers ``start..stop-1`` of ``count``
        (:meth:`PlacementPolicy.for_stage`)."""
        placement = self.placement.for_stage(start, stop, count)
        return self if placement is self.placement else dataclasses.replace(self, placement=placement)


def policy_types() -> dict[str, type[_Policy]]:
    """Each policy of :class:`SwapConfig` by its field name."""
    return {f.name: f.default_factory for f in dataclasses.fields(SwapConfig)}  # type: ignore[misc]


def setting_owners() -> dict[str, str]:
    """Each setting (a policy's field) -> the SwapConfig field of the policy that holds it."""
    owners: dict[str, str] = {}
    for policy, kind in policy_types().items():
        for f in dataclasses.fields(kind):
            if f.name in owners:
                raise TypeError(f"{f.name} is a field of both {owners[f.name]} and {policy}: a setting has one home")
            owners[f.name] = policy
    return owners


setting_owners()  # field names unique across the policies, checked once at import
