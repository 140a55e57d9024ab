"""Every bad input is one line on stderr and exit code 2, before any work starts, and nothing is written.

One table of cases, a few per kind of mistake (the clusters of issue 15): the [demo], [dgls]
and diffusion-pipe tables, numbers that are not numbers, output paths that cannot be
written, precision settings that cannot work, flags that would be ignored, missing pieces,
dataset files, launcher variables and messages. Each runs dgls_train.py's entry point in this
process (a subprocess costs seconds of imports; the few cases that need the real program
start are in test_launch_lines.py and test_diffusion_pipe_dropin.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cli_helpers import FAKE, FAKE_TABLES, demo_toml, fake_config, run_in_process, snapshot, write_checkpoint
from conftest import ROOT

from utils.dgls import DGLSUserError, SwapConfig
from utils.dgls.demo.model import DemoModelConfig, build_layers, layer_count
from utils.dgls.spelling import check_passthrough_flags


@dataclass(frozen=True)
class Case:
    name: str
    argv: Callable[[Path], list[str]]  # from the test's folder
    message: str  # a part of the one line
    setup: Callable[[Path, pytest.MonkeyPatch], None] | None = None


FULL_TABLES = FAKE_TABLES.replace('[adapter]\ntype = "lora"\nrank = 4\n', "")  # a full fine-tune


def demo(*flags: str, dgls="keep", model=None, **keys) -> Callable[[Path], list[str]]:
    return lambda tmp: ["--config", str(demo_toml(tmp, dgls=dgls, model=model, **keys)), *flags]


def dp(
    *flags: str, top: str = "", dataset: str | None = None, tables: str = FAKE_TABLES, checkout: str | None = None
) -> Callable[[Path], list[str]]:
    """A drop-in run of the stand-in checkout (or of ``checkout``, a folder in the test's folder that a setup
    makes, see ``checkout_copy``)."""
    return lambda tmp: [
        "--config",
        str(fake_config(tmp, top=top, dataset=dataset, tables=tables)),
        "--diffusion_pipe",
        str(tmp / checkout if checkout else FAKE),
        *flags,
    ]


NAN, INF = float("nan"), float("inf")


def full_demo(**optimizer) -> Callable[[Path], list[str]]:
    """toml/demo_full.toml with ``optimizer`` keys over its [optimizer] table."""
    import toml

    table = toml.loads((ROOT / "toml" / "demo_full.toml").read_text())["optimizer"]
    if optimizer.get("type") == "sgd":  # sgd takes lr, momentum and weight_decay only
        table = {"lr": table["lr"]}
    return demo(base="demo_full.toml", optimizer={**table, **optimizer})


def model(*lines: str, tables: str = FAKE_TABLES) -> str:
    """The stand-in's tables with ``lines`` added to [model] ({tmp} in them is the test's folder, see ``dp_at``)."""
    return tables.replace('dtype = "float32"\n', 'dtype = "float32"\n' + "".join(f"{x}\n" for x in lines), 1)


def dp_at(*flags: str, tables: str) -> Callable[[Path], list[str]]:
    """``dp`` with ``{tmp}`` in ``tables`` replaced by the test's folder."""
    return lambda tmp: dp(*flags, tables=tables.replace("{tmp}", str(tmp)))(tmp)


def diffusers_flux(double: int, single: int) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """tmp/flux: a Diffusers Flux folder whose transformer/config.json counts ``double`` + ``single`` blocks."""

    def setup(tmp: Path, mp) -> None:
        (tmp / "flux" / "transformer").mkdir(parents=True)
        config = {"_class_name": "FluxTransformer2DModel", "num_layers": double, "num_single_layers": single}
        (tmp / "flux" / "transformer" / "config.json").write_text(json.dumps(config))

    return setup


def checkout_copy(
    train_head: str = "", saver_head: str = "", submodules: tuple[str, ...] = (), remove: str | None = None
) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """tmp/ckpt: the stand-in checkout with lines put before its train.py and utils/saver.py, and git submodules
    (in .gitmodules) whose folders are empty, as in a clone without --recurse-submodules; ``remove``: a file
    of it to delete (an incomplete checkout). The run imports from
    it in this process: sys.path and sys.argv are the test's own copies, and utils.pipeline is the stand-in's
    (loaded here, removed after the test) so that no module of the copy stays imported."""

    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        checkout = tmp / "ckpt"
        shutil.copytree(FAKE, checkout)
        for rel, head in (("train.py", train_head), ("utils/saver.py", saver_head)):
            (checkout / rel).write_text(head + (checkout / rel).read_text())
        gitmodules = "".join(f'[submodule "{p}"]\n\tpath = {p}\n\turl = https://x/{p}\n' for p in submodules)
        (checkout / ".gitmodules").write_text(gitmodules)
        for folder in submodules:
            (checkout / folder).mkdir(parents=True)
        if remove is not None:
            (checkout / remove).unlink()
        mp.setattr(sys, "path", list(sys.path))
        mp.setattr(sys, "argv", list(sys.argv))
        spec = importlib.util.spec_from_file_location("utils.pipeline", FAKE / "utils" / "pipeline.py")
        pipeline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pipeline)
        mp.setitem(sys.modules, "utils.pipeline", pipeline)
        mp.delitem(sys.modules, "utils.saver", raising=False)

    return setup


def raw(text: str, *flags: str) -> Callable[[Path], list[str]]:
    def write(tmp: Path) -> list[str]:
        (tmp / "x.toml").write_bytes(text.encode("latin-1"))
        return ["--config", str(tmp / "x.toml"), *flags]

    return write


