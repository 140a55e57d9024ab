"""The engine's host time per step, and what it costs a launch-bound step, for this engine and an older one.

Flux-dev size at 512x512 by default (1024 image tokens: little compute per layer, so host work shows),
LoRA, checkpointing per block, the same "spread" placement for every engine (~``--gib`` streamed).
Arms alternate in rounds so that drift cancels: all-resident (no swapper), DGLS (this checkout), and,
with ``--old DIR``, the engine in DIR (a copy of an older ``utils/dgls``, loaded under another package
name). Host time is the wall time spent inside the engine's hook entry points (forward pre/post hooks,
output-gradient hooks, saved-tensor pack/unpack, end-of-backward callback), per step.

    python3 benchmarks/bench_host.py [--side 32] [--gib 9.6] [--old .old/dgls] [--rounds 2] [--tiny]

Writes benchmarks/results/<name>.json and .md (default name host; results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
import machine  # noqa: E402
from models import Bench, place  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402
from timing import time_steps  # noqa: E402
from units import GiB  # noqa: E402

import utils.dgls  # noqa: E402
from utils.dgls.streaming.hooks import HookAdapter  # noqa: E402

# The hook entry points of each engine, the same names in both: every host call DGLS makes during a step starts
# in one of them. Not ``_pack_over``/``_unpack_over`` (DGLS's hooks stacked on a checkpoint's): they call the
# checkpoint's own hooks, and an unpack there runs torch's recompute, whose time is not DGLS's.
HOOK_ENTRY_POINTS = ("_pre_forward", "_post_forward", "_on_output_grad", "_pack", "_unpack")
ENTRY_POINTS = {"current": (HookAdapter, HOOK_ENTRY_POINTS), "old": (None, HOOK_ENTRY_POINTS)}


class HostTimer:
    """Seconds spent inside wrapped methods (outermost calls only), in total and per entry point, and the
    seconds Python's garbage collector ran meanwhile (a pause inside a hook counts as the hook's time: an
    engine that makes more objects per step pays it there)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.by_entry: dict[str, float] = defaultdict(float)
        self.gc_seconds = 0.0
        self._depth = 0
        self._gc_started: float | None = None

    def reset(self) -> None:
        self.seconds, self.calls, self.gc_seconds = 0.0, 0, 0.0
        self.by_entry.clear()

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    took = time.perf_counter() - start
                    self.seconds += took
                    self.by_entry[name] += took
                    self.calls += 1

        return timed

    def gc_callback(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` entry: time every collection (inside the hooks or not)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_seconds += time.perf_counter() - self._gc_started
            self._gc_started = None


@contextmanager
def timed_entry_points(cls, names, timer: HostTimer):
    saved = {name: cls.__dict__[name] for name in names if name in cls.__dict__}
    for name, fn in saved.items():
        setattr(cls, name, timer.wrap(fn, name))
    gc.callbacks.append(timer.gc_callback)
    try:
        yield
    finally:
        gc.callbacks.remove(timer.gc_callback)
        for name, fn in saved.items():
            setattr(cls, name, fn)


def load_engine(folder: Path):
    """An engine package from ``folder`` (a ``utils/dgls`` copy) under the name ``dgls_old``."""
    spec = importlib.util.spec_from_file_location(
        "dgls_old", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["dgls_old"] = module
    spec.loader.exec_module(module)
    return module


def run_arm(bench: Bench, device, engine, resident: list[int], prefetch: int, steps: int, warmup: int, kind: str):
    """Step times and, per timed step, the host seconds in DGLS, per entry point, and in the garbage
    collector (engine None: all-resident, no host seconds)."""
    place(bench.layers, device)
    if engine is None:
        return time_steps(bench.training_step(), device, warmup, steps)[0], None
    timer = HostTimer()
    cls, names = ENTRY_POINTS[kind]
    cls = cls or importlib.import_module(f"{engine.__name__}.hooks").HookAdapter  # the old engine's own hooks
    with timed_entry_points(cls, names, timer):
        make = getattr(engine.SwapConfig, "of", engine.SwapConfig)  # an engine before the policies: flat fields
        config = make(gpu_layers=resident, prefetch=prefetch)
        with engine.LayerSwapper(bench.layers, config, device=device, log=None):
            time_steps(bench.training_step(), device, warmup, 0)
            timer.reset()

            def per_step() -> dict:
                got = dict(host=timer.seconds, gc=timer.gc_seconds, **timer.by_entry)
                timer.reset()
                return got

            times, host = time_steps(bench.training_step(), device, 0, steps, after=per_step)
    return times, host


def host_columns(steps: list[dict]) -> dict:
    """Per-step host seconds as milliseconds: medians (and the smallest total), per entry point, gc."""
    if not steps:
        return dict(host_ms=None)
    ms = {key: statistics.median(s.get(key, 0.0) for s in steps) * 1000 for key in steps[0]}
    columns = dict(host_ms=ms.pop("host"), min_host_ms=min(s["host"] for s in steps) * 1000, gc_ms=ms.pop("gc"))
    columns.update({f"{key.strip('_')}_ms": value for key, value in ms.items()})
    return columns


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=32, help="latent side: 32 is 512x512 (1024 tokens), 64 1024x1024")
    parser.add_argument("--gib", type=float, default=9.6, help="streamed GiB of the spread placement")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--old", type=Path, default=None, help="a utils/dgls folder of an older engine to compare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--name", default="host", help="results file stem")
    parser.add_argument("--results_dir", type=Path, default=None, help="default: results/ (results/tiny/ with --tiny)")
    args = parser.parse_args(argv)
    engines = {"all-resident": None, "DGLS (this engine)": utils.dgls}
    if args.old is not None:
        engines["DGLS (old engine)"] = load_engine(args.old)
    with machine.session(args.tiny) as (device, dtype):
        bench = flux.build(args.tiny, device, dtype, side=None if args.tiny else args.side)
        gib = sum(s.streamable_bytes for s in bench.sizes) / 2 / GiB if args.tiny else args.gib
        streamed, _ = bench.spread_config(gib, args.prefetch)
        resident = [s.index for s in bench.sizes if s.streamable_bytes and s.index not in streamed]
        times: dict[str, list[float]] = defaultdict(list)
        host: dict[str, list[dict]] = defaultdict(list)  # per timed step: seconds in DGLS, per entry, in gc
        for _ in range(args.rounds):
            for name, engine in engines.items():
                kind = "current" if engine is utils.dgls else "old"
                t, h = run_arm(bench, device, engine, resident, args.prefetch, args.steps, args.warmup, kind)
                times[name] += t
                if h is not None:
                    host[name] += h
        base = statistics.median(times["all-resident"])
        base_min = min(times["all-resident"])
        rows = [
            dict(
                method=name,
                median_step_s=statistics.median(times[name]),
                vs_resident=statistics.median(times[name]) / base,
                min_step_s=min(times[name]),
                min_vs_resident=min(times[name]) / base_min,
                **host_columns(host[name]),
                step_times_s=times[name],
            )
            for name in engines
        ]
        result = {
            "benchmark": "host",
            "title": "Host time of the engine per step (Flux-dev size, launch-bound)",
            "description": (
                f"{bench.shape}; spread placement, {len(streamed)} layers (~{bench.streamed_bytes(streamed) / GiB:.1f} "
                f"GiB) streamed, prefetch {args.prefetch}; arms alternate in {args.rounds} rounds of {args.steps} "
                "timed steps; medians." + (" TINY config on the CPU: the figures mean nothing." if args.tiny else "")
            ),
            "command": command_line(__file__, argv),
            "environment": machine.environment(device),
            "tiny": args.tiny,
            "notes": [
                "host ms: wall time inside DGLS's hook entry points per step (forward pre/post, output-gradient, "
                "saved-tensor pack/unpack), the time the host spends in DGLS instead of launching kernels; median "
                "and smallest over the timed steps, and the median per entry point. gc ms: time Python's garbage "
                "collector ran per step (anywhere in the step). min step: the fastest step of each arm, less "
                "sensitive than the median to other work on a shared host."
            ],
            "rows": rows,
        }
    write_result(result, args.name, args.results_dir or results_dir(args.tiny), echo=True)
    return result


if __name__ == "__main__":
    main()
