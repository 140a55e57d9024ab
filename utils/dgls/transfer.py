"""Transfers: host-to-device copies on dedicated streams, ordered by events.

The main thread decides what goes where (slots, release events); this module only
issues the copies, inline or on a background worker. The compute stream waits on a
fetch's ``ready`` event with ``wait_event``; the host does not block unless
``event_sync`` is off (the conservative debugging mode).

fp8-stored layers: their fp8 bytes land in a landing buffer owned by the copy stream and
are upcast into the slot by kernels on that same stream, before ``ready`` is recorded. So
the compute stream sees a finished slot in the compute dtype, and stream order alone keeps
the next copy from overwriting a landing buffer that is still being read.
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


@dataclass
class Fetch:
    """One layer's copy into one slot."""

    layer: int
    host: HostLayer
    slot: Slot
    wait_for: list = field(default_factory=list)  # events the copy stream waits on first
    ready: torch.cuda.Event | None = None
    start: torch.cuda.Event | None = None
    issued: threading.Event = field(default_factory=threading.Event)
    demand: bool = False  # issued because compute needed it now (a prefetch miss)
    stream: int = 0  # index of the copy stream it was issued on
    host_span: tuple[float, float] | None = None  # CPU: perf_counter() around the (synchronous) copy

    @property
    def nbytes(self) -> int:
        return self.host.host_nbytes  # bytes moved (fp8 storage moves fewer than the slot holds)


class CopyEngine:
    """Issues fetches on copy streams, inline or from a background worker thread."""

    def __init__(
        self,
        device: torch.device,
        store: HostStore,
        *,
        streams: int,
        event_sync: bool,
        use_thread: bool,
        timing: bool,
        landing_bytes: int = 0,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.store = store
        self.event_sync = event_sync
        self.timing = timing and self.cuda
        self.streams = [torch.cuda.Stream(device=device) for _ in range(streams)] if self.cuda else []
        # One landing buffer per copy stream for fp8 bytes awaiting their upcast (CUDA only).
        self.landing = [torch.empty(landing_bytes, dtype=torch.uint8, device=device) for _ in self.streams]
        self.landing_bytes = landing_bytes if self.cuda else 0
        self._next_stream = 0
        self._staging_done: list[torch.cuda.Event | None] = []
        self.error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if use_thread:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, name="dgls-prefetch", daemon=True)
            self._thread.start()

    # main thread -----------------------------------------------------------------
    def new_fetch(self, layer: int, host: HostLayer, slot: Slot, demand: bool) -> Fetch:
        fetch = Fetch(layer, host, slot, demand=demand)
        if self.cuda:
            fetch.wait_for = [e for e in (slot.released, slot.written) if e is not None]
            fetch.ready = torch.cuda.Event(enable_timing=self.timing)
            fetch.start = torch.cuda.Event(enable_timing=True) if self.timing else None
            slot.written = fetch.ready
        return fetch

    def submit(self, fetches: list[Fetch]) -> None:
        """Issue a batch of fetches, on the worker if there is one."""
        self.check()
        if self._queue is not None:
            self._queue.put(fetches)
        else:
            self._issue(fetches)

    def wait_issued(self, fetch: Fetch) -> None:
        """Block until the worker has issued this fetch (immediate when inline)."""
        while not fetch.issued.wait(timeout=1.0):
            self.check()
            if self._thread is not None and not self._thread.is_alive():
                raise SwapWorkerError("the DGLS prefetch worker stopped without issuing a pending copy")
        self.check()

    def check(self) -> None:
        """Surface a worker failure in the calling thread."""
        if self.error is not None:
            raise SwapWorkerError(f"DGLS prefetch worker failed: {self.error!r}") from self.error

    def drain(self) -> None:
        """Wait until every submitted copy has been issued and has finished."""
        if self._queue is not None:
            done = threading.Event()
            self._queue.put(done)
            while not done.wait(timeout=1.0):
                self.check()
                if not self._thread.is_alive():
                    break
        for s in self.streams:
            s.synchronize()
        self.check()

    def close(self) -> None:
        """Stop the worker and wait for the copy streams."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None
            self._queue = None
        for s in self.streams:
            s.synchronize()

    # any thread ------------------------------------------------------------------
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
                for f in item:
                    f.issued.set()
                return

    def _issue(self, fetches: list[Fetch]) -> None:
        if not self.cuda:
            for f in fetches:
                began = time.perf_counter()
                for src, dst in f.host.copies(f.slot.buffer, None):
                    dst.copy_(src)
                f.host.upcast(f.slot.buffer, None)
                f.host_span = (began, time.perf_counter())
                f.issued.set()
            return
        k = self._next_stream
        stream, landing = self.streams[k], self.landing[k]
        self._next_stream = (self._next_stream + 1) % len(self.streams)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for f in fetches:
                f.stream = k
                for event in f.wait_for:
                    if self.event_sync:
                        stream.wait_event(event)
                    else:
                        event.synchronize()
                if f.start is not None:
                    f.start.record(stream)
                if f.host.landing_bytes > self.landing_bytes:
                    raise RuntimeError(f"layer {f.layer} needs a {f.host.landing_bytes}-byte landing buffer")
                pairs = f.host.copies(f.slot.buffer, landing)
                if f.host.pinned:
                    for src, dst in pairs:
                        dst.copy_(src, non_blocking=True)
                else:
                    self._copy_staged(pairs, stream)
                f.host.upcast(f.slot.buffer, landing)
                f.ready.record(stream)
                if not self.event_sync:
                    stream.synchronize()
                f.issued.set()

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
