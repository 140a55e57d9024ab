"""Unit checkpoints: the pieces of each layer (its attention, its MLP, ...) run under checkpoints of their own,
so a layer's backward holds one piece's activations at a time.

Why
    With one checkpoint per layer, the layer's backward holds everything its recompute saved at once. For a
    Wan2.1-14B block at 81 frames (32,760 tokens) that is about 7.3 GiB (self-attention, cross-attention and
    the MLP's activations, and the block's own norm and modulation math), more at its peak with the
    backward's temporaries: once weights stream and checkpointed inputs wait in host memory, this working set
    is what decides the budget. Checkpointing the child modules a layer calls as well keeps only their inputs
    and the layer's own math while the layer is recomputed, and one piece's activations while that piece's
    backward runs.

Pieces
    The child modules of each layer that the swap-unit rule gives at half the layer's size (a Wan block's
    self-attention, cross-attention and MLP; a Flux block's attention, MLPs and modulations), whether the layer
    streams whole or as swap units (:func:`~..streaming.units.checkpoint_pieces`). A module that keeps only its input
    for backward (a Linear, a convolution, their LoRA wrappers) is no piece: its checkpoint would keep the same input
    and free nothing.

Cost
    A piece's forward runs once more per step: three times (forward, the layer's recompute, the piece's rerun)
    where per-layer checkpointing runs it twice, twice where the layer is not checkpointed. Compute grows by
    up to one forward (a quarter of a checkpointed step at most, less where attention's backward dominates).
    No copy is added for a whole layer: it stays resident from its recompute through its pieces' reruns; swap
    units are fetched again where the pool cannot keep them from the recompute to the rerun.

Kept outputs (``keep_piece_outputs``)
    The extra forward can be traded for host memory. Inside a checkpointed layer (a call that activation
    offload wraps, :class:`~.activation_offload.CheckpointedCall`), a piece's first run keeps its output; the
    output's storages go home with the layer's inputs and come back before the layer's recompute (one segment
    later than the inputs, :meth:`~.activation_offload.ActivationOffloader.before_recompute`), and the
    recompute takes the output instead of running the piece, which then runs only for its backward: twice per
    step, as under per-layer checkpointing. Since the piece does not run there, the engine starts no use for it
    (:meth:`UnitCheckpoints.replays`): swap units are not fetched for the recompute either. The cost is the
    outputs' size in pinned host RAM (a Wan-14B block at 81 frames: 1 GB, its three pieces' outputs) and its
    copies each way, on the streams activation offload uses.

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
    :meth:`~..streaming.hooks.HookAdapter.use_inside` starts a use of that entry (resident again if it was evicted) and
    pushes its hooks. The instance ``forward`` steps aside for that call. Without grad (eval, sampling, a
    reentrant checkpoint's first pass) nothing changes.

    With kept outputs the piece is, in both runs of its layer, a :class:`_KeptPiece` autograd node instead:
    it saves the piece's tensor inputs (the same saves in the forward and the recompute, as a non-reentrant
    layer checkpoint requires), computes the output in the first run (grad off inside the node, so nothing
    else is saved) and returns the kept one in the recompute; its backward runs the piece again with grad from
    the saved inputs, under the first run's RNG states and autocast (:class:`RunState`), and backpropagates
    through it (params' gradients accumulate in place, as under a reentrant checkpoint). Each input that
    requires grad enters the rerun as a leaf only where it was one in the run whose graph backward follows,
    else as a view of one: autocast casts a float32 leaf that requires grad to the low dtype once per region
    (the reads share that cast, and their gradients add in the low dtype), an intermediate at each read (the
    gradients add in float32); under bf16 autocast a LoRA Linear reads its float32 input twice, an attention's
    projections three or six times. The recompute also sets the RNG to where the piece's first run left it,
    so the layer's own random draws after it match. In a reentrant or 'unsloth' layer checkpoint's first pass
    (grad off) the piece runs plainly and keeps its output; the recompute's node is the one backward reaches.

Invariants
    - Bitwise: a rerun computes what the first run did (the checkpoint restores the RNG state and autocast),
      so gradients equal those of per-layer checkpointing with deterministic kernels.
    - Kept outputs are bitwise too, but for one case: a piece that reads an input more than once, in a layer
      that reads that input again after the piece (``x + piece(x)``), or shares autocast's cast of a float32
      leaf with the rest of the layer. The rerun sums the piece's own gradients for the input before backward
      adds the layer's; per-layer checkpointing adds each as it comes, and the sums round apart in the last
      bits. Flux's and Wan's pieces read each input once, or are its only or last reader.
    - A piece computes only while its entry is in use: every rerun starts a use of it.
    - A layer with pieces is never compiled (its forward runs checkpoints with side effects on the engine).
    - Kept outputs: a recompute takes the outputs in the order its forward kept them, and refuses another
      order with one line; once taken, only the layer's graph holds them (it frees them after its backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import DGLSUserError
from ..streaming.feature import Engine, Feature
from ..streaming.units import Entry, checkpoint_pieces, path_and_parents
from ..torch_private import TreeSpec, is_view, storage_key, tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .activation_offload import CheckpointedCall


@dataclass(frozen=True)
class Piece:
    """A module to checkpoint on its own: ``entry`` is the engine entry it belongs to; ``is_entry``: it is that
    entry itself (a swap unit, or a holder of units), so its own module hooks start its uses."""

    module: nn.Module
    entry: int
    is_entry: bool


_TENSOR = object()  # in a list of flattened values, where a tensor goes


def _same(value):
    return value


def _others(leaves: list) -> list:
    """Flattened values with every tensor replaced by ``_TENSOR`` (``None`` may be a value of its own)."""
    return [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]


def _autocast_caches(tensor: torch.Tensor) -> bool:
    """Autocast's rule for the casts it caches (within one autocast region): a leaf that requires grad and is no
    view. Such an input's casts are one node in its graph; any other input's are one node per use."""
    return tensor.requires_grad and tensor.is_leaf and not is_view(tensor)


@dataclass(frozen=True)
class RunState:
    """What a piece's rerun in backward reproduces of its first run: the RNG states (dropout draws the same
    mask) and autocast. Read with public APIs only; the CUDA generator's state is host-side (no sync)."""

    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None  # the CUDA generator of ``device``
    device: torch.device
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    autocast_cache: bool

    @classmethod
    def capture(cls, device: torch.device, rng_only: bool = False) -> RunState:
        cuda = device.type == "cuda"
        kinds = () if rng_only else tuple(dict.fromkeys(("cpu", device.type)))
        return cls(
            torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if cuda else None,
            device,
            tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds),
            torch.is_autocast_cache_enabled(),
        )

    def same_rng(self, other: RunState) -> bool:
        cuda_same = self.device_rng is None or torch.equal(self.device_rng, other.device_rng)
        return cuda_same and torch.equal(self.cpu_rng, other.cpu_rng)

    def set_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, self.device)

    @contextmanager
    def reproduced(self) -> Iterator[None]:
        """The RNG states and autocast of the first run, for the code inside (the RNG is restored after)."""
        devices = [self.device] if self.device_rng is not None else []
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=self.device.type))
            self.set_rng()
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                )
            yield


