"""Probe (not a benchmark): the host cost of DGLS's torch.profiler ranges per layer use while no profiler records.

python benchmarks/probe_range_cost.py

Every layer streamed, prefetch 1, on the CPU. First it counts, over real ``LayerSwapper.use`` calls, the
transport's ranges (``transport.profiler_range``: a ``with`` on a shared no-op context) and the residency
transitions (``StreamedLayer._expect``/``_enter``: a bool read and an attribute test each) per use; it counts
them by replacing the two module functions with counting wrappers for that stretch only (and putting them
back). Then it times each kind in a tight loop against an empty loop, and prints ranges per use x cost each.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.dgls import LayerSwapper, SwapConfig  # noqa: E402
from utils.dgls.memory import transport  # noqa: E402
from utils.dgls.streaming import residency  # noqa: E402
from utils.dgls.streaming.schedule import Phase  # noqa: E402

LAYERS, ROUNDS, LOOPS = 24, 50, 300_000


def ranges_per_use() -> tuple[float, float]:
    """Transport ranges and residency transitions per ``use``, every layer streamed with prefetch 1."""
    counts = {"transport": 0, "residency": 0}
    profiler_range, recording = transport.profiler_range, residency.profiler_recording

    def counted_range(name: str):
        counts["transport"] += 1
        return profiler_range(name)

    def counted_recording() -> bool:
        counts["residency"] += 1
        return recording()

    layers = [nn.Linear(16, 16).requires_grad_(False) for _ in range(LAYERS)]
    config = SwapConfig.of(blocks_to_swap=LAYERS, prefetch=1, swap_unit_mb=0)
    with LayerSwapper(layers, config, device="cpu", log=None) as swapper:
        for idx in range(LAYERS):  # warm: every layer has been fetched once
            swapper.use(idx, Phase.NO_GRAD)
        transport.profiler_range, residency.profiler_recording = counted_range, counted_recording
        try:
            for _ in range(ROUNDS):
                for idx in range(LAYERS):
                    swapper.use(idx, Phase.NO_GRAD)
        finally:
            transport.profiler_range, residency.profiler_recording = profiler_range, recording
    uses = ROUNDS * LAYERS
    return counts["transport"] / uses, counts["residency"] / uses


def best_us(loop) -> float:
    """The fastest of seven runs of ``loop`` (LOOPS iterations), in microseconds per iteration."""
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        loop()
        best = min(best, (time.perf_counter() - start) / LOOPS * 1e6)
    return best


def main() -> None:
    per_range, per_transition = ranges_per_use()

    def empty() -> None:
        for _ in range(LOOPS):
            pass

    def transport_ranges() -> None:
        for _ in range(LOOPS):
            with transport.profiler_range("DGLS weights in"):
                pass

    class Layer:
        _range = None

    layer = Layer()

    def transition_checks() -> None:  # what a transition adds: _expect's check, _enter's open-range test
        recording = residency.profiler_recording
        for _ in range(LOOPS):
            if recording():
                pass
            if layer._range is not None:
                pass

    base = best_us(empty)
    range_us, check_us = best_us(transport_ranges) - base, best_us(transition_checks) - base
    total = per_range * range_us + per_transition * check_us
    print(
        f"per use: {per_range:.2f} transport ranges x {range_us:.3f} us + {per_transition:.2f} residency transitions "
        f"x {check_us:.3f} us = {total:.2f} us of host time (no profiler recording)"
    )


if __name__ == "__main__":
    main()
