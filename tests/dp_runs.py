"""Running diffusion-pipe's real train.py from the tests (shared by the test_diffusion_pipe_*_real modules).

train.py runs in a subprocess through tests/fixtures/run_dp_train.py (environment, seeds,
shims, runpy); the checkout is the one $DGLS_DIFFUSION_PIPE names. Without it the tests
that use ``checkout_or_skip`` are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
RUNNER = FIXTURES / "run_dp_train.py"
ENV = "DGLS_DIFFUSION_PIPE"
# float32 on CPU (bitwise repeatable with MKL_CBWR); bf16 on a GPU, as users train (cuDNN attention off
# in the runner, so GPU runs are bitwise repeatable too).
DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
RUN_TIMEOUT = 600  # seconds per train.py run; a crash in a caching worker can leave train.py waiting forever

requires_checkout = pytest.mark.skipif(
    not os.environ.get(ENV), reason=f"opt-in, slow: set {ENV} to a diffusion-pipe checkout to run train.py for real"
)

# What train.py and its imports need beyond DGLS's own requirements (wandb: the runner has a stand-in).
DP_IMPORTS = ["deepspeed", "diffusers", "transformers", "peft", "multiprocess", "datasets", "imageio", "tensorboard"]


def checkout_or_skip() -> Path:
    """The checkout $DGLS_DIFFUSION_PIPE names, checked; skips when a package train.py needs is missing."""
    path = Path(os.environ[ENV]).resolve()
    assert (path / "train.py").is_file(), f"{ENV}={path} has no train.py"
    assert (path / "submodules" / "HunyuanVideo" / "hyvideo").is_dir(), (
        f"{path}/submodules/HunyuanVideo is empty: utils/patches.py imports its hyvideo package"
    )
    for name in DP_IMPORTS:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"diffusion-pipe needs the Python package {name!r}")
    return path


def run_train(
    checkout: Path,
    config: Path,
    log: Path,
    *extra: str,
    seed: int = 0,
    dgls: str | None = None,
    runner_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
) -> str:
    """Run train.py (through dgls_train.py with ``dgls`` flags) on ``config``; return its log.

    ``runner_args`` go to run_dp_train.py (``--preload``, ``--stand_in``); ``extra`` to train.py;
    ``env`` is added to the environment, ``unset`` names removed from it.
    The run gets its own process group, killed whole on timeout (caching workers included)."""
    env = {**child_env(*unset), **(env or {})}
    # MKL's float32 results on CPU depend on the memory alignment of the operands. Weights loaded
    # from safetensors sit at arbitrary offsets, DGLS's packed copies at aligned ones, so without
    # this the two runs differ in the last bits (about 1e-6); with it they are bitwise equal.
    env["MKL_CBWR"] = "COMPATIBLE"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    cmd = [sys.executable, str(RUNNER), "--checkout", str(checkout), "--seed", str(seed), *runner_args]
    if dgls is not None:
        cmd += ["--dgls", dgls]
    cmd += ["--", "--config", str(config), *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent), start_new_session=True
        )
        try:
            proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            tail = log.read_text(errors="replace")[-4000:]
            pytest.fail(f"{' '.join(cmd)} ran over {RUN_TIMEOUT} s; log tail:\n{tail}")
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}; log tail:\n{text[-4000:]}"
    return text


def run_train_ranks(
    checkout: Path,
    config: Path,
    log_stem: Path,
    world_size: int,
    *extra: str,
    seed: int = 0,
    dgls: str | None = None,
    expect: int = 0,
) -> list[str]:
    """train.py (through dgls_train.py with ``dgls`` flags) as ``world_size`` processes of one job on this machine,
    as ``deepspeed --num_gpus=N`` starts them (run_dp_train.py --rank/--world_size, one port); every rank must exit
    with ``expect``. Returns each rank's log (``log_stem``.rankR.log)."""
    from utils.dgls.program.distributed import free_port

    env = child_env()
    env["MKL_CBWR"] = "COMPATIBLE"  # see run_train
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    port = str(free_port())
    logs = [log_stem.with_name(f"{log_stem.name}.rank{rank}.log") for rank in range(world_size)]
    procs = []
    for rank, log in enumerate(logs):
        cmd = [sys.executable, str(RUNNER), "--checkout", str(checkout), "--seed", str(seed), "--port", port]
        cmd += ["--rank", str(rank), "--world_size", str(world_size)]
        if dgls is not None:
            cmd += ["--dgls", dgls]
        cmd += ["--", "--config", str(config), *extra]
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent), start_new_session=True
                )
            )
    try:
        for proc in procs:
            proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pytest.fail(
            f"train.py as {world_size} processes ran over {RUN_TIMEOUT} s; rank 0's log tail:\n"
            + logs[0].read_text(errors="replace")[-4000:]
        )
    texts = [log.read_text(errors="replace") for log in logs]
    for rank, (proc, text) in enumerate(zip(procs, texts)):
        assert proc.returncode == expect, (
            f"rank {rank} exited {proc.returncode}, not {expect}; log tail:\n{text[-4000:]}"
        )
    return texts


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-built ops go for these runs: one folder per DeepSpeed install.

    DeepSpeed builds its C++ ops on first use into torch's extensions folder, by name only (DGLS
    and run_dp_train.py keep its CPU communication op, deepspeed_shm_comm, out: utils/dgls/trainers/shm_op.py;
    --host_adam deepspeed builds cpu_adam). A DeepSpeed of another version (another virtualenv on
    the same machine) rebuilding one there concurrently made this one load an op that lacks what it
    calls (``module 'deepspeed_shm_comm' has no attribute ...``)."""
    import hashlib

    spec = importlib.util.find_spec("deepspeed")
    origin = spec.origin if spec is not None else "none"
    tag = hashlib.sha1(origin.encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "torch_extensions" / f"dgls-tests-{tag}"


def only_run_dir(output_dir) -> Path:
    runs = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def saved_model(output_dir, name: str) -> dict:
    """Every tensor of the safetensors files train.py saved under ``name`` (a full fine-tune's model, in one file or
    shards)."""
    from safetensors.torch import load_file

    files = sorted((only_run_dir(output_dir) / name).rglob("*.safetensors"))
    assert files, f"no model saved under {name}"
    weights = {}
    for path in files:
        weights.update(load_file(path))
    return weights


def saved_lora(output_dir, name: str) -> Path:
    """The adapter file train.py saved under ``name`` (step3, epoch1): diffusers-named for some
    model types (pytorch_lora_weights.safetensors), PEFT-named for others (adapter_model.safetensors)."""
    files = sorted((only_run_dir(output_dir) / name).glob("*.safetensors"))
    assert len(files) == 1, f"expected one LoRA file in {name}: {files}"
    return files[0]
