"""Probe (not a benchmark): what holds the device memory at the peak of one DGLS training step.

python benchmarks/probe_memory.py --model wan --latent_frames 21 --unit_mb 256 --out /tmp/out
python benchmarks/probe_memory.py --model wan --tiny --out /tmp/out  # the mechanics, on the CPU: no trace

Runs two warm-up steps with every block streamed and activation offload on (as ``bench_models.py``'s
``offload`` rows), then records the caching allocator's history over one more step
(``torch.cuda.memory._record_memory_history``) and replays it: the live blocks at the step's largest
allocated total, grouped by the first Python frame outside torch that allocated them, and the reserved
bytes then and at their own peak (the gap is fragmentation). Stacks are recorded for allocations only
(``context="alloc"``): with frees too, the checkpoint's early-stop exception, raised while the recorder
gathered a Python stack for a free, became a ``SystemError`` in torch 2.11. A block counts as free from
its free request on, as the allocator's own statistics count it (one freed with ``record_stream`` is
reused only after the side stream's work, which the ``pending`` line adds up at the peak).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import machine  # noqa: E402
from bench_models import BUILDERS  # noqa: E402
from models import place  # noqa: E402

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402

MiB = 2**20
OURS = ("diffusers", "utils/dgls", "benchmarks", "peft")


def site(frames: list[dict]) -> str:
    """The innermost frame in model or DGLS code (torch's own frames say little), with the torch op above it."""
    if not frames:  # allocated where no Python runs: the autograd engine's thread (the backward's own kernels)
        return "(no Python stack: autograd's backward)"
    for i, frame in enumerate(frames):
        name = frame["filename"]
        if any(part in name for part in OURS):
            above = frames[i - 1]["name"] if i else ""
            return f"{Path(name).name}:{frame['line']} {frame['name']} ({above})"
    return "(torch) " + (frames[0]["name"] if frames else "?")


def in_backward(frames: list[dict]) -> bool:
    """Under a recompute or a Python backward; an allocation with no Python stack is labelled by :func:`site`."""
    return any(f["name"] in ("unpack_hook", "recompute_fn", "backward") for f in frames)


def replay(before: dict, traces: list[dict]) -> list[str]:
    """The live blocks at the largest allocated total of ``traces``, starting from ``before``'s blocks."""
    live: dict[int, tuple[int, str]] = {}
    for segment in before["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = (block["size"], "(before the step)")
    total = sum(size for size, _ in live.values())
    reserved = sum(s["total_size"] for s in before["segments"])
    peak, peak_at, peak_reserved, reserved_at_peak = total, -1, reserved, reserved
    for i, event in enumerate(traces):
        action = event["action"]
        if action == "alloc":
            total += event["size"]
            if total > peak:
                peak, peak_at, reserved_at_peak = total, i, reserved
        elif action == "free_requested":
            total -= event["size"]
        elif action in ("segment_alloc", "segment_map"):
            reserved += event["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= event["size"]
    pending: dict[int, int] = {}
    for event in traces[: peak_at + 1]:
        if event["action"] == "alloc":
            frames = event["frames"]
            where = ("bwd " if in_backward(frames) or not frames else "fwd ") + site(frames)
            live[event["addr"]] = (event["size"], where)
        elif event["action"] == "free_requested":
            if live.pop(event["addr"], None) is not None:
                pending[event["addr"]] = event["size"]
        elif event["action"] == "free_completed":
            pending.pop(event["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in live.values():
        groups[where][0] += size
        groups[where][1] += 1
    lines = [
        f"peak allocated {peak / MiB:.0f} MiB (event {peak_at} of {len(traces)}), reserved then "
        f"{reserved_at_peak / MiB:.0f} MiB, peak reserved in the step {peak_reserved / MiB:.0f} MiB",
        f"freed but not yet reusable then (waiting for another stream): {sum(pending.values()) / MiB:.0f} MiB",
        "live at the peak, by allocation site:",
    ]
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        if size >= MiB:
            lines.append(f"  {size / MiB:9.0f} MiB  {count:4d}x  {where}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan", choices=list(BUILDERS))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--latent_frames", type=int, default=3)
    p.add_argument("--unit_mb", type=float, default=0.0)
    p.add_argument("--checkpoint_units", action="store_true")
    p.add_argument("--offload_recompute", action="store_true")
    p.add_argument("--keep_piece_outputs", action="store_true")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with machine.session(args.tiny) as (device, dtype):
        bench = BUILDERS[args.model](args.tiny, device, dtype, args)
        place(bench.layers, device)
        config = SwapConfig.of(
            blocks_to_swap=len(bench.blocks),
            prefetch=args.prefetch,
            offload_activations=True,
            offload_recompute=args.offload_recompute,
            swap_unit_mb=args.unit_mb,
            checkpoint_units=args.checkpoint_units,
            keep_piece_outputs=args.keep_piece_outputs,
        )
        with LayerSwapper(bench.layers, config, device, log=None) as swapper:
            ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
            step = bench.training_step(checkpoint_fn=ckpt)
            step()
            step()  # recompute offload measures in the first step and sends from the second
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()  # the weights' device copies from before the swapper took them
                torch.cuda.reset_peak_memory_stats(device)
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
                before = torch.cuda.memory._snapshot()
            step()
            if not cuda:
                print("CPU: one step ran; no allocator trace")
                return
            torch.cuda.synchronize(device)
            after = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            lines = [
                f"{bench.title}: {bench.shape}; unit_mb {args.unit_mb:g}, checkpoint_units {args.checkpoint_units}, "
                f"offload_recompute {args.offload_recompute}, keep_piece_outputs {args.keep_piece_outputs}",
                f"max_memory_allocated {torch.cuda.max_memory_allocated(device) / MiB:.0f} MiB, "
                f"max_memory_reserved {torch.cuda.max_memory_reserved(device) / MiB:.0f} MiB",
                *replay(before, after["device_traces"][device.index or 0]),
            ]
    text = "\n".join(lines)
    print(text)
    tag = f"{args.model}{args.latent_frames}_u{args.unit_mb:g}{'_cu' if args.checkpoint_units else ''}"
    tag += ("_rc" if args.offload_recompute else "") + ("_keep" if args.keep_piece_outputs else "")
    (args.out / f"probe_memory_{tag}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
