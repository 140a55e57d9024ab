"""Scaling over the GPUs of one machine: data-parallel and pipeline-stage training with DGLS on 1, 2, 4 ... GPUs.

One process per GPU (started here, one job per GPU count, each a fresh set of processes), every process streaming
from the one host copy its machine shares (utils/dgls/memory/peers.py). Models (random weights, no download; built
by flux.py, wan.py, sdxl.py as bench_models.py builds them), batch 1 per process:

- ``flux``: the Flux-dev-size LoRA at 1024x1024 with ``--vram_budget 8`` (GiB per GPU, the planner's placement);
- ``wan``: the Wan2.1-14B-size LoRA, a 480x832 clip of 81 frames (``--latent_frames 21``) in 8 GiB: the settings of
  toml/wan_lora_long_video.toml (every block streamed in swap units of 256 MB, activations offloaded with
  checkpoint_units, offload_recompute and keep_piece_outputs, prefetch 1), each process's device memory capped at
  ``--memory_cap_gib 8`` as an 8 GiB card holds it (``--vram_budget N`` plans instead);
- ``sdxl_full``: the SDXL UNet, every weight trained (AdamW; streamed layers on the host, each process updating its
  share of them, utils/dgls/training/data_parallel.py), layers of ``--stream_mib`` or more streamed.
- ``flux_full`` (pipeline rows only): Flux-dev with every weight trained, as toml/two_gpus_full_flux_dev.toml trains
  it through dgls_train.py: its ``[optimizer]`` table (the streamed layers' on the host, ``--host_adam``; the resident
  ones' by the class train.py builds), clipping at 1.0, ``--vram_budget 21`` per GPU (a stage's plan fixed at step 1);
  one stage runs its micro-batches layer-major (dgls_train.py's default there: each layer copied in and its gradients
  sent home once a step), several stages one micro-batch after another, each stage's host training summing them.

The LoRA's gradients are averaged over the processes after each backward (one all-reduce), as DeepSpeed does; a full
fine-tune's resident params' too. A vram_budget run's untimed steps last until every process's planner has settled.
Per GPU count (a row): samples per second (processes / median step), its ratio to one GPU's, and per GPU the peak
VRAM, DGLS's own host-to-device rate in the timed steps (bytes copied / copy-stream time) and the rate of plain
pinned copies of 1 GiB run on every GPU at once (the shared host memory and PCIe switches cap it); the job's host
memory (the processes' proportional set sizes summed: the shared copy counts once) and the shared copy's size.
Where the rate falls short of the GPU count, the row names the likely cap.

``--layout pipeline`` (or ``data,pipeline``; the LoRA models and flux_full) adds rows of ONE model in N pipeline
stages, a process per GPU, as diffusion-pipe runs ``pipeline_stages = N`` (scaling_pipeline.py: DeepSpeed's
PipelineModule partitioned by trainable parameters, ``train_batch``, DGLS placing each stage's layers under its own
GPU's budget or cap). Stages overlap only across micro-batches: a step is ``--micro_batches`` micro-batches of 1
(default 4) on every pipeline row, the 1-GPU one (one stage) included, and its samples/s are micro-batches / step. Per
row: its stages' layer ranges, bytes copied per step and host copies (each stage holds its own layers' copy), every
step's loss (the same model trains in every row, so the losses agree), and the bubble's bound N x M / (M + N - 1) the
cap is judged against. DeepSpeed 0.19.8 runs a stage's backward once per tensor it sends on (Flux's first stages:
twice); ``--one_backward`` runs it once, as 0.18.4 (diffusion-pipe's pin) does and as DGLS's demo and diffusion-pipe
runs with several stages do (utils/dgls/trainers/joined_backward.py); without it a row measures the installed
DeepSpeed's own pass.

    python benchmarks/bench_scaling.py --model flux --gpus 1,2,4 --name scaling_flux_124   # 4x H200: 5.5 minutes
    python benchmarks/bench_scaling.py --model flux --gpus 1,2 --name scaling_flux_12   # H100: about 5 minutes
    python benchmarks/bench_scaling.py --model flux --gpus 4 --name scaling_flux_4      # about 3 minutes
    python benchmarks/bench_scaling.py --merge scaling_flux_12,scaling_flux_4 --name scaling_flux   # no GPU
    python benchmarks/bench_scaling.py --model wan --gpus 1 --steps 3 --name scaling_wan_1b   # a step is ~22 s: one
        # GPU count per command (3-4.5 minutes each), then --gpus 2 (scaling_wan_2b), --gpus 4 (scaling_wan_4) and
        # --merge scaling_wan_1b,scaling_wan_2b,scaling_wan_4 --name scaling_wan_124
    python benchmarks/bench_scaling.py --model sdxl_full --gpus 1,2,4 --name scaling_sdxl_full_124   # 3.5 minutes
    python benchmarks/bench_scaling.py --model flux --gpus 1 --layout pipeline --name scaling_flux_pp_1
        # H100: about 4-5 minutes (a step of 4 micro-batches is ~4.5 s on one GPU; the planner settles first)
    python benchmarks/bench_scaling.py --model flux --gpus 2,4 --layout pipeline --name scaling_flux_pp_24   # ~6 min
    python benchmarks/bench_scaling.py --model flux --gpus 2,4 --layout pipeline --one_backward \
        --name scaling_flux_pp1_24                                                    # about 6 minutes
    python benchmarks/bench_scaling.py --merge scaling_flux_12,scaling_flux_4,scaling_flux_pp_1,scaling_flux_pp_24,\
scaling_flux_pp1_24 --name scaling_flux     # every layout's rows in one result (no GPU)
    python benchmarks/bench_scaling.py --model wan --gpus 1 --layout pipeline --micro_batches 2 --warmup 1 \
        --steps 2 --name scaling_wan_pp_1     # a step is 2 micro-batches of ~22 s: about 4 minutes
    python benchmarks/bench_scaling.py --model wan --gpus 2,4 --layout pipeline --micro_batches 2 --warmup 1 \
        --steps 2 --name scaling_wan_pp_24    # about 6 minutes; then --merge as above
    python benchmarks/bench_scaling.py --model flux_full --gpus 1,2 --layout pipeline --one_backward --steps 3 \
        --name scaling_flux_full_pp_12     # toml/two_gpus_full_flux_dev.toml's figures: host RAM about 180 GiB
        # for one stage (layer-major: no host sums), about 220 for two (each summing 4 micro-batches): 512 GiB machine
    python benchmarks/bench_scaling.py --model flux --gpus 1,4 --bind_cores --name scaling_flux_14_bound
        # each process on its own physical cores: whether 4 processes sharing cores slow a launch-bound step
    python benchmarks/bench_scaling.py --model flux --gpus 1,4 --share_fetch off,on --name scaling_flux_share_14
        # 4 GPUs copying every layer each, and each copying a quarter and gathering the rest: about 7 minutes
    python benchmarks/bench_scaling.py --model flux --tiny              # smoke test on CPU (gloo), 1 and 2 processes
    python benchmarks/bench_scaling.py --model wan --tiny --layout pipeline   # the same, 1 and 2 stages

Writes benchmarks/results/scaling_<model>.json and .md (``--name``); ``--merge A,B,...`` writes one result of the
rows of earlier results (of one model) instead of measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import command_line, results_dir, write_result  # noqa: E402
from units import GiB  # noqa: E402

LORA_MODELS = ("flux", "wan")
MODELS = (*LORA_MODELS, "sdxl_full", "flux_full")
PIPELINE_MODELS = (*LORA_MODELS, "flux_full")  # flux_full: pipeline rows only (toml/two_gpus_full_flux_dev.toml)
DEFAULT_BUDGET = {"flux": 8.0, "wan": 8.0, "flux_full": 21.0}
# flux_full trains as toml/two_gpus_full_flux_dev.toml: its [optimizer] table (read with the stdlib's TOML reader)
FULL_FLUX_TOML = Path(__file__).resolve().parents[1] / "toml" / "two_gpus_full_flux_dev.toml"
FULL_FLUX_OPTIMIZER = tomllib.loads(FULL_FLUX_TOML.read_text())["optimizer"]
EFFICIENT = 0.95  # a row at this share of N x one GPU's samples/s or more names no cap
SHARED_RATE = 0.9  # plain copies on every GPU at once below this share of one GPU's alone: the host side is shared
LAYOUTS = ("data", "pipeline", "data,pipeline")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="flux")
    p.add_argument("--gpus", default=None, help="comma list of GPU counts (default 1,2,4; tiny: 1,2 processes)")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (gloo): a smoke test")
    p.add_argument("--steps", type=int, default=None, help="timed steps per GPU count (default 5; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps without a budget (default 2; tiny 1)")
    p.add_argument("--max_warmup", type=int, default=40, help="vram_budget: most untimed steps while planners settle")
    p.add_argument("--vram_budget", type=float, default=None, help="GiB per GPU (default 8; flux_full 21)")
    p.add_argument("--memory_cap_gib", type=float, default=8.0, help="wan recipe: each process's device memory cap")
    p.add_argument("--latent_frames", type=int, default=21, help="wan: latent frames (21 = 81 video frames)")
    p.add_argument("--stream_mib", type=float, default=64.0, help="sdxl_full: stream the layers of this many MiB")
    p.add_argument(
        "--host_adam", default="split", help="sdxl_full, flux_full: where updates run (split, device, torch_fused)"
    )
    p.add_argument("--deadline_s", type=float, default=540.0, help="no GPU count starts past this many seconds")
    p.add_argument("--timeout_s", type=float, default=500.0, help="a job's processes are stopped after this")
    p.add_argument("--name", default=None, help="results file stem (default scaling_<model>)")
    p.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    p.add_argument("--merge", default=None, help="comma list of result names (one model) to join into --name")
    p.add_argument("--strict", action="store_true", help="a failing job fails the run (tests)")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="data",
        help="data: data-parallel rows; pipeline: rows of one model in N pipeline stages (LoRA models, flux_full); "
        "data,pipeline",
    )
    p.add_argument("--micro_batches", type=int, default=None, help="pipeline rows: micro-batches per step (default 4)")
    p.add_argument("--partition", default="parameters", help="pipeline rows: PipelineModule's partition_method")
    p.add_argument(
        "--one_backward",
        action="store_true",
        help="pipeline rows: DGLS's joined backward (one per stage and micro-batch, as DeepSpeed 0.18.4 and DGLS's "
        "runs with several stages); without it DeepSpeed's own pass (0.19.8: one backward per tensor sent on)",
    )
    p.add_argument(
        "--bind_cores",
        action="store_true",
        help="data rows: each process bound to its own block of physical cores (with their sibling threads) and "
        "as many torch threads: whether processes sharing cores hold the launch-bound step back (rank_cores)",
    )
    p.add_argument(
        "--share_fetch",
        default="auto",
        help="data rows: comma list of share_fetch modes (auto, on, off), one row each per GPU count above 1: the "
        "processes copy 1/N of each layer and all-gather the rest (utils/dgls/memory/fetch_share.py)",
    )
    p.add_argument("--job_share", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "PORT", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--job_layout", choices=("data", "pipeline"), default="data", help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------- one process of a job
def worker_device(args, rank: int):
    """A worker's (cuda, device, dtype): its own GPU in bf16, or the CPU in fp32 (one thread: several share it)."""
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_cudnn_sdp(False)  # as machine.session: its backward is broken on the lent H100s
    else:
        torch.set_num_threads(1)
    return cuda, device, dtype


