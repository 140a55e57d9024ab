"""Flux-dev-size training step: DGLS against all-resident and a naive synchronous swap, side by side.

diffusers' FluxTransformer2DModel built from its config (19 double + 38 single blocks, hidden
3072; random bf16 weights, no download), LoRA rank 16 on the blocks' Linear layers,
non-reentrant checkpointing per block, 1024x1024 (4096 image + 512 text tokens), batch 1.
Every method runs in this one process on the same model and inputs. Writes
benchmarks/results/<name>.json, .md and (with matplotlib) .png.

    python benchmarks/bench_flux.py                 # H100: a few minutes
    python benchmarks/bench_flux.py --tiny          # smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)


class Embed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.pos_embed = model.time_text_embed, model.pos_embed

    def forward(self, inputs):
        latents, text, pooled, t, guidance, img_ids, txt_ids = inputs
        h = self.x_embedder(latents)
        temb = self.time_text_embed(t.to(h.dtype) * 1000, guidance.to(h.dtype) * 1000, pooled)
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), 0))
        return h, self.context_embedder(text), temb, cos, sin


class Block(nn.Module):
    """One double or single block; both take and return the two streams in diffusers >= 0.35."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        h, e, temb, cos, sin = inputs
        e, h = self.block(hidden_states=h, encoder_hidden_states=e, temb=temb, image_rotary_emb=(cos, sin))
        return h, e, temb, cos, sin


class Final(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, inputs):
        h, _e, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(h, temb))


def build_layers(cfg: dict, dtype, init_device) -> list[nn.Module]:
    """The model as a diffusion-pipe-style layer list, random weights, on the CPU."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model

    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    layers = [
        Embed(model),
        *(Block(b) for b in model.transformer_blocks),
        *(Block(b) for b in model.single_transformer_blocks),
        Final(model),
    ]
    g = torch.Generator(device=init_device).manual_seed(0)
    for layer in layers:
        layer.to_empty(device=init_device)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if p.ndim >= 2:
                    p.normal_(0, 0.02, generator=g)
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.zero_()
        layer.to("cpu", dtype).requires_grad_(False)
    for layer in layers[1:-1]:
        names = sorted({n for n, m in layer.named_modules() if isinstance(m, nn.Linear)})
        inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=names), layer)
    for layer in layers:
        for name, p in layer.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(dtype)
                p.requires_grad_(True)
    return layers


def make_inputs(cfg: dict, image_tokens_side: int, text_tokens: int, device, dtype):
    g = torch.Generator().manual_seed(1)
    n = image_tokens_side**2
    latents = torch.randn(1, n, cfg["in_channels"], generator=g)
    text = torch.randn(1, text_tokens, cfg["joint_attention_dim"], generator=g)
    pooled = torch.randn(1, cfg["pooled_projection_dim"], generator=g)
    rows, cols = torch.meshgrid(torch.arange(image_tokens_side), torch.arange(image_tokens_side), indexing="ij")
    img_ids = torch.stack([torch.zeros(n), rows.flatten().float(), cols.flatten().float()], -1)
    txt_ids = torch.zeros(text_tokens, 3)
    target = torch.randn(1, n, cfg["in_channels"], generator=g)
    inputs = (
        latents.to(device, dtype),
        text.to(device, dtype),
        pooled.to(device, dtype),
        torch.tensor([0.5], device=device),
        torch.tensor([1.0], device=device),
        img_ids.to(device),
        txt_ids.to(device),
    )
    return inputs, target.to(device, dtype)


def train_step(layers, inputs, target, optimizer):
    h = inputs
    for i, layer in enumerate(layers):
        h = checkpoint(layer, h, use_reentrant=False) if 0 < i < len(layers) - 1 else layer(h)
    F.mse_loss(h.float(), target.float()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class NaiveSwap:
    """The lower bound: move a block's frozen weights in with .to() before it runs, out after."""

    def __init__(self, layers, streamed, device):
        self.handles = []
        for i in streamed:
            frozen = [p for p in layers[i].parameters() if not p.requires_grad]
            self.handles.append(layers[i].register_forward_pre_hook(lambda m, a, f=frozen: self.move(f, device)))
            self.handles.append(layers[i].register_forward_hook(lambda m, a, o, f=frozen: self.move(f, "cpu")))
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                if i not in streamed or p.requires_grad:
                    p.data = p.data.to(device)

    @staticmethod
    def move(params, device):
        for p in params:
            p.data = p.data.to(device)

    def remove(self, layers):
        for h in self.handles:
            h.remove()
        for layer in layers:
            layer.to("cpu")


