"""Profiler: a timeline of layer copies, layer compute and the waits between them, for a few steps.

Step stats say *how much* compute waited; the timeline says *where*: which layer's copy was
late, and what ran while it copied. As a listener of the engine it gets each layer use (marked
on the compute stream with a CUDA event, like the planner's UseRecorder), each copy (its token's
start/ready events; it ends after the fp8 upcast where there is one), each wait (the events
around the compute stream's wait), each copy of the other directions (the transport's ``copied`` event:
gradients home, activations out and in, optimizer state in and out, a lane each) and each end of a
backward pass (a "step"). Only steps
``warmup_steps + 1 .. warmup_steps + steps`` are kept; then the events are resolved (one
device synchronize, after the step has been read anyway) and written as a Chrome trace, plus
a PNG timeline when matplotlib is installed. Work that runs after the last kept pass, before the next
(the optimizer step of a clipped full fine-tune: its updates, and their disk reads and write-backs) falls
outside the window: profile one pass more to see it. Recording events never touches tensors, so a
profiled run computes exactly what an unprofiled one does; without ``--profile`` there is no
profiler at all.

On CPU there are no streams: a copy is a memcpy done when its layer is acquired (or on the copier
thread), timed with ``perf_counter``, and no waits exist.

Disk reads and writes (the disk tier) are host work on the reader's thread, with no stream and no CUDA event: on
CUDA they are timed with ``perf_counter`` too (``Copy.span``), and placed on the trace's clock through one pair
of stamps taken together at start-up (the device synchronized, then a CUDA event and ``perf_counter``): the two
clocks agree to well under a millisecond over a few steps.

Waits for activation restores (offload_activations) are on the waits lane beside the weights' (the transport's
``acquired`` event for their direction). On CUDA a "host" lane shows when the host reached each use, on the
device's clock (the same pair of stamps): the device reaching a use long after the host did means the host is
ahead; the two together (``host_lead_ms`` near 0 in the step summary) mean the device waited for the host to issue
work, time no copy wait shows.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import say
from ..memory.copier import Token, Wait
from ..memory.transport import ON_DISK, Copy, Direction
from ..streaming.feature import Engine, Feature
from ..streaming.schedule import Phase
from .listener import Listener
from .stats import elapsed_ms, timestamp

PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.NO_GRAD: "forward (no grad)"}
LANES = {"steps": 1, "compute": 2, "waits": 3, "host": 4}
COPY_LANE = 10  # copy stream k is lane COPY_LANE + k
# the other directions' streams, a lane each (weights are drawn per copy stream, with their layer)
TRANSFER_LANES = {d: 30 + k for k, d in enumerate(d for d in Direction if d is not Direction.WEIGHTS_IN)}


@dataclass
class _Use:
    layer: int
    phase: Phase
    streamed: bool
    step: int
    at: Any  # a CUDA event or a perf_counter() value
    host: float  # perf_counter() when the host reached the use (CUDA: the device reaches it later)


@dataclass
class _Copy:
    layer: int
    step: int
    nbytes: int
    demand: bool
    stream: int
    start: Any
    end: Any


@dataclass
class _Wait:
    layer: int  # -1: a wait for another direction than weights (``direction``)
    step: int
    start: Any
    end: Any
    direction: Direction = Direction.WEIGHTS_IN


def png_path(path: Path) -> Path:
    return path.with_suffix(".png") if path.suffix == ".json" else path.with_name(path.name + ".png")


class Profiler(Listener, Feature):
    """Records steps ``warmup_steps + 1 .. warmup_steps + steps`` (1-based), then writes ``path``."""

    def __init__(
        self,
        path: str | Path,
        device: torch.device | str,
        warmup_steps: int = 2,
        steps: int = 3,
        copy_streams: int = 1,
        log=say,
    ) -> None:
        self.path = Path(path)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup_steps = warmup_steps
        self.steps = steps
        self.copy_streams = copy_streams
        self.log = log or (lambda *_: None)
        self.steps_done = 0
        self.done = False
        self.notes: list[str] = []
        self._stamp_clocks()
        self._uses: list[_Use] = []
        self._copies: list[_Copy] = []
        self._waits: list[_Wait] = []
        self._transfers: list[tuple[Copy, int]] = []  # copies of the other directions, with their step
        self._boundaries: list[Any] = []  # start of the first recorded step, then the end of each
        self.installed = False  # an engine that failed to start closes its profiler unheard: nothing to say
        self._mark_boundary()

    def install(self, engine: Engine) -> None:
        """A feature of the engine (--profile): it listens to the engine and the transport."""
        engine.add_listener(self)
        self.installed = True

    def record_after(self, passes: int, steps: int) -> None:
        """Record the ``steps`` passes that follow the next ``passes`` ones, counted from now, in place of the window
        given at construction (which must not have begun): for a caller that knows where its steady steps start
        only once it got there (a benchmark, after the VRAM planner settled). Call it between passes."""
        if self._boundaries or self.done:
            raise RuntimeError("the profiler's window began already: construct it with a later one")
        self.warmup_steps, self.steps = self.steps_done + passes, steps
        self._stamp_clocks()  # the pair taken at construction may be minutes old: the two clocks drift apart
        self._mark_boundary()  # the window's start when it starts now

    def _stamp_clocks(self) -> None:
        """The trace's origin on the device's clock and the host's, taken together (the host lane, disk I/O)."""
        if self.cuda:  # idle, so the event below is stamped as it is recorded
            torch.cuda.synchronize(self.device)
        self._origin = timestamp(self.device)
        self._host_origin = time.perf_counter()

    # ---------------------------------------------------------------- recording (called by the swapper)
    @property
    def recording(self) -> bool:
        return not self.done and self.warmup_steps <= self.steps_done < self.warmup_steps + self.steps

    def _mark_boundary(self) -> None:
        if self.warmup_steps <= self.steps_done <= self.warmup_steps + self.steps:
            self._boundaries.append(timestamp(self.device))

    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        if self.recording:
            stamp = timestamp(self.device)
            self._uses.append(_Use(layer, phase, streamed, self.steps_done + 1, stamp, time.perf_counter()))

    def waited(self, wait: Wait) -> None:
        if self.recording:
            self._waits.append(_Wait(wait.token.layer, self.steps_done + 1, wait.before, wait.after))

    def acquired(self, copy: Copy, before, after) -> None:
        """A wait of the compute stream for another direction than weights (an activation restore)."""
        if self.recording and copy.direction is not Direction.WEIGHTS_IN:
            self._waits.append(_Wait(-1, self.steps_done + 1, before, after, copy.direction))

    def fetched(self, token: Token) -> None:
        """A copy the current use acquired (reported once, as the step stats count it)."""
        if not self.recording:
            return
        fetch = token
        start, end = (fetch.start, fetch.ready) if self.cuda else (fetch.span or (None, None))
        if start is None:
            note = "copy timing is off (collect_timing=False): no copy or wait events"
            if note not in self.notes:
                self.notes.append(note)
            return
        step = self.steps_done + 1
        self._copies.append(_Copy(fetch.layer, step, fetch.nbytes, fetch.demand, fetch.lane, start, end))

    def copied(self, copy: Copy) -> None:
        """A copy of another direction than weights in (those come with their layer through :meth:`fetched`);
        its timing is read when the trace is written (a CPU copy lands when it is waited for)."""
        if self.recording and copy.direction is not Direction.WEIGHTS_IN:
            self._transfers.append((copy, self.steps_done + 1))

    def pass_ended(self) -> None:
        if self.done:
            return
        self.steps_done += 1
        self._mark_boundary()
        if self.steps_done == self.warmup_steps + self.steps:
            self.write()

    def close(self) -> None:
        """At the end of a run: write what was recorded if the run ended before the last profiled step."""
        if not self.installed:
            self.done = True
            return
        if not self.done and len(self._boundaries) > 1:
            self.notes.append(f"the run ended after {len(self._boundaries) - 1} of {self.steps} profiled steps")
            self.write()
        elif not self.done:
            self.log(
                f"DGLS profile: nothing written to {self.path}: the run ended after {self.steps_done} steps, before "
                f"the first profiled one ({self.warmup_steps + 1}); profile a longer run"
            )
        self.done = True

    # ---------------------------------------------------------------- output
    def _us(self, stamp) -> float:
        return elapsed_ms(self._origin, stamp) * 1000.0

    def _transfer_us(self, copy: Copy) -> tuple[float | None, float | None]:
        """A transfer's start and end on the trace's clock: its CUDA events, or its host span (the CPU; disk I/O,
        whose host clock is placed on the device's by the pair taken at start-up)."""
        if self.cuda and copy.direction not in ON_DISK:
            return (None, None) if copy.start is None else (self._us(copy.start), self._us(copy.ready))
        if copy.span is None:
            return None, None
        if self.cuda:
            return tuple((t - self._host_origin) * 1e6 for t in copy.span)
        return self._us(copy.span[0]), self._us(copy.span[1])

    def trace(self) -> dict:
        """The Chrome-trace dict (``traceEvents``, ``X`` events in µs); resolves the events."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        bounds = [self._us(b) for b in self._boundaries]
        recorded = list(range(self.warmup_steps + 1, self.warmup_steps + len(bounds)))
        events: list[dict] = []

        def add(name: str, cat: str, lane: int, start: float, end: float, args: dict) -> None:
            span = {"ts": start, "dur": max(0.0, end - start)}
            events.append({"name": name, "cat": cat, "ph": "X", **span, "pid": 1, "tid": lane, "args": args})

        uses = [(u, self._us(u.at)) for u in self._uses]
        for k, (u, start) in enumerate(uses):
            step_end = bounds[u.step - self.warmup_steps] if u.step - self.warmup_steps < len(bounds) else start
            nxt = uses[k + 1] if k + 1 < len(uses) else None
            end = nxt[1] if nxt is not None and nxt[0].step == u.step else step_end
            args = {"layer": u.layer, "phase": PHASES[u.phase], "streamed": u.streamed, "step": u.step}
            add(f"layer {u.layer} {u.phase.value}", "compute", LANES["compute"], start, end, args)
        for w in self._waits:
            start, end = self._us(w.start), self._us(w.end)
            if w.direction is Direction.WEIGHTS_IN:
                add(f"wait layer {w.layer}", "wait", LANES["waits"], start, end, {"layer": w.layer, "step": w.step})
            else:
                args = {"direction": w.direction.value, "step": w.step}
                add(f"wait {w.direction.value}", "other wait", LANES["waits"], start, end, args)
        leads: dict[int, list[float]] = {}
        if self.cuda:  # the host's timeline on the device's clock: how far ahead of the device it issues the work
            for k, (u, start) in enumerate(uses):
                host = (u.host - self._host_origin) * 1e6
                nxt = uses[k + 1][0] if k + 1 < len(uses) else None
                end = (nxt.host - self._host_origin) * 1e6 if nxt is not None and nxt.step == u.step else host
                args = {"layer": u.layer, "phase": PHASES[u.phase], "step": u.step, "lead_ms": (start - host) / 1000}
                add(f"host at layer {u.layer} {u.phase.value}", "host", LANES["host"], host, end, args)
                leads.setdefault(u.step, []).append((start - host) / 1000)
        for c in self._copies:
            start, end = self._us(c.start), self._us(c.end)
            args = {"layer": c.layer, "bytes": c.nbytes, "demand": c.demand, "stream": c.stream, "step": c.step}
            args["GB/s"] = round(c.nbytes / (end - start) / 1e3, 2) if end > start else None
            add(f"copy layer {c.layer}", "copy", COPY_LANE + c.stream, start, end, args)
        used = set()
        for copy, step in self._transfers:
            start, end = self._transfer_us(copy)
            if start is None:  # CUDA: not timed; CPU or disk I/O: never ran
                continue
            args = {"direction": copy.direction.value, "bytes": copy.nbytes, "step": step}
            args["GB/s"] = round(copy.nbytes / (end - start) / 1e3, 2) if end > start else None
            add(copy.direction.value, "transfer", TRANSFER_LANES[copy.direction], start, end, args)
            used.add(copy.direction)
        summary = {}
        for i, step in enumerate(recorded):
            mine = [e for e in events if e["args"]["step"] == step]
            row = {
                "ms": round((bounds[i + 1] - bounds[i]) / 1000, 3),
                "uses": sum(e["cat"] == "compute" for e in mine),
                "streamed_uses": sum(e["cat"] == "compute" and e["args"]["streamed"] for e in mine),
                "copies": sum(e["cat"] == "copy" for e in mine),
                "bytes": sum(e["args"]["bytes"] for e in mine if e["cat"] == "copy"),
                "copy_ms": round(sum(e["dur"] for e in mine if e["cat"] == "copy") / 1000, 3),
                "wait_ms": round(sum(e["dur"] for e in mine if e["cat"] == "wait") / 1000, 3),
                "other_wait_ms": round(sum(e["dur"] for e in mine if e["cat"] == "other wait") / 1000, 3),
            }
            if leads.get(step):  # the device reached a use this long after the host did: near 0, the host was late
                row["host_lead_ms_min"] = round(min(leads[step]), 3)
                row["host_lead_ms_median"] = round(statistics.median(leads[step]), 3)
            summary[str(step)] = row
        for i, step in enumerate(recorded):
            add(f"step {step}", "step", LANES["steps"], bounds[i], bounds[i + 1], {"step": step, **summary[str(step)]})
        origin = min((e["ts"] for e in events), default=0.0)
        for e in events:
            e["ts"] = round(e["ts"] - origin, 3)
            e["dur"] = round(e["dur"], 3)
        events.sort(key=lambda e: (e["tid"], e["ts"]))
        lanes = {k: v for k, v in LANES.items() if k != "host" or self.cuda}
        lanes.update({self._copy_lane_name(k): COPY_LANE + k for k in range(self.copy_streams)})
        lanes.update({d.value: lane for d, lane in TRANSFER_LANES.items() if d in used})
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"DGLS on {self.device}"}}]
        for name, lane in lanes.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": lane, "args": {"name": name}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": lane, "args": {"sort_index": lane}})
        notes = list(self.notes)
        if not self.cuda:
            notes.append(
                "CPU: a copy is a memcpy done when its layer is acquired (or on the copier thread), timed with "
                "time.perf_counter; there are no waits"
            )
        other = {
            "tool": "DGLS profiler",
            "device": str(self.device),
            "clock": "cuda events" if self.cuda else "time.perf_counter",
            "warmup_steps": self.warmup_steps,
            "profile_steps": self.steps,
            "steps": recorded,
            "lanes": lanes,
            "summary": summary,
            "notes": notes,
        }
        return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}

    def _copy_lane_name(self, k: int) -> str:
        return "copy" if self.copy_streams == 1 else f"copy {k}"

    def write(self) -> None:
        """Write the JSON (and the PNG if matplotlib imports); print one line saying where."""
        self.done = True
        trace = self.trace()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(trace))
        steps = trace["otherData"]["steps"]
        span = f"{steps[0]}-{steps[-1]}" if steps else "none"
        png = png_path(self.path)
        try:
            draw_timeline(trace, png)
            where = f"timeline {png}"
        except ImportError:
            where = "pip install matplotlib for a PNG timeline"
        self.log(
            f"DGLS profile: steps {span} written to {self.path} (open in ui.perfetto.dev or chrome://tracing); {where}"
        )
        self._uses, self._copies, self._waits, self._boundaries, self._transfers = [], [], [], [], []


def draw_timeline(trace: dict, path: Path) -> None:
    """A PNG of the trace: one row per copy stream, compute (by phase; resident layers faded) and waits,
    layer numbers on bars wide enough to hold them, and the per-step summary under the title. Raises
    ImportError without matplotlib (an optional dependency)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    other = trace["otherData"]
    lanes = sorted(other["lanes"].items(), key=lambda kv: -kv[1])  # copies on top, steps at the bottom
    rows = {lane: y for y, (_, lane) in enumerate(lanes)}
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "forward (no grad)": "#8C8C8C"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    span = max((e["ts"] + e["dur"] for e in events), default=1.0) / 1000
    fig = Figure(figsize=(14, 1.8 + 0.5 * len(rows)))
    ax = fig.add_subplot()
    for e in events:
        y, start, width = rows[e["tid"]], e["ts"] / 1000, e["dur"] / 1000
        if e["cat"] == "compute":
            color, alpha = colors.get(e["args"]["phase"], "#8C8C8C"), 1.0 if e["args"]["streamed"] else 0.45
        elif e["cat"] == "copy":
            color, alpha = "#C44E52" if e["args"]["demand"] else "#55A868", 1.0
        elif e["cat"] in ("wait", "other wait"):
            color, alpha = "#D62728", 1.0
        elif e["cat"] == "host":
            color, alpha = "#8C8C8C", 0.6
        elif e["cat"] == "transfer":
            color, alpha = "#8172B3", 1.0
        else:
            color, alpha = "#DDDDDD", 1.0
            ax.axvline(start, color="#999999", linewidth=0.6, linestyle="--")
        edge = "white" if e["cat"] in ("compute", "step") else color  # narrow copies and waits stay visible
        ax.broken_barh([(start, width)], (y - 0.4, 0.8), facecolors=color, alpha=alpha, edgecolor=edge, lw=0.4)
        if e["cat"] == "step":
            ax.text(start + width / 2, y, e["name"], ha="center", va="center", fontsize=7)
        elif e["cat"] in ("compute", "copy") and width > span / 150:  # label bars wide enough for a number
            ax.text(start + width / 2, y, str(e["args"]["layer"]), ha="center", va="center", fontsize=5, color="white")
    ax.set_yticks(list(range(len(lanes))), [name for name, _ in lanes])
    ax.set_xlabel("ms")
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    steps = other["steps"]
    title = f"DGLS timeline on {other['device']}, steps {steps[0]}-{steps[-1]}" if steps else "DGLS timeline"
    ax.set_title(title + "\n" + summary_line(other["summary"]), fontsize=9)
    legend = [Patch(color=c, label=f"compute {p} (streamed layer)") for p, c in colors.items()]
    legend += [Patch(color=colors["forward"], alpha=0.45, label="faded: resident layer")]
    legend += [Patch(color="#55A868", label="copy (prefetch)"), Patch(color="#C44E52", label="copy (on demand)")]
    legend += [Patch(color="#D62728", label="compute waits on a copy (weights; activation restores)")]
    legend += [Patch(color="#8C8C8C", alpha=0.6, label="host reaches the use (CUDA)")]
    legend += [Patch(color="#8172B3", label="copy of another direction (gradients, activations, optimizer state)")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary_line(summary: dict) -> str:
    """The recorded steps together: time, copies, bytes, copy bandwidth, time compute waited."""
    rows = list(summary.values())
    if not rows:
        return "no steps recorded"
    ms = sum(r["ms"] for r in rows)
    copy_ms = sum(r["copy_ms"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    gbps = f"{nbytes / copy_ms / 1e6:.1f} GB/s" if copy_ms > 0 else "n/a"
    other = sum(r.get("other_wait_ms", 0.0) for r in rows)
    return (
        f"{len(rows)} steps, {ms / len(rows):.1f} ms per step; {sum(r['copies'] for r in rows)} copies, "
        f"{nbytes / 2**30:.2f} GiB at {gbps}; compute waited {sum(r['wait_ms'] for r in rows):.1f} ms in total"
        + (f" (+{other:.1f} ms for activation restores)" if other else "")
    )
