"""Two processes over gloo plan one placement for the same layers (utils/dgls/planning/agreement.py), end to end.

Each rank (a process of ``torch.multiprocessing.spawn``) trains the small demo model through a LayerSwapper with a
VRAM budget, as data-parallel replicas do; rank 1's budget is larger (``--vram_budget auto`` on a GPU with more free
memory) and one of its layers sleeps in every call (a slower GPU, or another load on it), so its probe differs. Both
plan for the smaller budget from the agreed probe (each use's longest compute time), which is what one planner given
that profile chooses, and, measuring plans, settle on the same placement from the same (slowest) step times. Without
the agreement, rank 0 would plan from its own probe: the profile checks fail. The scripted in-process version, with
the control that the ranks disagree alone: tests/test_plan_agreement.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import make_layers, train

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.memory.layout import measure
from utils.dgls.planning.autoplan import PlacementDriver
from utils.dgls.planning.planner import GiB, minimum_bytes, plan_for_budget

CPU = torch.device("cpu")
SLOW_LAYER, SLEEP_S = 2, 0.02  # rank 1's layer that sleeps in every call


def budgets() -> tuple[int, int]:
    """Rank 0's budget (in the middle of the demo model's: several plans fit) and rank 1's (larger), in bytes."""
    layers, _ = make_layers()
    sizes = [layout.sizes for layout in measure(layers)]
    middle = (minimum_bytes(sizes, None) + sum(s.streamable_bytes + s.fixed_bytes for s in sizes)) // 2
    return middle, middle + (middle - minimum_bytes(sizes, None)) // 2


def _record(driver: PlacementDriver, swapper: LayerSwapper, lines: list[str]) -> dict:
    return dict(
        budget=driver.budget,
        profile=driver.profile,
        own=driver.own_profile,
        plan=driver.plan,
        samples=[t.samples_ms for t in driver.trials],
        streamed=tuple(swapper.placement.streamed),
        prefetch=swapper.placement.prefetch,
        sizes=tuple(swapper.placement.sizes),
        done=driver.done,
        lines=lines,
    )


def _rank(rank: int, port: int, folder: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        budget = budgets()[rank]
        record = {}
        for mode, steps in (("plan", 3), ("measure", 20)):
            layers, trainable = make_layers()
            if rank == 1:
                layers[SLOW_LAYER].register_forward_hook(lambda *_: time.sleep(SLEEP_S))
            lines: list[str] = []
            config = SwapConfig.of(vram_budget=budget / GiB, swap_unit_mb=0, plan=mode == "plan")
            with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
                train(layers, trainable, CPU, "nonreentrant", steps=steps)
                record[mode] = _record(swapper.driver, swapper, lines)
        torch.save(record, folder / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def largest(a, b):
    """The agreed profile the module doc expects: each use's longest compute (the rest is the same on the CPU)."""
    uses = tuple(dataclasses.replace(x, compute_ms=max(x.compute_ms, y.compute_ms)) for x, y in zip(a.uses, b.uses))
    return dataclasses.replace(a, uses=uses)


@pytest.mark.slow  # two processes with torch and gloo, each probing and measuring plans
def test_two_processes_plan_one_placement_for_the_smaller_budget_from_the_agreed_probe(tmp_path):
    from utils.dgls.program.distributed import free_port

    torch.multiprocessing.spawn(_rank, args=(free_port(), tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    smaller, larger = budgets()
    # --plan: the probe's decision alone
    one, two = (r["plan"] for r in ranks)
    assert one["done"] and two["done"]
    assert one["budget"] == two["budget"] == smaller, "one plan for the smaller budget"
    assert any("one placement for the 2 data-parallel processes" in line for line in one["lines"])
    assert any("planned for the smallest" in line for line in one["lines"]), one["lines"]
    slow = [u.compute_ms for u in two["own"].uses if u.layer == SLOW_LAYER]
    assert max(slow) >= 1e3 * SLEEP_S * 0.9, "rank 1's own probe saw its slow layer"
    agreed = largest(one["own"], two["own"])
    assert one["profile"] == two["profile"] == agreed, "each use's longest compute time, on both"
    sizes = one["sizes"]
    aim = PlacementDriver(smaller, CPU, log=None, profile=agreed)._planning_budget(sizes)
    expected = plan_for_budget(sizes, agreed, aim)
    assert one["plan"] == two["plan"] == expected, "the plan one planner makes from the agreed profile"
    assert (one["streamed"], one["prefetch"]) == (two["streamed"], two["prefetch"])
    assert any("shared by the 2 data-parallel processes" in line for line in one["lines"])
    # measuring the shortlist: the same step times on both (the slower's), so the same winner
    one, two = (r["measure"] for r in ranks)
    assert one["done"] and two["done"]
    assert one["profile"] == two["profile"] == largest(one["own"], two["own"])
    assert len(one["samples"]) > 1 and one["samples"] == two["samples"]
    assert one["plan"] == two["plan"] and (one["streamed"], one["prefetch"]) == (two["streamed"], two["prefetch"])
    assert any(line.startswith("DGLS: chose") for line in one["lines"])
