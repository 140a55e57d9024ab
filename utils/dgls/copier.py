"""Copier: the only module that moves layer bytes onto the device and orders those moves.

Vocabulary, the same on every device:

- ``submit([(slot, host layer, demand), ...]) -> [Token]``: copy each master into its slot
  (fp8-stored bytes through a landing buffer and an upcast). Nothing waits on the host.
- ``acquire(token)``: from now on the compute stream may read the slot (it waits for the copy;
  the host does not, unless ``event_sync`` is off).
- ``release(slot)``: every kernel enqueued so far that reads the slot is behind a marker; the
  next write into the slot waits for that marker.

Slot protocol, enforced here on every device (a violation raises :class:`OrderingError`)::

    write -> acquire -> (compute reads) -> release -> write -> acquire -> ...

A slot that was acquired since its last write must be released before it is written again, and
every write waits for the slot's latest release and its previous write. Only a slot's latest
write can be acquired. So the engine cannot forget the rule that makes slot reuse safe: "a slot
is overwritten only after the kernels that read it".

Mechanics:

- :class:`CudaCopier`: copy streams used round-robin, one CUDA event per write (``ready``) and
  per release; the compute stream waits with ``wait_event``. With ``use_thread`` a worker thread
  issues the copies (and the host-side staging of pageable masters) in submission order.
- :class:`DeferredCopier` (CPU): a write is *not* performed when submitted. Its slot is filled
  with NaN bytes at once (the copy is "in flight": its contents are undefined), and the master
  bytes are written when the slot is acquired, so a read without ``acquire`` sees NaN, and
  copies are performed in acquire order, not submission order. With ``use_thread`` a worker
  performs each write as soon as it is submitted instead (the earliest the protocol allows).
  CI runs on CPU, so this is what makes a missing wait or an early slot reuse fail a test there.

Hazards handled:

- FIFO: with a worker thread a token exists before its CUDA event is recorded, and CUDA treats a
  wait on an event never recorded as a no-op. The worker issues writes strictly in submission
  order, so every gate of a write was recorded before it, and ``_issue`` asserts that.
- Landing buffers: one per copy stream, sized by :meth:`CudaCopier.resize` from the streamed
  layouts; stream order keeps the next copy from overwriting a landing buffer still being upcast.
- Pageable masters are staged through pinned bounce buffers; the host waits for a bounce
  buffer's previous copy before refilling it (the only host wait on the pageable path).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .device_pool import Slot
from .errors import SwapWorkerError
from .host_store import HostLayer, HostStore
from .precision import dequantize

POISON = 0xFF  # a NaN in every float dtype DGLS streams (fp32, bf16, fp16, fp8 e4m3fn/e5m2)


class OrderingError(RuntimeError):
    """The engine broke the slot protocol: a bug in DGLS, never a user error."""


@dataclass(eq=False)
class Marker:
    """A point on a stream that a write waits for: on the compute stream, every kernel enqueued before it
    reads no slot anymore; or a device update that rewrote the layer's host copy."""

    event: torch.cuda.Event | None = None  # None on CPU, where compute is synchronous


@dataclass(eq=False)
class Token:
    """One write of a layer's master into a slot."""

    layer: int
    slot: Slot
    host: HostLayer
    demand: bool  # issued because compute needed the layer now (a prefetch miss)
    gates: list = field(default_factory=list)  # Markers and Tokens this write waits for
    ready: torch.cuda.Event | None = None
    start: torch.cuda.Event | None = None
    stream: int = 0  # copy stream index
    issued: threading.Event = field(default_factory=threading.Event)  # recorded (CUDA) / performed (CPU)
    waited: bool = False  # the compute stream already waits for it
    span: tuple[float, float] | None = None  # CPU: perf_counter() around the copy

    @property
    def nbytes(self) -> int:
        return self.host.nbytes


@dataclass(frozen=True)
class Wait:
    """Events around the compute stream's wait for a copy (timing on)."""

    token: Token
    before: torch.cuda.Event
    after: torch.cuda.Event


@dataclass(eq=False)
class _SlotState:
    write: Token | None = None
    reading: bool = False  # acquired since the last release
    release: Marker | None = None


