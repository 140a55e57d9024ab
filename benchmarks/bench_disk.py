"""The disk tier: the disk's read bandwidth, and a LoRA step under host RAM budgets (Flux-dev or Wan2.1-14B size).

Two parts, side by side in one run:

- Read bandwidth of the directory's disk: a ``--file_gib`` file (unnamed, gone after the run) read in
  ``--request_mib`` requests by the disk tier's readers (:mod:`utils.dgls.memory.disk_io`): ``os.preadv``
  with direct I/O from 1 and from 8 threads, and DeepSpeed's async I/O where it builds.
- The LoRA training step with the "spread" placement streaming ~``--gib`` (or, with ``--vram_budget``, the VRAM
  planner's placement, timed once it settled), at each host RAM budget of ``--budgets`` (``all``: no budget, every
  master in RAM: the baseline). Per budget: the layers and GiB on disk, the GiB read from disk per step (counted
  from the transport's reads), the median step, the disk floor (bytes read per step / the 8-thread read
  bandwidth), the peak host RSS during the arm, measured (a sampler thread), and the disk plan's prediction
  (its start-up line, and with a VRAM budget the settled plan's, from measured compute).

    python3 benchmarks/bench_disk.py [--model flux|wan] [--budgets all,16,8] [--gib 20] [--vram_budget GIB]
        [--disk_dir DIR] [--tiny]

Writes benchmarks/results/<name>.json and .md (default name disk_<model>; results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
import wan  # noqa: E402
from models import Bench, place  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import time_steps  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls import LayerSwapper, Listener, SwapConfig  # noqa: E402
from utils.dgls.memory.disk_io import AioReader, ThreadReader, aio_handle  # noqa: E402
from utils.dgls.memory.disk_tier import DiskFile, check_directory, default_directory  # noqa: E402
from utils.dgls.memory.pinned import page_aligned_empty  # noqa: E402
from utils.dgls.memory.transport import Direction  # noqa: E402
from utils.dgls.streaming.tiers import RING_BUFFERS  # noqa: E402

MiB = 1024**2
PLANNER_STEPS = 80  # with --vram_budget: steps run, at most, before timing, for the planner to settle


class PeakRSS:
    """The process's peak resident set while the context is open, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._process = psutil.Process()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


