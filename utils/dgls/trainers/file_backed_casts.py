"""File-backed casts: while train.py loads its model under a host RAM budget, the dtype casts its loaders make go to a
scratch file on disk instead of anonymous memory.

Why: safetensors' reads are views of the checkpoint file (no RAM), but a loader that casts (an fp32 checkpoint such as
Wan2.1's official shards trained in bf16, ``transformer_dtype = 'float8'``) allocates the whole cast model in process
memory before DGLS places the first layer, so a machine whose RAM is smaller than the cast model cannot start, whatever
``host_ram_budget`` says. Cast into a shared mapping of a file instead, the copies are page cache the kernel writes back
and takes back under pressure; DGLS reads each layer once as it places it, then the file's space is freed.

What it replaces (through :class:`~..program.patches.Patches`, so each replacement carries ``__wrapped__``):
accelerate's ``set_module_tensor_to_device``, which diffusion-pipe's Wan, HunyuanVideo, Lumina 2 and Qwen-Image
loaders call with the dtype each weight is cast to, in ``accelerate.utils.modeling`` and in every module bound to it
(also the bindings train.py's imports make while it is installed, undone on removal). Casts written as
``p.data = p.data.to(dtype)`` (Flux's, Chroma's and LTX's ``transformer_dtype``) and diffusers' own ``torch_dtype``
casts are not reached: the start-up line (:mod:`..memory.file_backed`) counts them as copies in process memory.

When: :class:`~.diffusion_pipe.PipelineInterception` installs it before train.py runs, only with a host RAM budget (the
user said RAM is short, and named where disk space is), and removes it once this process's stage is built, and after
any error.

Invariants
    - The cast tensor holds the bytes ``value.to(dtype)`` gives (``copy_`` casts the same way); only floating-point
      CPU casts go to the file, everything else is accelerate's own path.
    - Scratch files are unlinked as soon as they are mapped: nothing is left on disk after any exit, ``kill -9``
      included; the space is freed when the last tensor of a chunk is.
    - The directory is checked for room before each chunk is written: one clear line otherwise.
    - Each tensor starts on a 256-byte boundary of its chunk.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import DGLSUserError
from ..memory.disk_tier import RAM_FILE_SYSTEMS, check_directory, default_directory, file_system
from ..memory.file_backed import SCRATCH_PREFIX
from ..memory.layout import human_bytes
from ..program.patches import Patches

CHUNK = 256 * 2**20
ALIGN = 256


class ScratchFiles:
    """Tensors carved from shared mappings of unlinked files in ``directory`` (chunks of at least :data:`CHUNK`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._chunk: torch.Tensor | None = None  # the chunk being carved (uint8 over its whole mapping)
        self._used = 0
        self.bytes = 0  # every byte handed out

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = self._new_chunk(max(nbytes, CHUNK)), 0
        self._used = start + nbytes
        self.bytes += nbytes
        return self._chunk[start : start + nbytes].view(dtype).view(shape)

    def drop_chunk(self) -> None:
        """No more casts: the chunk being carved is not held here any longer."""
        self._chunk, self._used = None, 0

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        check_directory(self.directory, nbytes, "the model load's casts")  # room for it, or one clear line
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
        try:
            _reserve(fd, nbytes, self.directory)
            storage = torch.UntypedStorage.from_file(name, shared=True, nbytes=nbytes)
        except RuntimeError as exc:
            raise DGLSUserError(
                f"disk_dir {self.directory}: cannot map a scratch file for the load's casts ({exc}); name another "
                "directory with --disk_dir"
            ) from None
        finally:
            os.close(fd)
            os.unlink(name)  # the mapping keeps it; nothing stays behind after any exit
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def _reserve(fd: int, nbytes: int, directory: Path) -> None:
    """The file's blocks, allocated now: a sparse file's mapping would take its blocks as the casts write it, and a
    disk filled meanwhile (by another rank's casts, or anything else) would kill the process with SIGBUS. A file
    system that cannot allocate ahead (some network and FUSE ones) keeps the free-space check alone."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise DGLSUserError(
            f"disk_dir {directory}: no room for a {human_bytes(nbytes)} scratch file of the model load's casts "
            f"({exc.strerror}): name another directory with --disk_dir, or free space on it"
        ) from None


def _bindings(value: Any, name: str) -> list[Any]:
    """Every loaded module whose global ``name`` is ``value`` (read from ``__dict__``: lazy modules import nothing)."""
    found = []
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict) and names.get(name) is value:
            found.append(module)
    return found


NAME = "set_module_tensor_to_device"


class FileBackedCasts:
    """The patch (see the module doc): ``install`` before train.py loads, ``remove`` once the stage is built."""

    def __init__(self, directory: str | Path | None) -> None:
        self.scratch = ScratchFiles(Path(directory).expanduser() if directory else default_directory())
        self.patches = Patches()
        self._original: Callable | None = None
        self._replacement: Callable | None = None
        self.note = ""  # a start-up line where it is not installed (the directory is RAM)

    def install(self) -> None:
        directory = self.scratch.directory
        if (kind := file_system(directory)) in RAM_FILE_SYSTEMS:  # a scratch file there would be RAM too
            self.note = (
                f"DGLS: the model load's casts stay in process memory: disk_dir {directory} is on {kind}, which is "
                "RAM; name a directory on a disk with --disk_dir to cast into a file there"
            )
            return
        try:
            import accelerate
            from accelerate.utils import modeling
        except ImportError as exc:
            raise DGLSUserError(
                f"with a host RAM budget DGLS casts the model load's weights into a file through accelerate, which "
                f"cannot be imported ({exc}): pip install accelerate (diffusion-pipe's loaders use it too)"
            ) from None
        original = modeling.__dict__.get(NAME)
        if original is None:
            raise DGLSUserError(
                f"accelerate {accelerate.__version__} has no utils.modeling.{NAME}, where DGLS casts the "
                "model load's weights into a file with a host RAM budget: this accelerate is too old or too new "
                "for DGLS; please report its version"
            )
        scratch = self.scratch

        def set_module_tensor_to_device(module, tensor_name, device, value=None, dtype=None, *args, **kwargs):
            if (
                value is not None
                and dtype is not None
                and str(device) == "cpu"
                and isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and value.is_floating_point()
                and dtype.is_floating_point
                and value.dtype != dtype
            ):
                cast = scratch.empty(value.shape, dtype)
                cast.copy_(value)
                value = cast
            return original(module, tensor_name, device, value, dtype, *args, **kwargs)

        self._original, self._replacement = original, set_module_tensor_to_device
        for module in _bindings(original, NAME):
            self.patches.replace(module, NAME, lambda _original: set_module_tensor_to_device)

    def remove(self) -> None:
        """Every replacement back, including the bindings modules made while it was installed; idempotent. The
        chunk being carved is let go (its space is freed with the last tensor cast into it)."""
        self.patches.restore()
        if self._replacement is not None:
            for module in _bindings(self._replacement, NAME):
                setattr(module, NAME, self._original)
        self._replacement = None
        self.scratch.drop_chunk()
