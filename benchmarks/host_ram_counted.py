"""What the host RAM check counts for a full fine-tune, per diffusion-pipe optimizer type, without a GPU.

A full fine-tune's host memory is the packed compute-dtype copies the GPU streams from, and the training state of
the streamed layers (:class:`~utils.dgls.memory.layout.TrainingLayout`): fp32 masters, gradient landings (and
fp32 sums with several micro-batches, or for an optimizer that steps once after the backward), the optimizer
state measured on its class (:mod:`utils.dgls.training.optimizer_state`), and under clipping the spares of
speculative updates (as many as fit beside the RAM reserve at start-up). This script builds the model with its
params on the meta device (no memory), measures the layouts exactly as the engine does for a full fine-tune in
bf16 with every block streamed (the most host RAM a placement takes), and counts each part per type: the figures
the start-up line and the RAM check give before anything is allocated. Measured RSS on a GPU host is
``bench_full.py --optimizer TYPE``'s (``host_rss_gib``, ``pinned_gib``).

    python3 benchmarks/host_ram_counted.py [--model flux|sdxl] [--optimizers adamw,AdamW8bit,...]
        [--diffusion_pipe CHECKOUT]   # its optimizers/ folder: adamw8bitkahan, automagic

Types whose library is missing are listed as such. Writes benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import command_line, results_dir, write_result  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls.errors import DGLSUserError  # noqa: E402
from utils.dgls.memory.layout import measure  # noqa: E402
from utils.dgls.training.host_optimizer import HostOptimizerSpec  # noqa: E402
from utils.dgls.training.host_training import training_layout  # noqa: E402

DEFAULT_TYPES = (
    "adamw,adamw_optimi,AdamW8bit,adamw8bitkahan,stableadamw,automagic,sgd,Lion,CAME,Prodigy,ScheduleFreeAdamW"
)
EXTRA_VALUES = {"sgd": {"momentum": 0.9}}  # diffusion-pipe's example tables give these


def meta_blocks(model: str, tiny: bool) -> list[torch.nn.Module]:
    """The model's streamed blocks with bf16 params on the meta device (nothing allocated)."""
    from models import params_on_meta

    with params_on_meta():
        if model == "flux":
            from diffusers import FluxTransformer2DModel
            from flux import FLUX_DEV, TINY

            net = FluxTransformer2DModel(**(TINY if tiny else FLUX_DEV))
            blocks = [*net.transformer_blocks, *net.single_transformer_blocks]
        else:
            from diffusers import UNet2DConditionModel
            from sdxl import SDXL, SDXL_TINY

            net = UNet2DConditionModel(**(SDXL_TINY if tiny else SDXL))
            blocks = [*net.down_blocks, net.mid_block, *net.up_blocks]
    for block in blocks:
        block.to(dtype=torch.bfloat16)
        block.requires_grad_(True)
    return blocks


def count(blocks: list[torch.nn.Module], table: dict, clipping: bool, accumulation: int) -> dict:
    """The host bytes of each part for one ``[optimizer]`` table."""
    spec = HostOptimizerSpec.from_table(table)
    layouts = dict(enumerate(measure(blocks, None, "bf16", host_trained=True)))
    layout = training_layout(layouts, spec, accumulation_steps=accumulation, clipping=clipping)
    parts = layout.parts()
    packed = layout.packed_bytes
    spares = parts.pop("speculation", 0)
    total = packed + sum(parts.values())
    return dict(
        packed_gib=packed / GiB,
        masters_gib=parts["masters"] / GiB,
        gradients_gib=parts["gradients"] / GiB,
        optimizer_gib=parts["optimizer"] / GiB,
        total_gib=total / GiB,
        spares_wanted_gib=spares / GiB,
        kernel=spec.kernel.split(" (")[0],
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("flux", "sdxl"), default="flux")
    parser.add_argument("--optimizers", default=DEFAULT_TYPES, help="comma list of [optimizer] types")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: none)")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--diffusion_pipe", type=Path, default=None, help="a checkout, for its optimizers/ types")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--name", default=None, help="results file stem (default host_ram_MODEL)")
    parser.add_argument("--results_dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.diffusion_pipe is not None:
        sys.path.insert(0, str(args.diffusion_pipe.resolve()))
    blocks = meta_blocks(args.model, args.tiny)
    params = sum(p.numel() for b in blocks for p in b.parameters())
    rows = []
    for name in args.optimizers.split(","):
        table = {"type": name, "lr": args.lr, **EXTRA_VALUES.get(name.lower(), {})}
        try:
            row = count(blocks, table, args.clip > 0, args.accumulation)
        except DGLSUserError as exc:
            row = dict(note=str(exc)[:160])
        rows.append(dict(method=name, **row))
        print(name, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    result = {
        "benchmark": "host_ram",
        "title": f"Host RAM a full fine-tune's streamed layers take, counted ({args.model}, bf16)",
        "description": (
            f"{params / 1e9:.2f}B params in {len(blocks)} streamed blocks (every block streams: the most host RAM a "
            f"placement takes), gradient_clipping {args.clip}, gradient_accumulation_steps {args.accumulation}; "
            "what the RAM check and the start-up line count before anything is allocated (not measured RSS)"
            + (" TINY config." if args.tiny else "")
        ),
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
        "environment": {"device": "cpu", "torch": torch.__version__},
        "tiny": args.tiny,
        "notes": [
            "packed: the bf16 copies the GPU streams from (pinned); masters: fp32; gradients: the bf16 landings the "
            "device-to-host copies write (pinned), plus fp32 sums with several micro-batches or a whole-step "
            "optimizer; optimizer: the state measured on the type's class; total: their sum. spares wanted: under "
            "clipping, one more master and state per layer for speculative updates, of which start-up keeps as "
            "many as fit beside the RAM reserve (none on a host that has no room: the updates then wait for the "
            "norm). Process overhead (CUDA context, the model loader, the data) comes on top."
        ],
        "rows": rows,
    }
    name = args.name or f"host_ram_{args.model}"
    write_result(result, name, args.results_dir or results_dir(args.tiny), plot_it=False, echo=True)
    return result


if __name__ == "__main__":
    main()
