"""Two processes over gloo plan one placement for the same layers (utils/dgls/planning/agreement.py), end to end.

Each rank (a process of ``torch.multiprocessing.spawn``) trains the small demo model through a LayerSwapper with a
VRAM budget, as data-parallel replicas do; rank 1's budget is larger (``--vram_budget auto`` on a GPU with more free
memory) and one of its layers sleeps in every call (a slower GPU, or another load on it), so its probe differs. Both
plan for the smaller budget from the agreed probe (each use's longest compute time), which is what one planner given
that profile chooses, and, measuring plans, settle on the same placement from the same (slowest) step times. Without
the agreement, rank 0 would plan from its own probe: the profile checks fail. The scripted in-process version, with
the control that the ranks disagree alone: tests/test_plan_agreement.py. Also: the demo's data-parallel processes
under deepspeed, and the replicas of one pipeline stage agreeing among themselves only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL, make_layers, train

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.demo.model import DemoModelConfig
from utils.dgls.memory.layout import measure
from utils.dgls.planning.agreement import PlanAgreement
from utils.dgls.planning.autoplan import PlacementDriver
from utils.dgls.planning.planner import GiB, minimum_bytes, plan_for_budget

CPU = torch.device("cpu")
SLOW_LAYER, SLEEP_S = 2, 0.02  # rank 1's layer that sleeps in every call
# On two GPUs: blocks of about 12 MiB, and room for the allocator's slack and the CUDA-side allocations beside them
GPU_MODEL = DemoModelConfig(hidden=512, heads=8, double_blocks=3, single_blocks=3, text_dim=64, latent_channels=16)
GPU_ROOM = 128 * 2**20


def budgets(cuda: bool = False) -> tuple[int, int]:
    """Rank 0's budget (in the middle of the demo model's: several plans fit) and rank 1's (larger), in bytes."""
    layers, _ = make_layers(cfg=GPU_MODEL if cuda else SMALL)
    sizes = [layout.sizes for layout in measure(layers)]
    middle = (minimum_bytes(sizes, None) + sum(s.streamable_bytes + s.fixed_bytes for s in sizes)) // 2
    middle += GPU_ROOM if cuda else 0
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


def _rank(rank: int, port: int, folder: Path, cuda: bool) -> None:
    """One process: on the CPU over gloo, or on GPU ``rank`` with NCCL as the default group (DeepSpeed's), the
    planner's agreement then on its own gloo group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device, cfg = (torch.device("cuda", rank), GPU_MODEL) if cuda else (CPU, SMALL)
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2)
    try:
        budget = budgets(cuda)[rank]
        record = {}
        for mode, steps in (("plan", 3), ("measure", 20)):
            layers, trainable = make_layers(cfg=cfg)
            if rank == 1:
                layers[SLOW_LAYER].register_forward_hook(lambda *_: time.sleep(SLEEP_S))
            lines: list[str] = []
            config = SwapConfig.of(vram_budget=budget / GiB, swap_unit_mb=0, plan=mode == "plan")
            with LayerSwapper(layers, config, device=device, log=lines.append) as swapper:
                train(layers, trainable, device, "nonreentrant", steps=steps, cfg=cfg)
                record[mode] = _record(swapper.driver, swapper, lines)
        torch.save(record, folder / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def largest(a, b):
    """The agreed profile the module doc expects: each use's longest compute and the largest memory figures, the
    slowest copies (on the CPU only the compute times differ)."""
    uses = tuple(dataclasses.replace(x, compute_ms=max(x.compute_ms, y.compute_ms)) for x, y in zip(a.uses, b.uses))
    return dataclasses.replace(
        a,
        uses=uses,
        activation_bytes=max(a.activation_bytes, b.activation_bytes),
        reserved_overhead=max(a.reserved_overhead, b.reserved_overhead),
        bytes_per_ms=min(a.bytes_per_ms, b.bytes_per_ms),
    )


@pytest.mark.slow  # two processes with torch and gloo, each probing and measuring plans
def test_two_processes_plan_one_placement_for_the_smaller_budget_from_the_agreed_probe(tmp_path):
    assert_one_placement(tmp_path, cuda=False)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_plan_one_placement_for_the_smaller_budget_from_the_agreed_probe(tmp_path):
    """The same on two GPUs: NCCL the default group, the agreement over its own gloo group, the peaks measured."""
    assert_one_placement(tmp_path, cuda=True)


def assert_one_placement(tmp_path: Path, cuda: bool) -> None:
    from utils.dgls.program.distributed import free_port

    torch.multiprocessing.spawn(_rank, args=(free_port(), tmp_path, cuda), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    smaller, larger = budgets(cuda)
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
    aim = PlacementDriver(smaller, CPU, log=None, profile=agreed)._planning_budget(sizes)  # device-free arithmetic
    expected = plan_for_budget(sizes, agreed, aim)
    assert one["plan"] == two["plan"] == expected, "the plan one planner makes from the agreed profile"
    assert (one["streamed"], one["prefetch"]) == (two["streamed"], two["prefetch"])
    assert any("shared by the 2 data-parallel processes" in line for line in one["lines"])
    # measuring the shortlist: the same step times on both (the slower's), so the same winner
    one, two = (r["measure"] for r in ranks)
    assert one["done"] and two["done"]
    assert one["profile"] == two["profile"] == largest(one["own"], two["own"])
    assert one["samples"] == two["samples"] and (len(one["samples"]) > 1 or cuda)  # a GPU may fit all: one check
    assert one["plan"] == two["plan"] and (one["streamed"], one["prefetch"]) == (two["streamed"], two["prefetch"])
    assert any(line.startswith("DGLS: chose") for line in one["lines"]) or cuda
    assert any("shared by the 2 data-parallel processes" in line for line in one["lines"])


@pytest.mark.slow  # the deepspeed launcher and two processes of the demo: about 40 s on 2 cores
def test_the_demo_s_data_parallel_processes_plan_one_placement(tmp_path):
    """dgls_train.py under deepspeed: the LoRA's two data-parallel processes (one pipeline stage) find each other at
    start-up and agree the probe; rank 0 alone says so."""
    from cli_helpers import demo_toml, run_user_command
    from conftest import ROOT
    from test_multi_process import two_processes

    config = demo_toml(tmp_path, steps=4, dgls={"vram_budget": 0.002})
    proc = run_user_command([*two_processes("dgls_train.py", "--deepspeed"), "--config", str(config)], ROOT)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    assert out.count("VRAM budget (one placement for the 2 data-parallel processes holding these layers)") == 1, out
    assert out.count("DGLS probe agreed by the 2 data-parallel processes") == 1


def _groups(rank: int, port: int, folder: Path) -> None:
    """Three processes: ranks 0 and 1 replicas of pipeline stage 0, rank 2 alone on stage 1 (other layers)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=3)
    try:
        layers, _ = make_layers()
        stage = 0 if rank < 2 else 1
        held = layers[:5] if stage == 0 else layers[5:]
        agreement = PlanAgreement.among(held, f"stage {stage}", 0 if stage == 0 else 5)
        said = None if agreement is None else (agreement.size, agreement.max_of([rank, -rank]))
        torch.save(said, folder / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # three processes with torch and gloo
def test_the_replicas_of_a_stage_agree_among_themselves_only(tmp_path):
    from utils.dgls.program.distributed import free_port

    torch.multiprocessing.spawn(_groups, args=(free_port(), tmp_path), nprocs=3)
    said = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert said == [(2, [1.0, 0.0]), (2, [1.0, 0.0]), None]
