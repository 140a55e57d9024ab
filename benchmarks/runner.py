"""The model benchmark's run: the methods of methods.py on one model, in one process, in order.

The run has one deadline: no case starts past it (its row says so), and a timed loop running when
it passes stops at 3 steps. A failing case or method is recorded as a row, and the run goes on.
Results are written after every row, so a run cut short still leaves its figures.
"""

from __future__ import annotations

import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import closing
from functools import partial
from pathlib import Path

import torch
from baselines import dp_checkout
from machine import environment, pinned_bandwidth, release_host_cache
from methods import METHODS, NOTES, Case, Methods, Options
from models import LORA_RANK, Bench, place
from report import write_result
from timing import Deadline
from units import GiB, MiB


def describe(result: dict) -> str:
    """What one step of a model result computes, on what, and how the model was built."""
    text = (
        f"{result['shape']}; batch 1, LoRA r{result['lora_rank']} on the blocks' Linear layers, non-reentrant "
        f"checkpointing per block; pinned host-to-device {result['pinned_h2d_gbps']:.1f} GB/s; random weights built "
        f"in {result['model_build_s']:.0f} s. {result['layers']} layers ({result['blocks']} blocks, "
        f"{result['total_frozen_gib']:.1f} GiB frozen; layer sizes {min(result['layer_mib']):.1f} to "
        f"{max(result['layer_mib']):.1f} MiB)."
    )
    return text + (" TINY config (smoke test): the figures mean nothing." if result["tiny"] else "")


def derive(result: dict) -> None:
    """Ratios, copy shares and floors of every timed row, from the figures measured in the run."""
    rows, bandwidth = result["rows"], result["pinned_h2d_gbps"]
    resident = next((r["median_step_s"] for r in rows if r["kind"] == "resident" and "median_step_s" in r), None)
    for r in rows:
        if bandwidth and r.get("copy_gbps") is not None:
            r["copy_share_of_pinned"] = r["copy_gbps"] / bandwidth
        # A/B rows: the resident steps of their own rounds; accumulation rows: all-resident with their micro-batches
        reference = r.get("ab_resident_s", r.get("reference_s", resident))
        if not reference or "median_step_s" not in r:
            continue
        r["vs_resident"] = r["median_step_s"] / reference
        if bandwidth and r.get("bytes_per_step") is not None:
            # what was really copied host-to-device (layers kept across a turnaround are copied once) ...
            r["floor_s"] = max(reference, r["bytes_per_step"] / bandwidth / 1e9)
            r["vs_floor"] = r["median_step_s"] / r["floor_s"]
        if bandwidth and r.get("streamed_gib") is not None:
            # ... and every streamed byte twice a step
            r["floor_2x_s"] = max(reference, 2 * r["streamed_gib"] * GiB / bandwidth / 1e9)
            r["vs_floor_2x"] = r["median_step_s"] / r["floor_2x_s"]


class Runner:
    """Runs the methods of ``options`` on ``bench`` and writes ``<out>/<bench.name>.json/.md/.png``."""

    def __init__(
        self,
        bench: Bench,
        options: Options,
        device: torch.device,
        dtype: torch.dtype,
        out: Path,
        deadline: Deadline,
        command: str,
        build_s: float,
    ) -> None:
        self.bench, self.options, self.device = bench, options, device
        self.out, self.deadline = out, deadline
        self.started = time.perf_counter() - build_s  # elapsed_s counts the build
        self.rows: list[dict] = []
        checkout = dp_checkout()
        self.result = {
            "benchmark": "models",
            "model": bench.model,
            "title": bench.title,
            "description": "",
            "command": command,
            "environment": environment(device),
            "tiny": options.tiny,
            "notes": [],
            "shape": bench.shape,
            "config": bench.config,
            "dtype": str(dtype),
            "lora_rank": LORA_RANK,
            "checkpointing": "non-reentrant, per block",
            "pinned_h2d_gbps": 0.0,
            "model_build_s": build_s,
            "layers": len(bench.layers),
            "blocks": len(bench.blocks),
            "layer_mib": [round((s.streamable_bytes + s.fixed_bytes) / MiB, 3) for s in bench.sizes],
            "total_frozen_gib": sum(s.streamable_bytes for s in bench.sizes) / GiB,
            "steps": options.steps,
            "warmup": options.warmup,
            "prefetch": options.prefetch,
            "methods": list(options.methods),
            "diffusion_pipe": str(checkout) if checkout else None,
            "rows": self.rows,
        }

    # -------------------------------------------------------- the run
    def run(self) -> dict:
        self.result["pinned_h2d_gbps"] = pinned_bandwidth(self.device)
        self.result["description"] = describe(self.result)
        self.result["notes"] = [NOTES["floors"]] + [
            NOTES[k] for k in METHODS if k in self.options.methods and k in NOTES
        ]
        place(self.bench.layers, self.device)
        methods = Methods(self.bench, self.options, self.device, self.deadline)
        for kind, label in METHODS.items():
            if kind in self.options.methods:
                self.attempt(kind, label, self.run_cases, partial(methods.cases, kind))
        self.write(plot=True)
        return self.result

    def run_cases(self, cases: Callable[[], Iterator[Case]]) -> None:
        with closing(cases()) as generator:
            for case in generator:
                if case.skipped or self.deadline.passed():
                    reason = case.skipped or "out of time (--deadline_s)"
                    self.record({"kind": case.kind, "method": case.method, "skipped": reason})
                else:
                    self.attempt(case.kind, case.method, self.measure, case)

    def measure(self, case: Case) -> None:
        """Run a case and record its row. A case returns its own peaks: taken before its teardown, which
        may put every weight back on the device."""
        times, extra = case.measure()
        row = {
            "kind": case.kind,
            "method": case.method,
            "median_step_s": statistics.median(times),
            "steps": len(times),
            "step_times_s": [round(t, 5) for t in times],
            **extra,
        }
        self.record(row)

    def attempt(self, kind: str, method: str, fn: Callable, *args) -> None:
        """``fn(*args)``; an error is recorded as a row of ``kind``/``method`` (and re-raised with strict)."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - unattended: keep going with the other methods
            if self.options.strict:
                raise
            traceback.print_exc()
            self.record({"kind": kind, "method": method, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            release_host_cache()

    def record(self, row: dict) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.write(plot=False)  # the plot comes at the end

    def write(self, plot: bool) -> None:
        self.result["elapsed_s"] = time.perf_counter() - self.started
        derive(self.result)
        write_result(self.result, self.bench.name, self.out, plot_it=plot, echo=plot)
