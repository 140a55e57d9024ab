"""Shared test set-up: repo root on sys.path, the ``gpu`` and ``slow`` markers, cuDNN attention off on GPUs.

``slow`` (declared in pytest.ini, deselected by default there; ``python3 -m pytest -m slow tests``
runs them, as .ci/run does) marks end-to-end runs of 20 s or more on 2 cores; the tests carry it.
"""

import os
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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # cuDNN's attention backward is broken on the lent H100 image (NaN or mha_graph.execute errors).
        torch.backends.cuda.enable_cudnn_sdp(False)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
