"""Shared fetches: data-parallel processes on one machine each copy a share of a layer, and gather the rest.

Why
    Data-parallel processes on one machine stream the same layers in the same order, each from the one host copy
    (:mod:`.peers`). Every process copies every streamed byte over its own link, so N GPUs read N times the model's
    bytes from host memory per pass, and the host's bandwidth to its GPUs is shared: on the lent 4x H200 machine 1 GiB
    pinned copies ran at 55.5 GB/s to one GPU alone and at 44.6 GB/s each with all four at once
    (``benchmarks/results/probe_numa_h2d_x4.txt``), which capped Flux-dev on 4 GPUs at 3.33x one GPU. Where the GPUs
    are linked by something faster than their host links (NVLink), each process can copy 1/N of each layer from the
    host and all-gather the other N-1 shares from its peers: the host then sends each layer's bytes once per pass for
    the whole machine, and each GPU's host link carries 1/N of them. Measured (Flux-dev-size LoRA, 8 GiB per GPU,
    4x H200, one run): 4 GPUs trained 4.79x one GPU's samples per second shared, 3.37x not
    (``benchmarks/results/scaling_flux_share_14.md``); on 2 GPUs, which the host's bandwidth does not cap, 1.82x
    against 1.81x (``scaling_flux_share_124.md``).

Layout (one region: a slot's directly copied bytes, or an fp8 layer's landing bytes)
    - ``nbytes`` split into N shares of ``step`` bytes (``ceil(nbytes / N)`` rounded up to :data:`ALIGN`); share
      ``i`` is bytes ``[i * step, (i + 1) * step)``. Process ``i`` copies its share's bytes that exist (the last share
      may be short or empty), then the all-gather fills ``[0, N * step)`` of the region on every process from each
      process's share. The bytes past ``nbytes`` are padding the gather writes with whatever the last share's buffer
      held there: every slot and landing buffer is :attr:`FetchShare.padding` bytes longer than its largest region, and
      nothing reads past ``nbytes`` before it is rewritten (the upcast writes a slot's fp8 params after the gather).

Mechanics
    - :meth:`FetchShare.among` (start-up, every rank, in lockstep): one process group per set of processes that
      share a host copy (:attr:`.peers.Peers.sets`, the same list on every rank; ``new_group`` wants every rank to
      make every group, in one order): NCCL on CUDA, gloo on the CPU (the CPU tests' transport).
    - ``auto`` (CUDA): the set measures one all-gather of the largest layer's bytes (at most :data:`MEASURED`)
      against one host copy of them by each member at once,
      and shares when the gather's rate beats ``N / (N - 1)`` times the host copy's, by :data:`MARGIN`: only then is
      copying 1/N and gathering the rest faster than copying all. NVLink passes (hundreds of GB/s against ~55); PCIe
      peers do not (a gather over PCIe brings each GPU as many bytes over its own link as the host copy did). Every
      member takes the set's one decision (a MIN all-reduce), and the start-up line gives both rates; declined, the
      group is released (its NCCL buffers are device memory no VRAM budget counts). On the CPU,
      ``auto`` is off (nothing to gain); ``on`` shares there too, which is how CI tests it.
    - The copier (:mod:`.copier`) calls :meth:`FetchShare.copies` for the pairs to copy and :meth:`FetchShare.gather`
      after them, on the weights-in stream (CUDA: the gather runs on the group's NCCL stream behind the copies, and
      the weights stream waits for it before the upcast and the copy's ready event; the host does not wait). On the
      CPU transport it runs when the write lands, so a missing wait still computes with NaN there.

Invariants and hazards
    - Every member issues the same gathers in the same order: each process fetches the same layers in the same order
      (data parallel runs one schedule; the swapper's decisions depend on the uses and the plan, never on timing, and
      the plan is agreed: :mod:`..planning.agreement`), and the copier issues its writes in submission order (one
      worker thread with ``--threading``). So a forward on some members only (a sample on rank 0) would wait for the
      others forever; and a VRAM budget's placement is fixed once it settles (a process alone re-planning would
      change its fetches), which :class:`..planning.autoplan.PlacementDriver` does while fetches are shared.
    - A gather reads only the process's own share of its own slot and writes its own slot: the slot protocol
      (:mod:`.copier`) is per process, unchanged. The host copy a share is read from is the same bytes on every
      member (one shared copy, or equal private copies of a frozen model).
    - Layers copied param by param (``selective_packing``) are copied whole by every process: their params are not
      one region. The start-up line counts them.
    - A process that stops (a crash, a kill) leaves the others' gathers waiting on the GPU: the launchers
      (``deepspeed``, ``torchrun``) stop the other processes when one fails, and DGLS's processes stop with one line on
      that signal (:mod:`..program.stop_signals`); under a launcher that does not, NCCL's watchdog ends them after its
      timeout.
    - The swap stats count each fetch as the whole layer's bytes (what the slot received), and its copy time as the
      copy stream's, the gather included: summed over the processes they are N times what crossed the host's links.
    - NCCL runs communicators concurrently (this one beside the gradients' reduction); with
      ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (which serializes streams) two communicators can deadlock: leave it unset.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import DGLSUserError
from .host_store import HostLayer, copy_chunks

ALIGN = 512  # bytes: every share starts at a multiple of it (the copy engines' and NCCL's preferred alignment)
MARGIN = 1.25  # auto shares when the gather beats the break-even rate by this much
MEASURED = 256 << 20  # bytes: the most auto's measurement moves (a Flux double block is ~680 MB; this times well)
MODES = ("auto", "on", "off")  # share_fetch (:class:`..streaming.config.TransferPolicy`)


@dataclass(frozen=True)
class Region:
    """One region's split: this process copies ``[lo, hi)``; the gather fills ``[0, size * step)``."""

    lo: int
    hi: int
    step: int


