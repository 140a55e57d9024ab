"""Train the demo model through DeepSpeed's pipeline engine, the way diffusion-pipe does.

``PipelineModule`` from a layer list, ``deepspeed.initialize``, ``train_batch``: the same
path diffusion-pipe takes, so the demo exercises the real DeepSpeed integration,
including keeping DeepSpeed from moving streamed layers to the device. A config without
``[adapter]`` trains every weight: streamed layers on the host (:mod:`..training.host_training`), joined to
DeepSpeed's optimizer step by :class:`~..trainers.engine_hooks.EngineHooks`. Every setting was checked before this
runs (``utils/dgls/program/validate.py``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.swapper import LayerSwapper
from ..errors import DGLSUserError, RunInterrupted, say
from ..memory.layout import human_bytes
from ..memory.monitor import MemoryMonitor
from ..memory.shm_space import check_before_start
from ..program.distributed import destroy_process_group
from ..program.paths import new_run_dir
from ..program.rendezvous import peers_arrived
from ..program.stop_signals import stop_signal_received, stops_as
from ..program.validate import DemoRun, accumulation_note
from ..trainers.engine_hooks import EngineHooks
from ..trainers.interleaved_steps import train_batch_block
from ..trainers.joined_backward import joined_backward
from ..trainers.layer_major_batches import layer_major_batches
from ..trainers.pipeline_hook import Stage, StageHook
from ..trainers.shm_op import without_shm_op
from ..training.shared_saves import SharedSaves
from ..watching.stats import StepReader, StepWindow
from .data import SyntheticLatents
from .model import BLOCK_CLASSES, add_lora, build_layers
from .settings import DemoSettings

PLAN_STEP_LIMIT = 100  # --plan stops when the planner has its plan (after the probe); never trains past this


@dataclass
class DemoResult:
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    bytes_streamed: int = 0
    peak_vram_bytes: int = 0
    pinned_bytes: int = 0
    lora_path: Path | None = None  # the saved weights: the LoRA, or the whole model for a full fine-tune
    lora: dict[str, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def quiet_deepspeed() -> Iterator[io.StringIO]:
    """DeepSpeed's start-up chatter (its accelerator warning, PipelineModule's layer listing, the
    topology) says nothing a demo user needs: it goes to a buffer, replayed on stderr if
    something fails inside (a bug: a user mistake or Ctrl-C stays one line, and so does a failure
    that follows a stop signal, such as the interrupted compiler's ``RuntimeError``:
    :func:`..program.stop_signals.stop_signal_received`). Its logger is held at ERROR for the block."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    muted = _BelowError()
    logger.addFilter(muted)  # DeepSpeed sets its level again when it is first imported; a filter stays
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield buffer
    except DGLSUserError:
        raise
    except Exception:
        if not stop_signal_received():
            sys.stderr.write(buffer.getvalue())
        raise
    finally:
        logger.removeFilter(muted)
        logger.setLevel(level)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def _init_distributed(run: DemoRun) -> None:
    """A one-process group (or the launcher's), with the environment checked in validate; without
    DeepSpeed's CPU shared-memory op, which training never uses (:mod:`..trainers.shm_op`)."""
    import deepspeed

    os.environ.update(run.dist.env)
    if not torch.distributed.is_initialized():
        backend = "nccl" if run.device.type == "cuda" else "gloo"
        with without_shm_op():
            deepspeed.init_distributed(dist_backend=backend, verbose=False)


