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
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flux import FLUX_DEV, RESULTS, TINY, build_layers, gpu_details, make_inputs, train_step  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.planner import _patterns, predict_peak  # noqa: E402

GiB = 2**30


def timed_steps(layers, inputs, target, optimizer, swapper, device, count: int) -> list[float]:
    times = []
    for _ in range(count):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        train_step(layers, inputs, target, optimizer)
        swapper.step_stats(reset_peak=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def peaks(device) -> tuple[float, float]:
    if device.type != "cuda":
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated(device) / GiB, torch.cuda.max_memory_reserved(device) / GiB


def reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budgets", default="8,12,16,24")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--name", default="planner")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # broken backward on the lent H100 image
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg, side, text_tokens = (TINY, 8, 8) if args.tiny else (FLUX_DEV, 64, 512)
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.tiny:
        budgets = [0.002, 0.004]
    layers = build_layers(cfg, dtype, "cpu")
    inputs, target = make_inputs(cfg, side, text_tokens, device, dtype)
    trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    rows = []

    # all-resident reference, if it fits
    for layer in layers:
        layer.to(device)
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    reset(device)
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
    reset(device)

    for budget in budgets:
        lines: list[str] = []
        swapper = LayerSwapper(layers, SwapConfig(vram_budget_gb=budget), device=device, log=lines.append)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
        planning = timed_steps(layers, inputs, target, optimizer, swapper, device, 4)
        plan = swapper.autoplanner.plan
        profile_note = [line for line in lines if line.startswith("DGLS plan")]
        reset(device)
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
                    if predict_peak(sizes, profile, set(candidates) - set(_patterns(candidates, k)[pattern]), prefetch)
                    <= budget * GiB
                ]
                for k in sorted({max(fitting), max(max(fitting) - 1, 0)}) if fitting else []:
                    streamed = sorted(set(candidates) - set(_patterns(candidates, k)[pattern]))
                    swapper.apply_placement(streamed, prefetch)
                    reset(device)
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
                        )
                    )
                    print(json.dumps(rows[-1]), flush=True)
        swapper.remove()
        reset(device)

    result = {
        "config": "flux-dev" if not args.tiny else "tiny",
        "resident_s": resident_s,
        "rows": rows,
        **gpu_details(),
    }
    result["torch"] = torch.__version__
    result["cuda"] = torch.version.cuda
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{args.name}.md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    rows = result["rows"]
    resident = result["resident_s"]
    out = [
        f"VRAM-budget planner, Flux-dev-size LoRA step ({result.get('gpu', 'CPU')}, torch {result['torch']}): "
        "automatic plan vs the best fitting hand configuration of a grid (resident at both ends or spread, "
        "prefetch 1-3, largest fitting resident count and one fewer), same process, same inputs.",
        "",
        "| budget GiB | auto plan | auto step (s) | predicted (s) | best hand config | hand step (s) | "
        "auto / best hand | auto peak reserved GiB | auto fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for budget in sorted({r["budget_gib"] for r in rows if r["budget_gib"] is not None}):
        auto = next(r for r in rows if r["budget_gib"] == budget and r["method"] == "auto")
        hands = [r for r in rows if r["budget_gib"] == budget and r["method"] == "hand" and r["fits"]]
        best = min(hands, key=lambda r: r["step_s"]) if hands else None
        hand_text = (
            f"{best['pattern']}, {best['streamed']} streamed, prefetch {best['prefetch']}" if best else "none fits"
        )
        ratio = f"{auto['step_s'] / best['step_s']:.3f}" if best else "-"
        out.append(
            f"| {budget:g} | {auto['pattern']}, {auto['streamed']} streamed, prefetch {auto['prefetch']} | "
            f"{auto['step_s']:.3f} ({auto['step_s'] / resident:.2f}x resident) | {auto['predicted_s']:.3f} | "
            f"{hand_text} | {best['step_s'] if best else float('nan'):.3f} | {ratio} | "
            f"{auto['peak_reserved']:.2f} | {'yes' if auto['fits'] else 'NO'} |"
        )
    out += [
        "",
        f"all-resident step: {resident:.3f} s. Target: auto within 5% of the best hand config, never over budget.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
