"""Copier: the weight slot protocol, a rule on top of the transport (:mod:`.transport`).

The transport moves the bytes of every direction; this module is its weights-in client, and adds the
rule that makes slot reuse safe. Vocabulary, the same on every device:

- ``submit([(slot, host layer, demand), ...]) -> [Token]``: copy each master into its slot
  (fp8-stored bytes through a landing buffer and an upcast). Nothing waits on the host.
- ``acquire(token)``: from now on the compute stream may read the slot (it waits for the copy;
  the host does not, unless ``ordered_by_events`` is off: ``--no-event_sync`` or
  ``--device_sync_mode layer``, when the host waits for each copy).
- ``release(slot)``: every kernel enqueued so far that reads the slot is behind a marker; the
  next write into the slot waits for that marker.

Slot protocol, enforced here on every device (a violation raises :class:`OrderingError`)::

    write -> acquire -> (compute reads) -> release -> write -> acquire -> ...

A slot that was acquired since its last write must be released before it is written again, and
every write waits for the slot's latest release and its previous write. Only a slot's latest
write can be acquired. So the engine cannot forget the rule that makes slot reuse safe: "a slot
is overwritten only after the kernels that read it".

Mechanics:

- :class:`CudaCopier`: the transport's weights-in streams used round-robin (one fp8 landing buffer
  each), a token's CUDA event recorded by the transport; the compute stream waits with ``wait_event``.
  With ``use_thread`` the transport's worker thread issues the copies (and the host-side staging of
  pageable masters) in submission order.
- :class:`DeferredCopier` (CPU): the transport's CPU backend fills the slot with NaN bytes at once (the
  copy is "in flight": its contents are undefined), and the master bytes are written when the slot is
  acquired, so a read without ``acquire`` sees NaN, and copies are performed in acquire order, not
  submission order. With ``use_thread`` the worker performs each write as soon as it is submitted
  instead (the earliest the protocol allows). CI runs on CPU, so this is what makes a missing wait or
  an early slot reuse fail a test there.
- Shared fetches (data parallel on one machine, :mod:`.fetch_share`): a write copies this process's share of the
  layer's bytes and gathers the other processes' shares into the slot (and the fp8 landing buffer) before the upcast,
  inside the same issued work, so the token, its gates and the slot protocol are those of a whole copy. Slots and
  landing buffers hold the gather's padding (:attr:`Copier.slot_padding`).

Hazards handled:

- FIFO: with a worker thread a token exists before its CUDA event is recorded, and CUDA treats a
  wait on an event never recorded as a no-op. The worker issues writes strictly in submission
  order, so every gate of a write was recorded before it, and ``_issue`` asserts that.
- Landing buffers: one per weights-in stream, sized by :meth:`CudaCopier.resize` from the streamed
  layouts; stream order keeps the next copy from overwriting a landing buffer still being upcast.
- Pageable masters are staged through pinned bounce buffers; the host waits for a bounce
  buffer's previous copy before refilling it (the only host wait on the pageable path).
- Disk layers (:mod:`.disk_tier`): at submit, the layer's read from the disk tier's file into a staging ring
  buffer is taken: the read the engine issued ahead (:meth:`.disk_tier.DiskTier.stage`), or one submitted now
  into the next buffer, gated on the previous write that read that buffer; the write is gated on the read and
  copies from the ring buffer (``Token.source``). A read starts once its ring buffer is free (a read ahead:
  as soon as a buffer is; one submitted here: ``prefetch`` layers ahead of its use); the write's issuing waits
  for it on the host (on the copy worker with ``--threading``, which a disk tier on CUDA turns on).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import partial

import torch

from .device_pool import Slot
from .fetch_share import FetchShare, Region
from .host_store import HostLayer, HostStore
from .precision import dequantize
from .transport import POISON, Copy, CudaTransport, Direction, Marker, Transport

__all__ = ["POISON", "Copier", "CudaCopier", "DeferredCopier", "Marker", "OrderingError", "Token", "Wait"]


class OrderingError(RuntimeError):
    """The engine broke the slot protocol: a bug in DGLS, never a user error."""


@dataclass(eq=False, kw_only=True)
class Token(Copy):
    """One write of a layer's master into a slot (a weights-in :class:`~.transport.Copy`)."""

    direction: Direction = Direction.WEIGHTS_IN
    layer: int
    slot: Slot
    host: HostLayer
    demand: bool  # issued because compute needed the layer now (a prefetch miss)
    gates: list = field(default_factory=list)  # Markers and Copies this write waits for
    # recorded (CUDA) / submitted (CPU); without a worker thread, :data:`PENDING` until issued, then :data:`ISSUED`
    issued: threading.Event = field(default_factory=threading.Event)
    waited: bool = False  # the compute stream already waits for it
    source: torch.Tensor | None = None  # a disk layer's staging buffer, read instead of the host buffer


