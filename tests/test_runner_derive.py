"""benchmarks/runner.py's ``derive`` on rows measured on a GPU (a copy bandwidth known): an A/B run has no
all-resident row of its own, so its floors use the resident steps of its own rounds (the device run of
``bench_engines.py --cases=flux_ab_spread20`` once failed there with a None); and benchmarks/blocking.py's
summary of where a step's host waited."""

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import runner  # noqa: E402


def test_an_ab_run_without_a_resident_row_gets_its_floors_from_its_own_resident_steps():
    row = {"kind": "ab", "median_step_s": 1.0, "ab_resident_s": 0.8, "bytes_per_step": 40e9, "streamed_gib": 20.0}
    result = {"rows": [row], "pinned_h2d_gbps": 50.0}
    runner.derive(result)
    assert row["vs_resident"] == 1.0 / 0.8
    assert row["floor_s"] == 0.8  # 40 GB at 50 GB/s is 0.8 s too
    assert row["floor_2x_s"] > 0.8  # 2 x 20 GiB is more than 40 GB


def test_rows_with_a_resident_row_keep_it_as_their_floor():
    rows = [{"kind": "resident", "median_step_s": 0.5}, {"kind": "dgls", "median_step_s": 0.6, "bytes_per_step": 1e9}]
    runner.derive({"rows": rows, "pinned_h2d_gbps": 50.0})
    assert rows[1]["floor_s"] == 0.5 and rows[1]["vs_resident"] == 0.6 / 0.5


def test_blocking_calls_sum_the_slow_runtime_calls_by_the_frames_that_made_them():
    """benchmarks/blocking.py: a runtime call's slow calls go to the innermost frame of this repository open at
    their start (and the innermost of any file, when another); fast calls count but name no site; names under
    MIN_MS in total are left out."""
    import blocking

    def frame(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def call(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid}

    ours, inner = "/r/utils/dgls/memory/transport.py(440): land", "torch/cuda/streams.py(9): synchronize"
    events = [
        frame("/r/benchmarks/models.py(150): step", 0, 10_000),
        frame(ours, 100, 3_000),
        frame(inner, 150, 2_900),
        call("cudaEventSynchronize", 200, 2_500),
        frame("/r/benchmarks/flux.py(80): forward", 4_000, 3_000),
        call("cudaEventSynchronize", 5_000, 1_000),
        call("cudaLaunchKernel", 5_100, 5),
        call("cudaEventSynchronize", 9_000, 500, tid=2),  # another thread: no frame of its own
    ]
    report = blocking.summarize(events)
    assert list(report) == ["cudaEventSynchronize"]  # the launch's 5 us are under MIN_MS
    row = report["cudaEventSynchronize"]
    assert (row["calls"], row["ms"], row["slow_calls"]) == (3, 4.0, 3)
    assert row["sites"] == {f"{ours} > {inner}": 2.5, "/r/benchmarks/flux.py(80): forward": 1.0, "?": 0.5}


def test_stream_gaps_are_the_busiest_streams_time_between_its_kernels():
    import blocking

    def kernel(ts, dur, stream=7):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "tid": stream}

    events = [kernel(0, 100), kernel(100, 50), kernel(300, 100), kernel(1000, 10), kernel(0, 20, stream=8)]
    gaps = blocking.stream_gaps(events)
    assert gaps == {"span_ms": 1.01, "busy_ms": 0.26, "gap_ms": 0.75, "kernels": 4, "gaps_of_100us_or_more": 2}
    assert blocking.stream_gaps([]) == {}