class FetchShare:
    """This process's share of every streamed layer's copy, and the group that gathers the rest (module doc)."""

    def __init__(self, group, index: int, size: int, note: str = "") -> None:
        if size < 2 or not 0 <= index < size:
            raise ValueError(f"a share needs 2 or more processes, and an index among them: {index} of {size}")
        self.group = group
        self.index = index
        self.size = size
        self.note = note  # the start-up line's measurement ("" where nothing was measured)

    @property
    def padding(self) -> int:
        """Bytes every slot and landing buffer holds past its largest region (the last share's rounding)."""
        return self.size * ALIGN

    def split(self, nbytes: int) -> Region:
        step = -(-nbytes // (self.size * ALIGN)) * ALIGN
        lo = min(self.index * step, nbytes)
        return Region(lo, min(lo + step, nbytes), step)

    def copies(
        self, host: HostLayer, slot: torch.Tensor, landing: torch.Tensor | None, source: torch.Tensor | None = None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, Region]]]:
        """This process's (host bytes, device bytes) pairs of a write, and the regions to gather after them (as
        :meth:`.host_store.HostLayer.copies`, each region's share only). A layer copied param by param: all of it,
        and nothing to gather."""
        if not host.packed:
            return host.copies(slot, landing, source), []
        layout = host.layout
        buffer = host.buffer if source is None else source
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        regions: list[tuple[torch.Tensor, Region]] = []
        spans = [(0, layout.direct_bytes, slot)]
        if landing is not None and layout.host_bytes > layout.direct_bytes:
            spans.append((layout.direct_bytes, layout.host_bytes - layout.direct_bytes, landing))
        for start, nbytes, device in spans:
            if nbytes == 0:
                continue
            region = self.split(nbytes)
            for o, end in copy_chunks(start + region.lo, start + region.hi):  # split where the page-locking is
                pairs.append((buffer[o:end], device[o - start : end - start]))
            regions.append((device, region))
        return pairs, regions

    def gather(self, regions: Sequence[tuple[torch.Tensor, Region]]) -> None:
        """Fill each region from every member's share (CUDA: enqueued behind the current stream's copies, and the
        current stream waits for it; the host does not)."""
        for device, region in regions:
            whole = device[: self.size * region.step]
            mine = whole[self.index * region.step : (self.index + 1) * region.step]
            work = _all_gather(whole, mine, self.group)
            if work is not None:
                work.wait()  # CUDA: the current stream waits for the group's stream, not the host

    def line(self, layers: int, whole: int) -> str:
        """The start-up line: ``whole`` of the ``layers`` streamed layers are copied param by param (not shared)."""
        copied = f"; {whole} of the {layers} streamed layers are copied param by param, whole" if whole else ""
        return (
            f"DGLS shared fetches: each of the {self.size} data-parallel processes on this machine copies "
            f"1/{self.size} of each streamed layer from host memory and gathers the rest from the others"
            f"{self.note}{copied}"
        )

    # ---------------------------------------------------------------- start-up
    @classmethod
    def among(
        cls, sets: Sequence[Sequence[int]], mode: str, device: torch.device, largest: torch.Tensor | None
    ) -> tuple[FetchShare | None, str]:
        """This process's share (None: it copies every byte itself) and the start-up line for it ("" where nothing
        is shared and nothing was asked). ``sets``: every set of processes that share a host copy (the same list on
        every rank); ``largest``: the largest streamed layer's page-locked host bytes (``auto``'s measurement copies
        from them; None: from a pinned buffer of its own).
        Every rank of the default group calls it at the same point."""
        if mode not in MODES:
            raise DGLSUserError(f"share_fetch is {mode!r}: use one of {', '.join(MODES)}")
        alone = (
            "DGLS shared fetches: on, but no other process of this job on this machine holds these layers (data "
            "parallel shares fetches, pipeline stages do not): this process copies whole layers"
        )
        if mode == "off" or (mode == "auto" and device.type != "cuda"):
            return None, ""
        if not sets:
            return None, alone if mode == "on" else ""
        dist = torch.distributed
        rank = dist.get_rank()
        backend = "nccl" if device.type == "cuda" else "gloo"
        mine = None
        for ranks in sorted(sorted(s) for s in sets):  # one order on every rank: new_group is a collective
            group = dist.new_group(list(ranks), backend=backend)
            if rank in ranks:
                mine = (group, list(ranks))
        if mine is None:
            return None, alone if mode == "on" else ""
        group, ranks = mine
        share = cls(group, ranks.index(rank), len(ranks))
        if device.type != "cuda":
            return share, ""
        gather_gbps, copy_gbps = _measure(share, device, largest)
        share.note = f" (gather {gather_gbps:.0f} GB/s, host copy {copy_gbps:.0f} GB/s)"
        if mode == "on":
            return share, ""
        flag = torch.tensor([1 if pays(gather_gbps, copy_gbps, share.size) else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if flag.item():
            return share, ""
        dist.destroy_process_group(group)  # its NCCL buffers are device memory outside the planner's count
        return None, (
            f"DGLS shared fetches: off, the gather between the {share.size} GPUs of this machine is not fast enough "
            f"to pay{share.note}; each process copies whole layers"
        )


def pays(gather_gbps: float, copy_gbps: float, size: int) -> bool:
    """Whether copying 1/``size`` of a layer and gathering the rest beats copying all of it, by :data:`MARGIN`: a
    layer of B bytes takes B / copy alone, B / (size x copy) + B / gather shared (the gather's rate counts the whole
    layer it fills), so sharing pays where gather > copy x size / (size - 1)."""
    return gather_gbps > MARGIN * copy_gbps * size / (size - 1)


def _measure(share: FetchShare, device: torch.device, largest: torch.Tensor | None) -> tuple[float, float]:
    """GB/s of one all-gather of the largest layer's bytes among the set, and of one host copy of them (CUDA;
    the first of each warms up, the second is timed). The same gathers on every member."""
    nbytes = min(max(int(largest.numel()) if largest is not None else 0, 64 << 20), MEASURED)
    region = share.split(nbytes)
    out = torch.empty(share.size * region.step, dtype=torch.uint8, device=device)
    if largest is not None:  # page-locked by the host store (registered: ``is_pinned()`` does not know it)
        host = largest[:nbytes]
    else:
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    times = []
    for _ in range(2):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        share.gather([(out, region)])
        torch.cuda.synchronize(device)
        gathered = time.perf_counter() - began
        began = time.perf_counter()
        out[: host.numel()].copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times = [gathered, time.perf_counter() - began]
    del out
    torch.cuda.empty_cache()  # the measurement's buffer is not the run's
    return nbytes / max(times[0], 1e-9) / 1e9, host.numel() / max(times[1], 1e-9) / 1e9


def _all_gather(output: torch.Tensor, mine: torch.Tensor, group):
    """``torch.distributed``'s all-gather into one tensor, async (its name changed: ``all_gather_single`` from torch
    2.13, ``all_gather_into_tensor`` before, which 2.13 deprecates)."""
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    return gather(output, mine, group=group, async_op=True)
