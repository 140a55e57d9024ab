"""Mapped safetensors (utils/dgls/memory/mapped_safetensors.py): a checkpoint's tensors as views of a private mapping:
the bytes safetensors gives, nothing read until used, the user's file never written; unaligned tensors copied."""

import json
import struct

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from utils.dgls.memory.mapped_safetensors import map_safetensors

TENSORS = {
    "w": torch.randn(64, 48).to(torch.bfloat16),
    "half": torch.randn(5, 3).half(),
    "f32": torch.randn(7),
    "fp8": torch.randn(16, 16).to(torch.float8_e4m3fn),
    "steps": torch.tensor(3, dtype=torch.int64),
    "empty": torch.zeros(0, 4),
}


def test_the_views_hold_what_safetensors_reads(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    mapped, loaded = map_safetensors(path), load_file(str(path))
    assert mapped.keys() == loaded.keys()
    for key, value in loaded.items():
        assert mapped[key].dtype == value.dtype and mapped[key].shape == value.shape, key
        assert torch.equal(mapped[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_mapping_reads_nothing_and_writes_never_reach_the_file(tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.ones(4096, 8192, dtype=torch.bfloat16)}, str(path))  # 64 MiB
    process = psutil.Process()
    before = process.memory_info().rss
    mapped = map_safetensors(path)
    assert process.memory_info().rss - before < 16 * 2**20, "mapping copies nothing"
    mapped["w"][0].fill_(7)  # a private mapping: the page is copied for this process only
    assert torch.equal(load_file(str(path))["w"], torch.ones(4096, 8192, dtype=torch.bfloat16))


def test_an_unaligned_tensor_is_copied_with_its_bytes(tmp_path):
    """The format does not promise alignment: a bf16 tensor at an odd offset comes out right (a copy)."""
    a = torch.tensor([1, 2, 3], dtype=torch.uint8)
    b = torch.randn(4).to(torch.bfloat16)
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [3, 11]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + a.numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    mapped = map_safetensors(path)
    assert torch.equal(mapped["a"], a) and torch.equal(mapped["b"].view(torch.uint8), b.view(torch.uint8))


def test_a_dtype_it_does_not_map_is_one_line(tmp_path):
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "c.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError, match="dtype C64"):
        map_safetensors(path)
