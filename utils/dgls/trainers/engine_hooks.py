"""Where DGLS joins a DeepSpeed engine when it trains streamed layers on the host.

Host-trained params (:mod:`..training.host_training`) hold no ``.grad`` at the optimizer step (their gradients
are summed in host memory) and their optimizer state lives on the host. For the duration of a run,
:class:`EngineHooks` wraps four methods of DeepSpeed's engines, for engines whose module has host
training (``find(module)``; other engines pass straight through, but for a resume's check that the
checkpoint holds no host optimizer state for them):

- ``PipelineEngine.train_batch``: the host training reads the trainer's current learning rate from
  this engine (for updates that start during backward, when there is no clipping);
- in every wrapper, before the host training's state or step is used: it is handed the engine's params in order
  (:meth:`~..training.host_training.HostTraining.adopt`: a whole-step optimizer, such as Prodigy, steps every
  trainable one in one instance, as train.py's optimizer, built over them in this order, does);
- ``_take_model_step`` (once per ``train_batch``: clip, the trainer's optimizer step, zero grads, the
  LR scheduler):

  0. the host training's ``before_step``: under a VRAM budget the planner fixes its plan at the first step, before
     any update (:mod:`..planning.autoplan`: the layers it makes resident bring their gradients to the engine's
     optimizer);
  1. one gradient norm over the engine's params and the host-trained ones (summed over the pipeline
     stages, as DeepSpeed's own clipping does), its coefficient applied to both;
  2. DeepSpeed's step with its own clipping held off (the grads are clipped already; the norm taken in 1 is what
     ``get_global_grad_norm()`` returns after it, for the trainer's log), so the trainer's
     optimizer updates the resident params and the scheduler advances as usual (a whole step takes the resident
     params' gradients first: its instance updates them, and the trainer's finds none);
  3. the host updates, queued with the learning rate this step used (the trainer's first param group's,
     read before the scheduler moves it);
  4. per-layer values train.py logs from its own instance (Automagic's ``avg_lr``) copied into it for the streamed
     params (:meth:`~..training.host_training.HostTraining.mirror_logged_state`).

  ZeRO (DeepSpeed's own optimizer offload included) partitions and offloads the optimizer that DGLS
  replaces for streamed layers: refused with a message at the first step.
- ``save_checkpoint``: the model states hold the true weights already (state dicts read the host
  masters); the host optimizer's state is saved beside them, ``dgls_host_optimizer_stage{N}.pt`` in the
  checkpoint's tag folder (the names: :class:`~..training.shared_saves.HostStateName`), before DeepSpeed's save
  (which writes ``latest`` last: a save that stops part way leaves none naming it). Data parallel (``shared``,
  :mod:`..training.shared_saves`): each process saves its share, ``dgls_host_optimizer_stage{N}_rank{R}.pt``, then a
  barrier, then DeepSpeed's save runs while rank 0 holds every owner's masters. Files of the tag that this save does
  not write (an earlier save by another number of processes) are removed (by rank 0, or the one process).
- ``load_checkpoint``: before DeepSpeed loads, this stage's file (or its processes' files, merged: each process keeps
  the layers it owns now) is read and checked against the host training
  (:meth:`~..training.host_training.HostTraining.state_problem`: the same layers, shapes and optimizer kind), every
  process together (:func:`~..training.data_parallel.agree`); a checkpoint without it, or a file cut short or
  damaged, is one line (each file read by :func:`~..program.resume.read_host_state`, as the check before start-up
  reads it; written without host training, resuming would restart the moments silently). After DeepSpeed
  loaded (masters included, through the state-dict hooks) the host optimizers take the state. With
  ``load_optimizer_states=False`` (train.py's ``--reset_optimizer``) neither is read.

The patches are on the class, installed in ``__enter__`` and removed in ``__exit__``
(:class:`~..program.patches.Patches`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import DGLSUserError
from ..program.patches import Patches
from ..program.resume import read_host_state, resolve_tag
from ..training.data_parallel import agree, peer_failure
from ..training.host_training import HostTraining
from ..training.shared_saves import (
    HostStateName,
    SharedSaves,
    host_state_files,
    merged_host_state,
    stale_host_state_files,
)

FLAG = "--resume_from_checkpoint"  # train.py's flag, named in a resume's lines


class EngineHooks:
    """A context manager: while it is open, DeepSpeed steps and checkpoints include ``find(module)``'s host training."""

    def __init__(
        self,
        find: Callable[[nn.Module], HostTraining | None],
        keep_hyper_parameters: bool = False,
        shared: Callable[[nn.Module], SharedSaves | None] = lambda module: None,
    ) -> None:
        """``keep_hyper_parameters``: a resume keeps the host optimizers' settings as built, not as saved (train.py's
        ``--reset_optimizer_params`` does so for its own optimizer). ``shared``: the engine's data-parallel saves
        (:mod:`..training.shared_saves`), or None where one process trains the stage's host layers."""
        self.find = find
        self.keep_hyper_parameters = keep_hyper_parameters
        self.shared = shared
        self.patches = Patches()

    def __enter__(self) -> EngineHooks:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine

        self.patches.replace(PipelineEngine, "train_batch", self._wrap_train_batch)
        self.patches.replace(DeepSpeedEngine, "_take_model_step", self._wrap_step)
        self.patches.replace(DeepSpeedEngine, "save_checkpoint", self._wrap_save)
        self.patches.replace(DeepSpeedEngine, "load_checkpoint", self._wrap_load)
        return self

    def __exit__(self, *exc) -> None:
        self.patches.restore()

    def _wrap_train_batch(self, original):
        find = self.find

        def train_batch(engine, *args, **kwargs):
            training = find(engine.module)
            if training is not None:  # early host updates (no clipping) use the lr this step runs with
                training.adopt(engine.module.parameters())
                training.set_step_lr(engine.optimizer.param_groups[0]["lr"])
            return original(engine, *args, **kwargs)

        return train_batch

    def _wrap_step(self, original):
        find = self.find

        def take_model_step(engine, *args, **kwargs):
            training = find(engine.module)
            if training is None:
                return original(engine, *args, **kwargs)
            if engine.zero_optimization():
                raise DGLSUserError(
                    "DeepSpeed ZeRO partitions and offloads the optimizer, and DGLS already keeps the streamed layers' "
                    "optimizer on the host (beside the GPU's work): turn zero_optimization off (stage 0)"
                )
            training.before_step()  # the VRAM planner's plan, at the first step (before any update)
            training.adopt(engine.module.parameters())  # after the plan: a whole step sees the final placement
            max_norm = engine.gradient_clipping()
            if max_norm > 0 and not training.clipping:
                raise DGLSUserError(
                    f"DeepSpeed clips gradients (gradient_clipping = {max_norm}) but DGLS was set up without clipping "
                    "(clip_grads = False): set clip_grads = True"
                )
            norm = None
            if max_norm > 0:
                norm = training.clip_grad_norm_(engine.module.parameters(), max_norm, reduce=_stage_sum(engine))
            training.take_resident_grads()
            groups = engine.optimizer.param_groups
            lr = groups[0]["lr"] if groups else None
            config = engine._config
            config.gradient_clipping = 0.0  # clipped above, host params included
            try:
                result = original(engine, *args, **kwargs)
            finally:
                config.gradient_clipping = max_norm
            if norm is not None:  # get_global_grad_norm()'s, for train.py's log (DeepSpeed's step took none, or one
                # of its optimizer's grads alone, clipped already)
                engine._global_grad_norm = float(norm)
            training.step(lr=lr)
            training.mirror_logged_state(engine.optimizer, engine.device)  # what train.py logs of its instance
            return result

        return take_model_step

    def _wrap_save(self, original):
        find, find_shared = self.find, self.shared

        def save_checkpoint(engine, save_dir, tag=None, *args, **kwargs):
            training, shared = find(engine.module), find_shared(engine.module)
            tag = tag if tag is not None else f"global_step{engine.global_steps}"
            if training is None:
                return original(engine, save_dir, tag, *args, **kwargs)
            grid, stage = getattr(engine, "grid", None), _stage(engine)
            rank = shared.ownership.rank if shared is not None else None  # data parallel: this process's share
            # the host state first: DeepSpeed's save writes ``latest`` at its end, so a save that stops part way
            # leaves no ``latest`` naming a checkpoint without it (the tag folder is made here if DeepSpeed has not).
            # Data parallel: every owner writes its share; else one process per stage writes the stage's file.
            if shared is not None or grid is None or grid.get_data_parallel_id() == 0:
                training.adopt(engine.module.parameters())
                folder = Path(save_dir) / str(tag)
                folder.mkdir(parents=True, exist_ok=True)
                if rank is None or rank == 0:
                    _remove_stale(folder, stage, shared.ownership.size if shared is not None else None)
                torch.save(training.state_dict(), folder / HostStateName(stage, rank).name)
            if shared is not None:  # every share written before rank 0 writes the masters (and ``latest``)
                with peer_failure("a checkpoint's save"):
                    torch.distributed.barrier()
            with shared.owners_masters() if shared is not None else contextlib.nullcontext():
                return original(engine, save_dir, tag, *args, **kwargs)  # rank 0 writes every layer's masters

        return save_checkpoint

    def _wrap_load(self, original):
        find, keep, find_shared = self.find, self.keep_hyper_parameters, self.shared

        def load_checkpoint(engine, load_dir, tag=None, *args, **kwargs):
            training = find(engine.module)
            state, problem = None, None
            if kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False):
                try:
                    run_dir, tag = resolve_tag(load_dir, tag)
                    shared = find_shared(engine.module)
                    state = _read_host_state(training, engine.module, run_dir, tag, _stage(engine), keep, shared)
                except DGLSUserError as exc:
                    problem = str(exc)
            agree(problem)  # before DeepSpeed loads anything, every process together
            result = original(engine, load_dir, tag, *args, **kwargs)
            if state is not None:
                training.load_state_dict(state, keep_hyper_parameters=keep)
            return result

        return load_checkpoint


