"""The disk tier: the disk's read bandwidth, and a LoRA step under host RAM budgets (Flux-dev or Wan2.1-14B size).

Two parts, side by side in one run:

- Read bandwidth of the directory's disk: a ``--file_gib`` file (unnamed, gone after the run) read in
  ``--request_mib`` requests by the disk tier's readers (:mod:`utils.dgls.memory.disk_io`): ``os.preadv``
  with direct I/O from 1 and from 8 threads, and DeepSpeed's async I/O where it builds.
- The LoRA training step with the "spread" placement streaming ~``--gib`` (or, with ``--vram_budget``, the VRAM
  planner's placement, timed once it settled; Wan without ``--vram_budget``: toml/wan_lora_long_video.toml's
  settings, every block streamed, under a ``--memory_cap_gib`` device memory cap as bench_scaling.py runs it), at
  each host RAM budget of ``--budgets`` (``all``: no budget, every master in RAM: the baseline). Per budget: the
  layers and GiB on disk, the GiB read from disk per step (counted from the transport's reads), the median step,
  the disk floor (bytes read per step / the 8-thread read bandwidth), the two-stream floor (the all-resident step,
  or the bytes copied to the device per step at the pinned bandwidth, whichever is longer), the peak host RSS
  during the arm, measured (a sampler thread), and the disk plan's prediction (its start-up line, and with a VRAM
  budget the settled plan's, from measured compute). The budget covers the streamed layers' weights; activation
  offload's pinned buffers are beside it.
- The all-resident step (every layer on the device, no DGLS; ``--no_resident`` skips it): the two-stream floor's
  start.
- ``--greedy_alone 16`` (budgets, or ``each``): those budgets' arms again with the disk plan's greedy alone, as it
  chose before the evenly spread choice joined it (:func:`greedy_alone`): the two choices side by side.
- ``--ring 4 --ring_budgets 16``: those budgets' arms again with 4 staging buffers instead of the tier's
  ``RING_BUFFERS`` (:func:`ring_of`): how far the reads may run ahead, side by side (the ring counts against the
  budget, and the disk plan models it, so the layers on disk may differ).

    python3 benchmarks/bench_disk.py [--model flux|wan] [--budgets all,16,8] [--gib 20] [--vram_budget GIB]
        [--disk_dir DIR] [--no_resident] [--tiny]
    python3 benchmarks/bench_disk.py --model flux --gib 19 --steps 3 --warmup 1 --name disk_flux   # ~19 GiB
        streamed: what --vram_budget 8 streams (flux_accum_budget8), without its ~35 planning steps
    python3 benchmarks/bench_disk.py --model wan --steps 2 --warmup 1 --name disk_wan   # 81 frames, 8 GiB cap
    python3 benchmarks/bench_disk.py --model wan --steps 2 --warmup 1 --no_resident --greedy_alone 16 \
        --name disk_wan_spread    # about 12 minutes: all, 16, 8 GiB, and 16 GiB as the greedy alone chose
    python3 benchmarks/bench_disk.py --model wan --budgets all,16 --steps 4 --warmup 1 --no_resident --ring 4 \
        --ring_budgets 16 --name disk_wan_ring   # 16 GiB with 2 and with 4 staging buffers

Writes benchmarks/results/<name>.json and .md (default name disk_<model>; results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
import wan  # noqa: E402
from models import Bench, place  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import time_steps  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls import LayerSwapper, Listener, SwapConfig  # noqa: E402
from utils.dgls.engine import build, disk_planning  # noqa: E402
from utils.dgls.memory.disk_io import AioReader, ThreadReader, aio_handle  # noqa: E402
from utils.dgls.memory.disk_tier import DiskFile, check_directory, default_directory  # noqa: E402
from utils.dgls.memory.pinned import page_aligned_empty  # noqa: E402
from utils.dgls.memory.transport import Direction  # noqa: E402
from utils.dgls.planning import disk_plan  # noqa: E402
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
        self.peak = self.start = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


class DiskReads(Listener):
    """Bytes the transport reads from disk (one ``copied`` event per read), and the weights it copies to the device
    (the two-stream floor's bytes); each read, for the time the reader spent in it (its ``span``: set once the read
    ran, on the disk thread, its gate waits not counted)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.nbytes = self.weights_in = 0
        self.reads: list = []

    def copied(self, copy) -> None:
        if copy.direction is Direction.DISK_IN:
            self.nbytes += copy.nbytes
            self.reads.append(copy)
        elif copy.direction is Direction.WEIGHTS_IN:
            self.weights_in += copy.nbytes

    def busy(self) -> tuple[float, int]:
        """Seconds the reader spent reading and the bytes of those reads (the reads that ran so far: one thread
        reads them one after another, so their spans add up)."""
        ran = [c for c in self.reads if c.span is not None]
        return sum(c.span[1] - c.span[0] for c in ran), sum(c.nbytes for c in ran)


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


