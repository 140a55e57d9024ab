"""VRAM-budget planner on the Flux-dev-size model: the automatic plan against a hand grid.

For each budget, DGLS plans from its probe steps (``vram_budget``), then the same swapper is
switched (``apply_placement``) through a grid of hand configurations: resident layers at both ends
or spread evenly, prefetch 1-3, the largest resident count the planner's memory model says fits
(and one fewer). Every configuration is measured in this one process on the same model and inputs;
a configuration whose real peak goes over the budget is marked as not fitting. Four budgets take
more than one 10-minute device call: run two per call, the second with --merge.

    python benchmarks/bench_planner.py --budgets 8,12                 # H100: about 7 minutes
    python benchmarks/bench_planner.py --budgets 16,24 --merge        # keeps the 8 and 12 GiB rows
    python benchmarks/bench_planner.py --tiny                         # smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
from methods import planner_trials  # noqa: E402
from models import Bench, place, streamed_by  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import peaks, reset_peaks, time_steps  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.planning.planner import predict_peak  # noqa: E402

NOTE = (
    "Each budget's rows (and its all-resident reference) come from one process. A/B: the auto plan and the "
    "sweep's best hand config re-measured alternately in rounds right after the sweep (step times drift by "
    "10% over minutes on the lent H100)."
)


class Measure:
    """Steps of one bench, each closed with the swapper's step (its peaks kept for the run's figure)."""

    def __init__(self, bench: Bench, device: torch.device) -> None:
        self.bench, self.device = bench, device
        self.step = bench.training_step()

    def times(self, swapper: LayerSwapper | None, count: int) -> list[float]:
        return time_steps(self.step, self.device, 0, count)[0]

    def peaks(self) -> tuple[float, float]:
        """Peak allocated and reserved GiB since the last reset (0 on CPU)."""
        figures = peaks(self.device)
        return figures.get("peak_allocated_gib", 0.0), figures.get("peak_reserved_gib", 0.0)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budgets", default="8,12,16,24")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--name", default="planner")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds of auto vs the best hand config")
    parser.add_argument(
        "--merge", action="store_true", help="keep the other budgets' rows of an earlier run (one call per budget pair)"
    )
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    args.results_dir = args.results_dir or results_dir(args.tiny)
    with machine.session(args.tiny) as (device, dtype):
        bench = flux.build(args.tiny, device, dtype)  # random init on the device, then the weights go to the CPU
        tight = bench.tight_budget_gib()
        budgets = [tight, 1.5 * tight] if args.tiny else [float(b) for b in args.budgets.split(",")]
        earlier = earlier_result(args, budgets)
        measure = Measure(bench, device)
        place(bench.layers, device)  # the all-resident reference
        reset_peaks(device)
        resident_s = statistics.median(measure.times(None, args.warmup + args.steps)[args.warmup :])
        alloc, reserved = measure.peaks()
        rows = [
            dict(budget_gib=None, method="all-resident", step_s=resident_s, peak_alloc=alloc, peak_reserved=reserved)
        ]
        print(json.dumps(rows[-1]), flush=True)
        place(bench.layers, "cpu")
        reset_peaks(device)
        command = command_line(__file__, argv)
        if earlier is not None:
            command = f"{earlier['command']} && {command}"
        kept = earlier["rows"] if earlier is not None else []

        def save() -> dict:  # after every budget: a run cut short keeps what it measured
            result = {
                "benchmark": "planner",
                "title": "VRAM-budget planner, Flux-dev-size LoRA step",
                "description": (
                    "automatic plan vs the best fitting hand configuration of a grid (resident at both ends or "
                    "spread, prefetch 1-3, largest fitting resident count and one fewer), same process, same inputs."
                    + (" TINY config (smoke test): the figures mean nothing." if args.tiny else "")
                ),
                "command": command,
                "environment": machine.environment(device),
                "tiny": args.tiny,
                "notes": [NOTE],
                "config": "tiny" if args.tiny else "flux-dev",
                "resident_s": resident_s,
                "rows": rows[:1] + kept + rows[1:],
            }
            result["budgets"] = summarize(result["rows"], resident_s)
            write_result(result, args.name, args.results_dir, echo=True)
            return result

        for budget in budgets:
            rows += plan_and_sweep(bench, measure, args, budget, resident_s)
            result = save()
    return result


def plan_and_sweep(bench: Bench, measure: Measure, args, budget: float, resident_s: float) -> list[dict]:
    """The auto plan at ``budget``, the hand grid, and the A/B of auto against the best fitting hand row."""
    device = measure.device
    lines: list[str] = []
    rows = []
    with LayerSwapper(bench.layers, SwapConfig.of(vram_budget=budget), device=device, log=lines.append) as swapper:
        planner = swapper.driver
        planning = []
        while not planner.done and len(planning) < 80:
            planning += measure.times(swapper, 1)
        plan = planner.plan
        reset_peaks(device)
        times = measure.times(swapper, args.warmup + args.steps)[args.warmup :]
        alloc, reserved = measure.peaks()
        auto = dict(
            budget_gib=budget,
            method="auto",
            pattern=plan.pattern,
            streamed=len(plan.streamed),
            prefetch=plan.prefetch,
            predicted_s=plan.predicted_ms / 1000,
            step_s=statistics.median(times),
            planning_steps_s=planning,
            trials=planner_trials(planner),
            resident_s=resident_s,
            peak_alloc=alloc,
            peak_reserved=reserved,
            fits=reserved <= budget,
            replanned=planner.replanned,
            log=[line for line in lines if line.startswith(("DGLS", "  "))],
        )
        rows.append(auto)
        print(json.dumps(auto), flush=True)
        sizes, profile = swapper.placement.sizes, planner.profile
        candidates = [s.index for s in sizes if s.streamable_bytes]
        for prefetch in (1, 2, 3):
            for pattern in ("ends", "spread"):
                fitting = [
                    k
                    for k in range(len(candidates) + 1)
                    if predict_peak(sizes, profile, streamed_by(candidates, k, pattern), prefetch) <= budget * GiB
                ]
                for k in sorted({max(fitting), max(max(fitting) - 1, 0)}) if fitting else []:
                    streamed = sorted(streamed_by(candidates, k, pattern))
                    swapper.apply_placement(streamed, prefetch)
                    reset_peaks(device)
                    times = measure.times(swapper, args.warmup + args.steps)
                    alloc, reserved = measure.peaks()
                    hand = dict(
                        budget_gib=budget,
                        method="hand",
                        pattern=pattern,
                        streamed=len(streamed),
                        prefetch=prefetch,
                        step_s=statistics.median(times[args.warmup :]),
                        peak_alloc=alloc,
                        peak_reserved=reserved,
                        fits=reserved <= budget,
                        layers=streamed,
                    )
                    rows.append(hand)
                    print(json.dumps(hand), flush=True)
        interleave(args, rows, plan, swapper, measure)
    reset_peaks(device)
    return rows


def interleave(args, rows: list[dict], plan, swapper: LayerSwapper, measure: Measure) -> None:
    """Auto against the best fitting hand config once more, alternating A/B/A/B/A/B in one stretch:
    step times drift by 10% or more over minutes, more than near-equal plans differ."""
    auto = rows[0]
    hands = [r for r in rows if r["method"] == "hand" and r["fits"]]
    if not hands:
        return
    best = min(hands, key=lambda r: r["step_s"])
    times: dict[str, list[float]] = {"auto": [], "hand": []}
    for _ in range(args.rounds):
        for name, streamed, prefetch in (
            ("auto", plan.streamed, plan.prefetch),
            ("hand", best["layers"], best["prefetch"]),
        ):
            swapper.apply_placement(streamed, prefetch)
            times[name] += measure.times(swapper, 1 + args.steps)[1:]
    auto["ab_auto_s"], auto["ab_hand_s"] = statistics.median(times["auto"]), statistics.median(times["hand"])
    auto["ab_hand"] = f"{best['pattern']}, {best['streamed']} streamed, prefetch {best['prefetch']}"
    auto["ab_ratio"] = auto["ab_auto_s"] / auto["ab_hand_s"]
    print(json.dumps({k: auto[k] for k in ("budget_gib", "ab_auto_s", "ab_hand_s", "ab_ratio", "ab_hand")}), flush=True)


def earlier_result(args, budgets: list[float]) -> dict | None:
    """With --merge: the last results file, its rows less its all-resident reference and the budgets this
    run measures again (each budget's auto row keeps the resident step of its own process)."""
    earlier = args.results_dir / f"{args.name}.json"
    if not (args.merge and earlier.exists()):
        return None
    result = json.loads(earlier.read_text())
    result["rows"] = [r for r in result["rows"] if r["budget_gib"] not in (None, *budgets)]
    return result


def summarize(rows: list[dict], resident_s: float) -> list[dict]:
    """A line per budget: the auto plan, the best fitting hand config of the sweep, and their A/B."""
    out = []
    for budget in sorted({r["budget_gib"] for r in rows if r["budget_gib"] is not None}):
        auto = next(r for r in rows if r["budget_gib"] == budget and r["method"] == "auto")
        hands = [r for r in rows if r["budget_gib"] == budget and r["method"] == "hand" and r["fits"]]
        best = min(hands, key=lambda r: r["step_s"], default=None)
        trial_peaks = [t["peak_reserved_gib"] for t in auto.get("trials", [])]
        out.append(
            {
                "budget_gib": budget,
                "auto_plan": f"{auto['pattern']}, {auto['streamed']} streamed, prefetch {auto['prefetch']}",
                "predicted_s": auto["predicted_s"],
                "step_s": auto["step_s"],
                "vs_resident": auto["step_s"] / auto.get("resident_s", resident_s),  # resident of its own process
                "best_hand": (
                    f"{best['pattern']}, {best['streamed']} streamed, prefetch {best['prefetch']}"
                    if best
                    else "none fits"
                ),
                "hand_step_s": best["step_s"] if best else None,
                "auto_vs_hand": auto["step_s"] / best["step_s"] if best else None,
                "ab_ratio": auto.get("ab_ratio"),
                "ab_auto_s": auto.get("ab_auto_s"),
                "ab_hand_s": auto.get("ab_hand_s"),
                "peak_reserved_gib": auto["peak_reserved"],
                "fits": auto["fits"],
                "highest_trial_peak_gib": max(trial_peaks, default=None),
            }
        )
    return out


if __name__ == "__main__":
    main()
