"""What a diffusion-pipe run resumes from, checked: the run folder, its ``latest`` file and the DeepSpeed
checkpoint folder that names, so a resume that cannot work is one line that names the file and what to do.

How train.py resumes (``--resume_from_checkpoint``, or ``resume_from_checkpoint`` in the TOML): with no value
the run folder is the last entry of ``output_dir`` in name order (diffusion-pipe names run folders by UTC
time), with a value the folder of that name; ``engine.load_checkpoint(run_dir, load_module_strict=False)``
then reads the tag in ``run_dir/latest`` and loads ``run_dir/<tag>/``: ``layer_NN-model_states.pt`` per layer
(only the trainable params: saved with ``exclude_frozen_parameters``, so a LoRA's hold only its adapter
weights), ``mp_rank_NN_model_states.pt`` (the trainer's optimizer, scheduler and train.py's client state)
and, for DGLS's full fine-tune of streamed layers, ``dgls_host_optimizer_stage<S>.pt`` (:mod:`..trainers.engine_hooks`;
``dgls_host_optimizer_stage<S>_rank<R>.pt``, one per process, for a data-parallel one: :mod:`..training.shared_saves`,
whose :class:`~..training.shared_saves.HostStateName` makes and parses these names).

Two places check, with the same lines:

- :func:`check_checkpoint`, before start-up (from :func:`.dp_config.check_resume`): ``latest`` exists and
  names a folder; every ``.pt`` file there is whole (a zip whose central directory is at its end, the
  format torch.save writes: an empty, truncated or garbage file fails here, reading only its end); the
  layer files' names say LoRA or full fine-tune (read with ``mmap``: no tensor data is read); the run
  folder's copy of the training TOML names the same model type; DGLS's host optimizer files are there
  exactly when this run needs them (a data-parallel save's shares: ranks 0 to R-1, each layer in one).
- :class:`ResumeChecks`, inside the run, just before DeepSpeed loads: each layer file of this process's
  pipeline stage holds the names and shapes of that layer's trainable params and buffers (diffusion-pipe
  loads non-strictly, which would skip a name that does not match without a word). Every process raises
  the first process's problem (:func:`agree`): one that raised alone would leave the others waiting in
  DeepSpeed's collectives.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DGLSUserError
from ..training.data_parallel import agree
from ..training.shared_saves import HOST_STATE_PREFIX, HostStateName
from .patches import Patches

LATEST = "latest"
LAYER_FILE = re.compile(r"layer_(\d+)-.*model_states\.pt$")
# Parts of a param name that only an adapter's params have (peft's LoRA and LoKr, and modules it trains whole).
ADAPTER_MARKS = ("lora_", "lokr_", "modules_to_save")


def torch_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole file written by ``torch.save``, or None. Reads the zip's central directory
    at the end of the file only: a file cut short, empty or of other bytes has none."""
    if not path.is_file():
        return "is missing" if not path.exists() else "is not a file"
    if path.stat().st_size == 0:
        return "is empty"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return "is cut short or is not a file torch.save wrote"
    if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
        return "is not a file torch.save wrote (it has no data.pkl)"
    return None


def checkpoint_folders(run_dir: Path) -> list[str]:
    """The checkpoint folders of a run folder (DeepSpeed's global_step<N>), in step order."""
    found = [p.name for p in run_dir.glob("global_step*") if p.is_dir()]
    return sorted(found, key=lambda name: int(name[11:]) if name[11:].isdigit() else -1)


def remedy(run_dir: Path, tag: str | None, flag: str) -> str:
    """What to do when the checkpoint ``tag`` of ``run_dir`` cannot be resumed."""
    others = [name for name in checkpoint_folders(run_dir) if name != tag]
    fresh = f"start a new run without {flag}"
    if not others:
        return fresh
    return f"write the name of another checkpoint folder ({', '.join(others)}) into {run_dir / LATEST}, or {fresh}"


