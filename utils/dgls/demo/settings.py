"""The demo's settings from the training TOML (``[demo]``, ``[model]``, ``[adapter]``, ``[optimizer]``),
checked in full before anything is built, so a bad value is one line instead of a traceback minutes in
(or, for ``output_dir``, after every step has run).

As in diffusion-pipe, a config with an ``[adapter]`` table trains a LoRA, and one without trains every
weight (full fine-tuning: streamed layers are trained on the host, :mod:`utils.dgls.training.host_training`).
``[optimizer]`` (type, lr, betas, weight_decay, eps; momentum for sgd) sets the optimizer of a full fine-tune,
each value checked for its range (:mod:`utils.dgls.training.host_optimizer`); a per-param optimizer of a library
(:mod:`utils.dgls.training.optimizer_types`) runs too, with its table's values, and diffusion-pipe's own classes
(its ``optimizers/`` folder) are refused, as the demo has no checkout; a LoRA trains with AdamW at
``[demo] lr``, so an ``[optimizer]`` beside ``[adapter]`` is refused rather than ignored, as is a learning rate set
in both tables."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DGLSUserError
from ..training import optimizer_types
from ..training.host_optimizer import HostOptimizerSpec
from .model import DemoModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch.manual_seed takes at most 2**64 - 1, and the data's generator is seeded with seed + 1; TOML's own
# integers stop at 2**63 - 1 (Python's parsers read bigger ones).
SEED_MAX = 2**63 - 1
DEMO_TABLES = ("model", "adapter", "demo", "optimizer", "dgls")  # the tables a demo config may have


def _whole(low: int, high: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
        return None if ok else f"a whole number >= {low}" + (f" and <= {high}" if high is not None else "")

    return check


def _positive_number(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return None if ok else "a number > 0"


def _one_of(*allowed: Any) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = any(value is a if isinstance(a, bool) else value == a for a in allowed)
        return (
            None if ok else "one of " + ", ".join(repr(a).lower() if isinstance(a, bool) else repr(a) for a in allowed)
        )

    return check


def _path(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "a folder path in quotes"


# key -> (default, check); a check returns what the value must be, or None if it is fine.
DEMO_KEYS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {
    "steps": (30, _whole(1)),
    "batch_size": (4, _whole(1)),
    "lr": (2e-3, _positive_number),
    "seed": (0, _whole(0, SEED_MAX)),
    "output_dir": ("output/demo", _path),
    "activation_checkpointing": (True, _one_of(True, False, "reentrant")),
    "device": ("auto", _one_of("auto", "cpu", "cuda")),
    "samples": (16, _whole(1)),
    "image_tokens": (64, _whole(1)),
    "text_tokens": (16, _whole(1)),
    "lora_rank": (8, _whole(1)),
    "hidden": (DemoModelConfig.hidden, _whole(2)),
    "heads": (DemoModelConfig.heads, _whole(1)),
    "double_blocks": (DemoModelConfig.double_blocks, _whole(0)),
    "single_blocks": (DemoModelConfig.single_blocks, _whole(0)),
    "pipeline_stages": (1, _whole(1)),  # under the deepspeed launcher: split the layers over this many GPUs
    "gradient_accumulation_steps": (1, _whole(1)),  # micro-batches per optimizer step (times --lazy_lora_steps)
}


@dataclass(frozen=True)
class DemoSettings:
    steps: int
    batch_size: int
    lr: float
    seed: int
    output_dir: Path  # '~' expanded
    activation_checkpointing: bool | str
    device: str
    samples: int
    image_tokens: int
    text_tokens: int
    lora_rank: int
    pipeline_stages: int
    gradient_accumulation_steps: int  # layer-major by default (--layer_major: program/validate.py)
    model: DemoModelConfig
    dtype: torch.dtype
    optimizer: HostOptimizerSpec | None = None  # full fine-tuning (no [adapter]); None: a LoRA

    @property
    def full(self) -> bool:
        return self.optimizer is not None

    def micro_batches(self, lazy_lora_steps: int) -> int:
        """Micro-batches per optimizer step: DeepSpeed's gradient_accumulation_steps."""
        return self.gradient_accumulation_steps * lazy_lora_steps

    def runs_layer_major(self, values: dict) -> bool:
        """A step's micro-batches run layer-major (:mod:`..trainers.layer_major_batches`; the rule:
        :func:`..program.validate.layer_major_applies`)."""
        from ..program.validate import layer_major_applies

        return layer_major_applies(values, self.pipeline_stages, self.micro_batches(values["lazy_lora_steps"]))

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _table(config: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise DGLSUserError(f"{path}: {name} = {table!r} must be a [{name}] table")
    return table


def demo_settings(config: dict[str, Any], path: str) -> DemoSettings:
    """Every demo setting, checked; one line naming the key and what it needs otherwise."""
    demo = _table(config, "demo", path)
    unknown = sorted(set(demo) - set(DEMO_KEYS))
    if unknown:
        raise DGLSUserError(f"{path}: unknown [demo] key(s) {unknown} (known: {', '.join(DEMO_KEYS)})")
    adapter = _table(config, "adapter", path)
    values = {key: default for key, (default, _) in DEMO_KEYS.items()}
    if "rank" in adapter:
        values["lora_rank"] = adapter["rank"]
    values.update(demo)
    for key, (_, check) in DEMO_KEYS.items():
        if (expected := check(values[key])) is not None:
            where = "[adapter] rank" if key == "lora_rank" and "lora_rank" not in demo else f"[demo] {key}"
            raise DGLSUserError(f"{path}: {where} must be {expected}, got {values[key]!r}")
    if values["hidden"] % 2 or values["hidden"] % values["heads"]:
        raise DGLSUserError(
            f"{path}: [demo] hidden = {values['hidden']} must be even and divisible by heads = {values['heads']}"
        )
    if values["double_blocks"] + values["single_blocks"] < 1:
        raise DGLSUserError(
            f"{path}: [demo] double_blocks + single_blocks must be at least 1 (the blocks hold the LoRA)"
        )
    dtype_name = _table(config, "model", path).get("dtype", "float32")
    if dtype_name not in DTYPES:
        raise DGLSUserError(f"{path}: [model] dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
    model = DemoModelConfig(**{k: values.pop(k) for k in ("hidden", "heads", "double_blocks", "single_blocks")})
    values["output_dir"] = Path(values["output_dir"]).expanduser()
    optimizer = None
    if "adapter" in config and "optimizer" in config:
        raise DGLSUserError(
            f"{path}: [optimizer] sets the optimizer of a full fine-tune, and this config trains a LoRA ([adapter]), "
            "whose optimizer is AdamW at [demo] lr: remove [optimizer], or remove [adapter] to train every weight"
        )
    if "adapter" not in config:
        given = _table(config, "optimizer", path)
        if "lr" in demo and "lr" in given:
            raise DGLSUserError(
                f"{path}: [demo] lr = {demo['lr']!r} and [optimizer] lr = {given['lr']!r} both set the learning rate "
                "of this full fine-tune: keep one"
            )
        table = {"type": "adamw", "lr": values["lr"], "weight_decay": 0.0, **given}
        try:
            optimizer = HostOptimizerSpec.from_table(table)
        except DGLSUserError as exc:
            raise DGLSUserError(f"{path}: {exc}") from None
        if optimizer.own_class and optimizer_types.TYPES[optimizer.type].from_checkout:
            raise DGLSUserError(
                f"{path}: [optimizer] type = {given['type']!r} is diffusion-pipe's own (its optimizers/ folder), and "
                "the demo runs without a checkout: train it through a diffusion-pipe config, or use type = 'adamw'"
            )
        optimizer.probe()  # an own class that fails a step: one line now
        values["lr"] = optimizer.lr
    return DemoSettings(**values, model=model, dtype=DTYPES[dtype_name], optimizer=optimizer)