def _read_host_state(
    training: HostTraining | None,
    module: nn.Module,
    run_dir: Path,
    tag: str,
    stage: int,
    keep_hyper_parameters: bool,
    shared: SharedSaves | None = None,
) -> dict | None:
    """Pipeline ``stage``'s host optimizer state from its file(s) in the checkpoint ``run_dir/tag``, checked against
    ``training`` (None: this stage trains nothing on the host, and the checkpoint must hold nothing for it either) as
    it will be loaded (``keep_hyper_parameters``: the run's settings, not the saved ones); ``module``: the engine's,
    whose params the host training is handed first (a whole step's instance is built over them). The stage's one
    file, or a data-parallel save's file per process instead (:mod:`..training.shared_saves`), read together; with
    ``shared`` this process keeps only the layers it owns (any number of processes may have saved them)."""
    folder = run_dir / tag
    files = host_state_files(folder, stage)
    if training is None:
        if files:
            raise DGLSUserError(
                f"{files[0]} holds the host optimizer state of streamed layers, and this run trains no layer of this "
                "pipeline stage on the host: resume with the placement it was saved with (the same --blocks_to_swap "
                "or --gpu_layers), or pass --reset_optimizer to start the optimizer afresh"
            )
        return None
    if not files:
        raise DGLSUserError(
            f"the checkpoint in {folder} has no DGLS host optimizer state ({HostStateName(stage).name}): it was saved "
            "without full fine-tuning of streamed layers on this pipeline stage; resume it the way it was trained, or "
            "pass --reset_optimizer to start the optimizer afresh"
        )

    def read(file: Path) -> object:  # mapped: each process reads only the layers it keeps (merged_host_state copies)
        return read_host_state(file, run_dir, tag, FLAG)

    training.adopt(module.parameters())
    every = shared.layers if shared is not None else set(training.layers)
    state, problem = merged_host_state(files, read, set(training.layers), every)
    if problem is not None:
        raise DGLSUserError(f"the checkpoint in {folder} {problem}")
    if (problem := training.state_problem(state, keep_hyper_parameters)) is None:
        return state
    raise DGLSUserError(f"{files[0] if len(files) == 1 else folder} {problem}")


def _stage(engine) -> int:
    """The engine's pipeline stage (0 without a pipeline grid)."""
    return engine.grid.get_pipe_parallel_rank() if getattr(engine, "grid", None) is not None else 0


def _remove_stale(folder: Path, stage: int, processes: int | None) -> None:
    """The host optimizer files of ``stage`` in the tag ``folder`` that this save (by ``processes`` data-parallel
    processes, None: one) does not write, removed: left by an earlier save of the same tag, a resume would read
    them too."""
    for stale in stale_host_state_files(folder, stage, processes):
        stale.unlink(missing_ok=True)


def _stage_sum(engine) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Sum a squared norm over the pipeline stages (each holds its own layers' grads)."""
    if not getattr(engine, "is_pipe_parallel", False) or engine.num_stages == 1:
        return None
    import torch.distributed as dist

    group = engine.grid.get_pipe_parallel_group()

    def reduce(squared: torch.Tensor) -> torch.Tensor:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        value = squared.to(device)
        dist.all_reduce(value, group=group)
        return value.cpu()

    return reduce