def cpu_topology(cpus: list[int]) -> dict[int, tuple[int, int]]:
    """Each logical CPU's (package, core) from sysfs; a CPU without topology files is a core of its own."""
    topology = {}
    for cpu in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = int((base / "physical_package_id").read_text())
            core = int((base / "core_id").read_text())
        except (OSError, ValueError):
            package, core = -1, cpu
        topology[cpu] = (package, core)
    return topology


def rank_cores(rank: int, world: int, topology: dict[int, tuple[int, int]]) -> tuple[list[int], int]:
    """``--bind_cores``: rank ``rank``'s logical CPUs of the allowed ones (``topology``: each one's package and core)
    and its count of physical cores. The physical cores, in (package, core) order, are split into ``world``
    contiguous blocks as evenly as they go (a block never spans two packages where each package holds a whole number
    of blocks, as on a 2-socket machine with 4 GPUs, 2 on each); each rank gets every sibling thread of its block's
    cores. With fewer physical cores than ranks, ranks share them round robin."""
    siblings: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(topology):
        siblings.setdefault(topology[cpu], []).append(cpu)
    cores = sorted(siblings)
    if len(cores) < world:
        core = cores[rank % len(cores)]
        return siblings[core], 1
    block = cores[rank * len(cores) // world : (rank + 1) * len(cores) // world]
    return sorted(cpu for core in block for cpu in siblings[core]), len(block)


def bind_cores(rank: int, world: int) -> int:
    """Bind this process to its cores (:func:`rank_cores`) with as many torch threads; their count."""
    import torch

    cpus, physical = rank_cores(rank, world, cpu_topology(sorted(os.sched_getaffinity(0))))
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(physical)
    return physical


def worker(args) -> None:
    """One rank: build the model, train data parallel, write OUT/rank<R>.json."""
    import scaling_pipeline
    import torch

    if args.job_layout == "pipeline":
        pipeline_worker(args)
        return
    rank, world, port, out = int(args.worker[0]), int(args.worker[1]), args.worker[2], Path(args.worker[3])
    cuda, device, dtype = worker_device(args, rank)
    cores = bind_cores(rank, world) if args.bind_cores else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist = torch.distributed
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        started = time.perf_counter()
        bench, swapper, step, planner = build(args, device, dtype, world)
        build_s = time.perf_counter() - started
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        warm = warm_up(args, step, planner, sync, dist)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        before = swapper.total_stats(sync=True)
        step.reduced.clear()
        thread_cpu: list[float] = []
        times = scaling_pipeline.timed_steps(step, args.steps, sync, dist, thread_cpu)
        stats = swapper.total_stats(sync=True).since(before)
        before_reduce_s, reduce_s, reduce_bytes = reduce_seconds(step.reduced)
        record = {
            "rank": rank,
            "build_s": build_s,
            "warmup_steps": warm,
            "step_times_s": times,
            "thread_cpu_ms": statistics.median(thread_cpu) * 1000,
            "bound_cores": cores,
            "shared_fetch": swapper.copier.share is not None,
            **job_figures(cuda, device, swapper, bench, stats, len(times)),
            "before_allreduce_ms": before_reduce_s * 1000,
            "allreduce_ms": reduce_s * 1000,
            "allreduce_mb": reduce_bytes / 1e6,
            "title": bench.title.replace("LoRA training", "full fine-tuning") if swapper.training else bench.title,
        }
        swapper.remove()
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def job_figures(cuda: bool, device, swapper, bench, stats, steps: int) -> dict:
    """A rank's figures after its timed ``steps`` (``stats``: the swapper's since they began), either layout: device
    memory, copies, the plain pinned rate with every rank copying at once (a collective: every rank calls it), host
    memory and the shared host copy, the placement. Lifts the wan recipe's device-memory cap first (the plain copies
    and the swapper's removal allocate beyond it)."""
    import machine
    import psutil
    import torch

    memory = psutil.Process().memory_full_info()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    torch.distributed.barrier()
    shared = sum(host.buffer.numel() for host in swapper.store.layers.values())
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if cuda else None,
        "bytes_per_step": stats.bytes_moved / max(1, steps),
        "copy_gbps": stats.gbps,
        "wait_ms_per_step": stats.wait_ms / max(1, steps),
        "raw_h2d_gbps": machine.pinned_bandwidth(device) if cuda else 0.0,
        "pss_gib": getattr(memory, "pss", memory.rss) / GiB,
        "rss_gib": memory.rss / GiB,
        "rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB: the process's peak
        "host_copy_gib": shared / GiB,
        "sharing_processes": swapper.masters.peers.local_ranks,
        "streamed_layers": len(swapper.placement.streamed),
        "entries": len(swapper.entries),
        "layers": len(bench.layers),
        "shape": bench.shape,
    }


