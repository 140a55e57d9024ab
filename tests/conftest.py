"""Shared test set-up: repo root on sys.path, the ``gpu`` and ``slow`` markers, cuDNN attention off on GPUs.

``slow`` (declared in pytest.ini, deselected by default there; ``python3 -m pytest -m slow tests``
runs them, as .ci/run does) marks end-to-end runs of 20 s or more on 2 cores; the tests carry it.
"""

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Deterministic cuBLAS (the GPU ordering tests compare bitwise): must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # The CPU tests run tiny tensors: intra-op threads only add hand-off latency, and on a loaded 2-core
    # machine (CI) they made a 40 ms training run take 2-20 s.
    torch.set_num_threads(1)
    # The Ctrl-C tests send SIGINT as a user's terminal does. A shell without job control starts background
    # commands (`pytest ... &`, `nohup .ci/run &` in a subshell) with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: give these runs the handler an interactive run has.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # cuDNN's attention backward is broken on the lent H100 image (NaN or mha_graph.execute errors).
        torch.backends.cuda.enable_cudnn_sdp(False)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What a user's shell does not have: torch.distributed's variables (a launcher sets them), the launcher's
# local sizes, DGLS's checkout and rendezvous-timeout variables.
USER_UNSET = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_SIZE",
    "LOCAL_WORLD_SIZE",
    "DGLS_DIFFUSION_PIPE",
    "DGLS_RENDEZVOUS_TIMEOUT",
)


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """A user's environment (none of ``USER_UNSET``), the test's folder as the current one; os.environ is
    restored afterwards, as an in-process run sets the one-process job's variables."""
    saved = dict(os.environ)
    for key in USER_UNSET:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(saved)
