"""Shared machinery of the model benchmarks (bench_flux.py, bench_models.py).

A benchmark is a real architecture built from its diffusers config with random weights (no
download), cut into a diffusion-pipe-style layer list, with LoRA rank 16 on the blocks' Linear
layers and non-reentrant checkpointing per block. Every method runs in one process on the same
model and inputs, one after another:

- ``resident``: every layer on the GPU, no hooks (the reference);
- ``dgls``: DGLS streaming 0/25/50/75/100% of the blocks (and ~N GiB targets), one swapper
  switched between placements with ``apply_placement``;
- ``options``: prefetch/threading/batch_move grid at the last ~GiB target (fresh swappers);
- ``dp``: diffusion-pipe's built-in block swap: its ``utils/offloading.py`` ModelOffloader,
  imported at run time from the checkout in ``$DGLS_DIFFUSION_PIPE`` and applied to the blocks
  the way that model's ``enable_block_swap`` does;
- ``auto``: DGLS with ``vram_budget`` ("auto" and fixed GiB): it probes and plans over the first
  steps, which are not timed;
- ``naive``: synchronous ``.to()`` of a block's frozen weights before it runs and back after (the
  lower bound).

Results are written after every method (a run cut short still leaves its figures) to
``<results_dir>/<name>.json`` (every figure), ``.md`` (tables) and ``.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.placement import LayerSizes, choose_streamed, plan_placement  # noqa: E402
from utils.dgls.planner import resident_patterns  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TINY_RESULTS = RESULTS / "tiny"  # --tiny smoke runs write here (git-ignored), never over the GPU results


def results_dir(tiny: bool) -> Path:
    return TINY_RESULTS if tiny else RESULTS


GiB = 2**30
MiB = 2**20
LORA_RANK = 16
ALL_METHODS = ("resident", "dgls", "dp", "auto", "naive")  # "options" and "ab" only on request (time)


# ---------------------------------------------------------------- device and machine
def setup_device() -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # broken backward on the lent H100 image
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


def gpu_details() -> dict:
    """GPU name, PCIe generation and width (current link), driver, read from nvidia-smi."""
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
        name, gen, width, driver = (x.strip() for x in out.stdout.strip().splitlines()[0].split(","))
        return {"gpu": name, "pcie_gen": gen, "pcie_width": width, "driver": driver}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        if torch.cuda.is_available():
            return {"gpu": torch.cuda.get_device_name()}
        return {}


def pinned_bandwidth(device, n: int = GiB) -> float:
    """Host-to-device GB/s of one copy of ``n`` bytes from pinned memory (median of 5 after a warm-up)."""
    if device.type != "cuda":
        return 0.0
    host, dev = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(n / a.elapsed_time(b) / 1e6)
    del host, dev
    release_host_cache()
    return statistics.median(rates[1:])


def environment() -> dict:
    """The GPU, PCIe link, driver, torch and CUDA versions of this run."""
    return {**gpu_details(), "torch": torch.__version__, "cuda": torch.version.cuda}


def release_host_cache() -> None:
    """Give back pinned blocks that torch's caching host allocator keeps after they are freed."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        empty = empty or getattr(torch._C, "_host_emptyCache", None)  # older torch
        if empty is not None:
            empty()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- building models
@contextlib.contextmanager
def params_on_meta():
    """Construct modules with their parameters on the meta device (no memory, no init) but real
    buffers (rotary tables and the like are computed in ``__init__`` and must survive)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def materialize(layers: list[nn.Module], device, dtype, seed: int = 0) -> None:
    """Random frozen weights for meta params, created directly on ``device`` in ``dtype``: N(0, 0.02)
    for matrices and kernels, 1 for vectors with "norm" in their name, 0 for the rest. Buffers move to
    ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in layers:
        for mod_name, module in layer.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                full = f"{mod_name}.{name}"
                data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                with torch.no_grad():
                    if data.ndim >= 2:
                        data.normal_(0, 0.02, generator=g)
                    elif "norm" in full:  # as bench_flux always did (norm biases and AdaLN biases too)
                        data.fill_(1.0)
                    else:
                        data.zero_()
                module._parameters[name] = nn.Parameter(data, requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = b.to(device)


def add_lora(layers: list[nn.Module], blocks: list[int], dtype, rank: int = LORA_RANK) -> None:
    """LoRA on every nn.Linear of the block layers (as diffusion-pipe's adapter does), in ``dtype``."""
    from peft import LoraConfig, inject_adapter_in_model

    for i in blocks:
        names = sorted({n for n, m in layers[i].named_modules() if isinstance(m, nn.Linear)})
        if names:
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=names), layers[i])
    for layer in layers:
        for name, p in layer.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(dtype)
                p.requires_grad_(True)


def place(layers: list[nn.Module], device) -> None:
    for layer in layers:
        layer.to(device)


# ---------------------------------------------------------------- a benchmark
@dataclass
class DPGroup:
    """One diffusion-pipe offloader: the block layers it owns and how many of them it swaps."""

    kind: str  # its block_type label
    layers: list[int]  # indices into the layer list, in block order
    swap: int


@dataclass
class Bench:
    """A model ready to measure: layers (LoRA injected, frozen weights on the device), inputs."""

    model: str  # flux | sdxl | wan
    name: str  # results file stem
    title: str
    shape: str  # what one step computes, for the report
    config: dict
    layers: list[nn.Module]
    inputs: object
    target: torch.Tensor
    checkpointed: frozenset[int]
    blocks: list[int]  # the layers counted as "blocks" (the shares)
    build_s: float = 0.0
    # diffusion-pipe's built-in swap: split(blocks_to_swap) -> offloader groups (None: dp has no block swap here)
    dp_split: Callable[[int], list[DPGroup]] | None = None
    dp_max: int = 0  # the largest blocks_to_swap diffusion-pipe accepts for this model
    dp_note: str = ""
    dp_block: Callable[[nn.Module], nn.Module] = lambda layer: layer.block  # the module dp hooks
    defaults: dict = field(default_factory=dict)  # per-model CLI defaults
    sizes: tuple[LayerSizes, ...] = ()

    def __post_init__(self) -> None:
        self.sizes = plan_placement(self.layers, SwapConfig(blocks_to_swap=0)).sizes

    def streamed_for(self, blocks_to_swap: int) -> tuple[int, ...]:
        return tuple(choose_streamed(list(self.sizes), SwapConfig(blocks_to_swap=blocks_to_swap)))

    def streamed_bytes(self, streamed) -> int:
        return sum(self.sizes[i].streamable_bytes for i in streamed)

    def blocks_to_swap_for_gib(self, gib: float) -> int:
        """The blocks_to_swap whose streamed bytes come closest to ``gib``."""
        return min(
            range(len(self.blocks) + 1), key=lambda n: abs(self.streamed_bytes(self.streamed_for(n)) / GiB - gib)
        )

    def spread_for_gib(self, gib: float) -> tuple[int, ...]:
        """The streamed layers of the "spread" pattern (resident layers evenly between streamed ones,
        as the planner places them) whose bytes come closest to ``gib``."""
        candidates = [s.index for s in self.sizes if s.streamable_bytes]
        options = [tuple(sorted(streamed_by(candidates, k, "spread"))) for k in range(len(candidates) + 1)]
        return min(options, key=lambda streamed: abs(self.streamed_bytes(streamed) / GiB - gib))

    def spread_config(self, gib: float, prefetch: int) -> tuple[tuple[int, ...], SwapConfig]:
        """The spread placement streaming about ``gib``: its streamed layers and its SwapConfig."""
        spread = self.spread_for_gib(gib)
        resident = [s.index for s in self.sizes if s.streamable_bytes and s.index not in spread]
        return spread, SwapConfig(gpu_layers=resident, prefetch=prefetch)

    def optimizer(self) -> torch.optim.Optimizer:
        params = [p for layer in self.layers for p in layer.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-5)