def build(args, device, dtype, world: int):
    """The model, its swapper, one training step (data parallel over ``world`` processes), and the planner (None
    without a budget)."""
    import flux
    import sdxl
    import torch
    import torch.nn.functional as F
    import wan
    from torch.utils.checkpoint import checkpoint

    from utils.dgls import LayerSwapper, SwapConfig
    from utils.dgls.training.host_optimizer import HostOptimizerSpec

    dist = torch.distributed
    log = print if dist.get_rank() == 0 else None
    full = args.model == "sdxl_full"
    capped = False
    if full:
        bench = sdxl.build(args.tiny, device, dtype, args, lora=False)
        for layer in bench.layers:
            layer.requires_grad_(True)
        spec = HostOptimizerSpec(lr=1e-5, implementation=args.host_adam if device.type == "cuda" else "torch")
        stream_mib = 0.05 if args.tiny else args.stream_mib  # tiny: the small layers stay resident
        resident = [s.index for s in bench.sizes if s.streamable_bytes < stream_mib * 2**20]
        config = SwapConfig.of(
            gpu_layers=resident, prefetch=2, host_optimizer=spec, data_parallel=world > 1, share_fetch=args.job_share
        )
    elif wan.runs_recipe(args):
        bench = wan.build(args.tiny, device, dtype, args)
        config = SwapConfig.of(**wan.recipe(len(bench.blocks), args.tiny), share_fetch=args.job_share)
        capped = device.type == "cuda"  # as an 8 GiB card holds it, once the swapper took the blocks home
    else:
        bench = (flux.build if args.model == "flux" else wan.build)(args.tiny, device, dtype, args)
        budget = args.vram_budget or DEFAULT_BUDGET[args.model]
        config = SwapConfig.of(
            vram_budget=bench.tight_budget_gib() if args.tiny else budget, share_fetch=args.job_share
        )
    swapper = LayerSwapper(bench.layers, config, device=device, log=log)
    if capped:  # (methods.memory_cap) after the build: the model is made on the device, whole, then streamed home
        wan.cap_device_memory(device, args.memory_cap_gib)
    ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
    params = [p for layer in bench.layers for p in layer.parameters() if p.requires_grad]
    if full:
        training = swapper.training
        averaged = [p for i, layer in enumerate(bench.layers) if not swapper.is_streamed(i) for p in layer.parameters()]
        optimizer = torch.optim.AdamW(averaged, lr=1e-5) if averaged else None
    else:
        training, averaged = None, params
        optimizer = torch.optim.AdamW(params, lr=1e-5)

    # each step's gradient all-reduce, from its flattening to its means copied back (the compute stream waits for
    # NCCL's), and the step's work before it: (step start, all-reduce start, its end, bytes), CUDA events read after
    # the step's sync (no sync of their own), or CPU clocks
    reduced: list[tuple[object, object, object, int]] = []

    def reduce_clock():
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step() -> None:
        begun = reduce_clock() if world > 1 else None
        h = bench.inputs
        for i, layer in enumerate(bench.layers):
            h = ckpt(layer, h) if i in bench.checkpointed else layer(h)
        F.mse_loss(h.float(), bench.target.float()).backward()
        grads = [p.grad for p in averaged if p.grad is not None]
        if world > 1 and grads:  # the trainer's data-parallel mean (DeepSpeed's), in one all-reduce
            clock = reduce_clock()
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat /= world
            for grad, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(mean)
            reduced.append((begun, clock, reduce_clock(), flat.numel() * flat.element_size()))
        if training is not None:
            training.clip_grad_norm_(params, 1.0)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if training is not None:
            training.step()

    step.reduced = reduced
    return bench, swapper, step, swapper.driver


