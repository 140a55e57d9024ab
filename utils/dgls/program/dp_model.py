"""diffusion-pipe's ``[model]`` table, read before anything loads: the files and folders it names must
exist, and where a ``config.json`` says how many blocks the model has, placement settings must fit.

Why: train.py opens the model files only after DeepSpeed has started and the dataset is cached, and
DGLS sees the layer list only once the model is loaded (when DeepSpeed builds the pipeline stage). A
missing checkpoint or ``--blocks_to_swap 60`` for a 59-layer Flux would otherwise cost those minutes.

- Paths: every ``[model]`` key a model type reads a file or folder from (any ``*_path``; ComfyUI-style
  types' ``diffusion_model``, ``vae``, ``text_encoder``, ``audio_vae``, ``merge_adapters`` and
  ``[[model.text_encoders]]`` paths), and ``[adapter] init_from_existing``. Relative paths start at
  the checkout, where train.py runs; diffusion-pipe does not expand ``~``. Only keys that are present
  are checked (which a type requires is diffusion-pipe's to say).
- Layer counts: only for the types whose layer list (``to_layers()``) is an input layer, the blocks
  a ``config.json`` counts and an output layer, read from the file diffusion-pipe builds the
  transformer from (:data:`LAYER_RULES`). For other types, or when that file is not there, the
  placement is checked against the real layer list when the stage is built (``PlacementPolicy.for_stage``).
- Libraries: a type whose LoRA diffusion-pipe adds through transformers' PEFT integration (:data:`TRANSFORMERS_LORA`)
  needs the peft that transformers asks for, which it checks only once the model is loaded (transformers 5.24.0
  asks for peft 0.22.0, newer than any on the package index: SDXL LoRAs then fail in train.py itself).
- ``[optimizer] gradient_release``: train.py's gradient release builds an optimizer per param with the ``lr`` of
  the param's group, which only the types whose module sets it in ``get_param_groups`` give (SDXL, Cosmos-Predict2
  and Anima at diffusion-pipe 8f83dbf, from ``[optimizer] lr``); the groups of models/base.py have none, and
  train.py fails with ``KeyError: 'lr'`` after the model loaded, plain or through DGLS (:func:`check_gradient_release`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DGLSUserError
from ..streaming.config import PlacementPolicy

FOLDER_KEYS = ("diffusers_path", "ckpt_path")  # read as folders (from_pretrained, a checkpoint folder)
COMFY_FILE_KEYS = ("diffusion_model", "vae", "text_encoder", "audio_vae")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# diffusion-pipe's models/sdxl.py: add_adapter on its two CLIP text encoders (transformers models)
TRANSFORMERS_LORA = {"sdxl": "its text encoders' LoRA"}
MIN_PEFT = re.compile(r"^MIN_PEFT_VERSION\s*=\s*[\"']([^\"']+)[\"']", re.M)
GROUP_LR = "param_kwargs['lr'] = pg['lr']"  # train.py's gradient release: each group's lr, read as a key
MODEL_IMPORTS = re.compile(r"^\s*from models((?:\.\w+)*) import (\w+)", re.M)  # a model module's own models


@dataclass(frozen=True)
class LayerRule:
    """A model type whose ``to_layers()`` is ``extra`` layers around the blocks that ``keys`` of a
    ``config.json`` count; the file is ``config_file`` under ``[model] root`` (or under the checkout when
    ``root`` is None); the rule does not apply when ``[model]`` sets one of ``unless``."""

    root: str | None
    config_file: str
    keys: tuple[str, ...]
    extra: int = 2
    unless: tuple[str, ...] = ()


# From diffusion-pipe's models/flux.py, sd3.py and qwen_image.py: [input layer] + blocks + [output layer].
LAYER_RULES = {
    "flux": LayerRule(
        "diffusers_path", "transformer/config.json", ("num_layers", "num_single_layers"), unless=("transformer_path",)
    ),
    "sd3": LayerRule("diffusers_path", "transformer/config.json", ("num_layers",)),
    "qwen_image": LayerRule(None, "configs/qwen_image/transformer/config.json", ("num_layers",)),
}


def _named_paths(config: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(how the user wrote the key, value) of every model file or folder the config names."""
    model = config.get("model", {})
    for key, value in model.items():
        if key.endswith("_path") or key in COMFY_FILE_KEYS:
            yield f"[model] {key}", value
    adapters = model.get("merge_adapters", [])
    for i, value in enumerate(adapters if isinstance(adapters, list) else [adapters]):
        yield f"[model] merge_adapters[{i}]", value
    encoders = model.get("text_encoders", [])
    for i, encoder in enumerate(encoders if isinstance(encoders, list) else []):
        if isinstance(encoder, dict):
            paths = encoder.get("paths", encoder.get("path"))
            for j, value in enumerate(paths if isinstance(paths, list) else [paths]):
                yield f"[[model.text_encoders]] {i} path" + (f"[{j}]" if isinstance(paths, list) else ""), value
    adapter = config.get("adapter")
    if isinstance(adapter, dict) and "init_from_existing" in adapter:
        yield "[adapter] init_from_existing", adapter["init_from_existing"]


