"""diffusion-pipe's ``[optimizer]`` types: how DGLS trains streamed layers with each, or why it refuses it.

Streamed layers' params train on the host, on fp32 masters, one optimizer per layer that steps as the layer's
gradients land (:mod:`.host_training`). That gives each param the update one optimizer over every param would give
it exactly when the optimizer's step is *per param*: each param's update reads only that param's gradient and
state, and group settings that every layer's optimizer sees alike (lr, betas, a step count that advances once a
step). :data:`TYPES` records, for every type diffusion-pipe's ``train.py`` builds (its ``get_optimizer``), what
reading the class's source decided:

- ``adamw``, ``adamw_optimi``, ``sgd``: DGLS's own kernels (:mod:`.host_optimizer`: host, device or split);
- ``per_layer``: the class diffusion-pipe builds, imported from where it imports it (a library, or the checkout's
  own ``optimizers/`` folder, on ``sys.path`` in a drop-in run), with the table's keyword arguments as given and
  diffusion-pipe's param groups, built once per layer on the host masters and stepped there;
- ``refused``: one line naming the nearest type that trains, and why: a step that reads state over every param
  (Prodigy's and D-Adaptation's step size, summed over all params), or weights the optimizer swaps in for saving
  (schedule-free), or a class that runs on the GPU only.

Invariants
    - Every name diffusion-pipe handles itself (its lower-cased types) is a key here; other names are classes of
      ``pytorch_optimizer``, looked up by exact name as ``train.py`` does (``getattr``); one not listed here is
      refused as unchecked (DGLS has not read its step), never run on a guess.
    - A library is imported only when its type is used; a missing one is one line naming the pip package.
    - Kahan summation (AdamW8bitKahan, optimi, Automagic) compensates the rounding of bf16 weights; DGLS's masters
      are fp32, where optimi and Automagic turn it off and AdamW8bitKahan (which always runs it) carries only fp32
      rounding; the start-up line says so.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from ..errors import DGLSUserError
from ..spelling import did_you_mean


@dataclass(frozen=True)
class OptimizerType:
    """How DGLS trains streamed layers with one ``[optimizer]`` type (see the module doc)."""

    runs: str  # "adamw" / "sgd": DGLS's kernels; "per_layer": the class on the host, one per layer; "refused"
    source: str = ""  # per_layer: "module:Class", as diffusion-pipe imports it
    packages: tuple[tuple[str, str], ...] = ()  # (module to import, pip package) the class needs
    state_bytes: int = 8  # host bytes of optimizer state per param (at most), for the RAM figure
    note: str = ""  # per_layer: what the start-up line adds
    refusal: str = ""  # refused: why, and the nearest type that trains
    fallback: str = ""  # per_layer: the nearest type, for the line that says the class fails with this library

    @property
    def from_checkout(self) -> bool:
        """The class is diffusion-pipe's own (its ``optimizers/`` folder), importable only in a drop-in run."""
        return self.source.startswith("optimizers.")

    @property
    def class_name(self) -> str:
        module, name = self.source.split(":")
        return f"{module}.{name}"


BNB = (("bitsandbytes", "bitsandbytes"),)
OPTIMI = (("optimi", "torch-optimi"),)
PYTORCH_OPTIMIZER = (("pytorch_optimizer", "pytorch-optimizer"),)
KAHAN_FP32 = "its Kahan summation is for bf16 weights, and the masters are fp32: it changes nothing here"
PER_PARAM_SUM = (
    "step size is estimated from sums over every param of the group, which one optimizer per streamed "
    "layer cannot see (DGLS steps each layer as its gradients land)"
)
SCHEDULE_FREE = (
    "schedule-free keeps two weight sequences and swaps their average in for evaluation and saving "
    "(optimizer.eval()), which DGLS's host masters do not follow"
)

