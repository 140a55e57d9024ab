"""One pass over every input before anything slow starts: flags, the TOML, files, paths, the
machine. It returns a complete description of the run, or stops with one line that says what
to change. Nothing here imports DeepSpeed, builds a model or writes a file (a probe file to
test that a folder is writable is removed at once).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DGLSUserError
from ..memory.disk_tier import precheck_directory
from ..memory.precision import dtype_of, is_fp8, name_of
from ..spelling import check_dgls_table_name, check_passthrough_flags, check_top_level, did_you_mean
from ..streaming.config import ComputePolicy, PlacementPolicy, SwapConfig, TrainingPolicy
from ..torch_private import check_torch
from . import options
from .distributed import DistEnv, dist_env, option_value
from .launch import DEMO_MODEL_TYPE, build_parser, check_known_type, load_toml, model_type
from .paths import check_output_dir, check_output_file
from .rendezvous import check_port

# Arguments the deepspeed launcher adds (--local_rank=N) or its users write (--deepspeed): the demo takes them.
LAUNCHER_ARGS = ("--local_rank", "--deepspeed")
SAFETENSORS_HEADER = 64 << 10  # room for a LoRA file's header, beyond its tensors
AUTOCAST_NAME = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}  # a cast_target TO -> the --autocast that computes in it


@dataclass(frozen=True)
class DemoRun:
    """The built-in demo, checked."""

    config_path: str
    settings: Any  # demo.settings.DemoSettings (imported only for the demo)
    values: dict[str, Any]
    swap: SwapConfig
    device: torch.device
    dist: DistEnv
    notes: tuple[str, ...]


@dataclass(frozen=True)
class DropInRun:
    """diffusion-pipe's train.py in a checkout, checked."""

    config_path: str
    config: dict[str, Any]
    checkout: Path
    train_args: tuple[str, ...]  # what train.py receives after --config
    values: dict[str, Any]
    swap: SwapConfig
    dist: DistEnv
    notes: tuple[str, ...]


def dgls_flags() -> list[str]:
    """Every flag dgls_train.py takes (for "did you mean")."""
    return [action for a in build_parser()._actions for action in a.option_strings if action.startswith("--")]


def require_modules(names: tuple[str, ...], why: str) -> None:
    """Each module must be importable (found without importing it)."""
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ModuleNotFoundError, ValueError):
            found = False
        if found:
            continue
        if name.startswith("utils."):
            folder = "/".join(name.split(".")[:-1])
            raise DGLSUserError(
                f"{folder}/{name.rsplit('.', 1)[1]}.py is missing next to dgls_train.py: copy the whole utils/dgls "
                "folder along with dgls_train.py (see the README)"
            )
        raise DGLSUserError(f"the Python package {name!r} is not installed ({why}): pip install -r requirements.txt")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpu_id(resolved: options.Resolved, dist: DistEnv, wanted: str = "auto") -> None:
    """--gpu_id names a visible GPU in a one-process run, or is not given."""
    gpu_id, label = resolved.values["gpu_id"], resolved.label("gpu_id")
    if dist.launched or not resolved.given("gpu_id"):
        return
    count = _cuda_count()
    if wanted == "cpu":
        raise DGLSUserError(f"{label} {gpu_id} has no effect: the config sets device = 'cpu'; drop one of them")
    if count == 0:
        raise DGLSUserError(f"{label} {gpu_id} but no CUDA device is visible: drop {label}")
    if gpu_id >= count:
        raise DGLSUserError(f"{label} {gpu_id} but only {count} CUDA device(s) are visible (0-{count - 1})")


def check_precision(compute: ComputePolicy, dtypes: set[str], trainer_autocasts: bool, where: str) -> None:
    """Refuse casts that match no weights (they would be reported but do nothing) and, where the
    trainer does not autocast, casts that would leave inputs and weights in different dtypes."""
    for source, target in compute.cast_target or ():
        if dtypes and source not in dtypes:
            raise DGLSUserError(
                f"cast_target {source} {target} casts nothing: the model's weights are {', '.join(sorted(dtypes))} "
                f"({where}); use cast_target {sorted(dtypes)[0]} {target}"
            )
        if not is_fp8(dtype_of(target, "cast_target")) and not trainer_autocasts and compute.autocast is None:
            raise DGLSUserError(
                f"cast_target {source} {target} makes the streamed weights {target} while the inputs stay {source}: "
                f"add --autocast {AUTOCAST_NAME[target]}, or store as fp8 (cast_target {source} f8_e4m3), which "
                f"computes in {source}"
            )


