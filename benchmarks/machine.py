"""The machine a benchmark runs on: its device and dtype, what it is, and its pinned copy bandwidth.

Every result records where it was measured (``environment``) and the host-to-device bandwidth
measured in the same run, since its floors and copy shares are relative to that bandwidth.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
from collections.abc import Iterator

import torch
from units import GiB


def device() -> torch.device:
    """The device a run trains on: CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def session(tiny: bool) -> Iterator[tuple[torch.device, torch.dtype]]:
    """The device and dtype of a run: CUDA in bf16 when there is one, else the CPU in fp32.

    A tiny run on the CPU uses one thread for its duration: its ops are so small that more threads
    only contend (on a 2-core CI runner a tiny planner run took 73 s with all threads, 7 s with one).
    cuDNN attention is off on CUDA: its backward is broken on the lent H100 image.
    """
    on = device()
    if on.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    threads = torch.get_num_threads()
    if tiny and on.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield on, (torch.bfloat16 if on.type == "cuda" else torch.float32)
    finally:
        torch.set_num_threads(threads)


def environment(device: torch.device) -> dict:
    """Where a result was measured: device, GPU, PCIe link, driver, torch and CUDA versions, and the CUDA
    allocator's settings when the environment sets them (they change peak reserved memory)."""
    found = {"device": device.type, **_gpu_details(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        found["alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    return found


def _gpu_details() -> dict:
    """GPU name, PCIe generation and width (current link) and driver, read from nvidia-smi."""
    query = "--query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        name, gen, width, driver = (x.strip() for x in out.stdout.strip().splitlines()[0].split(","))
        return {"gpu": name, "pcie_gen": gen, "pcie_width": width, "driver": driver}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}


def pinned_bandwidth(device: torch.device, nbytes: int = GiB) -> float:
    """Host-to-device GB/s of one copy of ``nbytes`` from pinned memory (median of 5 after a warm-up); 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / start.elapsed_time(end) / 1e6)
    del host, dev
    release_host_cache()
    return statistics.median(rates[1:])


def release_host_cache() -> None:
    """Give back the device cache and the pinned blocks torch's caching host allocator keeps after a free,
    so that one method's leftovers do not count against the next."""
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)  # older torch
    if empty is not None:
        empty()
