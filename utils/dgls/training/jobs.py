"""Jobs: host work of full fine-tuning (gradient sums, host updates) in submission order on the transport's job
worker, with the time they took and the time the training thread waited for them.

Mechanics
    - :meth:`Jobs.submit` queues a callable on :attr:`~..memory.transport.Transport.job_worker` (its thread on
      CUDA or with ``threaded``; deferred otherwise: a job runs only when something waits for it, so a missing
      wait changes the numbers in a CPU test) and returns its :class:`Job`, the token of its result.
    - :meth:`Jobs.wait` blocks until the job ran and returns what it returned.

Threads
    - A job's :attr:`Job.result` is written by the thread that runs it and read by another thread only after
      ``done`` is set (the happens-before); a later job reads an earlier one's result on the same thread.
    - ``waited_s`` is written by the training thread, ``job_s`` by the thread that runs jobs (one at a time);
      both are statistics that no decision reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from ..memory.transport import Worker

JobKind = Literal["accumulate", "update", "publish"]


@dataclass(eq=False)
class Job:
    """One host job (an accumulation, an update, or data parallel's publication of one) on the transport's job
    worker."""

    layer: int
    kind: JobKind
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None  # what it returned: read by another thread only after ``done``


class Jobs:
    """Host jobs in submission order on the transport's job worker (see the module doc)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.waited_s = 0.0  # seconds the training thread spent blocked on jobs
        # seconds the host spent on each kind
        self.job_s: dict[JobKind, float] = {"accumulate": 0.0, "update": 0.0, "publish": 0.0}

    def submit(self, layer: int, kind: JobKind, run: Callable[[], object]) -> Job:
        job = Job(layer, kind)
        job.done = self.worker.put(partial(self._run, job, run))
        return job

    def wait(self, job: Job) -> object:
        """Block until ``job`` ran; its result."""
        if not job.done.is_set():
            began = time.perf_counter()
            try:
                self.worker.wait(job.done)
            finally:
                self.waited_s += time.perf_counter() - began
        return job.result

    def _run(self, job: Job, run: Callable[[], object]) -> None:
        began = time.perf_counter()
        job.result = run()
        self.job_s[job.kind] += time.perf_counter() - began
