"""The model benchmark's methods: what each measures, one result row per case.

- ``resident``: every layer on the GPU, no hooks (the reference);
- ``dgls``: DGLS streaming shares of the blocks (and ~N GiB targets), one swapper switched between
  placements with ``apply_placement``;
- ``ab``: all-resident and DGLS alternating in rounds at each ~N GiB target, two placements each;
- ``options``: a prefetch/threading/batch_move grid at the last ~N GiB target (fresh swappers);
- ``dp``: diffusion-pipe's built-in block swap (baselines.DPSwap);
- ``auto``: DGLS with ``vram_budget`` ("auto" and fixed GiB), timed after its planning steps;
- ``naive``: synchronous ``.to()`` of a block's frozen weights around its use (baselines.NaiveSwap);
- ``offload``: DGLS with every block streamed and ``offload_activations`` (the checkpointed blocks'
  inputs in host memory between forward and recompute), on request.

Each method is a generator of :class:`Case`: set-up before its first case, teardown in its
``finally``. Deciding whether a case runs is the runner's job (runner.py), not a method's.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from baselines import DPSwap, NaiveSwap, dp_checkout, dp_streamed_bytes, load_dp_offloading
from blocking import blocking_calls, device_gaps
from machine import release_host_cache
from models import Bench, place
from timing import Deadline, peaks, reset_peaks, sync, time_steps
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from units import GiB, MiB

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.watching.profiler import Profiler
from utils.dgls.watching.stats import StepReader

METHODS = {
    "resident": "all-resident",
    "dgls": "DGLS",
    "ab": "A/B",
    "options": "DGLS options",
    "dp": "diffusion-pipe built-in",
    "auto": "DGLS vram_budget",
    "naive": "naive .to() swap",
    "offload": "DGLS + activation offload",
    "accum": "gradient accumulation",
}
PROFILE_LATER = 10**9  # a profiler's window until :func:`profile_one_step` places it (after the timed steps)
SETTLE_STEPS = 4  # vram_budget rows: untimed steps after the planner settled, on which it may still re-plan
DEFAULT_METHODS = ("resident", "dgls", "dp", "auto", "naive")  # ab and options on request: they take long

# How to read the table: written into each result (its "notes"), for the methods it ran.
NOTES = {
    "floors": (
        "floor (copied) = max(all-resident step, host-to-device bytes copied per step / pinned bandwidth); "
        "floor (2x streamed) = max(all-resident step, 2 x streamed bytes / pinned bandwidth); all measured in "
        "this run, medians over the timed steps after warm-up."
    ),
    "dgls": "DGLS rows: one swapper, its placement switched with `apply_placement` between rows.",
    "ab": (
        "A/B rows alternate all-resident and DGLS steps in rounds, and their 'vs resident' is against the "
        "resident steps of those rounds: step times drift over a run by more than placements differ. Two "
        "placements per size: blocks_to_swap's (resident layers at both ends) and the planner's spread "
        "(resident layers between streamed ones)."
    ),
    "options": "Options rows: a fresh swapper per prefetch/threading/batch_move combination.",
    "dp": (
        "diffusion-pipe built-in: its `utils/offloading.py` ModelOffloader imported from the checkout and "
        "measured in this run; streamed = weights of its swapped blocks (it moves only `.weight`, both ways), "
        "copy GB/s = (host-to-device + device-to-host bytes) / time inside its exchanges, waited = host time "
        "blocked on them."
    ),
    "auto": "vram_budget rows are timed after the planner's probe, trial and check steps and "
    f"{SETTLE_STEPS} steps after it settled (it watches their peaks and re-plans when one goes over the budget).",
    "naive": "naive: waited = time inside the synchronous moves (both ways).",
    "accum": (
        "gradient accumulation rows: N micro-batches a step (the same inputs each), one after another or layer-major "
        "(each layer over all N before the next: each streamed layer copied once a direction a step); 'vs resident' "
        "is against all-resident with the same N, one after another; per sample = step / N."
    ),
    "offload": (
        "activation offload rows: every block streamed, and the inputs checkpointed blocks keep for their "
        "recompute sent to host memory during the forward (all but those of the last prefetch blocks); "
        "'activations home' is what went per step."
    ),
}


@dataclass(frozen=True)
class Options:
    """What to run and how long: the model benchmark's command line after per-model defaults."""

    tiny: bool
    methods: tuple[str, ...]
    steps: int
    warmup: int
    prefetch: int
    shares: str  # DGLS: shares of the blocks streamed (comma list)
    gib: str  # DGLS, A/B and options: ~GiB streamed (comma list)
    budgets: str  # vram_budget values: auto and/or GiB
    dp_swaps: str  # diffusion-pipe blocks_to_swap: shares, NGiB targets or max
    naive: str  # naive swap: a share of the blocks or an NGiB target
    ab_rounds: int
    ab_steps: int
    strict: bool  # a failing method fails the run (tests)
    unit_mb: str = "0"  # offload: swap-unit sizes in MB, a row each (0: whole layers)
    checkpoint_units: str = "off"  # offload and vram_budget rows: checkpoint_units off, on, or a row of each
    offload_recompute: str = "off"  # offload rows: offload_recompute off, on, or a row of each
    keep_piece_outputs: str = "off"  # offload rows with checkpoint_units: keep_piece_outputs off, on, or both
    memory_cap_gib: float | None = None  # offload rows: the process may hold at most this much device memory
    budget_offload: str = "auto"  # vram_budget rows: offload_activations unset (auto), on, or off
    accumulation: str = "1,2,4,8"  # accum rows: micro-batches per step (comma list)
    accumulation_budgets: bool = False  # accum rows: also at each --budgets value (planned; rows take minutes)
    accumulation_ways: str = "both"  # accum rows: DGLS rows one after another, layer-major, or both
    profile_dir: Path | None = None  # accum rows: each DGLS row's --profile trace of one step after its timed ones
    accumulation_ab: bool = False  # accum rows: also all-resident layer-major against one after another, alternating
    # accum vram_budget rows, layer-major: swap units sized for the step's micro-batches (as dgls_train.py tells the
    # builder), for one micro-batch (the size before: utils/dgls/planning/unit_choice.py), or a row of each
    accumulation_units: str = "micro_batches"


