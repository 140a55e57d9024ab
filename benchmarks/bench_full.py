"""Full fine-tuning of the SDXL UNet (2.6B params), 1024x1024, batch 1, AdamW, side by side.

Every weight trains. Methods, each on the same layer list (sdxl.py, checkpointing as diffusion-pipe;
``--model flux``: Flux-dev's widths at 1024x1024, flux.py, with ``--flux_blocks`` double and single blocks,
every block checkpointed):

- ``resident``: everything on the GPU: bf16 weights for compute, fp32 masters and AdamW (fused, on the
  GPU) beside them, gradients summed into the masters' fp32 grads: the arithmetic DGLS keeps, all on
  the device (about 42 GiB of masters and moments; fits an 80 GB card).
- ``zero2-offload``: DeepSpeed ZeRO-2 with its optimizer offloaded to the CPU (bf16, DeepSpeedCPUAdam):
  what diffusion-pipe users reach for when a full fine-tune does not fit.
- ``dgls-split`` / ``dgls-device`` / ``dgls-torch_fused`` / ``dgls-deepspeed``: DGLS streams every layer
  above ``--stream_mib`` (prefetch ``--prefetch``); streamed layers keep fp32 masters and AdamW moments in
  host memory and send their gradients home; their AdamW step runs on the GPU with the state streamed in
  and back (``device``), on the CPU (torch's fused kernel, or DeepSpeedCPUAdam), or each layer on whichever
  of the two would finish it sooner at the rates measured on earlier steps (``split``; 'updated on GPU' is
  the GPU's share of the params in the timed steps). Small resident layers train with AdamW on the GPU.
  With clipping, each layer's update starts as its gradients land, at coefficient 1, and a step that clips redoes
  them (utils/dgls/training/speculation.py); ``dgls-IMPL-wait`` (not in the default list) makes them wait for
  the norm, as before; ``dgls-IMPL-prevnorm`` (opt-in, inexact: utils/dgls/training/previous_norm.py) starts
  them as their gradients land, scaled by the previous step's clip coefficient. 'grad norm' is the median norm of
  the timed steps (the synthetic data decides whether a step clips), 'speculation' what became of the speculative
  updates since the method started (prevnorm: how many started before their step's norm). ``dgls-device+triton``
  (``--optimizer AdamW8bit``, not in the default list): bitsandbytes' Triton kernels on the updater's stream
  instead of its CUDA kernels on the compute stream (utils/dgls/training/bitsandbytes_kernel.py).
- ``torchao-offload`` (not in the default list): diffusion-pipe's ``[optimizer] type = 'offload'``, built as its
  train.py builds it: torchao's ``CPUOffloadOptimizer(groups, torch.optim.AdamW, fused=True, ...)`` over the model's
  bf16 params, everything else on the GPU; ``--offload_gradients`` passes its option of that name. CUDA only.
- ``dp-recipe`` (not in the default list): diffusion-pipe's 24 GB full fine-tune recipe, everything on the GPU:
  ``adamw8bitkahan`` with ``gradient_release = true`` (an optimizer per param, stepped in its post-accumulate-grad
  hook, every micro-batch, no clipping); AdamW8bitKahan from ``--dp_checkout`` (or DGLS_DIFFUSION_PIPE), else
  bitsandbytes' AdamW8bit, the row's 'optimizer' saying which and why. Both: benchmarks/full_methods.py. A method
  whose library (or CUDA) is missing is a row that says so ('skipped').

``--accumulation N``: N micro-batches a step (diffusion-pipe's gradient_accumulation_steps; the same inputs each, each
loss scaled by 1 / N) in every method. Resident and DGLS methods run them layer-major (``--layer_major on``, the
default: each layer over all N micro-batches, then the next; DGLS then copies each streamed layer in once a
direction and sends its gradient sum home once a step), one after another (``off``), or a row each (``both``).
Every row has its per-sample time; 'vs resident' is against all-resident with the same micro-batches (one after
another where that row was measured); DGLS's and torchao's rows have the GiB copied to the device and home per step
(measured on the transport's copies, the warm-up's left out).

With ``--vram_budget GiB`` the DGLS methods place layers by the planner instead of ``--stream_mib``: step 1 is its
probe, and the plan it fixes before step 1's update stays for the run; the row names the placement (as the flags
that give it without the probe), and the peak reserved is the budget's check (a config's figures):

    python benchmarks/bench_full.py --model sdxl --vram_budget 21 --methods resident,dgls-split --steps 4 --warmup 2

Each method runs in a process of its own (so no method's memory counts in another's), one after
another on the same machine. Per method: median step, ratio to ``resident``, peak VRAM, the process's
peak RSS, and for DGLS the share of the step the training thread spent waiting on the host optimizer (a
fetch waiting for its layer's update, or the clip waiting for the last gradients) and the host's own
seconds per step summing gradients and updating. Writes benchmarks/results/full_sdxl.json and .md.

    python benchmarks/bench_full.py --steps 3  # H100: about 7 minutes
    python benchmarks/bench_full.py --tiny     # smoke test on CPU
    python benchmarks/bench_full.py --model flux --flux_blocks 5,10 --methods resident,dgls-split

Flux-dev itself (11.9B params) needs about 16 bytes of host RAM per param for DGLS with AdamW (fp32 master,
two fp32 moments, the gradient landing and the bf16 copy that streams): about 190 GB, more than the 128 GiB
of the lent machines, and its all-resident step does not fit on an 80 GB card. ``--flux_blocks`` keeps the
widths (a double block is 340M params, a single one 142M) and cuts the depth to what both fit;
``--optimizer sgd`` (no momentum, no state: 8 bytes a param) trains all of it:

    python benchmarks/bench_full.py --model flux --flux_blocks 19,38 --optimizer sgd --methods dgls-torch_fused

``--optimizer`` takes any [optimizer] type DGLS trains streamed layers with (utils/dgls/training/optimizer_types.py:
``AdamW8bit``, ``Lion``, ``CAME``, ``Prodigy`` ...), built as a diffusion-pipe table ``{type, lr}`` builds it; a type
that steps its own class runs it where DGLS's default puts it (method ``dgls-auto``: the CPU, but the device for
``AdamW8bit`` and ``Lion``, whose device kernels run their class's numbers; ``dgls-torch`` keeps them on the CPU), and
the resident method steps the same class on the device.
Every row records the host RAM it took: the process's peak RSS (the kernel's high-water mark, and the largest sample
after a step), the page-locked bytes, and for DGLS the optimizer state the RAM check counted beside
what the host optimizers hold after the timed steps, so a table of host RAM per optimizer type is one run per type:

    for o in adamw AdamW8bit Lion CAME Prodigy; do python benchmarks/bench_full.py --model flux --flux_blocks 19,38 \
        --optimizer $o --methods dgls-auto --steps 2 --name full_flux_ram_$o; done
    python benchmarks/bench_full.py --merge full_flux_ram_adamw,full_flux_ram_AdamW8bit,... --name full_flux_ram

``--merge A,B,...`` (no device) joins results of one model and shape that differ only in ``--optimizer`` into one
(``--name``), each row's method naming its optimizer type.

A host RAM budget (the disk tier, utils/dgls/training/disk_state.py): a DGLS method ``dgls-IMPL@GiB`` runs with
``host_ram_budget = GiB`` (``--disk_dir``: where its files go); the masters and AdamW moments of the layers that do
not fit are read from disk for their update and written back after it (the weights too, once every state is there).
The row counts the layers whose state and whose weights live on disk and the GiB read and written per step; beside
the all-in-RAM method in the same run:

    python benchmarks/bench_full.py --model flux --flux_blocks 19,38 --clip 0 \
        --methods dgls-torch_fused,dgls-torch_fused@64 --disk_dir /tmp --steps 3

Device commands for issues 35 and 36 (SDXL, 1024x1024; each one call of under 10 minutes on an H100 or H200, as one
``bench:`` step of benchmarks/device_session.sh: ``bench:bench_full.py:--methods=...:--steps=3``). torchao travels as a
wheel in .whl (torchao-0.17.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, the release built for the
device's torch 2.11), bitsandbytes as .bnb, and diffusion-pipe's optimizers/ folder as .dp/optimizers (AdamW8bitKahan):

    # 35: diffusion-pipe's ways beside DGLS and ZeRO-2 offload, clipping at 1.0 (dp-recipe never clips), then 0
    python benchmarks/bench_full.py --methods resident,dgls-split,zero2-offload,torchao-offload,dp-recipe \
        --steps 3 --warmup 2 --dp_checkout .dp --name full_sdxl_dp_ways
    python benchmarks/bench_full.py --methods resident,dgls-split,zero2-offload,torchao-offload --clip 0 \
        --steps 3 --warmup 2 --name full_sdxl_dp_ways_noclip
    # 35: clipping at 1.0 where no step clips (the loss times 0.01: the random model's norm of ~29 under the limit,
    # as a fine-tune's usually is), so DGLS keeps the updates it speculated before the norm was known
    python benchmarks/bench_full.py --methods resident,dgls-split,dgls-device --loss_scale 0.01 --steps 4 \
        --warmup 2 --name full_sdxl_clip_kept
    # 36: 4 micro-batches a step, resident and DGLS one after another and layer-major (4 rows), clipping at 1.0
    python benchmarks/bench_full.py --methods resident,dgls-split --accumulation 4 --layer_major both \
        --steps 3 --warmup 1 --name full_sdxl_accum4
    # 36 on a 24 GB budget: DGLS placed by the planner (its probe a layer-major step of 4 micro-batches)
    python benchmarks/bench_full.py --methods resident,dgls-split --accumulation 4 --layer_major both \
        --vram_budget 21 --steps 3 --warmup 1 --name full_sdxl_accum4_budget21
    # diffusion-pipe's ways with the same 4 micro-batches (per-sample time against the same resident)
    python benchmarks/bench_full.py --methods resident,torchao-offload,dp-recipe,zero2-offload --accumulation 4 \
        --steps 3 --warmup 1 --dp_checkout .dp --name full_sdxl_accum4_dp_ways
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import full_methods  # noqa: E402
import machine  # noqa: E402
import sdxl  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import peaks, reset_peaks, time_steps  # noqa: E402
from units import GiB  # noqa: E402

from utils.dgls import DGLSUserError, LayerSwapper, Listener, SwapConfig  # noqa: E402
from utils.dgls.engine.layer_major import layer_major_step  # noqa: E402
from utils.dgls.memory.transport import Direction  # noqa: E402
from utils.dgls.planning.row_copies import index_ranges  # noqa: E402
from utils.dgls.trainers.shm_op import without_shm_op  # noqa: E402
from utils.dgls.training import optimizer_types  # noqa: E402
from utils.dgls.training.host_optimizer import HostOptimizerSpec  # noqa: E402
from utils.dgls.training.optimizer_state import held_bytes  # noqa: E402

LR, BETAS, WD, EPS = 1e-5, (0.9, 0.99), 0.01, 1e-8
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD without momentum"}  # others: "[optimizer] type NAME"
METHODS = ("resident", "dgls-split", "dgls-device", "dgls-torch_fused", "dgls-deepspeed", "zero2-offload")
OTHERS = ("torchao-offload", "dp-recipe")  # diffusion-pipe's own ways (full_methods.py); not in the default list
LAYER_MAJOR = ("resident", "dgls-")  # the methods --layer_major applies to (prefixes)
NOTES = [
    "Every weight trains (no LoRA). 'host optimizer wait': the share of DGLS's step the training thread spent "
    "blocked on the host optimizer (a fetch waiting for its layer's update, or clipping waiting for the last "
    "gradients); the rest of the host work ran beside the GPU. With dgls-device the AdamW steps run on the GPU "
    "and a fetch waits for its layer's update there, so the training thread does not block on them: 'GPU wait' "
    "is the share of the step the compute stream waited for fetches (CUDA only), which then includes those "
    "updates. "
    "'host RSS': the process's peak resident memory since the method started (masters, gradient sums and AdamW "
    "moments live there for DGLS and ZeRO-offload): 'host_rss_gib' the largest sample after a step, "
    "'host_rss_peak_gib' the kernel's high-water mark of the method's process (building the model included). "
    "'pinned_gib': page-locked host bytes (CUDA only). 'host_state_counted_gib': the optimizer state the RAM check "
    "counted for streamed layers; 'host_state_held_gib': what the host optimizers hold after the timed steps.",
    "With several micro-batches a step: 'per sample' is the step over the micro-batches; 'copied GiB/step' the bytes "
    "the DGLS transport (or torchao) copied to the device and home in a timed step. torchao-offload and dp-recipe "
    "train the model's own bf16 params (no fp32 masters), as diffusion-pipe does; their 'optimizer' column says what "
    "ran (benchmarks/full_methods.py), and 'pinned' is torch's caching host allocator's page-locked bytes.",
]


class PeakRss:
    """The process's peak RSS, sampled after every step."""

    def __init__(self) -> None:
        self.process, self.peak = psutil.Process(), 0

    def sample(self) -> None:
        self.peak = max(self.peak, self.process.memory_info().rss)


