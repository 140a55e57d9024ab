"""diffusion-pipe's side of the checks before a drop-in run: the checkout, the training TOML's
keys that train.py reads unconditionally, and the dataset TOMLs it names.

Each mistake here would otherwise surface as a traceback from train.py (a KeyError, an
AssertionError, a UnicodeDecodeError), often after the model has loaded. Relative paths
resolve against the checkout, where train.py runs.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import DGLSUserError
from ..training.host_optimizer import HostOptimizerSpec, check_table_values, is_finite_number
from .launch import read_toml
from .resume import check_checkpoint

ENV_CHECKOUT = "DGLS_DIFFUSION_PIPE"
REQUIRED_FILES = ("train.py", "utils/pipeline.py", "models/base.py")
# diffusion-pipe's utils/common.py DTYPE_MAP, with the DGLS cast_target name of each dtype.
DP_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8": "f8_e4m3",
    "float8_e4m3fn": "f8_e4m3",
    "float8_e5m2": "f8_e5m2",
}
SAVE_KEYS = ("save_every_n_epochs", "save_every_n_steps", "save_every_n_examples")


def _is_checkout(path: Path) -> bool:
    return all((path / f).is_file() for f in REQUIRED_FILES)


def find_checkout(explicit: str | None, script_dir: Path) -> Path:
    """The diffusion-pipe checkout: --diffusion_pipe, then $DGLS_DIFFUSION_PIPE, then the current
    folder, then the folder dgls_train.py was copied into."""
    for source, value in (("--diffusion_pipe", explicit), (ENV_CHECKOUT, os.environ.get(ENV_CHECKOUT))):
        if value:
            path = Path(value).expanduser().resolve()
            missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
            if missing:
                raise DGLSUserError(f"{source} {value} is not a diffusion-pipe checkout: it has no {missing[0]}")
            return path
    for path in (Path.cwd(), script_dir):
        if _is_checkout(path):
            return path.resolve()
    raise DGLSUserError(
        "this config needs diffusion-pipe: run dgls_train.py from inside a diffusion-pipe checkout, "
        f"pass --diffusion_pipe PATH, or set {ENV_CHECKOUT}"
    )


def _table(config: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = config.get(key)
    if not isinstance(value, dict):
        article = "an" if key[0] in "aeiou" else "a"
        raise DGLSUserError(f"{path}: {key} = {value!r} must be {article} [{key}] table")
    return value


def _path_value(value: Any, key: str, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise DGLSUserError(f"{path}: {key} = {value!r} must be a path in quotes")
    if value.startswith("~"):
        raise DGLSUserError(
            f"{path}: {key} = {value!r}: diffusion-pipe does not expand '~'; write the full path "
            f"{os.path.expanduser(value)!r}"
        )
    return value


def check_train_config(config: dict[str, Any], path: str, swapping: bool) -> None:
    """The keys train.py reads before it checks anything itself; with swapping, what DGLS cannot run yet."""
    _path_value(config.get("output_dir"), "output_dir", path)
    model = _table(config, "model", path)
    for key in ("dtype", "transformer_dtype"):
        if (key in model or key == "dtype") and model.get(key) not in DP_DTYPES:
            raise DGLSUserError(f"{path}: [model] {key} must be one of {', '.join(DP_DTYPES)}, got {model.get(key)!r}")
    check_optimizer_table(_table(config, "optimizer", path), path)
    check_step_settings(config, path)
    if not any(key in config for key in SAVE_KEYS):
        raise DGLSUserError(f"{path} says when to save nothing: set one of {', '.join(SAVE_KEYS)}")
    if "adapter" in config:
        adapter = _table(config, "adapter", path)
        if adapter.get("type") not in ("lora", "lokr"):
            raise DGLSUserError(f"{path}: [adapter] type must be 'lora' or 'lokr', got {adapter.get('type')!r}")
        rank = adapter.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise DGLSUserError(f"{path}: [adapter] rank must be a whole number >= 1, got {rank!r}")
        if "alpha" in adapter:
            raise DGLSUserError(f"{path}: [adapter] alpha: diffusion-pipe sets alpha = rank itself; remove alpha")
    ckpt = config.get("activation_checkpointing", False)
    if ckpt not in (True, False, "unsloth"):
        raise DGLSUserError(f"{path}: activation_checkpointing must be true, false or 'unsloth', got {ckpt!r}")
    if not swapping:
        return
    if config.get("blocks_to_swap"):
        raise DGLSUserError(
            f"{path} sets diffusion-pipe's own blocks_to_swap; DGLS replaces it: remove it from the TOML and "
            "pass --blocks_to_swap to dgls_train.py instead (or run with --no-dynamic_swapping)"
        )
    host_optimizer_spec(config, path)  # a full fine-tune's optimizer must run on the host


def check_optimizer_table(table: dict[str, Any], path: str) -> None:
    """What train.py reads of ``[optimizer]`` whatever trains: ``type`` (it indexes it), and the hyper-parameters
    every optimizer means the same by (:func:`~..training.host_optimizer.check_table_values`: lr, eps, weight_decay,
    momentum, betas), which torch would take as they are (infinity, NaN) or refuse only after the model loaded."""
    kind = table.get("type")
    if not isinstance(kind, str) or not kind:
        raise DGLSUserError(f"{path}: [optimizer] type must be an optimizer name in quotes, like 'adamw', got {kind!r}")
    try:
        check_table_values(table)
    except DGLSUserError as exc:
        raise DGLSUserError(f"{path}: {exc}") from None


def check_step_settings(config: dict[str, Any], path: str) -> None:
    """The top-level keys train.py hands DeepSpeed for each step: the micro-batches a step sums (a whole number
    >= 1, or DeepSpeed asserts or int() fails after the model loaded; ``--lazy_lora_steps`` multiplies it) and
    the clipping norm (0 turns clipping off; negative or NaN would turn it off silently, a string fails at step 1)."""
    for key in ("gradient_accumulation_steps", "eval_gradient_accumulation_steps"):
        value = config.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DGLSUserError(f"{path}: {key} must be a whole number >= 1, got {value!r}")
    clip = config.get("gradient_clipping", 1.0)
    if not is_finite_number(clip) or clip < 0:
        raise DGLSUserError(
            f"{path}: gradient_clipping must be a finite number >= 0 (the largest gradient norm; 0 turns clipping "
            f"off), got {clip!r}"
        )


def gradient_release(config: dict[str, Any], path: str) -> bool:
    """``[optimizer] gradient_release`` (train.py's default: off), which must be true or false."""
    value = _table(config, "optimizer", path).get("gradient_release", False)
    if not isinstance(value, bool):
        raise DGLSUserError(f"{path}: [optimizer] gradient_release must be true or false, got {value!r}")
    return value


def host_optimizer_spec(config: dict[str, Any], path: str) -> HostOptimizerSpec | None:
    """A full fine-tune's (no [adapter]) host optimizer from [optimizer]; None for a LoRA. Optimizers DGLS
    cannot run on the host are refused by name (:meth:`HostOptimizerSpec.from_table`). ``gradient_release``
    means what it means in train.py: no clipping (:func:`host_clipping`), and an optimizer per param, so the
    weight decay applies to 1-D params too (``HostOptimizerSpec.gradient_release``)."""
    if "adapter" in config:
        return None
    release = gradient_release(config, path)
    table = {k: v for k, v in _table(config, "optimizer", path).items() if k != "gradient_release"}
    try:
        spec = HostOptimizerSpec.from_table(table)
        return dataclasses.replace(spec, gradient_release=True) if release else spec
    except DGLSUserError as exc:
        raise DGLSUserError(f"{path}: {exc}") from None


def probe_host_optimizer(spec: HostOptimizerSpec | None, checkout: Path) -> None:
    """The type's own optimizer class (per layer or whole step) stepped once on test tensors
    (:meth:`HostOptimizerSpec.probe`), with the checkout on ``sys.path`` as train.py has it (diffusion-pipe's own
    classes are in its ``optimizers/`` folder)."""
    if spec is None or not spec.own_class:
        return
    folder = str(checkout)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.probe()
    finally:
        if added:
            sys.path.remove(folder)


def host_clipping(config: dict[str, Any], path: str, micro_batches: int) -> float:
    """The clipping norm of a full fine-tune's step, as train.py hands it to DeepSpeed (0: off): with
    gradient_release none, and then one micro-batch a step (``micro_batches``: gradient_accumulation_steps times
    --lazy_lora_steps), since train.py then updates every param at every micro-batch and DGLS's streamed layers
    once a step."""
    if not gradient_release(config, path):
        return config.get("gradient_clipping", 1.0)
    if micro_batches != 1:
        raise DGLSUserError(
            f"{path}: [optimizer] gradient_release with {micro_batches} micro-batches a step "
            "(gradient_accumulation_steps times --lazy_lora_steps): train.py then updates each param at every "
            "micro-batch, its betas scaled to match, and DGLS updates streamed layers once a step: set "
            "gradient_accumulation_steps = 1 (and --lazy_lora_steps 1), or drop gradient_release"
        )
    return 0.0


def model_dtypes(config: dict[str, Any]) -> set[str]:
    """cast_target names of the dtypes the model's weights load in ([model] dtype, transformer_dtype)."""
    model = config.get("model", {})
    return {DP_DTYPES[model[k]] for k in ("dtype", "transformer_dtype") if model.get(k) in DP_DTYPES}


def check_dataset_files(config: dict[str, Any], path: str, checkout: Path) -> None:
    """The dataset TOMLs the config names, and the directories they list, must exist and parse."""
    if "dataset" not in config:
        raise DGLSUserError(f"{path} sets no dataset: add dataset = 'path/to/dataset.toml'")
    named = [("dataset", _path_value(config["dataset"], "dataset", path))]
    evals = config.get("eval_datasets", [])
    if not isinstance(evals, list):
        raise DGLSUserError(f"{path}: eval_datasets must be a list of {{name = ..., config = ...}} tables")
    for i, entry in enumerate(evals):
        key = f"eval_datasets[{i}]"
        if not isinstance(entry, dict) or "config" not in entry or "name" not in entry:
            raise DGLSUserError(
                f"{path}: {key} = {entry!r} must be a table like {{name = 'eval', config = 'eval_dataset.toml'}}"
            )
        named.append((key, _path_value(entry["config"], f"{key} config", path)))
    for key, value in named:
        dataset = checkout / value  # an absolute value stays itself
        if not dataset.is_file():
            raise DGLSUserError(
                f"{path}: {key} = {value!r} not found (relative paths start at the checkout {checkout})"
            )
        label = f"{key} of {path}"
        directories = read_toml(dataset, f"{dataset} (the {label})").get("directory")
        if not isinstance(directories, list) or not directories:
            raise DGLSUserError(f"{dataset} (the {label}) needs [[directory]] tables, each with a path")
        for directory in directories:
            folder = directory.get("path") if isinstance(directory, dict) else None
            if not isinstance(folder, str) or not (checkout / folder).is_dir():
                shown = folder if isinstance(directory, dict) else directory
                raise DGLSUserError(
                    f"{dataset}: [[directory]] path {shown!r} is not a folder "
                    f"(relative paths start at the checkout {checkout})"
                )


def run_dirs(output_dir: Path) -> list[Path]:
    """diffusion-pipe's run folders under output_dir, oldest first (it names them by UTC time)."""
    return sorted(p for p in output_dir.glob("*") if p.is_dir()) if output_dir.is_dir() else []


def resume_flag(config: dict[str, Any], path: str, train_args: list[str]) -> tuple[str | bool, str]:
    """What train.py resumes from (``--resume_from_checkpoint`` [FOLDER] over the TOML's resume_from_checkpoint):
    False, True (the most recent run folder) or a run folder's name; and the setting's name for messages."""
    resume, label = config.get("resume_from_checkpoint", False), f"resume_from_checkpoint in {path}"
    for i, arg in enumerate(train_args):
        if arg == "--resume_from_checkpoint":
            nxt = train_args[i + 1] if i + 1 < len(train_args) else None
            resume = nxt if nxt is not None and not nxt.startswith("--") else True
            label = "--resume_from_checkpoint"
        elif arg.startswith("--resume_from_checkpoint="):
            resume, label = arg.split("=", 1)[1], "--resume_from_checkpoint"
    if not isinstance(resume, (bool, str)):
        raise DGLSUserError(
            f"{path}: resume_from_checkpoint must be true, false or a run folder's name in quotes, got {resume!r}"
        )
    return resume, label


def check_resume(
    config: dict[str, Any], path: str, train_args: list[str], checkout: Path, swapping: bool, stages: int
) -> None:
    """A resume needs a run folder, and in it a checkpoint this run can load (:func:`.resume.check_checkpoint`):
    train.py would otherwise fail with a traceback after the model loaded, or load a LoRA into a full fine-tune
    without a word. ``stages``: the run's pipeline stages (checked)."""
    resume, label = resume_flag(config, path, train_args)
    if not resume:
        return
    output_dir = checkout / str(config["output_dir"])
    if resume is True:
        # train.py: the last entry of output_dir in name order, folder or not (diffusion-pipe names runs by time)
        entries = sorted(glob.glob(os.path.join(output_dir, "*")))
        if not entries:
            raise DGLSUserError(f"{label}: {output_dir} has no earlier run to resume (output_dir in {path})")
        run_dir = Path(entries[-1])
        if not run_dir.is_dir():
            raise DGLSUserError(
                f"{label}: train.py resumes the last entry of {output_dir} in name order, and that is the file "
                f"{run_dir.name}: move it out of output_dir, or name the run folder: --resume_from_checkpoint FOLDER"
            )
    else:
        run_dir = output_dir / resume
        if not run_dir.is_dir():
            raise DGLSUserError(f"{label} {resume}: no run folder {run_dir}")
    check_checkpoint(
        run_dir,
        flag=label,
        config_path=path,
        config=config,
        host_state=swapping and "adapter" not in config,
        stages=stages,
        load_optimizer="--reset_optimizer" not in train_args,
    )


def startup_notes(config: dict[str, Any]) -> list[str]:
    """What diffusion-pipe settings that DGLS takes over mean under DGLS."""
    notes = []
    if "adapter" not in config and config.get("optimizer", {}).get("gradient_release"):
        notes.append(
            "DGLS: [optimizer] gradient_release: no clipping, and each param updated as its gradient is ready: "
            "streamed layers' params on the host, a layer at a time as its last gradient lands (one optimizer per "
            "layer, weight decay on every param as train.py's per-param optimizers give it); the others by "
            "train.py's per-param optimizers on the GPU"
        )
    if config.get("disable_block_swap_for_eval"):
        notes.append(
            "DGLS: disable_block_swap_for_eval applies to diffusion-pipe's own block swap, which DGLS replaces: "
            "eval passes stream with DGLS's forward-only schedule (keep more layers resident to make them faster)"
        )
    return notes