def streamed_by(candidates: list[int], resident_count: int, pattern: str) -> set[int]:
    """The streamed layers of one of the planner's resident patterns ("ends", "spread", "first")."""
    return set(candidates) - set(resident_patterns(candidates, resident_count)[pattern])


def train_step(layers, inputs, target, optimizer, checkpointed) -> None:
    h = inputs
    for i, layer in enumerate(layers):
        h = checkpoint(layer, h, use_reentrant=False) if i in checkpointed else layer(h)
    F.mse_loss(h.float(), target.float()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_steps(bench: Bench, device, warmup: int, steps: int, after=None, deadline: float | None = None, min_steps=3):
    """``warmup`` + ``steps`` training steps of ``bench``; see ``time_steps``."""
    optimizer = bench.optimizer()

    def step() -> None:
        train_step(bench.layers, bench.inputs, bench.target, optimizer, bench.checkpointed)

    return time_steps(step, device, warmup, steps, after, deadline, min_steps)


def time_steps(step, device, warmup: int, steps: int, after=None, deadline: float | None = None, min_steps=3):
    """``warmup`` + ``steps`` calls of ``step()``, the host synchronised around each; returns the timed
    steps' seconds and what ``after()`` returned for each (called outside the timing). Past
    ``deadline`` (perf_counter) it stops once ``min_steps`` are timed."""
    times, extras = [], []
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        elapsed = time.perf_counter() - start
        extra = after() if after is not None else None
        if i >= warmup:
            times.append(elapsed)
            extras.append(extra)
        if deadline is not None and time.perf_counter() > deadline and len(times) >= min_steps:
            break
    return times, extras


def reset_peaks(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device) -> dict:
    if device.type != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB,
    }


# ---------------------------------------------------------------- naive swap (lower bound)
Held = tuple[int, list[torch.Tensor]]  # a block and its frozen params


class NaiveSwap:
    """The lower bound: move a block's frozen weights in with .to() before it runs, out after.

    A checkpointed block's weights go out right after its forward. Its recompute in backward
    moves them in again, and they go out when the next block's recompute starts (its backward is
    done by then), not at the recompute's forward hook: the recompute saves some weights
    themselves (a conv's, a norm's) for the backward, and ``.data =`` would move those too. Run
    the steps under ``set_checkpoint_early_stop(False)``, or non-reentrant checkpointing stops
    the recompute before the forward hook. A block without checkpointing keeps its weights until
    the step ends: its backward uses the params themselves. The moves out after the timed step
    are counted in the waited figure, not in the step time, which flatters the naive swap
    slightly.
    """

    def __init__(self, layers, streamed, device, checkpointed):
        self.device = device
        self.bytes = 0
        self.seconds = 0.0  # in and out
        self.seconds_in = 0.0
        self.handles = []
        self.inside: set[int] = set()  # id() of the frozen-param lists now on the device
        self.runs: dict[int, int] = {}  # this step's forward runs per block (the second is the recompute)
        self.after_backward: list[Held] = []  # recomputed: out once their backward is done
        self.held_to_step_end: list[Held] = []
        for i in streamed:
            frozen = [p for p in layers[i].parameters() if not p.requires_grad]
            self.handles.append(layers[i].register_forward_pre_hook(lambda m, a, i=i, f=frozen: self.before(i, f)))
            if i in checkpointed:
                self.handles.append(layers[i].register_forward_hook(lambda m, a, o, i=i, f=frozen: self.after(i, f)))
            else:
                self.held_to_step_end.append((i, frozen))
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                target = device if i not in streamed or p.requires_grad else "cpu"
                p.data = p.data.to(target)
            for b in layer.buffers():
                b.data = b.data.to(device)

    def before(self, block: int, params: list[torch.Tensor]) -> None:
        self.release(self.after_backward)
        self.move(block, params, True)

    def after(self, block: int, params: list[torch.Tensor]) -> None:
        self.runs[block] = self.runs.get(block, 0) + 1
        if self.runs[block] == 1:
            self.move(block, params, False)
        else:
            self.after_backward.append((block, params))

    def release(self, pending: list[Held]) -> None:
        for block, params in pending:
            self.move(block, params, False)
        pending.clear()

    def move(self, block: int, params: list[torch.Tensor], inward: bool) -> None:
        """In: host to device (the bytes counted); out: back to the host."""
        if (id(params) in self.inside) == inward:  # already there (on CPU: what a GPU run would move)
            return
        if inward:
            self.inside.add(id(params))
        else:
            self.inside.discard(id(params))
        start = time.perf_counter()
        for p in params:
            if inward:
                self.bytes += p.numel() * p.element_size()
            p.data = p.data.to(self.device if inward else "cpu")
        sync(self.device)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        if inward:
            self.seconds_in += elapsed

    def take(self) -> tuple[int, float, float]:
        """After a step: the last recomputed block's and the uncheckpointed blocks' weights go out;
        this step's bytes moved in, seconds moving both ways, and seconds moving in."""
        self.release(self.after_backward)
        for block, params in self.held_to_step_end:
            self.move(block, params, False)
        self.runs.clear()
        out = (self.bytes, self.seconds, self.seconds_in)
        self.bytes, self.seconds, self.seconds_in = 0, 0.0, 0.0
        return out

    def remove(self, layers, device):
        for h in self.handles:
            h.remove()
        for layer in layers:
            layer.to(device)


# ---------------------------------------------------------------- diffusion-pipe's built-in swap
def dp_checkout() -> Path | None:
    path = os.environ.get("DGLS_DIFFUSION_PIPE")
    return Path(path) if path else None


