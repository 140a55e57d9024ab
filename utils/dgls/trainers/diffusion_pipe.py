"""diffusion-pipe drop-in: run a checkout's own, unmodified train.py with DGLS placing its layers.

Nothing of diffusion-pipe is copied. ``run_drop_in`` puts the checkout on ``sys.path``,
changes into it, sets ``sys.argv`` to train.py's own arguments and runs train.py with
``runpy`` as ``__main__``. The interceptions (see :class:`PipelineInterception`) are
installed for the run and removed after it. The main one (:mod:`.pipeline_hook`) gives the
layers train.py built with ``model.to_layers()`` a :class:`LayerSwapper` as soon as DeepSpeed's
``PipelineModule`` has built this process's pipeline stage, before it moves the module to the
GPU. Streamed params then point at device placeholders, so that move (and the one in
``deepspeed.initialize``) copies only resident weights. Under the deepspeed launcher every
process does this for its own GPU and its own stage; the step lines and TensorBoard get the
stats of every process together, from rank 0.

If the checkout lacks what the interception needs, the run stops before training with a
message naming the file or function. Every other input was checked before this runs
(``utils/dgls/program/validate.py``).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import toml

from ..engine.swapper import LayerSwapper
from ..errors import DGLSUserError, RunInterrupted, say
from ..memory.file_backed import weight_sources
from ..memory.monitor import MemoryMonitor, MemoryReading
from ..memory.shm_space import check_before_start
from ..program.distributed import destroy_process_group
from ..program.dp_config import run_dirs
from ..program.options import swap_config
from ..program.patches import Patches
from ..program.rendezvous import peers_arrived
from ..program.resume import ResumeChecks
from ..program.stop_signals import stops_as
from ..program.validate import DropInRun, layer_major_applies
from ..streaming.config import SwapConfig
from ..training.shared_saves import SharedSaves
from ..watching.stats import StepReader, StepStats, StepWindow
from .engine_hooks import EngineHooks
from .file_backed_casts import FileBackedCasts
from .interleaved_steps import train_batch_block
from .joined_backward import SaidOnce, joined_backward
from .layer_major_batches import layer_major_batches
from .pipeline_hook import Stage, StageHook
from .shm_op import without_shm_op


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PipelineInterception:
    """DGLS inside train.py for the duration of a run (a context manager). Installs:

    * DeepSpeed's ``PipelineModule._build`` (:class:`~.pipeline_hook.StageHook`): give this process's
      stage of the layer list a LayerSwapper before DeepSpeed moves the module to the GPU;
    * ``PipelineEngine.train_batch``: a step's micro-batches run layer-major on one pipeline stage
      (:mod:`.layer_major_batches`, unless ``--no-layer_major``); after each step, read the swap stats (summed
      over every process of the job) and memory, print them on rank 0 with ``verbose`` (plus a windowed
      summary every ``verbose_every`` steps; no ETA, as the run length depends on the dataset),
      warn once when host RAM runs short, and write them to diffusion-pipe's TensorBoard run dir;
    * ``SummaryWriter.__init__`` (if tensorboard is installed): remember train.py's writer,
      so the stats land next to its loss;
    * with ``--plan`` only, ``utils.saver.Saver.save_model`` and ``save_checkpoint``: do nothing,
      so the probe steps never leave a LoRA or a checkpoint behind, however the run is saved;
    * for a full fine-tune (no [adapter]: streamed layers train on the host), DeepSpeed's optimizer step
      and checkpoints (:class:`~.engine_hooks.EngineHooks`), and ``Saver.save_full_model``, which reads
      params directly: it runs inside :meth:`~..engine.swapper.LayerSwapper.true_weights`, so it saves the masters
      (data parallel: rank 0 holds the other owners' for the save, :mod:`..training.shared_saves`);
    * ``DeepSpeedEngine.load_checkpoint`` (:class:`~..program.resume.ResumeChecks`): a resumed checkpoint's layer files
      must fit the layers (train.py loads them non-strictly, which would skip what does not match);
    * with a host RAM budget, until the stage is built, a torch-function mode (:mod:`.file_backed_casts`, not a
      patch): the load's dtype casts go to a scratch file in the disk_dir, not RAM. When the stage is built, one line
      says how many bytes of its weights are views of the checkpoint files and how many are copies
      (:mod:`..memory.file_backed`).
    """

    def __init__(
        self,
        values: dict[str, Any],
        log: Callable[[str], None] = say,
        swap: SwapConfig | None = None,
        reset_optimizer_params: bool = False,
    ) -> None:
        """``reset_optimizer_params``: train.py's flag of that name, which a resume of host training follows too."""
        self.values = values
        self.reset_optimizer_params = reset_optimizer_params
        self.swap = swap  # None: built from values when the layers arrive
        self.log = log
        self.steps = 0
        # the joined backward's line, once a run (the block is entered every step): on the stage's log
        self.joined_said = SaidOnce(lambda line: (self.swapper.log if self.swapper is not None else self.log)(line))
        self.swapper: LayerSwapper | None = None
        self.monitor: MemoryMonitor | None = None
        self.reader: StepReader | None = None
        self.window = StepWindow(values["verbose_every"])
        self.writer = None
        self.patches = Patches()
        self.stage_hook = StageHook(self.install)
        self.engine_hooks: EngineHooks | None = None
        self.resume_checks = ResumeChecks()
        # with a host RAM budget, the load's casts go to a scratch file, not RAM, until the stage is built
        self.casts = FileBackedCasts(values.get("disk_dir")) if values.get("host_ram_budget") is not None else None

    def __enter__(self) -> PipelineInterception:
        try:
            import utils.pipeline as dp_pipeline
        except ImportError as exc:
            raise DGLSUserError(
                f"cannot import diffusion-pipe's utils/pipeline.py ({exc}); is the checkout complete?"
            ) from None
        from deepspeed.runtime.pipe.engine import PipelineEngine
        from deepspeed.runtime.pipe.module import PipelineModule

        cls = getattr(dp_pipeline, "ManualPipelineModule", None)
        if not (isinstance(cls, type) and issubclass(cls, PipelineModule)):
            raise DGLSUserError(
                "diffusion-pipe's utils/pipeline.py has no ManualPipelineModule built on DeepSpeed's PipelineModule, "
                "where DGLS takes over the layers: this checkout is too old or too new for DGLS; please report its "
                "commit"
            )

        saver = self._saver_for_plan() if self.values["plan"] else None
        if saver is not None:
            for name in ("save_model", "save_checkpoint"):
                self.patches.replace(saver, name, lambda original: lambda *args, **kwargs: None)
        self.stage_hook.__enter__()
        if self.swap is not None and self.swap.training.host_optimizer is not None:
            self._hook_full_fine_tune()
        self.resume_checks.__enter__()  # after the engine hooks: it wraps their load_checkpoint
        self.patches.replace(PipelineEngine, "train_batch", self._wrap_train_batch)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            SummaryWriter = None
        if SummaryWriter is not None:
            self.patches.replace(SummaryWriter, "__init__", self._wrap_writer_init)
        if self.casts is not None:
            try:
                self.casts.install()
            except BaseException:
                self.__exit__(*sys.exc_info())  # the patches above back before the error goes up
                raise
        return self

    def _hook_full_fine_tune(self) -> None:
        import utils.saver as dp_saver

        saver = getattr(dp_saver, "Saver", None)
        if saver is None or "save_full_model" not in saver.__dict__:
            raise DGLSUserError(
                "this checkout's utils/saver.py has no Saver.save_full_model, which DGLS must point at the host "
                "masters of a full fine-tune: train a LoRA, or report the checkout's commit"
            )

        def save_true_weights(original):
            def save_full_model(saver_self, *args, **kwargs):
                shared = SharedSaves.of(self.swapper)  # data parallel: rank 0 saves the other owners' masters too
                with shared.owners_masters() if shared is not None else contextlib.nullcontext():
                    with self.swapper.true_weights():
                        return original(saver_self, *args, **kwargs)

            return save_full_model

        self.patches.replace(saver, "save_full_model", save_true_weights)
        self.engine_hooks = EngineHooks(
            lambda module: self.swapper.training if self.swapper is not None else None,
            self.reset_optimizer_params,
            shared=lambda module: SharedSaves.of(self.swapper),
        )
        self.engine_hooks.__enter__()

    @staticmethod
    def _saver_for_plan():
        try:
            import utils.saver as dp_saver
        except ModuleNotFoundError:
            # a package the checkout's saver imports (imageio), or a file of the checkout itself (utils/saver.py,
            # utils/common.py: an incomplete checkout): run_drop_in names it (missing_module_error)
            raise
        except ImportError as exc:
            raise DGLSUserError(
                f"--plan: this checkout's utils/saver.py does not import ({exc}): check its requirements "
                "(pip install -r requirements.txt in the checkout), or run without --plan"
            ) from None
        saver = getattr(dp_saver, "Saver", None)
        if saver is None or not all(name in saver.__dict__ for name in ("save_model", "save_checkpoint")):
            raise DGLSUserError(
                "--plan: this checkout's utils/saver.py has no Saver.save_model/save_checkpoint, so DGLS cannot "
                "keep the probe steps from being saved; run without --plan, or report the checkout's commit"
            )
        return saver

    def _wrap_train_batch(self, original):
        def train_batch_with_stats(engine, *args, **kwargs):
            if self.swapper is None:  # nothing may train without DGLS when the user asked for it
                raise DGLSUserError(
                    "train.py trains without having built a DeepSpeed PipelineModule, so DGLS placed no layers: this "
                    "diffusion-pipe version is too new for DGLS's interception; please report its commit"
                )
            start = time.perf_counter()
            self.reader.begin()  # eval passes between steps are not the step's
            with self._layer_major(engine), train_batch_block(engine, self.swapper):
                loss = original(engine, *args, **kwargs)
            self.steps += 1
            reading = self.monitor.read()
            stats = self.reader.end()  # this optimizer step's micro-batches, every process's together
            if self.swapper.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.swapper.device)  # the next step reports its own peak
            self.report(stats, getattr(engine, "global_steps", 0), time.perf_counter() - start, reading)
            if self.swapper.plan_finished:
                if _rank() == 0:
                    self.log("DGLS: --plan: stopping after the probe steps; nothing was saved")
                raise SystemExit(0)
            return loss

        return train_batch_with_stats

    def _layer_major(self, engine):
        """The step's micro-batches layer-major where :func:`..program.validate.layer_major_applies` (start-up said
        how they run: :func:`..program.validate.accumulation_note`); otherwise DeepSpeed's own schedule, with several
        stages each stage's backward once for all the tensors it sends on (:mod:`.joined_backward`: the stage's log
        says so at its first step)."""
        if layer_major_applies(self.values, engine.num_stages, engine.micro_batches):
            return layer_major_batches(engine, self.swapper)
        if engine.num_stages > 1:
            return joined_backward(engine, self.joined_said.log)
        return contextlib.nullcontext()

    def _wrap_writer_init(self, original):
        def init_and_remember(writer, *args, **kwargs):
            original(writer, *args, **kwargs)
            if self.writer is None:
                self.writer = writer

        return init_and_remember

    def report(
        self, stats: StepStats, step: int, seconds: float | None = None, reading: MemoryReading | None = None
    ) -> None:
        if _rank() != 0:
            return
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
        """After train.py ran to its end: summarise the last, partial window; say if the run was too
        short for --plan or --profile (the number of steps is not known before diffusion-pipe runs)."""
        if self.values["verbose"] and _rank() == 0 and (text := self.window.flush()):
            self.log(f"dgls {text}")
        if self.values["plan"]:
            raise DGLSUserError(
                f"--plan: train.py stopped after {self.steps} training step(s), before the planner had measured "
                "its probe (2 steps); nothing was saved: let the run go longer (epochs, max_steps)"
            )
        if self.swapper is None or not self.swap.observe.profile:
            return
        observe = self.swap.observe
        first = observe.profile_warmup_steps + 1
        if self.steps < first:
            self.log(
                f"DGLS: --profile: train.py ran {self.steps} training step(s), fewer than the {first} the profile "
                f"starts at: no trace was written to {observe.profile}"
            )

    def install(self, stage: Stage) -> LayerSwapper:
        """This process's stage of the layer list is built: place it (called by the stage hook)."""
        if self.swapper is not None:
            raise DGLSUserError("train.py built a second pipeline module; DGLS supports one model per run")
        # Plain functions between blocks (Chroma's concatenate_hidden_states) are fine: no weights, no hooks.
        if not all(isinstance(layer, torch.nn.Module) or callable(layer) for layer in stage.layers):
            raise DGLSUserError(
                "DeepSpeed's pipeline built layers that are neither modules nor functions: this diffusion-pipe "
                "version builds layers differently from what DGLS expects; please report its commit"
            )
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.swap is None:
            self.swap = swap_config(self.values)
        swap = self.swap.for_stage(stage.start, stage.stop, stage.layer_count)
        log = (lambda line: self.log(stage.label + line)) if stage.data_parallel_id == 0 else (lambda line: None)
        if self.casts is not None:
            self.casts.remove()  # the model is loaded: nothing of DGLS's runs under the casts' mode
        if stage.data_parallel_id == 0:  # what the load copied into process memory (memory/file_backed.py)
            log(weight_sources(stage.layers).line())
            if self.casts is not None and self.casts.note:
                log(self.casts.note)
        self.swapper = LayerSwapper(stage.layers, swap, device=device, log=log, share_group=stage.share_group)
        swapper = self.swapper
        self.monitor = MemoryMonitor(swapper.device, lambda: swapper.pinned_bytes)
        self.reader = StepReader(swapper)
        self.window.device_type = swapper.device.type
        return swapper

    def __exit__(self, *exc) -> None:
        """Always, also after an error or Ctrl-C: the layers back, the worker thread and pinned memory freed."""
        self.stage_hook.__exit__(*exc)
        if self.casts is not None:
            self.casts.remove()
        self.patches.restore()  # before the engine hooks: its train_batch wraps theirs
        self.resume_checks.__exit__(*exc)  # so does its load_checkpoint
        if self.engine_hooks is not None:
            self.engine_hooks.__exit__(*exc)
        if self.swapper is not None:
            self.swapper.remove()


