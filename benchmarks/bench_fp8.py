"""fp8 weight storage against bf16 storage and all-resident: Flux-dev-size LoRA step, side by side.

The model, inputs and step are bench_flux.py's (random bf16 weights, LoRA r16, non-reentrant
checkpointing per block, 4096 image + 512 text tokens). The same blocks stream (about 19 GiB
in bf16) with the host masters kept as bf16 or as fp8 (``cast_target bf16 f8_e4m3``: half the
bytes over PCIe, upcast to bf16 on the copy stream). Errors are measured against bf16 storage
(the exact weights) on one forward pass with the LoRA at its initial value: relative L2 error
of every block's output and of the loss. Writes benchmarks/results/<name>.json and .md.

    python benchmarks/bench_fp8.py            # H100: about 4 minutes
    python benchmarks/bench_fp8.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_flux  # noqa: E402
from common import results_dir  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402

GiB = bench_flux.GiB
FORMATS = {"e4m3": "f8_e4m3", "e5m2": "f8_e5m2"}


def probe(layers, inputs, target) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One forward without grad: every block's image-stream output (on the CPU) and the loss."""
    outputs = []
    with torch.no_grad():
        h = inputs
        for i, layer in enumerate(layers):
            h = layer(h)
            if 0 < i < len(layers) - 1:
                outputs.append(h[0].detach().to("cpu", copy=True))
        loss = F.mse_loss(h.float(), target.float()).cpu()
    return outputs, loss


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def errors(got, reference) -> dict:
    blocks = [rel_err(a, b) for a, b in zip(got[0], reference[0])]
    return {
        "loss_rel_err": abs(got[1].item() - reference[1].item()) / abs(reference[1].item()),
        "block_rel_err_mean": statistics.mean(blocks),
        "block_rel_err_max": max(blocks),
        "last_block_rel_err": blocks[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model: a smoke test (CPU or GPU)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--gib", type=float, default=19.0, help="stream about this many GiB (counted in bf16)")
    parser.add_argument("--formats", default="e4m3,e5m2", help="fp8 formats to try: e4m3, e5m2")
    parser.add_argument(
        "--pageable",
        type=int,
        default=1,
        help="also run bf16 and e4m3 storage with pageable masters (pinned_ram_budget_gb=0): a slow-link stand-in",
    )
    parser.add_argument("--name", default="fp8")
    parser.add_argument("--rewrite", action="store_true", help="re-render <name>.md from <name>.json")
    args = parser.parse_args()
    if args.rewrite:
        out = results_dir(args.tiny)
        write_reports(json.loads((out / f"{args.name}.json").read_text()), args.name, out)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # broken backward on the lent H100 image
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    source = "bf16" if dtype == torch.bfloat16 else "f32"
    cfg, side, text_tokens = (bench_flux.TINY, 8, 8) if args.tiny else (bench_flux.FLUX_DEV, 64, 512)

    t0 = time.perf_counter()
    layers = bench_flux.build_layers(cfg, dtype, device)
    build_s = time.perf_counter() - t0
    inputs, target = bench_flux.make_inputs(cfg, side, text_tokens, device, dtype)
    trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    lora_start = [p.detach().clone() for p in trainable]
    bandwidth = bench_flux.pinned_bandwidth(device)
    n = bench_flux.blocks_to_swap_for(layers, args.gib)
    rows: list[dict] = []
    probes: list = []  # one per row

    def reset():
        with torch.no_grad():
            for p, start in zip(trainable, lora_start):
                p.copy_(start)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    def record(name, times, extra):
        row = {"method": name, "median_step_s": statistics.median(times), "steps": len(times), **extra}
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GiB
        rows.append(row)
        print(json.dumps(row), flush=True)

    for layer in layers:
        layer.to(device)
    reset()
    resident_probe = probe(layers, inputs, target)
    times = bench_flux.measure(layers, inputs, target, device, args.steps, args.warmup)
    probes.append(resident_probe)
    record("all-resident", times, {"streamed_gib": 0.0})
    for layer in layers:
        layer.to("cpu")
    # remove() gives fp8-stored params back dequantized (lossy): keep the exact tensors to restore after each run.
    exact = [(p, p.data) for layer in layers for p in layer.parameters() if not p.requires_grad]

    runs = [("bf16 storage", SwapConfig(blocks_to_swap=n, prefetch=args.prefetch))]
    for fmt in (f for f in args.formats.split(",") if f):
        runs.append(
            (
                f"fp8 {fmt} storage",
                SwapConfig(blocks_to_swap=n, prefetch=args.prefetch, cast_target=[(source, FORMATS[fmt])]),
            )
        )
    if args.pageable:
        e4m3 = [(f"{label}, pageable", c.replace(pinned_ram_budget_gb=0.0)) for label, c in runs[:2]]
        runs += e4m3
    bf16_probe = None
    for label, swap_cfg in runs:
        reset()
        t0 = time.perf_counter()
        swapper = LayerSwapper(layers, swap_cfg, device=device, log=None)
        setup_s = time.perf_counter() - t0
        got = probe(layers, inputs, target)
        bf16_probe = bf16_probe or got
        steps, warmup = (args.steps, args.warmup) if "pageable" not in label else (max(2, args.steps // 2), 1)
        times = bench_flux.measure(layers, inputs, target, device, steps, warmup)
        swapper.step_stats()
        optimizer = torch.optim.AdamW(trainable, lr=0)
        bench_flux.train_step(layers, inputs, target, optimizer)
        stats = swapper.step_stats()
        extra = {
            "blocks_to_swap": n,
            "prefetch": args.prefetch,
            "cast_target": swap_cfg.cast_target,
            "streamed_gib": swapper.placement.streamed_bytes / GiB,
            "pool_gib": swapper.placement.pool_bytes / GiB,
            "landing_gib": swapper.placement.landing_bytes / GiB,
            "predicted_weights_pool_gib": swapper.placement.predicted_device_bytes / GiB,
            "pinned_gib": swapper.store.pinned_bytes / GiB,
            "pageable_layers": len(swapper.store.pageable_layers),
            "setup_s": setup_s,
            "bytes_per_step": stats.bytes_moved,
            "copy_gbps": stats.gbps,
            "wait_ms": stats.wait_ms,
            "hit_rate": stats.hit_rate,
        }
        probes.append(got)
        record(f"DGLS {label} (blocks_to_swap={n}, prefetch={args.prefetch})", times, extra)
        swapper.remove()
        for p, data in exact:
            p.data = data
    for row, got in zip(rows, probes):
        row.update(errors(got, bf16_probe))

    result = {
        "benchmark": "flux_dev_lora_step_fp8_storage",
        "config": cfg,
        "image_tokens": side * side,
        "text_tokens": text_tokens,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pinned_h2d_gbps": bandwidth,
        "model_build_s": build_s,
        **bench_flux.gpu_details(),
        "rows": rows,
    }
    write_reports(result, args.name, results_dir(args.tiny))


def write_reports(result: dict, name: str, out: Path) -> None:
    """JSON with every figure and a Markdown table."""
    rows = result["rows"]
    resident = next((r["median_step_s"] for r in rows if r["method"] == "all-resident"), None)
    bf16 = next((r["median_step_s"] for r in rows if "bf16 storage" in r["method"]), None)
    for r in rows:
        r["vs_resident"] = r["median_step_s"] / resident if resident else 0
        r["vs_bf16_storage"] = r["median_step_s"] / bf16 if bf16 else 0
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"fp8 weight storage, Flux-dev-size LoRA training step on {result.get('gpu', 'cpu')} "
        f"(PCIe gen {result.get('pcie_gen', '?')} x{result.get('pcie_width', '?')}, torch {result['torch']}): "
        f"{result['image_tokens']} image + {result['text_tokens']} text tokens, batch 1, LoRA r16, "
        f"non-reentrant checkpointing per block, random weights; pinned host-to-device "
        f"{result['pinned_h2d_gbps']:.1f} GB/s.",
        "",
        "| method | copied per pass GiB | step (s) | vs resident | vs bf16 storage | copied/step GiB | copy GB/s "
        "| compute waited (ms) | peak alloc GiB | loss rel err | block out rel err mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r.get('streamed_gib', 0):.1f} | {r['median_step_s']:.3f} | {r['vs_resident']:.2f}x "
            f"| {r['vs_bf16_storage']:.2f}x | {r.get('bytes_per_step', 0) / GiB:.1f} | {r.get('copy_gbps', 0):.1f} "
            f"| {r.get('wait_ms', 0):.0f} | {r.get('peak_allocated_gib', 0):.2f} | {r['loss_rel_err']:.2e} "
            f"| {r['block_rel_err_mean']:.2e} / {r['block_rel_err_max']:.2e} |"
        )
    lines += [
        "",
        "Errors are relative L2 errors against bf16 storage (the exact weights), on one forward pass with the "
        "LoRA at its initial value; 'block out' is each streamed or resident block's image-stream output. "
        "Copied per pass: bytes to fetch every streamed block once (fp8 halves bf16). 'pageable' rows keep the "
        "masters in pageable RAM (staged through pinned buffers: see their copy GB/s): a stand-in for a slower "
        "host link, where copies rather than compute set the step time.",
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