def run_demo(run: DemoRun, log: Callable[[str], None] = say, progress: bool | None = None) -> DemoResult:
    """Build, place, train and save; returns the losses and figures for the summary.
    ``progress``: show a progress bar (default: when stderr is a terminal)."""
    from tqdm import tqdm

    if progress is None:
        progress = sys.stderr.isatty()
    if progress and log is say:  # lines printed during training (the profile, the planner) keep the bar intact
        log = lambda line: tqdm.write(line + "\n", end="")  # noqa: E731 (one write: errors.say)
    s, device = run.settings, run.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # a job whose processes will share host memory checks that /dev/shm takes files (:mod:`..memory.shm_space`) before
    # its processes meet, as the drop-in does: each refuses on its own instead of waiting for the others
    check_before_start(run.dist, s.pipeline_stages, run.values["dynamic_swapping"], os.environ)
    try:
        with peers_arrived(run.dist), quiet_deepspeed():
            _init_distributed(run)
    except KeyboardInterrupt:
        raise _interrupted(0, s.steps) from None
    rank = torch.distributed.get_rank()
    held = HeldLog(log)  # each stage's first replica prints its placement
    if rank != 0:  # one voice for the rest: rank 0 prints the steps (stats of every process) and saves
        log, progress = (lambda line: None), False
    placed: dict = {}

    def install(stage: Stage) -> LayerSwapper:
        """This process's pipeline stage is built: place its layers (each stage's first replica speaks)."""
        speak = held if stage.data_parallel_id == 0 else (lambda line: None)
        swap = run.swap.for_stage(stage.start, stage.stop, stage.layer_count)
        placed["swapper"] = LayerSwapper(
            stage.layers, swap, device=device, log=lambda line: speak(stage.label + line), share_group=stage.share_group
        )
        return placed["swapper"]

    result, finished, planned_only = DemoResult(), False, False
    try:
        with stops_as(lambda: _interrupted(len(result.losses), s.steps)):
            torch.manual_seed(s.seed)
            layers = build_layers(s.model, seed=s.seed, dtype=s.dtype)
            if s.full:
                for layer in layers:
                    layer.requires_grad_(True)
            else:
                add_lora(layers, rank=s.lora_rank, seed=s.seed)
            hook = StageHook(install) if run.values["dynamic_swapping"] else contextlib.nullcontext()
            if not run.values["dynamic_swapping"]:
                log("DGLS: dynamic swapping off; every layer is resident")
            with quiet_deepspeed(), hook:
                engine = _engine(run, layers)
            held.release()  # the placement table, printed once DeepSpeed's start-up is past
            swapper = placed.get("swapper")
            training = swapper.training if swapper is not None else None
            lazy = run.values["lazy_lora_steps"]
            if s.micro_batches(lazy) > 1:
                log(accumulation_line(s, run.values))
            hooks = EngineHooks(lambda module: training) if training is not None else contextlib.nullcontext()
            with hooks, _step_order(run, engine, swapper, log):
                _train(run, engine, swapper, result, log, progress)
            planned_only = swapper is not None and run.values["plan"]  # --plan: measured and planned, nothing to save
            if not planned_only:
                result.lora = _gather_trained(layers, engine, s.full, SharedSaves.of(swapper))
            finished = True
    finally:
        if placed.get("swapper") is not None:
            placed["swapper"].remove()
        if finished:
            destroy_process_group()
    if rank != 0 or planned_only:
        return result
    from safetensors.torch import save

    what = "model" if s.full else "LoRA"
    path: Path | None = None
    try:
        data = save(result.lora)  # in memory first: a failed write is then Python's OSError, with its errno
        try:
            path = new_run_dir(s.output_dir) / ("model.safetensors" if s.full else "adapter_model.safetensors")
        except OSError as exc:
            raise DGLSUserError(cannot_save(exc, f"the trained {what}", len(data), s.output_dir)) from None
        write_whole(path, data, f"the trained {what}", s.output_dir)
        result.lora_path = path
        log(summary(result))
    except KeyboardInterrupt:
        saved = f"the {what} was saved to {path}" if path is not None and path.is_file() else "nothing was saved"
        raise RunInterrupted(f"stopped after all {s.steps} steps, while saving; {saved}") from None
    return result


def _step_order(run: DemoRun, engine, swapper: LayerSwapper | None, log: Callable[[str], None]):
    """How a step's passes run: layer-major where it applies (one stage); with several stages, each stage's backward
    once for all the tensors it sends on (:mod:`..trainers.joined_backward`; the stage's own log says so)."""
    if run.settings.runs_layer_major(run.values):
        return layer_major_batches(engine, swapper)
    if engine.num_stages > 1:
        return joined_backward(engine, swapper.log if swapper is not None else log)
    return contextlib.nullcontext()


