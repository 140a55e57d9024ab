"""Transfer benchmark: copy efficiency and the engine options, measured side by side in one run.

Answers: do layer copies reach the pinned bandwidth; do ``threading`` and ``batch_move`` help;
do small layers do better packed or param by param (``selective_packing``); how deep to prefetch.
Writes benchmarks/results/transfer.json and transfer.md.

    python benchmarks/bench_transfer.py            # on a CUDA machine (a few minutes)
    python benchmarks/bench_transfer.py --tiny     # smoke test, CPU or GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pinned_bandwidth, results_dir  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402


class Block(nn.Module):
    """An MLP block with a LoRA-style trainable side path; ``pieces`` splits its weight in many params."""

    def __init__(self, dim: int, pieces: int) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(dim // pieces, dim) * dim**-0.5) for _ in range(pieces)])
        self.out = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)
        self.lora = nn.Linear(dim, 8, bias=False)

    def forward(self, x):
        h = F.gelu(torch.cat([F.linear(x, w) for w in self.ws], -1))
        return x + F.linear(h, self.out) + self.lora(x).sum(-1, keepdim=True)


def build(blocks: int, dim: int, pieces: int, dtype, device) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [Block(dim, pieces) for _ in range(blocks)]
    for layer in layers:
        layer.to(dtype)
        for name, p in layer.named_parameters():
            p.requires_grad_(name.startswith("lora"))
    return layers


def step(layers, x, ckpt=True):
    h = x
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=False) if ckpt else layer(h)
    h.float().pow(2).mean().backward()


def timed_steps(layers, x, steps: int, warmup: int, device) -> list[float]:
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(layers, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def run_config(name, cfg: SwapConfig | None, shape, x, args, device, dtype) -> dict:
    layers = build(*shape, dtype=dtype, device=device)
    swapper = None
    if cfg is None:
        for layer in layers:
            layer.to(device)
    else:
        swapper = LayerSwapper(layers, cfg, device=device, log=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = timed_steps(layers, x, args.steps, args.warmup, device)
    row = {"name": name, "median_step_s": statistics.median(times)}
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if swapper is not None:
        swapper.step_stats()
        step(layers, x)
        stats = swapper.step_stats()
        row.update(
            bytes_per_step=stats.bytes_moved,
            copy_gbps=stats.gbps,
            wait_ms=stats.wait_ms,
            hit_rate=stats.hit_rate,
            copies=stats.fetches,
        )
        swapper.remove()
    del layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--name", default="transfer")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        big, small, tokens, args.steps, args.warmup = (8, 256, 1), (8, 256, 32), 64, 2, 1
    else:
        big, small, tokens = (24, 4096, 1), (24, 4096, 64), 4096  # 24 x 64 MiB blocks; same bytes in 65 params
    x = torch.randn(tokens, big[1], device=device, dtype=dtype)
    rows = [run_config("resident", None, big, x, args, device, dtype)]
    streamed = big[0] - 2
    for prefetch in (1, 2, 4):
        for threading in (False, True):
            for batch in (False, True):
                on = {False: "off", True: "on"}
                name = f"prefetch={prefetch} threading={on[threading]} batch_move={on[batch]}"
                cfg = SwapConfig(blocks_to_swap=streamed, prefetch=prefetch, threading=threading, batch_move=batch)
                rows.append(run_config(name, cfg, big, x, args, device, dtype))
    for label, packing in (("65 params/layer, packed", 0.0), ("65 params/layer, param by param", 1e6)):
        cfg = SwapConfig(blocks_to_swap=streamed, prefetch=2, selective_packing=packing)
        rows.append(run_config(label, cfg, small, x, args, device, dtype))
    resident = rows[0]["median_step_s"]
    bandwidth = pinned_bandwidth(device, 1 << 30 if not args.tiny else 1 << 20)
    for row in rows:
        row["vs_resident"] = row["median_step_s"] / resident
        if bandwidth and row.get("copy_gbps"):
            row["copy_vs_pinned_bandwidth"] = row["copy_gbps"] / bandwidth
            # The step can't beat the larger of the compute and the time to move its bytes.
            row["floor_s"] = max(resident, row["bytes_per_step"] / bandwidth / 1e9)
            row["vs_floor"] = row["median_step_s"] / row["floor_s"]
    result = {
        "benchmark": "transfer",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pinned_h2d_gbps": bandwidth,
        "blocks": big[0],
        "block_mib": big[1] * big[1] * 2 * torch.finfo(dtype).bits / 8 / 2**20,
        "tokens": tokens,
        "steps": args.steps,
        "rows": rows,
    }
    out = results_dir(args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Transfer benchmark on {result['device']} (torch {result['torch']}, CUDA {result['cuda']}): "
        f"{big[0]} blocks of {result['block_mib']:.0f} MiB, {streamed} streamed, {tokens} tokens, "
        f"non-reentrant checkpointing; pinned host-to-device {bandwidth:.1f} GB/s (one 1 GiB copy).",
        "",
        "| configuration | step (ms) | vs resident | floor (ms) | vs floor | copy GB/s | copy / pinned "
        "| compute waited (ms) | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['median_step_s'] * 1000:.1f} | {r['vs_resident']:.2f}x | "
            f"{r.get('floor_s', 0) * 1000:.1f} | {r.get('vs_floor', 0):.2f}x | "
            f"{r.get('copy_gbps', 0):.1f} | {r.get('copy_vs_pinned_bandwidth', 0):.0%} | {r.get('wait_ms', 0):.1f} | "
            f"{r.get('peak_allocated_gib', 0):.2f} |"
        )
    lines += [
        "",
        "floor = max(resident step, bytes copied per step / pinned bandwidth). The last two rows use blocks "
        "made of 65 params (same bytes, slower compute): compare them with each other, not with resident.",
    ]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