def read_tag(run_dir: Path, flag: str) -> str:
    """The checkpoint folder ``run_dir/latest`` names, checked to exist (DeepSpeed's rule for a load without a tag)."""
    latest = run_dir / LATEST
    if not latest.is_file():
        saved = checkpoint_folders(run_dir)
        what = f"it holds {', '.join(saved)} but no 'latest' file naming one" if saved else "it has no 'latest' file"
        raise DGLSUserError(
            f"{flag}: {run_dir} holds no checkpoint to resume ({what}; diffusion-pipe writes one every "
            f"checkpoint_every_n_epochs or checkpoint_every_n_minutes): {_fix_latest(run_dir, saved, flag)}"
        )
    try:
        tag = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        tag = None
    if not tag or "\n" in tag or not (run_dir / tag).is_dir():
        shown = repr(tag) if tag is not None else "no checkpoint folder (it is not text)"
        raise DGLSUserError(
            f"{latest} names {shown}, which is not a checkpoint folder in {run_dir}: "
            f"{_fix_latest(run_dir, checkpoint_folders(run_dir), flag)}"
        )
    return tag


def _fix_latest(run_dir: Path, saved: list[str], flag: str) -> str:
    """What to do when ``run_dir`` has no usable ``latest``: name one of its checkpoint folders ``saved`` there, or
    resume the most recent other run folder that has one (a run that failed at start leaves a newer folder)."""
    if saved:
        return f"write the name of a checkpoint folder ({', '.join(saved)}) into {run_dir / LATEST}, or start a new run"
    others = [p.name for p in sorted(run_dir.parent.glob("*")) if p != run_dir and (p / LATEST).is_file()]
    if others:
        return f"resume the last run folder that has one with --resume_from_checkpoint {others[-1]}, or start a new run"
    return f"start a new run without {flag}"


def damaged(path: Path, what: str, problem: str, run_dir: Path, tag: str, flag: str) -> str:
    """The line for a checkpoint file that cannot be read (``what`` it holds, in words)."""
    return (
        f"{path} ({what}) {problem}: the checkpoint was not saved completely or was damaged; "
        f"{remedy(run_dir, tag, flag)}"
    )


def read_saved(path: Path, what: str, run_dir: Path, tag: str, flag: str) -> Any:
    """``torch.load`` of a checkpoint file (tensors mapped, not read), any failure one line saying what to do;
    None for a whole file that holds objects beyond tensors and containers (a module's extra state: DeepSpeed
    loads those, and they are not checked here)."""
    problem = torch_file_problem(path)
    if problem is None:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            if "Weights only load failed" in str(exc) and "Unsupported global" in str(exc):
                return None
            problem = f"cannot be read (UnpicklingError: {str(exc).splitlines()[0]})"
        except Exception as exc:  # a damaged file fails in many ways (EOFError, KeyError, RuntimeError ...)
            problem = f"cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'damaged'})"
    raise DGLSUserError(damaged(path, what, problem, run_dir, tag, flag))


def read_host_state(path: Path, run_dir: Path, tag: str, flag: str) -> Any:
    """A host optimizer file of a checkpoint, read by :func:`read_saved` (tensors mapped, not read; any failure one
    line): DGLS saves tensors and containers only, so a file that holds other objects is one line too."""
    state = read_saved(path, _what(path), run_dir, tag, flag)
    if state is None:
        raise DGLSUserError(_not_host_state(path, run_dir, tag, flag))
    return state


def _not_host_state(path: Path, run_dir: Path, tag: str, flag: str) -> str:
    return (
        f"{path} holds no DGLS host optimizer state (per-layer optimizer state dicts, or a whole step's): "
        f"{remedy(run_dir, tag, flag)}"
    )


