"""Command-line wiring for ``dgls_train.py``: parse flags, read the TOML, pick the path."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import options as opts
from .errors import DGLSUserError

DEMO_MODEL_TYPE = "dgls_demo"
# diffusion-pipe's model types (models/*.py) as of 2026; a checkout may know more (checked there).
DIFFUSION_PIPE_MODEL_TYPES = frozenset(
    {
        "flux",
        "flux2",
        "chroma",
        "sdxl",
        "sd3",
        "ltx-video",
        "hunyuan-video",
        "hunyuan_image",
        "cosmos",
        "cosmos_predict2",
        "lumina",
        "lumina_2",
        "wan",
        "hidream",
        "omnigen2",
        "qwen_image",
        "qwen_image_edit",
        "auraflow",
        "z_image",
        "kandinsky5",
    }
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgls_train.py",
        description="Train with DGLS layer swapping: the built-in demo, or diffusion-pipe's train.py.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="training TOML (toml/demo.toml for the demo)")
    parser.add_argument("--diffusion_pipe", default=None, help="path to a diffusion-pipe checkout")
    opts.add_arguments(parser)
    return parser


def load_toml(path: str) -> dict[str, Any]:
    """Read the training TOML; any problem is one line that names the file."""
    import toml

    p = Path(path)
    if not p.is_file():
        raise DGLSUserError(f"config file not found: {path} (pass --config with the path to a training TOML)")
    try:
        return toml.loads(p.read_text())
    except (toml.TomlDecodeError, UnicodeDecodeError) as exc:
        raise DGLSUserError(f"config file {path} is not valid TOML: {exc}") from None


def model_type(config: dict[str, Any], path: str) -> str:
    model = config.get("model")
    if not isinstance(model, dict) or "type" not in model:
        raise DGLSUserError(f"{path} has no [model] type: set type = '{DEMO_MODEL_TYPE}' or a diffusion-pipe model")
    return str(model["type"])


def check_known_type(kind: str, checkout: Path | None) -> None:
    """An unknown model type is a typo until a checkout says otherwise."""
    if kind == DEMO_MODEL_TYPE or kind in DIFFUSION_PIPE_MODEL_TYPES:
        return
    if checkout is not None and (checkout / "models" / f"{kind.replace('-', '_')}.py").is_file():
        return
    known = ", ".join(sorted(DIFFUSION_PIPE_MODEL_TYPES))
    raise DGLSUserError(f"unknown model type '{kind}': use '{DEMO_MODEL_TYPE}' or a diffusion-pipe type ({known})")
