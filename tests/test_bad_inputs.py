"""Every bad input is one line on stderr and exit code 2, before any work starts, and nothing is written.

One table of cases, a few per kind of mistake (the clusters of issue 15): the [demo], [dgls]
and diffusion-pipe tables, numbers that are not numbers, output paths that cannot be
written, precision settings that cannot work, flags that would be ignored, missing pieces,
dataset files, launcher variables and messages. Each runs dgls_train.py's entry point in this
process (a subprocess costs seconds of imports; the few cases that need the real program
start are in test_launch_lines.py and test_diffusion_pipe_dropin.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import FAKE, FAKE_TABLES, demo_toml, fake_config, run_in_process, snapshot

from utils.dgls.distributed import LAUNCHER_KEYS, RENDEZVOUS_VAR

DIST_VARS = (*LAUNCHER_KEYS, "MASTER_ADDR", "MASTER_PORT", "DGLS_DIFFUSION_PIPE", RENDEZVOUS_VAR)


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
    *flags: str, top: str = "", dataset: str | None = None, tables: str = FAKE_TABLES
) -> Callable[[Path], list[str]]:
    return lambda tmp: [
        "--config",
        str(fake_config(tmp, top=top, dataset=dataset, tables=tables)),
        "--diffusion_pipe",
        str(FAKE),
        *flags,
    ]


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
        "pipeline_stages = 3 must divide the 2 processes",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
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
    Case("demo-full-vram-budget", demo("--vram_budget", "4", base="demo_full.toml"), "with a full fine-tune"),
    Case(
        "demo-full-optimizer",
        demo(base="demo_full.toml", optimizer={"type": "prodigy"}),
        "type = 'prodigy' cannot run on the host",
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
        "demo-full-device-sgd",
        demo("--host_adam", "device", base="demo_full.toml", optimizer={"type": "sgd", "lr": 1e-3}),
        "the device host optimizer is AdamW: use type = 'adamw', or --host_adam torch_fused",
    ),
    Case(
        "demo-full-data-parallel",
        demo(base="demo_full.toml"),
        "full fine-tuning of streamed layers runs one process per stage",
        env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
    ),
    Case("dp-full-optimizer", dp(tables=FULL_TABLES.replace('"adamw"', '"adamw8bit"')), "'adamw8bit' cannot run on"),
    Case("dp-full-vram-budget", dp("--vram_budget", "8", tables=FULL_TABLES), "with a full fine-tune"),
    Case("dp-full-deepspeed-config", dp("--deepspeed_config", "z.json", tables=FULL_TABLES), "ZeRO offload would"),
    Case("dp-stages-not-a-number", dp(top='pipeline_stages = "two"'), "pipeline_stages must be a whole number"),
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
if NOT_ROOT:
    CASES.append(
        Case("output-dir-chmod", lambda t: demo(output_dir=str(t / "ro" / "out"))(t), "not writable", read_only)
    )


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """No torch.distributed variables and no checkout variable, as on a user's machine; the test's
    folder as the current one. os.environ is restored afterwards (a run may set variables)."""
    saved = dict(os.environ)
    for key in DIST_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(saved)


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
    assert case.message in lines[0], lines[0]
    assert snapshot(tmp_path) == before, "a refused run wrote files"


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
    from utils.dgls.pipeline_hook import StageHook

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