@contextlib.contextmanager
def greedy_alone():
    """While open, the disk plan chooses with its greedy alone: ``disk_plan.spread_choice`` (the evenly spread
    candidate each cap also tries) is replaced by one that offers nothing (``choose_by_model`` skips a choice that does
    not fit, and spilling nothing does not where it runs). Restored on exit; this benchmark's arms only."""
    original = disk_plan.spread_choice
    disk_plan.spread_choice = lambda candidates, position, over: []
    try:
        yield
    finally:
        disk_plan.spread_choice = original


@contextlib.contextmanager
def ring_of(buffers: int | None):
    """While open, the disk tier's staging ring has ``buffers`` buffers (None: the tier's ``RING_BUFFERS``): the two
    module names the engine reads it from when it plans and builds the tier are set, and restored on exit; this
    benchmark's arms only."""
    if buffers is None:
        yield
        return
    saved = build.RING_BUFFERS, disk_planning.RING_BUFFERS
    build.RING_BUFFERS = disk_planning.RING_BUFFERS = buffers
    try:
        yield
    finally:
        build.RING_BUFFERS, disk_planning.RING_BUFFERS = saved


def run_arm(
    bench: Bench, device, budget: float | None, streamed, prefetch, args, greedy: bool = False, ring: int | None = None
) -> dict:
    place(bench.layers, device)
    resident = [s.index for s in bench.sizes if s.streamable_bytes and s.index not in streamed]
    capped = wan.runs_recipe(args) and device.type == "cuda"
    if args.vram_budget is not None:  # the planner places the layers (its probe, trials, then the plan it keeps)
        settings = dict(vram_budget=args.vram_budget)
    elif wan.runs_recipe(args):  # toml/wan_lora_long_video.toml's settings, every block streamed
        settings = wan.recipe(len(bench.blocks), args.tiny)
    else:
        settings = dict(gpu_layers=resident, prefetch=prefetch)
    if budget is not None:
        settings.update(host_ram_budget=budget, disk_dir=args.disk_dir)
    machine.release_host_cache()
    reads = DiskReads()
    lines: list[str] = []
    chooser = greedy_alone() if greedy else contextlib.nullcontext()
    with PeakRSS() as rss, chooser, ring_of(ring):
        with LayerSwapper(bench.layers, SwapConfig.of(**settings), device=device, log=lines.append) as swapper:
            swapper.add_listener(reads)
            # the features' checkpoint (activation offload: the wan recipe), as a trainer passes it
            ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
            step = bench.training_step(checkpoint_fn=ckpt)
            if capped:  # as an 8 GiB card holds it, once the swapper took the blocks home (bench_scaling's way)
                wan.cap_device_memory(device, args.memory_cap_gib)  # (empties the allocator's cache first)
            if device.type == "cuda":  # the arm's own peak: not the cache of the layers before they went home
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            time_steps(step, device, args.warmup, 0)
            for _ in range(PLANNER_STEPS):  # until the planner settled (its last line is the plan's disk floor)
                if swapper.driver is None or swapper.driver.done:
                    break
                time_steps(step, device, 1, 0)
            reads.reset()
            disk = swapper.store.disk
            buffers = len(disk.ring.buffers) if disk is not None else 0
            taken, dropped = (disk.taken, disk.dropped) if disk is not None else (0, 0)
            with PeakRSS() as training_rss:
                times = time_steps(step, device, 0, args.steps)[0]
            busy_s, busy_bytes = reads.busy()
            store = swapper.store
            on_disk = store.disk_layers
            disk_gib = sum(store.layers[i].nbytes for i in on_disk) / GiB
            peak = torch.cuda.max_memory_reserved(device) / GiB if device.type == "cuda" else None
            if capped:
                wan.cap_device_memory(device, None)
    return {
        "budget": shown(budget) + (", greedy alone" if greedy else "") + (f", ring of {ring}" if ring else ""),
        "staging_buffers": buffers,
        "layers_on_disk": len(on_disk),
        "disk_gib": disk_gib,
        "read_gib_per_step": reads.nbytes / args.steps / GiB,
        # the reader's time in its reads a timed step, and their rate while it read: a step's reads at less than the
        # disk's bandwidth, with the reader busy all the step, point at the reader; idle, at what feeds it
        "reader_busy_s_per_step": busy_s / args.steps,
        "read_gbps_while_reading": (busy_bytes / busy_s / 1e9) if busy_s > 0 else None,
        "weights_in_gib_per_step": reads.weights_in / args.steps / GiB,
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        # the arm's sampler may fall between the timed steps' samples: their peak is the arm's too
        "peak_rss_gib": max(rss.peak, training_rss.peak) / GiB,
        "rss_at_start_gib": rss.start / GiB,  # what the arms before left (the process, torch's host caches)
        "training_peak_rss_gib": training_rss.peak / GiB,  # during the timed steps: what training holds
        # fetches of a spilled layer that found its read ahead, and reads ahead dropped, per timed step
        "reads_ahead_taken_per_step": ((disk.taken - taken) / args.steps) if disk is not None else 0.0,
        "reads_ahead_dropped_per_step": ((disk.dropped - dropped) / args.steps) if disk is not None else 0.0,
        "peak_reserved_gib": peak,
        # the disk plan's predictions (the start-up line; with --vram_budget the settled plan's, measured compute)
        "disk_plan": [line for line in lines if line.startswith("DGLS disk plan")],
        "plan": [line for line in lines if line.startswith("DGLS plan (")][-1:],
    }


