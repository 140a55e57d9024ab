"""SwapConfig as policies: each policy checks itself with the one-line messages the flat SwapConfig gave, every
option row names exactly one policy field of its own name, and the flat constructor routes by field name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from utils.dgls.errors import DGLSUserError
from utils.dgls.program import options
from utils.dgls.streaming.config import (
    ActivationPolicy,
    ComputePolicy,
    ObservePolicy,
    PlacementPolicy,
    SwapConfig,
    TrainingPolicy,
    TransferPolicy,
    policy_types,
    setting_owners,
)

# Engine settings no option row sets: the start-up checks set the training policy from the trainer's config
# (--host_adam and --lazy_lora_steps reach it there), and the rest are library and test settings.
NOT_OPTIONS = {
    "compile_backend",
    "collect_timing",
    "profile_warmup_steps",
    "profile_steps",
    "host_optimizer",
    "accumulation_steps",
    "clip_grads",
    "first_layer",  # a pipeline stage's first layer, set by for_stage
    "layer_major_micro_batches",  # set by the start-up checks where layer-major applies
    "speculate_clipping",
    "data_parallel",  # set by the start-up checks from the launcher's processes and pipeline stages
}
# Options of the run around the engine (read from the resolved values by the start-up checks and the trainer).
RUN_OPTIONS = {
    "dynamic_swapping",
    "gpu_id",
    "lazy_lora_steps",
    "layer_major",
    "host_adam",
    "verbose",
    "verbose_every",
}

# (policy, settings, the whole message): the messages are the flat SwapConfig.validate's, word for word.
REFUSED = [
    (PlacementPolicy, dict(blocks_to_swap=-2), "blocks_to_swap must be a whole number >= 0, got -2"),
    (PlacementPolicy, dict(initial_gpu_layers=True), "initial_gpu_layers must be a whole number >= 0, got True"),
    (PlacementPolicy, dict(final_gpu_layers=1.5), "final_gpu_layers must be a whole number >= 0, got 1.5"),
    (PlacementPolicy, dict(prefetch=-1), "prefetch must be a whole number >= 0, got -1"),
    (PlacementPolicy, dict(prefetch=None), "prefetch must be a whole number >= 0, got None"),
    (
        PlacementPolicy,
        dict(swap_unit_mb=-1),
        "swap_unit_mb is a size in MB >= 0 (0: never split a layer), got -1",
    ),
    (PlacementPolicy, dict(vram_budget=0), "vram_budget must be a number of GiB > 0 or 'auto', got 0"),
    (PlacementPolicy, dict(vram_budget=math.nan), "vram_budget must be a number of GiB > 0 or 'auto', got nan"),
    (PlacementPolicy, dict(gpu_layers=[0, "a"]), "gpu_layers must be a list of layer indices, got [0, 'a']"),
    (
        PlacementPolicy,
        dict(gpu_layers=[0], blocks_to_swap=2),
        "gpu_layers lists the resident layers itself: drop initial_gpu_layers, final_gpu_layers and blocks_to_swap, "
        "or drop gpu_layers",
    ),
    (
        PlacementPolicy,
        dict(blocks_to_swap=2, final_gpu_layers=1),
        "blocks_to_swap chooses the resident layers itself: use either blocks_to_swap or "
        "initial_gpu_layers/final_gpu_layers, not both",
    ),
    (TransferPolicy, dict(cuda_streams=0), "cuda_streams must be a whole number >= 1, got 0"),
    (TransferPolicy, dict(selective_packing=-1.0), "selective_packing is a size in MB >= 0, got -1.0"),
    (
        TransferPolicy,
        dict(pinned_ram_budget_gb=math.inf),
        "pinned_ram_budget_gb must be a number of GiB >= 0, got inf",
    ),
    (
        TransferPolicy,
        dict(device_sync_mode="always"),
        "device_sync_mode must be one of none, step, layer, got 'always'",
    ),
    (
        ComputePolicy,
        dict(cast_target=[("bf16", "bf16")]),
        "cast_target bf16 bf16 casts a dtype to itself: drop that pair",
    ),
    (ComputePolicy, dict(autocast="int8"), "autocast must be one of fp32, fp16, bf16, got 'int8'"),
    (
        ComputePolicy,
        dict(mixed_precision="f8_e4m3"),
        "mixed_precision must be one of auto, f32, bf16, f16, got 'f8_e4m3'",
    ),
    (
        ActivationPolicy,
        dict(offload_recompute=True, offload_activations=False),
        "offload_recompute sends its tensors home with the activation offload: drop offload_activations = false "
        "(--no-offload_activations), or drop offload_recompute",
    ),
    (
        ActivationPolicy,
        dict(keep_piece_outputs=True),
        "keep_piece_outputs keeps the outputs of the pieces checkpoint_units checkpoints: turn checkpoint_units on "
        "(--checkpoint_units), or drop keep_piece_outputs",
    ),
    (TrainingPolicy, dict(accumulation_steps=0), "accumulation_steps must be a whole number >= 1, got 0"),
    (ObservePolicy, dict(profile_steps=0), "profile_steps must be a whole number >= 1, got 0"),
    (ObservePolicy, dict(profile_warmup_steps=-1), "profile_warmup_steps must be a whole number >= 0, got -1"),
]


@pytest.mark.parametrize("policy, settings, message", REFUSED, ids=lambda x: getattr(x, "__name__", None))
def test_each_policy_refuses_its_own_bad_values_in_one_line(policy, settings, message):
    with pytest.raises(DGLSUserError) as raised:
        policy(**settings)
    assert str(raised.value) == message
    with pytest.raises(DGLSUserError) as flat:  # the same check, whichever way the config is built
        SwapConfig.of(**settings)
    assert str(flat.value) == message


def test_every_policy_is_refused_somewhere_above():
    assert {policy for policy, _, _ in REFUSED} == set(policy_types().values())


def test_policies_normalise_what_they_accept():
    compute = ComputePolicy(cast_target=[["fp32", "bf16"]], autocast="fp16", mixed_precision="fp32")
    assert (compute.cast_target, compute.autocast, compute.mixed_precision) == ([("f32", "bf16")], "f16", "f32")
    assert ObservePolicy(profile="~/trace.json").profile.endswith("/trace.json")
    assert not ObservePolicy(profile="~/trace.json").profile.startswith("~")
    assert PlacementPolicy(gpu_layers=(0, 3)).gpu_layers == [0, 3]


def test_policies_are_frozen():
    config = SwapConfig.of(prefetch=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.placement.prefetch = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.placement = PlacementPolicy()  # type: ignore[misc]


def test_every_option_row_names_one_policy_field_of_its_own_name():
    kinds, owners = policy_types(), setting_owners()
    engine_rows = [o for o in options.OPTIONS if o.policy is not None]
    assert {o.name for o in options.OPTIONS if o.policy is None} == RUN_OPTIONS
    for o in engine_rows:
        assert o.policy in kinds, f"--{o.name}: no policy {o.policy!r}"
        assert owners.get(o.name) == o.policy, f"--{o.name} names {o.policy}, whose field {o.name} does not exist"
        default = {f.name: f.default for f in dataclasses.fields(kinds[o.policy])}[o.name]
        assert o.default == default, f"--{o.name}: the option's default differs from {o.policy}.{o.name}'s"
    named = [o.name for o in engine_rows]
    assert len(named) == len(set(named))
    assert set(owners) - set(named) == NOT_OPTIONS, "a policy field without an option row, or a stale NOT_OPTIONS"


def test_option_defaults_give_the_default_config():
    assert options.swap_config({o.name: o.default for o in options.OPTIONS}) == SwapConfig()


def test_swap_config_puts_each_value_in_its_policy():
    values = {o.name: o.default for o in options.OPTIONS}
    values.update(blocks_to_swap=3, threading=True, autocast="bf16", keep_piece_outputs=True, checkpoint_units=True)
    values.update(profile="t.json", device_sync_mode="step")
    config = options.swap_config(values)
    assert config.placement.blocks_to_swap == 3 and config.transfer.threading
    assert config.compute.autocast == "bf16" and config.activations.keep_piece_outputs
    assert config.observe.profile == "t.json" and config.transfer.sync_each_step


@pytest.mark.parametrize(
    "mode, event_sync, ordered, each_step",
    [
        ("none", True, True, False),
        ("step", True, True, True),
        ("layer", True, False, False),
        ("none", False, False, False),
    ],
)
def test_device_sync_mode_is_a_transfer_field(mode, event_sync, ordered, each_step):
    transfer = TransferPolicy(device_sync_mode=mode, event_sync=event_sync)
    assert (transfer.ordered_by_events, transfer.sync_each_step) == (ordered, each_step)


def test_flat_settings_go_to_the_policy_with_that_field():
    config = SwapConfig.of(prefetch=1, cuda_streams=2, cast_norms=True, clip_grads=False, profile_steps=4)
    assert config == SwapConfig(
        placement=PlacementPolicy(prefetch=1),
        transfer=TransferPolicy(cuda_streams=2),
        compute=ComputePolicy(cast_norms=True),
        training=TrainingPolicy(clip_grads=False),
        observe=ObservePolicy(profile_steps=4),
    )
    changed = config.replace(prefetch=3, training=TrainingPolicy(accumulation_steps=2), clip_grads=True)
    assert changed.placement.prefetch == 3 and changed.transfer.cuda_streams == 2
    assert changed.training == TrainingPolicy(accumulation_steps=2, clip_grads=True)
    assert config.placement.prefetch == 1, "replace copies"


def test_an_unknown_setting_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match=r"no setting 'prefech' \(did you mean prefetch\?\)"):
        SwapConfig.of(prefech=1)
    with pytest.raises(TypeError, match="placement must be a PlacementPolicy"):
        SwapConfig(placement=TransferPolicy())


def test_for_stage_keeps_the_stages_gpu_layers_as_its_own_indices():
    config = SwapConfig.of(gpu_layers=[0, 7], cuda_streams=2)
    stage = config.for_stage(5, 10, 10)
    assert stage.placement.gpu_layers == [2] and stage.transfer == config.transfer
    assert SwapConfig.of(blocks_to_swap=2).for_stage(0, 5, 10) == SwapConfig.of(blocks_to_swap=2)