@dataclass(frozen=True)
class Case:
    """One result row to measure: ``measure()`` returns the timed steps and the row's other figures.
    A case with ``skipped`` set is recorded as skipped, with that reason."""

    kind: str
    method: str
    measure: Callable[[], tuple[list[float], dict]] | None = None
    skipped: str = ""


def parse_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def resolve_swaps(bench: Bench, spec: str, limit: int) -> list[tuple[str, int | None, float | None]]:
    """(label, blocks_to_swap, GiB target) per item: '0.5' -> 50% of the blocks, '9.6GiB' -> a GiB
    target (the count is chosen by the caller, which knows what is measured), 'max' -> ``limit``."""
    out = []
    for item in parse_list(spec):
        if item == "max":
            out.append(("largest", limit, None))
        elif item.lower().endswith("gib"):
            out.append((f"~{item[:-3]} GiB", None, float(item[:-3])))
        else:
            out.append((f"{float(item):.0%} of blocks", min(limit, round(float(item) * len(bench.blocks))), None))
    return out


def planner_trials(planner) -> list[dict]:
    """The plans DGLS's planner measured before settling, its predictions next to the measurements."""
    return [
        {
            "pattern": t.plan.pattern,
            "streamed": len(t.plan.streamed),
            "prefetch": t.plan.prefetch,
            "predicted_s": t.plan.predicted_ms / 1000,
            "measured_s": t.wall_ms / 1000,
            "visits_s": [ms / 1000 for ms in t.samples_ms],
            "predicted_peak_gib": t.plan.predicted_peak / GiB,
            "peak_reserved_gib": t.peak_reserved / GiB,
        }
        for t in planner.trials
    ]


