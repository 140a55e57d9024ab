"""VRAM-budget planner on the Flux-dev-size model: the automatic plan against a hand grid.

For each budget, DGLS plans from its probe steps (``vram_budget_gb``), then the same
swapper is switched (``apply_placement``) through a grid of hand configurations: resident
layers at both ends or spread evenly, prefetch 1-3, the largest resident count the
planner's memory model says fits (and one fewer). Every configuration is measured in this
one process on the same model and inputs; a configuration whose real peak goes over the
budget is marked as not fitting. Writes benchmarks/results/planner.{json,md}.

    python benchmarks/bench_planner.py                # H100: about 7 minutes
    python benchmarks/bench_planner.py --tiny         # smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flux import FLUX_DEV, TINY, build_layers, make_inputs, train_step  # noqa: E402
from common import environment, planner_trials, reset_peaks, results_dir, setup_device, streamed_by, time_steps  # noqa: E402
from common import peaks as common_peaks  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.planner import predict_peak  # noqa: E402

GiB = 2**30


def timed_steps(layers, inputs, target, optimizer, swapper, device, count: int) -> list[float]:
    """``count`` steps, each closed with the swapper's step (its peaks kept for the run's figure)."""

    def step() -> None:
        train_step(layers, inputs, target, optimizer)
        swapper.step_stats(reset_peak=False)

    return time_steps(step, device, 0, count)[0]


def peaks(device) -> tuple[float, float]:
    """Peak allocated and reserved GiB (0 on CPU)."""
    figures = common_peaks(device)
    return figures.get("peak_allocated_gib", 0.0), figures.get("peak_reserved_gib", 0.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budgets", default="8,12,16,24")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--name", default="planner")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds of auto vs the best hand config")
    parser.add_argument(
        "--from_log",
        type=Path,
        help="rebuild the results files from the JSON lines this benchmark printed (a run whose files were lost)",
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the other budgets' rows of an earlier run (one call per budget pair)"
    )
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    args.results_dir = args.results_dir or results_dir(args.tiny)
    if args.from_log:
        rows, env = rows_from_log(args.from_log)
        env["rebuilt_from_log"] = args.from_log.name
        kept = earlier_rows(args, sorted({r["budget_gib"] for r in rows if r["budget_gib"] is not None}))
        print(report(save(args, kept + rows, rows[0]["step_s"], env)))
        return
    print(json.dumps({"env": environment()}), flush=True)
    device, dtype = setup_device()  # (cuDNN attention off: its backward is broken on the lent H100 image)
    cfg, side, text_tokens = (TINY, 8, 8) if args.tiny else (FLUX_DEV, 64, 512)
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.tiny:
        budgets = [0.002, 0.004]
    kept = earlier_rows(args, budgets)
    layers = build_layers(cfg, dtype, device)  # random init on the GPU (minutes on the CPU), weights end on the CPU
    inputs, target = make_inputs(cfg, side, text_tokens, device, dtype)
    trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    rows = []

    # all-resident reference, if it fits
    for layer in layers:
        layer.to(device)
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    reset_peaks(device)
    from bench_flux import measure

    times = measure(layers, inputs, target, device, args.steps, args.warmup)
    resident_s = statistics.median(times)
    alloc, reserved = peaks(device)
    rows.append(
        dict(budget_gib=None, method="all-resident", step_s=resident_s, peak_alloc=alloc, peak_reserved=reserved)
    )
    print(json.dumps(rows[-1]), flush=True)
    for layer in layers:
        layer.to("cpu")
    reset_peaks(device)

    for budget in budgets:
        lines: list[str] = []
        swapper = LayerSwapper(layers, SwapConfig(vram_budget_gb=budget), device=device, log=lines.append)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
        planning = []
        while not swapper.autoplanner.done and len(planning) < 80:
            planning += timed_steps(layers, inputs, target, optimizer, swapper, device, 1)
        plan = swapper.autoplanner.plan
        trials = planner_trials(swapper.autoplanner)
        profile_note = [line for line in lines if line.startswith(("DGLS", "  "))]
        reset_peaks(device)
        times = timed_steps(layers, inputs, target, optimizer, swapper, device, args.warmup + args.steps)[args.warmup :]
        alloc, reserved = peaks(device)
        rows.append(
            dict(
                budget_gib=budget,
                method="auto",
                pattern=plan.pattern,
                streamed=len(plan.streamed),
                prefetch=plan.prefetch,
                predicted_s=plan.predicted_ms / 1000,
                step_s=statistics.median(times),
                planning_steps_s=planning,
                trials=trials,
                resident_s=resident_s,
                peak_alloc=alloc,
                peak_reserved=reserved,
                fits=reserved <= budget,
                replanned=swapper.autoplanner.replanned,
                log=profile_note,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        sizes = swapper.placement.sizes
        profile = swapper.autoplanner.profile
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
                    times = timed_steps(layers, inputs, target, optimizer, swapper, device, args.warmup + args.steps)
                    alloc, reserved = peaks(device)
                    rows.append(
                        dict(
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
                    )
                    print(json.dumps(rows[-1]), flush=True)
        interleave(args, rows, budget, plan, swapper, layers, inputs, target, optimizer, device)
        swapper.remove()
        reset_peaks(device)

        save(args, kept + rows, resident_s)  # after every budget: a run cut short keeps what it measured
    print(report(save(args, kept + rows, resident_s)))


def interleave(args, rows, budget, plan, swapper, layers, inputs, target, optimizer, device) -> None:
    """Auto against the best fitting hand config once more, alternating A/B/A/B/A/B in one stretch:
    step times here drift by 10% or more over minutes, more than the 5% being judged."""
    auto = next(r for r in rows if r["budget_gib"] == budget and r["method"] == "auto")
    hands = [r for r in rows if r["budget_gib"] == budget and r["method"] == "hand" and r["fits"]]
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
            times[name] += timed_steps(layers, inputs, target, optimizer, swapper, device, 1 + args.steps)[1:]
    auto["ab_auto_s"], auto["ab_hand_s"] = statistics.median(times["auto"]), statistics.median(times["hand"])
    auto["ab_hand"] = f"{best['pattern']}, {best['streamed']} streamed, prefetch {best['prefetch']}"
    auto["ab_ratio"] = auto["ab_auto_s"] / auto["ab_hand_s"]
    print(json.dumps({k: auto[k] for k in ("budget_gib", "ab_auto_s", "ab_hand_s", "ab_ratio", "ab_hand")}), flush=True)


def earlier_rows(args, budgets: list[float]) -> list[dict]:
    """With --merge: the rows of budgets this run does not measure, from the last results file."""
    earlier = args.results_dir / f"{args.name}.json"
    if not (args.merge and earlier.exists()):
        return []
    return [r for r in json.loads(earlier.read_text())["rows"] if r["budget_gib"] not in (None, *budgets)]


REPORT_HEADER = re.compile(r"^VRAM-budget planner, Flux-dev-size LoRA step \((.+), torch (\S+)\)")


def rows_from_log(path: Path) -> tuple[list[dict], dict]:
    """The rows (A/B figures merged into their auto row) and the environment a run printed.
    Runs before the ``env`` line existed name the GPU and torch in their report's first line."""
    rows: list[dict] = []
    env: dict = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "env" in record:
                env = record["env"]
            elif "method" in record:
                rows.append(record)
            elif "ab_ratio" in record:
                budget = record["budget_gib"]
                next(r for r in rows if r["budget_gib"] == budget and r["method"] == "auto").update(record)
        elif not env and (match := REPORT_HEADER.match(line)):
            env = {"gpu": match[1], "torch": match[2]}
    if not rows or rows[0]["method"] != "all-resident":
        raise SystemExit(f"{path}: no rows of this benchmark (the all-resident row comes first)")
    return rows, env


