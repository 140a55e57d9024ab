"""The hook path's host work (issue 34): the CUDA weight path run on the CPU with counting stand-ins for
``torch.cuda`` (benchmarks/count_host.py), so CI runs the code a GPU runs and pins its CUDA API calls per copy;
and the shortcuts that keep the hot path cheap behave as what they replaced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, make_layers, train

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.memory.copier import ISSUED, PENDING
from utils.dgls.memory.transport import Direction
from utils.dgls.streaming.hooks import tensors_in
from utils.dgls.streaming.schedule import Phase
from utils.dgls.torch_private import profiler_recording, top_saved_tensors_hooks, under_selective_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import count_host  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reference():
    layers, trainable = make_layers()
    return train(layers, trainable, CPU, "nonreentrant")


@pytest.mark.parametrize("timing", [True, False], ids=["timed", "untimed"])
def test_the_cuda_weight_path_trains_bitwise_equal_with_one_stream_query_per_wait(reference, timing):
    """The CUDA copier and transport over CPU tensors: the same numbers as resident, and per copy one ready event
    (and a start event when timed), per timed wait two events around it and one current-stream query, per release
    one event: every event made is recorded, and no call queries the current stream twice for one wait."""
    layers, trainable = make_layers()
    calls = count_host.CudaCalls()
    config = SwapConfig.of(prefetch=2, collect_timing=timing)
    with count_host.cuda_stand_ins(calls), LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        count_host.use_cuda_copier(swapper, sys.modules["utils.dgls"])
        got = train(layers, trainable, CPU, "nonreentrant")
        fetches = swapper.total_stats().fetches
    assert_bitwise_equal(reference, got)
    copies, events = calls["stream()"], calls["Event()"]
    assert copies >= fetches > 0
    assert calls["Event.record"] == events
    waits = fetches if timing else 0  # a copy's first acquire waits (timed: between two events)
    releases = events - copies * (2 if timing else 1) - 2 * waits
    assert releases > 0
    assert calls["current_stream()"] == fetches + releases  # one per wait (timed or not), one per release marker
    assert calls["Stream.wait_event"] >= fetches


def test_tokens_without_a_worker_share_the_issued_event_and_with_one_have_their_own():
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        slot, host = swapper.pool.slots[0], swapper.store.layers[next(iter(swapper.store.layers))]
        (token,) = swapper.copier.submit([(slot, host, False)])
        assert token.issued is ISSUED and ISSUED.is_set()
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1, threading=True), device=CPU, log=None) as swapper:
        slot, host = swapper.pool.slots[0], swapper.store.layers[next(iter(swapper.store.layers))]
        (token,) = swapper.copier.submit([(slot, host, False)])
        swapper.copier.drain()
        assert token.issued not in (ISSUED, PENDING) and token.issued.is_set()
    assert not PENDING.is_set()


def test_a_write_whose_issuing_failed_stays_pending(monkeypatch):
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        copier = swapper.copier
        slot, host = swapper.pool.slots[0], swapper.store.layers[next(iter(swapper.store.layers))]

        def broken(direction, *args, **kwargs):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(copier.transport, "submit", broken)
        with pytest.raises(RuntimeError, match="copy failed"):
            copier.submit([(slot, host, False)])
        assert copier._slots[slot].write.issued is PENDING and not PENDING.is_set()
        monkeypatch.undo()
        copier.forget_slots()


def test_tensors_in_walks_nests_in_order():
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    assert tensors_in(a) == [a]
    found = tensors_in((a, [b, {"x": c, "y": (d, 3)}], None))
    assert len(found) == 4 and all(x is y for x, y in zip(found, (a, b, c, d)))
    assert tensors_in(None) == [] and tensors_in(3) == []


def test_the_hot_reads_answer_as_before():
    assert hash(Phase.FORWARD) != hash(Phase.BACKWARD) and {Phase.FORWARD: 1}[Phase.FORWARD] == 1
    assert {Direction.WEIGHTS_IN: 1}.get(Direction.WEIGHTS_IN) == 1 and Direction.GRADS_HOME not in {
        Direction.WEIGHTS_IN
    }
    assert profiler_recording() is False
    with torch.profiler.profile():
        assert profiler_recording() is True
    assert profiler_recording() is False
    assert top_saved_tensors_hooks() is None

    def pack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert top_saved_tensors_hooks()[0] is pack
    assert not under_selective_checkpoint()


@pytest.mark.slow  # with the other benchmark tests: diffusers' Flux class needs a newer peft than the floor
def test_count_host_counts_this_engine_on_the_cuda_path():
    """The counting script's own run (few layers, one step): every hook entry point counted, CUDA calls made."""
    result = count_host.main(["--steps", "1", "--warmup", "1", "--depth", "2,2"])
    total = result["this"]["total"]
    assert total["calls"] > 0 and total["py"] > 0 and total["cuda"] > 0
