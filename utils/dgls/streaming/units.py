"""Swap units: split a layer that is too large into the child modules it runs, so the pool holds smaller pieces.

Why
    The pool holds ``prefetch + 1`` slots of the largest streamed entry. A Wan2.1-14B block is 674 MiB,
    so two slots take 1.3 GiB of a 4 GiB budget, and one of diffusion-pipe's SDXL layers holds up to ten
    transformer blocks. Streaming a block's attention and its MLP as separate units halves (or better) the
    slot, at the cost of a few more, smaller copies.

Layout
    :func:`split_layers` turns the caller's layer list into the engine's entry list. A layer no larger
    than ``max_bytes`` is one entry, as before. A larger one becomes a *holder* entry (the layer module
    itself) followed by its *parts*, depth first: each child module of 1 MiB or more becomes a part, or,
    if it is itself larger than ``max_bytes`` and has children (or has no forward of its own, as a
    ``ModuleList``), a holder of its own parts (children under 1 MiB, or under 1/16 of ``max_bytes``, are not
    worth a copy of their own). What no part owns (the holder's own params, such as Wan's
    ``modulation``, and children under 1 MiB, such as norms) stays resident: :mod:`..memory.layout` sees that an
    entry holds other entries and counts those params as fixed.

Mechanics
    Every entry gets the engine's hooks (:mod:`.hooks`). The holder's forward starts a use of the holder
    (resident: it only releases the previous entry); each part's forward starts a use of that part, so
    the parts stream one after another and the use predictor learns their order, in forward, recompute
    and backward alike. Placement settings (``gpu_layers``, ``blocks_to_swap``, the ends) still name the
    caller's layers: a layer they stream streams all its parts (:func:`~.placement.choose_streamed`).

Hazards
    - A part's weights must only be read inside its own forward: its use ends when the next entry's use
      begins, and then its params may point at an empty placeholder. A holder that reads a child's weights
      directly (``F.linear(x, self.proj.weight)``) or iterates an ``nn.Sequential`` instead of calling it
      fails loudly (a shape error on the placeholder), never silently; DGLS adds a note to that error naming
      ``swap_unit_mb``. Turn splitting off for such a model with ``swap_unit_mb = 0``.
    - Under non-reentrant checkpointing a layer's region now spans several entries; :mod:`.hooks` keeps
      views of a streamed part's slot out of the checkpoint's storage (they are rebuilt from the part's
      current slot when backward needs them), so the region is safe.
    - ``compile`` never compiles a holder (its parts stream), only whole resident entries.

Checkpoint pieces
    :func:`~..activations.unit_checkpoints.pieces_to_checkpoint` says what ``checkpoint_units`` runs under
    checkpoints of its own: each layer's children at half its size by the same rule, split into units or not.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

MIN_PART_BYTES = 1024 * 1024  # children smaller than this (or than 1/16 of a unit) stay with their holder
MIN_PART_SHARE = 16  # (resident): not worth a copy of their own


@dataclass(frozen=True)
class Entry:
    """One entry of the engine's list: a module (or a weightless function) of the caller's layer ``layer``.
    ``part`` is its path inside that layer ('' for the whole layer, or for the layer as a holder);
    ``holder``: it was split and runs the parts that follow it."""

    value: object
    layer: int
    part: str = ""
    holder: bool = False


def param_bytes(module: nn.Module, trainable: bool = True) -> int:
    """Bytes of a module's params (each counted once); without ``trainable``, of its frozen ones only."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if trainable or not p.requires_grad)


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def split_layers(layers: Sequence, max_bytes: int | None, trainable_streams: bool = False) -> list[Entry]:
    """The engine's entries for ``layers``: each layer whole, or (when it holds more than ``max_bytes`` of
    params that can stream and has children to split into) as a holder followed by its parts. ``None`` or 0:
    no splitting. Sizes count frozen params, and trainable ones too if they stream (``trainable_streams``:
    full fine-tuning with the optimizer on the host)."""
    entries: list[Entry] = []
    # at least 1: a child without params is never a part, however small the units
    min_bytes = max(1, min(MIN_PART_BYTES, max_bytes // MIN_PART_SHARE)) if max_bytes else 0
    for index, layer in enumerate(layers):
        if max_bytes and isinstance(layer, nn.Module) and param_bytes(layer, trainable_streams) > max_bytes:
            parts = list(_split(layer, "", max_bytes, min_bytes, trainable_streams))
            if any(not holder for _, _, holder in parts):
                entries.extend(Entry(module, index, path, holder) for path, module, holder in parts)
                continue
        entries.append(Entry(layer, index))
    return entries


def _split(
    module: nn.Module, path: str, max_bytes: int, min_bytes: int, trainable: bool
) -> Iterator[tuple[str, nn.Module, bool]]:
    """(path, module, is holder) of ``module`` as a holder, then of its parts, depth first."""
    yield path, module, True
    for name, child in module.named_children():
        size = param_bytes(child, trainable)
        if size < min_bytes:
            continue  # stays with the holder
        child_path = f"{path}.{name}" if path else name
        splittable = any(True for _ in child.children())
        if splittable and (not _has_forward(child) or size > max_bytes):
            yield from _split(child, child_path, max_bytes, min_bytes, trainable)
        elif _has_forward(child):
            yield child_path, child, False
        # a weighty module without forward or children is read by its holder: it stays resident


def split_points(layers: Sequence, trainable_streams: bool = False) -> set[int]:
    """The unit sizes at which a module stops being one unit of :func:`split_layers`: the param bytes of each module
    that has children and a forward of its own, layers included (at that size it is one unit, or the layer stays
    whole; one byte less splits it). A module without children is a unit at any size; one without a forward always
    splits. Sizes count as :func:`split_layers` counts them (``trainable_streams``).

    - Not every size where its answer changes: a child under ``min(MIN_PART_BYTES, size // MIN_PART_SHARE)`` stays
      with its holder, so the answer also changes at ``MIN_PART_SHARE`` times each child's bytes under
      ``MIN_PART_BYTES``; those moves only take small children out of the slots, and are not listed."""
    points: set[int] = set()
    for layer in layers:
        if isinstance(layer, nn.Module):
            for module in layer.modules():
                if _has_forward(module) and any(True for _ in module.children()):
                    if size := param_bytes(module, trainable_streams):
                        points.add(size)
    return points


# Modules that keep only their input for backward (PEFT's LoRA layers wrap one as ``base_layer``): a checkpoint
# keeps that input anyway, so checkpointing one on its own frees nothing and costs a rerun.
SAVES_ONLY_ITS_INPUT = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def saves_only_its_input(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", module), SAVES_ONLY_ITS_INPUT)


def checkpoint_pieces(layer: nn.Module, trainable_streams: bool = False) -> list[tuple[str, nn.Module]]:
    """(path, module) of the child modules ``checkpoint_units`` runs under checkpoints of their own: those the
    swap-unit rule gives at half the layer's size (a block's attention, its MLP, its modulation), whether or not
    the layer streams as swap units, less those that keep only their input (:func:`saves_only_its_input`)."""
    size = param_bytes(layer, trainable_streams)
    if not size:
        return []
    limit = size // 2
    min_bytes = min(MIN_PART_BYTES, limit // MIN_PART_SHARE)
    return [
        (path, module)
        for path, module, holder in _split(layer, "", limit, min_bytes, trainable_streams)
        if not holder and not saves_only_its_input(module)
    ]


def path_and_parents(path: str) -> Iterator[str]:
    """'a.b.c', 'a.b', 'a', then '' (the layer itself)."""
    while path:
        yield path
        path = path.rpartition(".")[0]
    yield ""


def split_note(entries: Sequence[Entry], max_bytes: int | None) -> str:
    """What the start-up report says about split layers ('' when none is split)."""
    split = sorted({e.layer for e in entries if e.holder})
    if not split or not max_bytes:
        return ""
    parts = sum(1 for e in entries if e.part and not e.holder)
    return (
        f"DGLS: {len(split)} layers over {max_bytes / 2**20:.1f} MB (swap_unit_mb) run as {parts} swap units, "
        "listed under them above; what no unit holds stays resident"
    )