def _split_launcher_args(rest: list[str]) -> list[str]:
    """The demo's leftover arguments less the deepspeed launcher's."""
    out, skip = [], False
    for i, arg in enumerate(rest):
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in LAUNCHER_ARGS:
            skip = arg == "--local_rank" and i + 1 < len(rest) and not rest[i + 1].startswith("--")
            continue
        out.append(arg)
    return out


def _check_profile(resolved: options.Resolved, notes: list[str]) -> None:
    path = resolved.values["profile"]
    if path is None or not resolved.values["dynamic_swapping"]:
        return
    if (note := check_output_file(Path(path).expanduser(), f"{resolved.label('profile')} {path}")) is not None:
        notes.append(note)


def _demo(path: str, config: dict, rest: list[str], resolved: options.Resolved, swap: SwapConfig, cli_dp: str | None):
    require_modules(("utils.dgls.demo.settings", "utils.dgls.demo.train"), "")
    from ..demo.model import lora_param_count, param_count
    from ..demo.settings import DEMO_TABLES, demo_settings

    if cli_dp is not None:
        raise DGLSUserError(f"--diffusion_pipe has no effect: {path} is the built-in demo ([model] type = 'dgls_demo')")
    unknown = _split_launcher_args(rest)
    if unknown:
        flags = [a.split("=", 1)[0] for a in unknown if a.startswith("--")]
        hint = did_you_mean(flags[0], dgls_flags()) if flags else ""
        raise DGLSUserError(
            f"unknown argument(s) for the demo: {' '.join(unknown)}{hint} (dgls_train.py --help lists the flags)"
        )
    check_top_level(config, path, DEMO_TABLES, "the demo")
    settings = demo_settings(config, path)
    require_modules(("deepspeed", "peft", "safetensors", "tqdm"), "the demo needs it")
    values, notes = resolved.values, list(resolved.notes)
    dist = dist_env(os.environ, values["gpu_id"], resolved.given("gpu_id"))
    _check_demo_layout(path, settings, swap.placement, dist, resolved)
    device = _demo_device(settings.device, resolved, dist)
    if values["vram_budget"] == "auto" and device.type != "cuda":
        raise DGLSUserError(f"{resolved.label('vram_budget')} auto measures free VRAM: give a number of GiB on CPU")
    if values["profile"] is not None and values["dynamic_swapping"] and not values["plan"]:
        observe = swap.observe
        last = observe.profile_warmup_steps + observe.profile_steps
        if settings.steps < last:
            raise DGLSUserError(
                f"{resolved.label('profile')} records steps {observe.profile_warmup_steps + 1}-{last}, but [demo] "
                f"steps = {settings.steps} in {path}: raise steps to {last} or more, or drop the profile"
            )
    _check_profile(resolved, notes)
    if values["dynamic_swapping"] and not settings.activation_checkpointing:
        _offload_needs_checkpointing(resolved, values, f"[demo] activation_checkpointing = false in {path}")
    _check_layer_major(resolved, settings.pipeline_stages, f"[demo] pipeline_stages in {path}")
    swap = with_layer_major(swap, values, settings.pipeline_stages, settings.micro_batches(values["lazy_lora_steps"]))
    _check_disk_tier_sharing(resolved, dist.world_size, settings.pipeline_stages, f"[demo] pipeline_stages in {path}")
    if settings.full and values["dynamic_swapping"]:
        swap = _full_fine_tune(path, settings, swap, dist, resolved)
    elif resolved.given("host_adam") and values["dynamic_swapping"]:
        _host_adam_unused(resolved, path)
    swap = _with_clip_mode(swap, resolved, path, settings.full and values["dynamic_swapping"])
    if not values["plan"]:
        count = param_count(settings.model) if settings.full else lora_param_count(settings.model, settings.lora_rank)
        where = f"[demo] output_dir = '{settings.output_dir}' in {path}"
        check_output_dir(settings.output_dir, where, count * 4 + SAFETENSORS_HEADER)
    if values["dynamic_swapping"]:
        check_precision(swap.compute, {name_of(settings.dtype)}, False, f"[model] dtype = '{settings.dtype_name}'")
    check_port(dist)  # last: the settings come first, whatever else holds the port
    return DemoRun(path, settings, values, swap, device, dist, tuple(notes))


