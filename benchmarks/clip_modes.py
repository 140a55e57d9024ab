"""The loss curve of a full fine-tune under exact clipping and under ``clip_mode previous_norm`` (opt-in, inexact:
utils/dgls/training/previous_norm.py), side by side, on the CPU.

The built-in demo model (utils/dgls/demo, a small Flux-like stack) trains every weight with DGLS streaming its middle
layers (host AdamW, or SGD with momentum), on the demo's synthetic flow-matching data, the same batches in every run.
Two clipping limits, each a quantile of the gradient norms of an unclipped pilot run of the same length: one that
clips most steps (``--clips_most``, default its 10th percentile) and one that rarely clips (``--clips_rarely``, its
95th). For each limit, exact clipping and previous_norm train from the same start; the table gives the share of
steps that clipped, the mean loss over every step and over the last tenth, their differences, the largest
difference of the smoothed curves, and how far the final weights of the two modes are apart relative to how far
exact training moved them.

    python benchmarks/clip_modes.py [--steps 300] [--optimizers adamw,sgd] [--tiny]

Writes benchmarks/results/clip_modes.json, .md and (with matplotlib) .png (results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import machine  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.demo.data import SyntheticLatents  # noqa: E402
from utils.dgls.demo.model import DemoModelConfig, build_layers  # noqa: E402
from utils.dgls.training.host_optimizer import HostOptimizerSpec  # noqa: E402

CPU = torch.device("cpu")
MODEL = DemoModelConfig(hidden=64, heads=4, double_blocks=2, single_blocks=3, text_dim=32, latent_channels=8)
TINY_MODEL = DemoModelConfig(hidden=16, heads=2, double_blocks=1, single_blocks=1, text_dim=8, latent_channels=4)
OPTIMIZERS = {
    "adamw": HostOptimizerSpec(type="adamw", lr=1e-3, weight_decay=0.01, implementation="torch_fused"),
    "sgd": HostOptimizerSpec(type="sgd", lr=2e-2, momentum=0.9, weight_decay=0.01, implementation="torch"),
}
MODES = ("exact", "previous_norm")
SMOOTH = 20  # steps in the moving average the largest curve difference is read from


def _data(cfg: DemoModelConfig, tiny: bool):
    data = SyntheticLatents(cfg, samples=8 if tiny else 32, image_tokens=8 if tiny else 32, text_tokens=4, seed=3)
    return data.batches(2 if tiny else 4, torch.float32, CPU)


def train(cfg: DemoModelConfig, spec: HostOptimizerSpec, steps: int, limit: float | None, mode: str, tiny: bool):
    """One run: per-step losses and gradient norms, the final weights (the masters), and seconds. ``limit`` None: no
    clipping."""
    layers = build_layers(cfg, seed=0)
    for layer in layers:
        layer.requires_grad_(True)
    params = [p for layer in layers for p in layer.parameters()]
    settings = dict(host_optimizer=spec, accumulation_steps=1, prefetch=1, clip_grads=limit is not None)
    if limit is not None:
        settings["clip_mode"] = mode
    batches = _data(cfg, tiny)
    losses, norms = [], []
    began = time.perf_counter()
    with LayerSwapper(layers, SwapConfig.of(**settings), device=CPU, log=_quiet) as swapper:
        training = swapper.training
        resident = [p for p in params if not training.owns(p)]
        trainer = spec.build(resident) if resident else None
        for _ in range(steps):
            inputs, target = next(batches)
            h = inputs
            for layer in layers:
                h = layer(h)
            loss = F.mse_loss(h.float(), target.float())
            loss.backward()
            losses.append(float(loss.detach()))
            if limit is not None:
                norms.append(float(training.clip_grad_norm_(params, limit)))
            if trainer is not None:
                trainer.step()
                trainer.zero_grad(set_to_none=True)
            training.step()
        training.finish()
        weights = torch.cat([training.master_of(p).detach().flatten() if training.owns(p) else p.detach().flatten()
                             for p in params]).clone()  # fmt: skip
    return {"losses": losses, "norms": norms, "weights": weights, "seconds": time.perf_counter() - began}


def _quiet(line: str) -> None:
    """The swapper's start-up lines, not printed (one set a run)."""


