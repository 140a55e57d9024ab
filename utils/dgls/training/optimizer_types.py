"""diffusion-pipe's ``[optimizer]`` types: how DGLS trains streamed layers with each, or why it refuses it.

Streamed layers' params train on the host, on fp32 masters. :data:`TYPES` records, for every type diffusion-pipe's
``train.py`` builds (its ``get_optimizer``), what reading the class's source decided:

- ``adamw``, ``sgd``: DGLS's own kernels (:mod:`.host_optimizer`: host, device or split); ``adamw_optimi`` and
  ``offload`` (torchao's CPUOffloadOptimizer, which steps ``torch.optim.AdamW(fused=True)`` on the CPU, one per
  param) run as ``adamw``, the start-up line says how;
- ``per_layer``: the class diffusion-pipe builds, imported from where it imports it (a library, or the checkout's
  own ``optimizers/`` folder, on ``sys.path`` in a drop-in run), with the table's keyword arguments as given and
  diffusion-pipe's param groups, built once per layer on the host masters and stepped as the layer's gradients
  land. That gives each param the update one optimizer over every param gives it exactly when the step is *per
  param*: each param's update reads only that param's gradient and state, and group values that every layer's
  optimizer holds alike (lr, betas, a step count that advances once a step; schedule-free's ``weight_sum`` and
  ``lr_max``, which follow from the step count and the lr). A type marked ``on_device`` steps on the training
  device by default, its class's own state streamed from host memory: ``AdamW8bit`` with its class's own kernel
  (:mod:`.bitsandbytes_kernel`), ``Lion`` with the ops of its class's step (:class:`.optimizer_kernels.LionKernel`);
  ``--host_adam torch`` keeps it on the CPU;
- ``whole_step``: the class reads sums over every param in its step (Prodigy's and D-Adaptation's step size d):
  one instance over every trained param of the pipeline stage, as train.py's one optimizer is, stepped once after
  the backward (:mod:`.whole_step`);
- ``refused``: one line naming the nearest type that trains, and why.

Invariants
    - Every name diffusion-pipe handles itself (its lower-cased types) is a key here; other names are classes of
      ``pytorch_optimizer``, looked up by exact name as ``train.py`` does (``getattr``); one not listed here is
      refused as unchecked (DGLS has not read its step), never run on a guess.
    - A library is imported only when its type is used; a missing one is one line naming the pip package.
    - Kahan summation (AdamW8bitKahan, optimi, Automagic) compensates the rounding of bf16 weights; DGLS's masters
      are fp32, where optimi and Automagic turn it off and AdamW8bitKahan (which always runs it) carries only fp32
      rounding; the start-up line says so.
    - The host RAM an own class's state takes is measured on the class (:mod:`.optimizer_state`), never guessed
      here.
    - Schedule-free classes keep two weight sequences and swap their average in with ``optimizer.eval()``; train.py
      never calls it (nor does DeepSpeed), so diffusion-pipe evaluates and saves the training sequence, and so does
      DGLS.
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

    # "adamw" / "sgd": DGLS's kernels; "per_layer": the class on the host, one per layer; "whole_step": one instance
    # over every trained param, stepped after the backward; "refused"
    runs: str
    source: str = ""  # per_layer and whole_step: "module:Class", as diffusion-pipe imports it
    packages: tuple[tuple[str, str], ...] = ()  # (module to import, pip package) the class needs
    note: str = ""  # what the start-up line adds
    refusal: str = ""  # refused: why, and the nearest type that trains
    fallback: str = ""  # per_layer: the nearest type, for the line that says the class fails with this library
    # per_layer: why no version of its library runs the class on the CPU, where one line says the class fails (else
    # the line says to install a version it runs with)
    library_note: str = ""
    # per_layer: state keys train.py's logging reads from its own instance for every param (Automagic's avg_lr),
    # which DGLS copies there for the streamed params (HostTraining.mirror_logged_state)
    logged_state: tuple[str, ...] = ()
    # per_layer: the class's step has a device kernel (.optimizer_kernels.kernel_for) that steps its own state
    on_device: bool = False

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
GLOBAL_D = "its step size is estimated from sums over every param, as in train.py's one optimizer of the stage"
SCHEDULE_FREE = (
    "its group values (step, lr_max, weight_sum) are alike in every layer's optimizer; train.py never calls "
    "optimizer.eval(), so it saves the training weights, as DGLS does"
)

# diffusion-pipe's own names (train.py lower-cases them), then the pytorch_optimizer classes whose source was read.
TYPES: dict[str, OptimizerType] = {
    "adamw": OptimizerType("adamw"),
    "adamw_optimi": OptimizerType("adamw"),
    "sgd": OptimizerType("sgd"),
    "adamw8bit": OptimizerType(
        "per_layer",
        "bitsandbytes.optim:AdamW8bit",
        BNB,
        note="its moments blockwise 8-bit",
        fallback="'adamw' (bitsandbytes runs 8-bit optimizers on the CPU from version 0.50)",
        on_device=True,
    ),
    "adamw8bitkahan": OptimizerType(
        "per_layer",
        "optimizers.adamw_8bit:AdamW8bitKahan",
        BNB,
        note="bitsandbytes' blockwise 8-bit moments; its Kahan summation is for bf16 weights: on the fp32 masters "
        "it carries only fp32 rounding",
        # its update_step reads percentile_clipping and block_wise, which bitsandbytes 0.50 (the first with 8-bit CPU
        # kernels) dropped from get_config: train.py's own instance fails its first step with them too
        library_note="bitsandbytes 0.50 and later dropped the percentile_clipping setting its step reads, so "
        "train.py's own AdamW8bitKahan fails its first step with those versions too, and earlier versions have no "
        "CPU step",
        # its update runs on a zeroed buffer (shift) that is then added to the weight: the weight decay decays that
        # buffer, not the weight (tests/test_optimizer_types_cpu.py measures the equality on the class)
        fallback="type = 'adamw8bit' with weight_decay = 0: AdamW8bitKahan applies its weight decay to its rounding "
        "buffer, not to the weights, so on DGLS's fp32 masters it steps as AdamW8bit without weight decay, up to "
        "fp32 rounding",
    ),
    "stableadamw": OptimizerType("per_layer", "optimi:StableAdamW", OPTIMI, note=f"per-param update RMS; {KAHAN_FP32}"),
    "automagic": OptimizerType(
        "per_layer",
        "optimizers.automagic:Automagic",
        (("optimum.quanto", "optimum-quanto"),),
        # its per-element lr mask, polarity and RMS are each param's own; its lr bounds and bump the instance's
        note=f"its per-element learning rates are its own, as in diffusion-pipe; {KAHAN_FP32}",
        logged_state=("avg_lr",),  # train.py's _get_automagic_lrs stacks it over every param of its instance
    ),
    # train.py: CPUOffloadOptimizer(groups, torch.optim.AdamW, fused=True, **table): an AdamW per param on the CPU
    "offload": OptimizerType("adamw", packages=(("torchao", "torchao"),)),
    "genericoptim": OptimizerType(
        "refused",
        refusal="use 'adamw' (GenericOptim's default, ema momentum and second moment, is AdamW with eps = 1e-6): "
        "GenericOptim is built for the GPU: its Muon variants orthogonalize each 2-D gradient with torch.compile'd "
        "bf16 matrix products, each step reduces a gradient norm over the pipeline's model-parallel group, and "
        "train.py gives it param groups of its own (2-D params apart, projection settings moved to them), none of "
        "which DGLS runs on the host for streamed layers yet",
    ),
    # pytorch_optimizer (train.py: getattr(pytorch_optimizer, type)): per-param steps, read in its source
    "Lion": OptimizerType("per_layer", "pytorch_optimizer:Lion", PYTORCH_OPTIMIZER, on_device=True),
    "ADOPT": OptimizerType("per_layer", "pytorch_optimizer:ADOPT", PYTORCH_OPTIMIZER),
    "AdEMAMix": OptimizerType("per_layer", "pytorch_optimizer:AdEMAMix", PYTORCH_OPTIMIZER),
    "CAME": OptimizerType("per_layer", "pytorch_optimizer:CAME", PYTORCH_OPTIMIZER),
    # a step size d from sums over every param of the instance: whole_step
    **{
        name: OptimizerType("whole_step", f"pytorch_optimizer:{name}", PYTORCH_OPTIMIZER, note=GLOBAL_D)
        for name in ("Prodigy", "DAdaptAdam", "DAdaptAdan", "DAdaptAdaGrad", "DAdaptLion", "DAdaptSGD")
    },
    # schedule-free: per-param steps; train.py saves the training weights (it never swaps the average in)
    **{
        name: OptimizerType("per_layer", f"pytorch_optimizer:{name}", PYTORCH_OPTIMIZER, note=SCHEDULE_FREE)
        for name in ("ScheduleFreeAdamW", "ScheduleFreeRAdam", "ScheduleFreeSGD")
    },
    "ScheduleFreeWrapper": OptimizerType(
        "refused",
        refusal="use 'ScheduleFreeAdamW': ScheduleFreeWrapper takes the optimizer it wraps as its first argument, "
        "where train.py passes the param groups, so train.py cannot build it either",
    ),
}
PER_LAYER = tuple(name for name, entry in TYPES.items() if entry.runs == "per_layer")
WHOLE_STEP = tuple(name for name, entry in TYPES.items() if entry.runs == "whole_step")
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
            "with optimizers whose step it has read (one per layer, stepped as the layer's gradients land, where the "
            "step is per param; one over every param, stepped after the backward, where it sums over them)"
            f"{hint}: use one of {', '.join(repr(t) for t in RUNNING)}, or train a LoRA"
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
