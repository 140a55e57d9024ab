"""Unit checkpoints: the pieces of each layer (its attention, its MLP, ...) run under checkpoints of their own,
so a layer's backward holds one piece's activations at a time.

Why
    With one checkpoint per layer, the layer's backward holds everything its recompute saved at once. For a
    Wan2.1-14B block at 81 frames (32,760 tokens) that is about 7.3 GiB (self-attention, cross-attention and
    the MLP's activations, and the block's own norm and modulation math), 10.5 GiB at its peak with the
    backward's temporaries: once weights stream and checkpointed inputs wait in host memory, this working set
    is what decides the budget. Checkpointing the child modules a layer calls as well keeps only their inputs
    and the layer's own math while the layer is recomputed, and one piece's activations while that piece's
    backward runs.

Pieces
    The child modules of each layer that the swap-unit rule gives at half the layer's size (a Wan block's
    self-attention, cross-attention and MLP; a Flux block's attention, MLPs and modulations), whether the layer
    streams whole or as swap units (:func:`~.units.checkpoint_pieces`). A module that keeps only its input for
    backward (a Linear, a convolution, their LoRA wrappers) is no piece: its checkpoint would keep the same input
    and free nothing.

Cost
    A piece's forward runs once more per step: three times (forward, the layer's recompute, the piece's rerun)
    where per-layer checkpointing runs it twice, twice where the layer is not checkpointed. Compute grows by
    up to one forward (a quarter of a checkpointed step at most, less where attention's backward dominates).
    No copy is added for a whole layer: it stays resident from its recompute through its pieces' reruns; swap
    units are fetched again where the pool cannot keep them from the recompute to the rerun.

Mechanics
    :meth:`UnitCheckpoints.install` gives every piece an instance ``forward`` over its class's, which
    :meth:`UnitCheckpoints.remove` deletes again. With grad enabled (the forward, or the recompute of a layer
    checkpointed by any method) it calls ``torch.utils.checkpoint`` (non-reentrant, which nests inside a
    non-reentrant layer checkpoint and runs inside a reentrant one's or 'unsloth''s recompute). The first run
    happens inside the call that reached the piece, with DGLS's saved-tensor hooks for its entry pushed again
    above the checkpoint's own, so views of a slot bypass the checkpoint in this run as they do in the rerun
    (the counts of saved tensors match). When backward reaches the piece, the checkpoint runs it again through
    ``module(...)``: for a piece that is an entry (a swap unit, or a holder of units) the engine's module hooks
    start its use (and push the hooks); for a piece inside an entry (a whole layer, or a unit),
    :meth:`~.hooks.HookAdapter.use_inside` starts a use of that entry (resident again if it was evicted) and
    pushes its hooks. The instance ``forward`` steps aside for that call. Without grad (eval, sampling, a
    reentrant checkpoint's first pass) nothing changes.

Invariants
    - Bitwise: a rerun computes what the first run did (the checkpoint restores the RNG state and autocast),
      so gradients equal those of per-layer checkpointing with deterministic kernels.
    - A piece computes only while its entry is in use: every rerun starts a use of it.
    - A layer with pieces is never compiled (its forward runs checkpoints with side effects on the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .errors import DGLSUserError


@dataclass(frozen=True)
class Piece:
    """A module to checkpoint on its own: ``entry`` is the engine entry it belongs to; ``is_entry``: it is that
    entry itself (a swap unit, or a holder of units), so its own module hooks start its uses."""

    module: nn.Module
    entry: int
    is_entry: bool


class _PieceForward:
    """The instance ``forward`` of one piece: the class's forward, under a checkpoint when grad is enabled."""

    def __init__(
        self,
        piece: Piece,
        hooks_for: Callable[[int], AbstractContextManager],
        use_inside: Callable[[int], AbstractContextManager],
    ) -> None:
        self.piece = piece
        self.forward = type(piece.module).forward.__get__(piece.module)
        self.hooks_for = hooks_for
        self.use_inside = use_inside
        self.rerunning = False
        self.reruns = 0  # tests: how often backward ran the piece again

    def __call__(self, *args, **kwargs):
        if self.rerunning or not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        # Every tensor goes to the checkpoint as a positional input: it saves those through the saved-tensor hooks
        # (so an outer checkpoint or activation offload manages them), while its closure would hold keyword
        # arguments by reference from the forward until backward (a Flux block passes its attention's input so).
        leaves, spec = tree_flatten((args, kwargs))
        first = True

        def run(*leaves):
            nonlocal first
            args, kwargs = tree_unflatten(list(leaves), spec)
            if first:  # inside the call that got here: the entry is in use; DGLS's hooks go above the checkpoint's
                first = False
                with self.hooks_for(self.piece.entry):
                    return self.forward(*args, **kwargs)
            self.rerunning, self.reruns = True, self.reruns + 1
            try:
                with nullcontext() if self.piece.is_entry else self.use_inside(self.piece.entry):
                    return self.piece.module(*args, **kwargs)
            finally:
                self.rerunning = False

        return checkpoint(run, *leaves, use_reentrant=False)


class UnitCheckpoints:
    """Installs :class:`_PieceForward` on the pieces; :meth:`remove` puts the class forwards back.

    ``hooks_for(entry)`` pushes DGLS's saved-tensor hooks for an entry above those active now;
    ``use_inside(entry)`` starts a use of an entry and pushes its hooks (both :class:`~.hooks.HookAdapter`)."""

    def __init__(
        self,
        pieces: list[Piece],
        hooks_for: Callable[[int], AbstractContextManager],
        use_inside: Callable[[int], AbstractContextManager],
    ) -> None:
        self.pieces = pieces
        self.hooks_for = hooks_for
        self.use_inside = use_inside
        self._installed: list[_PieceForward] = []

    @staticmethod
    def check(pieces: list[Piece]) -> None:
        """Refuse pieces whose ``forward`` someone already replaced: call it before changing anything (the
        swapper does, at start-up), since :meth:`install` would replace that forward."""
        for piece in pieces:
            if "forward" in vars(piece.module):
                raise DGLSUserError(
                    f"checkpoint_units: a {type(piece.module).__name__} already has a forward of its own (compiled or "
                    "patched by the trainer), which its checkpoint would replace: drop checkpoint_units"
                )

    def install(self) -> None:
        for piece in self.pieces:
            wrapper = _PieceForward(piece, self.hooks_for, self.use_inside)
            piece.module.forward = wrapper
            self._installed.append(wrapper)

    def remove(self) -> None:
        for wrapper in self._installed:
            if vars(wrapper.piece.module).get("forward") is wrapper:
                del wrapper.piece.module.forward
        self._installed.clear()

    @property
    def reruns(self) -> int:
        return sum(w.reruns for w in self._installed)
