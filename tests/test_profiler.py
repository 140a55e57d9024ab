"""--profile: the trace holds every use and copy of the profiled steps, and changes nothing else."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from full_ft import SPEC, full_layers, train_dgls
from helpers import assert_bitwise_equal, checkpoint_for, child_env, make_layers, train

from utils.dgls import LayerSwapper, Listener, SwapConfig
from utils.dgls.memory.transport import ON_DISK, Copy, Direction
from utils.dgls.watching.profiler import Profiler

CPU = torch.device("cpu")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


class Recorder(Listener):
    """Each pass's uses and stats, as the engine reports them (independently of the profiler)."""

    def __init__(self, swapper):
        self.swapper, self.uses, self.per_step = swapper, [[]], []

    def use_started(self, layer, phase, streamed, missed):
        self.uses[-1].append((layer, phase.value))

    def pass_ended(self):
        self.per_step.append(self.swapper.step_stats())
        self.uses.append([])


def profiled_run(tmp_path, device=CPU, steps=4, dtype=torch.float32, **config):
    """Train with a profile (one backward per step); return the trace, each step's stats and uses."""
    layers, trainable = make_layers(dtype)
    config = {"prefetch": 2, "profile": str(tmp_path / "trace.json"), **config}
    lines = []
    with LayerSwapper(layers, SwapConfig.of(**config), device=device, log=lines.append) as swapper:
        recorder = Recorder(swapper)
        swapper.add_listener(recorder)
        record = train(layers, trainable, device, "nonreentrant", steps=steps, accumulate=1, dtype=dtype)
    path = tmp_path / "trace.json"
    trace = json.loads(path.read_text()) if path.exists() else None
    return trace, recorder.per_step, recorder.uses, lines, record


def lanes(trace):
    return {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def spans(trace, cat, step=None):
    return [
        e
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["cat"] == cat and (step is None or e["args"]["step"] == step)
    ]


def check_complete(trace, per_step, uses, warmup, steps):
    """Every use and every copy of the profiled steps is in the trace, in order, on its lane."""
    assert trace["otherData"]["steps"] == list(range(warmup + 1, warmup + steps + 1))
    assert len(spans(trace, "step")) == steps
    lane = lanes(trace)
    assert {"steps", "compute", "waits"} <= lane.keys() and any(name.startswith("copy") for name in lane)
    for step in trace["otherData"]["steps"]:
        stats = per_step[step - 1]
        compute = spans(trace, "compute", step)
        assert [(e["args"]["layer"], e["name"].split()[-1]) for e in compute] == uses[step - 1]
        assert sum(e["args"]["streamed"] for e in compute) == stats.uses > 0
        copies = spans(trace, "copy", step)
        assert len(copies) == stats.fetches > 0
        assert sum(e["args"]["bytes"] for e in copies) == stats.bytes_moved
        assert all(e["tid"] >= lane["copy" if "copy" in lane else "copy 0"] for e in copies)
        assert all(e["tid"] == lane["compute"] for e in compute)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 1
    starts = [e["ts"] for e in spans(trace, "compute")]
    assert starts == sorted(starts)


@pytest.mark.parametrize("threading_on", [False, True], ids=["inline", "thread"])
def test_profile_holds_every_use_and_copy_of_the_profiled_steps(tmp_path, threading_on):
    trace, per_step, uses, lines, _ = profiled_run(
        tmp_path, profile_warmup_steps=1, profile_steps=2, threading=threading_on
    )
    check_complete(trace, per_step, uses, warmup=1, steps=2)
    assert trace["otherData"]["clock"] == "time.perf_counter" and trace["otherData"]["notes"]
    (line,) = [x for x in lines if x.startswith("DGLS profile:")]
    assert f"steps 2-3 written to {tmp_path / 'trace.json'}" in line and "ui.perfetto.dev" in line
    assert (tmp_path / "trace.png").exists() == HAS_MATPLOTLIB


def test_profile_changes_no_numerics(tmp_path):
    *_, profiled = profiled_run(tmp_path, steps=3, profile_warmup_steps=0, profile_steps=2)
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=2), device=CPU, log=None):
        plain = train(layers, trainable, CPU, "nonreentrant", steps=3, accumulate=1)
    assert_bitwise_equal(plain, profiled)


def test_a_run_shorter_than_the_profile_writes_what_it_has(tmp_path):
    trace, per_step, uses, _, _ = profiled_run(tmp_path, steps=3, profile_warmup_steps=1, profile_steps=5)
    assert trace["otherData"]["steps"] == [2, 3]
    assert any("ended after 2 of 5" in note for note in trace["otherData"]["notes"])