def _what(path: Path) -> str:
    """What a file of a checkpoint folder holds, in words."""
    if path.name.startswith(HOST_STATE_PREFIX):
        return "DGLS's host optimizer state"
    if LAYER_FILE.search(path.name):
        return "a layer's weights"
    if path.name.startswith("mp_rank_"):
        return "DeepSpeed's optimizer and train.py's state"
    return "a checkpoint file"


def is_adapter_key(name: str) -> bool:
    return any(part.startswith(ADAPTER_MARKS) for part in name.split("."))


def check_checkpoint(
    run_dir: Path,
    *,
    flag: str,
    config_path: str,
    config: dict[str, Any],
    host_state: bool,
    stages: int,
    load_optimizer: bool,
) -> None:
    """Before start-up: the checkpoint ``run_dir/latest`` names can be resumed by this config (see the module doc).

    ``host_state``: this run trains streamed layers on the host (a full fine-tune with DGLS swapping), whose
    optimizer state DGLS saved beside DeepSpeed's; ``load_optimizer``: train.py loads optimizer states (no
    ``--reset_optimizer``)."""
    _check_model_type(run_dir, config_path, config, flag)
    tag = read_tag(run_dir, flag)
    folder = run_dir / tag
    layer_files = sorted(p for p in folder.glob("layer_*-model_states.pt") if LAYER_FILE.search(p.name))
    if not list(folder.glob("mp_rank_*_model_states.pt")) or not layer_files:
        missing = "mp_rank_00_model_states.pt" if layer_files else "layer_00-model_states.pt"
        raise DGLSUserError(
            f"{folder} has no {missing}: the checkpoint was not saved completely (or is not a diffusion-pipe "
            f"checkpoint); {remedy(run_dir, tag, flag)}"
        )
    for path in sorted(folder.glob("*.pt")):
        if (problem := torch_file_problem(path)) is not None:
            raise DGLSUserError(damaged(path, _what(path), problem, run_dir, tag, flag))
    names = [name for path in layer_files for name in read_saved(path, _what(path), run_dir, tag, flag) or {}]
    adapter = "adapter" in config
    if names and any(is_adapter_key(n) for n in names) != adapter:
        saved, now = (
            ("a LoRA's", "a full fine-tune (no [adapter])") if not adapter else ("a full fine-tune's", "a LoRA")
        )
        held = "adapter weights" if not adapter else "every weight and no adapter"
        raise DGLSUserError(
            f"{folder} is {saved} checkpoint (its layer files hold {held}), and {config_path} trains {now}: resume "
            f"it with the config it was trained with, or start a new run without {flag}"
        )
    _check_host_state(run_dir, tag, flag, host_state, stages, load_optimizer)


def _check_model_type(run_dir: Path, config_path: str, config: dict[str, Any], flag: str) -> None:
    """train.py copies the training TOML into the run folder when it starts one: another [model] type there
    means another model."""
    copy = run_dir / Path(config_path).name
    if not copy.is_file():
        return
    import toml

    try:
        saved = toml.loads(copy.read_text(encoding="utf-8")).get("model", {}).get("type")
    except (OSError, UnicodeDecodeError, toml.TomlDecodeError, AttributeError):
        return  # the copy is only a witness; the checkpoint's own files are checked
    now = config.get("model", {}).get("type")
    if isinstance(saved, str) and saved != now:
        raise DGLSUserError(
            f"{run_dir} was trained with [model] type = {saved!r} (its copy {copy.name}), and {config_path} sets "
            f"type = {now!r}: resume it with the config it was trained with, or start a new run without {flag}"
        )