@contextlib.contextmanager
def config_for_train_py(run: DropInRun) -> Iterator[str]:
    """The TOML path train.py should read. ``lazy_lora_steps N``: the same TOML with
    gradient_accumulation_steps multiplied by N and no [dgls] table, under the user's file name
    (train.py copies it into its run folder) in a temporary folder removed after the run."""
    steps = run.values["lazy_lora_steps"]
    if steps == 1:
        yield str(Path(run.config_path).resolve())
        return
    before = int(run.config.get("gradient_accumulation_steps", 1))
    changed = {k: v for k, v in run.config.items() if k != "dgls"}
    changed["gradient_accumulation_steps"] = before * steps
    with tempfile.TemporaryDirectory(prefix="dgls_") as folder:
        path = Path(folder) / Path(run.config_path).name
        path.write_text(toml.dumps(changed))
        say(
            f"DGLS: lazy_lora_steps {steps}: gradient_accumulation_steps {before} -> {before * steps} "
            f"(the optimizer runs every {before * steps} micro-batches)"
        )
        yield str(path)


def _what_was_saved(output_dir: Path, started: float) -> str:
    """For the interrupt line: the run folder train.py wrote in (diffusion-pipe names them by time),
    what it holds, and whether it can be resumed. A save folder that still holds diffusion-pipe's ``tmp``
    folder (the stages' parts, removed once the save is written) was interrupted while saving."""
    runs = [p for p in run_dirs(output_dir) if p.stat().st_mtime >= started]
    if not runs:
        return "nothing was saved"
    run_dir = runs[-1]
    saves = sorted(
        p.name + (" (incomplete: stopped while saving)" if (p / "tmp").is_dir() else "")
        for p in run_dir.iterdir()
        if p.is_dir() and not p.name.startswith("global_step")
    )
    text = f"diffusion-pipe's run folder is {run_dir}"
    text += f" (saved: {', '.join(saves)})" if saves else " (no LoRA saved yet)"
    if (run_dir / "latest").is_file():
        return text + "; to go on from its last checkpoint, run the same command with --resume_from_checkpoint"
    return text + "; it has no checkpoint to resume from yet"