def test_without_matplotlib_only_the_json_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    trace, _, _, lines, _ = profiled_run(tmp_path, steps=2, profile_warmup_steps=0, profile_steps=1)
    assert trace is not None and not (tmp_path / "trace.png").exists()
    assert any("pip install matplotlib" in x for x in lines)


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_demo_cli_profile_and_verbose(tmp_path):
    config = (ROOT / "toml" / "demo.toml").read_text()
    config = config.replace('output_dir = "output/demo"', f'output_dir = "{tmp_path}"').replace(
        "steps = 30", "steps = 5"
    )
    (tmp_path / "demo.toml").write_text(config)
    trace_path = tmp_path / "prof" / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "dgls_train.py"), "--config", str(tmp_path / "demo.toml")]
        + ["--profile", str(trace_path), "--verbose", "--verbose_every", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"DGLS profile: steps 3-5 written to {trace_path}" in out
    assert "DGLS steps 1-2: median" in out and "ETA" in out
    assert re.search(r"DGLS memory: .*pinned", out)  # on CUDA the line starts with VRAM
    assert "DGLS steps 5-5: median" in out  # the partial window at the end
    trace = json.loads(trace_path.read_text())
    assert trace["otherData"]["steps"] == [3, 4, 5] and len(spans(trace, "step")) == 3
    assert {"compute", "copy"} <= lanes(trace).keys()
    for step in (3, 4, 5):  # the demo streams its 8 blocks: each is used in forward and backward
        streamed = {e["args"]["layer"] for e in spans(trace, "compute", step) if e["args"]["streamed"]}
        assert streamed == set(range(1, 9))
        assert spans(trace, "copy", step)
    assert (trace_path.with_suffix(".png")).exists() == HAS_MATPLOTLIB


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [1, 2])
def test_cuda_profile_has_copies_waits_and_every_use(tmp_path, streams):
    device = torch.device("cuda", torch.cuda.current_device())
    trace, per_step, uses, _, _ = profiled_run(
        tmp_path,
        device=device,
        dtype=torch.bfloat16,
        profile_warmup_steps=1,
        profile_steps=2,
        cuda_streams=streams,
        prefetch=1,
    )
    check_complete(trace, per_step, uses, warmup=1, steps=2)
    assert trace["otherData"]["clock"] == "cuda events"
    copies = spans(trace, "copy")
    assert copies and all(e["dur"] > 0 and e["args"]["bytes"] > 0 for e in copies)
    assert {e["tid"] for e in copies} == {lanes(trace)["copy" if streams == 1 else f"copy {k}"] for k in range(streams)}
    waits = spans(trace, "wait")
    assert len(waits) == sum(s.fetches for s in per_step[1:3])  # one wait per fetch the compute stream waited on
    step_ms = [trace["otherData"]["summary"][str(s)]["ms"] for s in (2, 3)]
    assert all(ms > 0 for ms in step_ms)
    assert (tmp_path / "trace.png").exists() == HAS_MATPLOTLIB
    # the host lane: one span per use, the host reaching it no later than the device (within the clocks' agreement)
    host = spans(trace, "host")
    assert len(host) == len(spans(trace, "compute")) and lanes(trace)["host"] == 4
    for step in ("2", "3"):
        row = trace["otherData"]["summary"][step]
        assert row["host_lead_ms_min"] > -1.0 and row["host_lead_ms_median"] >= row["host_lead_ms_min"]


def test_profile_shows_every_direction_through_the_transport(tmp_path):
    """Activation offload's copies out and back reach the profile through the transport's one event per copy,
    a lane each, with the bytes the stats count."""
    layers, trainable = make_layers()
    config = SwapConfig.of(
        prefetch=1,
        offload_activations=True,
        profile=str(tmp_path / "trace.json"),
        profile_warmup_steps=1,
        profile_steps=2,
    )
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        recorder = Recorder(swapper)
        swapper.add_listener(recorder)
        ckpt = swapper.checkpoint_function(checkpoint_for("nonreentrant"))
        train(layers, trainable, CPU, "nonreentrant", steps=3, accumulate=1, checkpoint_fn=ckpt, eval_between=False)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {"activations out", "activations in"} <= lanes(trace).keys()
    for step in (2, 3):
        sent = [e for e in spans(trace, "transfer", step) if e["args"]["direction"] == "activations out"]
        assert sent and sum(e["args"]["bytes"] for e in sent) == recorder.per_step[step - 1].activation_bytes > 0


def full_with_offload(**observe) -> SwapConfig:
    """Full fine-tuning with AdamW on the device and activation offload: every direction moves bytes."""
    return SwapConfig.of(
        host_optimizer=dataclasses.replace(SPEC, implementation="device"),
        accumulation_steps=1,
        prefetch=1,
        offload_activations=True,
        **observe,
    )