def _check_demo_layout(
    path: str, settings, placement: PlacementPolicy, dist: DistEnv, resolved: options.Resolved
) -> None:
    """The demo's layers, pipeline stages, processes and placement settings fit together, before DeepSpeed
    starts: its layer count follows from [demo] double_blocks and single_blocks.

    - One check, in the order a user fixes them (each fix can change what the next one says): stages
      against layers, processes against stages, placement against the whole model, placement against
      each stage's layers; a later check may assume the earlier ones held.
    - Every stage gets layers: DeepSpeed's uniform split leaves the last stages empty when there are more
      stages than layers, and a process with no layers stops while the others fail inside gloo.
    - Placement is checked only where DGLS places layers (dynamic swapping on).
    """
    from ..demo.model import layer_count

    model = settings.model
    count, stages = layer_count(model), settings.pipeline_stages
    if stages > count:
        raise DGLSUserError(
            f"{path}: [demo] pipeline_stages = {stages} is more than the model's {count} layers "
            f"(double_blocks + single_blocks + 2), so a stage would have none: set pipeline_stages to {count} or fewer"
        )
    if dist.world_size % stages:
        command = f"deepspeed --num_gpus={stages} dgls_train.py --deepspeed --config {path}"
        if dist.launched:
            raise DGLSUserError(
                f"{path}: [demo] pipeline_stages = {stages} must divide the {dist.world_size} process(es) the "
                f"launcher started: launch with {command} (or a multiple of {stages} GPUs), or set pipeline_stages = 1"
            )
        raise DGLSUserError(
            f"{path}: [demo] pipeline_stages = {stages} runs one process per stage, and python dgls_train.py "
            f"starts 1 process: launch with {command}, or set pipeline_stages = 1"
        )
    if not resolved.values["dynamic_swapping"]:
        return
    described = (
        f"the demo model ({model.double_blocks} double and {model.single_blocks} single blocks, with its input "
        "and output layers)"
    )
    placement.check_layer_count(count, described, resolved.label)
    if stages > 1:  # each stage places its own layers; DeepSpeed's uniform split: count // stages or 1 more
        smallest = count // stages
        for name in ("blocks_to_swap", "initial_gpu_layers", "final_gpu_layers"):
            if (value := getattr(placement, name)) is not None and value > smallest:
                raise DGLSUserError(
                    f"{resolved.label(name)} is {value}, but it counts each pipeline stage's layers, and the smallest "
                    f"of the {stages} stages ([demo] pipeline_stages) holds {smallest} of the {count}: set {name} "
                    f"<= {smallest}"
                )


_OFFLOADS = {  # the flags that need activation checkpointing, and what each sends to host memory
    "offload_recompute": "what checkpointed layers' recomputes save",
    "keep_piece_outputs": "the outputs of checkpointed layers' pieces",
    "offload_activations": "the inputs checkpointed layers keep",
}


def _offload_needs_checkpointing(resolved: options.Resolved, values: dict, where: str) -> None:
    """Activation checkpointing is off (``where`` says where): an offload flag that needs it is refused."""
    for name, what in _OFFLOADS.items():
        if values[name]:
            raise DGLSUserError(
                f"{resolved.label(name)} sends {what} to host memory, and {where}: turn activation checkpointing "
                "on, or drop the flag"
            )


def _host_adam_unused(resolved: options.Resolved, path: str) -> None:
    raise DGLSUserError(
        f"{resolved.label('host_adam')} picks the host AdamW of a full fine-tune, and {path} trains a LoRA "
        "([adapter]): drop it"
    )


def _with_clip_mode(swap: SwapConfig, resolved: options.Resolved, path: str, full_fine_tune: bool) -> SwapConfig:
    """``--clip_mode`` into the training policy the full fine-tune's checks built (the policy refuses what the mode
    cannot combine with); refused where no streamed layer trains on the host (nothing would read it)."""
    mode = resolved.values["clip_mode"]
    if mode == "exact":
        return swap
    if not full_fine_tune:
        raise DGLSUserError(
            f"{resolved.label('clip_mode')} {mode} scales the host updates of a full fine-tune's streamed layers, and "
            f"{path} trains none (a LoRA, [adapter], or dynamic_swapping off): drop it"
        )
    return swap.replace(clip_mode=mode)