class Copier:
    """The slot protocol and the worker thread; subclasses move the bytes."""

    def __init__(self, store: HostStore, use_thread: bool) -> None:
        self.store = store
        self._slots: dict[Slot, _SlotState] = {}
        self.error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if use_thread:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, name="dgls-copier", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- protocol (main thread)
    def submit(
        self, requests: list[tuple[Slot, HostLayer, bool]], after: list[torch.cuda.Event | None] | None = None
    ) -> list[Token]:
        """Write each host layer into its slot (after the slot's latest release and write, and after the
        request's event in ``after``: a device update that rewrites the host copy, CUDA only)."""
        self.check()
        tokens = []
        for k, (slot, host, demand) in enumerate(requests):
            state = self._slots.setdefault(slot, _SlotState())
            if state.reading:
                owner = state.write.layer if state.write is not None else None
                raise OrderingError(
                    f"slot {slot.index} would be overwritten with layer {host.index} while layer {owner} may still "
                    "read it: release the slot before writing it"
                )
            gates = [g for g in (state.release, state.write) if g is not None]
            if after is not None and after[k] is not None:
                gates.append(Marker(after[k]))
            token = Token(host.index, slot, host, demand, gates)
            self._prepare(token)
            state.write = token
            tokens.append(token)
        if self._queue is not None:
            self._queue.put(tokens)
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
        state.release = self._marker()
        state.reading = False

    def forget_slots(self) -> None:
        """The pool was rebuilt: no old slot is read or written anymore (call after :meth:`drain`)."""
        self._slots.clear()

    # ---------------------------------------------------------------- lifecycle
    def check(self) -> None:
        """Surface a worker failure in the calling thread."""
        if self.error is not None:
            raise SwapWorkerError(f"DGLS copier thread failed: {self.error!r}") from self.error

    def drain(self) -> None:
        """Wait until every submitted write has been issued and has finished."""
        if self._queue is not None:
            done = threading.Event()
            self._queue.put(done)
            while not done.wait(timeout=1.0):
                self.check()
                if not self._thread.is_alive():
                    break
        self._finish_all()
        self.check()

    def close(self) -> None:
        """Stop the worker and wait for outstanding copies."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None
            self._queue = None
        self._finish_all()
        self._slots.clear()  # what it holds of the pool (tokens, slots) must not outlive remove()
        self.resize(0)

    def _wait_issued(self, token: Token) -> None:
        while not token.issued.wait(timeout=1.0):
            self.check()
            if self._thread is not None and not self._thread.is_alive():
                raise SwapWorkerError("the DGLS copier thread stopped without issuing a pending copy")
        self.check()

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._issue(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.error = exc
                for token in item:
                    token.issued.set()
                return

    # ---------------------------------------------------------------- mechanism (subclasses)
    def _prepare(self, token: Token) -> None:
        """Main thread, at submit: whatever must exist before the token is handed out."""

    def _issue(self, tokens: list[Token]) -> None:
        raise NotImplementedError

    def _wait(self, token: Token) -> Wait | None:
        """Make the compute side wait for ``token``'s write (issued by then, on the worker too)."""
        raise NotImplementedError

    def _marker(self) -> Marker:
        raise NotImplementedError

    def _finish_all(self) -> None:
        """Block until every issued write has landed."""

    def resize(self, landing_bytes: int) -> None:
        """The streamed set changed: make room for the largest fp8 landing."""


class DeferredCopier(Copier):
    """CPU copier: a write poisons its slot at once and lands when the slot is acquired (see module doc)."""

    def _prepare(self, token: Token) -> None:
        if self._queue is None:
            token.slot.buffer.fill_(POISON)

    def _issue(self, tokens: list[Token]) -> None:
        if self._queue is not None:  # worker: perform now, the earliest the protocol allows
            for token in tokens:
                token.slot.buffer.fill_(POISON)
                self._perform(token)

    def _wait(self, token: Token) -> None:
        if self._queue is not None:
            self._wait_issued(token)
        elif not token.issued.is_set():
            self._perform(token)
        return None

    def _perform(self, token: Token) -> None:
        began = time.perf_counter()
        host, buffer = token.host, token.slot.buffer
        for src, dst in host.copies(buffer, None):
            dst.copy_(src)
        _upcast(host, buffer, None)
        token.span = (began, time.perf_counter())
        token.issued.set()

    def _marker(self) -> Marker:
        return Marker()