def reduce_seconds(reduced: list) -> tuple[float, float, float]:
    """From the steps timed in ``reduced`` (after a sync): the median seconds of the work before the all-reduce
    (forward and backward: the ranks' difference is what the faster one waits in it), of the all-reduce itself, and
    its bytes."""
    if not reduced:
        return 0.0, 0.0, 0.0

    def seconds(a, b) -> float:
        return a.elapsed_time(b) / 1000 if hasattr(a, "elapsed_time") else b - a

    before = statistics.median(seconds(begun, start) for begun, start, _, _ in reduced)
    during = statistics.median(seconds(start, end) for _, start, end, _ in reduced)
    return before, during, float(reduced[-1][3])


# ---------------------------------------------------------------- one stage of a pipeline job
def pipeline_worker(args) -> None:
    """One pipeline stage (scaling_pipeline.py): build its part of the model, train, write OUT/rank<R>.json."""
    import scaling_pipeline
    import torch
    import wan

    rank, world, port, out = int(args.worker[0]), int(args.worker[1]), args.worker[2], Path(args.worker[3])
    cuda, device, dtype = worker_device(args, rank)
    scaling_pipeline.init_distributed(rank, world, port, cuda)
    dist = torch.distributed
    try:
        started = time.perf_counter()
        bench = model_builder(args.model)(args.tiny, device, dtype, args, on_meta=True)
        log = print  # each stage's own lines (its planner's), in its own rank's log
        engine, swapper = scaling_pipeline.build_engine(
            args,
            bench,
            device,
            dtype,
            world,
            partial(stage_config, args, stages=world),
            log,
            train_all=args.model == "flux_full",
        )
        if cuda and wan.runs_recipe(args):  # the wan recipe's cap, as build()'s
            wan.cap_device_memory(device, args.memory_cap_gib)
        build_s = time.perf_counter() - started
        losses: list[float] = []  # every step's, untimed ones too
        step = scaling_pipeline.stage_step(engine, bench, losses, swapper, args.one_backward, swapper.log)
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        with (
            scaling_pipeline.host_training_hooks(swapper),  # a full fine-tune's host updates join DeepSpeed's step
            scaling_pipeline.step_order(engine, swapper),  # one stage of a full fine-tune: layer-major, as dgls_train
        ):
            warm = warm_up(args, step, swapper.driver, sync, dist)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            before = swapper.total_stats(sync=True)
            thread_cpu: list[float] = []
            times = scaling_pipeline.timed_steps(step, args.steps, sync, dist, thread_cpu)
            stats = swapper.total_stats(sync=True).since(before)
        module = engine.module
        record = {
            "rank": rank,
            "build_s": build_s,
            "warmup_steps": warm,
            "step_times_s": times,
            "thread_cpu_ms": statistics.median(thread_cpu) * 1000,
            "losses": losses,
            "micro_batches": args.micro_batches,
            "stage_layers": [int(module._local_start), int(module._local_stop)],
            **job_figures(cuda, device, swapper, bench, stats, len(times)),
            "title": bench.title.replace("LoRA training", "full fine-tuning") if swapper.training else bench.title,
        }
        swapper.remove()
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def model_builder(model: str):
    import flux
    import wan

    return {"flux": flux.build, "wan": wan.build, "flux_full": partial(flux.build, lora=False)}[model]