def env(**values: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    return lambda tmp, mp: [mp.setenv(k, v) for k, v in values.items()]


def missing_module(name: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    return lambda tmp, mp: mp.setitem(sys.modules, name, None)  # find_spec then reports it absent


def make_file(rel: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    def setup(tmp: Path, mp) -> None:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text("x")

    return setup


def full_disk(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=(1 << 30) - 1024, free=1024))


def read_only(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)


RUN = "out/20250101_00-00-00"  # a run folder of the dp() configs' output_dir


def checkpoint(
    adapter: bool = True, host_stages: int = 0, change: Callable[[Path], None] | None = None, **kw
) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """A run folder with a checkpoint (:func:`cli_helpers.write_checkpoint`), then ``change(tag folder)``."""

    def setup(tmp: Path, mp) -> None:
        folder = write_checkpoint(tmp / RUN, adapter=adapter, host_stages=host_stages, **kw)
        if change is not None:
            change(folder)

    return setup


def truncate(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:-200])


def overwrite(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


NOT_ROOT = os.geteuid() != 0  # root writes into a 0o555 folder; /proc stands in for a read-only disk there

CASES = [
    # [demo] table
    Case("demo-steps-0", demo(steps=0), "[demo] steps must be a whole number >= 1, got 0"),
    Case("demo-steps-text", demo(steps="ten"), "[demo] steps must be a whole number >= 1, got 'ten'"),
    Case("demo-batch-0", demo(batch_size=0), "[demo] batch_size must be a whole number >= 1"),
    Case("demo-lora-rank-0", demo(lora_rank=0), "[demo] lora_rank must be a whole number >= 1"),
    Case("adapter-rank-0", raw('[model]\ntype = "dgls_demo"\n[adapter]\nrank = 0\n'), "[adapter] rank must be a whole"),
    Case("demo-heads", demo(hidden=64, heads=5), "hidden = 64 must be even and divisible by heads = 5"),
    Case("demo-output-dir-number", demo(output_dir=5), "[demo] output_dir must be a folder path in quotes, got 5"),
    Case("demo-lr-nan", demo(lr=float("nan")), "[demo] lr must be a number > 0, got nan"),
    Case("demo-ckpt", demo(activation_checkpointing="sometimes"), "[demo] activation_checkpointing must be one of"),
    Case("demo-device", demo(device="tpu"), "[demo] device must be one of 'auto', 'cpu', 'cuda'"),
    Case("demo-unknown-key", demo(stepz=3), "unknown [demo] key(s) ['stepz']"),
    Case("demo-no-blocks", demo(double_blocks=0, single_blocks=0), "double_blocks + single_blocks must be"),
    Case("model-dtype", demo(model={"dtype": "float64"}), "[model] dtype must be one of float32"),
    Case("demo-not-a-table", raw('demo = 5\n[model]\ntype = "dgls_demo"\n'), "demo = 5 must be a [demo] table"),
    # [dgls] table
    Case("dgls-not-a-table", demo(dgls=5), "dgls = 5 must be a [dgls] table"),
    Case("dgls-gpu-layers-text", demo(dgls={"gpu_layers": "0,x"}), "gpu_layers in"),
    Case("dgls-bool", demo(dgls={"threading": "yes"}), "[dgls] threading in"),
    Case("dgls-prefetch", demo(dgls={"prefetch": -3}), "prefetch must be a whole number >= 0, got -3"),
    Case("dgls-unknown", demo(dgls={"prefetc": 2}), "unknown [dgls] key 'prefetc'"),
    Case("dgls-sync-mode", demo(dgls={"device_sync_mode": "fast"}), "device_sync_mode in"),
    Case("dgls-budget-text", demo(dgls={"vram_budget": "lots"}), "vram_budget in"),
    Case("dgls-retired", demo(dgls={"sync_only_on_resume": True}), "[dgls] sync_only_on_resume in"),
    # numbers that are not numbers
    Case("budget-nan", demo("--vram_budget", "nan"), "vram_budget must be a number of GiB > 0 or 'auto', got nan"),
    Case("budget-inf", demo("--vram_budget", "inf"), "got inf"),
    Case("budget-negative", demo("--vram_budget", "-1"), "got -1.0"),
    Case("pinned-nan", demo("--pinned_ram_budget_gb", "nan"), "pinned_ram_budget_gb must be a number of GiB >= 0"),
    Case("packing-nan", demo("--selective_packing", "nan"), "selective_packing is a size in MB >= 0, got nan"),
    Case("budget-auto-cpu", demo("--vram_budget", "auto"), "auto measures free VRAM: give a number of GiB on CPU"),
    # output paths, checked before training
    Case("profile-is-folder", lambda t: demo("--profile", str(t), steps=5)(t), "is a folder: give a file path"),
    Case(
        "profile-under-file",
        lambda t: demo("--profile", str(t / "f" / "t.json"), steps=5)(t),
        "is a file, not a folder",
        make_file("f"),
    ),
    Case("profile-read-only", demo("--profile", "/proc/dgls/trace.json", steps=5), "/proc is not writable"),
    Case("output-dir-is-file", lambda t: demo(output_dir=str(t / "f"))(t), "is a file, not a folder", make_file("f")),
    Case("output-dir-read-only", demo(output_dir="/proc/dgls/out"), "/proc is not writable"),
    Case("output-dir-full-disk", demo(), "MiB free on its disk and the run writes", full_disk),
    Case(
        "dp-output-dir-is-file",
        lambda t: dp(top=f'output_dir = "{t / "f"}"')(t),
        "is a file, not a folder",
        make_file("f"),
    ),
    Case("dp-output-dir-home", dp(top='output_dir = "~/loras"'), "diffusion-pipe does not expand '~'"),
    # precision that cannot work, or would do nothing
    Case("cast-f32-bf16-no-autocast", demo("--cast_target", "f32", "bf16"), "add --autocast bf16"),
    Case(
        "cast-matches-nothing", demo("--cast_target", "bf16", "f8_e4m3"), "casts nothing: the model's weights are f32"
    ),
    Case("cast-to-itself", demo("--cast_target", "f32", "f32"), "casts a dtype to itself"),
    Case("autocast-fp8", demo("--autocast", "f8_e4m3"), "torch.autocast has no fp8 compute"),
    Case("dp-cast-matches-nothing", dp("--cast_target", "bf16", "f8_e4m3"), "casts nothing"),
    # flags that would be ignored
    Case("gpu-id-no-cuda", demo("--gpu_id", "5"), "--gpu_id 5 but no CUDA device is visible"),
    Case("gpu-id-negative", demo("--gpu_id", "-1"), "--gpu_id must be a whole number >= 0, got -1"),
    Case("gpu-id-cpu-device", demo("--gpu_id", "1", device="cpu"), "has no effect: the config sets device = 'cpu'"),
    Case("dp-gpu-id-no-cuda", dp("--gpu_id", "1"), "--gpu_id 1 but no CUDA device is visible"),
    Case("diffusion-pipe-with-demo", demo("--diffusion_pipe", str(FAKE)), "--diffusion_pipe has no effect"),
    Case("prefetch-negative-no-swap", demo("--prefetch", "-1", "--no-dynamic_swapping"), "prefetch must be"),
    Case("prefetch-no-swap", demo("--prefetch", "4", "--no-dynamic_swapping"), "--prefetch has no effect with"),
    Case(
        "profile-too-short",
        lambda t: demo("--profile", str(t / "t.json"))(t),
        "records steps 3-5, but [demo] steps = 4",
    ),
    Case("plan-without-budget", demo("--plan"), "--plan plans from a VRAM budget"),
    Case("plan-with-profile", demo("--plan", "--vram_budget", "1", "--profile", "t.json"), "drop one of them"),
    Case("plan-explicit-cli", demo("--plan", "--vram_budget", "1", "--gpu_layers", "0"), "both choose which layers"),
    Case(
        "placement-twice-cli",
        demo("--blocks_to_swap", "3", "--gpu_layers", "0,1"),
        "--gpu_layers and --blocks_to_swap both choose",
    ),
    Case(
        "placement-twice-toml",
        demo(dgls={"blocks_to_swap": 3, "initial_gpu_layers": 1}),
        "[dgls] initial_gpu_layers in",
    ),
    Case(
        "budget-and-prefetch",
        demo("--vram_budget", "1", "--prefetch", "3"),
        "choose the prefetch depth: drop --prefetch",
    ),
    Case(
        "budget-and-prefetch-toml",
        demo(dgls={"vram_budget": 1, "prefetch": 3}),
        "lets the planner choose the prefetch depth: drop [dgls] prefetch in",
    ),
    Case("lazy-steps-0", demo("--lazy_lora_steps", "0"), "--lazy_lora_steps must be a whole number >= 1"),
    Case("dp-local-rank-no-launcher", dp("--local_rank=1"), "--local_rank is the deepspeed launcher's"),
    # missing pieces
    Case("no-peft", demo(), "the Python package 'peft' is not installed", missing_module("peft")),
    Case("no-deepspeed", demo(), "the Python package 'deepspeed' is not installed", missing_module("deepspeed")),
    Case("dp-no-deepspeed", dp(), "'deepspeed' is not installed", missing_module("deepspeed")),
    Case(
        "no-demo-folder",
        demo(),
        "utils/dgls/demo/settings.py is missing next to dgls_train.py",
        missing_module("utils.dgls.demo.settings"),
    ),
    # diffusion-pipe's config and dataset files
    Case("dp-dataset-number", dp(top="dataset = 5"), "dataset = 5 must be a path in quotes"),
    Case("dp-directory-string", dp(dataset='directory = "images"\n'), "needs [[directory]] tables"),
    Case("dp-directory-missing", dp(dataset='[[directory]]\npath = "nowhere"\n'), "path 'nowhere' is not a folder"),
    Case(
        "dp-eval-no-config",
        dp(top="eval_datasets = [{name = 'e'}]"),
        "eval_datasets[0] = {'name': 'e'} must be a table",
    ),
    Case("dp-eval-string", dp(top="eval_datasets = ['e.toml']"), "eval_datasets[0] = 'e.toml' must be a table"),
    Case("dp-no-save", dp(top="save_every_n_epochs = DROP"), "says when to save nothing"),
    Case("dp-no-optimizer", dp(tables=FAKE_TABLES.split("[optimizer]")[0]), "optimizer = None must be an [optimizer]"),
    Case("dp-own-blocks-to-swap", dp(top="blocks_to_swap = 10"), "own blocks_to_swap"),
    Case("dp-stages", dp(top="pipeline_stages = 2"), "pipeline_stages = 2, which must divide the 1 process"),
    Case("dp-resume-nothing", dp("--resume_from_checkpoint"), "has no earlier run to resume"),
    # resume: the run folder, its latest file and the checkpoint it names, before start-up (issue 39)
    Case(
        "dp-resume-no-latest",
        dp("--resume_from_checkpoint"),
        "holds no checkpoint to resume (it has no 'latest' file",
        make_file(f"{RUN}/train.toml"),
    ),
    Case(
        "dp-resume-latest-missing",
        dp("--resume_from_checkpoint"),
        "holds global_step2 but no 'latest' file naming one",
        checkpoint(latest=False),
    ),
    Case(
        "dp-resume-latest-names-nothing",
        dp("--resume_from_checkpoint"),
        "latest names 'global_step9', which is not a checkpoint folder",
        checkpoint(change=lambda f: (f.parent / "latest").write_text("global_step9\n")),
    ),
    Case(
        "dp-resume-latest-empty",
        dp("--resume_from_checkpoint"),
        "latest names '', which is not a checkpoint folder",
        checkpoint(change=lambda f: (f.parent / "latest").write_text("")),
    ),
    Case(
        "dp-resume-truncated-layer",
        dp("--resume_from_checkpoint"),
        "layer_01-model_states.pt (a layer's weights) is cut short or is not a file torch.save wrote",
        checkpoint(change=truncate("layer_01-model_states.pt")),
    ),
    Case(
        "dp-resume-empty-model-states",
        dp("--resume_from_checkpoint"),
        "mp_rank_00_model_states.pt (DeepSpeed's optimizer and train.py's state) is empty: the checkpoint was not",
        checkpoint(change=overwrite("mp_rank_00_model_states.pt", b"")),
    ),
    Case(
        "dp-resume-garbage-host-state",
        dp("--resume_from_checkpoint", tables=FULL_TABLES),
        "dgls_host_optimizer_stage0.pt (DGLS's host optimizer state) is cut short or is not a file torch.save",
        checkpoint(adapter=False, host_stages=1, change=overwrite("dgls_host_optimizer_stage0.pt", b"garbage" * 9)),
    ),
    Case(
        "dp-resume-truncated-host-state",
        dp("--resume_from_checkpoint", tables=FULL_TABLES),
        "dgls_host_optimizer_stage0.pt (DGLS's host optimizer state) is cut short",
        checkpoint(adapter=False, host_stages=1, change=truncate("dgls_host_optimizer_stage0.pt")),
    ),
    Case(
        "dp-resume-no-model-states",
        dp("--resume_from_checkpoint"),
        "has no mp_rank_00_model_states.pt: the checkpoint was not saved completely",
        checkpoint(change=lambda f: (f / "mp_rank_00_model_states.pt").unlink()),
    ),
    Case(
        "dp-resume-lora-as-full",
        dp("--resume_from_checkpoint", tables=FULL_TABLES),
        "is a LoRA's checkpoint (its layer files hold adapter weights), and",
        checkpoint(),
    ),
    Case(
        "dp-resume-full-as-lora",
        dp("--resume_from_checkpoint"),
        "is a full fine-tune's checkpoint (its layer files hold every weight and no adapter), and",
        checkpoint(adapter=False, host_stages=1),
    ),
    Case(
        "dp-resume-other-model",
        dp("--resume_from_checkpoint"),
        "was trained with [model] type = 'sdxl' (its copy train.toml)",
        checkpoint(change=lambda f: (f.parent / "train.toml").write_text('[model]\ntype = "sdxl"\n')),
    ),
    Case(
        "dp-resume-full-without-host-state",
        dp("--resume_from_checkpoint", tables=FULL_TABLES),
        "has no DGLS host optimizer state (dgls_host_optimizer_stage0.pt): it was saved by train.py without DGLS",
        checkpoint(adapter=False),
    ),
    Case(
        "dp-resume-host-state-without-swapping",
        dp("--resume_from_checkpoint", "--no-dynamic_swapping", tables=FULL_TABLES),
        "was saved by DGLS's full fine-tune with streamed layers",
        checkpoint(adapter=False, host_stages=1),
    ),
    Case(
        "dp-resume-host-state-stages",
        dp("--resume_from_checkpoint", tables=FULL_TABLES),
        "holds DGLS host optimizer states of 2 pipeline stages, and this run has 1: resume with pipeline_stages = 2",
        checkpoint(adapter=False, host_stages=2),
    ),
    Case(
        "dp-resume-last-entry-a-file",
        dp("--resume_from_checkpoint"),
        "train.py resumes the last entry of",
        lambda tmp, mp: (checkpoint()(tmp, mp), make_file("out/notes.txt")(tmp, mp)),
    ),
    Case("dp-resume-config-number", dp(top="resume_from_checkpoint = 5"), "resume_from_checkpoint must be true, false"),
    Case("dp-resume-folder-missing", dp("--resume_from_checkpoint", "nope"), "--resume_from_checkpoint nope: no run"),
    Case("dp-retired-flag", dp("--async_zero_grad"), "--async_zero_grad was removed"),
    # launcher variables
    Case(
        "rank-without-world-size", demo(), "RANK set in the environment but not WORLD_SIZE, LOCAL_RANK", env(RANK="0")
    ),
    Case(
        "gpu-id-under-launcher",
        demo("--gpu_id", "0"),
        "--gpu_id does nothing under the deepspeed launcher",
        env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"),
    ),
    Case(
        "demo-stages-not-dividing",
        demo(pipeline_stages=3),
        "pipeline_stages = 3 must divide the 2 process(es) the launcher started: launch with deepspeed "
        "--num_gpus=3 dgls_train.py --deepspeed --config ",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    # the layout in the order a user fixes it: the stages need processes before a stage's placement is checked
    Case(
        "demo-stages-one-process-before-placement",
        demo("--blocks_to_swap", "3", pipeline_stages=4),
        "[demo] pipeline_stages = 4 runs one process per stage, and python dgls_train.py starts 1 process: launch "
        "with deepspeed --num_gpus=4 dgls_train.py --deepspeed --config ",
    ),
    Case(
        "demo-stages-more-than-layers-before-placement",
        demo("--blocks_to_swap", "5", pipeline_stages=4, double_blocks=1, single_blocks=0),
        "[demo] pipeline_stages = 4 is more than the model's 3 layers",
    ),
    Case(
        "rank-not-below-world-size",
        demo(),
        "RANK=2 must be from 0 to WORLD_SIZE - 1 = 1",
        env(RANK="2", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case("rank-negative", demo(), "RANK=-1 must be from 0", env(RANK="-1", WORLD_SIZE="2", LOCAL_RANK="0")),
    Case("world-size-0", demo(), "WORLD_SIZE=0 must be 1 or more", env(RANK="0", WORLD_SIZE="0", LOCAL_RANK="0")),
    Case(
        "local-rank-not-below-world-size",
        dp(),
        "LOCAL_RANK=4 must be from 0 to WORLD_SIZE - 1 = 1",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="4"),
    ),
    Case(
        "rendezvous-timeout-text",
        demo(),
        "DGLS_RENDEZVOUS_TIMEOUT='soon' must be a number of seconds > 0",
        env(DGLS_RENDEZVOUS_TIMEOUT="soon"),
    ),
    Case(
        "demo-stages-more-than-layers",
        demo(pipeline_stages=4, double_blocks=1, single_blocks=0),
        "[demo] pipeline_stages = 4 is more than the model's 3 layers (double_blocks + single_blocks + 2), so a "
        "stage would have none: set pipeline_stages to 3 or fewer",
        env(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0"),
    ),
    # full fine-tuning (a demo config without [adapter])
    Case(
        "demo-full-optimizer",
        demo(base="demo_full.toml", optimizer={"type": "ScheduleFreeWrapper"}),
        "type = 'ScheduleFreeWrapper' cannot train streamed layers: use 'ScheduleFreeAdamW'",
    ),
    Case(
        "demo-full-optimizer-key",
        demo(base="demo_full.toml", optimizer={"type": "adamw", "lr": 1e-4, "amsgrad": True}),
        "amsgrad cannot be passed to the host optimizer",
    ),
    Case("host-adam-with-lora", demo("--host_adam", "torch"), "picks the host AdamW of a full fine-tune"),
    Case(
        "demo-offload-without-checkpointing",
        demo("--offload_activations", activation_checkpointing=False),
        "--offload_activations sends the inputs checkpointed layers keep to host memory, and [demo] "
        "activation_checkpointing = false",
    ),
    Case(
        "demo-recompute-offload-without-checkpointing",
        demo("--offload_recompute", activation_checkpointing=False),
        "--offload_recompute sends what checkpointed layers' recomputes save to host memory, and [demo] "
        "activation_checkpointing = false",
    ),
    Case(
        "demo-recompute-offload-without-activation-offload",
        demo("--offload_recompute", "--no-offload_activations"),
        "offload_recompute sends its tensors home with the activation offload: drop offload_activations = false",
    ),
    Case(
        "demo-keep-piece-outputs-without-checkpoint-units",
        demo("--keep_piece_outputs"),
        "keep_piece_outputs keeps the outputs of the pieces checkpoint_units checkpoints: turn checkpoint_units on",
    ),
    Case(
        "demo-keep-piece-outputs-without-checkpointing",
        demo("--keep_piece_outputs", "--checkpoint_units", activation_checkpointing=False),
        "--keep_piece_outputs sends the outputs of checkpointed layers' pieces to host memory, and [demo] "
        "activation_checkpointing = false",
    ),
    Case(
        "dp-offload-without-checkpointing",
        dp("--offload_activations", top="activation_checkpointing = false"),
        "has no activation_checkpointing",
    ),
    Case(
        "demo-full-deepspeed-sgd",
        demo("--host_adam", "deepspeed", base="demo_full.toml", optimizer={"type": "sgd", "lr": 1e-3}),
        "the deepspeed host optimizer is AdamW: use type = 'adamw', or --host_adam torch_fused",
    ),
    Case(
        "demo-full-data-parallel-in-stages",
        demo(base="demo_full.toml", pipeline_stages=2),
        "would be data parallel within each stage: a full fine-tune runs data parallel on one stage",
        env(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0"),
    ),
    Case(
        "demo-full-data-parallel-whole-step",
        demo(base="demo_full.toml", optimizer={"type": "DAdaptAdam", "lr": 1.0}),
        "[optimizer] type 'DAdaptAdam' steps one instance over every param",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "demo-data-parallel-host-ram-budget",
        demo("--host_ram_budget", "1"),
        "--host_ram_budget keeps streamed layers on disk, and the 2 processes of this run on 1 pipeline stage(s)",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "drop-in-data-parallel-host-ram-budget",
        dp("--host_ram_budget", "auto"),
        "the disk tier does not combine with that copy yet",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "demo-full-data-parallel-vram-budget",
        demo("--vram_budget", "8", base="demo_full.toml"),
        "--vram_budget with 2 data-parallel processes of a full fine-tune",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "dp-full-optimizer", dp(tables=FULL_TABLES.replace('"adamw"', '"genericoptim"')), "'genericoptim' cannot train"
    ),
    # a drop-in full fine-tune of several processes trains data parallel on one stage (training/data_parallel.py)
    Case(
        "dp-full-data-parallel-in-stages",
        dp(top="pipeline_stages = 2", tables=FULL_TABLES),
        "would be data parallel within each stage: a full fine-tune runs data parallel on one stage, or one process "
        "per stage; set pipeline_stages = 1 or 4",
        env(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0"),
    ),
    Case(
        "dp-full-data-parallel-vram-budget",
        dp("--vram_budget", "8", tables=FULL_TABLES),
        "--vram_budget with 2 data-parallel processes of a full fine-tune",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "dp-full-data-parallel-gradient-release",
        dp(tables=FULL_TABLES + "gradient_release = true\n"),
        "gradient_release = true in",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "dp-full-data-parallel-whole-step",
        dp(tables=FULL_TABLES.replace('"adamw"', '"Prodigy"').replace("lr = 1e-3", "lr = 1.0")),
        "[optimizer] type 'Prodigy' steps one instance over every param",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    # a VRAM budget plans a full fine-tune at step 1, before any update (planning/autoplan.py): what that cannot serve
    Case(
        "dp-full-vram-budget-gradient-release",
        dp("--vram_budget", "8", tables=FULL_TABLES + "gradient_release = true\n"),
        "--vram_budget with [optimizer] gradient_release = true in",
    ),
    Case(
        "dp-full-vram-budget-resume",
        dp("--vram_budget", "8", "--resume_from_checkpoint", tables=FULL_TABLES),
        "--resume_from_checkpoint with --vram_budget: a full fine-tune's checkpoint holds the host optimizer state",
    ),
    Case("dp-full-deepspeed-config", dp("--deepspeed_config", "z.json", tables=FULL_TABLES), "ZeRO offload would"),
    Case("dp-stages-not-a-number", dp(top='pipeline_stages = "two"'), "pipeline_stages must be a whole number"),
    # full fine-tune settings: one line naming the key and its range, before start-up (issue 39)
    Case("demo-full-betas-scalar", full_demo(betas=0.9), "[optimizer] betas must be a list of two numbers, each in"),
    Case("demo-full-betas-three", full_demo(betas=[0.9, 0.99, 0.9]), "betas must be a list of two numbers"),
    Case("demo-full-weight-decay-nan", full_demo(weight_decay=NAN), "weight_decay must be a finite number >= 0, got n"),
    Case("demo-full-lr-inf", full_demo(lr=INF), "[optimizer] lr must be a finite number > 0, got inf"),
    Case("demo-full-weight-decay-inf", full_demo(weight_decay=INF), "weight_decay must be a finite number >= 0, got i"),
    Case("demo-full-eps-inf", full_demo(eps=INF), "[optimizer] eps must be a finite number > 0, got inf"),
    Case("demo-full-momentum-negative", full_demo(type="sgd", momentum=-0.5), "momentum must be a number in [0, 1)"),
    Case(
        "demo-full-momentum-text", full_demo(type="sgd", momentum="0.9"), "momentum must be a number in [0, 1), got '0"
    ),
    Case("demo-full-momentum-nan", full_demo(type="sgd", momentum=NAN), "momentum must be a number in [0, 1), got nan"),
    Case("demo-full-kahan-text", full_demo(type="adamw_optimi", kahan_sum="yes"), "kahan_sum must be true or false"),
    Case("demo-full-lr-twice", demo(base="demo_full.toml", lr=1e-3), "both set the learning rate of this full"),
    Case("demo-lora-optimizer", demo(optimizer={"type": "sgd", "lr": 0.1}), "this config trains a LoRA ([adapter])"),
    Case("demo-seed-huge", demo(seed=10**23), "[demo] seed must be a whole number >= 0 and <= 9223372036854775807"),
    Case("dp-clipping-negative", dp(top="gradient_clipping = -1"), "gradient_clipping must be a finite number >= 0"),
    Case("dp-clipping-nan", dp(top="gradient_clipping = nan"), "gradient_clipping must be a finite number >= 0"),
    Case("dp-clipping-text", dp(top='gradient_clipping = "1.0"', tables=FULL_TABLES), "got '1.0'"),
    Case("dp-accumulation-nan", dp(top="gradient_accumulation_steps = nan"), "gradient_accumulation_steps must be a"),
    Case("dp-accumulation-text", dp(top='gradient_accumulation_steps = "2"', tables=FULL_TABLES), "got '2'"),
    Case("dp-accumulation-fraction", dp(top="gradient_accumulation_steps = 1.5"), "whole number >= 1, got 1.5"),
    Case(
        "dp-accumulation-0-lazy",
        dp("--lazy_lora_steps", "2", top="gradient_accumulation_steps = 0"),
        "gradient_accumulation_steps must be a whole number >= 1, got 0",
    ),
    Case("dp-eval-accumulation-0", dp(top="eval_gradient_accumulation_steps = 0"), "eval_gradient_accumulation_steps"),
    Case("dp-lora-lr-inf", dp(tables=FAKE_TABLES.replace("lr = 1e-3", "lr = inf")), "lr must be a finite number > 0"),
    Case("dp-lora-betas-scalar", dp(tables=FAKE_TABLES + "betas = 0.9\n"), "betas must be a list of two numbers"),
    Case("dp-lora-momentum-nan", dp(tables=FAKE_TABLES + "momentum = nan\n"), "momentum must be a number in [0, 1)"),
    Case("dp-lora-no-type", dp(tables=FAKE_TABLES.replace('type = "adamw"\n', "")), "[optimizer] type must be"),
    Case("dp-full-weight-decay-nan", dp(tables=FULL_TABLES + "weight_decay = nan\n"), "weight_decay must be a finite"),
    Case("dp-full-eps-inf", dp(tables=FULL_TABLES + "eps = inf\n"), "[optimizer] eps must be a finite number > 0"),
    Case(
        "dp-full-sgd-momentum-negative",
        dp(tables=FULL_TABLES.replace('"adamw"', '"sgd"') + "momentum = -1\n"),
        "momentum must be a number in [0, 1), got -1",
    ),
    # messages: a bad flag is one line, not argparse's usage
    Case("verbose-every-zero", demo("--verbose_every", "0"), "--verbose_every must be a whole number >= 1"),
    Case("flag-value", demo("--prefetch", "x"), "argument --prefetch: expected a whole number, got 'x'"),
    Case("flag-choice", demo("--autocast", "f64"), "argument --autocast: invalid choice: 'f64'"),
    Case("flag-unknown-demo", demo("--bogus"), "unknown argument(s) for the demo: --bogus"),
    Case("flag-retired", demo("--async_zero_grad"), "--async_zero_grad was removed, as it had nothing to do"),
    Case("config-missing", lambda t: ["--config", str(t / "nope.toml")], "config file not found"),
    Case("config-not-toml", raw("[model\ntype="), "is not valid TOML"),
    Case("config-not-utf8", raw('[model]\ntype = "caf\xe9"\n'), "is not UTF-8 text"),
    Case("config-no-model", raw("[adapter]\nrank = 4\n"), "has no [model] type"),
    Case("unknown-model-type", raw('[model]\ntype = "fluxx"\n'), "unknown model type 'fluxx'"),
]


def transformers_asks_for_peft(need: str, have: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """transformers 5.24.0, which asks for peft ``need``, beside peft ``have`` (as the package index had them)."""

    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        from utils.dgls.program import dp_model

        mp.setattr(dp_model, "transformers_min_peft", lambda: need)
        mp.setattr(dp_model, "installed_version", {"peft": have, "transformers": "5.24.0"}.get)

    return setup


CASES += [
    # transformers 5.24.0 asks for peft 0.22.0, newer than any on the package index: SDXL's text encoders' LoRA
    # failed in train.py itself once the model had loaded
    Case(
        "sdxl-lora-peft-older-than-transformers-asks",
        dp(tables=FAKE_TABLES.replace('type = "flux"', 'type = "sdxl"')),
        "[model] type = 'sdxl' with an [adapter]: diffusion-pipe adds its text encoders' LoRA through transformers' "
        "add_adapter, and transformers 5.24.0 refuses peft 0.21.2 (it asks for 0.22.0 or newer): pip install "
        "'peft>=0.22.0', or if there is none yet, an earlier transformers that asks for peft 0.21.2 or older",
        transformers_asks_for_peft("0.22.0", "0.21.2"),
    ),
]
CASES += [
    # placement that cannot fit the model, refused before DeepSpeed starts (issue 39)
    Case(
        "demo-blocks-to-swap-too-many",
        demo("--blocks_to_swap", "50"),
        "--blocks_to_swap is 50, but the demo model (4 double and 4 single blocks, with its input and output "
        "layers) has only 10 layers: set blocks_to_swap <= 10",
    ),
    Case(
        "demo-gpu-layers-out-of-range",
        demo("--gpu_layers", "0,5,99"),
        "--gpu_layers names layer 99, but the demo model (4 double and 4 single blocks, with its input and output "
        "layers) has 10 layers: indices run 0-9",
    ),
    Case("demo-gpu-layers-0-99", demo("--gpu_layers", "0,99"), "--gpu_layers names layer 99, but the demo model"),
    Case(
        "demo-gpu-layers-negative",
        demo(dgls={"gpu_layers": [-1, 2, 10]}),
        "demo.toml names layers -1, 10, but the demo model",
    ),
    Case(
        "demo-initial-too-many",
        demo("--initial_gpu_layers", "11", double_blocks=2),
        "--initial_gpu_layers is 11, but the demo model (2 double and 4 single blocks",
    ),
    Case(
        "demo-blocks-to-swap-per-stage",
        demo("--blocks_to_swap", "6", pipeline_stages=2),
        "--blocks_to_swap is 6, but it counts each pipeline stage's layers, and the smallest of the 2 stages ([demo] "
        "pipeline_stages) holds 5 of the 10: set blocks_to_swap <= 5",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case(
        "dp-blocks-to-swap-from-config-json",
        dp_at("--blocks_to_swap", "8", tables=model('diffusers_path = "{tmp}/flux"')),
        "--blocks_to_swap is 8, but the flux model (num_layers 2 + num_single_layers 3 in ",
        diffusers_flux(2, 3),
    ),
    Case(
        "dp-gpu-layers-from-config-json",
        dp_at("--gpu_layers", "0,7", tables=model('diffusers_path = "{tmp}/flux"')),
        "names layer 7, but the flux model (num_layers 2 + num_single_layers 3 in",
        diffusers_flux(2, 3),
    ),
    # model files, checked before anything loads
    Case(
        "dp-diffusers-path-missing",
        dp(tables=model('diffusers_path = "/nowhere/FLUX.1-dev"')),
        "[model] diffusers_path = '/nowhere/FLUX.1-dev' not found",
    ),
    Case(
        "dp-transformer-path-relative",
        dp(tables=model('transformer_path = "models/flux1-dev.safetensors"')),
        "[model] transformer_path = 'models/flux1-dev.safetensors' not found (relative paths start at the checkout",
    ),
    Case(
        "dp-diffusers-path-is-a-file",
        dp(tables=model('diffusers_path = "train.py"')),
        "[model] diffusers_path = 'train.py' is a file; diffusion-pipe reads a model folder there",
    ),
    Case("dp-ckpt-path-home", dp(tables=model('ckpt_path = "~/Wan2.1-T2V-1.3B"')), "does not expand '~'"),
    Case(
        "dp-diffusers-path-hub-id",
        dp(tables=model('diffusers_path = "black-forest-labs/FLUX.1-dev"')),
        "diffusion-pipe reads models from disk: download black-forest-labs/FLUX.1-dev first",
    ),
    Case(
        "dp-comfy-text-encoder-missing",
        dp(tables=model("[[model.text_encoders]]", 'path = "/nowhere/qwen.safetensors"', 'type = "qwen_image"')),
        "[[model.text_encoders]] 0 path = '/nowhere/qwen.safetensors' not found",
    ),
    Case(
        "dp-init-from-existing-missing",
        dp(tables=FAKE_TABLES.replace("rank = 4\n", 'rank = 4\ninit_from_existing = "/nowhere/lora"\n')),
        "[adapter] init_from_existing = '/nowhere/lora' not found",
    ),
    Case("dp-model-path-number", dp(tables=model("vae = 5")), "[model] vae = 5 must be a path in quotes"),
    # misspelled names: did you mean
    Case("flag-typo-demo", demo("--vram_buget", "10"), "--vram_buget 10 (did you mean --vram_budget?)"),
    Case("flag-typo-dp", dp("--vram_buget", "10"), "unknown argument --vram_buget (did you mean --vram_budget?)"),
    Case(
        "flag-typo-train-py",
        dp("--resume_form_checkpoint"),
        "unknown argument --resume_form_checkpoint (did you mean --resume_from_checkpoint?)",
    ),
    Case("dgls-key-typo", demo(dgls={"prefech": 2}), "unknown [dgls] key 'prefech' in"),
    Case("dgls-key-typo-hint", demo(dgls={"prefech": 2}), "(did you mean prefetch?)"),
    Case(
        "dgls-table-upper-case",
        raw('[model]\ntype = "dgls_demo"\n[DGLS]\nprefetch = 1\n'),
        "[DGLS] is not read: DGLS takes its settings from a table named [dgls] (TOML names are case-sensitive)",
    ),
    Case("dgls-table-typo", raw('[model]\ntype = "dgls_demo"\n[dlgs]\nprefetch = 1\n'), "rename [dlgs] to [dgls]"),
    Case("dp-dgls-table-typo", dp(tables=FAKE_TABLES + "[dlgs]\nprefetch = 1\n"), "rename [dlgs] to [dgls]"),
    Case(
        "demo-table-typo",
        raw('[model]\ntype = "dgls_demo"\n[dmeo]\nsteps = 3\n'),
        "the demo reads no [dmeo] table (did you mean [demo]?)",
    ),
    # autocast: the fp8 names --help does not list are refused with what to do instead
    Case("autocast-unknown-lists-usable", demo("--autocast", "f64"), "(choose from fp32, fp16, bf16)"),
    Case("autocast-fp8-toml", demo(dgls={"autocast": "f8_e5m2"}), "autocast f8_e5m2 is not supported"),
    # the checkout: what its modules need
    Case(
        "dp-plan-saver-needs-a-package",
        dp("--vram_budget", "1", "--plan", checkout="ckpt"),
        "diffusion-pipe's train.py needs the Python package 'dgls_test_absent_package', which is not installed",
        checkout_copy(saver_head="import dgls_test_absent_package  # noqa\n"),
    ),
    # a file of the checkout itself is missing: not a package to install
    Case(
        "dp-plan-saver-needs-a-file-of-the-checkout",
        dp("--vram_budget", "1", "--plan", checkout="ckpt"),
        "diffusion-pipe's train.py imports utils.dgls_test_absent_module, and the checkout {tmp}/ckpt has no "
        "utils/dgls_test_absent_module.py: the checkout is incomplete",
        checkout_copy(saver_head="import utils.dgls_test_absent_module  # noqa\n"),
    ),
    Case(
        "dp-plan-checkout-without-saver",
        dp("--vram_budget", "1", "--plan", checkout="ckpt"),
        "the checkout {tmp}/ckpt has no utils/saver.py: the checkout is incomplete",
        checkout_copy(remove="utils/saver.py"),
    ),
    Case(
        "dp-submodule-not-cloned",
        dp("--no-dynamic_swapping", checkout="ckpt"),
        "imports 'comfy_api' from its submodule submodules/ComfyUI, which is empty (the checkout was cloned without "
        "--recurse-submodules): run git submodule update --init --recursive",
        checkout_copy("import comfy_api.latest  # noqa\n", submodules=("submodules/ComfyUI", "submodules/flow")),
    ),
    Case(
        "dp-package-missing-and-submodules-empty",
        dp("--no-dynamic_swapping", checkout="ckpt"),
        "its submodule submodules/HunyuanVideo is empty too: run git submodule update --init --recursive",
        checkout_copy("import dgls_test_absent_package  # noqa\n", submodules=("submodules/HunyuanVideo",)),
    ),
]
if NOT_ROOT:
    CASES.append(
        Case("output-dir-chmod", lambda t: demo(output_dir=str(t / "ro" / "out"))(t), "not writable", read_only)
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, monkeypatch, capsys, user_env):
    argv = case.argv(tmp_path)
    if case.setup is not None:
        case.setup(tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    code, _out, err = run_in_process(argv, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgls: error: "), err
    assert case.message.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert snapshot(tmp_path) == before, "a refused run wrote files"


def test_a_pipeline_stage_checks_placement_against_the_whole_layer_list():
    """Where the layer count is known only once the model is built (most drop-in model types), the stage
    refuses what does not fit instead of keeping the indices in its range: ``--gpu_layers 0,99`` on 10 layers
    dropped 99 without a word (issue 39, a regression of the per-stage split)."""
    with pytest.raises(DGLSUserError, match="gpu_layers names layer 99, but the model has 10 layers: indices run 0-9"):
        SwapConfig.of(gpu_layers=[0, 99]).for_stage(0, 10, 10)
    with pytest.raises(DGLSUserError, match="blocks_to_swap is 11, but the model has only 10 layers"):
        SwapConfig.of(blocks_to_swap=11).for_stage(0, 5, 10)
    assert SwapConfig.of(gpu_layers=[0, 7]).for_stage(5, 10, 10).placement.gpu_layers == [2]
    assert SwapConfig.of(gpu_layers=[0, 9]).for_stage(0, 10, 10).placement.gpu_layers == [0, 9]
    # DeepSpeed's stage bounds are numpy integers: the stage's first layer is a plain int
    stage = SwapConfig.of(blocks_to_swap=2).for_stage(np.int64(4), np.int64(10), 10).placement
    assert stage.first_layer == 4 and type(stage.first_layer) is int


@pytest.mark.parametrize("double, single", [(4, 4), (0, 1), (3, 0)])
def test_the_demo_knows_its_layer_count_before_building_it(double, single):
    cfg = DemoModelConfig(double_blocks=double, single_blocks=single)
    assert layer_count(cfg) == len(build_layers(cfg))


def test_train_py_flags_and_their_abbreviations_pass_through(tmp_path):
    """Only a flag neither dgls_train.py nor the checkout's train.py declares is refused; argparse's
    abbreviations of train.py's flags, DeepSpeed's config flags and flag values pass."""
    (tmp_path / "train.py").write_text(
        "parser.add_argument('--resume_from_checkpoint', nargs='?')\n"
        'parser.add_argument(\n    "--regenerate_cache", action="store_true")\n'
    )
    passed = ["--resume_from", "20250101", "--regenerate_cache", "--deepspeed", "--deepspeed_config=z.json", "-x"]
    check_passthrough_flags(passed, tmp_path, ["--vram_budget"])
    with pytest.raises(DGLSUserError, match=r"unknown argument --trust_cache: neither"):
        check_passthrough_flags(["--trust_cache"], tmp_path, ["--vram_budget"])
    (tmp_path / "train.py").write_text("args = parse()\n")  # declares nothing this way: nothing is refused
    check_passthrough_flags(["--trust_cache"], tmp_path, ["--vram_budget"])


def test_an_abbreviated_train_py_flag_reaches_train_py_in_full_and_an_ambiguous_one_is_refused(tmp_path):
    """DGLS's own checks of train.py's flags (the resume check, --reset_optimizer) match full names: an
    abbreviation is written out before they run and before train.py gets it; one that abbreviates several of
    train.py's flags (diffusion-pipe's --reset: three --reset_* flags) is one line naming them, where
    train.py's argparse would stop with a usage dump after its imports (issue 39 review)."""
    (tmp_path / "train.py").write_text(
        "".join(
            f"parser.add_argument('{flag}', action='store_true')\n"
            for flag in (
                "--resume_from_checkpoint",
                "--reset_dataloader",
                "--reset_optimizer",
                "--reset_optimizer_params",
                "--regenerate_cache",
            )
        )
    )
    args = [
        "--resume",
        "run1",
        "--reset_optimizer",
        "--reset_optimizer_p",
        "--reg",
        "--deepspeed_c=z.json",
        "--",
        "--res",
    ]
    assert check_passthrough_flags(args, tmp_path, []) == [
        "--resume_from_checkpoint",
        "run1",
        "--reset_optimizer",
        "--reset_optimizer_params",
        "--regenerate_cache",
        "--deepspeed_config=z.json",
        "--",
        "--res",
    ]
    expected = (
        "--reset is ambiguous: it abbreviates train.py's --reset_dataloader, --reset_optimizer, "
        "--reset_optimizer_params: write the flag in full"
    )
    with pytest.raises(DGLSUserError) as raised:
        check_passthrough_flags(["--reset"], tmp_path, [])
    assert str(raised.value) == expected


def test_an_abbreviated_resume_flag_is_checked_up_front_and_passed_in_full(tmp_path):
    """``--resume`` resumed in train.py (its argparse expands it) but skipped DGLS's resume check."""
    from utils.dgls.program.validate import prepare

    with pytest.raises(DGLSUserError, match="has no earlier run to resume"):
        prepare(dp("--resume")(tmp_path), ROOT)
    run = prepare(dp("--cache")(tmp_path), ROOT)
    assert "--cache_only" in run.train_args and "--cache" not in run.train_args


def test_a_drop_in_full_fine_tune_of_two_processes_on_one_stage_trains_data_parallel(tmp_path, monkeypatch):
    """Two processes of a diffusion-pipe full fine-tune on one pipeline stage each update their share of the streamed
    layers (training/data_parallel.py); one process, or a LoRA, does not share."""
    from utils.dgls.program.validate import prepare

    for key, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    run = prepare(dp("--blocks_to_swap", "1", tables=FULL_TABLES)(tmp_path / "full"), ROOT)
    assert run.swap.training.data_parallel and run.swap.training.host_optimizer is not None
    lora = prepare(dp("--blocks_to_swap", "1")(tmp_path / "lora"), ROOT)
    assert lora.swap.training.host_optimizer is None and not lora.swap.training.data_parallel
    monkeypatch.setenv("WORLD_SIZE", "1")
    one = prepare(dp("--blocks_to_swap", "1", tables=FULL_TABLES)(tmp_path / "one"), ROOT)
    assert one.swap.training.host_optimizer is not None and not one.swap.training.data_parallel


LISTEN = "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
LISTEN += "print(s.getsockname()[1], flush=True)\ntime.sleep(60)\n"


@pytest.fixture
def busy_port():
    """A port another program listens on (as one more training run's rank 0 would; a listener of this very
    process would not count, as torch's stores in one process share their server)."""
    other = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        yield int(other.stdout.readline())
    finally:
        other.kill()
        other.communicate()


BUSY_PORT_CASES = {
    "one-process-master-port": (
        lambda tmp, port: demo()(tmp),
        {"MASTER_PORT": "{port}"},
        "port {port} is in use by another program (another training run?); it is the environment's MASTER_PORT: set "
        "a free one, or unset MASTER_PORT (a free one is picked)",
    ),
    "drop-in-master-port-flag": (
        lambda tmp, port: dp("--master_port", str(port))(tmp),
        {},
        "port {port} is in use by another program (another training run?): pass a free port with --master_port, or "
        "drop it (a free one is picked)",
    ),
    "launcher-rank-0": (
        lambda tmp, port: demo()(tmp),
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "{port}"},
        "it is MASTER_PORT, which the deepspeed launcher sets from its --master_port (default 29500): launch with "
        "deepspeed --master_port N, a free port N",
    ),
}


@pytest.mark.parametrize("name", BUSY_PORT_CASES)
def test_a_busy_master_port_is_one_line_before_anything_starts(
    name, busy_port, tmp_path, monkeypatch, capsys, user_env
):
    """Refused up front by the process that would listen there (rank 0), instead of torch's DistNetworkError
    traceback once DeepSpeed starts."""
    argv, variables, message = BUSY_PORT_CASES[name]
    argv = argv(tmp_path, busy_port)
    for key, value in variables.items():
        monkeypatch.setenv(key, value.format(port=busy_port))
    before = snapshot(tmp_path)
    code, _out, err = run_in_process(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("dgls: error: "), err
    assert message.format(port=busy_port) in err, err
    assert snapshot(tmp_path) == before


def test_a_pipeline_stage_without_layers_stops_every_process_naming_pipeline_stages():
    """diffusion-pipe's layer count is known only once train.py built the model: when DeepSpeed's split leaves a
    stage empty, each process (each sees the whole split) stops at the build, before the swapper and before any
    process communicates; before, the empty stage's process said 'the layer list is empty' and the others died
    in gloo. (Three real processes: test_multi_process.py, slow.)"""
    from utils.dgls.errors import DGLSUserError
    from utils.dgls.trainers.pipeline_hook import StageHook

    hook = StageHook(lambda stage: pytest.fail("nothing is installed"))
    build = hook._wrap_build(lambda module: pytest.fail("nothing is built"))
    module = SimpleNamespace(parts=[0, 1, 2, 2], _layer_specs=["first", "last"])
    expected = (
        "pipeline_stages = 3 leaves pipeline stage(s) 3 of 3 without any of the model's 2 layers: set "
        "pipeline_stages lower in the training TOML (2 at most)"
    )
    with pytest.raises(DGLSUserError) as raised:
        build(module)
    assert str(raised.value) == expected


def test_the_transformers_peft_check_passes_a_new_enough_peft_a_full_fine_tune_and_other_types(monkeypatch):
    from utils.dgls.program import dp_model

    monkeypatch.setattr(dp_model, "transformers_min_peft", lambda: "0.22.0")
    lora = {"model": {"type": "sdxl"}, "adapter": {"type": "lora"}}
    for peft in ("0.22.0", "0.22", "0.22.1.dev0", "1.0"):  # compared as transformers compares (packaging)
        monkeypatch.setattr(dp_model, "installed_version", {"peft": peft, "transformers": "5.24.0"}.get)
        dp_model.check_adapter_libraries(lora, "x.toml")
    for peft in ("0.21.2", "0.22.0.dev0", "0.22.0rc1"):  # a pre-release of 0.22.0 is older than 0.22.0
        monkeypatch.setattr(dp_model, "installed_version", {"peft": peft, "transformers": "5.24.0"}.get)
        dp_model.check_adapter_libraries({"model": {"type": "sdxl"}}, "x.toml")  # a full fine-tune adds no LoRA
        dp_model.check_adapter_libraries({**lora, "model": {"type": "flux"}}, "x.toml")  # diffusers' own PEFT path
        with pytest.raises(DGLSUserError, match=f"refuses peft {peft} "):
            dp_model.check_adapter_libraries(lora, "x.toml")


def test_the_peft_version_transformers_asks_for_is_read_from_its_source():
    """Read without importing transformers (seconds); its PEFT integration says it as MIN_PEFT_VERSION."""
    from utils.dgls.program import dp_model

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from packaging.version import Version

    found = dp_model.transformers_min_peft()
    assert found is not None and Version(found) >= Version("0.1"), found