def _drop_in_full_fine_tune(
    path: str,
    config: dict,
    swap: SwapConfig,
    spec,
    dist: DistEnv,
    stages: int,
    resolved: options.Resolved,
    rest,
    micro_batches: int,
) -> SwapConfig:
    """A diffusion-pipe config without [adapter]: streamed layers train on the host (``micro_batches``: a step's,
    gradient_accumulation_steps times ``--lazy_lora_steps``). More processes than stages train data parallel on one
    stage, each updating its share (:mod:`..training.data_parallel`; its saves: :mod:`..training.shared_saves`)."""
    data_parallel = dist.world_size > stages
    if data_parallel:
        _check_data_parallel_full_fine_tune(path, spec, dist.world_size, stages, "pipeline_stages", swap, resolved)
        if spec.gradient_release:  # train.py asserts one data-parallel process at its first step
            raise DGLSUserError(
                f"[optimizer] gradient_release = true in {path} steps each param inside the backward pass, which "
                f"train.py runs with one process per pipeline stage, and the {dist.world_size} processes of this run "
                f"on {stages} stage(s) are data parallel: drop gradient_release, or set pipeline_stages = "
                f"{dist.world_size}"
            )
    if swap.placement.planned:
        _check_planned_full_fine_tune(path, spec, resolved)
    if option_value(rest, "--deepspeed_config") is not None:
        raise DGLSUserError(
            "--deepspeed_config: DGLS keeps the streamed layers' optimizer on the host itself (ZeRO offload would "
            "partition what DGLS replaces); drop it"
        )
    spec = dataclasses.replace(spec, implementation=resolved.values["host_adam"])
    _check_host_adam_build(spec)
    from . import dp_config

    clip = dp_config.host_clipping(config, path, micro_batches)  # 0 lets host updates start during backward
    # layer-major: each layer's gradients are summed on the device, so the host sees one micro-batch a step
    steps = 1 if layer_major_applies(resolved.values, stages, micro_batches) else micro_batches
    policy = TrainingPolicy(
        host_optimizer=spec, accumulation_steps=steps, clip_grads=bool(clip), data_parallel=data_parallel
    )
    return swap.replace(training=policy)


def _check_planned_full_fine_tune(path: str, spec, resolved: options.Resolved) -> None:
    """A VRAM budget plans a full fine-tune at step 1 and fixes the plan before any update
    (:mod:`..planning.autoplan`); what that cannot serve is refused here (``--plan`` shows the plan, and is
    allowed with both)."""
    if resolved.values["plan"]:
        return
    budget = resolved.label("vram_budget")
    if spec.gradient_release:
        raise DGLSUserError(
            f"{budget} with [optimizer] gradient_release = true in {path}: train.py steps each resident param inside "
            "the backward pass, before DGLS fixes the plan at step 1's optimizer step; give the placement instead "
            f"(--gpu_layers or --blocks_to_swap: {budget} with --plan prints the one it would choose), or drop "
            "gradient_release"
        )


def _check_planned_resume(path: str, config: dict, swap: SwapConfig, resolved: options.Resolved, rest) -> None:
    """A full fine-tune planned from a VRAM budget probes with every layer streamed, and a resumed checkpoint holds
    the host optimizer state of the layers its run streamed: refused before the checkpoint is checked."""
    from . import dp_config

    if "adapter" in config or not swap.placement.planned or resolved.values["plan"] or "--reset_optimizer" in rest:
        return
    resume, label = dp_config.resume_flag(config, path, list(rest))
    if resume:
        budget = resolved.label("vram_budget")
        raise DGLSUserError(
            f"{label} with {budget}: a full fine-tune's checkpoint holds the host optimizer state of the layers it "
            "streamed, and the planner's probe streams every layer; resume with the placement the run printed at its "
            "first step ('the same placement without the probe': --gpu_layers ... --prefetch ...) instead of "
            f"{budget}, or pass --reset_optimizer"
        )


def _check_host_adam_build(spec) -> None:
    """``--host_adam deepspeed`` loads DeepSpeedCPUAdam, compiled on first use: a lock a stopped build left
    is refused here, not after DeepSpeed started and placed the layers (where :func:`..training.jit_ops.before_loading`
    says what is compiled)."""
    if spec.implementation == "deepspeed":
        from ..training.jit_ops import refuse_stale_lock

        refuse_stale_lock("cpu_adam")  # DeepSpeed's CPUAdamBuilder.NAME, on every accelerator