def accumulation_line(s: DemoSettings, values: dict) -> str:
    """The start-up line of a step's micro-batches: how they run."""
    return accumulation_note(values, s.pipeline_stages, s.micro_batches(values["lazy_lora_steps"]))


def _interrupted(done: int, steps: int) -> RunInterrupted:
    """Ctrl-C, the same line during start-up (step 0) and training."""
    return RunInterrupted(
        f"stopped at step {done} of {steps}; nothing was saved (the demo saves its LoRA at the end, and has no "
        "checkpoint to resume from)"
    )


def cannot_save(exc: OSError, what: str, size: int, output_dir: Path) -> str:
    why = "its disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc))
    return (
        f"could not save {what} ({size / 2**20:.1f} MiB) under {output_dir}: {why}; nothing was saved and no run "
        "folder was left: free space there (or choose another output_dir) and run again"
    )


def write_whole(path: Path, data: bytes, what: str, output_dir: Path) -> None:
    """Write ``data`` to ``path``, the file of a new run folder: the whole file, or no file and no run folder.

    * the bytes go to a ``.partial`` file, renamed when complete: ``path`` never holds part of a save;
    * a write that fails (a disk that filled during training: the free space was checked before it) is one
      line that says so (:func:`cannot_save`), with the partial file and the run folder removed;
    * an interrupt (Ctrl-C, SIGTERM) before the rename removes them too and is raised on: ``path`` exists
      afterwards exactly when the save is whole."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    except BaseException as exc:
        if path.is_file():  # saved whole; only what came after the rename was interrupted
            raise
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # the run folder, empty now
        if isinstance(exc, OSError):
            raise DGLSUserError(cannot_save(exc, what, len(data), output_dir)) from None
        raise


class HeldLog:
    """Lines held back until :meth:`release` (while DeepSpeed's start-up output is muted), then passed on."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.lines = log, []

    def __call__(self, line: str) -> None:
        if self.lines is None:
            self.log(line)
        else:
            self.lines.append(line)

    def release(self) -> None:
        lines, self.lines = self.lines or [], None
        for line in lines:
            self.log(line)


def _gather_trained(layers: list, engine, full: bool, shared: SharedSaves | None) -> dict[str, torch.Tensor]:
    """The trained weights (the LoRA, or every weight of a full fine-tune: state dicts, so streamed layers
    give their host masters), each layer's from the first data-parallel replica of the pipeline stage that trained it
    (on rank 0; {} elsewhere). Where the replicas share its training (``shared``: data parallel on one stage, rank 0
    the first replica) the other owners send rank 0 their masters for it (:mod:`..training.shared_saves`)."""
    module = engine.module
    local = {}
    with shared.owners_masters() if shared is not None else contextlib.nullcontext():
        if engine.grid.get_data_parallel_id() == 0:
            for i in range(module._local_start, module._local_stop):
                trainable = {name for name, p in layers[i].named_parameters() if p.requires_grad}
                for name, value in layers[i].state_dict().items():
                    if full or name in trainable:
                        local[f"layers.{i}.{name}"] = value.detach().to("cpu", torch.float32).contiguous()
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()} if torch.distributed.get_rank() == 0 else {}


def _engine(run: DemoRun, layers):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    s = run.settings
    ckpt = s.activation_checkpointing
    pipeline = PipelineModule(
        layers=layers,
        num_stages=s.pipeline_stages,
        loss_fn=lambda out, target: F.mse_loss(out.float(), target.float()),
        partition_method="uniform",
        activation_checkpoint_interval=1 if ckpt else 0,
        activation_checkpoint_func=partial(torch.utils.checkpoint.checkpoint, use_reentrant=ckpt == "reentrant"),
        checkpointable_layers=list(BLOCK_CLASSES),
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": s.batch_size,
        "gradient_accumulation_steps": s.micro_batches(run.values["lazy_lora_steps"]),
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        # A LoRA trains with DeepSpeed's bf16 optimizer (fp32 copies of the LoRA); a full fine-tune's resident
        # params train in their own dtype, as diffusion-pipe's do, and its clipping includes the host params.
        # Layer-major: each micro-batch's gradient goes into the bf16 optimizer's fp32 sums on its own (as a
        # sequential step's backward adds it there), not one bf16 sum of all of them (layer_major_batches.py).
        "bf16": {
            "enabled": s.dtype == torch.bfloat16 and not s.full,
            "immediate_grad_update": s.runs_layer_major(run.values),
        },
    }
    # This stage's LoRA (every layer's with one), or for a full fine-tune every trainable param, as diffusion-pipe's
    # train.py gives its optimizer: those the host trains have no gradient at its step (it skips them), and those
    # the VRAM planner makes resident before step 1's optimizer step bring theirs (planning/autoplan.py).
    local = [p for p in pipeline.parameters() if p.requires_grad]
    if s.full:  # the [optimizer] type's class, as diffusion-pipe's train.py builds it (sgd too)
        optimizer = s.optimizer.trainer_optimizer(local)
    else:
        optimizer = torch.optim.AdamW(local, lr=s.lr, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=pipeline, optimizer=optimizer, config=ds_config)
    return engine