def stage_config(args, layers: list, stages: int = 1):
    """A pipeline stage's SwapConfig for its ``layers`` (each stage its own GPU's budget or cap), as build()'s for
    the whole model: the wan recipe streams every block of the stage (its device memory capped by the worker once
    DGLS took them home, as build() caps it)."""
    import scaling_pipeline
    import wan

    from utils.dgls import SwapConfig

    if wan.runs_recipe(args):
        blocks = sum(isinstance(layer, scaling_pipeline.StageBlock) for layer in layers)
        return SwapConfig.of(**wan.recipe(blocks, args.tiny))
    budget = args.vram_budget or DEFAULT_BUDGET[args.model]
    budget = scaling_pipeline.tight_budget_gib(layers) if args.tiny else budget
    if args.model == "flux_full":  # every weight trains: the stage's streamed layers on the host, as the toml's
        from utils.dgls.training.host_optimizer import HostOptimizerSpec

        spec = HostOptimizerSpec.from_table(FULL_FLUX_OPTIMIZER, "torch" if args.tiny else args.host_adam)
        layer_major = stages == 1 and args.micro_batches > 1  # as dgls_train.py (program/validate.py) sets them
        return SwapConfig.of(
            vram_budget=budget,
            host_optimizer=spec,
            clip_grads=True,  # the toml's gradient_clipping = 1.0, as the engine's config below
            accumulation_steps=1 if layer_major else args.micro_batches,
            layer_major_micro_batches=args.micro_batches if layer_major else 1,
        )
    return SwapConfig.of(vram_budget=budget)


def warm_up(args, step, planner, sync, dist) -> int:
    """Untimed steps: ``--warmup``, or with a budget until every process's planner has its plan and kept it for
    two steps (every process runs the same number of steps: their gradients meet at each)."""
    import torch

    if planner is None:
        for _ in range(args.warmup):
            step()
        sync()
        return args.warmup
    settled, state, count = 0, None, 0
    while count < args.max_warmup:
        step()
        count += 1
        now = (planner.done, planner.plan)
        settled = settled + 1 if planner.done and now == state else 0
        state = now
        flag = torch.tensor([1.0 if settled >= 2 else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() > 0:
            break
    sync()
    return count


# ---------------------------------------------------------------- the jobs and the result
def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def job_environment(args) -> dict[str, str]:
    """The workers' environment: this one's, and for the wan recipe the allocator setting its config's command line
    sets (wan.RECIPE_ALLOCATOR)."""
    import wan

    env = dict(os.environ)
    if wan.runs_recipe(args) and not args.tiny:
        env.setdefault(*wan.RECIPE_ALLOCATOR)
    return env


def log_paths(folder: str, name: str, layout: str, gpus: int) -> list[Path]:
    """Each rank's log of a job: in ``$DGLS_BENCH_LOGS`` where set (device_session.sh sets it under its output, so
    the logs come back, a job's stopped by a timeout too: its planner's lines, say), else in the job's folder."""
    kept = os.environ.get("DGLS_BENCH_LOGS")
    if not kept:
        return [Path(folder) / f"log{r}" for r in range(gpus)]
    Path(kept).mkdir(parents=True, exist_ok=True)
    return [Path(kept) / f"{name}_{layout}_{gpus}gpu_rank{r}.log" for r in range(gpus)]


def run_job(args, argv: list[str], gpus: int, name: str = "scaling", layout: str = "data") -> tuple[list[dict], str]:
    """Start ``gpus`` processes of this script as workers; their records (rank order) and rank 0's log, or [] and the
    tails of the logs of the ranks that failed."""
    with tempfile.TemporaryDirectory(prefix="dgls-scaling-") as folder:
        port, logs = free_port(), log_paths(folder, name, layout, gpus)
        procs = []
        for r in range(gpus):
            with open(logs[r], "w") as f:
                command = [sys.executable, __file__, *argv, "--worker", str(r), str(gpus), port, folder]
                procs.append(subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=job_environment(args)))
        deadline, stopped = time.time() + args.timeout_s, False
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                stopped = True
                for other in procs:
                    other.kill()
                    other.wait()
                break
        files = [Path(folder) / f"rank{r}.json" for r in range(gpus)]
        if all(p.returncode == 0 for p in procs) and all(f.exists() for f in files):
            return [json.loads(f.read_text()) for f in files], logs[0].read_text(errors="replace")
        failed = [r for r, p in enumerate(procs) if p.returncode != 0] or list(range(gpus))
        tails = [
            f"rank {r} (exit {procs[r].returncode}):\n{logs[r].read_text(errors='replace')[-1500:]}" for r in failed
        ]  # noqa: E501
        if stopped:  # the last line (the row's error) says so, not what the killed ranks printed as they went
            said = [line for line in logs[0].read_text(errors="replace").splitlines() if line.strip()] or ["-"]
            tails.append(f"stopped after {args.timeout_s:g} s (--timeout_s); rank 0's last line: {said[-1]}")
        return [], "\n".join(tails)


def row_label(args, layout: str, gpus: int) -> str:
    """'2 GPUs' (data parallel), 'pipeline, 2 GPUs' (pipeline stages)."""
    count = f"{gpus} GPU" + ("s" if gpus > 1 else "")
    return count if layout == "data" else f"{layout_name(args, layout)}, {count}"


def layout_name(args, layout: str) -> str:
    """A row's layout as results name it: 'data parallel', 'pipeline', 'pipeline, one backward'."""
    if layout == "data":
        return "data parallel"
    return "pipeline, one backward" if args.one_backward else "pipeline"


def labelled(args, layout: str, row: dict) -> dict:
    """A row with its layout named where the result has pipeline rows (data-parallel-only results as before)."""
    if args.layout == "data":
        return row
    return {"layout": layout_name(args, layout), **row}


def row_of(gpus: int, ranks: list[dict], base: dict | None, label: str | None = None) -> dict:
    """A GPU count's figures from its processes' records; ``base``: the one-GPU row of its layout (None: this is
    it). A pipeline job's records carry its micro-batches: a step then trains that many samples, and lasts as long
    as its slowest stage's (each step's longest time over the stages)."""
    micro = ranks[0].get("micro_batches")
    if micro is None:
        step = statistics.median(ranks[0]["step_times_s"])
        samples = gpus / step
    else:
        step = statistics.median(max(times) for times in zip(*(r["step_times_s"] for r in ranks)))
        samples = micro / step
    row = {
        "method": label or f"{gpus} GPU" + ("s" if gpus > 1 else ""),
        "gpus": gpus,
        "median_step_s": step,
        "samples_per_s": samples,
        "warmup_steps": ranks[0]["warmup_steps"],
        "peak_allocated_gib": [r["peak_allocated_gib"] for r in ranks],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in ranks],
        "copy_gbps": [r["copy_gbps"] for r in ranks],
        "raw_h2d_gbps": [r["raw_h2d_gbps"] for r in ranks],
        "wait_ms_per_step": [r["wait_ms_per_step"] for r in ranks],
        "bytes_per_step": ranks[0]["bytes_per_step"],
        "host_pss_gib": sum(r["pss_gib"] for r in ranks),
        "host_rss_gib": [r["rss_gib"] for r in ranks],
        "host_rss_peak_gib": [r.get("rss_peak_gib") for r in ranks],
        "host_copy_gib": ranks[0]["host_copy_gib"] if micro is None else sum(r["host_copy_gib"] for r in ranks),
        "sharing_processes": ranks[0]["sharing_processes"],
        "streamed_layers": [r["streamed_layers"] for r in ranks],
    }
    if "thread_cpu_ms" in ranks[0]:
        row["thread_cpu_ms"] = [r["thread_cpu_ms"] for r in ranks]
    if gpus > 1 and "shared_fetch" in ranks[0]:  # whether each process copied 1/N of every layer and gathered the rest
        row["shared_fetch"] = bool(ranks[0]["shared_fetch"])
    if ranks[0].get("bound_cores") is not None:  # --bind_cores: each process's physical cores
        row["bound_cores"] = [r["bound_cores"] for r in ranks]
    if micro is not None:
        row["micro_batches"] = micro
        row["stage_layers"] = [r["stage_layers"] for r in ranks]
        row["stage_bytes_per_step"] = [r["bytes_per_step"] for r in ranks]
        row["stage_host_copy_gib"] = [r["host_copy_gib"] for r in ranks]
        row["losses"] = ranks[-1]["losses"]  # every step's, untimed ones too: the last stage computes them
    if "allreduce_ms" in ranks[0]:  # data parallel's (a pipeline has no all-reduce of its own timed)
        row["before_allreduce_ms"] = [r["before_allreduce_ms"] for r in ranks]
        row["allreduce_ms"] = [r["allreduce_ms"] for r in ranks]
        row["allreduce_mb"] = ranks[0]["allreduce_mb"]
    base = base or row
    row["vs_1gpu"] = samples / base["samples_per_s"]
    row["efficiency"] = row["vs_1gpu"] / gpus * base["gpus"]
    if micro is not None:
        row["bubble_bound"] = bubble_bound(gpus, micro) / bubble_bound(base["gpus"], micro)
    row["cap"] = cap_of(row, base)
    return row


