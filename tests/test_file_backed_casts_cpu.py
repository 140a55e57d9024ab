"""File-backed casts (utils/dgls/trainers/file_backed_casts.py): while installed, accelerate's
set_module_tensor_to_device casts into unlinked scratch files: the same bytes as the cast, anonymous memory not growing
with the cast model, nothing left in the directory, every binding restored on removal, no room one clear line."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from accelerate.utils import modeling
from helpers import child_env
from safetensors import safe_open
from safetensors.torch import save_file

from utils.dgls.errors import DGLSUserError
from utils.dgls.memory.file_backed import weight_sources
from utils.dgls.trainers import file_backed_casts
from utils.dgls.trainers.file_backed_casts import FileBackedCasts

MiB = 2**20
# 3 float32 layers of 80 MiB: each bf16 cast (40 MiB) is above glibc's largest mmap threshold, so a cast in anonymous
# memory gets fresh pages however much freed heap earlier tests left (the control measures it)
N, ROWS, COUNT = 4096, 5120, 3


@pytest.fixture(autouse=True)
def on_a_disk(monkeypatch):
    """The tests' folders count as a disk wherever the machine's temp is tmpfs (casts there are not installed)."""
    monkeypatch.setattr(file_backed_casts, "file_system", lambda directory: "ext4")


def checkpoint(tmp_path):
    path = tmp_path / "fp32.safetensors"
    torch.manual_seed(0)
    save_file({f"{i}.weight": torch.randn(ROWS, N) for i in range(COUNT)} | {"0.bias": torch.randn(ROWS)}, str(path))
    return path


def load(path, dtype, setter):
    """diffusion-pipe's Wan/Qwen-Image load: a meta model, each file tensor set with the dtype it is cast to."""
    with init_empty_weights():
        model = torch.nn.Sequential(*(torch.nn.Linear(N, ROWS, bias=i == 0) for i in range(COUNT)))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():
            setter(model, key, device="cpu", dtype=dtype, value=f.get_tensor(key))
    return model


def test_casts_go_to_a_scratch_file_with_the_same_bytes(tmp_path):
    path, scratch = checkpoint(tmp_path), tmp_path / "scratch"
    plain = load(path, torch.bfloat16, modeling.set_module_tensor_to_device)
    casts = FileBackedCasts(scratch)
    casts.install()
    try:
        from accelerate.utils import set_module_tensor_to_device  # what diffusion-pipe's files bind

        assert set_module_tensor_to_device.__wrapped__ is casts._original
        cast = load(path, torch.bfloat16, set_module_tensor_to_device)
        sources = weight_sources([cast])
    finally:
        casts.remove()
    for (name, a), (_, b) in zip(plain.named_parameters(), cast.named_parameters(), strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    cast_bytes = (COUNT * ROWS * N + ROWS) * 2
    assert sources.scratch_bytes == cast_bytes and not sources.copied_bytes and casts.scratch.bytes == cast_bytes
    assert "cast into a scratch file" in sources.line()
    assert os.listdir(scratch) == [], "scratch files are unlinked once mapped"


MEASURE = """
import json, sys
import torch
from accelerate.utils import modeling
sys.path.insert(0, sys.argv[3])
from test_file_backed_casts_cpu import load
from utils.dgls.memory.file_backed import anonymous_memory
from utils.dgls.trainers.file_backed_casts import FileBackedCasts

before = anonymous_memory()
plain = load(sys.argv[1], torch.bfloat16, modeling.set_module_tensor_to_device)
grown_plain = anonymous_memory() - before
casts = FileBackedCasts(sys.argv[2])
casts.install()
before = anonymous_memory()
cast = load(sys.argv[1], torch.bfloat16, modeling.set_module_tensor_to_device)
grown = anonymous_memory() - before
casts.remove()
print(json.dumps([grown_plain, grown]))
"""


def test_a_cast_into_scratch_files_adds_no_anonymous_memory(tmp_path):
    """Measured in a fresh process (the suite's own threads and freed heap would blur RssAnon): the cast in anonymous
    memory grows it by the cast's size (the control), the same cast into scratch files by next to nothing."""
    path = checkpoint(tmp_path)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(tmp_path / "scratch"), str(root / "tests")],
        cwd=root,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    grown_plain, grown = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"RssAnon growth casting 240 MiB of fp32 to bf16: {grown_plain / MiB:.1f} MiB, "
        f"into scratch {grown / MiB:.1f} MiB"
    )
    assert grown_plain > 100 * MiB, "the control: the cast in anonymous memory allocates 120 MiB"
    assert grown < 16 * MiB, f"the cast grew anonymous memory by {grown / MiB:.1f} MiB"