# diffusion-pipe's own names (train.py lower-cases them), then the pytorch_optimizer classes whose source was read.
TYPES: dict[str, OptimizerType] = {
    "adamw": OptimizerType("adamw"),
    "adamw_optimi": OptimizerType("adamw"),
    "sgd": OptimizerType("sgd", state_bytes=4),
    "adamw8bit": OptimizerType(
        "per_layer",
        "bitsandbytes.optim:AdamW8bit",
        BNB,
        state_bytes=4,  # two uint8 moments and their blockwise absmax (32-bit below 4096 elements)
        note="its moments blockwise 8-bit",
        fallback="'adamw' (bitsandbytes runs 8-bit optimizers on the CPU from version 0.50)",
    ),
    "adamw8bitkahan": OptimizerType(
        "per_layer",
        "optimizers.adamw_8bit:AdamW8bitKahan",
        BNB,
        state_bytes=8,  # bitsandbytes' two 8-bit moments and the fp32 Kahan shift
        note="bitsandbytes' blockwise 8-bit moments; its Kahan summation is for bf16 weights: on the fp32 masters "
        "it carries only fp32 rounding",
        # its update_step reads percentile_clipping, which bitsandbytes 0.50 (the first with 8-bit CPU kernels) dropped
        fallback="'adamw8bit', bitsandbytes' own blockwise 8-bit AdamW (on fp32 masters Kahan summation has only "
        "fp32 rounding to make up for)",
    ),
    "stableadamw": OptimizerType(
        "per_layer", "optimi:StableAdamW", OPTIMI, state_bytes=8, note=f"per-param update RMS; {KAHAN_FP32}"
    ),
    "automagic": OptimizerType(
        "per_layer",
        "optimizers.automagic:Automagic",
        (("optimum.quanto", "optimum-quanto"),),
        state_bytes=8,  # 8-bit lr mask, polarity, factored second moment (4 bytes for 1-D params)
        note=f"its per-element learning rates are its own, as in diffusion-pipe; {KAHAN_FP32}",
    ),
    "offload": OptimizerType(
        "refused",
        refusal="use 'adamw': torchao's CPUOffloadOptimizer runs torch.optim.AdamW(fused=True) on the CPU, which is "
        "what DGLS already runs for streamed layers, and built by train.py over them it would keep a second pinned "
        "copy of each",
    ),
    "genericoptim": OptimizerType(
        "refused",
        refusal="use 'adamw' (GenericOptim's default, ema momentum and second moment): GenericOptim splits its "
        "param groups by diffusion-pipe's own rules (Muon on 2-D params), reduces a norm over the pipeline's "
        "model-parallel group and keeps CUDA tensors, none of which DGLS maps to host steps per layer yet",
    ),
    # pytorch_optimizer (train.py: getattr(pytorch_optimizer, type)): per-param steps, read in its source
    "Lion": OptimizerType("per_layer", "pytorch_optimizer:Lion", PYTORCH_OPTIMIZER, state_bytes=4),
    "ADOPT": OptimizerType("per_layer", "pytorch_optimizer:ADOPT", PYTORCH_OPTIMIZER),
    "AdEMAMix": OptimizerType("per_layer", "pytorch_optimizer:AdEMAMix", PYTORCH_OPTIMIZER, state_bytes=12),
    "CAME": OptimizerType("per_layer", "pytorch_optimizer:CAME", PYTORCH_OPTIMIZER),
    "Prodigy": OptimizerType("refused", refusal=f"use 'adamw' with an lr of your own: Prodigy's {PER_PARAM_SUM}"),
    **{
        name: OptimizerType(
            "refused", refusal=f"use '{nearest}' with an lr of your own: D-Adaptation's {PER_PARAM_SUM}"
        )
        for name, nearest in (
            ("DAdaptAdam", "adamw"),
            ("DAdaptAdan", "adamw"),
            ("DAdaptAdaGrad", "adamw"),
            ("DAdaptLion", "Lion"),
            ("DAdaptSGD", "sgd"),
        )
    },
    **{
        name: OptimizerType("refused", refusal=f"use '{nearest}': {SCHEDULE_FREE}")
        for name, nearest in (
            ("ScheduleFreeAdamW", "adamw"),
            ("ScheduleFreeRAdam", "adamw"),
            ("ScheduleFreeSGD", "sgd"),
            ("ScheduleFreeWrapper", "adamw"),
        )
    },
}
PER_LAYER = tuple(name for name, entry in TYPES.items() if entry.runs == "per_layer")
RUNNING = tuple(name for name, entry in TYPES.items() if entry.runs != "refused")


def lookup(given: str) -> tuple[str, OptimizerType]:
    """The :data:`TYPES` key and entry of ``[optimizer] type = given`` (diffusion-pipe's own names in any case,
    pytorch_optimizer's by exact name); a refused or unchecked type is one line naming the nearest that trains."""
    name = given.lower() if given.lower() in TYPES else given  # diffusion-pipe's own names are lower-case keys
    if name not in TYPES:
        by_case = {key.lower(): key for key in TYPES if not key.islower()}
        if given.lower() in by_case:
            right = by_case[given.lower()]
            raise DGLSUserError(
                f"[optimizer] type = {given!r}: train.py looks pytorch_optimizer's classes up by their exact name: "
                f"write type = {right!r}"
            )
        hint = did_you_mean(given, TYPES, "'{}'")
        raise DGLSUserError(
            f"[optimizer] type = {given!r}: DGLS has not read this optimizer's step, and trains streamed layers only "
            "with optimizers whose step updates each param from its own state (one optimizer per layer, stepped as "
            f"the layer's gradients land){hint}: use one of {', '.join(repr(t) for t in RUNNING)}, or train a LoRA"
        )
    entry = TYPES[name]
    if entry.runs == "refused":
        raise DGLSUserError(f"[optimizer] type = {given!r} cannot train streamed layers: {entry.refusal}")
    return name, entry


def missing_package(name: str, entry: OptimizerType) -> str | None:
    """The one line for a type whose library is not installed, or None."""
    for module, package in entry.packages:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted name whose parent package is missing
            found = False
        if not found:
            return f"[optimizer] type = {name!r} needs the {module} package: pip install {package}"
    return None


def load_class(name: str, entry: OptimizerType) -> type:
    """The class diffusion-pipe builds for ``name``, imported from where it imports it."""
    if (problem := missing_package(name, entry)) is not None:
        raise DGLSUserError(problem)
    module_name, class_name = entry.source.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if entry.from_checkout and exc.name in ("optimizers", module_name):
            raise DGLSUserError(
                f"[optimizer] type = {name!r} is diffusion-pipe's own ({module_name.replace('.', '/')}.py in its "
                "checkout), which this run does not have: train through a diffusion-pipe config, or use one of "
                f"{', '.join(repr(t) for t in RUNNING if not TYPES[t].from_checkout)}"
            ) from None
        raise
    klass = getattr(module, class_name, None)
    if not isinstance(klass, type):
        raise DGLSUserError(
            f"[optimizer] type = {name!r}: {module_name} has no class {class_name} (too old a version?)"
        )
    return klass
