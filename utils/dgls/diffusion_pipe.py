"""diffusion-pipe drop-in: run a checkout's own, unmodified train.py with DGLS placing its layers.

Nothing of diffusion-pipe is copied. ``run_train_py`` puts the checkout on ``sys.path``,
changes into it, sets ``sys.argv`` to train.py's own arguments and runs train.py with
``runpy`` as ``__main__``. One interception, installed for the run and removed after it:

* ``utils.pipeline.ManualPipelineModule.__init__`` is wrapped so that the layer list
  train.py built with ``model.to_layers()`` gets a :class:`LayerSwapper` before DeepSpeed's
  ``PipelineModule.__init__`` moves the module to the GPU. Streamed params then point at
  device placeholders, so that move (and the one in ``deepspeed.initialize``) copies only
  resident weights.

If the checkout lacks what the interception needs, the run stops before training with a
message naming the file or function.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .errors import DGLSUserError
from .options import swap_config
from .swapper import LayerSwapper

ENV_CHECKOUT = "DGLS_DIFFUSION_PIPE"
REQUIRED_FILES = ("train.py", "utils/pipeline.py", "models/base.py")


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


def check_train_config(config: dict[str, Any], path: str) -> None:
    """Refuse settings DGLS cannot run correctly yet, before anything is loaded."""
    if config.get("blocks_to_swap"):
        raise DGLSUserError(
            f"{path} sets diffusion-pipe's own blocks_to_swap; DGLS replaces it: remove it from the TOML and "
            "pass --blocks_to_swap to dgls_train.py instead (or run with --no-dynamic_swapping)"
        )
    if "adapter" not in config:
        raise DGLSUserError(
            f"{path} has no [adapter]: DGLS streams frozen weights, so it trains LoRAs for now; full "
            "fine-tuning (streaming weights, grads and optimizer state) is planned. Add an [adapter] table or "
            "run with --no-dynamic_swapping"
        )
    stages = config.get("pipeline_stages", 1)
    if stages != 1:
        raise DGLSUserError(
            f"{path} sets pipeline_stages = {stages}: DGLS supports one pipeline stage (one GPU) for now; "
            "set pipeline_stages = 1 or run with --no-dynamic_swapping"
        )
    ckpt = config.get("activation_checkpointing", False)
    if ckpt not in (True, False, "unsloth"):
        raise DGLSUserError(f"{path}: activation_checkpointing must be true, false or 'unsloth', got {ckpt!r}")


class PipelineInterception:
    """Wraps ``ManualPipelineModule.__init__`` for the duration of a run (a context manager)."""

    def __init__(self, values: dict[str, Any], log: Callable[[str], None] = print) -> None:
        self.values = values
        self.log = log
        self.swapper: LayerSwapper | None = None
        self._cls = None
        self._original_init = None

    def __enter__(self) -> PipelineInterception:
        try:
            import utils.pipeline as dp_pipeline
        except ImportError as exc:
            raise DGLSUserError(
                f"cannot import diffusion-pipe's utils/pipeline.py ({exc}); is the checkout complete?"
            ) from None
        cls = getattr(dp_pipeline, "ManualPipelineModule", None)
        if cls is None:
            raise DGLSUserError(
                "diffusion-pipe's utils/pipeline.py has no ManualPipelineModule: this checkout is too old or too new "
                "for DGLS's interception; please report its commit"
            )
        self._cls, self._original_init = cls, cls.__dict__["__init__"]
        interception = self

        def init_with_dgls(module, *args, **kwargs):
            layers = kwargs.get("layers", args[0] if args else None)
            interception.install(layers)
            return interception._original_init(module, *args, **kwargs)

        init_with_dgls.__wrapped__ = self._original_init
        cls.__init__ = init_with_dgls
        return self

    def install(self, layers) -> None:
        if self.swapper is not None:
            raise DGLSUserError("train.py built a second pipeline module; DGLS supports one model per run")
        if layers is None or not all(isinstance(layer, torch.nn.Module) for layer in layers):
            raise DGLSUserError(
                "ManualPipelineModule received no list of built layers (LayerSpecs?): this diffusion-pipe version "
                "builds layers differently from what DGLS expects; please report its commit"
            )
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.swapper = LayerSwapper(list(layers), swap_config(self.values), device=device, log=self.log)

    def __exit__(self, *exc) -> None:
        if self._cls is not None:
            self._cls.__init__ = self._original_init
            self._cls = None


def run_train_py(checkout: Path, config_path: str, train_args: list[str], values: dict[str, Any]) -> None:
    """Run the checkout's train.py as ``__main__`` with DGLS installed (or not, if swapping is off)."""
    config_path = str(Path(config_path).resolve())
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    os.chdir(checkout)
    sys.argv = [str(checkout / "train.py"), "--config", config_path, *train_args]
    if not values["dynamic_swapping"]:
        runpy.run_path(str(checkout / "train.py"), run_name="__main__")
        return
    with PipelineInterception(values) as interception:
        runpy.run_path(str(checkout / "train.py"), run_name="__main__")
        if interception.swapper is not None:
            interception.swapper.remove()
