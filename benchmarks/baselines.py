"""The two baselines DGLS is measured against: a naive swap, and diffusion-pipe's own block swap.

- :class:`NaiveSwap`: synchronous ``.to()`` of a block's frozen weights before it runs and back after:
  the lower bound any streaming must beat.
- :class:`DPSwap`: diffusion-pipe's built-in block swap, its ``utils/offloading.py`` ModelOffloader
  imported at run time from the checkout in ``$DGLS_DIFFUSION_PIPE`` and applied to the blocks the way
  that model's ``enable_block_swap`` does. This is the peer comparison: it is measured live, in the
  same process as DGLS, never quoted from another run.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
from machine import release_host_cache
from models import Bench, DPGroup, place
from timing import sync
from torch import nn

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

    def __init__(
        self, layers: list[nn.Module], streamed: set[int], device: torch.device, checkpointed: frozenset[int]
    ) -> None:
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

    def remove(self, layers: list[nn.Module], device: torch.device) -> None:
        for h in self.handles:
            h.remove()
        for layer in layers:
            layer.to(device)


def dp_checkout() -> Path | None:
    path = os.environ.get("DGLS_DIFFUSION_PIPE")
    return Path(path) if path else None


def load_dp_offloading(checkout: Path) -> ModuleType:
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

    def __init__(self, bench: Bench, offloading: ModuleType, groups: list[DPGroup], device: torch.device) -> None:
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


def dp_streamed_bytes(bench: Bench, blocks_to_swap: int) -> int:
    """The bytes diffusion-pipe's offloaders swap at ``blocks_to_swap``: the weights of each group's last
    ``swap`` blocks."""
    total = 0
    for group in bench.dp_split(blocks_to_swap):
        for i in group.layers[len(group.layers) - group.swap :]:
            total += sum(w.numel() * w.element_size() for w in dp_weights(bench.dp_block(bench.layers[i])))
    return total
