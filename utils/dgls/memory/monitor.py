"""Memory monitor: VRAM, DGLS's pinned RAM, process and system RAM, swap; warnings before a run stalls.

Host RAM is the resource layer streaming leans on: once the machine swaps, copies from
pageable memory crawl and page-locked memory cannot move at all. The monitor reads what
is in use and says, once per kind, when the host is running short and what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from .layout import human_bytes

GiB = 1024**3
MiB = 1024**2
RAM_PERCENT_LIMIT = 90.0  # system RAM use above this: the host is close to swapping
SWAP_GROWTH_LIMIT = 256 * MiB  # swap grown this much since the monitor started: the host is swapping now
PROC_VERSION = Path("/proc/version")

WSL_ADVICE = (
    "on WSL: raise memory= under [wsl2] in %UserProfile%\\.wslconfig and run `wsl --shutdown` (WSL gives Linux "
    "only part of the Windows RAM, and CUDA on WSL limits pinned memory), or lower --pinned_ram_budget_gb, or store "
    "streamed weights as fp8 with --cast_target bf16 f8_e4m3 (half the host bytes), or keep what does not fit on "
    "disk with --host_ram_budget (LoRA)"
)
ADVICE = (
    "lower --pinned_ram_budget_gb, stream fewer layers (--blocks_to_swap), store streamed weights as fp8 with "
    "--cast_target bf16 f8_e4m3 (half the host bytes), or keep what does not fit on disk with --host_ram_budget "
    "(LoRA)"
)


def _proc_version() -> str:
    try:
        return PROC_VERSION.read_text()
    except OSError:
        return ""


def is_wsl() -> bool:
    """Windows Subsystem for Linux: its kernel names itself "microsoft" in /proc/version."""
    return "microsoft" in _proc_version().lower()


def advice(wsl: bool) -> str:
    return WSL_ADVICE if wsl else ADVICE


def check_pinned_budget(
    requested_bytes: int, freed_bytes: int = 0, available_bytes: int | None = None, wsl: bool | None = None
) -> str | None:
    """A warning when ``requested_bytes`` of page-locked RAM will not fit the RAM available
    (plus ``freed_bytes`` that packing gives back), else None. Pinned pages cannot be swapped
    out, so pinning more than is free pushes everything else on the host into swap."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    room = available + freed_bytes
    if requested_bytes <= room:
        return None
    wsl = is_wsl() if wsl is None else wsl
    return (
        f"DGLS memory: {human_bytes(requested_bytes)} of pinned RAM requested but only {human_bytes(room)} is "
        f"available: the host will swap; {advice(wsl)}"
    )


@dataclass(frozen=True)
class MemoryReading:
    """Memory in use at one moment, in bytes (VRAM figures are 0 on CPU)."""

    vram_allocated: int
    vram_reserved: int
    vram_peak: int  # torch's peak since its last reset (the demo and the drop-in reset it after each step)
    pinned: int  # page-locked host RAM held by DGLS (masters and staging buffers)
    rss: int  # this process's resident set
    ram_used: int
    ram_total: int
    ram_percent: float
    swap_used: int
    cuda: bool = True

    def scalars(self) -> dict[str, float]:
        """For TensorBoard: sizes in GiB (``*_gib``), RAM use in percent."""
        d = {f"{k}_gib": v / GiB for k, v in asdict(self).items() if k not in ("ram_percent", "cuda")}
        d["ram_percent"] = self.ram_percent
        return d

    def line(self) -> str:
        vram = (
            f"VRAM {human_bytes(self.vram_allocated)} allocated, {human_bytes(self.vram_reserved)} reserved, "
            f"peak {human_bytes(self.vram_peak)}; "
            if self.cuda
            else ""
        )
        return (
            f"memory: {vram}pinned {human_bytes(self.pinned)}, RSS {human_bytes(self.rss)}, "
            f"RAM {human_bytes(self.ram_used)} of {human_bytes(self.ram_total)} ({self.ram_percent:.0f}%), "
            f"swap {human_bytes(self.swap_used)}"
        )


@dataclass
class MemoryMonitor:
    """Reads memory for ``device``; ``pinned_bytes_fn`` says how much DGLS has page-locked
    (``lambda: swapper.pinned_bytes``). Each kind of warning is given once per run."""

    device: torch.device
    pinned_bytes_fn: Callable[[], int] = lambda: 0
    wsl: bool | None = None  # None: detect from /proc/version
    swap_at_start: int = -1  # -1: read at construction
    _warned: set[str] = field(default_factory=set, init=False)
    _process: psutil.Process = field(default_factory=psutil.Process, init=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.wsl is None:
            self.wsl = is_wsl()
        if self.swap_at_start < 0:
            self.swap_at_start = psutil.swap_memory().used

    def read(self) -> MemoryReading:
        cuda = self.device.type == "cuda"
        vm = psutil.virtual_memory()
        return MemoryReading(
            vram_allocated=torch.cuda.memory_allocated(self.device) if cuda else 0,
            vram_reserved=torch.cuda.memory_reserved(self.device) if cuda else 0,
            vram_peak=torch.cuda.max_memory_allocated(self.device) if cuda else 0,
            pinned=int(self.pinned_bytes_fn()),
            rss=self._process.memory_info().rss,
            ram_used=vm.total - vm.available,
            ram_total=vm.total,
            ram_percent=vm.percent,
            swap_used=psutil.swap_memory().used,
            cuda=cuda,
        )

    def warnings(self, reading: MemoryReading) -> list[str]:
        """Warnings for this reading whose kind was not given before (so a run prints each once)."""
        found: dict[str, str] = {}
        if reading.ram_percent > RAM_PERCENT_LIMIT:
            found["ram"] = (
                f"DGLS memory: system RAM is {reading.ram_percent:.0f}% used ({human_bytes(reading.ram_used)} of "
                f"{human_bytes(reading.ram_total)}): the host is close to swapping, which stalls the copies; "
                f"{advice(self.wsl)}"
            )
        grown = reading.swap_used - self.swap_at_start
        if grown > SWAP_GROWTH_LIMIT:
            found["swap"] = (
                f"DGLS memory: swap use grew by {human_bytes(grown)} since the start (now "
                f"{human_bytes(reading.swap_used)}): the host is short of RAM and steps will slow down; "
                f"{advice(self.wsl)}"
            )
        new = [text for kind, text in found.items() if kind not in self._warned]
        self._warned.update(found)
        return new