def fresh_bench(
    tiny: bool,
    device: torch.device,
    dtype: torch.dtype,
    on: torch.device,
    model: str = "sdxl",
    depth: tuple[int, int] | None = None,
):
    """The model's layers built on ``on``, every weight trainable, inputs and target on ``device``;
    ``depth``: Flux's (double, single) blocks."""
    if model == "flux":
        bench = flux.build(tiny, on, dtype, lora=False, depth=depth)
    else:
        bench = sdxl.build(tiny, on, dtype, lora=False)
    for layer in bench.layers:
        layer.requires_grad_(True)
    bench.inputs = tuple(t.to(device) for t in bench.inputs)
    bench.target = bench.target.to(device)
    return bench


def flux_depth(args) -> tuple[int, int]:
    double, single = (int(n) for n in args.flux_blocks.split(","))
    return double, single


forward_backward = full_methods.forward_backward  # one micro-batch (its loss scaled by 1 / micro-batches)


def micro_batches(bench, count: int, layer_major: bool, swapper=None, scale: float = 1.0) -> None:
    """A step's ``count`` micro-batches (the bench's inputs each), each loss scaled by ``scale / count``: one after
    another, or layer-major (each layer over all of them, then the next: utils/dgls/engine/layer_major.py, the
    engine ``swapper`` streaming the layers)."""
    if not layer_major:
        for _ in range(count):
            forward_backward(bench, scale / count)
        return
    run = [
        partial(checkpoint, layer, use_reentrant=False) if i in bench.checkpointed else layer
        for i, layer in enumerate(bench.layers)
    ]

    def loss(h, _m: int) -> torch.Tensor:
        return F.mse_loss(h.float(), bench.target.float()) * (scale / count)

    layer_major_step(run, [bench.inputs] * count, loss, swapper)