# Without a worker thread a write is issued inside ``submit``, before its token is handed out: nothing waits for
# its ``issued`` on another thread, so the token takes these shared events (a token's own event, a condition and
# its lock, and a notify when set, are the weight path's largest cost per copy on the host) instead of its own.
# Except a disk layer's token: the next read into its ring buffer (maybe submitted in the same ``submit``) waits for
# it on the disk reader's thread (CUDA), maybe before it is issued, so it keeps an event of its own (the builder
# threads the CUDA copier whenever there is a disk tier, but the copier does not rely on that).
PENDING = threading.Event()  # never set: not issued (yet, or the issuing failed)
ISSUED = threading.Event()
ISSUED.set()


def _mark_issued(token: Token) -> None:
    if token.issued is PENDING:
        token.issued = ISSUED
    else:
        token.issued.set()


@dataclass(frozen=True)
class Wait:
    """Events around the compute stream's wait for a copy (timing on): from before the host waited for the copy to
    be issued (the copy worker issues a disk layer's copy once its read landed), so a stall the read causes counts."""

    token: Token
    before: torch.cuda.Event
    after: torch.cuda.Event


@dataclass(eq=False)
class _SlotState:
    write: Token | None = None
    reading: bool = False  # acquired since the last release
    release: Marker | None = None


class Copier:
    """The slot protocol; subclasses say how a write is issued on the transport. With ``share`` (data parallel on
    one machine, :mod:`.fetch_share`) each write copies this process's share of the layer and gathers the rest."""

    def __init__(
        self, transport: Transport, store: HostStore, use_thread: bool, share: FetchShare | None = None
    ) -> None:
        self.transport = transport
        self.store = store
        self.share = share
        self._slots: dict[Slot, _SlotState] = {}
        self.threaded = use_thread
        if use_thread:
            transport.copy_worker.start()

    # ---------------------------------------------------------------- protocol (main thread)
    def submit(self, requests: list[tuple[Slot, HostLayer, bool]], after: list | None = None) -> list[Token]:
        """Write each host layer into its slot (after the slot's latest release and write, and after the
        request's gates in ``after``, a list per request: a device update that rewrites the host copy)."""
        self.check()
        tokens = []
        for k, (slot, host, demand) in enumerate(requests):
            state = self._slots.get(slot)
            if state is None:
                state = self._slots[slot] = _SlotState()
            if state.reading:
                owner = state.write.layer if state.write is not None else None
                raise OrderingError(
                    f"slot {slot.index} would be overwritten with layer {host.index} while layer {owner} may still "
                    "read it: release the slot before writing it"
                )
            gates = [g for g in (state.release, state.write) if g is not None]
            if after is not None:
                gates.extend(after[k])
            token = Token(
                nbytes=host.nbytes,
                layer=host.index,
                slot=slot,
                host=host,
                demand=demand,
                gates=gates,
                # a disk layer's: its own (see PENDING)
                issued=threading.Event() if self.threaded or host.on_disk else PENDING,
            )
            self._prepare(token)
            if host.on_disk:  # read it into a staging buffer first (after that buffer's previous reader)
                ring, token.source, read = self.store.disk.read(self.transport, host.index, host.nbytes)
                token.gates.append(read)
                self.store.disk.consumed(ring, token)
            state.write = token
            tokens.append(token)
        if self.threaded:
            worker = self.transport.copy_worker
            worker.put(partial(self._issue_later, tokens), urgent=True, failed=partial(_wake, tokens))
        else:
            self._issue(tokens)
        return tokens

    def acquire(self, token: Token) -> Wait | None:
        """The compute stream may read ``token``'s slot after this; returns the wait's timing events."""
        state = self._slots.get(token.slot)
        if state is None or state.write is not token:
            raise OrderingError(f"layer {token.layer}'s copy into slot {token.slot.index} was overwritten before use")
        state.reading = True
        if token.waited:
            return None
        token.waited = True
        return self._wait(token)

    def release(self, slot: Slot) -> None:
        """Mark the end of the reads of ``slot`` enqueued so far (a no-op if it is not being read)."""
        state = self._slots.get(slot)
        if state is None or not state.reading:
            return
        state.release = self.transport.mark()
        state.reading = False

    def forget_slots(self) -> None:
        """The pool was rebuilt: no old slot is read or written anymore (call after :meth:`drain`)."""
        self._slots.clear()

    # ---------------------------------------------------------------- lifecycle
    def check(self) -> None:
        """Surface a worker failure in the calling thread (per use: one attribute read while none failed)."""
        worker = self.transport.copy_worker
        if worker.error is not None:
            worker.check()

    def drain(self) -> None:
        """Wait until every submitted write has been issued and has finished."""
        if self.threaded:
            worker = self.transport.copy_worker
            worker.wait(worker.put(_nothing, urgent=True))
        self.transport.synchronize(Direction.WEIGHTS_IN)
        self.check()

    def close(self) -> None:
        """Wait for outstanding copies and drop what this copier holds of the pool (tokens, slots must not
        outlive ``remove()``); the transport stops its worker threads itself."""
        if self.threaded and self.transport.copy_worker.error is None:
            self.drain()
        self.transport.synchronize(Direction.WEIGHTS_IN)
        self._slots.clear()
        self.resize(0)

    def _wait_issued(self, token: Token) -> None:
        if not token.issued.is_set():
            self.transport.copy_worker.wait(token.issued)
        self.check()

    def _issue_later(self, tokens: list[Token]) -> None:
        """On the worker thread (looked up there, so a test can replace ``_issue``)."""
        self._issue(tokens)

    # ---------------------------------------------------------------- mechanism (subclasses)
    def _prepare(self, token: Token) -> None:
        """Main thread, at submit: whatever must exist before the token is handed out."""

    def _issue(self, tokens: list[Token]) -> None:
        raise NotImplementedError

    def _wait(self, token: Token) -> Wait | None:
        """Make the compute side wait for ``token``'s write (issued by then, on the worker too)."""
        raise NotImplementedError

    def resize(self, landing_bytes: int) -> None:
        """The streamed set changed: make room for the largest fp8 landing."""

    @property
    def slot_padding(self) -> int:
        """Bytes each slot needs past the largest layer (a shared fetch's gather rounds up: :mod:`.fetch_share`)."""
        return self.share.padding if self.share is not None else 0

    def _pairs(
        self, host: HostLayer, slot: torch.Tensor, landing: torch.Tensor | None, source: torch.Tensor | None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, Region]]]:
        """The (host, device) pairs this process copies for a write, and the regions gathered after them."""
        if self.share is None:
            return host.copies(slot, landing, source), []
        return self.share.copies(host, slot, landing, source)