def run_drop_in(run: DropInRun) -> None:
    """Run the checkout's train.py as ``__main__`` with DGLS installed (or not, if swapping is off)."""
    values = run.values
    swap = run.swap
    if swap.observe.profile:  # a relative --profile path means where the command ran, not the checkout
        swap = swap.replace(profile=str(Path(swap.observe.profile).resolve()))
    output_dir = run.checkout / str(run.config["output_dir"])
    started = time.time()
    check_before_start(run.dist, run.config.get("pipeline_stages", 1), values["dynamic_swapping"], os.environ)
    os.environ.update(run.dist.env)
    if str(run.checkout) not in sys.path:
        sys.path.insert(0, str(run.checkout))
    # every process of the job is here before train.py starts; its process group shares rank 0's server;
    # train.py calls init_distributed itself (without DeepSpeed's shm op)
    with peers_arrived(run.dist), config_for_train_py(run) as config_path, without_shm_op():
        os.chdir(run.checkout)
        sys.argv = [str(run.checkout / "train.py"), "--config", config_path, *run.train_args]
        try:
            with stops_as(lambda: RunInterrupted(_what_was_saved(output_dir, started))):
                if not values["dynamic_swapping"]:
                    runpy.run_path(str(run.checkout / "train.py"), run_name="__main__")
                else:
                    reset_params = "--reset_optimizer_params" in run.train_args
                    with PipelineInterception(values, swap=swap, reset_optimizer_params=reset_params) as interception:
                        runpy.run_path(str(run.checkout / "train.py"), run_name="__main__")
                        interception.finish()
                destroy_process_group()
        except ModuleNotFoundError as exc:  # train.py's own dependencies (wandb, diffusers ...), or a submodule's
            raise missing_module_error(exc, run.checkout) from None
        finally:
            if values["plan"]:
                _discard_plan_run_dir(output_dir, started)


