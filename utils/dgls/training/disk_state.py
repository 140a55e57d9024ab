"""Disk state: the fp32 masters and optimizer state of full fine-tuning's layers that do not fit the host RAM budget
live in a file on disk; each is read for its layer's update and written back after it.

Why: a full fine-tune keeps, beside each streamed layer's packed copy, an fp32 master and the optimizer's state (AdamW:
two fp32 moments), six times the bf16 weights; they are read once a step (by the update), the weights twice (forward
and backward), so with a host RAM budget they spill first (:func:`plan_full_tiers`), the weights only once every
layer's state is on disk (the disk tier, :mod:`..memory.disk_tier`). Which layers' state spills: the state plan
(:mod:`..planning.state_plan`), those whose reads and write-backs hide behind the most remaining work of the step.

Layout
    - One unnamed file (:class:`~..memory.disk_tier.DiskFile`: gone when the process ends, however it ends) with an
      extent of whole pages per spilled layer: its own fp32 masters (params whose packed copy is not the master),
      then each param's state tensors (``state_keys``: fp32, shaped as the param), each 64-byte aligned.
    - ``SLOTS`` page-aligned RAM buffers of the largest extent. A layer's update runs on its tensors bound into one
      (``Tensor.set_``: the optimizer's param groups and state dicts keep the same tensor objects). Out of it they
      keep their shape over one NaN element (stride 0), so a read of a layer's state outside its update computes
      NaN rather than stale numbers.

Order (all on the job worker's thread, in the update jobs' order; the transport's disk directions)
    - :meth:`DiskState.queued` (training thread): an update of the layer was queued (a FIFO).
    - :meth:`DiskState.ahead` (every host update job, as it starts): with no read in flight, the read of the first
      queued spilled layer is issued, so it overlaps the updates before that layer's (the state plan's model,
      :mod:`..planning.state_plan`, replays this order).
    - :meth:`DiskState.bring_in` (the update job, before the step): the layer's read (issued by a job before, or
      now) is landed and its tensors bound to its slot; then the read of the next queued spilled layer is issued into
      the other slot, so it overlaps this update.
    - :meth:`DiskState.send_home` (the update job, after the step): tensors the step made (a first step's state) are
      copied into the slot, the extent written back (``Direction.DISK_OUT``), the tensors unbound.

Invariants
    - A read into slot ``k`` waits for the write-back from slot ``k`` before it (the write still reads the slot), and
      for the layer's own last write-back (else it reads the bytes of the step before): the CPU transport, whose
      reads leave NaN until waited for and whose writes land only when waited for, fails a test when a wait is
      missing.
    - No update reads state that is not read: its job lands its read before binding.
    - Host updates only, per-layer optimizers whose state is ``state_keys`` tensors; no speculative updates for these
      layers (no spare); the build refuses the rest in one line.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DGLSUserError
from ..memory.disk_io import ThreadReader, pread_into
from ..memory.disk_tier import DiskFile, check_directory, remove_stale
from ..memory.layout import LayerLayout, TrainingLayout, human_bytes
from ..memory.pinned import page_aligned_empty, whole_pages
from ..memory.transport import Copy, Transport
from ..streaming.tiers import Chooser, Tiers, plan_tiers, spread
from .grad_return import TrainedLayer

SLOTS = 2  # one being updated while the next one's state is read
ALIGN = 64


@dataclass(frozen=True)
class Piece:
    """One tensor of a layer's extent: a param's master (``key`` None) or one of its state tensors."""

    position: int  # the param's, in its layer's layout order
    key: str | None
    offset: int  # bytes into the extent
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)


def extent_pieces(layout: TrainingLayout, idx: int) -> tuple[list[Piece], int]:
    """Layer ``idx``'s pieces (masters first, then each param's state) and the extent's bytes."""
    pieces, offset = [], 0
    place = layout.layers[idx]
    wanted = [(p, None) for p in place.params if p.own_master]
    wanted += [(p, key) for p in place.params for key in layout.state_keys]
    for p, key in wanted:
        piece = Piece(p.position, key, offset, tuple(p.param.shape))
        pieces.append(piece)
        offset += -(-piece.nbytes // ALIGN) * ALIGN
    return pieces, offset


def state_ram_bytes(layout: TrainingLayout, idx: int) -> int:
    """What layer ``idx``'s masters and optimizer state take in RAM (what spilling it saves)."""
    return sum(p.nbytes for p in extent_pieces(layout, idx)[0])


def plan_full_tiers(
    layouts: Sequence[LayerLayout],
    hosted: Sequence[int],
    streamed: Sequence[int],
    budget: int,
    ring_count: int,
    trained: TrainingLayout,
    choose: Chooser | None = None,
    choose_states: Chooser | None = None,
) -> tuple[Tiers, dict[int, int]]:
    """A full fine-tune under ``budget``: the weights' tiers and the spilled training states (layer -> extent bytes).

    RAM holds the packed copies, the gradients (landings, sums), the masters and state of the layers not spilled and
    ``SLOTS`` buffers of the largest spilled extent. States spill first (read once a step): those ``choose_states``
    picks (the state plan, :mod:`..planning.state_plan`: the layers whose reads and write-backs hide behind the most
    remaining work; given the candidates in layer order and the bytes a choice leaves over the budget, it returns a
    choice that fits whenever spilling every state does, else every candidate), or without it as few as fit, spread
    over the layer order; with every state on disk, the weights spill as for a LoRA
    (:func:`~..streaming.tiers.plan_tiers`, with ``choose``) within what is left."""
    packed = sum(whole_pages(layouts[i].host_bytes) for i in hosted)
    parts = trained.parts()
    gradients = parts["gradients"]
    extents = {i: whole_pages(extent_pieces(trained, i)[1]) for i in trained.layers}
    state = {i: state_ram_bytes(trained, i) for i in trained.layers}
    order = sorted(i for i in extents if state[i])  # a layer with nothing to spill (fp32 SGD) saves nothing

    def over(chosen: list[int]) -> int:
        slots = SLOTS * max((extents[i] for i in chosen), default=0)
        spilled = set(chosen)
        kept = sum(n for i, n in state.items() if i not in spilled)
        return packed + gradients + kept + slots - budget

    def fits(chosen: list[int]) -> tuple[Tiers, dict[int, int]]:
        return Tiers(budget, packed, ring_count, states=len(chosen)), {i: extents[i] for i in sorted(chosen)}

    if choose_states is not None:
        chosen = choose_states(order, over)
        if over(chosen) <= 0:
            return fits(chosen)
        if over(order) <= 0:  # not the user's to fix: the chooser broke its contract
            raise AssertionError(
                f"the state plan chose {len(chosen)} of {len(order)} layers' masters and optimizer state to spill, "
                f"{human_bytes(over(chosen))} over the host RAM budget, where spilling all of them fits it"
            )
    else:
        for k in range(len(order) + 1):
            if over(spread(order, k)) <= 0:
                return fits(spread(order, k))
    extents = {i: extents[i] for i in order}
    slots = SLOTS * max(extents.values(), default=0)
    left = budget - gradients - slots - sum(n for i, n in state.items() if i not in extents)
    try:
        tiers = plan_tiers(layouts, hosted, streamed, max(left, 0), ring_count, choose=choose)
    except DGLSUserError:
        raise DGLSUserError(
            f"host_ram_budget {human_bytes(budget)} is too small for this full fine-tune: with every streamed layer's "
            f"weights, masters and optimizer state on disk DGLS still keeps {human_bytes(gradients)} of gradients, "
            f"{human_bytes(slots)} of state slots and the staging ring in RAM: raise host_ram_budget"
        ) from None
    return Tiers(budget, tiers.ram_bytes, ring_count, tiers.spilled, len(extents)), dict(extents)


class DiskState:
    """The spilled layers' masters and optimizer state: the file, the slots and the order (see the module doc)."""

    def __init__(
        self, file: DiskFile, reader: ThreadReader, layout: TrainingLayout, spilled: Mapping[int, int]
    ) -> None:
        self.file = file
        self.reader = reader
        self.spilled = frozenset(spilled)
        self.state_keys = layout.state_keys
        self.pieces = {i: extent_pieces(layout, i)[0] for i in spilled}
        for i in sorted(spilled):
            file.allocate(i, spilled[i])
        self.slots = [page_aligned_empty(max(spilled.values())) for _ in range(SLOTS)]
        self.transport: Transport | None = None
        self.weights: DiskFile | None = None  # the disk tier's file: a spilled layer's packed copy is flushed there
        self._queue: deque[int] = deque()  # layers whose update was queued, in order (training thread appends)
        self._lock = threading.Lock()
        self._reads: dict[int, tuple[int, Copy]] = {}  # issued, not yet landed: layer -> (slot, read)
        self._writers: list[Copy | None] = [None] * SLOTS  # each slot's last write-back
        self._written: dict[int, Copy] = {}  # each layer's last write-back
        self._next = 0
        self._out = torch.full((1,), float("nan"))  # what an unbound tensor views

    @classmethod
    def open(cls, directory: str | Path | None, layout: TrainingLayout, spilled: Mapping[int, int]) -> DiskState:
        """The file for ``spilled`` (layer -> extent bytes), after the directory's checks; nothing bound yet."""
        path = check_directory(directory, sum(spilled.values()))
        remove_stale(path)
        file = DiskFile(path, sum(spilled.values()))
        try:
            reader = ThreadReader(file.fd)  # plain threads: the state is host work on either backend
        except BaseException:
            file.close()
            raise
        return cls(file, reader, layout, spilled)

    def start(self, transport: Transport, weights: DiskFile | None) -> None:
        self.transport, self.weights = transport, weights

    # ---------------------------------------------------------------- the order
    def queued(self, idx: int) -> None:
        """Training thread: an update of layer ``idx`` was queued (its job brings it in)."""
        if idx in self.spilled:
            with self._lock:
                self._queue.append(idx)

    def ahead(self) -> None:
        """Job thread, as any update job starts (before it waits for its gradients): with no read in flight, the read
        of the first queued spilled layer is issued now, so it overlaps the updates (and gradient copies) before that
        layer's own."""
        if self._reads:
            return
        with self._lock:
            following = self._queue[0] if self._queue else None
        if following is not None:
            self._reads[following] = self._issue(following)

    def bring_in(self, layer: TrainedLayer) -> int:
        """Job thread, before ``layer``'s step: its read landed, its tensors bound; the next queued layer's read
        issued. Returns the slot (for :meth:`send_home`)."""
        idx = layer.index
        with self._lock:
            if idx in self._queue:
                self._queue.remove(idx)
            following = next((i for i in self._queue if i != idx), None)
        k, read = self._reads.pop(idx, None) or self._issue(idx)
        self.transport.land(read)
        self._bind(layer, k)
        if following is not None and not self._reads:
            self._reads[following] = self._issue(following)
        return k

    def send_home(self, layer: TrainedLayer, k: int) -> Copy:
        """Job thread, after ``layer``'s step: its tensors into slot ``k`` (those the step made are copied), the
        extent written back, the tensors unbound; the weights' extent flushed where they live on disk too."""
        idx = layer.index
        slot = self.slots[k]
        offset, size = self.file.extents[idx]
        tensors = self._tensors(layer)
        with torch.no_grad():
            for piece in self.pieces[idx]:
                t = tensors.get((piece.position, piece.key))
                if t is None:
                    continue
                view = self._view(slot, piece)
                if t.data_ptr() != view.data_ptr():  # made by the step (or read from a checkpoint)
                    if t.shape != view.shape or t.dtype != torch.float32:
                        raise AssertionError(
                            f"layer {idx}: state {piece.key} is not an fp32 tensor of the param's shape"
                        )
                    view.copy_(t)
                    if piece.key is None:
                        t.set_(view)  # a master (the optimizer's param): the same object, bound to the slot
                    else:  # a new object: one a load made may be the caller's too (torch's load keeps a value of
                        # the param's dtype and device as it is)
                        master = next(tp.master for tp in layer.params if tp.position == piece.position)
                        layer.optimizer.state[master][piece.key] = tensors[(piece.position, piece.key)] = view
        gates = [w for w in (self._writers[k],) if w is not None]
        write = self.transport.write(slot[:size], offset, gates, disk=self.reader)
        self._writers[k] = write
        self._written[idx] = write
        with torch.no_grad():
            for t in tensors.values():
                t.set_(self._out.untyped_storage(), 0, t.shape, (0,) * t.dim())
        if self.weights is not None and layer.host.on_disk:  # the update wrote the packed copy through the mapping
            self.weights.flush(self.weights.offset(idx), layer.host.nbytes)
        return write

    def adopt(self, layer: TrainedLayer) -> None:
        """Start-up (before any job): the layer's masters, just filled in RAM, to the file; their RAM freed."""
        self.transport.land(self.send_home(layer, self._next))  # landed before the slot is used again

    def master(self, layer: TrainedLayer, position: int) -> torch.Tensor:
        """A copy of the fp32 master of ``layer``'s param ``position`` as the file holds it (state dicts, the model's
        removal: the engine's true weights), read after :meth:`settle` (its ``flush``)."""
        piece = next(p for p in self.pieces[layer.index] if p.position == position and p.key is None)
        out = torch.empty(piece.shape, dtype=torch.float32)
        pread_into(self.reader.write_fd, out, self.file.extents[layer.index][0] + piece.offset)
        return out

    def settle(self) -> None:
        """Every write-back submitted so far is in the file."""
        for write in list(self._written.values()):
            self.transport.land(write)

    @contextmanager
    def held(self, layer: TrainedLayer) -> Iterator[None]:
        """Training thread, no job pending (after ``finish``): the layer's tensors bound for the block (state dicts,
        checkpoint loads), written back after it."""
        if layer.index not in self.spilled:
            yield
            return
        if self._reads:
            raise AssertionError("disk state: a read is in flight outside an update")
        k, read = self._issue(layer.index)
        self.transport.land(read)
        self._bind(layer, k)
        try:
            yield
        finally:
            self.transport.land(self.send_home(layer, k))

    # ---------------------------------------------------------------- mechanics
    def _issue(self, idx: int) -> tuple[int, Copy]:
        k = self._next
        self._next = (k + 1) % SLOTS
        offset, size = self.file.extents[idx]
        gates = [g for g in (self._writers[k], self._written.get(idx)) if g is not None]
        return k, self.transport.read(self.slots[k][:size], offset, gates, disk=self.reader)

    def _tensors(self, layer: TrainedLayer) -> dict[tuple[int, str | None], torch.Tensor]:
        """The layer's spilled tensors that exist: own masters, and the state tensors its optimizer made."""
        out: dict[tuple[int, str | None], torch.Tensor] = {}
        for tp in layer.params:
            if tp.packed is not None:
                out[(tp.position, None)] = tp.master
            state = layer.optimizer.state.get(tp.master, {})
            for key in self.state_keys:
                if isinstance(state.get(key), torch.Tensor):
                    out[(tp.position, key)] = state[key]
        return out

    def _bind(self, layer: TrainedLayer, k: int) -> None:
        tensors = self._tensors(layer)
        with torch.no_grad():
            for piece in self.pieces[layer.index]:
                t = tensors.get((piece.position, piece.key))
                if t is not None:
                    t.set_(self._view(self.slots[k], piece))

    @staticmethod
    def _view(slot: torch.Tensor, piece: Piece) -> torch.Tensor:
        return slot[piece.offset : piece.offset + piece.nbytes].view(torch.float32).view(piece.shape)

    def describe(self) -> str:
        return (
            f"DGLS disk state: the fp32 masters and optimizer state of {len(self.spilled)} streamed layers "
            f"({human_bytes(self.file.used)}) live in an unnamed file in {self.file.directory}, read before each "
            f"one's update into {SLOTS} buffers of {human_bytes(self.slots[0].numel())} and written back after it "
            f"({self.reader.name})"
        )

    def close(self) -> None:
        self.reader.close()
        self.file.close()


def refuse_disk_state(config, trained: TrainingLayout, count: int) -> None:
    """One line where the masters and optimizer state of ``count`` layers would go to disk and this run cannot keep
    them there (see the module doc), before anything is packed."""
    spec = config.training.host_optimizer
    what = f"host_ram_budget puts the fp32 masters and optimizer state of {count} streamed layers on disk"
    need = sum(trained.parts().values()) + sum(state_ram_bytes(trained, i) for i in trained.layers)
    raise_to = f"raise host_ram_budget (all in RAM: about {(need + trained.packed_bytes) / 2**30:.1f} GiB) or drop it"
    if spec.own_class:  # first: its state stays in RAM wherever it steps (AdamW8bit steps on the device)
        raise DGLSUserError(
            f"{what}, and [optimizer] type {spec.table_type or spec.type!r} keeps state DGLS does not lay out on disk "
            f"(AdamW's and SGD's can): use type = 'adamw', or {raise_to}"
        )
    if spec.on_device:
        raise DGLSUserError(
            f"{what}, which host updates read and write back around each update, and --host_adam {spec.implementation} "
            f"updates on the device: pass --host_adam torch_fused (or torch), or {raise_to}"
        )
    if config.training.data_parallel:
        raise DGLSUserError(f"{what}, and data-parallel processes share the host training state: {raise_to}")
    if config.placement.planned:
        raise DGLSUserError(
            f"{what}, and a VRAM budget's planner may make layers resident after its probe: give the placement "
            f"instead (--gpu_layers or --blocks_to_swap), or {raise_to}"
        )