class Methods:
    """The seven methods on one bench, their timed loops stopped early past ``deadline``."""

    def __init__(self, bench: Bench, options: Options, device: torch.device, deadline: Deadline) -> None:
        self.bench, self.options, self.device, self.deadline = bench, options, device, deadline

    def cases(self, kind: str) -> Iterator[Case]:
        """The cases of method ``kind`` (a key of METHODS)."""
        generators = {
            "resident": self.resident,
            "dgls": self.dgls,
            "ab": self.ab,
            "options": self.options_grid,
            "dp": self.dp,
            "auto": self.auto,
            "naive": self.naive,
            "offload": self.offload,
            "accum": self.accum,
        }
        return generators[kind]()

    # -------------------------------------------------------- shared steps
    def time_bench(
        self, warmup: int | None = None, after: Callable | None = None, checkpoint_fn: Callable | None = None
    ) -> tuple[list[float], list]:
        """--warmup (or ``warmup``) and --steps training steps, stopped early past the deadline."""
        warmup = self.options.warmup if warmup is None else warmup
        step = self.bench.training_step(checkpoint_fn=checkpoint_fn)
        return time_steps(step, self.device, warmup, self.options.steps, after, self.deadline)

    def time_placement(self, swapper: LayerSwapper) -> tuple[list[float], list]:
        """Step times and per-step swap stats of the placement in force, peaks counted from here; the
        checkpointed blocks through the swapper's checkpoint function (activation offload, when on)."""
        reset_peaks(self.device)
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
        return self.time_bench(after=StepReader(swapper, sync=True).end, checkpoint_fn=ckpt)

    def swap_figures(self, swapper: LayerSwapper, stats: list) -> dict:
        placement = swapper.placement
        return {
            "blocks_to_swap": len(placement.streamed),
            "prefetch": swapper.config.placement.prefetch,
            "threading": swapper.config.transfer.threading,
            "batch_move": swapper.config.transfer.batch_move,
            "streamed_layers": list(placement.streamed),
            "streamed_gib": placement.streamed_bytes / GiB,
            "predicted_weights_pool_gib": placement.predicted_device_bytes / GiB,
            "bytes_per_step": statistics.median(s.bytes_moved for s in stats) if stats else 0,
            "copy_gbps": statistics.median(s.gbps for s in stats) if stats else 0.0,
            "wait_ms": statistics.median(s.wait_ms for s in stats) if stats else 0.0,
            "activation_wait_ms": statistics.median(s.activation_wait_ms for s in stats) if stats else 0.0,
            "hit_rate": min(s.hit_rate for s in stats) if stats else 1.0,
            "misses_per_step": statistics.median(s.misses for s in stats) if stats else 0,
            "activations_home_gib": statistics.median(s.activation_bytes for s in stats) / GiB if stats else 0.0,
            "pinned_gib": swapper.pinned_bytes / GiB,  # weights, activation buffers pooled and waiting
            **peaks(self.device),
        }

    def blocks_to_swap(self, spec: str) -> tuple[str, int]:
        """The label and blocks_to_swap of a share ('0.5') or a GiB target ('19GiB')."""
        label, n, gib = resolve_swaps(self.bench, spec, len(self.bench.blocks))[0]
        return label, (self.bench.blocks_to_swap_for_gib(gib) if n is None else n)

    # -------------------------------------------------------- methods
    def resident(self) -> Iterator[Case]:
        def measure():
            place(self.bench.layers, self.device)
            reset_peaks(self.device)
            return self.time_bench()[0], {"streamed_gib": 0.0, **peaks(self.device)}

        yield Case("resident", "all-resident", measure)

    def dgls(self) -> Iterator[Case]:
        """Growing streamed sets on one swapper: each switch packs only the newly streamed layers."""
        spec = ",".join(parse_list(self.options.shares) + [f"{g}GiB" for g in parse_list(self.options.gib)])
        labels: dict[int, list[str]] = {}
        for item in parse_list(spec):
            label, n = self.blocks_to_swap(item)
            if n == len(self.bench.blocks) and "of blocks" in label:
                label += " (largest)"
            labels.setdefault(n, []).append(label)
        prefetch = self.options.prefetch
        place(self.bench.layers, self.device)
        config = SwapConfig.of(blocks_to_swap=min(labels), prefetch=prefetch)
        swapper = LayerSwapper(self.bench.layers, config, self.device, log=None)
        try:
            for n in sorted(labels):
                name = f"DGLS {' = '.join(labels[n])} (blocks_to_swap={n}, prefetch={prefetch})"
                yield Case("dgls", name, partial(self.measure_dgls, swapper, n))
        finally:
            swapper.remove()

    def measure_dgls(self, swapper: LayerSwapper, blocks_to_swap: int):
        streamed = self.bench.streamed_for(blocks_to_swap)
        if tuple(swapper.placement.streamed) != streamed:
            swapper.apply_placement(streamed, self.options.prefetch)
        times, stats = self.time_placement(swapper)
        return times, self.swap_figures(swapper, stats)

    def accum(self) -> Iterator[Case]:
        """Per micro-batch count: all-resident one after another (the reference) and layer-major, then DGLS at each
        --budgets value (with --accumulation_budgets) and each --gib target (default: 0 GiB), both ways (or the one
        --accumulation_ways names)."""
        gibs = parse_list(self.options.gib) or ([] if self.options.accumulation_budgets else ["0"])
        prefetch = self.options.prefetch
        ways = {"both": (False, True), "layer-major": (True,), "sequential": (False,)}[self.options.accumulation_ways]
        for count in (int(n) for n in parse_list(self.options.accumulation)):
            reference: dict = {}
            for layer_major in (False, True):
                name = f"all-resident, {micro_batches(count, layer_major)}"
                yield Case("accum", name, partial(self.measure_accum_resident, count, layer_major, reference))
            if self.options.accumulation_ab:
                name = f"A/B: all-resident, {micro_batches(count, True)} against one after another, step by step"
                yield Case("accum", name, partial(self.measure_accum_ab, count))
            for budget in parse_list(self.options.budgets) if self.options.accumulation_budgets else ():
                if budget == "auto":
                    continue
                gib = self.bench.tight_budget_gib() if self.options.tiny else float(budget)
                for layer_major in ways:
                    for sized_for in self._units_sized_for(count, layer_major):
                        name = f"DGLS vram_budget={gib:.3g} GiB, {micro_batches(count, layer_major)}"
                        if sized_for != count and layer_major:
                            name += f", units sized for {sized_for} micro-batch"
                        profile = self.profile_path(name)
                        run = partial(self.measure_accum_budget, gib, count, layer_major, reference, profile, sized_for)
                        yield Case("accum", name, run)
            for gib in gibs:
                n = self.bench.blocks_to_swap_for_gib(float(gib))
                config = SwapConfig.of(blocks_to_swap=n, prefetch=prefetch)
                for layer_major in ways:
                    what = micro_batches(count, layer_major)
                    name = f"DGLS ~{gib} GiB, {what} (blocks_to_swap={n}, prefetch={prefetch})"
                    run = partial(self.measure_accum, config, count, layer_major, reference, self.profile_path(name))
                    yield Case("accum", name, run)

    def _units_sized_for(self, count: int, layer_major: bool) -> tuple[int, ...]:
        """The micro-batch counts a vram_budget accum row's builder is told (``layer_major_micro_batches``)."""
        if not layer_major or count == 1:
            return (1,)
        return {"micro_batches": (count,), "one": (1,), "both": (1, count)}[self.options.accumulation_units]

    def blocking(self, step: Callable[[], object]) -> dict:
        """With --profile_dir, two more steps under torch.profiler: where the host waited, and the compute stream's
        gaps between kernels (:mod:`blocking`)."""
        if self.options.profile_dir is None:
            return {}
        return {"blocking_calls": blocking_calls(step, self.device), "device_gaps": device_gaps(step, self.device)}

    def profile_path(self, name: str) -> Path | None:
        """Where a DGLS accum row's trace goes with --profile_dir: a file named after the row."""
        if self.options.profile_dir is None:
            return None
        stem = "".join(c if c.isalnum() or c in ".-" else "_" for c in name).strip("_")
        return Path(self.options.profile_dir) / f"{stem}.json"

    def accum_figures(self, count: int, layer_major: bool, times: list[float], reference: dict) -> dict:
        figures = {"micro_batches": count, "layer_major": layer_major, "per_sample_s": statistics.median(times) / count}
        if "resident_s" in reference:
            figures["reference_s"] = reference["resident_s"]
        return figures

    def measure_accum_resident(self, count: int, layer_major: bool, reference: dict):
        place(self.bench.layers, self.device)
        reset_peaks(self.device)
        step = self.bench.training_step(micro_batches=count, layer_major=layer_major)
        times = time_steps(step, self.device, self.options.warmup, self.options.steps, None, self.deadline)[0]
        if not layer_major:
            reference["resident_s"] = statistics.median(times)
        figures = {"streamed_gib": 0.0, **peaks(self.device), **self.blocking(step)}
        return times, {**figures, **self.accum_figures(count, layer_major, times, reference)}

    def measure_accum_ab(self, count: int):
        """All-resident steps of ``count`` micro-batches, layer-major and one after another alternating (which goes
        first swaps every round), so both see the same device state (clocks, temperature, allocator): the row's
        times are the layer-major steps', its reference the others' of the same rounds."""
        place(self.bench.layers, self.device)
        reset_peaks(self.device)
        steps = {
            way: self.bench.training_step(micro_batches=count, layer_major=way) for way in (False, True)
        }  # (one after another, layer-major)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(self.options.warmup + self.options.steps):
            for way in (False, True) if i % 2 == 0 else (True, False):
                took = time_steps(steps[way], self.device, 0, 1)[0]
                if i >= self.options.warmup:
                    times[way] += took
            if self.deadline.passed() and len(times[True]) >= 3:
                break
        sequential = statistics.median(times[False])
        figures = {"streamed_gib": 0.0, **peaks(self.device), "ab_resident_s": sequential}
        figures["ab_resident_times_s"] = times[False]
        return times[True], {**figures, **self.accum_figures(count, True, times[True], {"resident_s": sequential})}

    def measure_accum_budget(
        self,
        gib: float,
        count: int,
        layer_major: bool,
        reference: dict,
        profile: Path | None = None,
        sized_for: int = 1,
    ):
        """Planned from the CPU, as the vram_budget rows are (:meth:`auto`); ``sized_for``: the micro-batches the
        builder sizes swap units for."""
        place(self.bench.layers, torch.device("cpu"))
        release_host_cache()
        try:
            times, figures = self.measure_auto(
                gib, micro_batches=count, layer_major=layer_major, profile=profile, sized_for=sized_for
            )
        finally:
            place(self.bench.layers, self.device)
        return times, {**figures, **self.accum_figures(count, layer_major, times, reference)}

    def measure_accum(
        self, config: SwapConfig, count: int, layer_major: bool, reference: dict, profile: Path | None = None
    ):
        place(self.bench.layers, self.device)
        lines: list[str] = []
        config = config.replace(**_profiling(profile))
        with LayerSwapper(self.bench.layers, config, self.device, log=lines.append) as swapper:
            reset_peaks(self.device)
            ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
            step = self.bench.training_step(
                checkpoint_fn=ckpt, micro_batches=count, layer_major=layer_major, swapper=swapper
            )
            after = StepReader(swapper, sync=True).end
            times, stats = time_steps(step, self.device, self.options.warmup, self.options.steps, after, self.deadline)
            figures = self.swap_figures(swapper, stats)  # peaks taken before leaving, which puts weights back
            figures.update(profile_one_step(swapper, step, 1 if layer_major else count, lines))
            if profile is not None:
                figures.update(self.blocking(step))
        return times, {**figures, **self.accum_figures(count, layer_major, times, reference)}

    def ab(self) -> Iterator[Case]:
        gibs = parse_list(self.options.gib)
        if not gibs:
            yield Case("ab", "A/B resident vs DGLS", skipped="no --gib to stream")
        prefetch = self.options.prefetch
        for gib in gibs:
            n = self.bench.blocks_to_swap_for_gib(float(gib))
            spread, spread_config = self.bench.spread_config(float(gib), prefetch)
            placements = (
                (f"blocks_to_swap={n}, prefetch={prefetch}", SwapConfig.of(blocks_to_swap=n, prefetch=prefetch)),
                (f"spread, {len(spread)} streamed, prefetch={prefetch}", spread_config),
            )
            for label, config in placements:
                yield Case("ab", f"A/B: DGLS ~{gib} GiB ({label})", partial(self.measure_ab, config))

    def measure_ab(self, config: SwapConfig):
        """Rounds of resident steps then DGLS steps; the peaks are the highest of the DGLS arms."""
        rounds, steps = self.options.ab_rounds, self.options.ab_steps
        resident: list[float] = []
        swapped: list[float] = []
        stats: list = []
        peak: dict = {}
        for _ in range(rounds):
            place(self.bench.layers, self.device)
            resident += time_steps(self.bench.training_step(), self.device, 1, steps)[0]
            with LayerSwapper(self.bench.layers, config, self.device, log=None) as swapper:
                reset_peaks(self.device)
                after = StepReader(swapper, sync=True).end
                times, round_stats = time_steps(self.bench.training_step(), self.device, 1, steps, after)
                swapped += times
                stats += round_stats
                figures = self.swap_figures(swapper, stats)  # peaks taken before leaving, which puts weights back
            peak = {
                k: max(figures[k], peak.get(k, 0.0))
                for k in ("peak_allocated_gib", "peak_reserved_gib")
                if k in figures
            }
        ab = {"ab_resident_s": statistics.median(resident), "ab_rounds": rounds, "ab_resident_times_s": resident}
        return swapped, {**figures, **peak, **ab}

    def options_grid(self) -> Iterator[Case]:
        gibs = parse_list(self.options.gib)
        n = self.bench.blocks_to_swap_for_gib(float(gibs[-1])) if gibs else len(self.bench.blocks) // 2
        where = f"~{gibs[-1]} GiB" if gibs else "50% of blocks"
        on = {False: "off", True: "on"}
        place(self.bench.layers, self.device)
        for p in (1, 2, 4):
            for t in (False, True):
                for b in (False, True):
                    name = f"DGLS {where} threading={on[t]} batch_move={on[b]} (blocks_to_swap={n}, prefetch={p})"
                    config = SwapConfig.of(blocks_to_swap=n, prefetch=p, threading=t, batch_move=b)
                    yield Case("options", name, partial(self.measure_fresh, config))

    def measure_fresh(self, config: SwapConfig):
        with LayerSwapper(self.bench.layers, config, self.device, log=None) as swapper:
            times, stats = self.time_placement(swapper)
            return times, self.swap_figures(swapper, stats)

    def dp(self) -> Iterator[Case]:
        bench, label = self.bench, "diffusion-pipe built-in"
        checkout = dp_checkout()
        if bench.dp_split is None:
            yield Case("dp", label, skipped=bench.dp_note or "diffusion-pipe has no block swap for it")
            return
        if checkout is None:
            yield Case("dp", label, skipped="DGLS_DIFFUSION_PIPE is not set (a diffusion-pipe checkout)")
            return
        offloading = load_dp_offloading(checkout)
        for size, n, gib in resolve_swaps(bench, self.options.dp_swaps, bench.dp_max):
            if n is None:  # a GiB target: the blocks_to_swap whose swapped weights come closest
                candidates = range(1, bench.dp_max + 1)
                n = min(candidates, key=lambda k: abs(dp_streamed_bytes(bench, k) / GiB - gib), default=0)
            if n < 1:  # diffusion-pipe: blocks_to_swap 0 means no block swap at all
                yield Case("dp", f"{label} {size}", skipped="blocks_to_swap 0 is no block swap")
                continue
            groups = bench.dp_split(n)
            split = ", ".join(f"{g.swap} of {len(g.layers)} {g.kind}" for g in groups)
            name = f"{label} {size} (blocks_to_swap={n}: {split})"
            yield Case("dp", name, partial(self.measure_dp, offloading, n))

    def measure_dp(self, offloading, blocks_to_swap: int):
        groups = self.bench.dp_split(blocks_to_swap)
        swap = DPSwap(self.bench, offloading, groups, self.device)
        try:
            reset_peaks(self.device)
            times, figures = self.time_bench(after=swap.take)
            row_peaks = peaks(self.device)
        finally:
            swap.remove()
        med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
        moved = med["h2d"] + med["d2h"]
        gbps = moved / med["swap_s"] / 1e9 if med["swap_s"] > 0 and self.device.type == "cuda" else 0.0
        return times, {
            "blocks_to_swap": blocks_to_swap,
            "dp_groups": [{"kind": g.kind, "blocks": len(g.layers), "swapped": g.swap} for g in groups],
            "streamed_gib": dp_streamed_bytes(self.bench, blocks_to_swap) / GiB,
            "bytes_per_step": med["h2d"],
            "d2h_bytes_per_step": med["d2h"],
            "copy_gbps": gbps,
            "swap_ms": med["swap_s"] * 1000,
            "wait_ms": med["wait_s"] * 1000,
            **row_peaks,
        }

    def auto(self) -> Iterator[Case]:
        """Each swapper starts from the weights on the CPU, as in a real run (diffusion-pipe loads to the
        CPU): starting from the GPU once gave a 10 GiB Flux budget an inflated minimum."""
        bench = self.bench
        place(bench.layers, torch.device("cpu"))
        release_host_cache()
        try:
            for spec in parse_list(self.options.budgets):
                for units in self._checkpoint_units():
                    extra = ", checkpoint_units" if units else ""
                    if spec == "auto":
                        skipped = "" if self.device.type == "cuda" else "vram_budget auto needs a CUDA device"
                        run = partial(self.measure_auto, "auto", units)
                        yield Case("auto", f"DGLS vram_budget=auto{extra}", run, skipped)
                        continue
                    budget = bench.tight_budget_gib() if self.options.tiny else float(spec)
                    run = partial(self.measure_auto, budget, units)
                    yield Case("auto", f"DGLS vram_budget={budget:.3g} GiB{extra}", run)
        finally:
            place(bench.layers, self.device)

    def _checkpoint_units(self) -> tuple[bool, ...]:
        return _rows_of(self.options.checkpoint_units)

    def measure_auto(
        self,
        budget: float | str,
        checkpoint_units: bool = False,
        micro_batches: int = 1,
        layer_major: bool = False,
        profile: Path | None = None,
        sized_for: int = 1,
    ):
        """A vram_budget row: planned (untimed), then timed; ``micro_batches`` a step, ``layer_major`` or not;
        ``profile``: the --profile trace of one step after the timed ones is written there; ``sized_for``: the
        layer-major micro-batches the builder sizes swap units for (``layer_major_micro_batches``)."""
        lines: list[str] = []
        reset_peaks(self.device)
        before = torch.cuda.memory_allocated(self.device) / GiB if self.device.type == "cuda" else 0.0
        offload = {"auto": None, "on": True, "off": False}[self.options.budget_offload]
        config = SwapConfig.of(
            vram_budget=budget,
            offload_activations=offload,
            checkpoint_units=checkpoint_units,
            layer_major_micro_batches=sized_for,
            **_profiling(profile),
        )
        with LayerSwapper(self.bench.layers, config, self.device, log=lines.append) as swapper:
            planner = swapper.driver
            planning = []
            ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
            step = self.bench.training_step(
                checkpoint_fn=ckpt, micro_batches=micro_batches, layer_major=layer_major, swapper=swapper
            )
            settled, state = 0, None  # steps since the planner settled: it watches their peaks and may re-plan
            while len(planning) < 80:  # probe, trials, check, then SETTLE_STEPS settled ones: not timed
                now = (planner.done, planner.plan, planner.replanned, swapper.placement)
                settled = settled + 1 if planner.done and now == state else 0
                state = now
                if settled >= SETTLE_STEPS:
                    break
                sync(self.device)
                start = time.perf_counter()
                step()
                planning.append(time.perf_counter() - start)
            plan = planner.plan
            reset_peaks(self.device)
            after = StepReader(swapper, sync=True).end
            times, stats = time_steps(step, self.device, self.options.warmup, self.options.steps, after, self.deadline)
            figures = self.swap_figures(swapper, stats)
            figures.update(profile_one_step(swapper, step, 1 if layer_major else micro_batches, lines))
            if profile is not None:
                figures.update(self.blocking(step))
            if "peak_reserved_gib" in figures:
                figures["fits_budget"] = figures["peak_reserved_gib"] * GiB <= planner.budget
            return times, {
                **figures,
                "slot_mib": _slot_mib(swapper),
                "unit_mib": swapper.unit_bytes / MiB if swapper.unit_bytes else None,
                "units_sized_for": sized_for,
                "offload_activations": self.options.budget_offload,
                "kept_activations": plan.kept_activations if plan else None,
                "checkpoint_units": checkpoint_units,
                "budget_gib": planner.budget / GiB,
                "allocated_before_gib": before,
                "plan_pattern": plan.pattern if plan else None,
                "plan_predicted_s": plan.predicted_ms / 1000 if plan else None,
                "replanned": planner.replanned,
                "planning_steps_s": [round(t, 4) for t in planning],
                "plan_log": [line.strip() for line in lines if _planner_line(line)],
                "trials": planner_trials(planner),
            }

    def offload(self) -> Iterator[Case]:
        n, prefetch = len(self.bench.blocks), self.options.prefetch
        recomputes = _rows_of(self.options.offload_recompute)
        for unit in parse_list(self.options.unit_mb):
            for checkpoint_units in self._checkpoint_units():
                keeps = _rows_of(self.options.keep_piece_outputs) if checkpoint_units else (False,)
                for recompute, keep in ((r, k) for r in recomputes for k in keeps):
                    units = f", swap units <= {float(unit):g} MB" if float(unit) else ""
                    units += ", checkpoint_units" if checkpoint_units else ""
                    units += ", keep_piece_outputs" if keep else ""
                    units += ", offload_recompute" if recompute else ""
                    cap = self.options.memory_cap_gib
                    units += f", device memory capped at {cap:g} GiB" if cap else ""
                    name = f"DGLS + offload_activations (blocks_to_swap={n}, prefetch={prefetch}{units})"
                    measure = partial(self.measure_offload, n, float(unit), checkpoint_units, recompute, keep)
                    yield Case("offload", name, measure)

    def measure_offload(
        self,
        blocks_to_swap: int,
        unit_mb: float,
        checkpoint_units: bool = False,
        recompute: bool = False,
        keep_outputs: bool = False,
    ):
        place(self.bench.layers, self.device)
        prefetch = self.options.prefetch
        config = SwapConfig.of(
            blocks_to_swap=blocks_to_swap,
            prefetch=prefetch,
            offload_activations=True,
            offload_recompute=recompute,
            swap_unit_mb=unit_mb,
            checkpoint_units=checkpoint_units,
            keep_piece_outputs=keep_outputs,
        )
        with (
            LayerSwapper(self.bench.layers, config, self.device, log=None) as swapper,
            memory_cap(self.device, self.options.memory_cap_gib),
        ):
            if recompute:  # its first step measures what each recompute saves (sending all of it): not timed
                self.bench.training_step(
                    checkpoint_fn=swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
                )()
            times, stats = self.time_placement(swapper)
            figures = {
                "unit_mb": unit_mb,
                "checkpoint_units": checkpoint_units,
                "offload_recompute": recompute,
                "keep_piece_outputs": keep_outputs,
                "slot_mib": _slot_mib(swapper),
            }
            return times, {**self.swap_figures(swapper, stats), **figures}

    def naive(self) -> Iterator[Case]:
        label, n = self.blocks_to_swap(self.options.naive)
        yield Case("naive", f"naive .to() swap {label} (blocks_to_swap={n})", partial(self.measure_naive, n))

    def measure_naive(self, blocks_to_swap: int):
        """One warm-up step, then timed steps until --steps or the deadline (3 at least). Early stop is off:
        otherwise non-reentrant checkpointing stops the recompute before the block's forward hook."""
        bench = self.bench
        streamed = set(bench.streamed_for(blocks_to_swap))
        naive = NaiveSwap(bench.layers, streamed, self.device, bench.checkpointed)
        try:
            with set_checkpoint_early_stop(False):
                reset_peaks(self.device)
                times, figures = self.time_bench(warmup=1, after=naive.take)
                row_peaks = peaks(self.device)
        finally:
            naive.remove(bench.layers, self.device)
        moved, seconds, seconds_in = (statistics.median(f[k] for f in figures) for k in range(3))
        return times, {
            "blocks_to_swap": blocks_to_swap,
            "streamed_gib": bench.streamed_bytes(streamed) / GiB,
            "bytes_per_step": moved,
            "copy_gbps": moved / seconds_in / 1e9 if seconds_in > 0 and self.device.type == "cuda" else 0.0,
            "wait_ms": seconds * 1000,
            "warmup_steps": 1,
            **row_peaks,
        }