def _check_host_state(run_dir: Path, tag: str, flag: str, host_state: bool, stages: int, load_optimizer: bool) -> None:
    folder = run_dir / tag
    files = sorted(folder.glob(f"{HOST_STATE_PREFIX}*.pt"))
    if not load_optimizer:
        return
    if not host_state and files:
        raise DGLSUserError(
            f"{folder} was saved by DGLS's full fine-tune with streamed layers ({files[0].name} holds their optimizer "
            "state, DeepSpeed's only the resident layers'), and this run trains without dynamic swapping: resume it "
            "with swapping on, or pass --reset_optimizer to start the optimizer afresh"
        )
    if not host_state:
        return
    if not files:
        raise DGLSUserError(
            f"{folder} has no DGLS host optimizer state ({HostStateName(0).name}): it was saved by train.py without "
            "DGLS's full fine-tune of streamed layers, so their optimizer state is in no file DGLS reads: resume it as "
            "it was trained (--no-dynamic_swapping), or pass --reset_optimizer to start the optimizer afresh"
        )
    saved_stages = sorted(named.stage for p in files if (named := HostStateName.parse(p.name)) is not None)
    if saved_stages and saved_stages[-1] >= stages:
        raise DGLSUserError(
            f"{folder} holds DGLS host optimizer states of {saved_stages[-1] + 1} pipeline stages, and this run has "
            f"{stages}: resume with pipeline_stages = {saved_stages[-1] + 1}, as it was saved"
        )
    held: dict[tuple[int, int], str] = {}  # (stage, layer) -> the share file holding it
    for path in files:
        state = read_host_state(path, run_dir, tag, flag)
        if not _is_host_state(state):
            raise DGLSUserError(_not_host_state(path, run_dir, tag, flag))
        share = HostStateName.parse(path.name)
        if share is None or share.rank is None or (folder / HostStateName(share.stage).name).exists():
            continue  # a stage's one file (a resume reads it alone, not the shares beside it)
        for layer in (k for k in state if str(k).isdigit()):
            if (key := (share.stage, int(layer))) in held:
                raise DGLSUserError(
                    f"{folder} holds the optimizer state of layer {layer} twice, in {held[key]} and {path.name}: "
                    f"the checkpoint was not saved completely or was damaged; {remedy(run_dir, tag, flag)}"
                )
            held[key] = path.name
    _check_shares(folder, files, run_dir, tag, flag)


def _check_shares(folder: Path, files: list[Path], run_dir: Path, tag: str, flag: str) -> None:
    """A data-parallel save's share files of a stage (:mod:`..training.shared_saves`) are ranks 0 to R-1, none
    missing between (a save that stopped part way, or a file removed since)."""
    ranks: dict[int, list[int]] = {}
    for path in files:
        if (share := HostStateName.parse(path.name)) is not None and share.rank is not None:
            ranks.setdefault(share.stage, []).append(share.rank)
    for stage, found in sorted(ranks.items()):
        if (folder / HostStateName(stage).name).exists():
            continue
        if missing := sorted(set(range(max(found) + 1)) - set(found)):
            raise DGLSUserError(
                f"{folder} holds the host optimizer state shares of data-parallel processes {sorted(found)} of "
                f"pipeline stage {stage} and no {HostStateName(stage, missing[0]).name}: the checkpoint was "
                f"not saved completely or was damaged; {remedy(run_dir, tag, flag)}"
            )


def _is_host_state(state: object) -> bool:
    """The shape of DGLS's host optimizer file: ``{layer: optimizer state dict}`` (per layer), or a whole step's
    ``{STATE_KEY: optimizer state dict, "layers": [...], "resident": n}`` (:mod:`..training.whole_step`)."""
    from ..training.whole_step import STATE_KEY

    if not isinstance(state, dict):
        return False
    if STATE_KEY in state:
        return isinstance(state[STATE_KEY], dict) and "state" in state[STATE_KEY]
    return all(isinstance(v, dict) and "state" in v for v in state.values())


def resolve_tag(load_dir: str | Path, tag: Any) -> tuple[Path, str]:
    """The checkpoint folder a ``load_checkpoint(load_dir, tag)`` reads (``latest`` when no tag)."""
    run_dir = Path(load_dir)
    if tag is None:
        tag = read_tag(run_dir, "--resume_from_checkpoint")
    return run_dir, str(tag)


