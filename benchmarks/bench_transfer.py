"""Transfer benchmark: copy efficiency and the engine options, measured side by side in one run.

Answers: do layer copies reach the pinned bandwidth; do ``threading`` and ``batch_move`` help;
do small layers do better packed or param by param (``selective_packing``); how deep to prefetch.
Writes benchmarks/results/transfer.json and transfer.md.

    python benchmarks/bench_transfer.py            # on a CUDA machine (a few minutes)
    python benchmarks/bench_transfer.py --tiny     # smoke test, CPU or GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import machine  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import peaks, reset_peaks, time_steps  # noqa: E402
from units import MiB  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.watching.stats import StepReader  # noqa: E402

NOTE = (
    "floor = max(resident step, bytes copied per step / pinned bandwidth). The last two rows use blocks made of "
    "65 params (same bytes, slower compute): compare them with each other, not with resident."
)


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


def step(layers: list[nn.Module], x: torch.Tensor) -> None:
    h = x
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=False)
    h.float().pow(2).mean().backward()


def run_config(name: str, cfg: SwapConfig | None, shape, x, args, device, dtype) -> dict:
    """One configuration's row: all-resident (``cfg`` None) or DGLS with ``cfg``, on fresh layers."""
    layers = build(*shape, dtype=dtype, device=device)
    swapper = None
    if cfg is None:
        for layer in layers:
            layer.to(device)
    else:
        swapper = LayerSwapper(layers, cfg, device=device, log=None)
    reset_peaks(device)
    times, _ = time_steps(partial(step, layers, x), device, args.warmup, args.steps)
    row = {"method": name, "median_step_s": statistics.median(times), **peaks(device)}
    if swapper is not None:
        reader = StepReader(swapper, sync=True)
        step(layers, x)
        stats = reader.end()
        row.update(
            bytes_per_step=stats.bytes_moved,
            copy_gbps=stats.gbps,
            wait_ms=stats.wait_ms,
            hit_rate=stats.hit_rate,
            copies=stats.fetches,
        )
        swapper.remove()
    del layers
    machine.release_host_cache()
    return row


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--name", default="transfer")
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    with machine.session(args.tiny) as (device, dtype):
        if args.tiny:
            big, small, tokens, args.steps, args.warmup = (8, 256, 1), (8, 256, 32), 64, 2, 1
        else:
            big, small, tokens = (24, 4096, 1), (24, 4096, 64), 4096  # 24 x 64 MiB blocks; same bytes in 65 params
        x = torch.randn(tokens, big[1], device=device, dtype=dtype)
        rows = [run_config("resident", None, big, x, args, device, dtype)]
        streamed = big[0] - 2
        on = {False: "off", True: "on"}
        for prefetch in (1, 2, 4):
            for threading in (False, True):
                for batch in (False, True):
                    name = f"prefetch={prefetch} threading={on[threading]} batch_move={on[batch]}"
                    cfg = SwapConfig.of(
                        blocks_to_swap=streamed, prefetch=prefetch, threading=threading, batch_move=batch
                    )
                    rows.append(run_config(name, cfg, big, x, args, device, dtype))
        for label, packing in (("65 params/layer, packed", 0.0), ("65 params/layer, param by param", 1e6)):
            cfg = SwapConfig.of(blocks_to_swap=streamed, prefetch=2, selective_packing=packing)
            rows.append(run_config(label, cfg, small, x, args, device, dtype))
        bandwidth = machine.pinned_bandwidth(device, 1 << 30 if not args.tiny else 1 << 20)
        derive(rows, bandwidth)
        block_mib = big[1] * big[1] * 2 * torch.finfo(dtype).bits / 8 / MiB
        result = {
            "benchmark": "transfer",
            "title": "Transfer benchmark",
            "description": (
                f"{big[0]} blocks of {block_mib:.0f} MiB, {streamed} streamed, {tokens} tokens, non-reentrant "
                f"checkpointing; pinned host-to-device {bandwidth:.1f} GB/s "
                f"(one {'1 MiB' if args.tiny else '1 GiB'} copy)."
                + (" TINY config (smoke test): the figures mean nothing." if args.tiny else "")
            ),
            "command": command_line(__file__, argv),
            "environment": machine.environment(device),
            "tiny": args.tiny,
            "notes": [NOTE],
            "pinned_h2d_gbps": bandwidth,
            "blocks": big[0],
            "block_mib": block_mib,
            "tokens": tokens,
            "steps": args.steps,
            "rows": rows,
        }
    write_result(result, args.name, args.results_dir or results_dir(args.tiny), echo=True)
    return result


def derive(rows: list[dict], bandwidth: float) -> None:
    """Each row against resident, and against its floor: the step can't beat the larger of the compute
    and the time to move its bytes."""
    resident = rows[0]["median_step_s"]
    for row in rows:
        row["vs_resident"] = row["median_step_s"] / resident
        if bandwidth and row.get("copy_gbps"):
            row["copy_share_of_pinned"] = row["copy_gbps"] / bandwidth
            row["floor_s"] = max(resident, row["bytes_per_step"] / bandwidth / 1e9)
            row["vs_floor"] = row["median_step_s"] / row["floor_s"]


if __name__ == "__main__":
    main()
