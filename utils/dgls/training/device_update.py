"""Device updates: the optimizer step of a host-trained layer run on the device, its state streamed in and out.

Why
    The host AdamW of a streamed layer reads and writes about 44 bytes of host memory per param per step
    (gradient sum, norm, moments, master, the compute-dtype copy), on a few CPU cores: in the SDXL full
    fine-tune the training thread waited on it for most of the step (benchmarks/results/full_sdxl.md). The
    same step on the device moves 16 bytes per param in (master, two moments, the gradient in the compute
    dtype) and 14 out (master, moments, the new compute-dtype copy) over a full-duplex link, and the
    arithmetic is a fused kernel.

Layout (the host side is placed by :class:`~..memory.layout.TrainingLayout`)
    - per trained param, in pinned host memory: the fp32 master, the optimizer state the kernel names
      (:mod:`.optimizer_kernels`: AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``, Lion's ``exp_avg``,
      AdamW8bit's 8-bit codes and their scales; the layer's optimizer's state, so checkpoints are the host optimizer's),
      the gradient (the pinned landing in the compute dtype, or the fp32 sum over micro-batches) and the packed
      compute-dtype copy the copier streams;
    - on the device, two scratch buffers (:class:`Scratch`), each with room for ``capacity`` params:
      fp32 master, state (the kernel's slots) and gradient, and the compute-dtype gradient and copy.

Mechanics (:meth:`DeviceUpdater.update`, one layer; its params in chunks of at most ``capacity``). The
in-stream and the out-stream are the transport's optimizer-state-in and -out streams (:mod:`..memory.transport`),
each half of a chunk one :meth:`~..memory.transport.Transport.issue` behind its gates:
    1. In-stream: wait for the buffer's previous chunk to be copied out, for this layer's previous update
       (its host state is read now) and for the gradients' copy home (``after``); copy master, state and
       gradient in; scale the gradient by the clip coefficient; the kernel's step
       (:class:`~.optimizer_kernels.OptimizerKernel`: the fused torch optimizer's arithmetic on this device); write
       the compute-dtype copy. Step counts stay on the host (one per param, as in the optimizer's state).
    2. Out-stream: wait for (1); copy master, state and the compute-dtype copy home (master and state into a
       spare instead, for a speculative update: ``into``, ``ParamUpdate.home``, :mod:`.speculation`); mark the buffer
       free. The layer's last chunk's copy home is ``done``: a fetch of the layer waits for it on the device
       (the copier's gate), and the host waits for it before it reads a master (:meth:`synchronize`).
    Buffers alternate, so chunk k+1 comes in while chunk k goes out.

On the CPU (tests) the same steps run in order on the calling thread with plain copies, after the transport's
CPU backend landed their gates (the gradients' copies): the numbers are the fused torch optimizer's on the CPU,
bitwise.

Timing (split updates without clipping, :mod:`.update_split`): with a :attr:`DeviceUpdater.timeline`, each
chunk records a timing event on the in-stream once its waits are met and makes its ``free`` event a timing
one; :func:`timeline_busy` turns a step's chunks into the seconds the device spent on them.

Hazards handled
    - A buffer is rewritten only after its previous chunk went home (``free``).
    - A layer's host state is read only after its previous update wrote it back (``done``), even when
      the buffers' alternation would allow it (a one-chunk layer updated twice in a row).
    - The gradient landing is read only after its device-to-host copy (``after``); it is rewritten by the
      next backward of the layer, which runs after a forward that waited for this update.
    - Scalars (step counts, the clip coefficient) reach the device from pinned tensors through
      non-blocking copies: a pageable copy would make the host wait for the in-stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..memory.pinned import PinnedMemory
from ..memory.transport import Copy, Direction, Gate, Transport
from .optimizer_kernels import AdamWKernel, OptimizerKernel, scale_

DEFAULT_CAPACITY = 8 * 2**20  # params per chunk: two buffers of 24 bytes a param (AdamW), 384 MiB in all


@dataclass(frozen=True)
class FlatParam:
    """One param's place in its layer's flat buffers."""

    offset: int  # elements from the start of the layer's flat buffers
    numel: int
    master: torch.Tensor  # the fp32 master: a view of ``FlatLayer.masters`` (a key of the optimizer's state)
    packed: torch.Tensor  # host compute-dtype copy to rewrite
    group: dict  # the optimizer param group (lr, betas, eps, weight_decay)


@dataclass(eq=False)
class FlatLayer:
    """A layer's trained params back to back in the optimizer's order (groups contiguous): one pinned fp32
    buffer each for the masters and each state tensor, one in the compute dtype for the gradient landings.

    Why: a chunk of params then comes in with four copies and goes home with three (plus one per param
    for its compute-dtype copy, whose host layout is the streamed layer's), and one fused kernel steps it.
    Per-param copies cost the training thread time to enqueue: for the SDXL UNet (1,362 params a step),
    enqueueing its device updates one param at a time took longer than the link took to move them (the flat
    layout's gain is in benchmarks/results/full_sdxl_flat.md)."""

    masters: torch.Tensor  # fp32, pinned on CUDA
    landings: torch.Tensor  # compute dtype, pinned on CUDA
    params: list[FlatParam]
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the kernel's state keys -> fp32 flat buffers


@dataclass(frozen=True)
class ParamUpdate:
    """One param's share of a layer update."""

    master: torch.Tensor  # fp32, host (pinned on CUDA); a key of the optimizer's state
    grad: torch.Tensor  # host: the compute-dtype landing or the fp32 sum
    packed: torch.Tensor | None  # host compute-dtype copy to rewrite (None when the master is that copy)
    group: dict  # the optimizer param group (lr, betas, eps, weight_decay)
    home: tuple[torch.Tensor, ...] | None = None  # where master and state go home (a spare), if not in place


class Scratch:
    """One device buffer: fp32 master and gradient, the kernel's state slots, compute-dtype gradient and copy.

    Slot ``k`` is ``slot_bytes[k] * capacity`` bytes (4-byte aligned): a chunk's params' state tensors of that slot
    lie in it back to back, each at a 4-byte aligned offset, and the kernel promises that each takes at most
    ``slot_bytes[k]`` bytes per element of its param (:attr:`~.optimizer_kernels.OptimizerKernel.slot_bytes`), so a
    chunk's tensors always fit; a tensor that would not is a DGLS bug (an assertion), never a write past the slot.
    A slot of 4 bytes an element is also an fp32 tensor shaped as the chunk (the flat path's :meth:`views`)."""

    def __init__(self, capacity: int, device: torch.device, slot_bytes: tuple[int, ...] = (4, 4)) -> None:
        self.capacity = capacity
        self.slot_bytes = tuple(slot_bytes)
        self.fp32 = torch.empty(2 * capacity, dtype=torch.float32, device=device)  # master, then gradient
        self.starts = [0]
        for width in self.slot_bytes:
            self.starts.append(self.starts[-1] + _round4(width * capacity))
        self.slots = torch.empty(self.starts[-1], dtype=torch.uint8, device=device)
        self.raw_grad = torch.empty(4 * capacity, dtype=torch.uint8, device=device)
        self.raw_out = torch.empty(4 * capacity, dtype=torch.uint8, device=device)
        self.free: Copy | None = None  # its last chunk's copy home

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.capacity, self.slot_bytes)

    @staticmethod
    def bytes_for(capacity: int, slot_bytes: tuple[int, ...]) -> int:
        """Device bytes of one buffer with room for ``capacity`` params and state slots of ``slot_bytes`` each."""
        return (8 + 8) * capacity + sum(_round4(width * capacity) for width in slot_bytes)

    def master_grad(self, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 master and gradient views of ``n`` params at ``offset`` (a param's state: :meth:`slot`)."""
        c = self.capacity
        return self.fp32[offset : offset + n], self.fp32[c + offset : c + offset + n]

    def views(self, offset: int, n: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """fp32 master, state (one per slot, each of 4 bytes an element: a flat kernel's) and gradient views of ``n``
        params at ``offset`` (the flat path's chunk)."""
        state = [self._region(k).view(torch.float32)[offset : offset + n] for k in range(len(self.slot_bytes))]
        master, grad = self.master_grad(offset, n)
        return master, state, grad

    def slot(self, k: int, at: int, like: torch.Tensor) -> torch.Tensor:
        """A view of slot ``k`` at byte ``at`` (4-byte aligned) with ``like``'s dtype and element count."""
        region = self._region(k)
        if at % 4 or at + like.nbytes > region.numel():
            raise AssertionError(f"a state tensor of {like.nbytes} bytes at byte {at} overruns slot {k}")
        return region[at : at + like.nbytes].view(like.dtype)

    def _region(self, k: int) -> torch.Tensor:
        return self.slots[self.starts[k] : self.starts[k + 1]]

    def raw(self, buffer: torch.Tensor, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return buffer[offset * dtype.itemsize : (offset + n) * dtype.itemsize].view(dtype)


def _round4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


class DeviceUpdater:
    """Optimizer steps of host-trained layers on ``device`` (see the module doc), by ``kernel`` (AdamW unless
    :meth:`reserve` is given another)."""

    def __init__(self, transport: Transport, capacity: int | None = None) -> None:
        self.transport = transport  # its optimizer-state-in and -out streams (the in-stream and the out-stream)
        self.device = transport.device
        self.cuda = transport.cuda
        self.capacity = DEFAULT_CAPACITY if capacity is None else capacity
        self.kernel: OptimizerKernel = AdamWKernel()
        self.buffers: list[Scratch] = []
        self._turn = 0
        # per-param layers' optimizer state, page-locked at its exact size on CUDA (the copies in and out are
        # asynchronous); flat layers' state is the training layout's
        self._memory = PinnedMemory(self.cuda, "stream fewer layers (blocks_to_swap), or free RAM")
        # CUDA, when a list: each chunk appends (began, home, params), timing events on the in-stream once its
        # waits are met and on the out-stream after its last copy home (:func:`timeline_busy` reads them)
        self.timeline: list[tuple] | None = None

    def reserve(self, largest_param: int, largest_layer: int, kernel: OptimizerKernel | None = None) -> int:
        """Allocate the two buffers: room for a chunk, for the largest param at least and for the largest
        layer's params at most, with ``kernel``'s state (the kernel every later update runs); returns their
        device bytes."""
        if kernel is not None:
            self.kernel = kernel
        self.kernel.check_device(self.device)
        capacity = self.capacity_for(largest_param, largest_layer, self.capacity)
        widths = self.kernel.slot_bytes
        if not self.buffers or self.buffers[0].capacity < capacity or self.buffers[0].slot_bytes != widths:
            self.synchronize()
            self.buffers = [Scratch(capacity, self.device, widths) for _ in range(2)]
            # the memory may have been freed by kernels still queued on the compute stream
            self.transport.after_compute(Direction.STATE_IN, Direction.STATE_OUT)
        return sum(b.nbytes for b in self.buffers)

    @staticmethod
    def capacity_for(largest_param: int, largest_layer: int, capacity: int = DEFAULT_CAPACITY) -> int:
        """Params a buffer holds: a chunk of ``capacity``, at least the largest param, at most the largest layer."""
        return max(min(capacity, largest_layer), largest_param)

    @classmethod
    def reserved_bytes(cls, largest_param: int, largest_layer: int, kernel: OptimizerKernel) -> int:
        """The device bytes :meth:`reserve` allocates for these sizes and ``kernel`` (the VRAM planner's figure)."""
        capacity = cls.capacity_for(largest_param, largest_layer)
        return 2 * Scratch.bytes_for(capacity, kernel.slot_bytes)

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s layer no longer trains here (the VRAM planner made it resident): unpin its state."""
        for state in optimizer.state.values():
            for key in self.kernel.keys_of(state) if state else ():
                if isinstance(state.get(key), torch.Tensor):
                    self._memory.free(state[key])

    @torch.no_grad()  # an own class's masters require grad (as train.py's params do), and are written in place
    def update(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[ParamUpdate],
        coef: torch.Tensor | None,
        lr: float | None,
        after: Sequence[Gate],
        previous: Copy | None,
    ) -> Copy | None:
        """Step ``params`` (each with a gradient) with ``optimizer``'s hyper-parameters and state; ``lr``
        overrides the groups'. ``after``: the gradients' copies home; ``previous``: this layer's previous
        update. Returns the copy the layer's next reader waits for (its last chunk's copy home)."""
        if not params:
            return previous
        self.kernel.begin_step(optimizer)
        if not self.buffers:
            sizes = [p.master.numel() for p in params]
            self.reserve(max(sizes), sum(sizes))
        stepped = []
        for p in params:
            stepped.append((p, self._count_step(self._state(optimizer, p.master))))
        done = None
        for chunk in _chunks(stepped, self.buffers[0].capacity):
            done = self._chunk(optimizer, chunk, coef, lr, after, previous)
        return done

    def _state(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict:
        """``master``'s optimizer state, created by the kernel's ``create_state`` (as the fused torch optimizer
        would, or by an own class's ``init_state``), pinned on CUDA (the copies in and out are asynchronous)."""
        state = optimizer.state[master]
        if not state:
            self.kernel.create_state(optimizer, master, self._memory.zeros)
        return state

    def _count_step(self, state: dict) -> float:
        """One more step in ``state``'s count (kernels that count them); the count the kernel reads."""
        if not self.kernel.counts_steps:
            return 0.0
        state["step"] += 1
        return float(state["step"])

    def prepare(self, optimizer: torch.optim.Optimizer, flat: FlatLayer | None = None) -> None:
        """Create the params' state now (pinned), so a host step of the same optimizer finds it there and
        a later device step can copy it asynchronously (an update split between the two). With ``flat``,
        the state tensors are views of its flat buffers (``flat.state``, placed by the training layout), where the
        kernel's state can be flat; where it cannot (an own class's: 8-bit moments ...), nothing is made now: the
        layer's first update makes it (:meth:`_state`), after a VRAM budget's plan, for the layers it streams only
        (:meth:`~..memory.layout.TrainingLayout.deferred_state`; own classes never split their updates)."""
        if flat is not None:
            if self.kernel.flat:
                for fp in flat.params:
                    state = optimizer.state[fp.master]
                    if self.kernel.counts_steps:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in self.kernel.state_keys:
                        state[key] = _view(flat.state[key], fp)
            return
        for group in optimizer.param_groups:
            for master in group["params"]:
                self._state(optimizer, master)

    def adopt_state(
        self, optimizer: torch.optim.Optimizer, flat: FlatLayer | None, replaced: list[torch.Tensor]
    ) -> None:
        """After a checkpoint load replaced the state tensors (``replaced``: the ones it dropped): copy them into the
        flat buffers (``flat``), or pin them where they are."""
        if flat is None or not self.kernel.flat:
            self.pin_state(optimizer, replaced)
            return
        for fp in flat.params:
            state = optimizer.state[fp.master]
            for key, buffer in flat.state.items():
                view = _view(buffer, fp)
                if state.get(key) is not None:
                    view.copy_(state[key])
                else:
                    view.zero_()
                state[key] = view
            if self.kernel.counts_steps and "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)

    def update_flat(
        self,
        optimizer: torch.optim.Optimizer,
        flat: FlatLayer,
        coef: torch.Tensor | None,
        lr: float | None,
        after: Sequence[Gate],
        previous: Copy | None,
        into: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None,
    ) -> Copy | None:
        """:meth:`update` of every param of a flat layer, each with its gradient in the landings: chunks of
        consecutive params of one group and one step count, each moved with a few copies of flat ranges and
        stepped by one fused kernel over them (elementwise, so the same numbers as per param). ``into``: flat
        masters and state buffers of the same layout that master and state go home to (a spare)."""
        if not self.buffers:
            self.reserve(max(fp.numel for fp in flat.params), flat.masters.numel())
        capacity = self.buffers[0].capacity
        chunks: list[list[FlatParam]] = []
        keys: list[tuple[int, float]] = []
        size = 0
        for fp in flat.params:
            key = (id(fp.group), self._count_step(self._state(optimizer, fp.master)))
            if not chunks or size + fp.numel > capacity or keys[-1] != key:
                chunks.append([])
                keys.append(key)
                size = 0
            chunks[-1].append(fp)
            size += fp.numel
        done = previous
        home = into if into is not None else (flat.masters, flat.state)
        for chunk, (_, step) in zip(chunks, keys):
            done = self._flat_chunk(flat, chunk, chunk[0].group, step, coef, lr, after, previous, home)
        return done

    def _flat_chunk(self, flat, chunk, group, step, coef, lr, after, previous, home_buffers) -> Copy:
        start, end = chunk[0].offset, chunk[-1].offset + chunk[-1].numel
        n = end - start
        buf = self._next_buffer()
        keys = self.kernel.state_keys
        fp32 = 4 * (1 + len(keys))  # master and state bytes a param
        with self._coming_in(buf, after, previous) as came_in:
            m, state, g = buf.views(0, n)
            m.copy_(flat.masters[start:end], non_blocking=True)
            for key, s in zip(keys, state):
                s.copy_(flat.state[key][start:end], non_blocking=True)
            raw = buf.raw(buf.raw_grad, 0, n, flat.landings.dtype)
            raw.copy_(flat.landings[start:end], non_blocking=True)
            g.copy_(raw)
            if coef is not None:
                g.mul_(_to_device(coef, self.device))
            steps = []
            if self.kernel.counts_steps:
                steps = [_to_device(torch.tensor(step, dtype=torch.float32), self.device)]
            self.kernel.step([m], [g], [[s] for s in state], steps, group, lr)
            out = buf.raw(buf.raw_out, 0, n, flat.landings.dtype)
            out.copy_(m)
            came_in.nbytes = n * (fp32 + flat.landings.itemsize)  # master, state, gradient
        masters_home, state_home = home_buffers
        with self._going_home(came_in) as home:
            home.nbytes = n * (fp32 + flat.landings.itemsize)  # master, state, compute-dtype copy
            masters_home[start:end].copy_(m, non_blocking=True)
            for key, s in zip(keys, state):
                state_home[key][start:end].copy_(s, non_blocking=True)
            for fp in chunk:
                fp.packed.view(-1).copy_(out[fp.offset - start : fp.offset - start + fp.numel], non_blocking=True)
        return self._home(buf, came_in, home, n)

    def mark(self, end: bool):
        """A timing event at the current end of the in-stream (``end=False``: before the updates queued
        next) or of the out-stream (``end=True``: after the last one went home); None on the CPU."""
        return self.transport.mark(Direction.STATE_OUT if end else Direction.STATE_IN, timed=True).event

    def _chunk(self, optimizer, chunk, coef, lr, after, previous) -> Copy:
        items = [p for p, _ in chunk]
        buf = self._next_buffer()
        steps = [step for _, step in chunk]
        group = items[0].group
        keys = [self.kernel.keys_of(optimizer.state[p.master]) for p in items]
        with self._coming_in(buf, after, previous) as came_in:
            masters, states, grads = [], [], []
            offset, at = 0, [0] * len(buf.slot_bytes)  # elements into master and gradient; bytes into each slot
            for p, names in zip(items, keys):
                n = p.master.numel()
                m, g = buf.master_grad(offset, n)
                state = optimizer.state[p.master]
                m.copy_(p.master.view(-1), non_blocking=True)
                views = []
                for k, key in enumerate(names):
                    host = state[key].view(-1)
                    s = buf.slot(k, at[k], host)
                    s.copy_(host, non_blocking=True)
                    at[k] += _round4(host.nbytes)
                    views.append(s)
                if p.grad.dtype == torch.float32:
                    g.copy_(p.grad.view(-1), non_blocking=True)
                else:
                    raw = buf.raw(buf.raw_grad, offset, n, p.grad.dtype)
                    raw.copy_(p.grad.view(-1), non_blocking=True)
                    g.copy_(raw)
                masters.append(m)
                states.append(views)
                grads.append(g)
                offset += n
            state_bytes = [sum(s.nbytes for s in views) for views in states]
            # master, state, gradient
            came_in.nbytes = sum(4 * p.master.numel() + b + p.grad.nbytes for p, b in zip(items, state_bytes))
            if coef is not None:
                scale_(grads, _to_device(coef, self.device))
            step_values: list = []
            if self.kernel.counts_steps and self.kernel.steps_on_device:
                step_values = list(_to_device(torch.tensor(steps, dtype=torch.float32), self.device).unbind())
            elif self.kernel.counts_steps:
                step_values = [int(step) for step in steps]
            hosts = [p.master for p in items]
            self.kernel.step_params(optimizer, hosts, masters, grads, states, step_values, group, lr)
            outs = []
            offset = 0
            for p, m in zip(items, masters):
                n = p.master.numel()
                if p.packed is not None:
                    out = buf.raw(buf.raw_out, offset, n, p.packed.dtype)
                    out.copy_(m)
                    outs.append(out)
                else:
                    outs.append(None)
                offset += n
        with self._going_home(came_in) as home:
            for p, m, views, names, out in zip(items, masters, states, keys, outs):
                state = optimizer.state[p.master]
                targets = p.home if p.home is not None else (p.master, *(state[key] for key in names))
                targets[0].view(-1).copy_(m, non_blocking=True)
                for target, view in zip(targets[1:], views):
                    target.view(-1).copy_(view, non_blocking=True)
                if out is not None:
                    p.packed.view(-1).copy_(out, non_blocking=True)
            home.nbytes = sum(
                4 * m.numel() + b + (p.packed.nbytes if p.packed is not None else 0)
                for p, m, b in zip(items, masters, state_bytes)
            )
        return self._home(buf, came_in, home, sum(p.master.numel() for p in items))

    def _next_buffer(self) -> Scratch:
        """The buffer the next chunk uses (they alternate)."""
        buf = self.buffers[self._turn]
        self._turn ^= 1
        return buf

    def _coming_in(self, buf: Scratch, after: Sequence[Gate], previous: Copy | None):
        """On the in-stream, once ``buf``'s previous chunk went home, the gradients' copies landed (``after``)
        and the layer's previous update is home (``previous``). With a :attr:`timeline`, the chunk's timing
        starts once they are met."""
        gates = (buf.free, previous, *after)
        return self.transport.issue(Direction.STATE_IN, gates, timed=self.timeline is not None)

    def _going_home(self, came_in: Copy):
        """On the out-stream, once the chunk's step (``came_in``) ran."""
        return self.transport.issue(Direction.STATE_OUT, (came_in,), timed=self.timeline is not None)

    def _home(self, buf: Scratch, came_in: Copy, home: Copy, params: int) -> Copy:
        """``buf`` is free once the chunk's copies home ran (and the chunk is timed); the chunk's copy home."""
        buf.free = home
        if self.timeline is not None:
            self.timeline.append((came_in.start, home.ready, params))
        return home

    def synchronize(self) -> None:
        """Block until every update enqueued so far is home (a host read of masters or state follows)."""
        self.transport.synchronize(Direction.STATE_OUT, Direction.STATE_IN)

    def pin_state(self, optimizer: torch.optim.Optimizer, replaced: list[torch.Tensor]) -> None:
        """After a checkpoint load replaced the state tensors (``replaced``: the ones it dropped): the new ones
        into pinned memory, where the async copies read them, and the old ones unpinned."""
        if not self.cuda:
            return
        for old in replaced:
            self._memory.free(old)
        for state in optimizer.state.values():
            for key in self.kernel.keys_of(state) if state else ():
                if state.get(key) is not None:
                    state[key] = self._memory.copy_of(state[key])

    def pinned_bytes(self) -> int:
        """Host bytes of the optimizer state this module pinned (per-param layers; flat ones are the layout's)."""
        return self._memory.nbytes


def _chunks(stepped: Sequence[tuple[ParamUpdate, float]], capacity: int) -> list[list[tuple[ParamUpdate, float]]]:
    """Runs of consecutive params (with their step counts) of one param group with at most ``capacity``
    elements (a larger param alone; :meth:`DeviceUpdater.reserve` makes room for the largest)."""
    chunks: list[list[tuple[ParamUpdate, float]]] = []
    size = 0
    for p, step in stepped:
        n = p.master.numel()
        if not chunks or size + n > capacity or chunks[-1][0][0].group is not p.group:
            chunks.append([])
            size = 0
        chunks[-1].append((p, step))
        size += n
    return chunks


def _view(buffer: torch.Tensor, fp: FlatParam) -> torch.Tensor:
    return buffer[fp.offset : fp.offset + fp.numel].view(fp.master.shape)


def _to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without making the host wait (pinned, non-blocking)."""
    if device.type != "cuda":
        return value
    return value.pin_memory().to(device, non_blocking=True)


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The time covered by ``(start, end)`` intervals (overlaps counted once): how long the device was busy
    with updates, leaving out the gaps where it waited for gradients."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def timeline_busy(timeline: Sequence[tuple[torch.cuda.Event, torch.cuda.Event, int]]) -> tuple[int, float] | None:
    """Params and busy seconds of a :attr:`DeviceUpdater.timeline` whose chunks all went home; None while
    one is still running (or for an empty one)."""
    if not timeline or not all(home.query() for _, home, _ in timeline):
        return None
    origin = timeline[0][0]
    spans = [(origin.elapsed_time(began) / 1000, origin.elapsed_time(home) / 1000) for began, home, _ in timeline]
    return sum(n for _, _, n in timeline), busy_seconds(spans)
