"""diffusion-pipe drop-in: run a checkout's own, unmodified train.py with DGLS placing its layers.

Nothing of diffusion-pipe is copied. ``run_train_py`` puts the checkout on ``sys.path``,
changes into it, sets ``sys.argv`` to train.py's own arguments and runs train.py with
``runpy`` as ``__main__``. The interceptions (see :class:`PipelineInterception`) are
installed for the run and removed after it. The main one wraps
``utils.pipeline.ManualPipelineModule.__init__`` so that the layer list train.py built with
``model.to_layers()`` gets a :class:`LayerSwapper` before DeepSpeed's
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import toml

from .errors import DGLSUserError
from .monitor import MemoryMonitor, MemoryReading
from .options import swap_config
from .stats import StepStats, StepWindow
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


def check_dataset_files(config: dict[str, Any], path: str, checkout: Path) -> None:
    """The dataset TOMLs the config names, and the directories they list, must exist; relative
    paths resolve against the checkout, where train.py runs. A missing one would otherwise
    surface as a traceback after the model has loaded."""
    if "dataset" not in config:
        raise DGLSUserError(f"{path} sets no dataset: add dataset = 'path/to/dataset.toml'")
    named = [("dataset", config["dataset"])]
    for i, entry in enumerate(config.get("eval_datasets", [])):
        named.append((f"eval_datasets[{i}]", entry["config"] if isinstance(entry, dict) else entry))
    for key, value in named:
        dataset = checkout / value  # an absolute value stays itself
        if not dataset.is_file():
            raise DGLSUserError(
                f"{path}: {key} = {value!r} not found (relative paths start at the checkout {checkout})"
            )
        try:
            directories = toml.loads(dataset.read_text()).get("directory", [])
        except toml.TomlDecodeError as exc:
            raise DGLSUserError(f"{dataset} (the {key} of {path}) is not valid TOML: {exc}") from None
        for directory in directories:
            folder = checkout / str(directory.get("path", ""))
            if not folder.is_dir():
                raise DGLSUserError(
                    f"{dataset}: [[directory]] path {directory.get('path')!r} is not a folder "
                    f"(relative paths start at the checkout {checkout})"
                )


def startup_notes(config: dict[str, Any]) -> list[str]:
    """What diffusion-pipe settings that DGLS takes over mean under DGLS."""
    notes = []
    if config.get("disable_block_swap_for_eval"):
        notes.append(
            "DGLS: disable_block_swap_for_eval applies to diffusion-pipe's own block swap, which DGLS replaces: "
            "eval passes stream with DGLS's forward-only schedule (keep more layers resident to make them faster)"
        )
    return notes


class Patches:
    """Attributes replaced for one run and put back afterwards (each documented where installed)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name]
        replacement = make(original)
        replacement.__wrapped__ = original
        self._saved.append((owner, name, original))
        setattr(owner, name, replacement)

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)


