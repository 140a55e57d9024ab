"""Shared by the command-line tests: configs for the demo and the stand-in checkout, running
dgls_train.py in-process or as a user would, and snapshots of the files a run may touch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ROOT
from helpers import child_env

import dgls_train
from utils.dgls.program.launch import entry

FAKE = ROOT / "tests" / "fixtures" / "fake_checkout"


def demo_toml(
    folder: Path,
    steps: int = 4,
    dgls: Any = "keep",
    model: dict | None = None,
    optimizer: dict | None = None,
    base: str = "demo.toml",
    **demo: Any,
) -> Path:
    """toml/demo.toml (or ``base``, e.g. demo_full.toml) with its output in ``folder/out``, ``steps`` steps
    and ``demo`` keys set in [demo] (None removes one); ``dgls`` replaces the [dgls] table (any value:
    tests give bad ones), ``model`` updates [model], ``optimizer`` replaces [optimizer]."""
    import toml

    config = toml.loads((ROOT / "toml" / base).read_text())
    if optimizer is not None:
        config["optimizer"] = optimizer
    config["demo"].update({"steps": steps, "output_dir": str(folder / "out"), **demo})
    config["demo"] = {k: v for k, v in config["demo"].items() if v is not None}
    config["model"].update(model or {})
    if dgls != "keep":
        config.pop("dgls")
        if dgls is not None:
            config = {"dgls": dgls, **config} if not isinstance(dgls, dict) else {**config, "dgls": dgls}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "demo.toml"
    path.write_text(toml.dumps(config))
    return path


FAKE_TABLES = '[model]\ntype = "flux"\ndtype = "float32"\n[adapter]\ntype = "lora"\nrank = 4\n'
FAKE_TABLES += '[optimizer]\ntype = "adamw"\nlr = 1e-3\n'


def fake_config(folder: Path, top: str = "", dataset: str | None = None, tables: str = FAKE_TABLES) -> Path:
    """A diffusion-pipe training TOML for the stand-in checkout, with its dataset folder; ``top``
    adds or overrides top-level keys (TOML text; the value DROP removes one), ``dataset`` replaces
    the dataset TOML's text, ``tables`` the tables after the top-level keys."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    (folder / "out").mkdir(exist_ok=True)
    (folder / "dataset.toml").write_text(dataset or f'[[directory]]\npath = "{folder / "images"}"\n')
    base = {
        "output_dir": f'"{folder / "out"}"',
        "dataset": f'"{folder / "dataset.toml"}"',
        "save_every_n_epochs": "1",
        "pipeline_stages": "1",
        "activation_checkpointing": "true",
    }
    for line in top.splitlines():
        if "=" in line:
            key, value = (x.strip() for x in line.split("=", 1))
            base[key] = value
    text = "\n".join(f"{k} = {v}" for k, v in base.items() if v != "DROP") + "\n" + tables
    path = folder / "train.toml"
    path.write_text(text)
    return path


def run_in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    """dgls_train.py's entry point in this process: (exit code, stdout, stderr)."""
    code = entry(lambda: dgls_train.main(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no torch.distributed variables, no DGLS_DIFFUSION_PIPE
    (the launch lines find the checkout from --diffusion_pipe or the current folder)."""
    return child_env("DGLS_DIFFUSION_PIPE")


def run_user_command(cmd: list[str], cwd: Path, env_extra: dict[str, str] | None = None, timeout: int = 600):
    """A command as a user types it (see user_env)."""
    env = user_env()
    env.update(env_extra or {})
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def deepspeed_cmd(*args: str) -> list[str]:
    """``deepspeed ...``: the launcher script installed with deepspeed (beside this Python, or on PATH)."""
    import shutil
    import sys

    script = Path(sys.executable).parent / "deepspeed"
    found = str(script) if script.is_file() else shutil.which("deepspeed")
    assert found, "the deepspeed launcher script is not installed"
    return [found, *args]


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "dgls_train.py"), *args]


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``roots``: (size, mtime in ns); two snapshots differ if anything was written."""
    seen = {}
    for root in roots:
        for base, dirs, files in os.walk(root):
            for name in dirs + files:
                p = Path(base) / name
                st = p.stat()
                seen[str(p)] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return seen


def write_checkpoint(
    run_dir: Path, adapter: bool = True, host_stages: int = 0, tag: str = "global_step2", latest: bool = True
) -> Path:
    """A small checkpoint folder as diffusion-pipe's train.py leaves it (DeepSpeed's files, with DGLS's host
    optimizer state of ``host_stages`` stages): three layers of LoRA weights (``adapter``: a rank-2 LoRA of a 4x4
    Linear ``proj``) or of that Linear's weights, and ``latest`` naming ``tag``. Returns the tag folder."""
    import torch

    folder = run_dir / tag
    folder.mkdir(parents=True, exist_ok=True)
    if adapter:  # a rank-2 LoRA on a 4x4 Linear, or the Linear itself
        weights = {"proj.lora_A.default.weight": torch.zeros(2, 4), "proj.lora_B.default.weight": torch.zeros(4, 2)}
    else:
        weights = {"proj.weight": torch.zeros(4, 4), "proj.bias": torch.zeros(4)}
    for i in range(3):
        torch.save(weights, folder / f"layer_{i:02d}-model_states.pt")
    torch.save({"module": None, "optimizer": {"state": {}, "param_groups": []}}, folder / "mp_rank_00_model_states.pt")
    for stage in range(host_stages):
        state = {1: {"state": {}, "param_groups": [{"params": [0, 1], "lr": 1e-3, "betas": (0.9, 0.99)}]}}
        torch.save(state, folder / f"dgls_host_optimizer_stage{stage}.pt")
    if latest:
        (run_dir / "latest").write_text(tag)
    return folder
