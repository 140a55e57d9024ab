"""Train the demo model through DeepSpeed's pipeline engine, the way diffusion-pipe does.

``PipelineModule`` from a layer list, ``deepspeed.initialize``, ``train_batch``: the same
path diffusion-pipe takes, so the demo exercises the real DeepSpeed integration,
including keeping DeepSpeed from moving streamed layers to the device.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import DGLSUserError
from ..monitor import MemoryMonitor
from ..options import swap_config
from ..stats import StepWindow, human_bytes
from ..swapper import LayerSwapper
from .data import SyntheticLatents
from .model import BLOCK_CLASSES, DemoModelConfig, add_lora, build_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEMO_KEYS = {
    "steps",
    "batch_size",
    "lr",
    "seed",
    "output_dir",
    "activation_checkpointing",
    "device",
    "samples",
    "image_tokens",
    "text_tokens",
    "lora_rank",
    "hidden",
    "heads",
    "double_blocks",
    "single_blocks",
}


@dataclass
class DemoResult:
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    bytes_streamed: int = 0
    peak_vram_bytes: int = 0
    pinned_bytes: int = 0
    lora_path: Path | None = None
    lora: dict[str, torch.Tensor] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(device: torch.device) -> None:
    """A single-process group, as the deepspeed launcher would set up."""
    import deepspeed

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)


def demo_settings(train_config: dict) -> dict:
    demo = dict(train_config.get("demo", {}))
    unknown = set(demo) - DEMO_KEYS
    if unknown:
        raise DGLSUserError(f"unknown [demo] key(s) {sorted(unknown)} (known: {', '.join(sorted(DEMO_KEYS))})")
    dtype_name = train_config.get("model", {}).get("dtype", "float32")
    if dtype_name not in DTYPES:
        raise DGLSUserError(f"[model] dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
    demo.setdefault("steps", 30)
    demo.setdefault("batch_size", 4)
    demo.setdefault("lr", 2e-3)
    demo.setdefault("seed", 0)
    demo.setdefault("activation_checkpointing", True)
    demo.setdefault("output_dir", "output/demo")
    demo.setdefault("lora_rank", train_config.get("adapter", {}).get("rank", 8))
    demo["dtype"] = DTYPES[dtype_name]
    if demo["activation_checkpointing"] not in (True, False, "reentrant"):
        raise DGLSUserError("[demo] activation_checkpointing must be true, false or 'reentrant'")
    return demo


def pick_device(demo: dict, gpu_id: int) -> torch.device:
    wanted = demo.get("device", "auto")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DGLSUserError("[demo] device = 'cuda' but no CUDA device is visible: use device = 'auto' or 'cpu'")
    if gpu_id >= torch.cuda.device_count():
        raise DGLSUserError(f"--gpu_id {gpu_id} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", gpu_id)


def run_demo(train_config: dict, options: dict, log=print, progress: bool = True) -> DemoResult:
    """Build, place, train and save; returns the losses and figures for the summary."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from safetensors.torch import save_file
    from tqdm import tqdm

    if progress and log is print:
        log = tqdm.write  # lines printed during training (the profile, the planner) keep the bar intact
    demo = demo_settings(train_config)
    device = pick_device(demo, options["gpu_id"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init_distributed(device)
    model_cfg = DemoModelConfig(
        **{k: demo[k] for k in ("hidden", "heads", "double_blocks", "single_blocks") if k in demo}
    )
    torch.manual_seed(demo["seed"])
    layers = build_layers(model_cfg, seed=demo["seed"], dtype=demo["dtype"])
    trainable = add_lora(layers, rank=demo["lora_rank"], seed=demo["seed"])
    swapper = None
    if options["dynamic_swapping"]:
        swapper = LayerSwapper(layers, swap_config(options), device=device, log=log)
    else:
        log("DGLS: dynamic swapping off; every layer is resident")
    ckpt = demo["activation_checkpointing"]
    pipeline = PipelineModule(
        layers=layers,
        num_stages=1,
        loss_fn=lambda out, target: F.mse_loss(out.float(), target.float()),
        partition_method="uniform",
        activation_checkpoint_interval=1 if ckpt else 0,
        activation_checkpoint_func=partial(torch.utils.checkpoint.checkpoint, use_reentrant=ckpt == "reentrant"),
        checkpointable_layers=list(BLOCK_CLASSES),
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": demo["batch_size"],
        "gradient_accumulation_steps": options["lazy_lora_steps"],
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": demo["dtype"] == torch.bfloat16},
    }
    optimizer = torch.optim.AdamW(trainable, lr=demo["lr"], weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=pipeline, optimizer=optimizer, config=ds_config)
    data = SyntheticLatents(
        model_cfg,
        samples=demo.get("samples", 16),
        image_tokens=demo.get("image_tokens", 64),
        text_tokens=demo.get("text_tokens", 16),
        seed=demo["seed"],
    )
    batches = data.batches(demo["batch_size"], demo["dtype"], device)

    result = DemoResult()
    bar = tqdm(range(demo["steps"]), desc="demo", unit="step", disable=not progress, dynamic_ncols=True)
    monitor = MemoryMonitor(device, lambda: swapper.store.pinned_bytes if swapper is not None else 0)
    window = StepWindow(options["verbose_every"], demo["steps"], device.type)
    for step in bar:
        start = time.perf_counter()
        before = swapper.total_stats() if swapper is not None else None
        loss = engine.train_batch(data_iter=batches).item()
        reading = monitor.read()
        stats = swapper.total_stats().since(before) if swapper is not None else None  # this optimizer step
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # so the next step reports its own peak
        if swapper is not None and swapper.plan_finished:
            log("DGLS: --plan: stopping after the probe; nothing was saved")
            swapper.remove()
            return result
        result.step_seconds.append(time.perf_counter() - start)
        result.losses.append(loss)
        line = f"step {step + 1}: loss {loss:.4f}, {result.step_seconds[-1] * 1000:.0f} ms"
        if stats is not None:
            result.bytes_streamed += stats.bytes_moved
            result.peak_vram_bytes = max(result.peak_vram_bytes, stats.peak_vram_bytes)
            result.pinned_bytes = stats.pinned_bytes
            line += "; " + (stats.line(device.type) if options["verbose"] else stats.short())
        bar.set_postfix(loss=f"{loss:.4f}")
        log(line)
        for warning in monitor.warnings(reading):
            log(warning)
        if options["verbose"] and (text := window.add(result.step_seconds[-1], stats)):
            log(f"DGLS {text}\nDGLS {reading.line()}")
    if options["verbose"] and (text := window.flush()):
        log(f"DGLS {text}")
    if device.type == "cuda" and swapper is None:
        result.peak_vram_bytes = torch.cuda.max_memory_allocated(device)

    out_dir = Path(demo["output_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    result.lora = {
        f"layers.{i}.{name}": p.detach().to("cpu", torch.float32).contiguous()
        for i, layer in enumerate(layers)
        for name, p in layer.named_parameters()
        if p.requires_grad
    }
    result.lora_path = out_dir / "adapter_model.safetensors"
    save_file(result.lora, str(result.lora_path))
    if swapper is not None:
        swapper.remove()
    log(summary(result))
    return result


def summary(r: DemoResult) -> str:
    median = statistics.median(r.step_seconds) * 1000 if r.step_seconds else 0.0
    vram = human_bytes(r.peak_vram_bytes) if r.peak_vram_bytes else "n/a (CPU)"
    return (
        f"DGLS demo finished: loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f} over {len(r.losses)} steps; "
        f"median step {median:.0f} ms; peak VRAM {vram}; "
        f"pinned RAM {human_bytes(r.pinned_bytes)}; streamed {human_bytes(r.bytes_streamed)}; "
        f"LoRA saved to {r.lora_path}"
    )
