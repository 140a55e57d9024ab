"""File-backed weights: how much of a model's weights are views of its checkpoint files, and how much are copies.

Why: safetensors reads a CPU torch tensor as a view of a private mapping of the file (``load_file``,
``safe_open(...).get_tensor``, and diffusers' loaders through them), so a loaded weight costs no process memory
until it is read, and once read its pages are clean page cache the kernel takes back under pressure. What does
allocate is what a loader does next: a dtype cast (an fp32 checkpoint trained in bf16, diffusion-pipe's
``transformer_dtype``), ``load_state_dict`` into a model built with real (not meta) weights, ``torch.load`` of a
``.pt`` file. Those copies sit in anonymous memory, the whole model at once, before DGLS places the first layer;
on a machine whose RAM is smaller than the model that is where it stops. This module measures it, so start-up can
say how many bytes of the layers are copies and of which dtype.

How: a tensor is file-backed when its memory lies in a mapping of a file (``/proc/self/maps``; Linux only).

Invariants
    - Parameters only (buffers are computed, not loaded), and not an adapter's (PEFT's ``lora_*``: made by the run).
    - Each byte is counted once: a view of a file by its range, a copy by its whole storage (tied or shared
      weights are not counted twice); meta and non-CPU tensors (already placed, or placeholders) are not counted.
    - A page of a private file mapping that the process wrote is anonymous memory but still counted as file-backed
      (maps does not tell pages apart); loaders do not write weights before training starts.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

MiB, GiB = 2**20, 2**30
SCRATCH_PREFIX = (
    "dgls-cast-"  # files of the load's casts (trainers/file_backed_casts.py): on disk, but not read in place
)


def size_text(nbytes: int) -> str:
    """``nbytes`` in GiB, or in MiB below a tenth of one (a small model's line still says something)."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / MiB:.2f} MiB"


def anonymous_memory() -> int | None:
    """This process's anonymous resident memory (``RssAnon``; pages of a file mapping are not in it), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def file_mappings(maps: str | None = None) -> list[tuple[int, int, str]]:
    """(start, end, path) of every mapping of a regular file in this process, sorted by start (``maps``: the text of
    /proc/self/maps, read when None); empty where the platform has no /proc."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
            continue  # anonymous, or [heap], [stack], ...
        start, end = (int(x, 16) for x in fields[0].split("-"))
        found.append((start, end, fields[5].removesuffix(" (deleted)")))
    found.sort()
    return found


@dataclass
class WeightSources:
    """Bytes of some modules' CPU weights: views of files (by file) and copies in process memory (by dtype)."""

    file_bytes: dict[str, int] = field(default_factory=dict)
    scratch_bytes: int = 0  # cast into DGLS's scratch files (page cache, written back under pressure)
    copied_bytes: dict[torch.dtype, int] = field(default_factory=dict)
    process_anonymous: int | None = None  # the whole process's anonymous memory when measured (Linux)

    @property
    def mapped(self) -> int:
        return sum(self.file_bytes.values())

    @property
    def copied(self) -> int:
        return sum(self.copied_bytes.values())

    def line(self) -> str:
        """The start-up line: what is read in place and what was copied (and why a copy happens)."""
        text = (
            f"DGLS: model load: {size_text(self.mapped)} of the layers' weights are read in place from "
            f"{len(self.file_bytes)} file(s) (no copy in RAM), {size_text(self.copied)} are copies in process memory"
        )
        if self.scratch_bytes:
            text += f", {size_text(self.scratch_bytes)} cast into a scratch file in the disk_dir (not held in RAM)"
        if self.copied:
            by_dtype = ", ".join(
                f"{size_text(b)} {str(d).removeprefix('torch.')}" for d, b in self.copied_bytes.items()
            )
            text += (
                f" ({by_dtype}): made after loading, by a cast (transformer_dtype, or the run's dtype where the "
                "checkpoint stores another) or a loader that copies; this much RAM is needed before DGLS places the "
                "layers, where a checkpoint stored in the dtype the layers train in would be read in place"
            )
        if self.process_anonymous is not None:
            text += f"; the process holds {size_text(self.process_anonymous)} of anonymous memory"
        return text


ADAPTER = "lora_"  # PEFT's adapter weights (lora_A, lora_B, lora_magnitude_vector): made by the run, not loaded


def weight_sources(modules: Iterable[object], maps: list[tuple[int, int, str]] | None = None) -> WeightSources:
    """Where the CPU parameters of ``modules`` (non-modules are skipped) live, but for an adapter's: see the module
    doc."""
    maps = file_mappings() if maps is None else maps
    starts = [start for start, _, _ in maps]
    result = WeightSources(process_anonymous=anonymous_memory())
    seen_views: set[tuple[int, int]] = set()
    seen_storages: set[int] = set()
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            continue
        for name, tensor in module.named_parameters():
            if tensor.device.type != "cpu" or tensor.is_meta or not tensor.numel() or ADAPTER in name:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            where = bisect.bisect_right(starts, tensor.data_ptr()) - 1
            if where >= 0 and tensor.data_ptr() < maps[where][1]:
                if (tensor.data_ptr(), nbytes) in seen_views:
                    continue
                seen_views.add((tensor.data_ptr(), nbytes))
                path = maps[where][2]
                if Path(path).name.startswith(SCRATCH_PREFIX):
                    result.scratch_bytes += nbytes
                else:
                    result.file_bytes[path] = result.file_bytes.get(path, 0) + nbytes
                continue
            storage = tensor.untyped_storage()  # a copy: its whole storage is allocated, once for all its views
            if storage.data_ptr() in seen_storages:
                continue
            seen_storages.add(storage.data_ptr())
            result.copied_bytes[tensor.dtype] = result.copied_bytes.get(tensor.dtype, 0) + storage.nbytes()
    return result
