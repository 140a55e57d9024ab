"""Start-up on a CPU (issue 39): no C++ build, no wait on a build's lock, nothing written to /dev/shm.

DeepSpeed's ``init_distributed`` used to load its CPU shared-memory op (``deepspeed_shm_comm``), building
it on the first run (minutes, in silence) and waiting forever on the build's ``lock`` file once a build
was killed; DGLS runs keep it out (utils/dgls/shm_op.py). The stale lock is made in a temporary
``TORCH_EXTENSIONS_DIR``; torch's wait on it raises in the fast tests (so that a run that would wait fails
instead of hanging). A real read-only /dev/shm needs a private mount namespace (root and ``unshare``):
the slow test that uses one skips without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import FAKE, demo_toml, fake_config, python_cmd, run_in_process
from conftest import ROOT
from helpers import DIST_KEYS, child_env

from utils.dgls.shm_op import without_shm_op

SHM_OP = "deepspeed_shm_comm"


def stale_lock(folder: Path) -> Path:
    """What a killed build leaves: the op's build folder with only its ``lock`` file."""
    lock = folder / SHM_OP / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    return lock


@pytest.fixture
def locked_extensions(tmp_path, monkeypatch):
    """An extensions folder with a stale lock, as the one torch builds in; nothing loaded before (an
    earlier test of this process may have loaded the op, and DeepSpeed would not look again); waiting
    on the lock raises."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from torch.utils.file_baton import FileBaton

    folder = tmp_path / "torch_extensions"
    lock = stale_lock(folder)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})

    def wait(baton):
        raise AssertionError(f"waited on {baton.lock_file_path}")

    monkeypatch.setattr(FileBaton, "wait", wait)
    return SimpleNamespace(folder=folder, lock=lock)


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """A user's shell (no torch.distributed variables), restored afterwards: an in-process run sets them."""
    saved = dict(os.environ)
    for key in (*DIST_KEYS, "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "DGLS_DIFFUSION_PIPE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(saved)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------------ DeepSpeed's CPU shared-memory op


def test_inside_without_shm_op_deepspeed_neither_builds_nor_waits_for_its_cpu_op(locked_extensions):
    """The decision DeepSpeed's TorchBackend makes at init_distributed (``build_shm_op``), with the
    installed DeepSpeed (CI: also 0.18.4); its table of compatible ops is as before afterwards."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    before = dict(deepspeed.ops.__compatible_ops__)
    with without_shm_op():
        assert build_shm_op() is None
    assert deepspeed.ops.__compatible_ops__ == before
    assert files_under(locked_extensions.folder) == [SHM_OP, f"{SHM_OP}/lock"]


def test_the_one_process_demo_starts_past_a_stale_build_lock_and_builds_nothing(
    tmp_path, user_env, locked_extensions, capsys
):
    """A one-process CPU run needs no shared-memory all-reduce: the demo neither builds the op nor
    waits on the lock a killed build left (it used to wait forever, in silence)."""
    assert not torch.distributed.is_initialized(), "an earlier test left a process group behind"
    code, out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=1))], capsys)
    assert code == 0, err
    assert "LoRA saved to" in out
    assert files_under(locked_extensions.folder) == [SHM_OP, f"{SHM_OP}/lock"]


def test_the_drop_in_runs_train_py_without_the_shm_op(tmp_path, user_env, locked_extensions, monkeypatch):
    """diffusion-pipe's train.py calls ``deepspeed.init_distributed()`` itself: it runs inside
    ``without_shm_op`` (train.py stands in here: what DeepSpeed decides when it starts)."""
    import runpy

    from deepspeed.comm.torch import build_shm_op

    from utils.dgls.diffusion_pipe import run_drop_in
    from utils.dgls.validate import prepare

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    config = fake_config(tmp_path / "cfg")
    run = prepare(["--config", str(config), "--diffusion_pipe", str(FAKE), "--no-dynamic_swapping"], ROOT)
    built = []
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name: built.append(build_shm_op()))
    run_drop_in(run)
    assert built == [None]


# ------------------------------------------------------------------ /dev/shm


def test_a_one_process_run_writes_nothing_to_shm_in_its_clean_up(tmp_path, user_env, monkeypatch, capsys):
    """A read-only /dev/shm (every write there fails): the one-process demo trains and saves. It used
    to train, then fail removing DeepSpeed's buffer in its clean-up, and save nothing."""
    import pathlib

    real_unlink, real_open = pathlib.Path.unlink, os.open

    def read_only(path) -> OSError:
        return OSError(30, "Read-only file system", str(path))

    def unlink(self, missing_ok=False):
        if str(self).startswith("/dev/shm/"):
            raise read_only(self)
        return real_unlink(self, missing_ok=missing_ok)

    def open_(path, flags, *args, **kwargs):
        if str(path).startswith("/dev/shm/") and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise read_only(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    monkeypatch.setattr(os, "open", open_)
    code, out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=1))], capsys)
    assert code == 0, err
    assert list((tmp_path / "out").glob("*/adapter_model.safetensors"))


# ------------------------------------------------------------------ the real program (slow)


def run_program(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """(exit code, stdout and stderr, seconds to the first line); killed whole after ``timeout``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran over {timeout} s (waiting on something?); output:\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - start


@pytest.mark.slow
def test_the_demo_and_the_drop_in_start_past_a_stale_lock(tmp_path):
    """The issue's case as a user meets it: a build killed once left its lock, and every later CPU run
    waited on it forever. Now the demo and the drop-in (the stand-in checkout) train, build nothing,
    and leave the lock alone."""
    folder = tmp_path / "torch_extensions"
    stale_lock(folder)
    env = {**child_env("DGLS_DIFFUSION_PIPE", "LOCAL_SIZE"), "TORCH_EXTENSIONS_DIR": str(folder)}
    code, out, _ = run_program(python_cmd("--config", str(demo_toml(tmp_path / "demo", steps=2))), ROOT, env, 300)
    assert code == 0 and "LoRA saved to" in out, out[-3000:]
    config = fake_config(tmp_path / "dp", top="max_steps = 2")
    code, out, _ = run_program(python_cmd("--config", str(config), "--diffusion_pipe", str(FAKE)), tmp_path, env, 300)
    assert code == 0, out[-3000:]
    assert files_under(folder) == [SHM_OP, f"{SHM_OP}/lock"]


def private_shm_prefix(mode: str) -> list[str]:
    """A command prefix that runs under a fresh tmpfs on /dev/shm (``ro``: read-only; ``1m``: 1 MiB) in
    a private mount namespace; the machine's /dev/shm is untouched. Skips where that is not allowed."""
    opts = {"ro": "ro,size=64m", "1m": "size=1m"}[mode]
    script = f'mount -t tmpfs -o {opts} dgls-test /dev/shm && exec "$@"'
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("needs a private mount namespace (root and unshare) to give /dev/shm another size")
    return prefix


@pytest.mark.slow
def test_one_process_trains_and_saves_with_a_read_only_shm(tmp_path):
    prefix = private_shm_prefix("ro")
    env = child_env("DGLS_DIFFUSION_PIPE", "LOCAL_SIZE")
    code, out, _ = run_program([*prefix, *python_cmd("--config", str(demo_toml(tmp_path, steps=2)))], ROOT, env, 300)
    assert code == 0 and "LoRA saved to" in out, out[-3000:]