def save(args, rows: list[dict], resident_s: float, env: dict | None = None) -> dict:
    result = {"config": "flux-dev" if not args.tiny else "tiny", "resident_s": resident_s, "rows": rows}
    result.update(env if env is not None else environment())
    out = args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text(report(result))
    return result


def report(result: dict) -> str:
    rows = result["rows"]
    out = [
        f"VRAM-budget planner, Flux-dev-size LoRA step ({result.get('gpu', 'CPU')}, torch {result['torch']}): "
        "automatic plan vs the best fitting hand configuration of a grid (resident at both ends or spread, "
        "prefetch 1-3, largest fitting resident count and one fewer), same process, same inputs.",
        "",
        "| budget GiB | auto plan | predicted (s) | auto step (s) | best hand config (sweep) | hand step (s) | "
        "auto / hand (sweep) | auto / hand (A/B) | auto peak reserved GiB | highest trial peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for budget in sorted({r["budget_gib"] for r in rows if r["budget_gib"] is not None}):
        auto = next(r for r in rows if r["budget_gib"] == budget and r["method"] == "auto")
        hands = [r for r in rows if r["budget_gib"] == budget and r["method"] == "hand" and r["fits"]]
        best = min(hands, key=lambda r: r["step_s"]) if hands else None
        hand_text = (
            f"{best['pattern']}, {best['streamed']} streamed, prefetch {best['prefetch']}" if best else "none fits"
        )
        ratio = f"{auto['step_s'] / best['step_s']:.3f}" if best else "-"
        ab = (
            f"{auto['ab_ratio']:.3f} ({auto['ab_auto_s']:.3f} / {auto['ab_hand_s']:.3f} s)"
            if "ab_ratio" in auto
            else "-"
        )
        resident = auto.get("resident_s", result["resident_s"])  # measured in the same process as this budget
        trial_peak = max((t["peak_reserved_gib"] for t in auto.get("trials", [])), default=float("nan"))
        over = "" if auto["fits"] else " (OVER)"
        out.append(
            f"| {budget:g} | {auto['pattern']}, {auto['streamed']} streamed, prefetch {auto['prefetch']} | "
            f"{auto['predicted_s']:.3f} | {auto['step_s']:.3f} ({auto['step_s'] / resident:.2f}x resident) | "
            f"{hand_text} | {best['step_s'] if best else float('nan'):.3f} | {ratio} | {ab} | "
            f"{auto['peak_reserved']:.2f}{over} | {trial_peak:.2f} |"
        )
    out += [
        "",
        "Each budget's rows (and its all-resident reference) come from one process. "
        "A/B: the auto plan and the sweep's best hand config re-measured alternately in "
        "rounds right after the sweep (step times drift by 10% over minutes here). "
        "Target: auto within 5% of the best hand config, never over budget.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
