"""Mapped safetensors: a checkpoint's tensors as views of the file's pages, with no copy in process memory.

Why: views of a private mapping of the file cost nothing until read; once DGLS has packed a layer (into pinned RAM
or its disk tier) the pages it read are clean page cache, which the kernel takes back under pressure. safetensors'
own CPU torch reads (``safetensors.torch.load_file``, ``safe_open(...).get_tensor``) already return such views (it
maps the file with ``torch.UntypedStorage.from_file(shared=False)`` and slices it; measured from 0.3.3 to 0.8.0), so
diffusion-pipe's loaders need no patch for that: what they copy into process memory are casts, which
:mod:`.file_backed` measures at start-up. This module maps a file the same way where DGLS reads one itself.

Invariants
    - The mapping is private (``MAP_PRIVATE``): a write to a view never reaches the user's file.
    - A view has the dtype, shape and bytes ``safetensors`` itself gives for the key; a tensor whose offset in the
      file is not a multiple of its element size is copied (the format does not promise alignment).
    - The mapping lives as long as any view of it (the storage is shared by every view).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_header(path: str | Path) -> tuple[dict, int]:
    """The file's header (key -> {dtype, shape, data_offsets}; ``__metadata__`` dropped) and where the data starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def map_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` as a view of one private mapping of it (see the module doc)."""
    header, start = read_header(path)
    size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
    out = {}
    for key, entry in header.items():
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {key} has dtype {entry['dtype']}, which DGLS does not map")
        begin, end = entry["data_offsets"]
        data = raw[start + begin : start + end]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if (start + begin) % itemsize:
            data = data.clone()  # unaligned: a copy of its own (the format does not promise alignment)
        out[key] = data.view(dtype).view(entry["shape"])
    return out