def check_model_paths(config: dict[str, Any], path: str, checkout: Path) -> None:
    """Each model file or folder the config names exists (a folder where diffusion-pipe reads one)."""
    for key, value in _named_paths(config):
        if not isinstance(value, str) or not value.strip():
            raise DGLSUserError(f"{path}: {key} = {value!r} must be a path in quotes")
        if value.startswith("~"):
            raise DGLSUserError(
                f"{path}: {key} = {value!r}: diffusion-pipe does not expand '~'; write the full path "
                f"{os.path.expanduser(value)!r}"
            )
        target = checkout / value  # an absolute value stays itself
        if not target.exists():
            hub = (
                f"; diffusion-pipe reads models from disk: download {value} first and give its folder"
                if HUB_ID.match(value) and not value.startswith(".")
                else ""
            )
            raise DGLSUserError(
                f"{path}: {key} = {value!r} not found (relative paths start at the checkout {checkout}){hub}"
            )
        if key.split()[-1] in FOLDER_KEYS and not target.is_dir():
            raise DGLSUserError(f"{path}: {key} = {value!r} is a file; diffusion-pipe reads a model folder there")


def layer_count(config: dict[str, Any], checkout: Path) -> tuple[int, str] | None:
    """(layers of the model's layer list, where that number comes from), or None where it is not known
    before the model loads. A rule's file that is missing or names no whole block counts gives None."""
    model = config.get("model", {})
    rule = LAYER_RULES.get(model.get("type"))
    if rule is None or any(key in model for key in rule.unless):
        return None
    if rule.root is None:
        base = checkout
    elif isinstance(model.get(rule.root), str):
        base = checkout / model[rule.root]
    else:
        return None
    file = base / rule.config_file
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    counts = [data.get(key) if isinstance(data, dict) else None for key in rule.keys]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None
    blocks = " + ".join(f"{key} {n}" for key, n in zip(rule.keys, counts, strict=True))
    return sum(counts) + rule.extra, f"{blocks} in {file}, plus its input and output layers"


def check_placement(
    config: dict[str, Any], checkout: Path, placement: PlacementPolicy, label: Callable[[str], str] = str
) -> None:
    """Placement settings the model cannot hold, where its layer count is known before it loads."""
    known = layer_count(config, checkout)
    if known is not None:
        count, source = known
        placement.check_layer_count(count, f"the {config['model']['type']} model ({source})", label)