LAYER_MAJOR_DEEPSPEED = (0, 19)  # layer-major steps are checked bitwise against DeepSpeed's pipeline engine from here


def deepspeed_too_old_for_layer_major() -> str | None:
    """Why this DeepSpeed runs a step's micro-batches one after another, or None. DeepSpeed 0.18 builds its train
    schedule inside ``train_batch`` and scales gradients differently: a layer-major step there gave numbers that
    differ from one micro-batch after another in the last bits, so it is not run there."""
    try:
        from importlib.metadata import version

        found = version("deepspeed")
    except Exception:  # not installed: nothing runs DeepSpeed's engine
        return None
    parts = tuple(int(x) for x in found.split("+")[0].split(".")[:2] if x.isdigit())
    if parts >= LAYER_MAJOR_DEEPSPEED:
        return None
    want = ".".join(map(str, LAYER_MAJOR_DEEPSPEED))
    return f"layer-major needs DeepSpeed {want} or newer (this one is {found}: pip install -U deepspeed)"


def layer_major_applies(values: dict, stages: int, micro_batches: int) -> bool:
    """A step's micro-batches run layer-major (:mod:`..engine.layer_major`): asked for (the default), with DGLS placing
    the layers, on one pipeline stage, more than one of them, and a DeepSpeed it is checked with."""
    wanted = values["layer_major"] and values["dynamic_swapping"] and stages == 1 and micro_batches > 1
    return bool(wanted and deepspeed_too_old_for_layer_major() is None)


def with_layer_major(swap: SwapConfig, values: dict, stages: int, micro_batches: int) -> SwapConfig:
    """``swap`` told the micro-batches a step runs layer-major where :func:`layer_major_applies` (the builder sizes
    swap units so a layer's can stay over them: :mod:`..planning.unit_choice`); unchanged elsewhere."""
    if not layer_major_applies(values, stages, micro_batches):
        return swap
    return swap.replace(layer_major_micro_batches=micro_batches)


def accumulation_note(values: dict, stages: int, micro_batches: int) -> str:
    """The start-up line of how a step's ``micro_batches`` run (the demo's and diffusion-pipe's; decided from the
    configuration alone: :func:`layer_major_applies`)."""
    if layer_major_applies(values, stages, micro_batches):
        how = "layer-major: each layer runs all of them before the next (each streamed layer copied once a direction)"
    elif not values["dynamic_swapping"]:
        how = "one after another (dynamic swapping is off)"
    elif not values["layer_major"]:
        how = "one after another (--no-layer_major)"
    elif (too_old := deepspeed_too_old_for_layer_major()) is not None:
        how = f"one after another: {too_old}"
    else:
        how = f"one after another: layer-major runs one pipeline stage, and this run has {stages}"
    return f"DGLS: {micro_batches} micro-batches a step, {how}"


def _check_layer_major(resolved: options.Resolved, stages: int, where: str) -> None:
    """An explicit ``layer_major`` with several pipeline stages is refused (the default runs them one after another,
    and says so at start-up)."""
    too_old = deepspeed_too_old_for_layer_major()
    if resolved.given("layer_major") and resolved.values["layer_major"] and too_old is not None:
        raise DGLSUserError(f"{resolved.label('layer_major')}: {too_old}, or drop it (one micro-batch after another)")
    if resolved.given("layer_major") and resolved.values["layer_major"] and stages > 1:
        raise DGLSUserError(
            f"{resolved.label('layer_major')} runs a step's micro-batches layer by layer on one pipeline stage, and "
            f"{where} has {stages}: drop it (several stages run their micro-batches one after another), or use one "
            "stage"
        )


def _check_disk_tier_sharing(resolved: options.Resolved, world_size: int, stages: int, where: str) -> None:
    """A host RAM budget with data-parallel processes that share one host copy (:mod:`..memory.peers`) is refused
    here, before the model loads (the builder would refuse it once a layer spilled: :mod:`..streaming.masters`)."""
    from ..memory.shm_space import SHM

    if (
        resolved.given("host_ram_budget")
        and resolved.values["dynamic_swapping"]
        and world_size > stages
        and SHM.is_dir()
    ):
        raise DGLSUserError(
            f"{resolved.label('host_ram_budget')} keeps streamed layers on disk, and the {world_size} processes of "
            f"this run on {stages} pipeline stage(s) ({where}) are data parallel, sharing one host copy of the "
            "streamed layers: the disk tier does not combine with that copy yet; drop host_ram_budget (the machine "
            "holds one copy for all processes)"
        )