def _smoothed(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - SMOOTH] if i >= SMOOTH else 0.0)
        out.append(total / min(i + 1, SMOOTH))
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def compare(exact: dict, delayed: dict, start: torch.Tensor, limit: float) -> dict:
    """The figures of one limit: previous_norm against exact."""
    last = max(1, len(exact["losses"]) // 10)
    a, b = exact["losses"], delayed["losses"]
    smooth_a, smooth_b = _smoothed(a), _smoothed(b)
    moved = float((exact["weights"] - start).norm())
    return {
        "clipped_share": sum(n > limit for n in exact["norms"]) / len(exact["norms"]),
        "clipped_share_previous_norm": sum(n > limit for n in delayed["norms"]) / len(delayed["norms"]),
        "mean_loss_exact": statistics.fmean(a),
        "mean_loss_previous_norm": statistics.fmean(b),
        "final_loss_exact": statistics.fmean(a[-last:]),
        "final_loss_previous_norm": statistics.fmean(b[-last:]),
        "mean_loss_diff": statistics.fmean(b) - statistics.fmean(a),
        "final_loss_diff": statistics.fmean(b[-last:]) - statistics.fmean(a[-last:]),
        "final_loss_rel_diff": (statistics.fmean(b[-last:]) - statistics.fmean(a[-last:]))
        / statistics.fmean(a[-last:]),
        "max_smoothed_rel_diff": max(abs(y - x) / x for x, y in zip(smooth_a, smooth_b)),
        "weights_apart_rel": float((delayed["weights"] - exact["weights"]).norm()) / moved if moved else 0.0,
        "median_norm": statistics.median(exact["norms"]),
    }


def plot(result: dict, curves: dict, path: Path) -> bool:
    """The smoothed loss curves of each optimizer and limit, exact and previous_norm; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = list(curves)
    columns = min(2, len(keys))
    rows = -(-len(keys) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for mode, style in zip(MODES, ("-", "--")):
            ax.plot(_smoothed(curves[key][mode]), style, label=mode, linewidth=1)
        ax.set_yscale("log")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss ({SMOOTH}-step mean)")
        ax.legend(fontsize=7)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--optimizers", default="adamw,sgd", help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--clips_most", type=float, default=0.10, help="limit: this quantile of the pilot's norms")
    parser.add_argument("--clips_rarely", type=float, default=0.95, help="limit: this quantile of the pilot's norms")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: a tiny model, results/tiny/")
    parser.add_argument("--results_dir", type=Path, default=None)
    parser.add_argument("--name", default="clip_modes")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = TINY_MODEL if args.tiny else MODEL
    rows, curves = [], {}
    for name in args.optimizers.split(","):
        spec = OPTIMIZERS[name]
        start = torch.cat([p.detach().flatten() for layer in build_layers(cfg, seed=0) for p in layer.parameters()])
        pilot = train(cfg, spec, args.steps, float("inf"), "exact", args.tiny)  # its norms; it never clips
        for label, q in (("clips most steps", args.clips_most), ("clips rarely", args.clips_rarely)):
            limit = _quantile(pilot["norms"], q)
            runs = {mode: train(cfg, spec, args.steps, limit, mode, args.tiny) for mode in MODES}
            row = {"method": f"{name}, {label}", "optimizer": name, "limit": limit, "quantile": q}
            row.update(compare(runs["exact"], runs["previous_norm"], start, limit))
            last = max(1, args.steps // 10)  # context: what clipping itself changes, the unclipped run against exact
            unclipped = statistics.fmean(pilot["losses"][-last:])
            row["unclipped_final_rel_diff"] = (unclipped - row["final_loss_exact"]) / row["final_loss_exact"]
            row["seconds"] = {mode: runs[mode]["seconds"] for mode in MODES}
            row["losses"] = {mode: runs[mode]["losses"] for mode in MODES}
            rows.append(row)
            curves[f"{name}, {label} (limit {limit:.3g})"] = row["losses"]
    result = {
        "benchmark": "clip_modes",
        "title": "Loss curves: exact clipping vs clip_mode previous_norm" + (" (tiny)" if args.tiny else ""),
        "description": (
            f"the demo model ({start.numel()} params, "
            f"{len(build_layers(cfg))} layers, the middle ones streamed), {args.steps} steps of batch "
            f"{2 if args.tiny else 4}, every weight trained; the limits are quantiles of an unclipped run's norms"
        ),
        "environment": machine.environment(CPU),
        "tiny": args.tiny,
        "steps": args.steps,
        "rows": rows,
        "notes": [
            "'clipped': the share of steps whose norm exceeded the limit (exact / previous_norm runs). 'loss diff': "
            "previous_norm minus exact, of the mean over every step and over the last tenth ('final'), relative to "
            f"exact's. 'max curve diff': the largest relative gap of the {SMOOTH}-step moving averages. 'weights "
            "apart': the distance of the two runs' final weights over the distance exact training moved them. 'no "
            "clipping': the final loss of the unclipped run (the limits' pilot) against exact clipping's, for scale. "
            "Every run sees the same batches; step 1 is exact in both modes."
        ],
        "command": command_line(__file__, argv if argv is not None else sys.argv[1:]),
    }
    out = args.results_dir or results_dir(args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    plot(result, curves, out / f"{args.name}.png")
    write_result(result, args.name, out, plot_it=False, echo=True)
    return result


if __name__ == "__main__":
    main()
