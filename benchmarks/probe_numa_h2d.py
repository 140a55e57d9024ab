"""Probe: does the NUMA node of pinned host memory cap host-to-device copies when several GPUs copy at once?

Several data-parallel processes read one shared host copy of the streamed weights (issue 38). Its pages live where
they were first touched: on one NUMA node unless told otherwise. On a two-socket machine half the GPUs then read
across the socket link. This probe measures, per GPU, 1 GiB pinned copies to the device (several in flight, one
stream per GPU, all GPUs started together from one process) with the source on each node, interleaved over all
nodes, and on the GPU's own node; alone and all GPUs at once. It prints the machine's topology first. Diagnostic
only: nothing is written to results/.

    python benchmarks/probe_numa_h2d.py [--gib 1] [--repeats 8]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
from pathlib import Path

import torch

MPOL_DEFAULT, MPOL_INTERLEAVE = 0, 3
SYS_SET_MEMPOLICY = 238  # x86_64


def nodes() -> dict[int, list[int]]:
    """Each NUMA node's CPUs (one node 0 with every CPU where sysfs has none)."""
    found = {}
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = []
        for part in (path / "cpulist").read_text().strip().split(","):
            if part:
                lo, _, hi = part.partition("-")
                cpus += range(int(lo), int(hi or lo) + 1)
        if cpus:
            found[int(path.name[4:])] = cpus
    return found or {0: sorted(os.sched_getaffinity(0))}


def gpu_node(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        return max(0, int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text()))
    except (OSError, ValueError):
        return -1


def set_policy(mode: int, node_ids: list[int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(sum(1 << n for n in node_ids))
    if libc.syscall(SYS_SET_MEMPOLICY, mode, ctypes.byref(mask) if node_ids else None, 64) != 0:
        raise OSError(ctypes.get_errno(), "set_mempolicy")


def pinned_on(where: str, all_nodes: dict[int, list[int]], nbytes: int) -> torch.Tensor:
    """A pinned buffer whose pages were first touched on node ``where`` (a number) or interleaved (``"il"``)."""
    saved = os.sched_getaffinity(0)
    try:
        if where == "il":
            set_policy(MPOL_INTERLEAVE, list(all_nodes))
        else:
            os.sched_setaffinity(0, all_nodes[int(where)])
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buf.fill_(1)
    finally:
        if where == "il":
            set_policy(MPOL_DEFAULT, [])
        os.sched_setaffinity(0, saved)
    return buf


def placement(buf: torch.Tensor) -> str:
    """Pages per node of the mapping that holds ``buf`` (from /proc/self/numa_maps)."""
    addr = buf.data_ptr()
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        ranges.append((lo, hi))
    start = next((lo for lo, hi in ranges if lo <= addr < hi), None)
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        if start is not None and int(line.split()[0], 16) == start:
            return " ".join(w for w in line.split() if w.startswith("N"))
    return "?"


def rates(sources: dict[int, torch.Tensor], repeats: int) -> dict[int, float]:
    """GB/s per GPU, every GPU in ``sources`` copying its source ``repeats`` times at once."""
    dsts = {g: torch.empty_like(src, device=f"cuda:{g}") for g, src in sources.items()}
    streams = {g: torch.cuda.Stream(device=g) for g in sources}
    for g in sources:
        torch.cuda.synchronize(g)
    events = {g: [torch.cuda.Event(enable_timing=True) for _ in range(2)] for g in sources}
    for g, src in sources.items():
        with torch.cuda.device(g), torch.cuda.stream(streams[g]):
            events[g][0].record()
            for _ in range(repeats):
                dsts[g].copy_(src, non_blocking=True)
            events[g][1].record()
    seconds = {}
    for g in sources:
        streams[g].synchronize()
        seconds[g] = events[g][0].elapsed_time(events[g][1]) / 1e3
    return {g: repeats * sources[g].numel() / seconds[g] / 1e9 for g in sources}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    for cmd in (["nvidia-smi", "topo", "-m"], ["lscpu"]):
        try:
            print(subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout)
        except (OSError, subprocess.SubprocessError) as error:
            print(f"{cmd[0]}: {error}")
    all_nodes = nodes()
    gpus = list(range(torch.cuda.device_count()))
    local = {g: gpu_node(g) for g in gpus}
    print("nodes:", {n: f"{c[0]}-{c[-1]} ({len(c)})" for n, c in all_nodes.items()}, "GPU nodes:", local)
    nbytes = int(args.gib * 2**30)
    wheres = [str(n) for n in all_nodes] + (["il"] if len(all_nodes) > 1 else [])
    print(f"{'source':>8} | {'pages':<30} | alone GB/s per GPU | all at once GB/s per GPU (sum)")
    for where in wheres:
        bufs = {g: pinned_on(where, all_nodes, nbytes) for g in gpus}
        rates(bufs, 1)  # warm
        alone = [rates({g: bufs[g]}, args.repeats)[g] for g in gpus]
        together = rates(bufs, args.repeats)
        print(
            f"{where:>8} | {placement(bufs[0]):<30} | {' / '.join(f'{r:.1f}' for r in alone)} | "
            f"{' / '.join(f'{together[g]:.1f}' for g in gpus)} ({sum(together.values()):.0f})"
        )
        del bufs
    if len(all_nodes) > 1 and all(n in all_nodes for n in local.values()):
        bufs = {g: pinned_on(str(local[g]), all_nodes, nbytes) for g in gpus}
        together = rates(bufs, args.repeats)
        print(
            f"{'local':>8} | {'each GPU its own node':<30} | - | "
            f"{' / '.join(f'{together[g]:.1f}' for g in gpus)} ({sum(together.values()):.0f})"
        )
        # one shared buffer for all GPUs (as DGLS's one host copy), on node 0 and interleaved
        for where in wheres:
            shared = pinned_on(where, all_nodes, nbytes)
            together = rates({g: shared for g in gpus}, args.repeats)
            print(
                f"{'shared ' + where:>8} | {placement(shared):<30} | - | "
                f"{' / '.join(f'{together[g]:.1f}' for g in gpus)} ({sum(together.values()):.0f})"
            )


if __name__ == "__main__":
    main()
