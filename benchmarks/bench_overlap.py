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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
from models import Bench, place  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import time_steps  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402

NOTE = (
    "A use's time runs on the compute stream from its start to the next use's start. The last two columns "
    "compare the same uses of the layers resident in all three arms (not the last forward use, which holds the "
    "loss, nor the step's last use, which holds the optimizer): above 1.00x, that compute ran slower while "
    "copies streamed beside it. Extra time neither waited nor explained by that slow-down is host-side (hooks, "
    "launches) or in the streamed layers' own uses."
)


def arms(bench: Bench, gib: float, prefetch: int) -> dict[str, SwapConfig]:
    return {
        "resident": SwapConfig.of(blocks_to_swap=0, prefetch=prefetch),
        "spread": bench.spread_config(gib, prefetch)[1],
        "ends": SwapConfig.of(blocks_to_swap=bench.blocks_to_swap_for_gib(gib), prefetch=prefetch),
    }


def profiled_steps(bench: Bench, device, config: SwapConfig, trace: Path, steps: int) -> tuple[list[float], dict, set]:
    """One warm-up step then ``steps`` profiled ones; their wall times, the trace, the streamed set."""
    place(bench.layers, device)
    config = config.replace(profile=str(trace), profile_warmup_steps=1, profile_steps=steps)
    with LayerSwapper(bench.layers, config, device, log=None) as swapper:
        times, _ = time_steps(bench.training_step(), device, 1, steps)
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


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=9.6, help="streamed GiB of the spread and ends arms")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per arm and round")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    with machine.session(args.tiny) as (device, dtype):
        bench = flux.build(args.tiny, device, dtype)
        # tiny: half the streamable bytes (its layers are KiB, not GiB)
        gib = sum(s.streamable_bytes for s in bench.sizes) / 2 / GiB if args.tiny else args.gib
        rows, resident_everywhere, shared_uses = measure(bench, device, arms(bench, gib, args.prefetch), args)
        result = {
            "benchmark": "overlap",
            "title": "Where the swapped step's time goes (Flux-dev size, DGLS profiler)",
            "description": (
                f"~{gib:g} GiB streamed, prefetch {args.prefetch}; arms alternate in {args.rounds} rounds of "
                f"{args.steps} profiled steps; medians."
                + (" TINY config on the CPU (copies run inline there): the figures mean nothing." if args.tiny else "")
            ),
            "command": command_line(__file__, argv),
            "environment": machine.environment(device),
            "tiny": args.tiny,
            "notes": [NOTE],
            "gib": gib,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "prefetch": args.prefetch,
            "resident_in_every_arm": resident_everywhere,
            "shared_uses": shared_uses,
            "rows": rows,
        }
    write_result(result, "overlap", args.results_dir or results_dir(args.tiny), echo=True)
    return result


def measure(bench: Bench, device, configs: dict[str, SwapConfig], args) -> tuple[list[dict], list[int], int]:
    """The arms' rows, the layers resident in every arm, and how many of their uses are compared."""
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
        rows.append(
            dict(
                arm=name,
                streamed_layers=len(streamed_sets[name]),
                streamed_gib=bench.streamed_bytes(streamed_sets[name]) / GiB,
                step_ms=statistics.median(walls[name]) * 1000,
                step_times_s=walls[name],
                waited_ms=statistics.median(waits[name]),
                shared_layers_ms=sum(statistics.median(uses[name][k]) for k in common_keys),
            )
        )
    base = rows[0]
    for row in rows:
        row["vs_resident"] = row["step_ms"] / base["step_ms"]
        row["extra_ms"] = row["step_ms"] - base["step_ms"]
        row["shared_vs_resident"] = row["shared_layers_ms"] / max(base["shared_layers_ms"], 1e-9)
    return rows, sorted(resident_everywhere), len(common_keys)


if __name__ == "__main__":
    main()
