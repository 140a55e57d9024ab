"""Where a swapped step's extra time goes: compute waits, slower compute beside copies, or the rest.

The Flux A/B runs put DGLS's spread placement at ~9.6 GiB streamed within 1.04-1.10x of
all-resident while compute waited on copies for almost no time. This benchmark splits that
gap. Three arms alternate in rounds (drift cancels): "resident" (a swapper that streams
nothing: the same hooks, no copies), "spread" and "ends" (blocks_to_swap's placement) at the
target. Each arm runs under DGLS's profiler (a CUDA event at the start of every layer use), so
each step splits into: time in layer uses (less waits), time compute waited on copies, and time
outside the layers (loss, optimizer, launches). The layer uses that are resident in every arm
are compared one by one: if they run slower while copies stream beside them, the copies
interfere with compute itself (memory bandwidth, clocks), which no schedule can hide.

    python3 benchmarks/bench_overlap.py [--gib 9.6] [--rounds 2] [--steps 3] [--tiny]

Writes benchmarks/results/overlap.json and overlap.md (results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
from bench_flux import flux_bench  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402

GiB = 1024**3


def arms(bench, gib: float, prefetch: int) -> dict[str, SwapConfig]:
    spread = set(bench.spread_for_gib(gib))
    resident = [s.index for s in bench.sizes if s.streamable_bytes and s.index not in spread]
    return {
        "resident": SwapConfig(blocks_to_swap=0, prefetch=prefetch),
        "spread": SwapConfig(gpu_layers=resident, prefetch=prefetch),
        "ends": SwapConfig(blocks_to_swap=bench.blocks_to_swap_for_gib(gib), prefetch=prefetch),
    }


def profiled_steps(bench, device, config: SwapConfig, trace: Path, steps: int) -> tuple[list[float], dict, set]:
    """One warm-up step then ``steps`` profiled ones; their wall times, the trace, the streamed set."""
    common.place(bench.layers, device)
    config = config.replace(profile_path=str(trace), profile_warmup_steps=1, profile_steps=steps)
    optimizer = bench.optimizer()
    walls = []
    with LayerSwapper(bench.layers, config, device, log=None) as swapper:
        streamed = set(swapper.placement.streamed)
        for _ in range(1 + steps):
            common.sync(device)
            start = time.perf_counter()
            common.train_step(bench.layers, bench.inputs, bench.target, optimizer, bench.checkpointed)
            common.sync(device)
            walls.append(time.perf_counter() - start)
            swapper.step_stats()
    return walls[1:], json.loads(trace.read_text()), streamed


def split_steps(trace: dict) -> tuple[dict[int, dict], dict[tuple, list[float]]]:
    """Per profiled step: ms waited on copies; and each use's compute ms (less its waits),
    keyed by (layer, phase, n-th use of that layer and phase in its step)."""
    per_step: dict[int, dict] = defaultdict(lambda: {"waited_ms": 0.0})  # per profiled step
    waits: dict[tuple, float] = defaultdict(float)
    for e in trace["traceEvents"]:
        if e.get("cat") == "wait":
            waits[(e["args"]["step"], e["args"]["layer"])] += e["dur"] / 1000
            per_step[e["args"]["step"]]["waited_ms"] += e["dur"] / 1000
    uses: dict[tuple, list[float]] = defaultdict(list)
    seen: dict[tuple, int] = defaultdict(int)
    for e in sorted((e for e in trace["traceEvents"] if e.get("cat") == "compute"), key=lambda e: e["ts"]):
        a = e["args"]
        # a wait happens at the start of its layer's use: it is inside that use's interval
        ms = e["dur"] / 1000 - waits.pop((a["step"], a["layer"]), 0.0)
        per_step.setdefault(a["step"], {"waited_ms": 0.0})
        key = (a["layer"], a["phase"], seen[(a["step"], a["layer"], a["phase"])])
        seen[(a["step"], a["layer"], a["phase"])] += 1
        uses[key].append(ms)
    return dict(per_step), uses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=9.6, help="streamed GiB of the spread and ends arms")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per arm and round")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--results_dir", type=Path, default=None)
    args = parser.parse_args(argv)
    device, dtype = common.setup_device()
    bench = flux_bench(args.tiny, device, dtype)
    # tiny: half the streamable bytes (its layers are KiB, not GiB)
    gib = sum(s.streamable_bytes for s in bench.sizes) / 2 / GiB if args.tiny else args.gib
    configs = arms(bench, gib, args.prefetch)
    walls: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, list[dict]] = defaultdict(list)
    uses: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    streamed_sets: dict[str, set] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, config in configs.items():
                trace_path = Path(tmp) / f"{name}_{r}.json"
                times, trace, streamed_sets[name] = profiled_steps(bench, device, config, trace_path, args.steps)
                per_step, arm_uses = split_steps(trace)
                walls[name] += times
                parts[name] += [per_step[s] for s in sorted(per_step)]
                for key, values in arm_uses.items():
                    uses[name][key] += values
    resident_everywhere = set(range(len(bench.layers))) - set().union(*streamed_sets.values())
    # blocks only: the first and last layer's uses also hold the loss and the optimizer step
    shared = resident_everywhere & set(bench.blocks)
    common_keys = [k for k in uses["resident"] if k[0] in shared and all(k in uses[a] for a in uses)]
    rows = []
    for name in configs:
        wall_ms = statistics.median(walls[name]) * 1000
        waited_ms = statistics.median(p["waited_ms"] for p in parts[name])
        shared_ms = sum(statistics.median(uses[name][k]) for k in common_keys)
        rows.append(
            dict(
                arm=name,
                streamed_layers=len(streamed_sets[name]),
                streamed_gib=bench.streamed_bytes(streamed_sets[name]) / GiB,
                step_ms=wall_ms,
                step_times_s=walls[name],
                waited_ms=waited_ms,
                shared_uses=len(common_keys),
                shared_layers_ms=shared_ms,
            )
        )
    base = rows[0]
    for row in rows:
        row["vs_resident"] = row["step_ms"] / base["step_ms"]
        row["extra_ms"] = row["step_ms"] - base["step_ms"]
        row["shared_vs_resident"] = row["shared_layers_ms"] / max(base["shared_layers_ms"], 1e-9)
    result = {
        "title": "Where the swapped step's time goes (Flux-dev size, DGLS profiler)",
        "env": {**common.gpu_details(), "torch": torch.__version__, "cuda": torch.version.cuda},
        "tiny": args.tiny,
        "gib": gib,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "prefetch": args.prefetch,
        "resident_in_every_arm": sorted(resident_everywhere),
        "rows": rows,
    }
    out = args.results_dir or common.results_dir(args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "overlap.md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    env = result["env"]
    lines = [
        f"{result['title']} on {env.get('gpu', 'CPU')} (torch {env['torch']}), "
        f"~{result['gib']:g} GiB streamed, prefetch {result['prefetch']}; arms alternate in "
        f"{result['rounds']} rounds of {result['steps_per_round']} profiled steps; medians.",
        "",
        "| arm | streamed layers | step (ms) | vs resident | extra vs resident (ms) | waited on copies (ms) "
        "| block uses resident in every arm (ms) | those vs resident arm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['arm']} | {r['streamed_layers']} | {r['step_ms']:.0f} | {r['vs_resident']:.2f}x | "
            f"{r['extra_ms']:+.0f} | {r['waited_ms']:.0f} | "
            f"{r['shared_layers_ms']:.0f} ({r['shared_uses']} uses) | {r['shared_vs_resident']:.3f}x |"
        )
    lines += [
        "",
        "A use's time runs on the compute stream from its start to the next use's start, less the waits "
        "inside it. The last two columns compare the same uses of the blocks resident in all three arms: "
        "above 1.00x, that compute ran slower while copies streamed beside it. Extra time neither waited "
        "nor explained by that slow-down is host-side (hooks, launches) or in the streamed layers' own uses."
        + (" TINY config on the CPU (copies run inline there): the figures mean nothing." if result["tiny"] else ""),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