class DiskReads(Listener):
    """Bytes the transport reads from disk (one ``copied`` event per read)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def copied(self, copy) -> None:
        if copy.direction is Direction.DISK_IN:
            self.nbytes += copy.nbytes


def read_bandwidth(directory: str | None, nbytes: int, request: int, threads: tuple[int, ...]) -> list[dict]:
    """GB/s of reading an ``nbytes`` file in ``request``-byte reads, per reader."""
    path = check_directory(directory, nbytes)
    file = DiskFile(path, nbytes)
    try:
        block = os.urandom(min(request, 64 * MiB))
        for offset in range(0, file.nbytes, len(block)):
            os.pwrite(file.fd, block[: file.nbytes - offset], offset)
        os.fsync(file.fd)
        os.posix_fadvise(file.fd, 0, file.nbytes, os.POSIX_FADV_DONTNEED)  # buffered reads start cold too
        buffer = page_aligned_empty(request)
        readers = [ThreadReader(file.fd, n) for n in threads]
        handle, why = aio_handle(max(threads))
        if handle is not None:
            readers.append(AioReader(file.fd, handle, max(threads)))
        rows = []
        for reader in readers:
            start = time.perf_counter()
            for offset in range(0, file.nbytes - request + 1, request):
                reader.read(buffer, offset)
            seconds = time.perf_counter() - start
            read = (file.nbytes // request) * request
            rows.append({"reader": reader.name, "gbps": read / seconds / 1e9, "bytes": read, "request": request})
            reader.close()
        if handle is None:
            rows.append({"reader": "DeepSpeed async I/O", "skipped": why})
        return rows
    finally:
        file.close()


def run_arm(bench: Bench, device, budget: float | None, streamed, prefetch, args) -> dict:
    place(bench.layers, device)
    resident = [s.index for s in bench.sizes if s.streamable_bytes and s.index not in streamed]
    if args.vram_budget is not None:  # the planner places the layers (its probe, trials, then the plan it keeps)
        settings = dict(vram_budget=args.vram_budget)
    else:
        settings = dict(gpu_layers=resident, prefetch=prefetch)
    if budget is not None:
        settings.update(host_ram_budget=budget, disk_dir=args.disk_dir)
    machine.release_host_cache()
    reads = DiskReads()
    lines: list[str] = []
    with PeakRSS() as rss:
        with LayerSwapper(bench.layers, SwapConfig.of(**settings), device=device, log=lines.append) as swapper:
            swapper.add_listener(reads)
            time_steps(bench.training_step(), device, args.warmup, 0)
            for _ in range(PLANNER_STEPS):  # until the planner settled (its last line is the plan's disk floor)
                if swapper.driver is None or swapper.driver.done:
                    break
                time_steps(bench.training_step(), device, 1, 0)
            reads.nbytes = 0
            times = time_steps(bench.training_step(), device, 0, args.steps)[0]
            store = swapper.store
            on_disk = store.disk_layers
            disk_gib = sum(store.layers[i].nbytes for i in on_disk) / GiB
    return {
        "budget": shown(budget),
        "layers_on_disk": len(on_disk),
        "disk_gib": disk_gib,
        "read_gib_per_step": reads.nbytes / args.steps / GiB,
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "peak_rss_gib": rss.peak / GiB,
        # the disk plan's predictions (the start-up line; with --vram_budget the settled plan's, measured compute)
        "disk_plan": [line for line in lines if line.startswith("DGLS disk plan")],
        "plan": [line for line in lines if line.startswith("DGLS plan (")][-1:],
    }


def shown(budget: float | None) -> str:
    return "all" if budget is None else f"{budget:.3g}"


def tiny_budgets(bench: Bench, streamed, prefetch: int) -> list[float | None]:
    """A tiny model's budgets: all, and the ring plus a quarter and a twentieth of the streamed bytes."""
    total = bench.streamed_bytes(streamed)
    ring = RING_BUFFERS * max(bench.sizes[i].streamable_bytes for i in streamed)
    return [None, (ring + total / 4) / GiB, (ring + total / 20) / GiB]


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("flux", "wan"), default="flux")
    parser.add_argument("--budgets", default="all,16,8", help="host RAM budgets in GiB; all: every master in RAM")
    parser.add_argument("--gib", type=float, default=20.0, help="streamed GiB of the spread placement")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument(
        "--vram_budget", type=float, default=None, help="GiB: the planner places the layers (instead of --gib's spread)"
    )
    parser.add_argument("--side", type=int, default=64, help="Flux: latent side (64: 1024x1024)")
    parser.add_argument("--latent_frames", type=int, default=21, help="Wan: latent frames (21: 81 video frames)")
    parser.add_argument("--disk_dir", default=None, help=f"default: the system temp ({default_directory()})")
    parser.add_argument("--file_gib", type=float, default=4.0, help="the read-bandwidth file's size")
    parser.add_argument("--request_mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--name", default=None, help="results file stem (default disk_<model>)")
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    file_bytes = 8 * MiB if args.tiny else int(args.file_gib * GiB)
    request = (1 if args.tiny else args.request_mib) * MiB
    bandwidth = read_bandwidth(args.disk_dir, file_bytes, request, (1, 8))
    direct8 = next((r["gbps"] for r in bandwidth if "8 threads" in r["reader"] and "gbps" in r), 0.0)
    with machine.session(args.tiny) as (device, dtype):
        if args.model == "flux":
            bench = flux.build(args.tiny, device, dtype, side=None if args.tiny else args.side)
        else:
            bench = wan.build(args.tiny, device, dtype, args)
        gib = sum(s.streamable_bytes for s in bench.sizes) * 0.8 / GiB if args.tiny else args.gib
        streamed, _ = bench.spread_config(gib, args.prefetch)
        if args.tiny:
            budgets = tiny_budgets(bench, streamed, args.prefetch)
        else:
            budgets = [None if b.strip() == "all" else float(b) for b in args.budgets.split(",")]
        rows = [run_arm(bench, device, budget, streamed, args.prefetch, args) for budget in budgets]
        base = rows[0]["median_step_s"] if budgets[0] is None else None
        for row in rows:
            row["vs_all_in_ram"] = row["median_step_s"] / base if base else None
            floor = row["read_gib_per_step"] * GiB / (direct8 * 1e9) if direct8 else None
            row["disk_floor_s"] = floor
        result = {
            "benchmark": "disk",
            "title": f"Disk tier: {bench.title} under host RAM budgets",
            "description": (
                f"{bench.shape}; spread placement, {len(streamed)} layers (~{bench.streamed_bytes(streamed) / GiB:.1f} "
                f"GiB) streamed, prefetch {args.prefetch}; host RAM budgets "
                f"{', '.join(shown(b) for b in budgets)} GiB; {args.steps} timed steps after {args.warmup}; medians. "
                f"Disk: {check_directory(args.disk_dir, 0)}."
                + (" TINY config on the CPU: the figures mean nothing." if args.tiny else "")
            ),
            "command": command_line(__file__, argv),
            "environment": machine.environment(device),
            "tiny": args.tiny,
            "read_bandwidth": bandwidth,
            "notes": [
                *(
                    f"read bandwidth, {r['reader']}: "
                    + (
                        f"{r['gbps']:.2f} GB/s ({r['bytes'] / GiB:.2f} GiB in {r['request'] // MiB} MiB reads)"
                        if "gbps" in r
                        else f"skipped: {r['skipped']}"
                    )
                    for r in bandwidth
                ),  # fmt: skip
                "disk floor: GiB read from disk per step / the 8-thread direct-I/O read bandwidth; a step cannot be "
                "faster than that. Peak RSS: the process's resident set during the arm, sampled every 20 ms.",
                *(f"host RAM budget {r['budget']}: {line}" for r in rows for line in r["plan"] + r["disk_plan"]),
            ],
            "rows": rows,
        }
    write_result(result, args.name or f"disk_{args.model}", args.results_dir or results_dir(args.tiny), echo=True)
    return result


if __name__ == "__main__":
    main()
