"""The diffusion-pipe drop-in: finding the checkout, refusals, and the interception, on a stand-in checkout.

The stand-in (tests/fixtures/fake_checkout) has diffusion-pipe's shape without its code. The real
train.py is checked where an environment variable points at a checkout.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import FAKE, fake_config, python_cmd, run_user_command
from conftest import ROOT
from helpers import child_env
from safetensors.torch import load_file

import dgls_train
from utils.dgls.errors import DGLSUserError
from utils.dgls.program.distributed import DEFAULT_PORT
from utils.dgls.program.dp_config import (
    ENV_CHECKOUT,
    check_dataset_files,
    check_train_config,
    find_checkout,
    host_optimizer_spec,
    startup_notes,
)
from utils.dgls.program.launch import build_parser

BASE = {
    "output_dir": "out",
    "model": {"type": "flux", "dtype": "bfloat16"},
    "optimizer": {"type": "adamw"},
    "save_every_n_epochs": 1,
    "adapter": {"type": "lora", "rank": 4},
    "pipeline_stages": 1,
    "activation_checkpointing": True,
}


def test_find_checkout_explicit_env_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_CHECKOUT, raising=False)
    assert find_checkout(str(FAKE), tmp_path) == FAKE.resolve()
    with pytest.raises(DGLSUserError, match="is not a diffusion-pipe checkout: it has no train.py"):
        find_checkout(str(tmp_path), tmp_path)
    monkeypatch.setenv(ENV_CHECKOUT, str(FAKE))
    assert find_checkout(None, tmp_path) == FAKE.resolve()
    monkeypatch.delenv(ENV_CHECKOUT)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DGLSUserError, match="needs diffusion-pipe"):
        find_checkout(None, tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"blocks_to_swap": 10}, "own blocks_to_swap"),
        ({"adapter": None, "optimizer": {"type": "GenericOptim", "lr": 1.0}}, "'GenericOptim' cannot train streamed"),
        ({"adapter": None, "optimizer": {"type": "adamw_optimi"}}, "type 'adamw_optimi' needs lr"),
        ({"adapter": None, "optimizer": {"type": "adamw", "kahan_sum": True}}, "kahan_sum is an option of"),
        ({"adapter": None, "optimizer": {"type": "adamw_optimi", "lr": 1, "decouple_lr": True}}, "decouple_lr cannot"),
        ({"adapter": None, "optimizer": {"type": "adamw", "gradient_release": 1}}, "gradient_release must be true or"),
        ({"activation_checkpointing": "sometimes"}, "activation_checkpointing must be"),
    ],
)
def test_refusals(change, message):
    config = {**BASE, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(DGLSUserError, match=message):
        check_train_config(config, "x.toml", swapping=True)


def test_a_lora_optimizer_is_checked_only_where_every_optimizer_means_the_same():
    """train.py builds a LoRA's optimizer itself and passes it every key: DGLS checks lr, eps, weight_decay,
    momentum and betas (two for AdamW's kind, any number for others), and lets each class's own keys through."""
    table = {"type": "Prodigy", "lr": 1.0, "betas": [0.9, 0.99, 0.999], "d_coef": 2, "safeguard_warmup": True}
    check_train_config({**BASE, "optimizer": table}, "x.toml", swapping=True)
    check_train_config({**BASE, "optimizer": {"type": "adamw", "betas": [0.9, 0.99], "beta2_half_life": 50}}, "x", True)
    for table, message in (
        ({"type": "Prodigy", "lr": "1"}, "lr must be a finite number > 0, got '1'"),
        ({"type": "Prodigy", "betas": [0.9, 1.5, 0.9]}, "betas must be a list of numbers, each in \\[0, 1\\)"),
        ({"type": "adamw8bit", "betas": [0.9]}, "betas must be a list of two numbers"),
        ({"type": "adamw", "beta2_half_life": 50}, "beta2_half_life sets the second of betas"),
        ({"type": "adamw", "betas": [0.9, 0.99], "beta2_half_life": -1}, "beta2_half_life must be a finite number"),
    ):
        with pytest.raises(DGLSUserError, match=message):
            check_train_config({**BASE, "optimizer": table}, "x.toml", swapping=True)


def test_a_full_fine_tune_maps_its_optimizer_to_the_host():
    config = {k: v for k, v in BASE.items() if k != "adapter"}
    config["optimizer"] = {"type": "AdamW", "lr": 2e-5, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-7}
    check_train_config(config, "x.toml", swapping=True)
    spec = host_optimizer_spec(config, "x.toml")
    assert (spec.type, spec.lr, spec.betas, spec.weight_decay, spec.eps) == ("adamw", 2e-5, (0.9, 0.95), 0.1, 1e-7)
    assert host_optimizer_spec(BASE, "x.toml") is None  # a LoRA


def test_a_full_fine_tune_takes_the_defaults_of_the_class_diffusion_pipe_builds():
    """What [optimizer] leaves out is what torch.optim.AdamW, optimi.AdamW or torch.optim.SGD would use; optimi's
    AdamW runs as AdamW (the start-up line says so), kahan_sum accepted (a no-op on fp32 masters in optimi too)."""
    config = {k: v for k, v in BASE.items() if k != "adapter"}

    def spec(table):
        return host_optimizer_spec({**config, "optimizer": table}, "x.toml")

    got = spec({"type": "adamw"})
    assert (got.lr, got.betas, got.eps, got.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    got = spec({"type": "adamw_optimi", "lr": 2e-5, "kahan_sum": True})
    assert (got.type, got.lr, got.betas, got.eps, got.weight_decay) == ("adamw", 2e-5, (0.9, 0.99), 1e-6, 1e-2)
    assert "adamw_optimi" in got.kernel and "Kahan" in got.kernel
    got = spec({"type": "SGD", "lr": 0.1})
    assert (got.type, got.lr, got.momentum, got.weight_decay) == ("sgd", 0.1, 0.0, 0.0)


def test_dataset_files_are_checked_relative_to_the_checkout(tmp_path):
    checkout = tmp_path / "dp"
    (checkout / "data" / "images").mkdir(parents=True)
    (checkout / "data" / "ds.toml").write_text('[[directory]]\npath = "data/images"\n')
    (checkout / "data" / "bad.toml").write_text('[[directory]]\npath = "data/missing"\n')
    (checkout / "data" / "broken.toml").write_text("[[directory]\n")
    evals = [{"name": "e", "config": "data/ds.toml"}]
    check_dataset_files({"dataset": "data/ds.toml", "eval_datasets": evals}, "x", checkout)
    cases = [
        ({}, "sets no dataset"),
        ({"dataset": "data/nope.toml"}, "dataset = 'data/nope.toml' not found"),
        (
            {"dataset": "data/ds.toml", "eval_datasets": ["data/ds.toml"]},
            "eval_datasets\\[0\\] = 'data/ds.toml' must be",
        ),
        ({"dataset": "data/ds.toml", "eval_datasets": [{"name": "e", "config": "n.toml"}]}, "'n.toml' not found"),
        ({"dataset": "data/bad.toml"}, "path 'data/missing' is not a folder"),
        ({"dataset": "data/broken.toml"}, "is not valid TOML"),
    ]
    for config, message in cases:
        with pytest.raises(DGLSUserError, match=message):
            check_dataset_files(config, "x.toml", checkout)


def test_disable_block_swap_for_eval_says_what_it_means_under_dgls():
    assert startup_notes({}) == []
    (note,) = startup_notes({"disable_block_swap_for_eval": True})
    assert "forward-only schedule" in note


def test_unknown_type_and_missing_checkout_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_CHECKOUT, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "typo.toml").write_text('[model]\ntype = "fluxx"\n')
    with pytest.raises(DGLSUserError, match="unknown model type 'fluxx'"):
        dgls_train.main(["--config", str(tmp_path / "typo.toml")])
    (tmp_path / "flux.toml").write_text('[model]\ntype = "flux"\n[adapter]\nrank = 4\n')
    with pytest.raises(DGLSUserError, match="needs diffusion-pipe"):
        dgls_train.main(["--config", str(tmp_path / "flux.toml")])


def _copy_checkout(tmp_path, pipeline_text=None):
    checkout = tmp_path / "dp"
    shutil.copytree(FAKE, checkout)
    if pipeline_text is not None:
        (checkout / "utils" / "pipeline.py").write_text(pipeline_text)
    return checkout


def _facts(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAKE_TRAIN "))
    return json.loads(line[len("FAKE_TRAIN ") :])


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_interception_streams_layers_and_matches_plain_run(tmp_path):
    """The README's launch line from inside a checkout, with none of the torch.distributed variables
    set (as on a user's machine; the stand-in train.py, like diffusion-pipe's, sets only MASTER_ADDR
    and MASTER_PORT): DGLS makes it a one-process job. The LoRA equals a plain train.py run's."""
    checkout = _copy_checkout(tmp_path)
    swapped_cfg, plain_cfg = fake_config(tmp_path / "a"), fake_config(tmp_path / "b")
    proc = run_user_command(
        python_cmd("--config", str(swapped_cfg), "--blocks_to_swap", "6", "--prefetch", "2"), checkout
    )
    swapped = _facts(proc)
    assert "streamed" in proc.stdout  # the placement table
    plain = _facts(run_user_command(python_cmd("--config", str(plain_cfg), "--no-dynamic_swapping"), checkout))
    assert swapped["placeholders"] > 0 and plain["placeholders"] == 0
    assert swapped["losses"] == plain["losses"]
    lora_swapped, lora_plain = (load_file(str(tmp_path / x / "out" / "lora.safetensors")) for x in "ab")
    assert lora_swapped.keys() == lora_plain.keys()
    for key in lora_plain:
        assert (lora_swapped[key] == lora_plain[key]).all(), key
    assert Path(swapped["cwd"]).resolve() == checkout.resolve()
    job = swapped["env"]
    assert (job["RANK"], job["WORLD_SIZE"], job["LOCAL_RANK"], job["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert job["MASTER_PORT"] != str(DEFAULT_PORT)  # a free port: two runs on one machine do not collide
    assert swapped["argv"][-3:] == ["--master_port", job["MASTER_PORT"], "--local_rank=0"]


def test_train_py_arguments_pass_through():
    args, rest = build_parser().parse_known_args(
        [
            "--config",
            "c.toml",
            "--prefetch",
            "2",
            "--resume_from_checkpoint",
            "--regenerate_cache",
            "--master_port",
            "29501",
            "--deepspeed",
        ]
    )
    assert args.prefetch == 2
    assert rest == ["--resume_from_checkpoint", "--regenerate_cache", "--master_port", "29501", "--deepspeed"]


@pytest.mark.skipif(not os.environ.get(ENV_CHECKOUT), reason=f"set {ENV_CHECKOUT} to a diffusion-pipe checkout")
def test_real_train_py_still_has_the_interception_points():
    checkout = Path(os.environ[ENV_CHECKOUT])
    train = (checkout / "train.py").read_text()
    pipeline = (checkout / "utils" / "pipeline.py").read_text()
    assert re.search(r"^from utils\.pipeline import ManualPipelineModule", train, re.M), "train.py import changed"
    assert "model.to_layers()" in train, "train.py no longer builds layers with model.to_layers()"
    assert re.search(r"ManualPipelineModule\(\s*layers=layers", train), "ManualPipelineModule call changed"
    assert "class ManualPipelineModule(PipelineModule)" in pipeline


@pytest.mark.parametrize(
    "pipeline_text, message",
    [
        (
            "class ManualPipelineModule:\n    pass\n",
            "no ManualPipelineModule built on DeepSpeed.s PipelineModule, where DGLS takes over the layers",
        ),
        ("import a_module_this_checkout_lacks\n", "cannot import diffusion-pipe's utils/pipeline.py"),
    ],
    ids=["interception-point-gone", "pipeline-does-not-import"],
)
@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_a_checkout_the_interception_does_not_fit_is_one_line(tmp_path, pipeline_text, message):
    checkout = _copy_checkout(tmp_path, pipeline_text)
    proc = _run_dgls_train(ROOT / "dgls_train.py", tmp_path, "--diffusion_pipe", str(checkout))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_an_incomplete_copy_into_a_checkout_names_what_is_missing(tmp_path):
    checkout = _copy_checkout(tmp_path)
    shutil.copy(ROOT / "dgls_train.py", checkout)
    proc = _run_dgls_train(checkout / "dgls_train.py", tmp_path)
    assert proc.returncode == 2 and "utils/dgls/ is missing next to dgls_train.py" in proc.stderr, proc.stderr
    shutil.copytree(ROOT / "utils" / "dgls", checkout / "utils" / "dgls")
    (checkout / "utils" / "dgls" / "program" / "launch.py").unlink()
    proc = _run_dgls_train(checkout / "dgls_train.py", tmp_path)
    assert proc.returncode == 2 and "utils/dgls/program/launch.py is missing" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    shutil.copy(ROOT / "utils" / "dgls" / "program" / "launch.py", checkout / "utils" / "dgls" / "program")
    shutil.rmtree(checkout / "utils" / "dgls" / "memory")
    proc = _run_dgls_train(checkout / "dgls_train.py", tmp_path)
    assert proc.returncode == 2 and "utils/dgls/memory is missing" in proc.stderr, proc.stderr
    shutil.copytree(ROOT / "utils" / "dgls" / "memory", checkout / "utils" / "dgls" / "memory")
    shutil.rmtree(checkout / "utils" / "dgls" / "demo")  # the drop-in runs without it; the demo names it
    demo = subprocess.run(
        [sys.executable, str(checkout / "dgls_train.py"), "--config", str(ROOT / "toml" / "demo.toml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=child_env(),
    )
    assert demo.returncode == 2, demo.stderr
    assert demo.stderr == (
        "dgls: error: utils/dgls/demo/settings.py is missing next to dgls_train.py: copy the whole utils/dgls "
        "folder along with dgls_train.py (see the README)\n"
    )


def _run_dgls_train(script, tmp_path, *extra):
    config = fake_config(tmp_path / "cfg")
    env = child_env(ENV_CHECKOUT)
    return subprocess.run(
        [sys.executable, str(script), "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


def test_gpu_id_selects_the_device_of_a_one_process_run(tmp_path, monkeypatch):
    """--gpu_id 1 on a two-GPU machine: train.py gets --local_rank=1 (it calls torch.cuda.set_device with
    it) and LOCAL_RANK=1 (DeepSpeed's PipelineModule places the module by it)."""
    import torch

    from utils.dgls.program.validate import prepare

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = fake_config(tmp_path)
    run = prepare(["--config", str(config), "--diffusion_pipe", str(FAKE), "--gpu_id", "1"], ROOT)
    assert run.train_args[-1] == "--local_rank=1" and run.dist.env["LOCAL_RANK"] == "1"
    with pytest.raises(DGLSUserError, match="--gpu_id 2 but only 2 CUDA device"):
        prepare(["--config", str(config), "--diffusion_pipe", str(FAKE), "--gpu_id", "2"], ROOT)


def test_a_run_too_short_for_the_profile_says_so():
    from utils.dgls import SwapConfig
    from utils.dgls.trainers.diffusion_pipe import PipelineInterception

    lines = []
    values = {"verbose": False, "verbose_every": 10, "plan": False}
    interception = PipelineInterception(values, log=lines.append, swap=SwapConfig.of(profile="/tmp/t.json"))
    interception.swapper, interception.steps = object(), 2
    interception.finish()
    assert lines == [
        "DGLS: --profile: train.py ran 2 training step(s), fewer than the 3 the profile starts at: "
        "no trace was written to /tmp/t.json"
    ]


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
@pytest.mark.parametrize("steps", [3, pytest.param(1, marks=pytest.mark.slow)], ids=["probe-done", "run-too-short"])
def test_plan_in_the_drop_in_saves_nothing(tmp_path, steps):
    """--plan stops after the probe; if train.py ends first, it says so. Either way no LoRA, no
    checkpoint and no run folder stay behind (diffusion-pipe's Saver does nothing under --plan)."""
    config = fake_config(tmp_path / "cfg", top=f"max_steps = {steps}\ncheckpoint_every_n_steps = 1")
    proc = run_user_command(
        python_cmd("--config", str(config), "--diffusion_pipe", str(FAKE), "--vram_budget", "1", "--plan"), tmp_path
    )
    if steps == 3:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (
            "DGLS plan (" in proc.stdout and "--plan: stopping after the probe steps; nothing was saved" in proc.stdout
        )
    else:
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert "--plan: train.py stopped after 1 training step(s), before the planner had measured" in proc.stderr
    assert list((tmp_path / "cfg" / "out").iterdir()) == []


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_a_package_train_py_needs_but_is_missing_is_one_line(tmp_path):
    checkout = _copy_checkout(tmp_path)
    train = checkout / "train.py"
    train.write_text("import a_package_nobody_has  # noqa\n" + train.read_text())
    proc = _run_dgls_train(ROOT / "dgls_train.py", tmp_path, "--diffusion_pipe", str(checkout))
    assert proc.returncode == 2 and proc.stderr == (
        "dgls: error: diffusion-pipe's train.py needs the Python package 'a_package_nobody_has', which is not "
        f"installed: pip install -r {checkout / 'requirements.txt'}\n"
    ), proc.stderr[-2000:]