def check_adapter_libraries(config: dict[str, Any], path: str) -> None:
    """One line where a LoRA of a :data:`TRANSFORMERS_LORA` type would fail in transformers' ``add_adapter``
    (its peft is older than transformers asks for), before the model loads (module doc)."""
    kind = config.get("model", {}).get("type")
    if "adapter" not in config or kind not in TRANSFORMERS_LORA:
        return
    need, have = transformers_min_peft(), installed_version("peft")
    if need is None or have is None:
        return
    from packaging.version import Version  # transformers' own comparison (check_peft_version); it depends on it

    if Version(have) >= Version(need):
        return
    transformers = f"transformers {installed_version('transformers') or ''}".strip()
    raise DGLSUserError(
        f"{path}: [model] type = {kind!r} with an [adapter]: diffusion-pipe adds {TRANSFORMERS_LORA[kind]} through "
        f"transformers' add_adapter, and {transformers} refuses peft {have} (it asks for {need} or newer): "
        f"pip install 'peft>={need}', or if there is none yet, an earlier transformers that asks for peft {have} or "
        "older (its MIN_PEFT_VERSION, in transformers/integrations/peft.py)"
    )


def check_gradient_release(config: dict[str, Any], path: str, checkout: Path) -> None:
    """One line where train.py's gradient release would fail for this model type: it reads each param group's
    ``lr`` (:data:`GROUP_LR`), and neither the type's module nor a model module it imports defines
    ``get_param_groups`` (models/base.py's groups carry no ``lr``), or one does but takes the lr from
    ``[optimizer] lr``, which is not set. Nothing is said where train.py does not read it, or where its model
    modules cannot be found (module doc)."""
    optimizer = config.get("optimizer")
    if not (isinstance(optimizer, dict) and optimizer.get("gradient_release") is True):
        return
    train = _read(checkout / "train.py")
    kind = config.get("model", {}).get("type")
    if train is None or GROUP_LR not in train or not isinstance(kind, str):
        return
    found = re.search(rf"==\s*'{re.escape(kind)}'[^\n]*:\s*\n\s*from models((?:\.\w+)*) import (\w+)", train)
    if found is None:
        return
    module = _module_file(checkout, found.group(1), found.group(2))
    sources = _model_sources(checkout, module) if module is not None else []
    if not sources:
        return
    start = f"{path}: [optimizer] gradient_release = true fails in this checkout's train.py for [model] type = {kind!r}"
    if not any("def get_param_groups" in text for text in sources):
        raise DGLSUserError(
            f"{start}: its gradient release reads each param group's 'lr', and models/{module}'s groups (those of "
            "models/base.py) have none (KeyError: 'lr' after the model loads, plain train.py too): drop "
            "gradient_release (with gradient_clipping = 0, DGLS updates each streamed layer as its last gradient "
            "lands)"
        )
    if "lr" not in optimizer:
        raise DGLSUserError(
            f"{start} without [optimizer] lr: its gradient release reads each param group's 'lr', which "
            f"models/{module} takes from it: set lr"
        )


def _module_file(checkout: Path, package: str, name: str) -> str | None:
    """The file under models/ that ``from models<package> import name`` reads (``package``: "" or ".wan"): a module
    of the package (``from models.wan import wan``: wan/wan.py; ``from models import flux``: flux.py), or the package
    itself (``from models.flux import FluxPipeline``: flux.py); None where neither is there."""
    parts = [part for part in package.split(".") if part]
    for candidate in ("/".join([*parts, name]) + ".py", "/".join(parts) + ".py" if parts else None):
        if candidate is not None and (checkout / "models" / candidate).is_file():
            return candidate
    return None


def _model_sources(checkout: Path, module: str) -> list[str]:
    """The text of models/``module`` and of the model modules it imports (one level: a type built on another's
    pipeline class, not models/base.py); empty when the file cannot be read."""
    text = _read(checkout / "models" / module)
    if text is None:
        return []
    others = {_module_file(checkout, package, name) for package, name in MODEL_IMPORTS.findall(text)}
    read = (_read(checkout / "models" / other) for other in others - {None, "base.py", module})
    return [text, *(other for other in read if other is not None)]


def _read(path: Path) -> str | None:
    """The text of a checkout's file; None where it cannot be read (then nothing is checked)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def transformers_min_peft() -> str | None:
    """The peft version transformers' PEFT integration asks for, read from its source (importing transformers
    takes seconds); None where it is not installed or says it otherwise."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(spec.submodule_search_locations[0]) / "integrations" / "peft.py"
    found = MIN_PEFT.search(source.read_text()) if source.is_file() else None
    return found.group(1) if found else None