def bubble_bound(stages: int, micro: int) -> float:
    """The most ``stages`` pipeline stages can speed a step of ``micro`` micro-batches up over one stage, with
    every stage equally fast and nothing waited on: DeepSpeed's schedule keeps a stage busy M of its M + N - 1
    slots."""
    return stages * micro / (micro + stages - 1)


def cap_of(row: dict, base: dict) -> str:
    """The shared resource that most likely caps a row short of N x one GPU's rate, or ""."""
    if row["gpus"] == base["gpus"] or row["efficiency"] >= EFFICIENT:
        return ""
    if "bubble_bound" in row:
        bound = row["bubble_bound"]
        micro, stages = row["micro_batches"], row["gpus"]
        bubble = f"the pipeline's bubble: {micro} micro-batches over {stages} stages reach {bound:.2f}x at most"
        if row["vs_1gpu"] >= EFFICIENT * bound:
            return bubble
        return f"{bubble}; short of it: {data_cap(row, base, 'unequal stages, or the sends between them')}"
    return data_cap(row, base, "the gradient all-reduce and collectives")


def data_cap(row: dict, base: dict, otherwise: str) -> str:
    """The shared resource (host-to-device copies) most likely behind a shortfall; ``otherwise`` if copies kept
    pace."""
    alone = statistics.mean(base["raw_h2d_gbps"]) or 0.0
    together = statistics.mean(row["raw_h2d_gbps"]) or 0.0
    waited = statistics.mean(row["wait_ms_per_step"]) - statistics.mean(base["wait_ms_per_step"])
    if waited > 0.05 * row["median_step_s"] * 1000:  # copies held the compute back: shared or not?
        if alone and together < SHARED_RATE * alone:
            busy = row["bytes_per_step"] / (statistics.mean(row["copy_gbps"]) or 1.0) / 1e6  # ms a step
            return (
                f"host-to-device bandwidth: plain copies on all {row['gpus']} GPUs at once ran at "
                f"{together / alone:.0%} of one GPU's alone, and the compute waited {waited:.0f} ms more per step on "
                f"copies (each copy stream busy {busy:.0f} ms of the {row['median_step_s'] * 1000:.0f} ms step)"
            )
        return f"copies: the compute waited {waited:.0f} ms more per step on them than on one GPU"
    if "allreduce_ms" not in row:  # a pipeline row (no all-reduce of its own timed), or an older result's
        return f"{otherwise} (copies kept pace)"
    longer = (row["median_step_s"] - base["median_step_s"]) * 1000
    reduce_ms = statistics.mean(row.get("allreduce_ms") or [0.0])
    before = row.get("before_allreduce_ms") or [0.0]
    skew = max(before) - min(before)
    if skew >= 0.5 * longer > 0:
        slowest = before.index(max(before))
        return (
            f"unequal ranks: rank {slowest}'s forward and backward took {skew:.0f} ms longer than the fastest's (each "
            f"process's own placement: streamed units {row['streamed_layers']}), of the {longer:.0f} ms the step grew"
        )
    if reduce_ms >= 0.5 * longer > 0:
        return (
            f"the gradient all-reduce: {reduce_ms:.0f} ms a step ({row.get('allreduce_mb', 0.0):.0f} MB, after the "
            f"backward) of the {longer:.0f} ms the step grew (copies kept pace)"
        )
    after = max(0.0, row["median_step_s"] * 1000 - max(before) - reduce_ms)  # the ranks' medians: may not add up
    if after >= 0.5 * longer > 0:
        return (
            f"after the all-reduce: {after:.0f} ms a step (a full fine-tune's: the host updates of its own share "
            f"of the layers that the step waits for) of the {longer:.0f} ms the step grew"
        )
    rate = statistics.mean(row["copy_gbps"]) / (statistics.mean(base["copy_gbps"]) or 1.0)
    cpu = ""
    if row.get("thread_cpu_ms") and base.get("thread_cpu_ms"):
        cpu = (
            f", the training thread's CPU time a step {max(row['thread_cpu_ms']):.0f} ms against "
            f"{base['thread_cpu_ms'][0]:.0f} ms"
        )
    return (
        f"contention in the forward and backward: the slowest rank's took {max(before):.0f} ms against one GPU's "
        f"whole step of {base['median_step_s'] * 1000:.0f} ms (its copies at {rate:.0%} of one GPU's rate{cpu}), "
        f"the all-reduce {reduce_ms:.0f} ms, {after:.0f} ms after it"
    )


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def description(args, record: dict) -> str:
    import wan

    if wan.runs_recipe(args):
        what = (
            f"toml/wan_lora_long_video.toml's settings, device memory capped at {args.memory_cap_gib:g} GiB per GPU, "
            f"PYTORCH_CUDA_ALLOC_CONF={job_environment(args).get('PYTORCH_CUDA_ALLOC_CONF')} (its command line sets "
            "expandable_segments:True)"
        )
    elif args.model in PIPELINE_MODELS:
        budget = "the tightest budget" if args.tiny else f"{args.vram_budget or DEFAULT_BUDGET[args.model]:g} GiB"
        what = f"--vram_budget {budget} per GPU"
        if args.model == "flux_full":
            what = (
                f"every weight trained with toml/two_gpus_full_flux_dev.toml's [optimizer] "
                f"({FULL_FLUX_OPTIMIZER['type']}: the streamed layers' on the host, --host_adam {args.host_adam}; the "
                f"resident ones' by the class train.py builds), clipping at 1.0, {what}; one stage runs its "
                "micro-batches layer-major, as dgls_train.py does"
            )
    else:
        what = (
            f"every weight trained, layers of {args.stream_mib:g} MiB or more streamed, host AdamW ({args.host_adam})"
        )

    layouts = {
        "data": "batch 1 per process, data parallel over 1 to N GPUs of one machine",
        "pipeline": (
            f"one model in N pipeline stages over 1 to N GPUs of one machine (DeepSpeed's PipelineModule, partition "
            f"'{args.partition}', a process per stage), {args.micro_batches} micro-batches of 1 per step, "
            + (
                "one backward per stage and micro-batch (--one_backward: DGLS's joined backward, as DeepSpeed 0.18.4)"
                if args.one_backward
                else f"DeepSpeed {deepspeed_version()}'s backward"
            )
        ),
    }
    how = "; ".join(
        (f"{layouts[layout]}" if args.layout == "data" else f"{layout} rows: {layouts[layout]}")
        for layout in args.layout.split(",")
    )
    bound = (
        "; each process bound to its own block of physical cores (their sibling threads too) and as many torch "
        "threads (--bind_cores)"
        if args.bind_cores
        else ""
    )
    if args.share_fetch != "auto":  # the data rows' modes (utils/dgls/memory/fetch_share.py)
        bound += f"; data rows above 1 GPU with share_fetch {' and '.join(args.share_fetch.split(','))}"
    return (
        f"{record['shape']}; {how}; {what}{bound}; "
        f"{record['streamed_layers']} of {record['entries']} swap units ({record['layers']} layers) streamed on rank 0"
    )


