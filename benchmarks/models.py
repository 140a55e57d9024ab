"""A model ready to measure: real architectures built with random weights, cut into layer lists.

A benchmark model is built from its diffusers config with its parameters on the meta device (no
download, no init), given random frozen weights directly on the device, cut into a
diffusion-pipe-style layer list, and given LoRA rank 16 on the blocks' Linear layers: the training
step DGLS serves, without the weights. flux.py, sdxl.py and wan.py build the three models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from units import GiB

from utils.dgls import SwapConfig, layer_major_step
from utils.dgls.memory.layout import LayerSizes, measure  # noqa: E402
from utils.dgls.planning.planner import resident_patterns
from utils.dgls.streaming.config import PlacementPolicy
from utils.dgls.streaming.placement import choose_streamed

LORA_RANK = 16


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Construct modules with their parameters on the meta device (no memory, no init) but real
    buffers: rotary tables and the like are computed in ``__init__`` and must survive."""
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


def materialize(layers: list[nn.Module], device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Random frozen weights for meta params, created directly on ``device`` in ``dtype``: N(0, 0.02)
    for matrices and kernels, 1 for vectors with "norm" in their name (so norms pass activations
    through), 0 for the rest. Buffers move to ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in layers:
        for mod_name, module in layer.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                with torch.no_grad():
                    if data.ndim >= 2:
                        data.normal_(0, 0.02, generator=g)
                    elif "norm" in f"{mod_name}.{name}":
                        data.fill_(1.0)
                    else:
                        data.zero_()
                module._parameters[name] = nn.Parameter(data, requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = b.to(device)


def add_lora(layers: list[nn.Module], blocks: list[int], dtype: torch.dtype, rank: int = LORA_RANK) -> None:
    """LoRA on every nn.Linear of the block layers (as diffusion-pipe's adapter does), trainable, in ``dtype``."""
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


def place(layers: list[nn.Module], device: torch.device | str) -> None:
    for layer in layers:
        layer.to(device)


def streamed_by(candidates: list[int], resident_count: int, pattern: str) -> set[int]:
    """The streamed layers of one of the planner's resident patterns ("ends", "spread", "first")."""
    return set(candidates) - set(resident_patterns(candidates, resident_count)[pattern])


@dataclass
class DPGroup:
    """One diffusion-pipe offloader: the block layers it owns and how many of them it swaps."""

    kind: str  # its block_type label
    layers: list[int]  # indices into the layer list, in block order
    swap: int


@dataclass
class Bench:
    """A model ready to measure: layers (LoRA injected, frozen weights on the device), inputs, target,
    and how diffusion-pipe's own block swap would split its blocks (for the ``dp`` baseline)."""

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
    # diffusion-pipe's built-in swap: split(blocks_to_swap) -> offloader groups (None: dp has no block swap here)
    dp_split: Callable[[int], list[DPGroup]] | None = None
    dp_max: int = 0  # the largest blocks_to_swap diffusion-pipe accepts for this model
    dp_note: str = ""  # why there is no dp_split
    dp_block: Callable[[nn.Module], nn.Module] = lambda layer: layer.block  # the module dp's offloader hooks
    defaults: dict = field(default_factory=dict)  # per-model command-line defaults
    sizes: tuple[LayerSizes, ...] = ()

    def __post_init__(self) -> None:
        self.sizes = tuple(layout.sizes for layout in measure(self.layers))

    def training_step(
        self,
        lr: float = 1e-5,
        checkpoint_fn: Callable | None = None,
        micro_batches: int = 1,
        layer_major: bool = False,
        swapper=None,
    ) -> Callable[[], None]:
        """One LoRA training step (forward, backward, AdamW) per call, with a fresh optimizer; the
        checkpointed layers through ``checkpoint_fn(function, *args)`` (default: torch's, non-reentrant).
        ``micro_batches``: gradients of that many micro-batches (the bench's inputs each) accumulated per step, one
        after another or ``layer_major`` (:func:`utils.dgls.layer_major_step`, streamed by ``swapper``)."""
        optimizer = torch.optim.AdamW([p for la in self.layers for p in la.parameters() if p.requires_grad], lr=lr)
        ckpt = checkpoint_fn or partial(checkpoint, use_reentrant=False)
        run = [
            partial(ckpt, layer) if i in self.checkpointed else layer for i, layer in enumerate(self.layers)
        ]  # each as a step runs it, for the layer-major schedule

        def loss(h, m=0):
            return F.mse_loss(h.float(), self.target.float()) / micro_batches

        def step() -> None:
            if layer_major:
                layer_major_step(run, [self.inputs] * micro_batches, loss, swapper)
            else:
                for _ in range(micro_batches):
                    h = self.inputs
                    for i, layer in enumerate(self.layers):
                        h = ckpt(layer, h) if i in self.checkpointed else layer(h)
                    loss(h).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def streamed_for(self, blocks_to_swap: int) -> tuple[int, ...]:
        return tuple(choose_streamed(list(self.sizes), PlacementPolicy(blocks_to_swap=blocks_to_swap)))

    def streamed_bytes(self, streamed) -> int:
        return sum(self.sizes[i].streamable_bytes for i in streamed)

    def blocks_to_swap_for_gib(self, gib: float) -> int:
        """The blocks_to_swap whose streamed bytes come closest to ``gib``."""
        return min(
            range(len(self.blocks) + 1), key=lambda n: abs(self.streamed_bytes(self.streamed_for(n)) / GiB - gib)
        )

    def tight_budget_gib(self) -> float:
        """A VRAM budget just above the smallest DGLS can plan for (the resident essentials and the largest
        layer in 2.5 slots), so that nearly every layer streams: a tiny model's budget, its layers being KiB."""
        fixed = sum(s.fixed_bytes for s in self.sizes)
        return (fixed + 2.5 * max(s.streamable_bytes for s in self.sizes)) / GiB

    def spread_config(self, gib: float, prefetch: int) -> tuple[tuple[int, ...], SwapConfig]:
        """The "spread" placement (resident layers evenly between streamed ones, as the planner places
        them) whose streamed bytes come closest to ``gib``: its streamed layers and its SwapConfig."""
        candidates = [s.index for s in self.sizes if s.streamable_bytes]
        options = [tuple(sorted(streamed_by(candidates, k, "spread"))) for k in range(len(candidates) + 1)]
        spread = min(options, key=lambda streamed: abs(self.streamed_bytes(streamed) / GiB - gib))
        resident = [i for i in candidates if i not in spread]
        return spread, SwapConfig.of(gpu_layers=resident, prefetch=prefetch)