def optimizer_type(name: str) -> str:
    """``--optimizer``: ``adamw``, ``sgd`` or any [optimizer] type DGLS trains streamed layers with (as spelled in a
    diffusion-pipe table); a refused or unknown one is argparse's error, with DGLS's line."""
    if name in OPTIMIZERS:
        return name
    try:
        optimizer_types.lookup(name)
    except Exception as exc:  # noqa: BLE001 - DGLSUserError: its line is the message
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def describe_optimizer(name: str) -> str:
    return OPTIMIZERS.get(name, f"[optimizer] type {name!r}")


def host_spec(optimizer: str, implementation: str) -> HostOptimizerSpec:
    """The host optimizer DGLS runs: AdamW, SGD without momentum (no state: 8 bytes of host RAM a param), or another
    [optimizer] type, as a diffusion-pipe table of its type and lr builds it (its class's defaults otherwise)."""
    if optimizer == "sgd":
        return HostOptimizerSpec(type="sgd", lr=LR, weight_decay=0.0, implementation=implementation)
    if optimizer == "adamw":
        return HostOptimizerSpec(lr=LR, betas=BETAS, weight_decay=WD, eps=EPS, implementation=implementation)
    return HostOptimizerSpec.from_table({"type": optimizer, "lr": LR}, implementation)