def _planner_line(line: str) -> bool:
    """A line of the planner's log (the profiler's line goes with the row's profile figures)."""
    return line.startswith(("DGLS", "  ")) and not line.startswith("DGLS profile:")


def _profiling(path: Path | None) -> dict:
    """SwapConfig settings for a row profiled with --profile_dir: the profiler built, its window placed later."""
    if path is None:
        return {}
    return {"profile": str(path), "profile_warmup_steps": PROFILE_LATER, "profile_steps": 1}


def profile_one_step(swapper: LayerSwapper, step: Callable[[], object], passes: int, log: list[str]) -> dict:
    """With a profiler built (--profile_dir), one more step, untimed, recorded (its ``passes`` backward passes:
    micro-batches one after another are a pass each, a layer-major step one): the trace is written at its end, so
    writing it never lands in a timed step. The row's figures: the trace's path and its step summary."""
    profiler = swapper.feature(Profiler)
    if profiler is None:
        return {}
    profiler.record_after(0, passes)
    step()
    sync(swapper.device)
    if not profiler.done:
        return {"profile_error": "the profiled step ended before its last pass"}
    trace = json.loads(profiler.path.read_text())
    written = [line for line in log if line.startswith("DGLS profile:")]
    return {"profile": str(profiler.path), "profile_summary": trace["otherData"]["summary"], "profile_log": written}


def _rows_of(choice: str) -> tuple[bool, ...]:
    """An off/on/both option: the rows it asks for, without and/or with the setting."""
    return {"off": (False,), "on": (True,), "both": (False, True)}[choice]


@contextmanager
def memory_cap(device: torch.device, gib: float | None) -> Iterator[None]:
    """At most ``gib`` of device memory for this process inside the block (None: no cap), as a card of that size
    would allow: the caching allocator frees its cached blocks and retries before it gives up, so the row's
    peak reserved stays under the cap or the row fails with an out-of-memory error."""
    if gib is None or device.type != "cuda":
        yield
        return
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(gib * GiB / torch.cuda.get_device_properties(device).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _slot_mib(swapper: LayerSwapper) -> float:
    """The pool's slot size: the largest streamed layer or swap unit."""
    return swapper.placement.slot_bytes / 2**20


def micro_batches(count: int, layer_major: bool) -> str:
    """An accum row's label: "4 micro-batches layer-major", "1 micro-batch one after another"."""
    return f"{count} micro-batch{'es' if count > 1 else ''} {'layer-major' if layer_major else 'one after another'}"