def _wake(tokens: list[Token]) -> None:
    """The worker failed to issue ``tokens``: their waiters wake (and find the error). Only tokens of a threaded
    copier get here, each with its own event; the shared :data:`PENDING` is never set (it would mark every later
    worker-less token issued)."""
    for token in tokens:
        if token.issued is not PENDING:
            token.issued.set()


def _nothing() -> None:
    pass


class DeferredCopier(Copier):
    """CPU copier: a write poisons its slot at once and lands when the slot is acquired (see module doc)."""

    def __init__(
        self,
        store: HostStore,
        use_thread: bool,
        transport: Transport | None = None,
        share: FetchShare | None = None,
    ) -> None:
        transport = transport if transport is not None else Transport(torch.device("cpu"))
        super().__init__(transport, store, use_thread, share)

    def _issue(self, tokens: list[Token]) -> None:
        for token in tokens:
            host, buffer = token.host, token.slot.buffer
            pairs, regions = self._pairs(host, buffer, None, token.source)
            self.transport.submit(
                Direction.WEIGHTS_IN,
                [(dst, src) for src, dst in pairs],
                token.gates,
                into=token,
                poison=[buffer],
                then=partial(_gather_and_upcast, self.share, regions, host, buffer, None, token.source),
                late=not self.threaded,  # the worker performs each write now, the earliest the protocol allows
            )
            _mark_issued(token)

    def _wait(self, token: Token) -> None:
        self._wait_issued(token)
        self.transport.acquire(token)
        return None