NOTES = [
    "samples/s: processes / median step (each process a sample per step); vs 1 GPU: its ratio to the 1-GPU row.",
    "VRAM, copy GB/s (DGLS's copies in the timed steps: bytes / copy-stream time) and raw H2D GB/s (1 GiB pinned "
    "copies run on every GPU at once) are per GPU, in rank order; host GiB is the job's processes' proportional set "
    "sizes summed, in which the one shared host copy (shared GiB) counts once.",
    "cap: for rows under 95% of N x one GPU's rate, the shared resource that most likely held it back.",
    "before ms: each process's forward and backward (GPU time to its all-reduce): the faster ranks wait the "
    "difference in the all-reduce. all-reduce ms: each step's gradient all-reduce (the mean of the gradients the "
    "processes do not update alone: the LoRA's, a full fine-tune's resident params'), flattening and copying back "
    "included, timed on the GPU; it runs after the backward, as DeepSpeed's does.",
    "thread CPU ms: the training thread's CPU time in a step (median; time.thread_time, its waits for the device "
    "included where they spin): more of it on several GPUs than on one, for the same work, points at a CPU shared "
    "by the processes (cores, clocks, memory bandwidth) rather than at the copies.",
]
SHARE_NOTES = [
    "share_fetch on: each of the N processes copies 1/N of every streamed layer from host memory and gathers the "
    "rest from the other GPUs (NCCL all-gather); its copy GB/s counts the whole layer over the copy stream's time, "
    "gather included. off: each process copies every layer itself (utils/dgls/memory/fetch_share.py).",
]
PIPELINE_NOTES = [
    "pipeline rows: one model, a stage per GPU, each streaming its own layers from its own host copy (shared GiB: "
    "the stages' copies summed); a step is every micro-batch through every stage, samples/s = micro-batches / median "
    "step (each step as long as its slowest stage's), vs 1 GPU against the 1-stage row of the same micro-batches; "
    "stages overlap only across micro-batches, so N stages reach N x M / (M + N - 1) at most (the bubble).",
]


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.micro_batches = args.micro_batches if args.micro_batches is not None else (2 if args.tiny else 4)
    if "pipeline" in args.layout and args.model not in PIPELINE_MODELS:
        raise SystemExit(f"--layout {args.layout}: pipeline rows are of the models {', '.join(PIPELINE_MODELS)}")
    if args.model == "flux_full" and args.layout != "pipeline":
        raise SystemExit(
            "--model flux_full: pipeline rows only (--layout pipeline), a Flux-dev full fine-tune in stages as "
            "toml/two_gpus_full_flux_dev.toml runs it; data-parallel full fine-tuning: --model sdxl_full"
        )
    if args.bind_cores and args.layout != "data":
        raise SystemExit(f"--bind_cores binds the data-parallel rows' processes: --layout data, not {args.layout}")
    if args.worker:
        worker(args)
        return None
    name = args.name or f"scaling_{args.model}"
    out = args.results_dir or results_dir(args.tiny)
    if args.merge:
        return merge(args, out)
    import torch

    counts = [int(n) for n in (args.gpus or ("1,2" if args.tiny else "1,2,4")).split(",")]
    if not args.tiny and torch.cuda.device_count() < max(counts):
        seen = torch.cuda.device_count()
        raise SystemExit(f"--gpus {args.gpus or '1,2,4'} needs {max(counts)} CUDA devices; {seen} seen")
    started = time.time()
    rows, record = [], None
    modes = args.share_fetch.split(",")
    if bad := [m for m in modes if m not in ("auto", "on", "off")]:
        raise SystemExit(f"--share_fetch {args.share_fetch}: {bad[0]!r} is not auto, on or off")
    for layout in args.layout.split(","):
        base = None
        jobs = [(gpus, mode) for gpus in counts for mode in (modes if gpus > 1 and layout == "data" else modes[:1])]
        for gpus, mode in jobs:
            label = row_label(args, layout, gpus) + (f", share_fetch {mode}" if len(modes) > 1 and gpus > 1 else "")
            if time.time() - started > args.deadline_s:
                rows.append(
                    labelled(
                        args,
                        layout,
                        {"method": label, "gpus": gpus, "skipped": f"past --deadline_s {args.deadline_s:g}"},
                    )
                )
                continue
            job_argv = [a for a in argv if a != "--strict"] + ["--job_layout", layout, "--job_share", mode]
            ranks, log = run_job(args, job_argv, gpus, name, layout)
            if not ranks:
                if args.strict:
                    raise RuntimeError(f"{label} failed:\n{log}")
                error = log.strip().splitlines()[-1] if log.strip() else "?"
                rows.append(labelled(args, layout, {"method": label, "gpus": gpus, "error": error}))
                continue
            record = record or ranks[0]
            row = labelled(args, layout, row_of(gpus, ranks, base, label))
            base = base or row
            rows.append(row)
            print(f"{label}: {row['samples_per_s']:.3f} samples/s ({row['vs_1gpu']:.2f}x)", flush=True)
            # the rows so far, written at once: a device call's limit that stops a later job keeps these
            write_result(scaling_result(args, argv, record, rows), name, out)
    result = scaling_result(args, argv, record, rows)
    write_result(result, name, out, echo=True)
    return result


