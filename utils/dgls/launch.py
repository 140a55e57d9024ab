"""Command-line wiring for ``dgls_train.py``: parse flags, read the TOML, pick the path."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import options as opts
from .errors import DGLSUserError

DEMO_MODEL_TYPE = "dgls_demo"


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
