"""Real architectures, random weights: a LoRA training step per method, one model per invocation.

Models (flux.py, sdxl.py, wan.py) are built from their diffusers configs (no download), cut into
diffusion-pipe-style layer lists, with LoRA rank 16 on the blocks' Linear layers, non-reentrant
checkpointing per block, batch 1: ``flux`` (Flux-dev size, 1024x1024), ``sdxl`` (the SDXL UNet,
1024x1024), ``wan`` (Wan2.1-14B size, a 480x832 clip of 9 frames). Methods: see runner.py. Writes
benchmarks/results/<name>.json, .md, .png and the results index README.md (name: flux_dev, sdxl,
wan, or --name).

    python benchmarks/bench_models.py --model flux            # H100: about 7 minutes
    python benchmarks/bench_models.py --model sdxl            # H100: about 2 minutes
    python benchmarks/bench_models.py --model wan             # H100: about 6-7 minutes
    python benchmarks/bench_models.py --model flux --methods resident,ab --ab_rounds 4 --name flux_dev_ab
    python benchmarks/bench_models.py --model wan --tiny      # smoke test on CPU, seconds
    python benchmarks/bench_models.py --model flux --methods accum --gib 20 --accumulation 1,2,4,8   # layer-major
    python benchmarks/bench_models.py --model flux --methods accum --gib "" --accumulation_budgets --budgets 8,4
    python benchmarks/bench_models.py --model flux --methods accum --accumulation 4 --accumulation_budgets \
        --budgets 8 --gib "" --profile_dir /tmp/traces          # + a --profile trace of one step per DGLS row
    DGLS_DIFFUSION_PIPE=/path/to/diffusion-pipe python benchmarks/bench_models.py --model flux   # with dp

A run starts no method past --deadline_s (480 s after start; a running timed loop then stops at 3
steps), so one invocation stays within a 10-minute device call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
import sdxl  # noqa: E402
import wan  # noqa: E402
from methods import DEFAULT_METHODS, METHODS, Options, parse_list  # noqa: E402
from report import command_line, results_dir  # noqa: E402
from runner import Runner  # noqa: E402
from timing import Deadline  # noqa: E402

BUILDERS = {"flux": flux.build, "sdxl": sdxl.build, "wan": wan.build}
# per-model defaults (a model's Bench.defaults) fall back to these
FALLBACKS = {"gib": "", "dp_swaps": "0.5,max", "naive": "0.5", "budgets": "auto"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=list(BUILDERS))
    p.add_argument("--tiny", action="store_true", help="tiny config (on CPU without CUDA): a smoke test")
    p.add_argument("--steps", type=int, default=None, help="timed steps per method (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per method (default 3; tiny 1)")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument(
        "--methods", default="all", help=f"comma list of {','.join(METHODS)}, or all (= {','.join(DEFAULT_METHODS)})"
    )
    p.add_argument("--shares", default="0,0.25,0.5,0.75,1", help="DGLS: shares of the blocks streamed")
    p.add_argument("--gib", default=None, help="DGLS, A/B and options: also stream about this many GiB (comma list)")
    p.add_argument("--ab_rounds", type=int, default=2, help="A/B: rounds of resident then DGLS per placement")
    p.add_argument("--ab_steps", type=int, default=5, help="A/B: timed steps per arm and round")
    p.add_argument("--budgets", default=None, help="vram_budget values: auto and/or GiB (comma list)")
    p.add_argument("--dp_swaps", default=None, help="diffusion-pipe blocks_to_swap: shares, NGiB or max (comma list)")
    p.add_argument("--naive", default=None, help="naive swap: a share of the blocks or an NGiB target")
    p.add_argument("--unit_mb", default="0", help="offload: swap-unit sizes in MB, a row each (0: whole layers)")
    p.add_argument(
        "--checkpoint_units",
        choices=("off", "on", "both"),
        default="off",
        help="offload and vram_budget rows: checkpoint_units off, on, or a row of each",
    )
    p.add_argument(
        "--offload_recompute",
        choices=("off", "on", "both"),
        default="off",
        help="offload rows: offload_recompute off, on, or a row of each",
    )
    p.add_argument(
        "--keep_piece_outputs",
        choices=("off", "on", "both"),
        default="off",
        help="offload rows with checkpoint_units: keep_piece_outputs off, on, or a row of each",
    )
    p.add_argument(
        "--memory_cap_gib",
        type=float,
        default=None,
        help="offload rows: cap the process's device memory at this many GiB (as a card of that size would)",
    )
    p.add_argument(
        "--budget_offload",
        choices=("auto", "on", "off"),
        default="auto",
        help="vram_budget rows: offload_activations unset (the planner offloads what the budget needs), on, or off",
    )
    p.add_argument("--accumulation", default="1,2,4,8", help="accum rows: micro-batches per step (comma list)")
    p.add_argument(
        "--accumulation_budgets", action="store_true", help="accum rows: also at each --budgets GiB value (planned)"
    )
    p.add_argument(
        "--accumulation_ab",
        action="store_true",
        help="accum rows: also one row of all-resident layer-major steps alternating with one-after-another steps "
        "(its 'vs resident' against those of the same rounds: no drift between rows)",
    )
    p.add_argument(
        "--accumulation_ways",
        choices=("both", "layer-major", "sequential"),
        default="both",
        help="accum rows: DGLS rows both ways, or only one (the all-resident rows run both ways: the reference)",
    )
    p.add_argument(
        "--accumulation_units",
        choices=("micro_batches", "one", "both"),
        default="micro_batches",
        help="accum vram_budget rows, layer-major: swap units sized for the step's micro-batches (as dgls_train.py "
        "does), for one micro-batch (the size before), or a row of each",
    )
    p.add_argument(
        "--profile_dir",
        type=Path,
        default=None,
        help="accum rows: DGLS's --profile trace (JSON, and PNG with matplotlib) of one step after each DGLS row's "
        "timed steps, a file per row in this folder; and per accum row (all-resident ones too) two more steps under "
        "torch.profiler: the CUDA runtime calls the host waited in and where, and the compute stream's gaps between "
        "kernels (benchmarks/blocking.py)",
    )
    p.add_argument("--latent_frames", type=int, default=3, help="wan: latent frames of the clip (3 = 9 frames)")
    p.add_argument("--deadline_s", type=float, default=480.0, help="seconds after start: no method starts past it")
    p.add_argument("--strict", action="store_true", help="a failing method fails the run (tests)")
    p.add_argument("--name", default=None, help="results file stem (default per model)")
    p.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    methods = DEFAULT_METHODS if args.methods == "all" else tuple(parse_list(args.methods))
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}: choose from {', '.join(METHODS)}")
    deadline = Deadline.after(args.deadline_s)
    started = time.perf_counter()
    with machine.session(args.tiny) as (device, dtype):
        bench = BUILDERS[args.model](args.tiny, device, dtype, args)
        build_s = time.perf_counter() - started
        bench.name = args.name or bench.name
        given = {key: getattr(args, key) for key in FALLBACKS}
        defaults = {key: bench.defaults.get(key, FALLBACKS[key]) if v is None else v for key, v in given.items()}
        options = Options(
            tiny=args.tiny,
            methods=methods,
            steps=args.steps if args.steps is not None else (2 if args.tiny else 10),
            warmup=args.warmup if args.warmup is not None else (1 if args.tiny else 3),
            prefetch=args.prefetch,
            shares=args.shares,
            ab_rounds=args.ab_rounds,
            ab_steps=args.ab_steps,
            strict=args.strict,
            unit_mb=args.unit_mb,
            checkpoint_units=args.checkpoint_units,
            offload_recompute=args.offload_recompute,
            keep_piece_outputs=args.keep_piece_outputs,
            memory_cap_gib=args.memory_cap_gib,
            budget_offload=args.budget_offload,
            accumulation=args.accumulation,
            accumulation_budgets=args.accumulation_budgets,
            accumulation_ways=args.accumulation_ways,
            accumulation_ab=args.accumulation_ab,
            accumulation_units=args.accumulation_units,
            profile_dir=args.profile_dir,
            **defaults,
        )
        print(
            f"{bench.title}: {bench.shape}; {len(bench.layers)} layers, {len(bench.blocks)} blocks, built in "
            f"{build_s:.1f} s on {device}",
            flush=True,
        )
        out = args.results_dir or results_dir(args.tiny)
        command = command_line(__file__, argv)
        return Runner(bench, options, device, dtype, out, deadline, command, build_s).run()


if __name__ == "__main__":
    main()
