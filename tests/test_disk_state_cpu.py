"""Full fine-tuning with a host RAM budget: the masters and optimizer state of the layers that do not fit live on disk
(utils/dgls/training/disk_state.py), read before each one's update and written back after it.

- A run whose budget spills states (and, smaller, the weights too) equals the all-in-RAM run bitwise: AdamW on the
  host, with and without clipping, bf16 (own fp32 masters) and fp32 (the packed copy is the master), several
  micro-batches a step and one, and the optimizer state dict and its reload.
- Mutations the CPU transport catches: a read not waited for (its slot holds NaN), a read that does not wait for the
  write-backs before it (the file still holds the step before), a write-back never made.
- States spill before weights; what a disk state cannot serve is one line before anything is packed.
"""

import dataclasses
import json

import pytest
import torch
from full_ft import SPEC, assert_same, differs, full_layers, train_dgls
from helpers import skip_waits

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.memory.transport import Direction
from utils.dgls.training import disk_state
from utils.dgls.training.host_optimizer import HostOptimizerSpec

CPU = torch.device("cpu")
BF16 = torch.bfloat16
# SMALL's budgets (MiB / 1024) that spill some states and no weights, by dtype and micro-batches a step (sums)
STATES = {(BF16, 1): 0.002, (BF16, 2): 0.0025, (torch.float32, 2): 0.003}
EVERYTHING = 0.002  # bf16, two micro-batches: every state and some weights on disk


def run(tmp_path, dtype=BF16, budget=None, accumulate=2, max_norm=0.05, steps=3, **kw):
    layers = full_layers(dtype)
    extra = {"host_ram_budget": budget, "disk_dir": str(tmp_path)} if budget is not None else {}
    cfg = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=accumulate, prefetch=1, **extra, **kw)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        state = swapper.training.disk_state
        spilled = (sorted(state.spilled) if state is not None else [], swapper.store.disk_layers)
        record = train_dgls(layers, swapper, CPU, "nonreentrant", steps=steps, accumulate=accumulate, dtype=dtype,
                            max_norm=max_norm)  # fmt: skip
    return record, spilled


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(dtype=BF16, accumulate=2, max_norm=0.05):
        key = (dtype, accumulate, max_norm)
        if key not in cache:
            cache[key] = run(None, dtype, None, accumulate, max_norm)[0]
        return cache[key]

    return get


@pytest.mark.parametrize(
    "dtype, accumulate, max_norm",
    [(BF16, 2, 0.05), (BF16, 1, 0.05), (BF16, 2, None), (BF16, 1, None), (torch.float32, 2, 0.05)],
)
def test_states_on_disk_equal_all_in_ram(tmp_path, reference, dtype, accumulate, max_norm):
    got, (states, weights) = run(tmp_path, dtype, STATES[dtype, accumulate], accumulate, max_norm)
    assert states and weights == []
    assert_same(reference(dtype, accumulate, max_norm), got)


def test_states_and_weights_on_disk_equal_all_in_ram(tmp_path, reference):
    got, (states, weights) = run(tmp_path, BF16, EVERYTHING)
    assert states == [1, 2, 3, 4, 5, 6] and 0 < len(weights) < 6  # some weights too (which: the disk plan)
    assert_same(reference(), got)


def test_fp32_masters_that_are_the_packed_weights_on_disk_equal_all_in_ram(tmp_path, reference):
    got, (states, weights) = run(tmp_path, torch.float32, 0.0015, accumulate=1)  # masters: the weights' extents
    assert states == [1, 2, 3, 4, 5, 6] and weights == [1, 2, 3, 4, 5, 6]
    assert_same(reference(torch.float32, 1), got)


def test_a_read_that_is_not_waited_for_differs(tmp_path, reference, monkeypatch):
    skip_waits(monkeypatch, Direction.DISK_IN)  # the slot keeps its NaN bytes
    got, _ = run(tmp_path, BF16, STATES[BF16, 2])
    assert differs(reference(), got)


def test_a_read_that_does_not_wait_for_the_write_backs_differs(tmp_path, reference, monkeypatch):
    read = disk_state.DiskState._issue

    def ungated(self, idx):
        self._writers, self._written = [None] * disk_state.SLOTS, {}  # forget every write-back: none is a gate
        return read(self, idx)

    monkeypatch.setattr(disk_state.DiskState, "_issue", ungated)
    got, _ = run(tmp_path, BF16, STATES[BF16, 2])
    assert differs(reference(), got)