def _full_fine_tune(path: str, settings, swap: SwapConfig, dist: DistEnv, resolved: options.Resolved) -> SwapConfig:
    """A demo config without [adapter]: streamed layers are trained on the host; what that cannot do is refused.
    Several processes on one stage train data parallel, each updating its share of the streamed layers
    (:mod:`..training.data_parallel`): on one stage only, and with a placement fixed at start-up."""
    data_parallel = dist.world_size > settings.pipeline_stages
    spec = dataclasses.replace(settings.optimizer, implementation=resolved.values["host_adam"])
    if data_parallel:
        stages = settings.pipeline_stages
        _check_data_parallel_full_fine_tune(
            path, spec, dist.world_size, stages, "[demo] pipeline_stages", swap, resolved
        )
    _check_host_adam_build(spec)
    # layer-major: each layer's gradients are summed on the device, so the host sees one micro-batch a step
    count = settings.micro_batches(resolved.values["lazy_lora_steps"])
    steps = 1 if layer_major_applies(resolved.values, settings.pipeline_stages, count) else count
    policy = TrainingPolicy(host_optimizer=spec, accumulation_steps=steps, data_parallel=data_parallel)
    return swap.replace(training=policy)


def _check_data_parallel_full_fine_tune(
    path: str, spec, world_size: int, stages: int, setting: str, swap: SwapConfig, resolved: options.Resolved
) -> None:
    """A full fine-tune whose ``world_size`` processes on ``stages`` pipeline stages are data parallel (the demo's
    and diffusion-pipe's; ``setting`` names where stages are set): each process updates its share of the streamed
    layers (:mod:`..training.data_parallel`), on one stage only, with a placement fixed at start-up and a per-param
    optimizer."""
    if stages > 1:
        raise DGLSUserError(
            f"{path} has no [adapter] (a full fine-tune), and {world_size} processes on {stages} pipeline stages "
            "would be data parallel within each stage: a full fine-tune runs data parallel on one stage, or one "
            f"process per stage; set {setting} = 1 or {world_size}"
        )
    if swap.placement.planned and not resolved.values["plan"]:
        raise DGLSUserError(
            f"{resolved.label('vram_budget')} with {world_size} data-parallel processes of a full fine-tune "
            f"({path} has no [adapter]): each streamed layer's owner is fixed at start-up, and the planner re-places "
            "layers after its probe; give the placement (--gpu_layers or --blocks_to_swap: --plan prints the one it "
            "would choose)"
        )
    from ..training.data_parallel import refuse_whole_step

    try:
        refuse_whole_step(spec)
    except DGLSUserError as exc:
        raise DGLSUserError(f"{path}: {exc}") from None