def device_optimizer(params: list, optimizer: str) -> torch.optim.Optimizer:
    """The same optimizer over params on the device (resident layers, and the all-resident method)."""
    fused = {"fused": True} if params[0].is_cuda else {"foreach": False}
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR, weight_decay=0.0, **fused)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **fused)
    return host_spec(optimizer, "auto").trainer_optimizer(params)  # the type's class, as train.py builds it


def resident_step(
    bench, clip: float, optimizer_name: str = "adamw", accumulation: int = 1, layer_major: bool = False, scale=1.0
) -> Callable[[], None]:
    """Everything on the device; ``accumulation`` micro-batches a step, one after another or ``layer_major`` (the
    schedule alone: nothing streams, so it copies nothing either way)."""
    params = [p for layer in bench.layers for p in layer.parameters()]
    masters = [p.detach().float() for p in params]
    optimizer = device_optimizer(masters, optimizer_name)

    def step() -> None:
        micro_batches(bench, accumulation, layer_major, scale=scale)
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)

    return step


def zero2_step(bench, device, clip: float, accumulation: int = 1) -> tuple[Callable[[], None], object]:
    import deepspeed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not torch.distributed.is_initialized():
        with without_shm_op():  # as in DGLS runs: no CPU shared-memory op to build or wait for
            deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)

    class Stack(torch.nn.Module):  # the layers as one module for DeepSpeed; the step runs them itself
        def __init__(self, layers):
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "bf16": {"enabled": device.type == "cuda"},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "steps_per_print": 10**9,
    }
    model = Stack(bench.layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    layers = list(engine.module.layers)

    def step() -> None:  # the engine scales each loss by 1 / accumulation and steps at the last micro-batch
        for _ in range(accumulation):
            h = bench.inputs
            for i, layer in enumerate(layers):
                h = checkpoint(layer, h, use_reentrant=False) if i in bench.checkpointed else layer(h)
            loss = F.mse_loss(h.float(), bench.target.float())
            engine.backward(loss)
            engine.step()

    return step, engine


def dgls_spec(implementation: str, optimizer: str) -> tuple[HostOptimizerSpec, str]:
    """A DGLS method's host optimizer and its clipping variant, from its ``IMPL[+LAUNCH][-wait|-prevnorm]`` (the
    method's name after ``dgls-``, less its ``@GiB``; ``+triton``: the own class's Triton kernels)."""
    implementation, _, wait = implementation.partition("-")
    if wait not in ("", "wait", "prevnorm"):
        raise ValueError(
            f"a DGLS method is dgls-IMPL, dgls-IMPL-wait or dgls-IMPL-prevnorm, got dgls-{implementation}-{wait}"
        )
    implementation, _, launch = implementation.partition("+")
    spec = host_spec(optimizer, implementation)
    return (dataclasses.replace(spec, kernel_launch=launch) if launch else spec), wait


def dgls_step(
    bench,
    device,
    implementation: str,
    stream_mib: float,
    prefetch: int,
    clip: float,
    optimizer="adamw",
    budget: float | None = None,
    log: Callable[[str], None] | None = None,
    ram: dict | None = None,
    accumulation: int = 1,
    layer_major: bool = False,
    scale: float = 1.0,
    gpu_layers: list[int] | None = None,
):
    """DGLS's step of ``implementation`` (``IMPL``, or ``IMPL-wait``: with clipping, updates wait for the gradient norm
    instead of speculating; ``IMPL-prevnorm``: clip_mode previous_norm): layers of ``stream_mib`` or more streamed, or
    with ``budget`` (GiB) the planner's placement, its plan fixed before step 1's update (``log`` hears the plan; the
    trainer's optimizer then holds every param, as diffusion-pipe's does, and the layers the plan keeps resident bring
    their gradients to it). Returns the step, the swapper and the list each step's gradient norm is appended to.
    ``accumulation`` micro-batches a step: one after another (the host training told ``accumulation_steps``), or
    ``layer_major`` (each layer's gradients summed on the device over the micro-batches and sent home once: the host
    training sees one a step). ``gpu_layers``: the layers kept on the GPU, by hand (a placement a budget's probe
    printed), instead of ``stream_mib``'s."""
    spec, wait = dgls_spec(implementation, optimizer)
    sizes = bench.sizes  # measured before anything was trainable: streamable = every param of the layer
    common = dict(host_optimizer=spec, clip_grads=bool(clip), speculate_clipping=wait != "wait", **(ram or {}))
    if wait == "prevnorm":
        common["clip_mode"] = "previous_norm"
    common["accumulation_steps"] = 1 if layer_major else accumulation
    if budget is not None:
        config = SwapConfig.of(vram_budget=budget, **common)
    else:
        small = [s.index for s in sizes if s.streamable_bytes < stream_mib * 2**20]
        resident = small if gpu_layers is None else gpu_layers
        config = SwapConfig.of(gpu_layers=resident, prefetch=prefetch, **common)
    swapper = LayerSwapper(bench.layers, config, device=device, log=log)
    training = swapper.training
    params = [p for layer in bench.layers for p in layer.parameters()]
    device_params = params if budget is not None else [p for p in params if not training.owns(p)]
    trainer = device_optimizer(device_params, optimizer) if device_params else None
    training.adopt(params)  # a whole step's instance (Prodigy ...) steps every param, as train.py's one does
    norms: list[float] = []

    def step() -> None:
        micro_batches(bench, accumulation, layer_major, swapper, scale)
        training.before_step()  # under a budget, the first fixes the plan (clipping would call it too)
        if clip:
            norms.append(float(training.clip_grad_norm_(params, clip)))
        training.take_resident_grads()  # a whole step: resident params' gradients to its instance
        if trainer is not None:
            trainer.step()
            trainer.zero_grad(set_to_none=True)
        training.step()

    return step, swapper, norms


def applies_layer_major(name: str, micro_batches: int) -> bool:
    """Whether --layer_major changes ``name``'s step: resident and DGLS methods with several micro-batches a step (one
    micro-batch runs as before, so rows without --accumulation stay comparable with earlier results)."""
    return name.startswith(LAYER_MAJOR) and micro_batches > 1


def measure(name: str, args, device, dtype) -> dict:
    count = args.accumulation
    layer_major = args.layer_major == "on" and applies_layer_major(name, count)
    row: dict = {"method": name, "micro_batches": count, "layer_major": layer_major}
    rss = PeakRss()
    began = time.perf_counter()
    # built on the device (fast, and the same weights for every method), then moved to the host for DGLS
    bench = fresh_bench(args.tiny, device, dtype, device, args.model, flux_depth(args))
    if name.startswith("dgls-"):
        for layer in bench.layers:
            layer.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["trained_params_b"] = sum(p.numel() for layer in bench.layers for p in layer.parameters()) / 1e9
    cleanup: Callable[[], None] = gc.collect  # replaced by the method's own clean-up
    training = swapper = None
    norms: list[float] = []
    copies: Callable[[], dict] | None = None  # the bytes copied since its last call, per direction
    hyper = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
    try:
        if name == "resident":
            step = resident_step(bench, args.clip, args.optimizer, count, layer_major, args.loss_scale)
        elif name == "zero2-offload":
            if args.optimizer != "adamw":
                raise ValueError("the ZeRO-2 offload method runs AdamW only")
            step, engine = zero2_step(bench, device, args.clip, count)
            cleanup = engine.destroy
        elif name == "torchao-offload":
            if args.optimizer != "adamw":
                raise ValueError("diffusion-pipe's 'offload' type is torchao's CPUOffloadOptimizer over AdamW only")
            step, figures, copies = full_methods.torchao_offload_step(
                bench, device, args.clip, count, args.offload_gradients, hyper
            )
            row.update(figures)
        elif name == "dp-recipe":
            step, figures = full_methods.dp_recipe_step(bench, device, count, args.dp_checkout, hyper)
            row.update(figures)
        elif name.startswith("dgls-"):
            impl, _, ram_gib = name.split("-", 1)[1].partition("@")
            ram = dict(host_ram_budget=float(ram_gib), disk_dir=args.disk_dir) if ram_gib else None
            plan: list[str] = []

            def log(line: str) -> None:  # the planner's placement; the state plan's line (which states on disk)
                if "without the probe" in line:
                    plan.append(line.split("this run): ", 1)[1])
                elif line.startswith("DGLS disk state plan:"):
                    row["state_plan"] = line

            step, swapper, norms = dgls_step(
                bench, device, impl, args.stream_mib, args.prefetch, args.clip, args.optimizer, args.vram_budget,
                log, ram, count, layer_major, args.loss_scale, args.gpu_layers,
            )  # fmt: skip
            training = swapper.training
            counter = full_methods.CopyCounter()
            swapper.add_listener(counter)
            copies = counter.take
            cleanup = swapper.remove
            disk = DiskBytes()
            swapper.add_listener(disk)
        else:
            known = ", ".join(METHODS + OTHERS)
            raise ValueError(f"unknown method {name!r}: one of {known}, or dgls-IMPL-wait, dgls-IMPL-prevnorm")
        reset_peaks(device)
        progress(f"{name}: built in {time.perf_counter() - began:.0f} s")
        for k in range(1 + args.warmup):  # the first step builds optimizer state and kernels (and fixes a plan)
            began = time.perf_counter()
            step()
            progress(f"{name}: untimed step {k + 1} of {1 + args.warmup} took {time.perf_counter() - began:.1f} s")
        if swapper is not None:
            sizes = swapper.placement.sizes  # the entries (a budget may split layers into swap units)
            row["streamed_gib"] = sum(sizes[i].streamable_bytes for i in swapper.streamed_layers) / GiB
            if args.vram_budget is not None:
                row["placement"] = plan[-1] if plan else "everything streamed"
        waited = training.waited_s if training is not None else 0.0
        jobs = dict(training.job_s) if training is not None else {}
        copies_before = swapper.total_stats(sync=True) if swapper is not None else None
        if swapper is not None:
            disk.read = disk.written = 0
        copied: list[dict] = []
        if copies is not None:
            copies()  # the warm-up's copies: not counted

        timed = [time.perf_counter()]

        def after() -> None:
            rss.sample()
            if copies is not None:
                copied.append(copies())
            timed.append(time.perf_counter())
            progress(f"{name}: timed step {len(timed) - 1} of {args.steps} ended, {timed[-1] - timed[-2]:.1f} s")

        times, _ = time_steps(step, device, 0, args.steps, after=after)
        if copied:
            directions = sorted({d for c in copied for d in c})
            per_step = {d: statistics.median(c.get(d, 0) for c in copied) / GiB for d in directions}
            row["copied_gib_per_step"] = per_step
            row["copied_total_gib_per_step"] = statistics.median(sum(c.values()) for c in copied) / GiB
        if training is not None:
            state = training.disk_state
            row["state_layers_on_disk"] = len(state.spilled) if state is not None else 0
            row["state_layers"] = index_ranges(state.spilled) if state is not None else ""
            row["weight_layers_on_disk"] = len(swapper.store.disk_layers)
            row["disk_read_gib_per_step"] = disk.read / len(times) / GiB
            row["disk_written_gib_per_step"] = disk.written / len(times) / GiB
            row["host_wait_share"] = (training.waited_s - waited) / sum(times)
            # the compute stream waiting for fetches: with dgls-device, fetches wait for their layer's update
            row["compute_wait_share"] = swapper.total_stats(sync=True).since(copies_before).wait_ms / 1000 / sum(times)
            for kind, seconds in training.job_s.items():
                row[f"host_{kind}_s"] = (seconds - jobs[kind]) / len(times)
            row["host_optimizer"] = training.implementation
            row["pinned_gib"] = swapper.pinned_bytes / GiB  # packed copies, landings (and device updates' state)
            row["host_state_counted_gib"] = training.layout.parts()["optimizer"] / GiB  # the RAM check's figure
            row["host_state_held_gib"] = host_state_held(training) / GiB
            row["host_training"] = {name: n / GiB for name, n in training.layout.parts().items()}
            if training.split is not None:  # the split of the last step, and the rates it came from
                row["device_share"] = training.split.device_share
                row["split"] = training.split.describe()
            if norms:
                row["grad_norm"] = statistics.median(norms[-len(times) :])
            row["speculation"] = training.speculation.describe()
            if training.previous_norm is not None:
                row["speculation"] = training.previous_norm.describe()
        else:  # torch's caching host allocator: torchao's host copies, DeepSpeed's pinned buffers (CUDA only)
            row["pinned_gib"] = full_methods.host_pinned_bytes(device) / GiB
        row.update(median_step_s=statistics.median(times), step_times_s=times, steps=len(times), **peaks(device))
        row["per_sample_s"] = row["median_step_s"] / count
        row["host_rss_gib"] = rss.peak / GiB
        high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; updated lazily
        row["host_rss_peak_gib"] = max(high_water, rss.peak) / GiB
    except full_methods.Skip as exc:  # a method this machine cannot run (a library missing, no CUDA): why
        row["skipped"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - a method that cannot run is a row that says why
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        cleanup()
        del bench
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


class DiskBytes(Listener):
    """Bytes the transport reads from and writes to disk (the disk tier's weights and training state)."""

    def __init__(self) -> None:
        self.read = self.written = 0

    def copied(self, copy) -> None:
        if copy.direction is Direction.DISK_IN:
            self.read += copy.nbytes
        elif copy.direction is Direction.DISK_OUT:
            self.written += copy.nbytes


def host_state_held(training) -> int:
    """Bytes of the state tensors the host optimizers of streamed layers hold (a whole step's instance: the streamed
    layers' masters' share of it)."""
    if training.whole is not None:
        masters = [tp.master for layer in training.layers.values() for tp in layer.params]
        return held_bytes(training.whole.optimizer, masters)
    return sum(held_bytes(layer.optimizer) for layer in training.layers.values() if layer.optimizer is not None)


def layer_list(text: str) -> list[int]:
    """``--gpu_layers``: comma-separated layer indices."""
    try:
        return sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer indices separated by commas, e.g. 0,4,58, got {text!r}") from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke test)")
    parser.add_argument("--model", choices=("sdxl", "flux"), default="sdxl")
    parser.add_argument("--flux_blocks", default="5,10", help="--model flux: double,single blocks (Flux-dev has 19,38)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--optimizer",
        type=optimizer_type,
        default="adamw",
        help="adamw, sgd (without momentum: no optimizer state), or any [optimizer] type DGLS trains streamed layers "
        "with (AdamW8bit, Lion, CAME, Prodigy ...; its own class runs where DGLS's default puts it: method dgls-auto)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--stream_mib", type=float, default=64.0, help="stream layers of at least this many MiB")
    parser.add_argument(
        "--vram_budget", type=float, default=None, help="GiB: DGLS methods place layers by the planner (not stream_mib)"
    )
    parser.add_argument(
        "--gpu_layers",
        type=layer_list,
        default=None,
        help="DGLS methods: the layers kept on the GPU, e.g. 0,4,14,58 (the placement a --vram_budget run printed, by "
        "hand: no probe step with every layer streamed), instead of --stream_mib's",
    )
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--disk_dir", default=None, help="dgls-IMPL@GiB methods: the disk tier's directory")
    parser.add_argument(
        "--clip", type=float, default=1.0, help="gradient clipping norm; 0: none (DGLS then updates during backward)"
    )
    parser.add_argument(
        "--loss_scale",
        type=float,
        default=1.0,
        help="resident and DGLS methods: the loss times this; below the random model's norm over --clip, steps that "
        "do not clip (a fine-tune's usual case), whose speculated updates DGLS keeps",
    )
    parser.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches a step (gradient_accumulation_steps), every method"
    )
    parser.add_argument(
        "--layer_major",
        choices=("on", "off", "both"),
        default="on",
        help="resident and DGLS methods with --accumulation: each layer over all micro-batches, then the next (on), "
        "micro-batches one after another (off), or a row each (both)",
    )
    parser.add_argument(
        "--offload_gradients", action="store_true", help="torchao-offload: free device gradients once copied home"
    )
    parser.add_argument(
        "--dp_checkout",
        default=None,
        help="dp-recipe: diffusion-pipe checkout for AdamW8bitKahan (or DGLS_DIFFUSION_PIPE)",
    )
    parser.add_argument("--name", default=None, help="results file stem (default: full_MODEL)")
    parser.add_argument("--merge", default=None, help="comma list of result names (one model, one --optimizer each)")
    parser.add_argument("--results_dir", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one method, write its row to --row
    parser.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gpu_layers is not None and args.vram_budget is not None:
        parser.error("--gpu_layers places the layers by hand, --vram_budget by the planner: give one")
    if args.accumulation < 1:
        parser.error("--accumulation is a count of micro-batches: 1 or more")
    if not (args.loss_scale > 0 and math.isfinite(args.loss_scale)):
        parser.error("--loss_scale must be a finite number > 0")
    others = [m for m in args.methods.split(",") if not m.startswith(LAYER_MAJOR)]  # not micro_batches' loss
    if args.loss_scale != 1.0 and others:
        parser.error(f"--loss_scale scales the resident and DGLS methods' loss only: drop {', '.join(others)}")
    for name in args.methods.split(","):  # a DGLS method's optimizer settings, checked before any method runs
        if name.startswith("dgls-"):
            try:
                spec, _ = dgls_spec(name.split("-", 1)[1].partition("@")[0], args.optimizer)
                if spec.kernel_launch != "cuda":  # another launch of an own class's kernel: its device and library
                    spec.device_kernel().check_device(machine.device())
            except (DGLSUserError, ValueError) as exc:
                parser.error(f"--methods {name}: {exc} (drop {name} from --methods)")
    if args.merge and not args.name:
        parser.error("--merge writes one result: name it with --name")
    args.name = args.name or f"full_{args.model}"
    if args.tiny:
        args.stream_mib = 0.001
    return args


def runs(args) -> list[tuple[str, str]]:
    """(method, --layer_major) of each row, in order: with ``--layer_major both``, the methods it applies to twice."""
    out = []
    for name in args.methods.split(","):
        if args.layer_major == "both" and applies_layer_major(name, args.accumulation):
            out += [(name, "off"), (name, "on")]
        else:
            out.append((name, "off" if args.layer_major == "both" else args.layer_major))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.merge:
        return merge(args.merge.split(","), args.name, args.results_dir or results_dir(args.tiny))
    if args.one:
        with machine.session(args.tiny) as (device, dtype):
            args.row.write_text(json.dumps(measure(args.one, args, device, dtype)))
        return {}
    started = time.time()
    rows: list[dict] = []
    with machine.session(args.tiny) as (device, _):
        environment = machine.environment(device)
    own = sys.argv[1:] if argv is None else list(argv)
    for name, layer_major in runs(args):  # the result is rewritten after each method: a cut-off run keeps some
        lm = layer_major == "on" and applies_layer_major(name, args.accumulation)
        failed = {"micro_batches": args.accumulation, "layer_major": lm}
        rows.append(_in_subprocess(name, [*own, "--layer_major", layer_major], failed))
        result = _result(args, argv, environment, rows, started)
        write_result(result, args.name, args.results_dir or results_dir(args.tiny), echo=True)
    return result


def merge(names: list[str], name: str, out: Path) -> dict:
    """One result of the rows of runs that differ only in ``--optimizer`` (a host RAM table per optimizer type is one
    run per type): each row's method gets its run's type, and the description names none. Runs of another model,
    shape, setting or machine (a title, description, environment or command that differs in more than the optimizer
    and the name) are refused, as is a name without a result."""
    names = [n.strip() for n in names if n.strip()]
    missing = [n for n in names if not (out / f"{n}.json").is_file()]
    if missing:
        raise SystemExit(f"--merge: no result named {', '.join(missing)} in {out}")
    parts = [json.loads((out / f"{n}.json").read_text()) for n in names]
    rows, described = [], set()
    for part in parts:
        found = re.search(r"--optimizer[= ](\S+)", part["command"])
        kind = part.get("optimizer") or (found.group(1) if found else "adamw")
        rest = re.sub(r" --(optimizer|name)[= ]\S+", "", part["command"])
        text = part["description"].replace(describe_optimizer(kind), "OPTIMIZER")
        described.add((part["title"], text, json.dumps(part["environment"], sort_keys=True), rest))
        rows += [dict(row, method=f"{row['method']} ({describe_optimizer(kind)})") for row in part["rows"]]
    if len(described) != 1:
        raise SystemExit(
            "--merge joins runs that differ only in --optimizer, on one machine: these differ in their "
            + " | ".join(sorted({" ; ".join(str(v) for v in d) for d in described}))[:2000]
        )
    result = dict(
        parts[0],
        rows=rows,
        description=described.pop()[1].replace("OPTIMIZER", "the optimizer each row names"),
        seconds=sum(p.get("seconds", 0.0) for p in parts),
        command=" && ".join(p["command"] for p in parts),
    )
    result.pop("optimizer", None)
    write_result(result, name, out, echo=True)
    return result


PROGRESS = "bench_full: "  # the head of a method process's progress lines, which the parent echoes as they come


def progress(line: str) -> None:
    """A progress line of a method's process (its build, each step): a run cut off by a time limit shows how far
    each method came and how long its steps took."""
    print(PROGRESS + line, file=sys.stderr, flush=True)


def _in_subprocess(name: str, argv: list[str], failed: dict) -> dict:
    """``name``'s row, measured in a process of its own (``failed``: what a row that failed in it still says). Its
    progress lines are echoed to stderr as they come; the rest of its output is kept for the error line."""
    with tempfile.TemporaryDirectory() as folder:
        row = Path(folder) / "row.json"
        cmd = [sys.executable, __file__, *argv, "--one", name, "--row", str(row)]
        last = "no output"
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    print(line.rstrip(), file=sys.stderr, flush=True)
                elif line.strip():
                    last = line.strip()
        if proc.returncode != 0 or not row.is_file():
            return {"method": name, **failed, "error": f"exit {proc.returncode}: {last[:300]}"}
        return json.loads(row.read_text())


def _layer_major_last(row: dict) -> bool:
    return bool(row.get("layer_major"))


def _result(args, argv, environment: dict, rows: list[dict], started: float) -> dict:
    # the reference: all-resident with the same micro-batches, one after another where that row was measured
    resident = sorted((r for r in rows if r["method"] == "resident" and "median_step_s" in r), key=_layer_major_last)
    base = resident[0]["median_step_s"] if resident else None
    for r in rows:
        if base and "median_step_s" in r:
            r["vs_resident"] = r["median_step_s"] / base
    clipping = f"gradients clipped to norm {args.clip:g}" if args.clip else "no gradient clipping"
    if args.loss_scale != 1.0:
        clipping += f" (the loss times {args.loss_scale:g})"
    if args.accumulation > 1:
        how = {"on": "layer-major", "off": "one after another", "both": "one after another and layer-major"}
        clipping += (
            f"; {args.accumulation} micro-batches a step (gradient_accumulation_steps), resident and DGLS "
            f"{how[args.layer_major]}; 'vs resident' against all-resident with the same micro-batches"
            + (" one after another" if args.layer_major == "both" else "")
        )
    if args.vram_budget is not None:
        clipping += f"; DGLS placed by --vram_budget {args.vram_budget:g} (its plan fixed at step 1)"
    if args.gpu_layers is not None:
        clipping += f"; DGLS keeps layers {', '.join(map(str, args.gpu_layers))} on the GPU (--gpu_layers)"
    if args.model == "flux":
        double, single = flux_depth(args)
        title = f"Flux-dev-width full fine-tune step ({double} double + {single} single blocks; Flux-dev: 19 + 38)"
        shape = "tiny shapes" if args.tiny else "1024x1024 (4096 image + 512 text tokens)"
        shape += ", every block checkpointed"
    else:
        title = "SDXL-UNet full fine-tune step"
        shape = "1024x1024 (128x128x4 latents), checkpointing as diffusion-pipe"
    return {
        "benchmark": "full",
        "optimizer": args.optimizer,
        "title": title + (" (tiny)" if args.tiny else ""),
        "description": f"{shape}, batch 1, {describe_optimizer(args.optimizer)}, every weight trained, {clipping}; "
        "median of the timed steps",
        "tiny": args.tiny,
        "environment": environment,
        "rows": rows,
        "notes": NOTES,
        "seconds": time.time() - started,
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
    }


if __name__ == "__main__":
    main()