# Top-level modules diffusion-pipe imports from its git submodules (submodules/<folder>, put on sys.path by
# the file that imports them), by the folder that holds them.
SUBMODULE_MODULES = {
    "comfy": "ComfyUI",
    "comfy_api": "ComfyUI",
    "comfy_extras": "ComfyUI",
    "hyvideo": "HunyuanVideo",
    "hyimage": "HunyuanImage-2.1",
    "cosmos1": "Cosmos",
    "Lumina_2": "Lumina_2",
    "hi_diffusers": "HiDream",
    "ltx_video": "LTX_Video",
    "omnigen2": "OmniGen2",
    "src": "flow",
}


def empty_submodules(checkout: Path) -> list[str]:
    """The checkout's git submodules (``path = ...`` in .gitmodules) whose folder is absent or empty: a clone
    without ``--recurse-submodules`` (or a downloaded archive)."""
    try:
        text = (checkout / ".gitmodules").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    paths = [line.split("=", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("path")]
    return [p for p in paths if not (checkout / p).is_dir() or not any((checkout / p).iterdir())]


def missing_module_error(exc: ModuleNotFoundError, checkout: Path) -> DGLSUserError:
    """The line for a module train.py could not import: a file of the checkout itself (``utils.*``), an
    incomplete checkout; from a submodule folder left empty, the git command that fills it; otherwise the
    package to install (and the empty submodules, if there are any)."""
    full = exc.name or str(exc)
    if full == "utils" or full.startswith("utils."):  # not a package to install: a file missing from a folder
        path = full.replace(".", "/") + ".py"
        if full.startswith("utils.dgls."):
            return DGLSUserError(
                f"{path} is missing next to dgls_train.py: copy the whole utils/dgls folder along with "
                "dgls_train.py (see the README)"
            )
        return DGLSUserError(
            f"diffusion-pipe's train.py imports {full}, and the checkout {checkout} has no {path}: the checkout is "
            "incomplete; restore its files (git status, git checkout -- utils in the checkout) or clone it again"
        )
    name = full.split(".")[0]
    empty = empty_submodules(checkout)
    fill = f"git submodule update --init --recursive (in {checkout})"
    folder = SUBMODULE_MODULES.get(name)
    holder = next((p for p in empty if Path(p).name in (folder, name)), None)
    if holder is not None:
        return DGLSUserError(
            f"diffusion-pipe's train.py imports {name!r} from its submodule {holder}, which is empty (the checkout "
            f"was cloned without --recurse-submodules): run {fill}"
        )
    listed = f"submodule {empty[0]} is" if len(empty) == 1 else f"submodules {', '.join(empty)} are"
    also = f"; its {listed} empty too: run {fill}" if empty else ""
    return DGLSUserError(
        f"diffusion-pipe's train.py needs the Python package {name!r}, which is not installed: "
        f"pip install -r {checkout / 'requirements.txt'}{also}"
    )


def _discard_plan_run_dir(output_dir: Path, started: float) -> None:
    """--plan saves nothing: remove the run folder train.py made for it (it holds only the copies of the
    TOMLs and TensorBoard events made at start; a folder with anything saved in it stays)."""
    for run_dir in run_dirs(output_dir):
        if run_dir.stat().st_mtime >= started and all(p.is_file() for p in run_dir.iterdir()):
            shutil.rmtree(run_dir)
