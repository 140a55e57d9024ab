"""The compute stream's waits for activation restores are measured apart from its waits for weight copies.

"compute waited" in the step stats and the benchmarks' rows is the weights' waits (the swapper's ``waited``, per
layer); a restore of a checkpointed call's inputs (offload_activations) that comes too late shows in
``activation_wait_ms`` ("activation waits (ms)" in the benchmarks, the waits lane of ``--profile``). The events are
CUDA's on a GPU; here they are stand-ins with the same two methods, so the arithmetic is tested on the CPU (the GPU
test in test_activation_offload_gpu.py delays real restores).
"""

import json
import time

import pytest
import torch
from helpers import checkpoint_for, make_layers, train

from utils.dgls.activations.activation_offload import ActivationOffloader
from utils.dgls.memory.copier import Wait
from utils.dgls.memory.transport import Copy, Direction, Transport
from utils.dgls.streaming.schedule import Phase
from utils.dgls.watching.profiler import Profiler
from utils.dgls.watching.stats import StatsCollector

CPU = torch.device("cpu")


class Stamp:
    """A CUDA event's two methods over a fixed time in ms (``done``: whether it completed)."""

    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "Stamp") -> float:
        return end.ms - self.ms


def restore() -> Copy:
    return Copy(direction=Direction.ACTIVATIONS_IN, nbytes=1024)


def test_restore_waits_are_counted_apart_from_weight_waits():
    stats = StatsCollector(CPU, lambda: 0)
    start = stats.total()
    weights = Copy(direction=Direction.WEIGHTS_IN, nbytes=4096)
    stats.waited(Wait(weights, Stamp(0.0), Stamp(2.0)))  # the swapper's report of a weight wait
    stats.acquired(weights, Stamp(0.0), Stamp(2.0))  # the transport's report of the same wait: not counted again
    stats.acquired(restore(), Stamp(10.0), Stamp(13.5))
    stats.acquired(restore(), Stamp(20.0), Stamp(21.0, done=False))  # not resolved yet
    now = stats.total()
    assert now.wait_ms == pytest.approx(2.0)
    assert now.activation_wait_ms == pytest.approx(3.5)
    assert now.pending == 1
    stats.pass_ended()
    assert stats.last_pass().activation_wait_ms == pytest.approx(3.5)
    later = stats.total(sync=True)  # sync: every pair resolved
    assert later.activation_wait_ms == pytest.approx(4.5) and later.pending == 0
    step = later.since(start)
    assert (step.wait_ms, step.activation_wait_ms) == (pytest.approx(2.0), pytest.approx(4.5))
    assert "waited 4.5 ms for their restores" in step.line("cpu")
    assert "restores" not in later.since(later).line("cpu")


class TimingTransport(Transport):
    """The CPU transport, recording whether each acquire asked for timing."""

    def __init__(self, timed):
        super().__init__(CPU, timed=timed)
        self.asked: list[tuple[Direction, bool]] = []

    def acquire(self, copy, timed=False):
        self.asked.append((copy.direction, timed))
        return super().acquire(copy, timed)


@pytest.mark.parametrize("timed", [True, False])
def test_a_restore_is_a_timed_wait_where_the_transport_times_restores(timed):
    transport = TimingTransport({Direction.ACTIVATIONS_IN} if timed else set())
    offloader = ActivationOffloader(CPU, keep=1, min_bytes=0, transport=transport)
    layers, trainable = make_layers()
    ckpt = offloader.wrap(checkpoint_for("nonreentrant"))
    train(layers, trainable, CPU, "nonreentrant", checkpoint_fn=ckpt)
    restores = [t for d, t in transport.asked if d is Direction.ACTIVATIONS_IN]
    assert offloader.restored_bytes > 0 and restores
    assert set(restores) == {timed}


def test_the_profile_puts_restore_waits_on_the_waits_lane(tmp_path):
    path = tmp_path / "trace.json"
    profiler = Profiler(path, CPU, warmup_steps=0, steps=1, log=None)
    t0 = time.perf_counter()
    profiler.use_started(3, Phase.BACKWARD, True, False)
    profiler.acquired(restore(), t0, t0 + 0.002)  # CPU stamps: perf_counter values
    profiler.acquired(Copy(direction=Direction.WEIGHTS_IN), t0, t0 + 0.005)  # comes through ``waited``: not again
    profiler.pass_ended()
    trace = json.loads(path.read_text())
    waits = [e for e in trace["traceEvents"] if e.get("cat") == "other wait"]
    assert len(waits) == 1 and waits[0]["name"] == "wait activations in"
    assert waits[0]["dur"] == pytest.approx(2000.0, rel=1e-3)
    row = trace["otherData"]["summary"]["1"]
    assert row["other_wait_ms"] == pytest.approx(2.0, rel=1e-3) and row["wait_ms"] == 0.0
    assert not any(e.get("cat") == "wait" for e in trace["traceEvents"])


def test_record_after_moves_the_profile_window_to_the_passes_asked_for(tmp_path):
    path = tmp_path / "trace.json"
    profiler = Profiler(path, CPU, warmup_steps=10**9, steps=1, log=None)
    for _ in range(3):  # passes before the window is placed: not recorded
        profiler.use_started(0, Phase.FORWARD, True, False)
        profiler.pass_ended()
    profiler.record_after(1, 2)  # skip one pass, then record two
    for layer in range(4):
        profiler.use_started(layer, Phase.FORWARD, True, False)
        profiler.pass_ended()
    trace = json.loads(path.read_text())
    assert trace["otherData"]["steps"] == [5, 6]
    uses = [e["args"]["layer"] for e in trace["traceEvents"] if e.get("cat") == "compute"]
    assert uses == [1, 2]
    with pytest.raises(RuntimeError):
        profiler.record_after(0, 1)  # written: a window placed now would never be written


def test_record_after_now_records_the_next_pass(tmp_path):
    path = tmp_path / "trace.json"
    profiler = Profiler(path, CPU, warmup_steps=10**9, steps=1, log=None)
    profiler.pass_ended()
    profiler.record_after(0, 1)
    profiler.use_started(7, Phase.BACKWARD, True, False)
    profiler.pass_ended()
    trace = json.loads(path.read_text())
    assert trace["otherData"]["steps"] == [2]
    assert [e["args"]["layer"] for e in trace["traceEvents"] if e.get("cat") == "compute"] == [7]