def _train(run: DemoRun, engine, swapper, result: DemoResult, log, progress: bool) -> None:
    """The step loop; with --plan it runs until the planner has printed its plan, and no further."""
    from tqdm import tqdm

    s, device, values = run.settings, run.device, run.values
    plan = swapper is not None and values["plan"]
    data = SyntheticLatents(
        s.model, samples=s.samples, image_tokens=s.image_tokens, text_tokens=s.text_tokens, seed=s.seed
    )
    shard = (engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size())
    batches = data.batches(s.batch_size, s.dtype, device, shard)
    steps = PLAN_STEP_LIMIT if plan else s.steps
    bar = tqdm(range(steps), desc="demo", unit="step", disable=not progress or plan, dynamic_ncols=True)
    monitor = MemoryMonitor(device, lambda: swapper.pinned_bytes if swapper is not None else 0)
    window = StepWindow(values["verbose_every"], s.steps, device.type)
    reader = StepReader(swapper) if swapper is not None else None
    for step in bar:
        start = time.perf_counter()
        with train_batch_block(engine, swapper):  # several stages: the planner acts between steps only
            loss = engine.train_batch(data_iter=batches).item()
        reading = monitor.read()
        stats = reader.end() if reader is not None else None  # this step, every process's together
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # so the next step reports its own peak
        if plan:
            if swapper.plan_finished:
                log("DGLS: --plan: stopping after the probe; nothing was saved")
                return
            continue
        result.step_seconds.append(time.perf_counter() - start)
        result.losses.append(loss)
        line = f"step {step + 1}: loss {loss:.4f}, {result.step_seconds[-1] * 1000:.0f} ms"
        if stats is not None:
            result.bytes_streamed += stats.bytes_moved
            result.peak_vram_bytes = max(result.peak_vram_bytes, stats.peak_vram_bytes)
            result.pinned_bytes = stats.pinned_bytes
            line += "; " + (stats.line(device.type) if values["verbose"] else stats.short())
        bar.set_postfix(loss=f"{loss:.4f}")
        log(line)
        for warning in monitor.warnings(reading):
            log(warning)
        if values["verbose"] and (text := window.add(result.step_seconds[-1], stats)):
            log(f"DGLS {text}\nDGLS {reading.line()}")
    if plan:
        raise RuntimeError(f"the planner gave no plan in {PLAN_STEP_LIMIT} steps")
    if values["verbose"] and (text := window.flush()):
        log(f"DGLS {text}")
    if device.type == "cuda" and swapper is None:
        result.peak_vram_bytes = torch.cuda.max_memory_allocated(device)


def summary(r: DemoResult) -> str:
    median = statistics.median(r.step_seconds) * 1000 if r.step_seconds else 0.0
    vram = human_bytes(r.peak_vram_bytes) if r.peak_vram_bytes else "n/a (CPU)"
    return (
        f"DGLS demo finished: loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f} over {len(r.losses)} steps; "
        f"median step {median:.0f} ms; peak VRAM {vram}; "
        f"pinned RAM {human_bytes(r.pinned_bytes)}; streamed {human_bytes(r.bytes_streamed)}; "
        f"{'model' if r.lora_path and r.lora_path.name == 'model.safetensors' else 'LoRA'} saved to {r.lora_path}"
    )