class CudaCopier(Copier):
    """The transport's weights-in streams and CUDA events (see module doc)."""

    def __init__(
        self,
        transport: CudaTransport,
        store: HostStore,
        *,
        ordered_by_events: bool,
        use_thread: bool,
        landing_bytes: int,
        share: FetchShare | None = None,
    ) -> None:
        self.device = transport.device
        self.share = share  # before resize: the landing buffers hold its padding
        self.ordered_by_events = ordered_by_events  # False: the host waits for each copy instead
        self.transport = transport
        self.lanes = transport.lanes(Direction.WEIGHTS_IN)
        self._timing = Direction.WEIGHTS_IN in transport.timed  # weight copies record timing events (fixed)
        self.landing: list[torch.Tensor] = []
        self.landing_bytes = -1
        self.resize(landing_bytes)
        self._next_lane = 0
        self._staging_done: list[Marker | None] = []
        super().__init__(transport, store, use_thread, share)

    def resize(self, landing_bytes: int) -> None:
        if landing_bytes == self.landing_bytes:
            return
        self.transport.synchronize(Direction.WEIGHTS_IN)
        nbytes = landing_bytes + self.slot_padding if landing_bytes else 0
        self.landing = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.lanes)]
        self.landing_bytes = landing_bytes

    def _prepare(self, token: Token) -> None:
        # the event a later write may be gated on before this one is issued (the worker); a timed copy's start
        # event is made when it is issued, before anything reads it (the listeners, once it was acquired)
        token.ready = self.transport.event(self._timing)

    def _wait(self, token: Token) -> Wait | None:
        # timed, a copy not issued yet: the compute stream's stall starts here, before the host waits for the issue
        # (the worker's wait for a disk read), not at the stream's wait for the copy (:class:`Wait`)
        early = None
        if self._timing and self.ordered_by_events and token.issued is not PENDING and not token.issued.is_set():
            early = torch.cuda.Event(enable_timing=True)
            early.record(torch.cuda.current_stream(self.device))
        self._wait_issued(token)
        if not self.ordered_by_events:
            self.transport.land(token)
            return None
        if not self._timing:
            self.transport.acquire(token)
            return None
        before, after = self.transport.acquire(token, timed=True)
        return Wait(token, early if early is not None else before, after)

    def _issue(self, tokens: list[Token]) -> None:
        k = self._next_lane
        self._next_lane = (k + 1) % self.lanes
        for token in tokens:
            for gate in token.gates:
                if isinstance(gate, Token) and not gate.issued.is_set():
                    raise OrderingError(f"layer {token.layer}'s copy would wait on an unrecorded copy (FIFO broken)")
            self.transport.issue_work(
                Direction.WEIGHTS_IN,
                token.gates,
                self._copy,
                token,
                self.landing[k],
                into=token,
                lane=k,
                host_waits=not self.ordered_by_events,
            )
            _mark_issued(token)

    def _copy(self, token: Token, landing: torch.Tensor) -> None:
        """Enqueue the copy (and the fp8 upcast) on the current stream (a weights-in lane)."""
        host = token.host
        if host.layout.landing_bytes > landing.numel():
            raise OrderingError(f"layer {token.layer} needs a {host.layout.landing_bytes}-byte landing buffer")
        pairs, regions = self._pairs(host, token.slot.buffer, landing, token.source)
        if host.pinned or token.source is not None:  # a disk layer's staging buffer is pinned
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        else:
            self._copy_staged(pairs)
        _gather_and_upcast(self.share, regions, host, token.slot.buffer, landing)

    def _copy_staged(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Pageable master: memcpy into a pinned bounce buffer, then an async copy from it."""
        staging = self.store.staging
        if len(self._staging_done) != len(staging):
            self._staging_done = [None] * len(staging)
        k = 0
        for host, dst in pairs:
            done = 0
            while done < host.numel():
                buf = staging[k]
                n = min(buf.numel(), host.numel() - done)
                self._staging_done[k] = self.transport.staged_copy(
                    dst[done : done + n], host[done : done + n], buf[:n], self._staging_done[k]
                )
                done += n
                k = (k + 1) % len(staging)


def _gather_and_upcast(
    share: FetchShare | None,
    regions: list[tuple[torch.Tensor, Region]],
    host: HostLayer,
    slot: torch.Tensor,
    landing: torch.Tensor | None,
    source: torch.Tensor | None = None,
) -> None:
    """After this process's share of a write was copied: the other shares from the other processes
    (:mod:`.fetch_share`), then the fp8 upcast (:func:`_upcast`), which rewrites what the gather's padding covered."""
    if regions:
        share.gather(regions)
    _upcast(host, slot, landing, source)


def _upcast(
    host: HostLayer, slot: torch.Tensor, landing: torch.Tensor | None, source: torch.Tensor | None = None
) -> None:
    """Write the fp8-stored params into the slot in their compute dtype (times their scales), from
    ``landing`` on CUDA or straight from the host master on the CPU (``source``: a disk layer's staging buffer)."""
    layout = host.layout
    for k, p in layout.scaled_params:
        if landing is not None:
            base = p.host_offset - layout.direct_bytes
            source_view = landing[base : base + p.host_nbytes].view(p.stored).view(p.shape)
        else:
            source_view = host.master_view(k, source)
        out = slot[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
        dequantize(source_view, host.scales[k], p.dtype, out=out)