def test_a_write_back_never_made_differs(tmp_path, reference, monkeypatch):
    skip_waits(monkeypatch, Direction.DISK_OUT)  # reads gated on it find the file as it was
    got, _ = run(tmp_path, BF16, STATES[BF16, 2])
    assert differs(reference(), got)


def test_the_state_dict_and_its_reload_go_through_the_disk(tmp_path):
    layers = full_layers(BF16)
    cfg = SwapConfig.of(host_optimizer=SPEC, prefetch=1, host_ram_budget=STATES[BF16, 1], disk_dir=str(tmp_path))
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=2, dtype=BF16)
        training = swapper.training
        saved = training.state_dict()
        spilled = sorted(training.disk_state.spilled)
        for idx in spilled:  # the copies hold numbers; the layer's own tensors are unbound again
            moments = [s["exp_avg_sq"] for s in saved[idx]["state"].values()]
            assert moments and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in moments)
            unbound = training.layers[idx].optimizer.state
            assert all(torch.isnan(s["exp_avg_sq"]).all() for s in unbound.values())
        zeroed = {
            idx: {**s, "state": {i: {**v, "exp_avg": torch.zeros_like(v["exp_avg"])} for i, v in s["state"].items()}}
            for idx, s in saved.items()
        }
        training.load_state_dict(zeroed)
        again = training.state_dict()
    for idx in spilled:
        for i, values in again[idx]["state"].items():
            assert torch.equal(values["exp_avg"], torch.zeros_like(values["exp_avg"]))
            assert torch.equal(values["exp_avg_sq"], saved[idx]["state"][i]["exp_avg_sq"])


def test_the_start_up_line_says_where_the_states_live(tmp_path):
    lines = []
    layers = full_layers(BF16)
    cfg = SwapConfig.of(host_optimizer=SPEC, prefetch=1, host_ram_budget=STATES[BF16, 1], disk_dir=str(tmp_path))
    with LayerSwapper(layers, cfg, device=CPU, log=lines.append) as swapper:
        n = len(swapper.training.disk_state.spilled)  # which and how many: the state plan's (measured bandwidths)
    assert any(f"DGLS disk state: the fp32 masters and optimizer state of {n} streamed layers" in ln for ln in lines)
    assert any(f"the fp32 masters and optimizer state of {n} streamed layers are read from disk" in ln for ln in lines)
    assert any("every streamed layer's weights stay in RAM" in line for line in lines)
    assert list(tmp_path.iterdir()) == []  # unnamed files


def test_states_spill_before_weights_and_evenly():
    layers = full_layers(BF16)
    with LayerSwapper(layers, SwapConfig.of(host_optimizer=SPEC, prefetch=1), device=CPU, log=None) as swapper:
        layout, store = swapper.training.layout, swapper.store
        layouts = [h.layout for h in store.layers.values()]
    by_index = {lay.index: lay for lay in layouts}
    full = [by_index.get(i) for i in range(max(by_index) + 1)]
    hosted = sorted(by_index)
    parts = layout.parts()
    packed = sum(disk_state.whole_pages(by_index[i].host_bytes) for i in hosted)
    states = {i: disk_state.state_ram_bytes(layout, i) for i in layout.layers}
    extent = max(disk_state.whole_pages(disk_state.extent_pieces(layout, i)[1]) for i in layout.layers)
    two = packed + parts["gradients"] + sum(states.values()) - 2 * max(states.values()) + 2 * extent
    tiers, spilled = disk_state.plan_full_tiers(full, hosted, hosted, two, 2, layout)
    assert len(spilled) <= 3 and not tiers.spilled  # a few states, no weights
    _, all_states = disk_state.plan_full_tiers(
        full, hosted, hosted, packed + parts["gradients"] + 2 * extent, 2, layout
    )
    assert sorted(all_states) == hosted


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"host_optimizer": dataclasses.replace(SPEC, implementation="device")}, "pass --host_adam torch_fused"),
        ({"vram_budget": 1.0}, "give the placement instead"),
    ],
)
def test_what_the_disk_state_cannot_serve_is_one_line(tmp_path, kw, match):
    cfg = SwapConfig.of(**{"host_optimizer": SPEC, "host_ram_budget": STATES[BF16, 1], "disk_dir": str(tmp_path), **kw})
    with pytest.raises(DGLSUserError, match=match):
        LayerSwapper(full_layers(BF16), cfg, device=CPU, log=None)
    assert list(tmp_path.iterdir()) == []