def _layers(module: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """(global layer index, layer) of a DeepSpeed PipelineModule's stage that has state to load."""
    start = getattr(module, "_local_start", 0)
    for local, layer in enumerate(getattr(module, "forward_funcs", [])):
        if isinstance(layer, nn.Module):
            yield start + local, layer


def layer_fit_problem(module: nn.Module, run_dir: Path, tag: str) -> str | None:
    """Why the layer files of ``run_dir/tag`` do not fit this stage's layers of ``module``, or None: each must
    hold exactly the layer's trainable params and buffers (what DeepSpeed saves with exclude_frozen_parameters),
    each of the same shape."""
    folder = run_dir / tag
    flag = "--resume_from_checkpoint"
    count = getattr(module, "_num_layers", None)
    extra = sorted(int(m.group(1)) for p in folder.glob("layer_*-model_states.pt") if (m := LAYER_FILE.search(p.name)))
    if count is not None and extra and extra[-1] >= count:
        return _misfit(folder, f"it holds layer_{extra[-1]:02d} and this model has {count} layers", run_dir, flag)
    for idx, layer in _layers(module):
        frozen = {name for name, p in layer.named_parameters() if not p.requires_grad}
        want = {k: tuple(v.shape) for k, v in layer.state_dict().items() if k not in frozen}
        paths = sorted(folder.glob(f"layer_{idx:02d}-*model_states.pt"))
        if not paths:
            if not want:
                continue
            return _misfit(folder, f"it has no file for layer {idx} (layer_{idx:02d}-model_states.pt)", run_dir, flag)
        try:
            saved = read_saved(paths[0], _what(paths[0]), run_dir, tag, flag)
        except DGLSUserError as exc:
            return str(exc)
        if saved is None:  # objects beyond tensors: DeepSpeed's own load reads them
            continue
        got = (
            {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
            if isinstance(saved, dict)
            else {}
        )
        if got == want:
            continue
        if missing := sorted(set(want) - set(got)):
            detail = f"{paths[0].name} has no {missing[0]!r}"
        elif unknown := sorted(set(got) - set(want)):
            detail = f"{paths[0].name} holds {unknown[0]!r}, which layer {idx} of this model has not (or not trainable)"
        else:
            name = next(k for k in want if want[k] != got[k])
            detail = (
                f"{paths[0].name} holds {name!r} of shape {list(got[name])}, and this model's is {list(want[name])}"
            )
        return _misfit(folder, detail, run_dir, flag)
    return None


def _misfit(folder: Path, detail: str, run_dir: Path, flag: str) -> str:
    return (
        f"{folder} does not fit this model: {detail}; it was saved by another model or other settings (model files, "
        f"[adapter] rank, LoRA or full fine-tune): resume with the config it was trained with, or start a new run "
        f"without {flag}"
    )


class ResumeChecks:
    """A context manager: while open, ``DeepSpeedEngine.load_checkpoint`` first checks the checkpoint against the
    engine's module (:func:`layer_fit_problem`), every process together (:func:`agree`)."""

    def __init__(self) -> None:
        self.patches = Patches()

    def __enter__(self) -> ResumeChecks:
        from deepspeed.runtime.engine import DeepSpeedEngine

        self.patches.replace(DeepSpeedEngine, "load_checkpoint", self._wrap_load)
        return self

    def __exit__(self, *exc) -> None:
        self.patches.restore()

    @staticmethod
    def _wrap_load(original):
        def load_checkpoint(engine, load_dir, tag=None, *args, **kwargs):
            problem = None
            try:
                run_dir, tag = resolve_tag(load_dir, tag)
                problem = layer_fit_problem(engine.module, run_dir, tag)
            except DGLSUserError as exc:
                problem = str(exc)
            agree(problem)
            return original(engine, load_dir, tag, *args, **kwargs)

        return load_checkpoint
