"""Where a swapped step's extra time goes: compute waits, slower compute beside copies, or the rest.

The Flux A/B runs put DGLS's spread placement at ~9.6 GiB streamed within 1.04-1.10x of
all-resident while compute waited on copies for almost no time. This benchmark splits that
gap. Three arms alternate in rounds (drift cancels): "resident" (a swapper that streams
nothing: the same hooks, no copies), "spread" and "ends" (blocks_to_swap's placement) at the
target. Each arm runs under DGLS's profiler (a CUDA event at the start of every layer use).
Per arm it reports the step time, the time compute waited on copies, and the compute-stream
time of the layer uses that are resident in every arm, compared one by one: if they run slower
while copies stream beside them, the copies interfere with compute itself (memory bandwidth,
clocks), which no schedule can hide. What is neither waiting nor that slow-down is host time
or the streamed layers' own uses.

    python3 benchmarks/bench_overlap.py [--gib 9.6] [--rounds 2] [--steps 3] [--tiny]

Writes benchmarks/results/overlap.json and overlap.md (results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from bench_flux import flux_bench  # noqa: E402
from common import GiB  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402


def arms(bench, gib: float, prefetch: int) -> dict[str, SwapConfig]:
    return {
        "resident": SwapConfig(blocks_to_swap=0, prefetch=prefetch),
        "spread": bench.spread_config(gib, prefetch)[1],
        "ends": SwapConfig(blocks_to_swap=bench.blocks_to_swap_for_gib(gib), prefetch=prefetch),
    }


def profiled_steps(bench, device, config: SwapConfig, trace: Path, steps: int) -> tuple[list[float], dict, set]:
    """One warm-up step then ``steps`` profiled ones; their wall times, the trace, the streamed set."""
    common.place(bench.layers, device)
    config = config.replace(profile_path=str(trace), profile_warmup_steps=1, profile_steps=steps)
    with LayerSwapper(bench.layers, config, device, log=None) as swapper:
        times, _ = common.run_steps(bench, device, 1, steps, after=swapper.step_stats)
        streamed = set(swapper.placement.streamed)
    return times, json.loads(trace.read_text()), streamed


def use_spans(trace: dict) -> dict[tuple, list[float]]:
    """Each layer use's ms on the compute stream, keyed by (layer, phase, n-th such use in its step).

    Left out per step: the last forward use (its span holds the loss) and the last use (its span
    runs to the step's end: the optimizer). A streamed layer's span also holds its wait; only
    layers resident in every arm are compared, and those never wait.
    """
    by_step: dict[int, list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("cat") == "compute":
            by_step[e["args"]["step"]].append(e)
    spans: dict[tuple, list[float]] = defaultdict(list)
    for events in by_step.values():
        events.sort(key=lambda e: e["ts"])
        forward = [e for e in events if e["args"]["phase"] == "forward"]
        dropped = {id(events[-1])} | ({id(forward[-1])} if forward else set())
        seen: dict[tuple, int] = defaultdict(int)
        for e in events:
            a = e["args"]
            n = seen[(a["layer"], a["phase"])]
            seen[(a["layer"], a["phase"])] += 1
            if id(e) not in dropped:
                spans[(a["layer"], a["phase"], n)].append(e["dur"] / 1000)
    return spans


def waited_ms(trace: dict) -> list[float]:
    """Per profiled step: the time compute waited on copies (the profiler's own summary)."""
    return [row["wait_ms"] for row in trace["otherData"]["summary"].values()]


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
    waits: dict[str, list[float]] = defaultdict(list)
    uses: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    streamed_sets: dict[str, set] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, config in configs.items():
                trace_path = Path(tmp) / f"{name}_{r}.json"
                times, trace, streamed_sets[name] = profiled_steps(bench, device, config, trace_path, args.steps)
                walls[name] += times
                waits[name] += waited_ms(trace)
                for key, values in use_spans(trace).items():
                    uses[name][key] += values
    resident_everywhere = set(range(len(bench.layers))) - set().union(*streamed_sets.values())
    common_keys = [k for k in uses["resident"] if k[0] in resident_everywhere and all(k in uses[a] for a in uses)]
    rows = []
    for name in configs:
        wall_ms = statistics.median(walls[name]) * 1000
        shared_ms = sum(statistics.median(uses[name][k]) for k in common_keys)
        rows.append(
            dict(
                arm=name,
                streamed_layers=len(streamed_sets[name]),
                streamed_gib=bench.streamed_bytes(streamed_sets[name]) / GiB,
                step_ms=wall_ms,
                step_times_s=walls[name],
                waited_ms=statistics.median(waits[name]),
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
        "env": common.environment(),
        "tiny": args.tiny,
        "gib": gib,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "prefetch": args.prefetch,
        "resident_in_every_arm": sorted(resident_everywhere),
        "shared_uses": len(common_keys),
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
            f"{r['shared_layers_ms']:.0f} ({result['shared_uses']} uses) | {r['shared_vs_resident']:.3f}x |"
        )
    lines += [
        "",
        "A use's time runs on the compute stream from its start to the next use's start. The last two "
        "columns compare the same uses of the layers resident in all three arms (not the last forward use, "
        "which holds the loss, nor the step's last use, which holds the optimizer): "
        "above 1.00x, that compute ran slower while copies streamed beside it. Extra time neither waited "
        "nor explained by that slow-down is host-side (hooks, launches) or in the streamed layers' own uses."
        + (" TINY config on the CPU (copies run inline there): the figures mean nothing." if result["tiny"] else ""),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