def scaling_result(args, argv: list[str], record: dict | None, rows: list[dict]) -> dict:
    """The result of the rows measured so far (``record``: the first job's rank 0, for the title)."""
    import machine
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    return {
        "benchmark": "scaling",
        "model": args.model,
        "title": f"Scaling over GPUs: {record['title'] if record else args.model}",
        "description": description(args, record) if record else args.model,
        "environment": machine.environment(device),
        "tiny": args.tiny,
        "command": command_line(__file__, argv),
        "notes": NOTES
        + (SHARE_NOTES if args.share_fetch != "auto" else [])
        + (PIPELINE_NOTES if "pipeline" in args.layout else []),
        "rows": rows,
    }


def merge(args, out: Path) -> dict:
    """One result of the rows of earlier ones (one GPU count per device command): ratios to the 1-GPU row again,
    each layout's (and each micro-batch count's) rows to their own first row. Data-parallel rows keep their form
    unless pipeline rows join them (then every row names its layout, as a run of both layouts writes them)."""
    parts = [json.loads((out / f"{n}.json").read_text()) for n in args.merge.split(",")]
    models = {part["model"] for part in parts}
    if len(models) != 1:
        raise SystemExit(f"--merge joins the results of one model; these are of {', '.join(sorted(models))}")
    name = args.name or f"scaling_{models.pop()}"
    measured = [r for part in parts for r in part["rows"] if "samples_per_s" in r]
    if not measured:
        raise SystemExit("no measured rows to merge")
    mixed = any("micro_batches" in r for r in measured)
    groups: dict[tuple, list[dict]] = {}
    for row in measured:
        if mixed:
            row.setdefault("layout", "data parallel")
        groups.setdefault((row.get("layout", ""), row.get("micro_batches") or 0), []).append(row)
    one_stage = {micro: group[0] for (_, micro), group in groups.items() if micro and group[0]["gpus"] == 1}
    rows = []
    for key in sorted(groups, key=lambda k: (k[0] != "data parallel", k)):
        group = sorted(groups[key], key=lambda r: r["gpus"])
        # one stage runs the same either way (--one_backward changes stages that send on): a pipeline group measured
        # from 2 GPUs up takes the 1-stage row of its micro-batches from the other pipeline result
        base = group[0] if group[0]["gpus"] == 1 or not key[1] else one_stage.get(key[1], group[0])
        for row in group:
            row["vs_1gpu"] = row["samples_per_s"] / base["samples_per_s"]
            row["efficiency"] = row["vs_1gpu"] / row["gpus"] * base["gpus"]
            if "micro_batches" in row:
                micro = row["micro_batches"]
                row["bubble_bound"] = bubble_bound(row["gpus"], micro) / bubble_bound(base["gpus"], micro)
            row["cap"] = cap_of(row, base)
        rows += group
    notes = list(dict.fromkeys(note for part in parts for note in part["notes"]))
    descriptions = list(dict.fromkeys(part["description"] for part in parts))
    result = dict(
        parts[0],
        rows=rows,
        notes=notes,
        description=" | ".join(descriptions) if mixed else parts[0]["description"],
        command=" && ".join(p["command"] for p in parts),
    )
    write_result(result, name, out, echo=True)
    return result


if __name__ == "__main__":
    main()