def load_dp_offloading(checkout: Path):
    """diffusion-pipe's utils/offloading.py, imported from the checkout (torch-only: no ComfyUI)."""
    path = checkout / "utils" / "offloading.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: DGLS_DIFFUSION_PIPE must point at a diffusion-pipe checkout")
    spec = importlib.util.spec_from_file_location("diffusion_pipe_offloading", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dp_weights(block: nn.Module, unique: bool = True) -> list[torch.Tensor]:
    """The tensors diffusion-pipe's offloader moves: ``.weight`` of modules whose name lacks 'lora'.

    Under PEFT a LoRA-wrapped Linear and its ``base_layer`` both answer ``.weight`` with the same
    tensor, so the offloader's job list has it twice (``unique=False``): it is copied to the host twice
    per exchange, and to the device once (the second copy is the device tensor onto itself)."""
    seen, out = set(), []
    for name, module in block.named_modules():
        if "lora" in name:
            continue
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and (not unique or id(w) not in seen):
            seen.add(id(w))
            out.append(w)
    return out


class DPSwap:
    """diffusion-pipe's ModelOffloader on the bench's blocks, as ``enable_block_swap`` sets it up: the
    blocks' wrappers call ``wait_for_block`` before the block and ``submit_move_blocks_forward`` after
    (here as forward hooks on the wrapper layers), backward hooks are the offloader's own. Counts the
    bytes each exchange moves and the host time spent waiting for exchanges."""

    def __init__(self, bench: Bench, offloading, groups: list[DPGroup], device):
        self.bench, self.device = bench, device
        self.h2d = self.d2h = 0
        self.swap_s = self.wait_s = 0.0
        self.lock = threading.Lock()
        self.handles = []
        self.offloaders = []
        # Flux's wrappers call their blocks with keywords only, so the offloader's full backward hooks fire on
        # the output gradients (torch warns): that is how they run in diffusion-pipe too.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        place(bench.layers, device)  # enable_block_swap: the transformer goes to the GPU ...
        for group in groups:
            blocks = [bench.dp_block(bench.layers[i]) for i in group.layers]
            off = offloading.ModelOffloader(
                group.kind, blocks, len(blocks), group.swap, True, device, False
            )  # supports_backward=True, reentrant_activation_checkpointing=False (diffusion-pipe's default)
            self._instrument(off)
            for j, i in enumerate(group.layers):
                layer = bench.layers[i]
                self.handles.append(layer.register_forward_pre_hook(lambda m, a, o=off, j=j: o.wait_for_block(j)))
                self.handles.append(
                    layer.register_forward_hook(lambda m, a, out, o=off, j=j: o.submit_move_blocks_forward(j))
                )
            off.prepare_block_devices_before_forward()  # ... then the swapped blocks' weights go to the CPU
            self.offloaders.append(off)

    def _instrument(self, off) -> None:
        original_swap = off.swap_weight_devices
        original_wait = off._wait_blocks_move
        cuda = self.device.type == "cuda"

        def swap(block_to_cpu, block_to_cuda):
            # (on CPU every tensor is on the host: count what a GPU run would move)
            h2d = sum(
                w.numel() * w.element_size() for w in dp_weights(block_to_cuda) if not cuda or w.device.type == "cpu"
            )
            d2h = sum(
                w.numel() * w.element_size()
                for w in dp_weights(block_to_cpu, unique=False)
                if not cuda or w.device.type != "cpu"
            )
            start = time.perf_counter()
            if cuda:
                original_swap(block_to_cpu, block_to_cuda)
            # On CPU diffusion-pipe's exchange raises NotImplementedError, so it is a no-op there (the hooks,
            # the worker thread and its futures still run).
            with self.lock:  # runs on the offloader's worker thread
                self.swap_s += time.perf_counter() - start
                self.h2d += h2d
                self.d2h += d2h

        def wait(block_idx):
            start = time.perf_counter()
            original_wait(block_idx)
            with self.lock:
                self.wait_s += time.perf_counter() - start

        off.swap_weight_devices = swap
        off._wait_blocks_move = wait

    def take(self) -> dict:
        """The counters since the last call. Exchanges still in flight are not waited for (that would hide
        their cost from the next step, where diffusion-pipe waits for them): they count in the next step."""
        with self.lock:
            out = {"h2d": self.h2d, "d2h": self.d2h, "swap_s": self.swap_s, "wait_s": self.wait_s}
            self.h2d = self.d2h = 0
            self.swap_s = self.wait_s = 0.0
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for off in self.offloaders:
            for idx in list(off.futures):
                off.futures.pop(idx).result()
            off.thread_pool.shutdown(wait=True)
            for h in off.remove_handles:
                h.remove()
            off.remove_handles = []
        self.offloaders = []
        place(self.bench.layers, self.device)
        release_host_cache()


# ---------------------------------------------------------------- the run
def parse_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def resolve_swaps(bench: Bench, spec: str, limit: int) -> list[tuple[str, int | None, float | None]]:
    """(label, blocks_to_swap, GiB target) per item: '0.5' -> 50% of the blocks, '9.6GiB' -> a GiB
    target (the count is chosen by the caller, which knows what is measured), 'max' -> ``limit``."""
    out = []
    for item in parse_list(spec):
        if item == "max":
            out.append(("largest", limit, None))
        elif item.lower().endswith("gib"):
            out.append((f"~{item[:-3]} GiB", None, float(item[:-3])))
        else:
            out.append((f"{float(item):.0%} of blocks", min(limit, round(float(item) * len(bench.blocks))), None))
    return out


class Runner:
    def __init__(self, bench: Bench, args, device, dtype, results_dir: Path, started: float):
        self.bench, self.args, self.device, self.dtype = bench, args, device, dtype
        self.results_dir = results_dir
        self.started = started
        self.deadline = started + args.deadline_s
        self.rows: list[dict] = []
        self.result = {
            "benchmark": f"{bench.model}_lora_step",
            "model": bench.model,
            "title": bench.title,
            "shape": bench.shape,
            "config": bench.config,
            "tiny": bool(args.tiny),
            "dtype": str(dtype),
            "lora_rank": LORA_RANK,
            "checkpointing": "non-reentrant, per block",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": str(device),
            **gpu_details(),
            "pinned_h2d_gbps": 0.0,
            "model_build_s": bench.build_s,
            "layers": len(bench.layers),
            "blocks": len(bench.blocks),
            "layer_mib": [round((s.streamable_bytes + s.fixed_bytes) / MiB, 3) for s in bench.sizes],
            "total_frozen_gib": sum(s.streamable_bytes for s in bench.sizes) / GiB,
            "steps": args.steps,
            "warmup": args.warmup,
            "prefetch": args.prefetch,
            "methods": sorted(args.method_set),
            "diffusion_pipe": str(dp_checkout()) if dp_checkout() else None,
            "rows": self.rows,
        }
        if bench.model == "flux":
            self.result["peers"] = FLUX_PEERS
            self.result["targets"] = FLUX_TARGETS

    # -------------------------------------------------------- bookkeeping
    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def record(self, row: dict) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.result["elapsed_s"] = time.perf_counter() - self.started
        write_reports(self.result, self.bench.name, self.results_dir, plot=False)  # the plot comes at the end

    def skip(self, kind: str, method: str, reason: str) -> None:
        self.record({"kind": kind, "method": method, "skipped": reason})

    def timed_row(self, kind, method, times, extra) -> dict:
        return {
            "kind": kind,
            "method": method,
            "median_step_s": statistics.median(times),
            "steps": len(times),
            "step_times_s": [round(t, 5) for t in times],
            **extra,
            **peaks(self.device),
        }

    def guarded(self, kind: str, method: str, fn) -> None:
        """Run one method; an error is recorded as a row (and re-raised with --strict)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - unattended: keep going with the other methods
            if self.args.strict:
                raise
            traceback.print_exc()
            self.record({"kind": kind, "method": method, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    # -------------------------------------------------------- methods
    def run(self) -> dict:
        self.result["pinned_h2d_gbps"] = pinned_bandwidth(self.device)
        place(self.bench.layers, self.device)
        methods = (
            ("resident", "all-resident", self.resident),
            ("dgls", "DGLS", self.dgls),
            ("ab", "A/B", self.ab),
            ("options", "DGLS options", self.options),
            ("dp", "diffusion-pipe built-in", self.dp),
            ("auto", "DGLS vram_budget", self.auto),
            ("naive", "naive .to() swap", self.naive),
        )
        for kind, label, method in methods:
            if kind in self.args.method_set:
                self.guarded(kind, label, method)
        self.result["elapsed_s"] = time.perf_counter() - self.started
        write_reports(self.result, self.bench.name, self.results_dir, echo=True)
        return self.result

    def resident(self) -> None:
        place(self.bench.layers, self.device)
        reset_peaks(self.device)
        times, _ = run_steps(self.bench, self.device, self.args.warmup, self.args.steps, deadline=self.deadline)
        self.record(self.timed_row("resident", "all-resident", times, {"streamed_gib": 0.0}))

    def dgls_configs(self) -> list[tuple[str, int]]:
        """(label, blocks_to_swap), one per distinct count, in growing order."""
        bench = self.bench
        spec = ",".join(parse_list(self.args.shares) + [f"{g}GiB" for g in parse_list(self.args.gib)])
        labels: dict[int, list[str]] = {}
        for label, n, gib in resolve_swaps(bench, spec, len(bench.blocks)):
            n = bench.blocks_to_swap_for_gib(gib) if n is None else n
            if n == len(bench.blocks) and "of blocks" in label:
                label += " (largest)"
            labels.setdefault(n, []).append(label)
        return [(" = ".join(labels[n]), n) for n in sorted(labels)]

    def time_placement(self, swapper, warmup: int | None = None, steps: int | None = None) -> tuple[list[float], list]:
        """Step times and per-step swap stats of the placement in force, peaks counted from here."""
        swapper.step_stats()
        reset_peaks(self.device)
        return run_steps(
            self.bench,
            self.device,
            self.args.warmup if warmup is None else warmup,
            self.args.steps if steps is None else steps,
            after=lambda: swapper.step_stats(reset_peak=False),
            deadline=self.deadline,
        )

    def swap_extra(self, swapper, stats) -> dict:
        placement = swapper.placement
        bw = self.result["pinned_h2d_gbps"]
        gbps = statistics.median(s.gbps for s in stats) if stats else 0.0
        return {
            "blocks_to_swap": len(placement.streamed),
            "prefetch": swapper.config.prefetch,
            "threading": swapper.config.threading,
            "batch_move": swapper.config.batch_move,
            "streamed_layers": list(placement.streamed),
            "streamed_gib": placement.streamed_bytes / GiB,
            "predicted_weights_pool_gib": placement.predicted_device_bytes / GiB,
            "bytes_per_step": statistics.median(s.bytes_moved for s in stats) if stats else 0,
            "copy_gbps": gbps,
            "copy_share_of_pinned": gbps / bw if bw else None,
            "wait_ms": statistics.median(s.wait_ms for s in stats) if stats else 0.0,
            "hit_rate": min(s.hit_rate for s in stats) if stats else 1.0,
            "misses_per_step": statistics.median(s.misses for s in stats) if stats else 0,
        }

    def dgls(self) -> None:
        bench = self.bench
        configs = self.dgls_configs()  # growing streamed sets: each switch packs only the newly streamed layers
        place(bench.layers, self.device)
        swapper = LayerSwapper(
            bench.layers, SwapConfig(blocks_to_swap=configs[0][1], prefetch=self.args.prefetch), self.device, log=None
        )
        try:
            for label, n in configs:
                name = f"DGLS {label} (blocks_to_swap={n}, prefetch={self.args.prefetch})"
                if self.left() < 10:
                    self.skip("dgls", name, "out of time (--deadline_s)")
                    continue
                streamed = bench.streamed_for(n)
                if tuple(swapper.placement.streamed) != streamed:
                    swapper.apply_placement(streamed, self.args.prefetch)
                times, stats = self.time_placement(swapper)
                self.record(self.timed_row("dgls", name, times, self.swap_extra(swapper, stats)))
        finally:
            swapper.remove()

    def ab(self) -> None:
        """All-resident and DGLS at each target's streamed GiB in alternation (R D R D R D), so that
        the ratio the targets are judged on is not skewed by the drift of step times over a run.
        Two placements per target: blocks_to_swap's (resident layers at both ends) and the
        planner's "spread" pattern (resident layers between streamed ones, hiding their copies)."""
        targets = [t for t in self.result.get("targets", []) if "streamed_gib" in t]
        if not targets:
            self.skip("ab", "A/B resident vs DGLS", "this model has no step-time targets")
            return
        prefetch = self.args.prefetch
        for t in targets:
            n = self.bench.blocks_to_swap_for_gib(t["streamed_gib"])
            spread, spread_config = self.bench.spread_config(t["streamed_gib"], prefetch)
            placements = [
                (f"blocks_to_swap={n}, prefetch={prefetch}", SwapConfig(blocks_to_swap=n, prefetch=prefetch)),
                (f"spread, {len(spread)} streamed, prefetch={prefetch}", spread_config),
            ]
            for label, config in placements:
                name = f"A/B: DGLS ~{t['streamed_gib']:g} GiB ({label})"
                if self.left() < 60:
                    self.skip("ab", name, "out of time (--deadline_s)")
                    continue
                self.guarded("ab", name, lambda config=config, name=name: self.ab_one(config, name))

    def ab_one(self, config: SwapConfig, name: str) -> None:
        bench, rounds, steps = self.bench, self.args.ab_rounds, self.args.ab_steps
        resident: list[float] = []
        swapped: list[float] = []
        stats: list = []
        peak = {}
        for _ in range(rounds):
            place(bench.layers, self.device)
            resident += run_steps(bench, self.device, 1, steps)[0]
            with LayerSwapper(bench.layers, config, self.device, log=None) as swapper:
                times, round_stats = self.time_placement(swapper, warmup=1, steps=steps)
                swapped += times
                stats += round_stats
                extra = self.swap_extra(swapper, stats)
                round_peak = peaks(self.device)  # before leaving: that puts every weight back on the device
            peak = {k: max(v, peak.get(k, 0.0)) for k, v in round_peak.items()}
        row = self.timed_row("ab", name, swapped, extra)
        row.update(peak, ab_resident_s=statistics.median(resident), ab_rounds=rounds, ab_resident_times_s=resident)
        self.record(row)

    def options(self) -> None:
        bench = self.bench
        target = parse_list(self.args.gib)[-1] if parse_list(self.args.gib) else None
        n = bench.blocks_to_swap_for_gib(float(target)) if target else len(bench.blocks) // 2
        where = f"~{target} GiB" if target else "50% of blocks"
        on = {False: "off", True: "on"}
        place(bench.layers, self.device)
        for p in (1, 2, 4):
            for t in (False, True):
                for b in (False, True):
                    name = f"DGLS {where} threading={on[t]} batch_move={on[b]} (blocks_to_swap={n}, prefetch={p})"
                    if self.left() < 10:
                        self.skip("options", name, "out of time (--deadline_s)")
                        continue
                    swapper = LayerSwapper(
                        bench.layers,
                        SwapConfig(blocks_to_swap=n, prefetch=p, threading=t, batch_move=b),
                        self.device,
                        log=None,
                    )
                    try:
                        times, stats = self.time_placement(swapper)
                        self.record(self.timed_row("options", name, times, self.swap_extra(swapper, stats)))
                    finally:
                        swapper.remove()

    def dp(self) -> None:
        bench = self.bench
        checkout = dp_checkout()
        if bench.dp_split is None:
            self.skip("dp", "diffusion-pipe built-in", bench.dp_note or "diffusion-pipe has no block swap for it")
            return
        if checkout is None:
            self.skip("dp", "diffusion-pipe built-in", "DGLS_DIFFUSION_PIPE is not set (a diffusion-pipe checkout)")
            return
        offloading = load_dp_offloading(checkout)
        spec = self.args.dp_swaps or bench.defaults.get("dp_swaps", "0.5,max")
        for label, n, gib in resolve_swaps(bench, spec, bench.dp_max):
            if n is None:  # a GiB target: the blocks_to_swap whose swapped weights come closest
                n = min(range(1, bench.dp_max + 1), key=lambda k: abs(self.dp_bytes(k) / GiB - gib), default=0)
            if n < 1:  # diffusion-pipe: blocks_to_swap 0 means no block swap at all
                self.skip("dp", f"diffusion-pipe built-in {label}", "blocks_to_swap 0 is no block swap")
                continue
            groups = bench.dp_split(n)
            split = ", ".join(f"{g.swap} of {len(g.layers)} {g.kind}" for g in groups)
            name = f"diffusion-pipe built-in {label} (blocks_to_swap={n}: {split})"
            if self.left() < 15:
                self.skip("dp", name, "out of time (--deadline_s)")
                continue
            self.guarded("dp", name, lambda n=n, name=name, groups=groups: self.dp_one(offloading, n, name, groups))

    def dp_bytes(self, n: int) -> int:
        bench = self.bench
        total = 0
        for g in bench.dp_split(n):
            for i in g.layers[len(g.layers) - g.swap :]:
                total += sum(w.numel() * w.element_size() for w in dp_weights(bench.dp_block(bench.layers[i])))
        return total

    def dp_one(self, offloading, n, name, groups) -> None:
        swap = DPSwap(self.bench, offloading, groups, self.device)
        try:
            reset_peaks(self.device)
            times, figures = run_steps(
                self.bench, self.device, self.args.warmup, self.args.steps, after=swap.take, deadline=self.deadline
            )
            med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
            bw = self.result["pinned_h2d_gbps"]
            moved = med["h2d"] + med["d2h"]
            gbps = moved / med["swap_s"] / 1e9 if med["swap_s"] > 0 and self.device.type == "cuda" else 0.0
            extra = {
                "blocks_to_swap": n,
                "dp_groups": [{"kind": g.kind, "blocks": len(g.layers), "swapped": g.swap} for g in groups],
                "streamed_gib": self.dp_bytes(n) / GiB,
                "bytes_per_step": med["h2d"],
                "d2h_bytes_per_step": med["d2h"],
                "copy_gbps": gbps,
                "copy_share_of_pinned": gbps / bw if bw else None,
                "swap_ms": med["swap_s"] * 1000,
                "wait_ms": med["wait_s"] * 1000,
            }
            self.record(self.timed_row("dp", name, times, extra))
        finally:
            swap.remove()

    def auto(self) -> None:
        bench = self.bench
        budgets = parse_list(self.args.budgets or bench.defaults.get("budgets", "auto"))
        # Each swapper starts from the weights on the CPU, as in a real run (diffusion-pipe loads to the CPU)
        # and as in bench_planner.py. Starting from the GPU once gave a 10 GiB Flux budget an inflated minimum
        # (about 20 GiB already allocated at the probe); allocated_before_gib in each row tells the next run.
        place(bench.layers, torch.device("cpu"))
        release_host_cache()  # and the device cache
        for spec in budgets:
            if spec != "auto" and self.args.tiny:  # a tiny model needs a tiny budget: the minimum and a bit
                fixed = sum(s.fixed_bytes for s in bench.sizes)
                largest = max(s.streamable_bytes for s in bench.sizes)
                value = (fixed + 2.5 * largest) / GiB  # just above the minimum: something must stream
            else:
                value = spec if spec == "auto" else float(spec)
            name = f"DGLS vram_budget={spec if spec == 'auto' else f'{value:.3g} GiB'}"
            if spec == "auto" and self.device.type != "cuda":
                self.skip("auto", name, "vram_budget auto needs a CUDA device")
                continue
            if self.left() < 20:
                self.skip("auto", name, "out of time (--deadline_s)")
                continue
            self.guarded("auto", name, lambda value=value, name=name: self.auto_one(value, name))
        place(bench.layers, self.device)

    def auto_one(self, budget, name) -> None:
        bench = self.bench
        lines: list[str] = []
        reset_peaks(self.device)
        before = torch.cuda.memory_allocated(self.device) / GiB if self.device.type == "cuda" else 0.0
        swapper = LayerSwapper(bench.layers, SwapConfig(vram_budget_gb=budget), self.device, log=lines.append)
        try:
            planning = []
            optimizer = bench.optimizer()
            while not swapper.autoplanner.done and len(planning) < 80:  # probe, trials, check: not timed
                sync(self.device)
                start = time.perf_counter()
                train_step(bench.layers, bench.inputs, bench.target, optimizer, bench.checkpointed)
                swapper.step_stats(reset_peak=False)
                planning.append(time.perf_counter() - start)
            plan = swapper.autoplanner.plan
            times, stats = self.time_placement(swapper)
            extra = self.swap_extra(swapper, stats)
            budget_bytes = swapper.autoplanner.budget
            extra.update(
                budget_gib=budget_bytes / GiB,
                allocated_before_gib=before,
                plan_pattern=plan.pattern if plan else None,
                plan_predicted_s=plan.predicted_ms / 1000 if plan else None,
                replanned=swapper.autoplanner.replanned,
                planning_steps_s=[round(t, 4) for t in planning],
                plan_log=[line.strip() for line in lines if line.startswith(("DGLS", "  "))],
                trials=planner_trials(swapper.autoplanner),
            )
            row = self.timed_row("auto", name, times, extra)
            if "peak_reserved_gib" in row:
                row["fits_budget"] = row["peak_reserved_gib"] * GiB <= budget_bytes
            self.record(row)
        finally:
            swapper.remove()

    def naive(self) -> None:
        bench = self.bench
        spec = self.args.naive or bench.defaults.get("naive", "0.5")
        label, n = self.dgls_like(spec)
        streamed = set(bench.streamed_for(n))
        name = f"naive .to() swap {label} (blocks_to_swap={n})"
        if self.left() < 20:
            self.skip("naive", name, "out of time (--deadline_s)")
            return
        naive = NaiveSwap(bench.layers, streamed, self.device, bench.checkpointed)
        try:
            with set_checkpoint_early_stop(False):
                reset_peaks(self.device)
                # one warm-up step, then as many timed steps as the deadline leaves (3 to --steps)
                first, _ = run_steps(bench, self.device, 0, 1, after=naive.take)
                fit = int((self.left() - 5) / max(first[0], 1e-3))
                steps = max(3, min(self.args.steps, fit))
                times, figures = run_steps(bench, self.device, 0, steps, after=naive.take, deadline=self.deadline)
                moved, seconds, seconds_in = (statistics.median(f[k] for f in figures) for k in range(3))
                extra = {
                    "blocks_to_swap": n,
                    "streamed_gib": bench.streamed_bytes(streamed) / GiB,
                    "bytes_per_step": moved,
                    "copy_gbps": moved / seconds_in / 1e9 if seconds_in > 0 and self.device.type == "cuda" else 0.0,
                    "wait_ms": seconds * 1000,
                    "warmup_steps": 1,
                }
                self.record(self.timed_row("naive", name, times, extra))
        finally:
            naive.remove(bench.layers, self.device)

    def dgls_like(self, spec: str) -> tuple[str, int]:
        label, n, gib = resolve_swaps(self.bench, spec, len(self.bench.blocks))[0]
        return label, (self.bench.blocks_to_swap_for_gib(gib) if n is None else n)


def planner_trials(planner) -> list[dict]:
    """The plans the planner measured before settling, with its predictions next to the measurements."""
    return [
        {
            "pattern": t.plan.pattern,
            "streamed": len(t.plan.streamed),
            "prefetch": t.plan.prefetch,
            "predicted_s": t.plan.predicted_ms / 1000,
            "measured_s": t.wall_ms / 1000,
            "visits_s": [ms / 1000 for ms in t.samples_ms],
            "predicted_peak_gib": t.plan.predicted_peak / GiB,
            "peak_reserved_gib": t.peak_reserved / GiB,
        }
        for t in planner.trials
    ]


# ---------------------------------------------------------------- Flux peers and targets
FLUX_PEERS = [
    {"method": "diffusion-pipe built-in (earlier run)", "streamed_gib": 9.6, "vs_resident": 1.65, "peak_gib": 15.6},
    {"method": "diffusion-pipe built-in (earlier run)", "streamed_gib": 19, "vs_resident": 2.6, "peak_gib": 6.3},
    {
        "method": "H2D-only ring-of-two streamer (earlier run)",
        "streamed_gib": 9.6,
        "vs_resident": 1.3,
        "peak_gib": 17.4,
    },
    {"method": "H2D-only ring-of-two streamer (earlier run)", "streamed_gib": 19, "vs_resident": 1.95, "peak_gib": 8.1},
]
FLUX_TARGETS = [
    {"target": "9.6 GiB streamed: step <= 1.05x resident", "streamed_gib": 9.6, "max_vs_resident": 1.05},
    {
        "target": "19 GiB streamed: step <= 1.25x resident at <= 8 GiB peak allocated",
        "streamed_gib": 19,
        "max_vs_resident": 1.25,
        "max_peak_allocated_gib": 8.0,
    },
    {"target": "copies >= 90% of the measured pinned bandwidth", "min_copy_share": 0.9},
]


def kind_of(row: dict) -> str:
    """A row's method family (JSONs from before this module have no "kind")."""
    if "kind" in row:
        return row["kind"]
    method = row["method"]
    if method == "all-resident":
        return "resident"
    if method.startswith("naive"):
        return "naive"
    return "options" if "threading=" in method else "dgls"


def nearest_dgls(rows, gib: float) -> dict | None:
    """The DGLS row (placement grid) whose streamed GiB is closest to ``gib``, within 10%."""
    cands = [r for r in rows if kind_of(r) == "dgls" and "median_step_s" in r]
    cands = [r for r in cands if abs(r.get("streamed_gib", 0) - gib) <= 0.1 * gib]
    return min(cands, key=lambda r: abs(r["streamed_gib"] - gib), default=None)


def best_ab(rows, gib: float, max_peak_gib: float | None = None) -> dict | None:
    """The fastest A/B row (against its own resident steps) streaming within 10% of ``gib``.

    With ``max_peak_gib``, rows within that peak allocation come first: a target that bounds
    both time and memory is judged on a row that can meet both, not on a faster one that
    cannot."""
    cands = [r for r in rows if kind_of(r) == "ab" and "vs_resident" in r and abs(r["streamed_gib"] - gib) <= 0.1 * gib]
    if max_peak_gib is not None:
        cands = [r for r in cands if r.get("peak_allocated_gib", 0) <= max_peak_gib] or cands
    return min(cands, key=lambda r: r["vs_resident"], default=None)


def evaluate_targets(result: dict) -> list[dict]:
    rows, out = result["rows"], []
    for t in result.get("targets", []):
        ev = dict(t)
        if "min_copy_share" in t:
            shares = [
                r["copy_gbps"] / result["pinned_h2d_gbps"]
                for r in rows
                if kind_of(r) in ("dgls", "ab") and r.get("copy_gbps") and result.get("pinned_h2d_gbps")
            ]
            if not shares:
                ev.update(status="not measured")
            else:
                worst = min(shares)
                ev.update(measured=f"{worst:.0%} (worst DGLS row; median {statistics.median(shares):.0%})")
                ev.update(met=worst >= t["min_copy_share"], margin=f"{(worst - t['min_copy_share']) * 100:+.0f} points")
            out.append(ev)
            continue
        row = best_ab(rows, t["streamed_gib"], t.get("max_peak_allocated_gib")) or nearest_dgls(rows, t["streamed_gib"])
        if row is None or "vs_resident" not in row:
            ev.update(status="not measured")
            out.append(ev)
            continue
        ratio = row["vs_resident"]
        ev.update(row=row["method"], measured=f"{ratio:.2f}x at {row['streamed_gib']:.1f} GiB streamed")
        met = ratio <= t["max_vs_resident"]
        margins = [f"{ratio - t['max_vs_resident']:+.2f}x vs the {t['max_vs_resident']:.2f}x limit"]
        if "max_peak_allocated_gib" in t and "peak_allocated_gib" in row:
            peak = row["peak_allocated_gib"]
            ev["measured"] += f", {peak:.1f} GiB peak allocated"
            met = met and peak <= t["max_peak_allocated_gib"]
            margins.append(
                f"{peak - t['max_peak_allocated_gib']:+.1f} GiB vs the {t['max_peak_allocated_gib']:g} GiB limit"
            )
        ev.update(met=met, margin="; ".join(margins))
        out.append(ev)
    return out


# ---------------------------------------------------------------- reports
def derive(result: dict) -> None:
    """Ratios and floors, from the figures measured in the run."""
    rows, bandwidth = result["rows"], result.get("pinned_h2d_gbps", 0)
    resident = next((r["median_step_s"] for r in rows if r["method"] == "all-resident" and "median_step_s" in r), None)
    for r in rows:
        # A/B rows have their own resident reference, measured in alternation with them
        reference = r.get("ab_resident_s", resident)
        if not reference or "median_step_s" not in r:
            continue
        r["vs_resident"] = r["median_step_s"] / reference
        if bandwidth and r.get("bytes_per_step") is not None:
            # What was really copied host-to-device (layers kept across the forward/backward turnaround
            # are copied once) ...
            r["floor_s"] = max(resident, r["bytes_per_step"] / bandwidth / 1e9)
            r["vs_floor"] = r["median_step_s"] / r["floor_s"]
        if bandwidth and r.get("streamed_gib") is not None:
            # ... and the definition: every streamed byte twice a step.
            r["floor_2x_s"] = max(resident, 2 * r["streamed_gib"] * GiB / bandwidth / 1e9)
            r["vs_floor_2x"] = r["median_step_s"] / r["floor_2x_s"]
    if result.get("targets"):
        result["target_results"] = evaluate_targets(result)


def _f(value, fmt: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt) + suffix


def render_md(result: dict) -> str:
    rows = result["rows"]
    if "shape" not in result and "image_tokens" in result:  # a JSON from before this module
        result["shape"] = f"{result['image_tokens']} image + {result['text_tokens']} text tokens"
        result.setdefault("title", "Flux-dev-size LoRA training step")
    gpu = result.get("gpu", "CPU")
    lines = [
        f"{result.get('title', 'LoRA training step')} on {gpu} "
        f"(PCIe gen {result.get('pcie_gen', '?')} x{result.get('pcie_width', '?')}, torch {result['torch']}, "
        f"CUDA {result.get('cuda')}): {result.get('shape', '')}; batch 1, LoRA r{result.get('lora_rank', 16)} "
        "on the blocks' Linear layers, non-reentrant checkpointing per block; pinned host-to-device "
        f"{result.get('pinned_h2d_gbps', 0):.1f} GB/s; random weights built in {result.get('model_build_s', 0):.0f} s."
    ]
    if result.get("layer_mib"):
        sizes = result["layer_mib"]
        lines[0] += (
            f" {result['layers']} layers ({result['blocks']} blocks, {result['total_frozen_gib']:.1f} GiB frozen; "
            f"layer sizes {min(sizes):.1f} to {max(sizes):.1f} MiB)."
        )
    if result.get("tiny"):
        lines[0] += " TINY config (smoke test): the figures mean nothing."
    lines += [
        "",
        "| method | steps | streamed GiB | step (s) | vs resident | vs floor (copied) | vs floor (2x streamed) "
        "| copied/step GiB | copy GB/s | copy / pinned | compute waited (ms) | peak alloc GiB | peak reserved GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        if "median_step_s" not in r:
            notes.append(
                f"- {r['method']}: {'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error']}"
            )
            continue
        share = r.get("copy_share_of_pinned")
        if share is None and r.get("copy_gbps") and result.get("pinned_h2d_gbps"):
            share = r["copy_gbps"] / result["pinned_h2d_gbps"]
        cells = [
            r["method"],
            str(r.get("steps", "-")),
            f"{r.get('streamed_gib', 0):.1f}",
            f"{r['median_step_s']:.3f}",
            _f(r.get("vs_resident"), ".2f", "x"),
            _f(r.get("vs_floor"), ".2f", "x"),
            _f(r.get("vs_floor_2x"), ".2f", "x"),
            f"{r.get('bytes_per_step', 0) / GiB:.1f}",
            f"{r.get('copy_gbps', 0):.1f}",
            _f(share, ".0%"),
            f"{r.get('wait_ms', 0):.0f}",
            _f(r.get("peak_allocated_gib"), ".2f"),
            _f(r.get("peak_reserved_gib"), ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if r.get("plan_log"):
            fits = {True: " (peak reserved within the budget)", False: " (peak reserved OVER the budget)"}
            notes.append(f"- {r['method']}: {' / '.join(r['plan_log'])}{fits.get(r.get('fits_budget'), '')}")
    lines += [
        "",
        "floor (copied) = max(all-resident step, host-to-device bytes copied per step / pinned bandwidth); "
        "floor (2x streamed) = max(all-resident step, 2 x streamed bytes / pinned bandwidth); all measured in "
        "this run, medians over the timed steps after warm-up. A/B rows alternate all-resident and DGLS steps "
        "in rounds, and their 'vs resident' is against the resident steps of those rounds (the targets use them): "
        "step times drift over a run by more than the margins judged. DGLS placements are switched with "
        "`apply_placement` on one swapper; `vram_budget` rows are timed after the planner's probe/check steps. "
        "diffusion-pipe built-in: its `utils/offloading.py` ModelOffloader imported from the checkout, "
        "streamed = weights of its swapped blocks (it moves only `.weight`, both ways), copy GB/s = "
        "(host-to-device + device-to-host bytes) / time inside its exchanges, waited = host time blocked on "
        "them. naive: waited = time inside the synchronous moves.",
    ]
    if notes:
        lines += ["", *notes]
    if result.get("peers"):
        lines += [
            "",
            "Peers (H100, Flux-dev, 1024x1024, batch 1) measured earlier, and this run:",
            "",
            "| method | streamed GiB | vs resident | peak allocated GiB |",
            "|---|---|---|---|",
        ]
        for p in result["peers"]:
            lines.append(f"| {p['method']} | {p['streamed_gib']:g} | {p['vs_resident']:.2f}x | {p['peak_gib']:.1f} |")
        for r in rows:
            this_run = kind_of(r) in ("dp", "ab") or (kind_of(r) == "dgls" and "GiB" in r["method"])
            if this_run and "median_step_s" in r:
                lines.append(
                    f"| {r['method']} (this run) | {r['streamed_gib']:.1f} | {_f(r.get('vs_resident'), '.2f', 'x')} "
                    f"| {_f(r.get('peak_allocated_gib'), '.1f')} |"
                )
    if result.get("target_results"):
        lines += ["", "| target | measured | met? | by how much |", "|---|---|---|---|"]
        for t in result["target_results"]:
            met = {True: "met", False: "MISSED"}.get(t.get("met"), t.get("status", "-"))
            lines.append(f"| {t['target']} | {t.get('measured', '-')} | {met} | {t.get('margin', '-')} |")
    return "\n".join(lines) + "\n"


def write_reports(
    result: dict, name: str, results_dir: Path | None = None, echo: bool = False, plot: bool = True
) -> None:
    """JSON with every figure, a Markdown table and (with matplotlib) a plot."""
    results_dir = Path(results_dir or RESULTS)
    if result.get("benchmark") == "flux_dev_lora_step" and not result.get("tiny"):  # older JSONs lack them
        result.setdefault("peers", FLUX_PEERS)
        result.setdefault("targets", FLUX_TARGETS)
    derive(result)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    md = render_md(result)
    (results_dir / f"{name}.md").write_text(md)
    if echo:
        print(md)
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if echo:
            print("matplotlib not installed: no plot written (pip install matplotlib)")
        return
    timed = [r for r in result["rows"] if "median_step_s" in r]
    if not timed:
        return
    fig, ax = plt.subplots(figsize=(8, 4.8))
    markers = {"resident": "*", "dgls": "o", "ab": "P", "options": ".", "auto": "D", "dp": "s", "naive": "x"}
    for r in timed:
        kind = kind_of(r)
        ax.scatter(r.get("peak_allocated_gib", 0), r["median_step_s"], label=r["method"], marker=markers.get(kind, "o"))
    ax.set_yscale("log")
    ax.set_xlabel("peak allocated VRAM (GiB)")
    ax.set_ylabel("median step (s, log scale)")
    ax.set_title(f"{result.get('title', name)}: time vs VRAM (lower left is better)", fontsize=9)
    ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(results_dir / f"{name}.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- command line
def build_parser(models: list[str], default_model: str | None, doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if default_model is None:
        parser.add_argument("--model", required=True, choices=models)
    else:
        parser.add_argument("--model", default=default_model, choices=models)
    parser.add_argument("--tiny", action="store_true", help="tiny config (on CPU without CUDA): a smoke test")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per method (default 10; tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per method (default 3; tiny 1)")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument(
        "--methods",
        default="all",
        help=f"comma list of {','.join(ALL_METHODS)},options,ab, or all (= {','.join(ALL_METHODS)})",
    )
    parser.add_argument("--shares", default="0,0.25,0.5,0.75,1", help="DGLS: shares of the blocks streamed")
    parser.add_argument("--ab_rounds", type=int, default=2, help="A/B: rounds of resident then DGLS per placement")
    parser.add_argument(
        "--ab_steps", type=int, default=5, help="A/B: timed steps per arm and round (2 x 5: the 10 the medians need)"
    )
    parser.add_argument("--gib", default=None, help="DGLS: also stream about this many GiB (comma list)")
    parser.add_argument("--budgets", default=None, help="vram_budget values: auto and/or GiB (comma list)")
    parser.add_argument(
        "--dp_swaps", default=None, help="diffusion-pipe blocks_to_swap: shares, NGiB targets or max (comma list)"
    )
    parser.add_argument("--naive", default=None, help="naive swap: a share of the blocks or an NGiB target")
    parser.add_argument("--latent_frames", type=int, default=3, help="wan: latent frames of the clip (3 = 9 frames)")
    parser.add_argument(
        "--deadline_s",
        type=float,
        default=480.0,
        help="seconds after start: past this, methods are skipped and timed loops stop at 3 steps",
    )
    parser.add_argument("--strict", action="store_true", help="a failing method fails the run (tests)")
    parser.add_argument("--name", default=None, help="results file stem (default per model)")
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    parser.add_argument("--rewrite", action="store_true", help="re-render <name>.md/.png from <name>.json")
    return parser


def main(argv, builders: dict[str, Callable], default_model: str | None, doc: str) -> dict | None:
    """``builders[model](tiny, device, dtype, args) -> Bench``."""
    args = build_parser(list(builders), default_model, doc).parse_args(argv)
    name = args.name or {"flux": "flux_dev"}.get(args.model, args.model)
    args.results_dir = args.results_dir or results_dir(args.tiny)
    if args.rewrite:
        write_reports(json.loads((args.results_dir / f"{name}.json").read_text()), name, args.results_dir, echo=True)
        return None
    methods = ALL_METHODS if args.methods == "all" else tuple(parse_list(args.methods))
    unknown = set(methods) - set(ALL_METHODS) - {"options", "ab"}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}: choose from {', '.join(ALL_METHODS)}, options, ab")
    args.method_set = set(methods)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    started = time.perf_counter()
    device, dtype = setup_device()
    threads = torch.get_num_threads()
    if args.tiny and device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: threads only add contention (CI runners are small and shared)
    try:
        bench = builders[args.model](args.tiny, device, dtype, args)
        bench.build_s = time.perf_counter() - started
        bench.name = name
        if args.gib is None:
            args.gib = bench.defaults.get("gib", "")
        print(
            f"{bench.title}: {bench.shape}; {len(bench.layers)} layers, {len(bench.blocks)} blocks, built in "
            f"{bench.build_s:.1f} s on {device}",
            flush=True,
        )
        return Runner(bench, args, device, dtype, args.results_dir, started).run()
    finally:
        torch.set_num_threads(threads)