class PipelineInterception:
    """DGLS inside train.py for the duration of a run (a context manager). Installs:

    * ``ManualPipelineModule.__init__``: give the layer list a LayerSwapper before DeepSpeed
      moves the module to the GPU;
    * ``PipelineEngine.train_batch``: after each step, read the swap stats and memory, print
      them with ``verbose`` (plus a windowed summary every ``verbose_every`` steps; no ETA, as
      the run length depends on the dataset), warn once when host RAM runs short, and write
      them to diffusion-pipe's TensorBoard run dir;
    * ``SummaryWriter.__init__`` (if tensorboard is installed): remember train.py's writer,
      so the stats land next to its loss.
    """

    def __init__(self, values: dict[str, Any], log: Callable[[str], None] = print) -> None:
        self.values = values
        self.log = log
        self.swapper: LayerSwapper | None = None
        self.monitor: MemoryMonitor | None = None
        self.window = StepWindow(values["verbose_every"])
        self.writer = None
        self.patches = Patches()

    def __enter__(self) -> PipelineInterception:
        try:
            import utils.pipeline as dp_pipeline
        except ImportError as exc:
            raise DGLSUserError(
                f"cannot import diffusion-pipe's utils/pipeline.py ({exc}); is the checkout complete?"
            ) from None
        cls = getattr(dp_pipeline, "ManualPipelineModule", None)
        if cls is None or "__init__" not in cls.__dict__:
            raise DGLSUserError(
                "diffusion-pipe's utils/pipeline.py has no ManualPipelineModule.__init__: this checkout is too old or "
                "too new for DGLS's interception; please report its commit"
            )
        from deepspeed.runtime.pipe.engine import PipelineEngine

        self.patches.replace(cls, "__init__", self._wrap_pipeline_init)
        self.patches.replace(PipelineEngine, "train_batch", self._wrap_train_batch)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            SummaryWriter = None
        if SummaryWriter is not None:
            self.patches.replace(SummaryWriter, "__init__", self._wrap_writer_init)
        return self

    def _wrap_pipeline_init(self, original):
        def init_with_dgls(module, *args, **kwargs):
            self.install(kwargs.get("layers", args[0] if args else None))
            return original(module, *args, **kwargs)

        return init_with_dgls

    def _wrap_train_batch(self, original):
        def train_batch_with_stats(engine, *args, **kwargs):
            start = time.perf_counter()
            before = self.swapper.total_stats() if self.swapper is not None else None
            loss = original(engine, *args, **kwargs)
            if self.swapper is not None:
                reading = self.monitor.read()
                stats = self.swapper.total_stats().since(before)  # this optimizer step's micro-batches
                if self.swapper.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.swapper.device)  # the next step reports its own peak
                self.report(stats, getattr(engine, "global_steps", 0), time.perf_counter() - start, reading)
                if self.swapper.plan_finished:
                    self.log("DGLS: --plan: stopping after the probe steps; nothing was saved")
                    raise SystemExit(0)
            return loss

        return train_batch_with_stats

    def _wrap_writer_init(self, original):
        def init_and_remember(writer, *args, **kwargs):
            original(writer, *args, **kwargs)
            if self.writer is None:
                self.writer = writer

        return init_and_remember

    def report(
        self, stats: StepStats, step: int, seconds: float | None = None, reading: MemoryReading | None = None
    ) -> None:
        if self.values["verbose"]:
            self.log(f"dgls step {step}: {stats.line(self.swapper.device.type)}")
            if seconds is not None and (text := self.window.add(seconds, stats)):
                self.log(f"dgls {text}" + (f"\ndgls {reading.line()}" if reading is not None else ""))
        if reading is not None:
            for warning in self.monitor.warnings(reading):
                self.log(warning)
        if self.writer is not None:
            for key, value in stats.as_dict().items():
                self.writer.add_scalar(f"dgls/{key}", value, step)
            for key, value in (reading.scalars() if reading is not None else {}).items():
                self.writer.add_scalar(f"dgls/memory/{key}", value, step)

    def finish(self) -> None:
        """After train.py: summarise the last, partial window and put the layers back."""
        if self.values["verbose"] and (text := self.window.flush()):
            self.log(f"dgls {text}")
        if self.swapper is not None:
            self.swapper.remove()

    def install(self, layers) -> None:
        if self.swapper is not None:
            raise DGLSUserError("train.py built a second pipeline module; DGLS supports one model per run")
        # Plain functions between blocks (Chroma's concatenate_hidden_states) are fine: no weights, no hooks.
        # DeepSpeed LayerSpecs are neither modules nor callables: they are built later, after placement.
        if layers is None or not all(isinstance(layer, torch.nn.Module) or callable(layer) for layer in layers):
            raise DGLSUserError(
                "ManualPipelineModule received no list of built layers (LayerSpecs?): this diffusion-pipe version "
                "builds layers differently from what DGLS expects; please report its commit"
            )
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.swapper = LayerSwapper(list(layers), swap_config(self.values), device=device, log=self.log)
        swapper = self.swapper
        self.monitor = MemoryMonitor(swapper.device, lambda: swapper.store.pinned_bytes)
        self.window.device_type = swapper.device.type

    def __exit__(self, *exc) -> None:
        self.patches.restore()


def with_lazy_lora_steps(config: dict[str, Any], config_path: str, steps: int) -> str:
    """``lazy_lora_steps N``: the same TOML with gradient_accumulation_steps multiplied by N, written
    to a temporary file next to nothing the user owns; returns the path train.py should read."""
    if steps == 1:
        return config_path
    import tempfile

    import toml

    before = int(config.get("gradient_accumulation_steps", 1))
    changed = dict(config, gradient_accumulation_steps=before * steps)
    changed.pop("dgls", None)
    handle, path = tempfile.mkstemp(prefix="dgls_", suffix=".toml")
    with os.fdopen(handle, "w") as f:
        toml.dump(changed, f)
    print(
        f"DGLS: lazy_lora_steps {steps}: gradient_accumulation_steps {before} -> {before * steps} "
        f"(the optimizer runs every {before * steps} micro-batches; config written to {path})"
    )
    return path


def run_train_py(checkout: Path, config_path: str, train_args: list[str], values: dict[str, Any]) -> None:
    """Run the checkout's train.py as ``__main__`` with DGLS installed (or not, if swapping is off)."""
    config_path = str(Path(config_path).resolve())
    if values.get("profile"):  # a relative --profile path means where the command ran, not the checkout
        values = {**values, "profile": str(Path(values["profile"]).resolve())}
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    os.chdir(checkout)
    sys.argv = [str(checkout / "train.py"), "--config", config_path, *train_args]
    if not values["dynamic_swapping"]:
        runpy.run_path(str(checkout / "train.py"), run_name="__main__")
        return
    with PipelineInterception(values) as interception:
        runpy.run_path(str(checkout / "train.py"), run_name="__main__")
        interception.finish()