def test_profile_of_a_full_fine_tune_with_offload_shows_every_direction(tmp_path):
    """Full fine-tuning with AdamW on the device and activation offload: gradients home, activations out and in,
    optimizer state in and out each get a lane of their own, from the one event the transport sends per copy."""
    layers = full_layers()
    config = full_with_offload(profile=str(tmp_path / "trace.json"), profile_warmup_steps=0, profile_steps=2)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        ckpt = swapper.checkpoint_function(checkpoint_for("nonreentrant"))
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=2, accumulate=1, checkpoint_fn=ckpt)
    trace = json.loads((tmp_path / "trace.json").read_text())
    others = {d.value for d in Direction if d not in (Direction.WEIGHTS_IN, *ON_DISK)}  # no disk tier here
    assert others <= lanes(trace).keys()
    assert {e["args"]["direction"] for e in spans(trace, "transfer") if e["args"]["bytes"] > 0} == others


class Directions(Listener):
    """The directions the transport reported copies of."""

    def __init__(self):
        self.seen = set()

    def copied(self, copy):
        self.seen.add(copy.direction)


def test_a_torch_profiler_trace_shows_every_direction_and_the_weight_states():
    """A torch.profiler trace of a full fine-tune step with activation offload and device updates (CPU backend)
    holds a ``DGLS <direction>`` range for every direction the transport moved bytes in, one per host optimizer
    job, and a range for each residency transition of the streamed layers (fetch, acquire, release, evict), named
    with the state."""
    layers = full_layers()
    config = full_with_offload()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        directions = Directions()
        swapper.add_listener(directions)
        ckpt = swapper.checkpoint_function(checkpoint_for("nonreentrant"))
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1, checkpoint_fn=ckpt)  # warm-up
        directions.seen.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1, checkpoint_fn=ckpt, start_step=1)
        streamed = swapper.streamed_layers
    names = {event.name for event in profile.events()}
    every = set(Direction) - set(ON_DISK)  # no layer on disk here
    assert directions.seen == every, "a full fine-tune step with offload and device updates uses all"
    for direction in directions.seen:
        assert f"DGLS {direction.value}" in names, direction
    assert "DGLS host optimizer job" in names  # the job worker's items (run deferred on the CPU)
    for transition, state in [("fetch", "fetching"), ("acquire", "in use"), ("release", "released"), ("evict", "host")]:
        assert {f"DGLS layer {i} {transition}: {state}" for i in streamed} <= names, transition


@pytest.mark.gpu
def test_a_cuda_torch_profiler_trace_shows_weight_copies_and_states():
    """CUDA (no worker threads): the weights-in enqueues and the residency transitions are ranges of the trace,
    beside the copy kernels. Ranges on DGLS's own worker threads show only where the profiler records them."""
    dev = torch.device("cuda", torch.cuda.current_device())
    layers, trainable = make_layers(torch.bfloat16)
    with LayerSwapper(layers, SwapConfig.of(prefetch=1, threading=False), device=dev, log=None) as swapper:
        train(layers, trainable, dev, "nonreentrant", steps=1, dtype=torch.bfloat16)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            train(layers, trainable, dev, "nonreentrant", steps=1, dtype=torch.bfloat16)
        streamed = swapper.streamed_layers
    names = {event.name for event in profile.events()}
    assert "DGLS weights in" in names
    assert streamed and all(f"DGLS layer {i} acquire: in use" in names for i in streamed)


def test_disk_io_on_cuda_is_placed_on_the_trace_by_its_host_span(tmp_path):
    """Disk reads and writes have no CUDA event: on CUDA the trace places their perf_counter span through the
    clock pair taken at start-up (before, they were left out of the trace there)."""
    profiler = Profiler(tmp_path / "p.json", "cpu", log=None)
    profiler.cuda, profiler._host_origin = True, 100.0  # as on CUDA (the pair's host stamp)
    read = Copy(direction=Direction.DISK_IN, nbytes=4096, span=(100.5, 100.75))
    assert profiler._transfer_us(read) == (500_000.0, 750_000.0)
    write = Copy(direction=Direction.DISK_OUT, nbytes=4096, span=(101.0, 101.5))
    assert profiler._transfer_us(write) == (1_000_000.0, 1_500_000.0)
    assert profiler._transfer_us(Copy(direction=Direction.DISK_IN)) == (None, None)  # not run yet
    assert profiler._transfer_us(Copy(direction=Direction.GRADS_HOME)) == (None, None)  # not timed
