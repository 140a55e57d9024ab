"""The engine's host work per step, counted (not timed): Python calls, C calls, CUDA API calls and gc objects.

``bench_host`` times the host milliseconds per step on a GPU, which move with the machine; this counts, on the
CPU and deterministically, what those milliseconds are made of, per hook entry point, for this engine and
(``--old DIR``) an older one at the same placement, so a change to the hook path can be judged before a GPU
run. The model is Flux-dev's depth (19 double, 38 single blocks) at tiny widths, LoRA, checkpointed blocks,
the "spread" placement streaming ``--fraction`` of the streamable bytes (Flux-dev at 512x512 streams ~25
blocks), prefetch 2, exactly what bench_host runs otherwise.

What is counted, per entry point (the hook entry points bench_host times, plus the end-of-backward callback,
which autograd calls on its own):

- ``py``: Python function calls (``sys.setprofile`` "call" events, generator resumptions included);
- ``c``: calls of C functions from Python ("c_call" events: builtins, torch ops, attribute-free C methods);
- ``cuda``: CUDA API calls the engine makes (event creations, records, stream waits, current-stream queries,
  stream switches, synchronisations). The CPU has no CUDA, so with ``--cuda`` (the default) each engine runs
  its CUDA copier over CPU tensors with ``torch.cuda.Event``/``Stream``/``stream``/``current_stream``/
  ``synchronize`` replaced by counting stand-ins for the duration of the run (the stand-ins' own calls are not
  counted as Python calls); ``--no-cuda`` counts the CPU backend instead;
- ``objects``: instances of Python classes made (``__init__`` calls: tokens, markers, references, contexts);
- per engine, against the all-resident step: the net gc-tracked objects a step leaves (``gc.get_count()[0]``
  across the step with the collector off: what counts toward the next collection) and the unreachable ones a
  collection then finds (reference cycles): the engine's share of what makes the collector run.

    python3 benchmarks/count_host.py [--old .old/utils/dgls] [--steps 2] [--top 25] [--no-cuda] [--depth 19,38]

Prints a table (and with ``--top`` the functions whose call counts differ most between the engines).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch._dynamo.eval_frame
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flux  # noqa: E402
from bench_host import HOOK_ENTRY_POINTS, load_engine  # noqa: E402
from models import place  # noqa: E402

import utils.dgls  # noqa: E402

# bench_host's entry points, the end-of-backward callback, and DGLS's saved-tensor hooks stacked on a checkpoint's
# (the checkpoint's own hooks they call are not counted, and an unpack's recompute counts in the hooks it runs)
ENTRY_POINTS = (*HOOK_ENTRY_POINTS, "_on_backward_end", "_pack_over", "_unpack_over")
THIS_FILE = __file__
# the outer saved-tensor hooks of a checkpoint, and the dynamo-disabling wrapper around them
NOT_DGLS = (torch.utils.checkpoint.__file__, torch._dynamo.eval_frame.__file__)


# ---------------------------------------------------------------- CUDA stand-ins
class CudaCalls(Counter):
    """How many times each stand-in was called; each call also counts in ``current`` (the entry point running)."""

    current: Counter | None = None

    def hit(self, name: str) -> None:
        self[name] += 1
        if self.current is not None:
            self.current["cuda"] += 1


class _Event:
    def __init__(self, calls: CudaCalls, enable_timing: bool = False, **_) -> None:
        calls.hit("Event()")
        self.calls = calls

    def record(self, stream=None) -> None:
        self.calls.hit("Event.record")

    def wait(self, stream=None) -> None:
        self.calls.hit("Event.wait")

    def synchronize(self) -> None:
        self.calls.hit("Event.synchronize")

    def query(self) -> bool:
        self.calls.hit("Event.query")
        return True

    def elapsed_time(self, other) -> float:
        self.calls.hit("Event.elapsed_time")
        return 0.0


class _Stream:
    def __init__(self, calls: CudaCalls, device=None, priority: int = 0, **_) -> None:
        self.calls = calls
        self.device = device

    def wait_event(self, event) -> None:
        self.calls.hit("Stream.wait_event")

    def wait_stream(self, stream) -> None:
        self.calls.hit("Stream.wait_stream")

    def synchronize(self) -> None:
        self.calls.hit("Stream.synchronize")

    def record_event(self, event=None):
        self.calls.hit("Stream.record_event")
        return event


@contextlib.contextmanager
def cuda_stand_ins(calls: CudaCalls) -> Iterator[None]:
    """``torch.cuda``'s event and stream API replaced by counting stand-ins (nothing runs on a device)."""
    cuda = torch.cuda

    def stream_context(stream):
        calls.hit("stream()")
        return contextlib.nullcontext()

    def current_stream(device=None):
        calls.hit("current_stream()")
        return _Stream(calls, device)

    def synchronize(device=None):
        calls.hit("synchronize()")

    fakes = dict(
        Event=lambda *a, **k: _Event(calls, *a, **k),
        Stream=lambda *a, **k: _Stream(calls, *a, **k),
        stream=stream_context,
        current_stream=current_stream,
        synchronize=synchronize,
    )
    saved = {name: getattr(cuda, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(cuda, name, fake)
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(cuda, name, real)


def use_cuda_copier(swapper, engine) -> None:
    """Replace the CPU copier (and transport) of a swapper built on the CPU by the engine's CUDA ones, over the
    same CPU slots and masters (pinned, as on a GPU host), before any use: the CUDA path's host work."""
    for host in swapper.store.layers.values():
        host.pinned = True
    if hasattr(swapper, "transport"):  # this engine: the one transport
        transport_mod = importlib.import_module(f"{engine.__name__}.memory.transport")
        copier_mod = importlib.import_module(f"{engine.__name__}.memory.copier")
        swapper.copier.close()
        listeners = swapper.transport.listeners
        swapper.transport.close()
        transport = transport_mod.CudaTransport(
            swapper.device,
            weight_lanes=swapper.config.transfer.cuda_streams,
            timed={transport_mod.Direction.WEIGHTS_IN} if swapper.config.observe.collect_timing else set(),
        )
        transport.listeners = listeners
        swapper.transport = transport
        swapper.copier = copier_mod.CudaCopier(
            transport,
            swapper.store,
            ordered_by_events=swapper.config.transfer.ordered_by_events,
            use_thread=False,
            landing_bytes=swapper.placement.landing_bytes,
        )
    else:  # the engine before the transport: the copier owns its streams
        copier_mod = importlib.import_module(f"{engine.__name__}.copier")
        swapper.copier.close()
        config = swapper.config
        swapper.copier = copier_mod.CudaCopier(
            swapper.device,
            swapper.store,
            streams=config.cuda_streams,
            event_sync=config.event_sync,
            use_thread=False,
            timing=config.collect_timing,
            landing_bytes=swapper.placement.landing_bytes,
        )


# ---------------------------------------------------------------- counting
class HostCounter:
    """Counts inside wrapped methods, per entry point (a nested one counts in its own name: an unpack's
    recompute runs forward hooks) and per function; the checkpoint's own code is not counted."""

    def __init__(self, cuda_calls: CudaCalls) -> None:
        self.cuda_calls = cuda_calls
        self.by_entry: dict[str, Counter] = defaultdict(Counter)
        self.functions: Counter = Counter()
        self._entry: str | None = None
        self._muted = None  # the frame of the checkpoint's code running now (until it returns)

    def reset(self) -> None:
        self.by_entry.clear()
        self.functions.clear()

    def _profile(self, frame, event: str, arg) -> None:
        if self._muted is not None:
            if event == "return" and frame is self._muted:
                self._muted = None
            return
        filename = frame.f_code.co_filename
        if filename == THIS_FILE:  # the stand-ins and the wrapper itself
            return
        if event == "call" and filename in NOT_DGLS:
            self._muted = frame
            return
        if event == "call":
            entry = self.by_entry[self._entry]
            entry["py"] += 1
            code = frame.f_code
            self.functions[f"{Path(code.co_filename).name}:{code.co_qualname}"] += 1
            if code.co_name == "__init__":  # an instance of a Python class (a dataclass's generated one too)
                entry["objects"] += 1
                made = frame.f_locals.get("self")
                self.functions[f"new {type(made).__qualname__}"] += 1
        elif event == "c_call":
            self.by_entry[self._entry]["c"] += 1
            self.functions[f"C {getattr(arg, '__qualname__', None) or getattr(arg, '__name__', '?')}"] += 1

    def wrap(self, fn, name: str):
        def counted(*args, **kwargs):
            outer = self._entry, self._muted, self.cuda_calls.current
            self._entry, self._muted = name, None
            entry = self.by_entry[name]
            self.cuda_calls.current = entry
            entry["calls"] += 1
            if outer[0] is None:
                sys.setprofile(self._profile)
            try:
                return fn(*args, **kwargs)
            finally:
                if outer[0] is None:
                    sys.setprofile(None)
                self._entry, self._muted, self.cuda_calls.current = outer

        return counted


@contextlib.contextmanager
def counted_entry_points(cls, counter: HostCounter) -> Iterator[None]:
    saved = {name: cls.__dict__[name] for name in ENTRY_POINTS if name in cls.__dict__}
    for name, fn in saved.items():
        setattr(cls, name, counter.wrap(fn, name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)


def gc_objects_per_step(step, steps: int) -> tuple[int, int]:
    """What a step leaves for the garbage collector, with the collector off meanwhile: the net gc-tracked objects
    created (``gc.get_count()[0]``, what counts toward the next collection) and the unreachable ones a collection
    then finds (reference cycles, freed only by the collector). The smallest over ``steps`` steps."""
    gc.collect()
    gc.disable()
    try:
        created, cyclic = [], []
        for _ in range(steps):
            before = gc.get_count()[0]
            step()
            created.append(gc.get_count()[0] - before)
            cyclic.append(gc.collect())
    finally:
        gc.enable()
    return min(created), min(cyclic)


def count_arm(bench, device, engine, resident: list[int], prefetch: int, steps: int, warmup: int, cuda: bool):
    place(bench.layers, device)
    step = bench.training_step()
    if engine is None:
        for _ in range(warmup):
            step()
        return None, gc_objects_per_step(step, steps), CudaCalls()
    calls = CudaCalls()
    counter = HostCounter(calls)
    try:  # this engine's layout, or the flat one before the folders
        hooks = importlib.import_module(f"{engine.__name__}.streaming.hooks")
    except ModuleNotFoundError:
        hooks = importlib.import_module(f"{engine.__name__}.hooks")
    make = getattr(engine.SwapConfig, "of", engine.SwapConfig)
    config = make(gpu_layers=resident, prefetch=prefetch)
    stand_ins = cuda_stand_ins(calls) if cuda else contextlib.nullcontext()
    with stand_ins, counted_entry_points(hooks.HookAdapter, counter):
        with engine.LayerSwapper(bench.layers, config, device=device, log=None) as swapper:
            if cuda:
                use_cuda_copier(swapper, engine)
            for _ in range(warmup):
                step()
            counter.reset()
            calls.clear()
            for _ in range(steps):
                step()
            by_entry = {name: {k: v / steps for k, v in c.items()} for name, c in counter.by_entry.items()}
            functions = Counter({name: n / steps for name, n in counter.functions.items()})
            cuda_calls = CudaCalls({name: n / steps for name, n in calls.items()})
            objects = gc_objects_per_step(step, steps)
    return (by_entry, functions), objects, cuda_calls


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=None, help="a utils/dgls folder of an older engine to compare")
    parser.add_argument("--depth", default="19,38", help="double,single blocks (Flux-dev's by default)")
    parser.add_argument("--fraction", type=float, default=0.44, help="share of the streamable bytes streamed")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=True, help="the CUDA copier path")
    parser.add_argument("--top", type=int, default=0, help="list the functions whose counts differ most")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device, dtype = torch.device("cpu"), torch.float32
    double, single = (int(n) for n in args.depth.split(","))
    bench = flux.build(True, device, dtype, depth=(double, single))
    gib = sum(s.streamable_bytes for s in bench.sizes) * args.fraction / 2**30
    streamed, _ = bench.spread_config(gib, args.prefetch)
    resident = [s.index for s in bench.sizes if s.streamable_bytes and s.index not in streamed]
    engines = {"resident": None, "this": utils.dgls}
    if args.old is not None:
        engines["old"] = load_engine(args.old)
    found = {}
    for name, engine in engines.items():
        found[name] = count_arm(bench, device, engine, resident, args.prefetch, args.steps, args.warmup, args.cuda)
    base_objects = found["resident"][1]
    print(
        f"Flux-dev depth at tiny widths, LoRA, {len(streamed)} of {len(bench.layers)} layers streamed, prefetch "
        f"{args.prefetch}, {'CUDA copier (counting stand-ins)' if args.cuda else 'CPU backend'}; per step\n"
    )
    print("| engine | entry point | calls | Python calls | C calls | CUDA calls | Python objects made |")
    print("|---|---|---|---|---|---|---|")
    result = {}
    for name in engines:
        if engines[name] is None:
            continue
        (by_entry, functions), objects, cuda_calls = found[name]
        total = Counter()
        for entry in ENTRY_POINTS:
            c = by_entry.get(entry, {})
            total.update(c)
            print(
                f"| {name} | {entry} | {c.get('calls', 0):.0f} | {c.get('py', 0):.0f} | {c.get('c', 0):.0f} | "
                f"{c.get('cuda', 0):.0f} | {c.get('objects', 0):.0f} |"
            )
        print(
            f"| **{name}** | **all** | {total['calls']:.0f} | **{total['py']:.0f}** | **{total['c']:.0f}** | "
            f"**{total['cuda']:.0f}** | **{total['objects']:.0f}** |"
        )
        gc_left = dict(created=objects[0] - base_objects[0], cyclic=objects[1] - base_objects[1])
        result[name] = dict(total=dict(total), by_entry=by_entry, gc=gc_left, cuda=cuda_calls)
    print()
    for name, r in result.items():
        cuda = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["cuda"].items()))
        print(
            f"{name}: beyond the all-resident step, gc-tracked objects left {r['gc']['created']}, of them "
            f"unreachable (cycles) {r['gc']['cyclic']}; CUDA calls: {cuda or '-'}"
        )
    if args.top and "old" in found:
        now, before = found["this"][0][1], found["old"][0][1]
        names = set(now) | set(before)
        print(f"\nfunctions by calls per step (this, old), largest first (top {args.top}):")
        for fn in sorted(names, key=lambda n: -max(now.get(n, 0), before.get(n, 0)))[: args.top]:
            print(f"  {now.get(fn, 0):7.0f} {before.get(fn, 0):7.0f}  {fn}")
    return result


if __name__ == "__main__":
    main()
