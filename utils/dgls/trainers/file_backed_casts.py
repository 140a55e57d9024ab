"""File-backed casts: while train.py loads its model under a host RAM budget, the dtype casts its loaders make go to a
scratch file on disk instead of anonymous memory.

Why: safetensors' reads are views of the checkpoint file (no RAM), but a loader that casts (an fp32 checkpoint such as
Wan2.1's official shards trained in bf16, ``transformer_dtype = 'float8'``) allocates the whole cast model in process
memory before DGLS places the first layer, so a machine whose RAM is smaller than the cast model cannot start, whatever
``host_ram_budget`` says. Cast into a shared mapping of a file instead, the copies are page cache the kernel writes back
and takes back under pressure; DGLS reads each layer once as it places it, then the file's space is freed.

How: one :class:`torch.overrides.TorchFunctionMode` (:class:`CastsIntoScratch`), pushed on this thread's mode stack
while the model loads and taken off once the stage is built: no function is replaced. It sees every cast a loader
writes, whoever calls it: ``Tensor.to(dtype)`` / ``.to(device, dtype)`` / ``.to(other)`` (diffusers' and accelerate's
loads, ``p.data = p.data.to(dtype)`` in diffusion-pipe's Flux, Chroma and LTX loaders, ``Module.to(dtype)`` through
``Module._apply``), ``Tensor.type(dtype)``, ``.type_as``, ``.bfloat16()``, ``.half()``, ``.float()``, ``.double()``.

When: :class:`~.diffusion_pipe.PipelineInterception` installs it before train.py runs, only with a host RAM budget (the
user said RAM is short, and named where disk space is), and removes it once this process's stage is built, before DGLS
places the layers, and after any error. train.py caches its dataset in that window too: on a GPU its casts are of GPU
tensors (untouched); a CPU-only run's VAE and text-encoder casts go to the file as well, with the same bytes.

Not reached (the start-up line, :mod:`..memory.file_backed`, still counts them as copies): loads that copy without a
cast (``torch.load`` of a ``.pt`` without ``mmap``, ``load_state_dict`` into weights that are not meta), casts of a
non-contiguous tensor, a cast made in another thread or in a forked process.

Invariants
    - Caught: a CPU-to-CPU cast of a plain tensor or parameter (no other subclass), strided, contiguous, not
      autograd-tracked (``requires_grad`` under grad mode), from one floating dtype to another (float8 included), of at
      least :data:`MIN_BYTES`. Everything else (GPU tensors, integer casts, in-place ops, any other function) runs as
      without the mode, unchanged.
    - The cast tensor holds the bytes the cast gives (``copy_`` is the cast ``Tensor.to`` makes), is contiguous and is
      a plain tensor with its own storage of exactly its bytes (a view of the chunk's storage, which it keeps alive:
      ``p.data = cast`` keeps the mapping); sent to another process, only it is copied into shared memory.
    - Scratch files are unlinked as soon as they are mapped: nothing is left on disk after any exit, ``kill -9``
      included; the space is freed when the last tensor of a chunk is.
    - The directory is checked for room before each chunk is written: one clear line otherwise.
    - Each tensor starts on a 256-byte boundary of its chunk.
    - The mode is on this thread's stack only between ``install`` and ``remove`` (mode stacks are per thread: other
      Python threads never see it; torch's autograd workers copy the stack, but nothing runs backward while it is
      on), and off before DGLS places the layers and trains; it casts in the process that installed it only.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import DGLSUserError
from ..memory.disk_tier import RAM_FILE_SYSTEMS, check_directory, default_directory, file_system
from ..memory.file_backed import SCRATCH_PREFIX
from ..memory.layout import human_bytes
from ..torch_private import parse_to, take_off_function_mode_stack, tensor_method

CHUNK = 256 * 2**20
ALIGN = 256
# Casts smaller than this stay in process memory: scalars and a few-element vectors a computation casts (a timestep,
# a shift); a weight is larger (a Flux norm of one head is 128 values)
MIN_BYTES = 16


class ScratchFiles:
    """Tensors carved from shared mappings of unlinked files in ``directory`` (chunks of at least :data:`CHUNK`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._chunk: torch.UntypedStorage | None = None  # the chunk being carved (its whole mapping)
        self._used = 0
        self.bytes = 0  # every byte handed out

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` in a scratch file, with a storage of its own bytes."""
        nbytes = shape.numel() * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.nbytes():
            self._chunk, start = self._new_chunk(max(nbytes, CHUNK)), 0
        self._used = start + nbytes
        self.bytes += nbytes
        storage = self._chunk[start : start + nbytes]  # a storage of these bytes that keeps the chunk mapped
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def drop_chunk(self) -> None:
        """No more casts: the chunk being carved is not held here any longer."""
        self._chunk, self._used = None, 0

    def _new_chunk(self, nbytes: int) -> torch.UntypedStorage:
        check_directory(self.directory, nbytes, "the model load's casts")  # room for it, or one clear line
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
        try:
            _reserve(fd, nbytes, self.directory)
            return torch.UntypedStorage.from_file(name, shared=True, nbytes=nbytes)
        except RuntimeError as exc:
            raise DGLSUserError(
                f"disk_dir {self.directory}: cannot map a scratch file for the load's casts ({exc}); name another "
                "directory with --disk_dir"
            ) from None
        finally:
            os.close(fd)
            os.unlink(name)  # the mapping keeps it; nothing stays behind after any exit


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


FIXED_CASTS = {"bfloat16": torch.bfloat16, "half": torch.float16, "float": torch.float32, "double": torch.float64}
KEEPS_LAYOUT = (None, torch.preserve_format, torch.contiguous_format)  # of a contiguous source: a contiguous cast

# A cast method's rule: ``rule(args, kwargs)`` is the dtype the call casts ``args[0]`` to on the CPU, or None where the
# call is no such cast (another device, a layout of its own, arguments not understood)
CastRule = Callable[[tuple, dict], "torch.dtype | None"]


def _fixed_cast(dtype: torch.dtype) -> CastRule:
    def rule(args: tuple, kwargs: dict) -> torch.dtype | None:
        return dtype if len(args) == 1 and kwargs.get("memory_format") in KEEPS_LAYOUT else None

    return rule


def _to_target(args: tuple, kwargs: dict) -> torch.dtype | None:
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # a new tensor either way: the cast makes one
    try:
        device, dtype, _, memory_format = parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return None
    cpu = device is None or device.type == "cpu"
    return dtype if cpu and memory_format in KEEPS_LAYOUT else None


def _type_target(args: tuple, kwargs: dict) -> torch.dtype | None:
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    if isinstance(target, str):  # 'torch.BFloat16Tensor'; a CUDA type is not on the CPU
        target = None if "cuda" in target else getattr(torch, target.removeprefix("torch."), None)
    if isinstance(target, torch.dtype):
        return target
    dtype = getattr(target, "dtype", None)  # a legacy type class (torch.BFloat16Tensor)
    return dtype if isinstance(dtype, torch.dtype) and getattr(target, "is_cuda", True) is False else None


def _type_as_target(args: tuple, kwargs: dict) -> torch.dtype | None:
    if len(args) == 2 and isinstance(args[1], torch.Tensor):
        return args[1].dtype if args[1].device.type == "cpu" else None
    return None


CAST_RULES: dict[str, CastRule] = {
    "to": _to_target,
    "type": _type_target,
    "type_as": _type_as_target,
    **{name: _fixed_cast(dtype) for name, dtype in FIXED_CASTS.items()},
}


def cast_rules() -> dict[Any, CastRule]:
    """Each tensor cast method's function -> its rule, as ``torch.Tensor`` has the methods now. A mode is handed the
    method as ``torch.Tensor`` has it: torch's own, or a wrapper something put in its place (it still casts through
    torch's); both are keys. A caught cast is made here, so such a wrapper's other work does not run for it (nothing
    train.py loads wraps these methods). Built once per mode, when it is installed."""
    rules: dict[Any, CastRule] = {}
    for name, rule in CAST_RULES.items():
        rules.setdefault(tensor_method(name), rule)
        if (replaced := getattr(torch.Tensor, name, None)) is not None:
            rules.setdefault(replaced, rule)
    return rules


def cast_target(func: Any, args: tuple, kwargs: dict, rules: dict[Any, CastRule] | None = None) -> torch.dtype | None:
    """The dtype ``func(*args, **kwargs)`` casts ``args[0]`` to on the CPU, or None where the call is no such cast
    (another function, another device, a layout of its own, arguments not understood). ``rules``: from
    :func:`cast_rules` (built now where not given)."""
    try:
        rule = (cast_rules() if rules is None else rules).get(func)
    except TypeError:  # an unhashable callable: no cast method
        return None
    return None if rule is None else rule(args, kwargs)


def caught(source: Any, dtype: torch.dtype | None) -> bool:
    """Whether the cast of ``source`` to ``dtype`` goes to a scratch file (the module doc's first invariant)."""
    return (
        dtype is not None
        and type(source) in (torch.Tensor, torch.nn.Parameter)
        and source.device.type == "cpu"
        and source.layout == torch.strided
        and source.is_floating_point()
        and dtype.is_floating_point
        and source.dtype != dtype
        and source.numel() * dtype.itemsize >= MIN_BYTES
        and source.is_contiguous()
        and not source.is_neg()
        and not (source.requires_grad and torch.is_grad_enabled())
    )


class CastsIntoScratch(TorchFunctionMode):
    """The mode: a caught cast (see :func:`caught`) is made into :class:`ScratchFiles`; every other call runs on.

    Inside ``__torch_function__`` torch has taken this mode off the stack, so the copy it makes is not seen again. A
    process forked while it is on (train.py's caching workers) inherits it with the chunk's mapping, shared with this
    process: there it casts as without the mode, or both would carve the same bytes.
    """

    def __init__(self, scratch: ScratchFiles) -> None:
        super().__init__()
        self.scratch = scratch
        self.pid = os.getpid()
        self.rules = cast_rules()  # looked up per call: no loop over the cast methods

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and caught(args[0], dtype := cast_target(func, args, kwargs, self.rules)) and os.getpid() == self.pid:
            cast = self.scratch.empty(args[0].shape, dtype)
            cast.copy_(args[0])
            return cast
        return func(*args, **kwargs)


class FileBackedCasts:
    """The mode's lifetime (see the module doc): ``install`` before train.py loads, ``remove`` once the stage is
    built; ``remove`` is idempotent and must run on the thread that installed (mode stacks are per thread)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.scratch = ScratchFiles(Path(directory).expanduser() if directory else default_directory())
        self.mode: CastsIntoScratch | None = None  # on the stack of ``self._thread`` while not None
        self._thread: int | None = None
        self.note = ""  # a start-up line where it is not installed (the directory is RAM)

    def install(self) -> None:
        if self.mode is not None:
            raise RuntimeError("the load's casts are already redirected: install once, then remove")
        directory = self.scratch.directory
        if (kind := file_system(directory)) in RAM_FILE_SYSTEMS:  # a scratch file there would be RAM too
            self.note = (
                f"DGLS: the model load's casts stay in process memory: disk_dir {directory} is on {kind}, which is "
                "RAM; name a directory on a disk with --disk_dir to cast into a file there"
            )
            return
        self.mode, self._thread = CastsIntoScratch(self.scratch), threading.get_ident()
        self.mode.__enter__()

    def remove(self) -> None:
        """The mode off the stack; the chunk being carved is let go (its space is freed with the last tensor cast
        into it)."""
        if self.mode is not None:
            if threading.get_ident() != self._thread:
                raise RuntimeError("file-backed casts removed on another thread than the one that installed them")
            take_off_function_mode_stack(self.mode)
            self.mode = None
        self.scratch.drop_chunk()
