"""Shared test set-up: repo root on sys.path, the ``gpu`` and ``slow`` markers, cuDNN attention off on GPUs."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: minutes long (diffusion-pipe's real train.py); -m 'not slow' skips it")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # cuDNN's attention backward is broken on the lent H100 image (NaN or mha_graph.execute errors).
        torch.backends.cuda.enable_cudnn_sdp(False)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
