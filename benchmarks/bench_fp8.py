"""fp8 weight storage against bf16 storage and all-resident: Flux-dev-size LoRA step, side by side.

The model, inputs and step are bench_models.py's Flux (flux.py). The same blocks stream (about 19
GiB in bf16) with the host masters kept as bf16 or as fp8 (``cast_target bf16 f8_e4m3``: half the
bytes over PCIe, upcast to bf16 on the copy stream). Errors are measured against bf16 storage (the
exact weights) on one forward pass with the LoRA at its initial value: relative L2 error of every
block's output and of the loss. Writes benchmarks/results/<name>.json and .md.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
from models import Bench, place  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import peaks, reset_peaks, time_steps  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.watching.stats import StepReader  # noqa: E402

FORMATS = {"e4m3": "f8_e4m3", "e5m2": "f8_e5m2"}
NOTE = (
    "Errors are relative L2 errors against bf16 storage (the exact weights), on one forward pass with the LoRA "
    "at its initial value; 'block out' is each block's image-stream output. Copied per pass: bytes to fetch "
    "every streamed block once (fp8 halves bf16). 'pageable' rows keep the masters in pageable RAM (staged "
    "through pinned buffers: see their copy GB/s): a stand-in for a slower host link, where copies rather "
    "than compute set the step time."
)
Probe = tuple[list[torch.Tensor], torch.Tensor]


def probe(bench: Bench) -> Probe:
    """One forward without grad: every block's image-stream output (on the CPU) and the loss."""
    outputs = []
    with torch.no_grad():
        h = bench.inputs
        for i, layer in enumerate(bench.layers):
            h = layer(h)
            if i in bench.blocks:
                outputs.append(h[0].detach().to("cpu", copy=True))
        loss = F.mse_loss(h.float(), bench.target.float()).cpu()
    return outputs, loss


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def errors(got: Probe, reference: Probe) -> dict:
    blocks = [rel_err(a, b) for a, b in zip(got[0], reference[0])]
    return {
        "loss_rel_err": abs(got[1].item() - reference[1].item()) / abs(reference[1].item()),
        "block_rel_err_mean": statistics.mean(blocks),
        "block_rel_err_max": max(blocks),
        "last_block_rel_err": blocks[-1],
    }


def storage_runs(args, blocks_to_swap: int, source: str) -> list[tuple[str, SwapConfig]]:
    """bf16 storage, each fp8 format, then (--pageable) bf16 and the first fp8 format with pageable masters."""
    base = SwapConfig.of(blocks_to_swap=blocks_to_swap, prefetch=args.prefetch)
    runs = [("bf16 storage", base)]
    for fmt in (f for f in args.formats.split(",") if f):
        runs.append((f"fp8 {fmt} storage", base.replace(cast_target=[(source, FORMATS[fmt])])))
    if args.pageable:
        runs += [(f"{label}, pageable", c.replace(pinned_ram_budget_gb=0.0)) for label, c in runs[:2]]
    return runs


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
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
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    with machine.session(args.tiny) as (device, dtype):
        return measure(args, device, dtype, command_line(__file__, argv))


def measure(args, device: torch.device, dtype: torch.dtype, command: str) -> dict:
    t0 = time.perf_counter()
    bench = flux.build(args.tiny, device, dtype)
    build_s = time.perf_counter() - t0
    trainable = [p for layer in bench.layers for p in layer.parameters() if p.requires_grad]
    lora_start = [p.detach().clone() for p in trainable]
    bandwidth = machine.pinned_bandwidth(device)
    # tiny: half the streamable bytes (its layers are KiB, not GiB)
    gib = sum(s.streamable_bytes for s in bench.sizes) / 2 / GiB if args.tiny else args.gib
    n = bench.blocks_to_swap_for_gib(gib)
    rows: list[dict] = []
    probes: list[Probe] = []

    def reset() -> None:
        with torch.no_grad():
            for p, start in zip(trainable, lora_start):
                p.copy_(start)
        reset_peaks(device)

    def record(name: str, times: list[float], extra: dict) -> None:
        row = {"method": name, "median_step_s": statistics.median(times), "steps": len(times), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    place(bench.layers, device)
    reset()
    probes.append(probe(bench))
    times, _ = time_steps(bench.training_step(), device, args.warmup, args.steps)
    record("all-resident", times, {"streamed_gib": 0.0, **peaks(device)})
    place(bench.layers, "cpu")
    # remove() gives fp8-stored params back dequantized (lossy): keep the exact tensors to restore after each run.
    exact = [(p, p.data) for layer in bench.layers for p in layer.parameters() if not p.requires_grad]
    source = "bf16" if dtype == torch.bfloat16 else "f32"
    for label, config in storage_runs(args, n, source):
        reset()
        t0 = time.perf_counter()
        with LayerSwapper(bench.layers, config, device=device, log=None) as swapper:
            setup_s = time.perf_counter() - t0
            probes.append(probe(bench))
            steps, warmup = (args.steps, args.warmup) if "pageable" not in label else (max(2, args.steps // 2), 1)
            times, stats = time_steps(bench.training_step(), device, warmup, steps, StepReader(swapper, sync=True).end)
            placement = swapper.placement
            extra = {
                "blocks_to_swap": n,
                "prefetch": args.prefetch,
                "cast_target": config.compute.cast_target,
                "streamed_gib": placement.streamed_bytes / GiB,
                "pool_gib": placement.pool_bytes / GiB,
                "landing_gib": placement.landing_bytes / GiB,
                "predicted_weights_pool_gib": placement.predicted_device_bytes / GiB,
                "pinned_gib": swapper.store.pinned_bytes / GiB,
                "pageable_layers": len(swapper.store.pageable_layers),
                "setup_s": setup_s,
                "bytes_per_step": statistics.median(s.bytes_moved for s in stats),
                "copy_gbps": statistics.median(s.gbps for s in stats),
                "wait_ms": statistics.median(s.wait_ms for s in stats),
                "hit_rate": min(s.hit_rate for s in stats),
                **peaks(device),
            }
        record(f"DGLS {label} (blocks_to_swap={n}, prefetch={args.prefetch})", times, extra)
        for p, data in exact:
            p.data = data
    resident = rows[0]["median_step_s"]
    bf16 = rows[1]["median_step_s"]
    for row, got in zip(rows, probes):
        row.update(errors(got, probes[1]), vs_resident=row["median_step_s"] / resident)
        row["vs_bf16_storage"] = row["median_step_s"] / bf16
    result = {
        "benchmark": "fp8",
        "title": "fp8 weight storage, Flux-dev-size LoRA training step",
        "description": (
            f"{bench.shape}, batch 1, LoRA r16, non-reentrant checkpointing per block, random weights; the same "
            f"{n} blocks streamed with their host masters stored as bf16 or as fp8; pinned host-to-device "
            f"{bandwidth:.1f} GB/s." + (" TINY config (smoke test): the figures mean nothing." if args.tiny else "")
        ),
        "command": command,
        "environment": machine.environment(device),
        "tiny": args.tiny,
        "notes": [NOTE],
        "shape": bench.shape,
        "config": bench.config,
        "dtype": str(dtype),
        "pinned_h2d_gbps": bandwidth,
        "model_build_s": build_s,
        "rows": rows,
    }
    write_result(result, args.name, args.results_dir or results_dir(args.tiny), echo=True)
    return result


if __name__ == "__main__":
    main()