def run_resident(bench: Bench, device, args) -> dict:
    """Every layer on the device, no DGLS: the step the two-stream floor starts from."""
    place(bench.layers, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(bench.training_step(), device, args.warmup, args.steps)[0]
    peak = torch.cuda.max_memory_reserved(device) / GiB if device.type == "cuda" else None
    return {"median_step_s": statistics.median(times), "step_times_s": times, "peak_reserved_gib": peak}


def floors(rows: list[dict], resident: float | None, pinned: float, disk_gbps: float, first_is_all: bool) -> None:
    """Each row's ratios: to the all-in-RAM row, to all-resident, and to its floors (all measured in this run)."""
    base = rows[0]["median_step_s"] if first_is_all else None
    for row in rows:
        step = row["median_step_s"]
        row["vs_all_in_ram"] = step / base if base else None
        row["vs_resident"] = step / resident if resident else None
        row["disk_floor_s"] = row["read_gib_per_step"] * GiB / (disk_gbps * 1e9) if disk_gbps else None
        copies = row["weights_in_gib_per_step"] * GiB / (pinned * 1e9) if pinned else 0.0
        # without the all-resident step (--no_resident) there is no two-stream floor: the copies alone are not one
        two_stream = max(resident, copies) if resident else None
        row["two_stream_floor_s"] = two_stream
        floor = max((x for x in (two_stream, row["disk_floor_s"]) if x), default=None)
        row["floor_s"], row["vs_floor"] = floor, (step / floor if floor else None)


def placement(bench: Bench, streamed, args) -> str:
    if args.vram_budget is not None:
        return f"the planner's placement for --vram_budget {args.vram_budget:g}"
    if wan.runs_recipe(args):
        return (
            f"toml/wan_lora_long_video.toml's settings ({wan.recipe(len(bench.blocks), args.tiny)}), device memory "
            f"capped at {args.memory_cap_gib:g} GiB"
        )
    return (
        f"spread placement, {len(streamed)} layers (~{bench.streamed_bytes(streamed) / GiB:.1f} GiB) streamed, "
        f"prefetch {args.prefetch}"
    )


def shown(budget: float | None) -> str:
    return "all" if budget is None else f"{budget:.3g}"


def greedy_arm(budget: float, spec: str) -> bool:
    """Whether ``--greedy_alone`` or ``--ring_budgets`` (``spec``) names ``budget`` (or is ``each``)."""
    named = [b.strip() for b in spec.split(",") if b.strip()]
    return "each" in named or any(abs(float(b) - budget) < 1e-9 for b in named if b != "each")


def tiny_budgets(bench: Bench, streamed, buffers: int) -> list[float | None]:
    """A tiny model's budgets: all, and a ring of ``buffers`` plus a quarter and a twentieth of the streamed bytes."""
    total = bench.streamed_bytes(streamed)
    ring = buffers * max(bench.sizes[i].streamable_bytes for i in streamed)
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
    parser.add_argument(
        "--memory_cap_gib", type=float, default=8.0, help="wan: device memory cap of its recipe (streaming arms)"
    )
    parser.add_argument("--disk_dir", default=None, help=f"default: the system temp ({default_directory()})")
    parser.add_argument("--file_gib", type=float, default=4.0, help="the read-bandwidth file's size")
    parser.add_argument("--request_mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--no_resident", action="store_true", help="skip the all-resident step (every layer on the device, no DGLS)"
    )
    parser.add_argument(
        "--greedy_alone",
        default="",
        help="budgets (GiB, comma list, or each) whose arm runs again with the disk plan's greedy alone",
    )
    parser.add_argument("--ring", type=int, default=None, help="staging buffers of the --ring_budgets arms")
    parser.add_argument(
        "--ring_budgets", default="", help="budgets (GiB, comma list, or each) whose arm runs again with --ring buffers"
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--name", default=None, help="results file stem (default disk_<model>)")
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    if wan.runs_recipe(args) and not args.tiny:  # before CUDA starts: the allocator reads it once
        os.environ.setdefault(*wan.RECIPE_ALLOCATOR)
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
            budgets = tiny_budgets(bench, streamed, max(RING_BUFFERS, args.ring or 0))
        else:
            budgets = [None if b.strip() == "all" else float(b) for b in args.budgets.split(",")]
        pinned = machine.pinned_bandwidth(device)
        resident = None if args.no_resident else run_resident(bench, device, args)
        arms = [(budget, False, None) for budget in budgets]
        arms += [
            (budget, True, None) for budget in budgets if budget is not None and greedy_arm(budget, args.greedy_alone)
        ]
        if args.ring is not None:
            arms += [
                (budget, False, args.ring)
                for budget in budgets
                if budget is not None and greedy_arm(budget, args.ring_budgets)
            ]
        rows = [
            run_arm(bench, device, budget, streamed, args.prefetch, args, greedy, ring) for budget, greedy, ring in arms
        ]
        floors(rows, resident["median_step_s"] if resident else None, pinned, direct8, budgets[0] is None)
        result = {
            "benchmark": "disk",
            "title": f"Disk tier: {bench.title} under host RAM budgets",
            "description": (
                f"{bench.shape}; {placement(bench, streamed, args)}; host RAM budgets "
                f"{', '.join(shown(b) for b in budgets)} GiB; {args.steps} timed steps after {args.warmup}; medians. "
                f"Disk: {check_directory(args.disk_dir, 0)}."
                + (" TINY config on the CPU: the figures mean nothing." if args.tiny else "")
            ),
            "command": command_line(__file__, argv),
            "environment": machine.environment(device),
            "tiny": args.tiny,
            "read_bandwidth": bandwidth,
            "pinned_h2d_gbps": pinned,
            "resident": resident,
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
                "faster than that. RSS while training: the process's peak resident set during the timed steps; peak "
                "RSS: during the whole arm (the swapper's build included, and what the arms before left in the "
                "process: rss_at_start_gib), sampled every 20 ms. Reads ahead: fetches of a spilled layer that found "
                "its read issued ahead, and reads ahead dropped (the order changed), per timed step. Reader busy: "
                "the disk thread's time in its reads a timed step (gate waits not counted); GB/s while reading: "
                "their bytes over that time.",
                "two-stream floor: max(all-resident step, GiB copied to the device per step / pinned host-to-device "
                f"bandwidth, {pinned:.1f} GB/s here); floor: the larger of it and the disk floor"
                + (
                    f"; all-resident: {resident['median_step_s']:.3f} s a step, {resident['peak_reserved_gib']:.1f} "
                    "GiB reserved"
                    if resident and resident["peak_reserved_gib"] is not None
                    else ""
                ),
                *(f"host RAM budget {r['budget']}: {line}" for r in rows for line in r["plan"] + r["disk_plan"]),
                *(
                    [
                        "greedy alone: the disk plan's greedy chose the layers on disk alone, as before the evenly "
                        "spread choice joined it (each cap's faster of the two in the model: the other rows)"
                    ]
                    if any(greedy for _, greedy, _ in arms)
                    else []
                ),  # fmt: skip
            ],
            "rows": rows,
        }
    write_result(result, args.name or f"disk_{args.model}", args.results_dir or results_dir(args.tiny), echo=True)
    return result


if __name__ == "__main__":
    main()