def _demo_device(wanted: str, resolved: options.Resolved, dist: DistEnv) -> torch.device:
    check_gpu_id(resolved, dist, wanted)
    count = _cuda_count()
    if wanted == "cpu" or (wanted == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise DGLSUserError("[demo] device = 'cuda' but no CUDA device is visible: use device = 'auto' or 'cpu'")
    return torch.device("cuda", dist.local_rank)


def _drop_in(path: str, config: dict, rest: list[str], resolved: options.Resolved, swap: SwapConfig, cli_dp, here):
    from . import dp_config, dp_model

    kind = model_type(config, path)
    try:
        checkout = dp_config.find_checkout(cli_dp, here)
    except DGLSUserError:
        check_known_type(kind, None)  # a typo reads better as "unknown model type" than "no checkout"
        raise
    check_known_type(kind, checkout)
    rest = check_passthrough_flags(rest, checkout, dgls_flags())  # abbreviations of train.py's flags in full
    values, notes = resolved.values, list(resolved.notes)
    swapping = values["dynamic_swapping"]
    dp_config.check_train_config(config, path, swapping)
    dp_config.check_dataset_files(config, path, checkout)
    dp_model.check_model_paths(config, path, checkout)
    dp_model.check_adapter_libraries(config, path)
    dp_model.check_gradient_release(config, path, checkout)
    if swapping:
        dp_model.check_placement(config, checkout, swap.placement, resolved.label)
    output_dir = config["output_dir"]
    check_output_dir(checkout / output_dir, f"output_dir = '{output_dir}' in {path}")
    require_modules(("deepspeed",), "diffusion-pipe's train.py needs it")
    if option_value(rest, "--local_rank") is not None and "LOCAL_RANK" not in os.environ:
        raise DGLSUserError(
            "--local_rank is the deepspeed launcher's: for a one-process run choose the GPU with --gpu_id"
        )
    dist = dist_env(os.environ, values["gpu_id"], resolved.given("gpu_id"), option_value(rest, "--master_port"))
    check_gpu_id(resolved, dist)
    stages = config.get("pipeline_stages", 1)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise DGLSUserError(f"{path}: pipeline_stages must be a whole number >= 1, got {stages!r}")
    if dist.world_size % stages:
        raise DGLSUserError(
            f"{path} sets pipeline_stages = {stages}, which must divide the {dist.world_size} process(es) of this "
            f"run: launch with deepspeed --num_gpus={stages} (or a multiple of it), or set pipeline_stages = 1"
        )
    if swapping:
        _check_planned_resume(path, config, swap, resolved, rest)
    dp_config.check_resume(config, path, rest, checkout, swapping, stages)
    if values["vram_budget"] == "auto" and _cuda_count() == 0:
        raise DGLSUserError(f"{resolved.label('vram_budget')} auto measures free VRAM: give a number of GiB on CPU")
    _check_profile(resolved, notes)
    if swapping and not config.get("activation_checkpointing", False):
        _offload_needs_checkpointing(resolved, values, f"{path} has no activation_checkpointing")
    _check_layer_major(resolved, stages, f"pipeline_stages in {path}")
    _check_disk_tier_sharing(resolved, dist.world_size, stages, f"pipeline_stages in {path}")
    # a step's micro-batches: train.py's engine runs the same count (checked whole and >= 1 above)
    micro_batches = config.get("gradient_accumulation_steps", 1) * values["lazy_lora_steps"]
    swap = with_layer_major(swap, values, stages, micro_batches)
    if swapping and (spec := dp_config.host_optimizer_spec(config, path)) is not None:
        swap = _drop_in_full_fine_tune(path, config, swap, spec, dist, stages, resolved, rest, micro_batches)
        dp_config.probe_host_optimizer(swap.training.host_optimizer, checkout)
    elif swapping and resolved.given("host_adam"):
        _host_adam_unused(resolved, path)
    swap = _with_clip_mode(swap, resolved, path, swap.training.host_optimizer is not None)
    if swapping:
        # diffusion-pipe autocasts each layer's forward to [model] dtype itself
        check_precision(swap.compute, dp_config.model_dtypes(config), True, "[model] dtype/transformer_dtype")
        notes += dp_config.startup_notes(config)
        if micro_batches > 1:  # said before the model loads
            notes.append(accumulation_note(values, stages, micro_batches))
    train_args = list(rest)
    if option_value(rest, "--master_port") is None:
        train_args += ["--master_port", str(dist.port)]
    if not dist.launched:
        train_args.append(f"--local_rank={dist.local_rank}")
    check_port(dist)  # last: the settings come first, whatever else holds the port
    return DropInRun(path, config, checkout, tuple(train_args), values, swap, dist, tuple(notes))


def prepare(argv: list[str] | None, here: Path) -> DemoRun | DropInRun:
    """Every check, in the order a user would fix them; ``here`` is the folder of dgls_train.py."""
    args, rest = build_parser().parse_known_args(argv)
    options.refuse_retired(rest)
    check_torch()  # a torch without the private APIs DGLS calls; the engine's build says if it is untested
    config = load_toml(args.config)
    check_dgls_table_name(config, args.config)
    resolved = options.resolve(config.get("dgls"), args, args.config)
    swap = options.swap_config(resolved.values)  # every engine setting, each checked by its policy
    options.check(resolved)
    if swap.transfer.host_ram_budget is not None and resolved.values["dynamic_swapping"]:
        precheck_directory(swap.transfer.disk_dir)  # before the model loads; its room is checked once it is measured
    if model_type(config, args.config) == DEMO_MODEL_TYPE:
        return _demo(args.config, config, rest, resolved, swap, args.diffusion_pipe)
    return _drop_in(args.config, config, rest, resolved, swap, args.diffusion_pipe, here)
