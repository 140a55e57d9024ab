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
from conftest import ROOT
from helpers import child_env
from safetensors.torch import load_file

import dgls_train
from utils.dgls.diffusion_pipe import (
    ENV_CHECKOUT,
    check_dataset_files,
    check_train_config,
    find_checkout,
    startup_notes,
)
from utils.dgls.errors import DGLSUserError

FAKE = ROOT / "tests" / "fixtures" / "fake_checkout"
BASE = {"adapter": {"type": "lora", "rank": 4}, "pipeline_stages": 1, "activation_checkpointing": True}


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
        ({"adapter": None}, "has no \\[adapter\\]"),
        ({"pipeline_stages": 2}, "pipeline_stages = 2"),
        ({"activation_checkpointing": "sometimes"}, "activation_checkpointing must be"),
    ],
)
def test_refusals(change, message):
    config = {**BASE, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(DGLSUserError, match=message):
        check_train_config(config, "x.toml")


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
        ({"dataset": "data/ds.toml", "eval_datasets": ["data/nope.toml"]}, "eval_datasets\\[0\\] = 'data/nope.toml'"),
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


def run_fake(tmp_path, *extra):
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "train.toml"
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "dataset.toml").write_text(f'[[directory]]\npath = "{tmp_path / "images"}"\n')
    config.write_text(
        f'output_dir = "{out}"\ndataset = "{tmp_path / "dataset.toml"}"\npipeline_stages = 1\n'
        'activation_checkpointing = true\n[model]\ntype = "flux"\n[adapter]\ntype = "lora"\nrank = 4\n'
    )
    env = child_env(ENV_CHECKOUT)
    env["MASTER_PORT"] = str(29500 + os.getpid() % 1000 + len(extra))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "dgls_train.py"), "--config", str(config), "--diffusion_pipe", str(FAKE), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAKE_TRAIN "))
    return json.loads(line[len("FAKE_TRAIN ") :]), load_file(str(out / "lora.safetensors")), proc.stdout


def test_interception_streams_layers_and_matches_plain_run(tmp_path):
    swapped, lora_swapped, stdout = run_fake(tmp_path / "a", "--blocks_to_swap", "6", "--prefetch", "1")
    plain, lora_plain, _ = run_fake(tmp_path / "b", "--no-dynamic_swapping")
    assert "streamed" in stdout  # the placement table
    assert swapped["placeholders"] > 0 and plain["placeholders"] == 0
    assert swapped["losses"] == plain["losses"]
    assert lora_swapped.keys() == lora_plain.keys()
    for key in lora_plain:
        assert (lora_swapped[key] == lora_plain[key]).all(), key
    assert Path(swapped["cwd"]).resolve() == FAKE.resolve()


def test_train_py_arguments_pass_through():
    args, rest = dgls_train.build_parser().parse_known_args(
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


def _copy_checkout(tmp_path, pipeline_text=None):
    checkout = tmp_path / "dp"
    shutil.copytree(FAKE, checkout)
    if pipeline_text is not None:
        (checkout / "utils" / "pipeline.py").write_text(pipeline_text)
    return checkout


@pytest.mark.parametrize(
    "pipeline_text, message",
    [
        (
            "class ManualPipelineModule:\n    pass\n",
            "no ManualPipelineModule.__init__: this checkout is too old or too new",
        ),
        ("import a_module_this_checkout_lacks\n", "cannot import diffusion-pipe's utils/pipeline.py"),
    ],
    ids=["interception-point-gone", "pipeline-does-not-import"],
)
def test_a_checkout_the_interception_does_not_fit_is_one_line(tmp_path, pipeline_text, message):
    checkout = _copy_checkout(tmp_path, pipeline_text)
    proc = _run_dgls_train(ROOT / "dgls_train.py", tmp_path, "--diffusion_pipe", str(checkout))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]


def test_an_incomplete_copy_into_a_checkout_names_what_is_missing(tmp_path):
    checkout = _copy_checkout(tmp_path)
    shutil.copy(ROOT / "dgls_train.py", checkout)
    proc = _run_dgls_train(checkout / "dgls_train.py", tmp_path)
    assert proc.returncode == 2 and "utils/dgls/ is missing next to dgls_train.py" in proc.stderr, proc.stderr
    shutil.copytree(ROOT / "utils" / "dgls", checkout / "utils" / "dgls")
    (checkout / "utils" / "dgls" / "launch.py").unlink()
    proc = _run_dgls_train(checkout / "dgls_train.py", tmp_path)
    assert proc.returncode == 2 and "utils/dgls/launch.py is missing" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _run_dgls_train(script, tmp_path, *extra):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "dataset.toml").write_text(f'[[directory]]\npath = "{tmp_path / "images"}"\n')
    config = tmp_path / "train.toml"
    config.write_text(
        f'output_dir = "{out}"\ndataset = "{tmp_path / "dataset.toml"}"\n'
        '[model]\ntype = "flux"\n[adapter]\ntype = "lora"\nrank = 4\n'
    )
    env = child_env(ENV_CHECKOUT)
    return subprocess.run(
        [sys.executable, str(script), "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