def measure(layers, inputs, target, device, steps, warmup) -> list[float]:
    optimizer = torch.optim.AdamW([p for layer in layers for p in layer.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        train_step(layers, inputs, target, optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def pinned_bandwidth(device) -> float:
    if device.type != "cuda":
        return 0.0
    n = GiB
    host, dev = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(n / a.elapsed_time(b) / 1e6)
    return statistics.median(rates[1:])


def blocks_to_swap_for(layers, gib: float) -> int:
    """The blocks_to_swap whose streamed bytes come closest to ``gib``."""
    probe = SwapConfig(blocks_to_swap=0)
    from utils.dgls.placement import plan_placement

    sizes = plan_placement(layers, probe).sizes
    candidates = sum(1 for s in sizes if s.streamable_bytes)
    best = min(
        range(candidates + 1),
        key=lambda n: abs(plan_placement(layers, probe.replace(blocks_to_swap=n)).streamed_bytes / GiB - gib),
    )
    return best


def gpu_details() -> dict:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        name, gen, width, driver = (x.strip() for x in out.stdout.strip().split(","))
        return {"gpu": name, "pcie_gen": gen, "pcie_width": width, "driver": driver}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU/GPU: a smoke test")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--methods", default="all", help="comma list: resident,dgls,naive,options or all")
    parser.add_argument("--shares", default="0,0.25,0.5,0.75,1", help="shares of blocks streamed")
    parser.add_argument("--gib", default="9.6,19", help="also stream about this many GiB")
    parser.add_argument("--name", default="flux_dev")
    parser.add_argument("--rewrite", action="store_true", help="re-render <name>.md/.png from <name>.json")
    args = parser.parse_args()
    if args.rewrite:
        write_reports(json.loads((RESULTS / f"{args.name}.json").read_text()), args.name)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # broken backward on the lent H100 image
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg, side, text_tokens = (TINY, 8, 8) if args.tiny else (FLUX_DEV, 64, 512)
    methods = {"resident", "dgls", "naive"} if args.methods == "all" else set(args.methods.split(","))
    options = []
    if "options" in methods:  # the engine options, at the last --gib target
        options = [(p, t, b) for p in (1, 2, 4) for t in (False, True) for b in (False, True)]

    t0 = time.perf_counter()
    layers = build_layers(cfg, dtype, device)
    build_s = time.perf_counter() - t0
    inputs, target = make_inputs(cfg, side, text_tokens, device, dtype)
    block_count = cfg["num_layers"] + cfg["num_single_layers"]
    bandwidth = pinned_bandwidth(device)
    rows = []

    def record(name, times, extra):
        row = {"method": name, "median_step_s": statistics.median(times), "steps": len(times), **extra}
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GiB
        rows.append(row)
        print(json.dumps(row), flush=True)

    def reset():
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    if "resident" in methods:
        for layer in layers:
            layer.to(device)
        reset()
        record("all-resident", measure(layers, inputs, target, device, args.steps, args.warmup), {"streamed_gib": 0})
        for layer in layers:
            layer.to("cpu")
    runs = []
    if "dgls" in methods:
        counts = {f"{float(s):.0%} of blocks": round(float(s) * block_count) for s in args.shares.split(",") if s}
        for gib in (g for g in args.gib.split(",") if g):
            counts[f"~{gib} GiB"] = blocks_to_swap_for(layers, float(gib))
        runs += [(label, SwapConfig(blocks_to_swap=n, prefetch=args.prefetch)) for label, n in counts.items()]
    if options:
        target_gib = args.gib.split(",")[-1]
        n = blocks_to_swap_for(layers, float(target_gib))
        on = {False: "off", True: "on"}
        runs += [
            (
                f"~{target_gib} GiB threading={on[t]} batch_move={on[b]}",
                SwapConfig(blocks_to_swap=n, prefetch=p, threading=t, batch_move=b),
            )
            for p, t, b in options
        ]
    for label, swap_cfg in runs:
        reset()
        swapper = LayerSwapper(layers, swap_cfg, device=device, log=None)
        times = measure(layers, inputs, target, device, args.steps, args.warmup)
        swapper.step_stats()
        optimizer = torch.optim.AdamW([p for la in layers for p in la.parameters() if p.requires_grad], lr=0)
        train_step(layers, inputs, target, optimizer)
        stats = swapper.step_stats()
        extra = {
            "blocks_to_swap": swap_cfg.blocks_to_swap,
            "prefetch": swap_cfg.prefetch,
            "threading": swap_cfg.threading,
            "batch_move": swap_cfg.batch_move,
            "streamed_gib": swapper.placement.streamed_bytes / GiB,
            "predicted_weights_pool_gib": swapper.placement.predicted_device_bytes / GiB,
            "bytes_per_step": stats.bytes_moved,
            "copy_gbps": stats.gbps,
            "wait_ms": stats.wait_ms,
            "hit_rate": stats.hit_rate,
        }
        record(f"DGLS {label} (blocks_to_swap={swap_cfg.blocks_to_swap}, prefetch={swap_cfg.prefetch})", times, extra)
        swapper.remove()
    if "naive" in methods:
        n = blocks_to_swap_for(layers, float(args.gib.split(",")[-1]))
        from utils.dgls.placement import plan_placement

        placement = plan_placement(layers, SwapConfig(blocks_to_swap=n))
        reset()
        naive = NaiveSwap(layers, set(placement.streamed), device)
        times = measure(layers, inputs, target, device, max(2, args.steps // 4), 1)
        record(f"naive .to() swap (blocks_to_swap={n})", times, {"streamed_gib": placement.streamed_bytes / GiB})
        naive.remove(layers)

    result = {
        "benchmark": "flux_dev_lora_step",
        "config": cfg,
        "image_tokens": side * side,
        "text_tokens": text_tokens,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pinned_h2d_gbps": bandwidth,
        "model_build_s": build_s,
        **gpu_details(),
        "rows": rows,
    }
    write_reports(result, args.name)


def derive(result: dict) -> None:
    """Ratios and floors, from the figures measured in the run."""
    rows, bandwidth = result["rows"], result["pinned_h2d_gbps"]
    resident = next((r["median_step_s"] for r in rows if r["method"] == "all-resident"), None)
    for r in rows:
        if not resident:
            continue
        r["vs_resident"] = r["median_step_s"] / resident
        if bandwidth and r.get("bytes_per_step") is not None:
            # What was really copied (layers kept across the forward/backward turnaround are copied once) ...
            r["floor_s"] = max(resident, r["bytes_per_step"] / bandwidth / 1e9)
            r["vs_floor"] = r["median_step_s"] / r["floor_s"]
            # ... and the definition: every streamed byte twice a step.
            r["floor_2x_s"] = max(resident, 2 * r["streamed_gib"] * GiB / bandwidth / 1e9)
            r["vs_floor_2x"] = r["median_step_s"] / r["floor_2x_s"]


def write_reports(result: dict, name: str) -> None:
    """JSON with every figure, a Markdown table and (with matplotlib) a plot."""
    derive(result)
    rows = result["rows"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Flux-dev-size LoRA training step on {result.get('gpu', 'cpu')} "
        f"(PCIe gen {result.get('pcie_gen', '?')} x{result.get('pcie_width', '?')}, torch {result['torch']}): "
        f"{result['image_tokens']} image + {result['text_tokens']} text tokens, batch 1, LoRA r16, "
        f"non-reentrant checkpointing per block; pinned host-to-device {result['pinned_h2d_gbps']:.1f} GB/s.",
        "",
        "| method | streamed GiB | step (s) | vs resident | vs floor (copied) | vs floor (2x streamed) "
        "| copied/step GiB | copy GB/s | compute waited (ms) | peak alloc GiB | peak reserved GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r.get('streamed_gib', 0):.1f} | {r['median_step_s']:.3f} "
            f"| {r.get('vs_resident', 0):.2f}x | {r.get('vs_floor', 0):.2f}x | {r.get('vs_floor_2x', 0):.2f}x "
            f"| {r.get('bytes_per_step', 0) / GiB:.1f} | {r.get('copy_gbps', 0):.1f} | {r.get('wait_ms', 0):.0f} "
            f"| {r.get('peak_allocated_gib', 0):.2f} | {r.get('peak_reserved_gib', 0):.2f} |"
        )
    lines += [
        "",
        "floor (copied) = max(all-resident step, bytes copied per step / pinned bandwidth); floor (2x streamed) = "
        "max(all-resident step, 2 x streamed bytes / pinned bandwidth); all measured in this run.",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.8))
        for r in rows:
            ax.scatter(r.get("peak_allocated_gib", 0), r["median_step_s"], label=r["method"])
        ax.set_yscale("log")
        ax.set_xlabel("peak allocated VRAM (GiB)")
        ax.set_ylabel("median step (s, log scale)")
        ax.set_title("Flux-dev LoRA step: time vs VRAM (lower left is better)")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot written (pip install matplotlib)")


if __name__ == "__main__":
    main()