def test_states_on_disk_with_the_job_thread_equal_all_in_ram(tmp_path, reference):
    """The job worker on its own thread (as on CUDA): reads issued and landed there, queued from the training thread."""
    got, (states, _) = run(tmp_path, BF16, STATES[BF16, 2], threading=True)
    assert states
    assert_same(reference(), got)


def test_each_spilled_state_is_read_once_a_step_and_the_next_read_overlaps_the_update(tmp_path, monkeypatch):
    """One read and one write-back per spilled layer and update; a layer's read is issued by an update before it (so
    it overlaps that update: DiskState.ahead, or the spilled update before it), or as its own update job starts."""
    events = []
    bring_in, issue = disk_state.DiskState.bring_in, disk_state.DiskState._issue
    monkeypatch.setattr(
        disk_state.DiskState, "bring_in", lambda s, layer: events.append(("in", layer.index)) or bring_in(s, layer)
    )
    monkeypatch.setattr(disk_state.DiskState, "_issue", lambda s, idx: events.append(("read", idx)) or issue(s, idx))
    _, (states, _) = run(tmp_path, BF16, STATES[BF16, 2], steps=2)
    reads = [idx for kind, idx in events if kind == "read"]
    updates = [idx for kind, idx in events if kind == "in"]
    assert sorted(reads) == sorted(updates) == sorted(states * 2)
    ahead, current = 0, None  # a read issued inside another layer's update (the call that brings that one in)
    for kind, idx in events:
        if kind == "in":
            current = idx
        elif current is not None and idx != current:
            ahead += 1
    assert ahead >= 2 * (len(states) - 1)


def test_torch_fused_adamw_with_states_on_disk_equals_all_in_ram(tmp_path):
    """The host kernel diffusion-pipe users pick here (--host_adam torch_fused): its state tensors bind the same."""
    fused = dataclasses.replace(SPEC, implementation="torch_fused")
    records = []
    for budget in (None, STATES[BF16, 1]):
        layers = full_layers(BF16)
        extra = {"host_ram_budget": budget, "disk_dir": str(tmp_path)} if budget is not None else {}
        cfg = SwapConfig.of(host_optimizer=fused, accumulation_steps=1, prefetch=1, **extra)
        with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
            assert (swapper.training.disk_state is not None) == (budget is not None)
            records.append(train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=1, dtype=BF16))
    assert_same(*records)


def test_without_state_to_spill_the_weights_spill_and_equal_all_in_ram(tmp_path):
    """fp32 SGD without momentum keeps no state and its masters are the packed weights: nothing spills as training
    state, the weights do (the updates write them through the file's mapping, the copies read them from the file)."""
    sgd = HostOptimizerSpec(type="sgd", lr=1e-2, implementation="torch")
    records = []
    for budget in (None, 0.0012):
        layers = full_layers(torch.float32)
        extra = {"host_ram_budget": budget, "disk_dir": str(tmp_path)} if budget is not None else {}
        cfg = SwapConfig.of(host_optimizer=sgd, accumulation_steps=1, prefetch=1, **extra)
        with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
            assert swapper.training.disk_state is None
            assert bool(swapper.store.disk_layers) == (budget is not None)
            records.append(train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=1))
    assert_same(*records)


def test_the_profile_draws_disk_reads_and_write_backs_on_the_cpu(tmp_path):
    """The trace has a lane for each disk direction (three passes: the clipped update of the first step, two
    micro-batches, runs after its second pass)."""
    trace = tmp_path / "trace.json"
    run(tmp_path, BF16, STATES[(BF16, 2)], profile=str(trace), profile_warmup_steps=0, profile_steps=3)
    lanes = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "transfer"}
    assert {"disk reads", "disk writes"} <= lanes


def test_weights_on_disk_are_not_read_ahead_of_their_update(tmp_path, reference):
    """A full fine-tune rewrites a layer's packed weights on disk with its update, which its fetch waits for (the
    fetch gates): a read ahead could come before it, so the engine reads no layer ahead there; its fetches read.
    (The CPU transport performs a read when it is waited for, so a read ahead too early would still see the update
    here: this checks the rule, not its consequence.)"""
    layers = full_layers(BF16)
    cfg = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=2, prefetch=1, host_ram_budget=EVERYTHING,
                        disk_dir=str(tmp_path))  # fmt: skip
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        got = train_dgls(layers, swapper, CPU, "nonreentrant", steps=3, accumulate=2, dtype=BF16, max_norm=0.05)
        disk = swapper.store.disk
        assert swapper.store.disk_layers and disk.taken == 0 and disk.staged == {}
    assert_same(reference(), got)