def test_what_is_not_a_cpu_float_cast_is_accelerates(tmp_path):
    path = checkpoint(tmp_path)
    casts = FileBackedCasts(tmp_path / "scratch")
    casts.install()
    try:
        same = load(path, torch.float32, modeling.set_module_tensor_to_device)  # no cast: views of the checkpoint
    finally:
        casts.remove()
    assert casts.scratch.bytes == 0 and weight_sources([same]).mapped == (COUNT * ROWS * N + ROWS) * 4


def test_every_binding_is_restored(tmp_path):
    original = modeling.set_module_tensor_to_device
    before = types.ModuleType("dgls_test_casts_before")
    before.set_module_tensor_to_device = original
    sys.modules[before.__name__] = before
    casts = FileBackedCasts(tmp_path)
    try:
        casts.install()
        during = types.ModuleType("dgls_test_casts_during")  # train.py's model files, imported while it is installed
        exec("from accelerate.utils import set_module_tensor_to_device", during.__dict__)
        sys.modules[during.__name__] = during
        assert before.set_module_tensor_to_device is during.set_module_tensor_to_device is not original
        casts.remove()
        casts.remove()  # idempotent
        import accelerate.utils

        for module in (modeling, accelerate.utils, before, during):
            assert module.set_module_tensor_to_device is original, module
    finally:
        casts.remove()
        sys.modules.pop("dgls_test_casts_before", None)
        sys.modules.pop("dgls_test_casts_during", None)


def test_a_disk_without_room_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(file_backed_casts, "check_directory", _no_room)
    casts = FileBackedCasts(tmp_path)
    with pytest.raises(DGLSUserError, match="no room"):
        casts.scratch.empty(torch.Size([4]), torch.bfloat16)


def _no_room(directory, nbytes, purpose):
    assert purpose == "the model load's casts"
    raise DGLSUserError(f"disk_dir {directory} has no room for {nbytes} bytes")


def test_a_disk_that_fills_after_the_check_is_one_line_not_a_sigbus(tmp_path, monkeypatch):
    """The scratch file's blocks are allocated before it is mapped: a sparse file's mapping would take them as the
    casts write, and a disk filled meanwhile would kill the process (SIGBUS). A file system that cannot allocate
    ahead keeps the free-space check alone."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DGLSUserError, match="no room for a .* scratch file of the model load's casts") as raised:
        FileBackedCasts(tmp_path).scratch.empty(torch.Size([4]), torch.bfloat16)
    assert "\n" not in str(raised.value) and not list(tmp_path.iterdir()), "one line, and no file left"

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    cast = FileBackedCasts(tmp_path).scratch.empty(torch.Size([4]), torch.bfloat16)
    assert cast.shape == (4,)


def test_on_a_ram_file_system_the_casts_stay_and_a_line_says_why(tmp_path, monkeypatch):
    """A scratch file on tmpfs is RAM too: nothing is installed, and the start-up note says what to change."""
    monkeypatch.setattr(file_backed_casts, "file_system", lambda directory: "tmpfs")
    before = modeling.set_module_tensor_to_device
    casts = FileBackedCasts(tmp_path)
    casts.install()
    assert modeling.set_module_tensor_to_device is before
    assert "is on tmpfs, which is RAM" in casts.note and "--disk_dir" in casts.note
    casts.remove()


def test_an_accelerate_without_the_function_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delattr(modeling, "set_module_tensor_to_device")
    with pytest.raises(DGLSUserError, match="has no utils.modeling.set_module_tensor_to_device"):
        FileBackedCasts(tmp_path).install()


def test_removal_lets_go_of_the_chunk_being_carved(tmp_path):
    casts = FileBackedCasts(tmp_path)
    casts.install()
    casts.scratch.empty(torch.Size([4]), torch.bfloat16)
    assert casts.scratch._chunk is not None
    casts.remove()
    assert casts.scratch._chunk is None