class KeptRun:
    """One call of a piece inside a checkpointed layer whose recompute takes the piece's output from the first
    run (``keep_piece_outputs``): what its rerun in backward needs, and the output kept for the recompute.

    The output's tensors are kept detached (tensors of their own on the same storages, without the first run's
    graph): activation offload sends their storages home with the layer's inputs and brings them back before
    the recompute, which returns them (as outputs of :class:`_KeptPiece`, so backward reaches the piece)."""

    def __init__(self, piece: _PieceForward, leaves: list, spec: TreeSpec, state: RunState) -> None:
        self.piece = piece
        self.spec = spec
        self.others = _others(leaves)  # the non-tensor inputs
        self.state = state  # before the first run
        self.after: RunState | None = None  # the RNG after the first run, when the piece drew from it
        self.kept: tuple[torch.Tensor, ...] = ()
        self.out_spec: TreeSpec | None = None
        self.out_others: list = []

    def inputs(self, tensors) -> tuple[tuple, dict]:
        it = iter(tensors)
        return tree_unflatten([next(it) if x is _TENSOR else x for x in self.others], self.spec)

    def first(self, tensors) -> tuple[torch.Tensor, ...]:
        """The first run (grad off: inside :class:`_KeptPiece`, or a reentrant layer checkpoint's first pass):
        the class's forward, inside the use of the entry that reached the piece. Keeps the output."""
        args, kwargs = self.inputs(tensors)
        flat, self.out_spec = tree_flatten(self.piece.forward(*args, **kwargs))
        after = RunState.capture(self.state.device, rng_only=True)
        self.after = None if after.same_rng(self.state) else after
        self.out_others = _others(flat)
        outputs = tuple(x for x in flat if isinstance(x, torch.Tensor))
        self.kept = tuple(t.detach() for t in outputs)
        return outputs

    def release(self) -> tuple[torch.Tensor, ...]:
        """The kept output, for the recompute, which is its last reader here: from now on only the layer's graph
        holds it (through its backward it would otherwise stay on the device)."""
        kept, self.kept = self.kept, ()
        return kept

    def output(self, tensors) -> object:
        it = iter(tensors)
        return tree_unflatten([next(it) if x is _TENSOR else x for x in self.out_others], self.out_spec)

    def backward(self, saved: tuple, needs: tuple[bool, ...], leaves: tuple[bool, ...], grads: tuple) -> list:
        """Run the piece again from its saved inputs, with grad, as in its first run, and backpropagate ``grads``
        through it: the gradients of the inputs (the params' accumulate in place, as a reentrant checkpoint's).

        An input that requires grad is a leaf of the rerun only where it was one in the graph backward follows
        (``leaves``), else a view of its leaf: autocast shares one cast among the reads of a float32 leaf and
        casts anything else at each read, and the reads' gradients sum differently (see the module docstring)."""
        grad_leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, needs)]
        read = {storage_key(t) for t in grad_leaves}  # storages backward still reads: the inputs, and
        # what the rerun saves (DGLS's own hooks, pushed above these, turn views of slots into references)

        def note_saved(tensor: torch.Tensor) -> torch.Tensor:
            read.add(storage_key(tensor))
            return tensor

        with torch.enable_grad():  # a view made here is part of the graph (backward runs without grad)
            inputs = [x if leaf or not need else x.view_as(x) for x, leaf, need in zip(grad_leaves, leaves, needs)]
            with self.state.reproduced(), torch.autograd.graph.saved_tensors_hooks(note_saved, _same):
                outputs = self.piece.rerun(*self.inputs(inputs))
        flat = [x for x in tree_flatten(outputs)[0] if isinstance(x, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(flat, grads) if g is not None and o.requires_grad]
        for o, _ in pairs:  # an output nothing saved is read by no one: only its graph is needed from here on
            storage = o.untyped_storage()
            if storage_key(o) not in read and storage.resizable():
                storage.resize_(0)
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [t.grad if need else None for t, need in zip(grad_leaves, needs)]


class _KeptPiece(torch.autograd.Function):
    """A piece in a checkpointed layer, as autograd sees it in both runs of the layer: the same tensors saved
    (its inputs, so a non-reentrant layer checkpoint counts the same saves in the forward and the recompute),
    outputs computed in the first run and returned from the kept ones in the recompute, and a backward that
    runs the piece again (:meth:`KeptRun.backward`). ``anchor`` requires grad, so backward reaches the piece
    even when none of its inputs requires grad (LoRA params inside it do)."""

    @staticmethod
    def forward(ctx, run: KeptRun, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.run = run
        ctx.leaves = tuple(_autocast_caches(t) for t in tensors)  # as the graph backward follows has them
        ctx.save_for_backward(*tensors)
        outputs = run.release() if run.out_spec is not None else run.first(tensors)  # the recompute, or the first run
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *ctx.run.backward(ctx.saved_tensors, ctx.needs_input_grad[2:], ctx.leaves, grads)


class _PieceForward:
    """The instance ``forward`` of one piece: the class's forward, under a checkpoint when grad is enabled, or with
    ``keep_piece_outputs`` inside a checkpointed layer, run once in its first run and replayed in its recompute."""

    def __init__(
        self,
        piece: Piece,
        hooks_for: Callable[[int], AbstractContextManager],
        use_inside: Callable[[int], AbstractContextManager],
        calling: Callable[[], CheckpointedCall | None] | None,
        anchor: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.piece = piece
        self.forward = type(piece.module).forward.__get__(piece.module)
        self.hooks_for = hooks_for
        self.use_inside = use_inside
        self.calling = calling
        self.anchor = anchor
        self.device = device
        self.rerunning = False
        self.reruns = 0  # tests: how often backward ran the piece again
        self.replayed = 0  # tests: how often a layer's recompute took the piece's kept output

    def __call__(self, *args, **kwargs):
        if self.rerunning:
            return self.forward(*args, **kwargs)
        call = self.calling() if self.calling is not None else None
        if call is not None:
            return self._replay(call, args, kwargs) if call.recomputing else self._keep(call, args, kwargs)
        if not torch.is_grad_enabled():
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
            return self.rerun(args, kwargs)

        return checkpoint(run, *leaves, use_reentrant=False)

    def rerun(self, args: tuple, kwargs: dict):
        """Backward reached the piece: run it again as a use of its entry."""
        self.rerunning, self.reruns = True, self.reruns + 1
        try:
            with nullcontext() if self.piece.is_entry else self.use_inside(self.piece.entry):
                return self.piece.module(*args, **kwargs)
        finally:
            self.rerunning = False

    def _keep(self, call: CheckpointedCall, args: tuple, kwargs: dict):
        """The first run of the checkpointed layer: run the piece, keep its output for the layer's recompute."""
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        run = KeptRun(self, leaves, spec, RunState.capture(self.device))
        if self._differentiable(tensors):  # a non-reentrant layer checkpoint: the recompute saves what this saves
            outputs = _KeptPiece.apply(run, self.anchor, *tensors)
        else:
            outputs = run.first(tensors)
        call.keep(run, list(run.kept))
        return run.output(outputs)

    def _replay(self, call: CheckpointedCall, args: tuple, kwargs: dict):
        """The layer's recompute: the output kept in its first run, as the output of the piece's autograd node."""
        if not self.replays_next(call):
            raise DGLSUserError(
                f"keep_piece_outputs: the recompute of a checkpointed layer called its pieces in another order than "
                f"its forward did (at a {type(self.piece.module).__name__}): drop keep_piece_outputs"
            )
        run = call.outputs.popleft()
        self.replayed += 1
        if run.after is not None:  # the RNG as the first run left it: later random draws of the layer match
            run.after.set_rng()
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if self._differentiable(tensors):
            return run.output(_KeptPiece.apply(run, self.anchor, *tensors))
        return run.output(run.release())

    def _differentiable(self, tensors: list[torch.Tensor]) -> bool:
        if not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in tensors) or any(p.requires_grad for p in self.piece.module.parameters())

    def replays_next(self, call: CheckpointedCall) -> bool:
        """``call`` is a recompute, and the next output it kept is this piece's."""
        return call.recomputing and bool(call.outputs) and call.outputs[0].piece is self


class UnitCheckpoints(Feature):
    """Installs :class:`_PieceForward` on the pieces; :meth:`remove` (or :meth:`close`) puts the class forwards back.

    At :meth:`install` it takes from the engine's hooks (:class:`~..streaming.hooks.HookAdapter`)
    ``saved_tensor_hooks(entry)``,
    which pushes DGLS's saved-tensor hooks for an entry above those active now, and ``use_inside(entry)``, which
    starts a use of an entry and pushes its hooks. ``layers``: how many layers the pieces belong to (the report)."""

    def __init__(
        self,
        pieces: list[Piece],
        device: torch.device,
        calling: Callable[[], CheckpointedCall | None] | None = None,
        layers: int = 0,
    ) -> None:
        self.pieces = pieces
        self.device = device
        self.calling = calling  # keep_piece_outputs: the checkpointed call running now (activation offload's)
        self.layers = layers
        self._anchor = torch.empty(0, requires_grad=True)  # see _KeptPiece
        self._installed: list[_PieceForward] = []
        self._by_module: dict[int, _PieceForward] = {}

    @staticmethod
    def check(pieces: list[Piece]) -> None:
        """Refuse pieces whose ``forward`` someone already replaced: call it before changing anything (the
        builder does, at start-up), since :meth:`install` would replace that forward."""
        for piece in pieces:
            if "forward" in vars(piece.module):
                raise DGLSUserError(
                    f"checkpoint_units: a {type(piece.module).__name__} already has a forward of its own (compiled or "
                    "patched by the trainer), which its checkpoint would replace: drop checkpoint_units"
                )

    def install(self, engine: Engine) -> None:
        hooks = engine.hooks
        for piece in self.pieces:
            wrapper = _PieceForward(
                piece, hooks.saved_tensor_hooks, hooks.use_inside, self.calling, self._anchor, self.device
            )
            piece.module.forward = wrapper
            self._installed.append(wrapper)
            self._by_module[id(piece.module)] = wrapper

    def remove(self) -> None:
        for wrapper in self._installed:
            if vars(wrapper.piece.module).get("forward") is wrapper:
                del wrapper.piece.module.forward
        self._installed.clear()
        self._by_module.clear()

    def close(self) -> None:
        self.remove()

    def describe(self) -> list[str]:
        cost = (
            "their outputs wait in host memory for their layer's recompute"
            if self.calling is not None
            else "each piece's forward runs once more per step"
        )
        return [
            f"DGLS: checkpoint_units: {len(self.pieces)} swap units or child modules of {self.layers} layers run "
            f"under checkpoints of their own (a layer's backward holds one piece's activations; {cost})"
        ]

    def replays(self, module: nn.Module) -> bool:
        """The next call of ``module`` is a layer's recompute taking its kept output (``keep_piece_outputs``):
        the engine starts no use for it (:class:`~..streaming.hooks.HookAdapter`), so no copy brings its weights."""
        call = self.calling() if self.calling is not None else None
        wrapper = self._by_module.get(id(module)) if call is not None else None
        return wrapper is not None and wrapper.replays_next(call)

    @property
    def reruns(self) -> int:
        return sum(w.reruns for w in self._installed)

    @property
    def replayed(self) -> int:
        return sum(w.replayed for w in self._installed)


def pieces_to_checkpoint(entries: Sequence[Entry], trainable_streams: bool = False) -> list[Piece]:
    """What ``checkpoint_units`` checkpoints: the :func:`checkpoint_pieces` of each of the caller's layers, each
    with the entry that runs it: itself where it is a swap unit or a holder of units, else the nearest entry
    that contains it (the whole layer, or the unit it is part of)."""
    pieces: list[Piece] = []
    for entry in entries:
        if entry.part or not isinstance(entry.value, nn.Module):
            continue  # only the caller's layers (whole, or the holder of their units)
        paths = {e.part: i for i, e in enumerate(entries) if e.layer == entry.layer}
        for path, module in checkpoint_pieces(entry.value, trainable_streams):
            owner = next(paths[p] for p in path_and_parents(path) if p in paths)
            pieces.append(Piece(module, owner, is_entry=path in paths))
    return pieces
