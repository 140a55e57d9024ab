"""Probe (not a benchmark): torch.profiler timeline of one SDXL full-fine-tune step with DGLS, per CUDA stream.

python benchmarks/probe_full_profile.py --impl device --out /tmp/out
python benchmarks/probe_full_profile.py --impl split --send_group_mib 0  # each gradient sent home alone
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_full  # noqa: E402
import machine  # noqa: E402

from utils.dgls.training import grad_return  # noqa: E402


def summarize(trace: Path, bucket_ms: float = 50.0) -> None:
    events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print("no GPU events")
        return
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    print(f"GPU span {(t1 - t0) / 1000:.1f} ms")
    by_stream = defaultdict(list)
    for e in gpu:
        by_stream[e.get("tid")].append(e)
    for tid, evs in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
        busy = sum(e["dur"] for e in evs) / 1000
        kinds = defaultdict(lambda: [0, 0.0, 0])
        for e in evs:
            name = e["name"]
            kind = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "DtoD" if "DtoD" in name else e["cat"]
            k = kinds[kind]
            k[0] += 1
            k[1] += e["dur"] / 1000
            k[2] += int(e.get("args", {}).get("memory bandwidth (GB/s)", 0) * e["dur"] * 1e-6 * 1e9 / 1e9 or 0)
        desc = ", ".join(f"{kind}: {n} ops {ms:.1f} ms" for kind, (n, ms, _) in kinds.items())
        print(f"stream {tid}: busy {busy:.1f} ms; {desc}")
    n = int((t1 - t0) / 1000 / bucket_ms) + 1
    print(f"per {bucket_ms:.0f} ms bucket, busy ms per stream:")
    grid = defaultdict(lambda: [0.0] * n)
    for e in gpu:
        start = (e["ts"] - t0) / 1000
        end = start + e["dur"] / 1000
        b = int(start / bucket_ms)
        while start < end and b < n:
            edge = (b + 1) * bucket_ms
            grid[e.get("tid")][b] += min(end, edge) - start
            start, b = edge, b + 1
    tids = sorted(grid, key=str)
    print("bucket " + " ".join(f"{str(t)[-8:]:>8}" for t in tids))
    for b in range(n):
        print(f"{b * bucket_ms:6.0f} " + " ".join(f"{grid[t][b]:8.1f}" for t in tids))


def phases(bench, step_rest, device, steps: int = 4) -> list[tuple[float, float]]:
    """(forward+backward, the rest of the step) in seconds, each ended by a device synchronize."""
    import time

    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bench_full.forward_backward(bench)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        step_rest()
        torch.cuda.synchronize()
        out.append((t1 - t0, time.perf_counter() - t1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default="device")
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--resident", action="store_true", help="time the resident forward+backward too")
    parser.add_argument(
        "--send_group_mib", type=float, default=None, help="gradients sent home in groups of this many MiB (0: alone)"
    )
    args = parser.parse_args()
    if args.send_group_mib is not None:  # this probe's own process, before anything is built; never undone
        grad_return.SEND_GROUP_BYTES = int(args.send_group_mib * 2**20)
    with machine.session(False) as (device, dtype):
        bench = bench_full.fresh_bench(False, device, dtype, torch.device("cpu"))
        step, swapper, _ = bench_full.dgls_step(bench, device, args.impl, 64.0, 2, 1.0)
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        training = swapper.training
        params = [p for layer in bench.layers for p in layer.parameters()]

        def rest() -> None:
            training.clip_grad_norm_(params, 1.0)
            training.step()

        for fb, r in phases(bench, rest, device):
            print(f"phases: forward+backward {fb:.3f} s, clip+updates {r:.3f} s")
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        step()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        if args.trace:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                step()
                torch.cuda.synchronize()
            trace = args.out / f"profile_{args.impl}.json"
            prof.export_chrome_trace(str(trace))
            summarize(trace)
        if swapper.training.split is not None:
            print(swapper.training.split.describe())
        swapper.remove()
        if args.resident:
            del bench
            resident = bench_full.fresh_bench(False, device, dtype, device)
            for fb, _ in phases(resident, lambda: None, device):
                print(f"resident phases: forward+backward {fb:.3f} s")


if __name__ == "__main__":
    main()