class CudaCopier(Copier):
    """Copy streams and CUDA events (see module doc)."""

    def __init__(
        self,
        device: torch.device,
        store: HostStore,
        *,
        streams: int,
        event_sync: bool,
        use_thread: bool,
        timing: bool,
        landing_bytes: int,
    ) -> None:
        self.device = device
        self.event_sync = event_sync
        self.timing = timing
        self.streams = [torch.cuda.Stream(device=device) for _ in range(streams)]
        self.landing: list[torch.Tensor] = []
        self.landing_bytes = -1
        self.resize(landing_bytes)
        self._next_stream = 0
        self._staging_done: list[torch.cuda.Event | None] = []
        super().__init__(store, use_thread)

    def resize(self, landing_bytes: int) -> None:
        if landing_bytes == self.landing_bytes:
            return
        self._finish_all()
        self.landing = [torch.empty(landing_bytes, dtype=torch.uint8, device=self.device) for _ in self.streams]
        self.landing_bytes = landing_bytes

    def _prepare(self, token: Token) -> None:
        token.ready = torch.cuda.Event(enable_timing=self.timing)
        token.start = torch.cuda.Event(enable_timing=True) if self.timing else None

    def _marker(self) -> Marker:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Marker(event)

    def _wait(self, token: Token) -> Wait | None:
        self._wait_issued(token)
        compute = torch.cuda.current_stream(self.device)
        if not self.event_sync:
            token.ready.synchronize()
            return None
        if not self.timing:
            compute.wait_event(token.ready)
            return None
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(token.ready)
        after.record(compute)
        return Wait(token, before, after)

    def _finish_all(self) -> None:
        for s in self.streams:
            s.synchronize()

    def _issue(self, tokens: list[Token]) -> None:
        k = self._next_stream
        self._next_stream = (k + 1) % len(self.streams)
        stream = self.streams[k]
        with torch.cuda.stream(stream):  # also makes the stream's device current
            for token in tokens:
                token.stream = k
                for gate in token.gates:
                    event = gate.event if isinstance(gate, Marker) else gate.ready
                    if isinstance(gate, Token) and not gate.issued.is_set():
                        raise OrderingError(
                            f"layer {token.layer}'s copy would wait on an unrecorded copy (FIFO broken)"
                        )
                    if self.event_sync:
                        stream.wait_event(event)
                    else:
                        event.synchronize()
                if token.start is not None:
                    token.start.record(stream)
                self._copy(token, stream, self.landing[k])
                token.ready.record(stream)
                if not self.event_sync:
                    stream.synchronize()
                token.issued.set()

    def _copy(self, token: Token, stream: torch.cuda.Stream, landing: torch.Tensor) -> None:
        """Enqueue the copy (and the fp8 upcast) on ``stream``, the current stream here."""
        host = token.host
        if host.layout.landing_bytes > landing.numel():
            raise OrderingError(f"layer {token.layer} needs a {host.layout.landing_bytes}-byte landing buffer")
        pairs = host.copies(token.slot.buffer, landing)
        if host.pinned:
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        else:
            self._copy_staged(pairs, stream)
        _upcast(host, token.slot.buffer, landing)

    def _copy_staged(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> None:
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
                if self._staging_done[k] is not None:
                    self._staging_done[k].synchronize()  # bounce buffer still being read
                buf[:n].copy_(host[done : done + n])
                dst[done : done + n].copy_(buf[:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self._staging_done[k] = event
                done += n
                k = (k + 1) % len(staging)


def _upcast(host: HostLayer, slot: torch.Tensor, landing: torch.Tensor | None) -> None:
    """Write the fp8-stored params into the slot in their compute dtype (times their scales), from
    ``landing`` on CUDA or straight from the host master on the CPU."""
    layout = host.layout
    for k, p in enumerate(layout.params):
        if not p.scaled:
            continue
        if landing is not None:
            base = p.host_offset - layout.direct_bytes
            source = landing[base : base + p.host_nbytes].view(p.stored).view(p.shape)
        else:
            source = host.master_view(k)
        out = slot[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
        dequantize(source, host.scales[k], p.dtype, out=out)
