"""The transport's CPU backend and its worker thread, on their own.

Every direction's copies go through one backend, so one rule holds for all of them: a late copy's
destination holds NaN until something waits for it (the consumer's ``acquire``, the host's ``land``, or a
later copy gated on it), and a test that skips the wait (:func:`helpers.skip_waits`) reads NaN.
"""

import threading

import pytest
import torch
from helpers import skip_waits

from utils.dgls import DGLSUserError, SwapWorkerError
from utils.dgls.memory.transport import Direction, Marker, Transport, Worker

CPU = torch.device("cpu")


class Heard:
    def __init__(self):
        self.copies = []

    def copied(self, copy):
        self.copies.append((copy.direction, copy.nbytes))


@pytest.mark.parametrize("direction", list(Direction), ids=[d.name for d in Direction])
def test_a_late_copy_in_any_direction_is_nan_until_it_is_waited_for(direction):
    transport = Transport(CPU)
    heard = Heard()
    transport.listeners.append(heard)
    src, dst = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    copy = transport.submit(direction, [(dst, src)])
    assert torch.isnan(dst).all()  # in flight: undefined contents
    assert heard.copies == [(direction, 24)]  # one event per copy, with its direction and bytes
    transport.acquire(copy)
    assert torch.equal(dst, src)
    src.fill_(7)
    transport.land(copy)  # landed once: a second wait changes nothing
    assert torch.equal(dst, torch.arange(6, dtype=torch.float32))


def test_a_gate_lands_before_the_copy_it_gates_and_a_marker_is_free():
    transport = Transport(CPU)
    a, b = torch.zeros(3), torch.zeros(3)
    first = transport.submit(Direction.ACTIVATIONS_IN, [(a, torch.ones(3))])
    with transport.issue(Direction.STATE_IN, [first, Marker(), None]):
        b.copy_(a * 2)  # reads what the gate wrote
    assert torch.equal(b, torch.full((3,), 2.0))
    transport.submit(Direction.GRADS_HOME, [(b, a)], late=False)  # an eager copy lands at once
    assert torch.equal(b, a)


@pytest.mark.parametrize("direction", list(Direction), ids=[d.name for d in Direction])
def test_the_mutation_skips_only_its_direction(monkeypatch, direction):
    skip_waits(monkeypatch, direction)
    transport = Transport(CPU)
    dsts = {d: torch.zeros(2) for d in Direction}
    copies = {d: transport.submit(d, [(dsts[d], torch.ones(2))]) for d in Direction}
    for copy in copies.values():
        transport.acquire(copy)
    assert {d for d, t in dsts.items() if torch.isnan(t).any()} == {direction}


def test_a_copy_to_issue_never_waits_for_a_running_host_job():
    """Copies and host optimizer jobs run on two threads: a copy is issued while a long host update runs (on one
    thread it would have waited for the whole update, and the next layer's weights with it)."""
    transport = Transport(CPU)
    running, release = threading.Event(), threading.Event()
    transport.copy_worker.start()
    transport.job_worker.start()
    try:
        transport.job_worker.put(lambda: (running.set(), release.wait(10)))
        assert running.wait(10)
        issued = transport.copy_worker.put(lambda: None, urgent=True)
        assert issued.wait(5), "the copy waited for the running job"
        assert {transport.copy_worker.name, transport.job_worker.name} == {"dgls-copies", "dgls-jobs"}
    finally:
        release.set()
        transport.close()


def test_the_worker_runs_copies_to_issue_ahead_of_queued_jobs_in_order():
    worker = Worker()
    order, gate = [], threading.Event()
    worker.start()
    try:
        worker.put(gate.wait)  # holds the thread while the rest is queued
        jobs = [worker.put(lambda k=k: order.append(f"job {k}")) for k in range(2)]
        copies = [worker.put(lambda k=k: order.append(f"copy {k}"), urgent=True) for k in range(2)]
        gate.set()
        for done in jobs + copies:
            worker.wait(done)
        assert order == ["copy 0", "copy 1", "job 0", "job 1"]
        assert worker.threaded and not worker.on_thread()
    finally:
        worker.close()


def test_without_a_thread_queued_work_runs_in_order_when_waited_for():
    worker = Worker()
    order = []
    first = worker.put(lambda: order.append(1))
    second = worker.put(lambda: order.append(2))
    assert order == []  # deferred: nothing runs by itself
    worker.wait(second)
    assert order == [1, 2] and first.is_set()


def test_a_worker_failure_surfaces_in_the_waiting_thread():
    worker = Worker()
    worker.start()

    def broken():
        raise OSError("simulated failure")

    done = worker.put(broken)
    with pytest.raises(SwapWorkerError, match="simulated failure"):
        worker.wait(done)
    with pytest.raises(SwapWorkerError):
        worker.put(lambda: None)
    worker.close()


def test_a_user_mistake_a_job_finds_surfaces_as_itself_one_line():
    """A setting a job refuses (AdamW8bit's Triton launch with a per-param skip_zeros) is the user's to fix: it reaches
    the waiting thread as the DGLSUserError it is, which dgls_train.py prints as one line, not as a worker failure
    (a bug, with its traceback)."""
    worker = Worker()
    worker.start()

    def refuses():
        raise DGLSUserError("a setting this job refuses: change it")

    done = worker.put(refuses)
    with pytest.raises(DGLSUserError, match="a setting this job refuses") as caught:
        worker.wait(done)
    assert not isinstance(caught.value, SwapWorkerError)
    worker.close()


def test_a_join_stands_for_all_of_its_copies():
    transport = Transport(CPU)
    dsts = [torch.zeros(2) for _ in range(3)]
    joined = transport.join([transport.submit(Direction.GRADS_HOME, [(d, torch.ones(2))]) for d in dsts])
    assert joined.nbytes == 24 and all(torch.isnan(d).all() for d in dsts)
    transport.land(joined)
    assert all(torch.equal(d, torch.ones(2)) for d in dsts)
    assert transport.join([]) is None
