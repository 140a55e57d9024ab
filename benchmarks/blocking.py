"""Where a step's host waits: the CUDA runtime calls that took the host's time, and the Python code that made them.

Why: a profile whose host lane reaches each layer just as the device does (``host_lead_ms`` near 0) says the device
waited for the host, or the host for the device, but not which call made it wait. Run one step under
``torch.profiler`` with Python stacks, and for each CUDA runtime call name whose calls took at least
:data:`MIN_MS` of the host's time in total (a synchronize, a pageable copy, a host registration, an allocator
``cudaFree``...), sum its calls, and the time of its slow calls by the innermost frame of this repository that
made them (and the innermost frame of any file, torch's included, when that is another).

:func:`device_gaps` runs one more step with the device's activity only and says how much of it the busiest stream
spent between kernels: time it waited for the host to issue work (or on an event).

The step of :func:`blocking_calls` runs under the profiler's Python tracer, several times slower on the host than a
timed step: it measures where the host blocks and how often, not how long a step takes. CUDA only; nothing on the
CPU.
"""

from __future__ import annotations

import bisect
import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

MIN_MS = 1.0  # runtime calls whose total host time is below this are not reported
SLOW_MS = 0.1  # a call at least this long is one the host waited in (a kernel launch takes microseconds)
SITES = 4  # call sites kept per runtime call name, most time first
LONG_GAP_US = 100.0  # a gap between two kernels of the stream this long is counted apart
OURS = ("utils/dgls/", "benchmarks/")  # frames named after files under these are this repository's


def blocking_calls(step: Callable[[], object], device: torch.device) -> dict:
    """Run ``step`` once under the profiler; per CUDA runtime call name with at least :data:`MIN_MS` of host time:
    ``{"calls", "ms", "slow_calls", "sites": {frame: ms of its slow calls}}``, most time first. ``{}`` on the CPU."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        step()
        torch.cuda.synchronize(device)
    return summarize(_events(prof))


def device_gaps(step: Callable[[], object], device: torch.device) -> dict:
    """Run ``step`` once under the profiler without Python stacks (the host near its usual speed): on the stream
    that ran the most kernel time, the span from its first kernel to its last, the time kernels ran, and the gaps
    between them (time the stream waited: for the host to issue work, or on an event). ``{}`` on the CPU."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return stream_gaps(_events(prof))


def stream_gaps(events: list[dict]) -> dict:
    """The report of :func:`device_gaps` from a chrome trace's events (``kernel``)."""
    streams: dict[object, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            streams[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0)))
    if not streams:
        return {}
    spans = sorted(max(streams.values(), key=lambda s: sum(end - start for start, end in s)))
    busy = gaps = 0.0
    long_gaps, reach = 0, spans[0][0]
    for start, end in spans:
        gap = start - reach
        if gap > 0:
            gaps += gap
            long_gaps += gap >= LONG_GAP_US
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    ms = 1000.0
    return {
        "span_ms": round((reach - spans[0][0]) / ms, 2),
        "busy_ms": round(busy / ms, 2),
        "gap_ms": round(gaps / ms, 2),
        "kernels": len(spans),
        "gaps_of_100us_or_more": long_gaps,
    }


def _events(prof: torch.profiler.profile) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def summarize(events: list[dict]) -> dict:
    """The report of :func:`blocking_calls` from a chrome trace's events (``cuda_runtime`` and ``python_function``)."""
    ours: dict[object, list[tuple[float, float, str]]] = defaultdict(list)  # per thread: this repository's frames
    every: dict[object, list[tuple[float, float, str]]] = defaultdict(list)  # and all (torch's too)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function":
            span = (e["ts"], e["ts"] + e.get("dur", 0), e.get("name", ""))
            every[e.get("tid")].append(span)
            if any(o in span[2] for o in OURS):
                ours[e.get("tid")].append(span)
    for spans in (*ours.values(), *every.values()):
        spans.sort()
    totals: dict[str, dict] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "cuda_runtime":
            continue
        row = totals.setdefault(e["name"], {"calls": 0, "ms": 0.0, "slow_calls": 0, "sites": defaultdict(float)})
        ms = e.get("dur", 0) / 1000
        row["calls"] += 1
        row["ms"] += ms
        if ms >= SLOW_MS:
            row["slow_calls"] += 1
            site = _innermost(ours.get(e.get("tid"), []), e["ts"]) or "?"
            inner = _innermost(every.get(e.get("tid"), []), e["ts"])
            row["sites"][site if inner in (None, site) else f"{site} > {inner}"] += ms
    report = {}
    for name, row in sorted(totals.items(), key=lambda kv: -kv[1]["ms"]):
        if row["ms"] < MIN_MS:
            continue
        sites = {k: round(v, 2) for k, v in sorted(row["sites"].items(), key=lambda kv: -kv[1])[:SITES]}
        report[name] = {"calls": row["calls"], "ms": round(row["ms"], 2), "slow_calls": row["slow_calls"]}
        report[name]["sites"] = sites
    return report


def _innermost(frames: list[tuple[float, float, str]], ts: float) -> str | None:
    """The latest-starting of ``frames`` open at ``ts`` (``frames``: one thread's, sorted; they nest)."""
    i = bisect.bisect_right(frames, (ts, float("inf"), ""))
    while i > 0:
        i -= 1
        start, end, name = frames[i]
        if end >= ts:
            return name
    return None
