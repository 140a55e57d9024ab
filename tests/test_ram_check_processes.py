"""Pipeline stages on one machine: each process trains its own layers from one host's RAM (utils/dgls/memory/peers.py's
``others_on_machine``), so the full fine-tune's RAM checks count the job's other processes there too, at start-up and
when a VRAM budget's plan is fixed, and every process stops with the same line (``agree``) before any allocates.

Two processes of ``torch.multiprocessing.spawn`` over gloo, each a stage (its own ``share_group``) holding the small
demo model's layers, with the host's free RAM faked in each: room for one stage's need and not for both. Alone, one
process starts on that host; together both are refused, naming the other process's need, also where only one of them
reads too little free RAM (the other stops with its line). Without the count, each would pass its own check and the
two together would run out of RAM after allocating.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
from full_ft import SPEC, full_layers
from test_planner_full import middle_budget, train_full

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.memory import host_store
from utils.dgls.program.distributed import free_port
from utils.dgls.training import host_training

pytestmark = pytest.mark.slow  # three launches of two processes with torch: about 30 s
CPU = torch.device("cpu")
RESERVE = 2 * 2**30  # ram_reserve of the faked 16 GiB host


class Host:
    total = 16 * 2**30
    available = 0


def _needs() -> tuple[int, int]:
    """One stage's start-up need, and the optimizer state the first updates make of the layers its plan streams."""
    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, clip_grads=False, vram_budget=middle_budget(layers))
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        start = host_training.host_training_need(swapper.training.layout, probe=True)
        train_full(layers, swapper, steps=1, clip=False)
        streamed = swapper.training.layout.deferred_state()
    assert 0 < streamed
    return start, streamed


def _stage(rank: int, port: int, folder: Path, start_free: tuple[int, int], plan_free: int) -> None:
    """One pipeline stage: build with ``start_free[rank]`` bytes free, then train under the budget with ``plan_free``
    free when the plan is fixed; writes what happened."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    host_store.psutil.virtual_memory = lambda: Host  # this process's own module: the parent's is untouched
    Host.available = start_free[rank]
    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, clip_grads=False, vram_budget=middle_budget(layers))
    outcome = "trained"
    try:
        with LayerSwapper(layers, config, device=CPU, log=None, share_group=f"stage{rank}") as swapper:
            Host.available = plan_free
            train_full(layers, swapper, clip=False)
    except DGLSUserError as exc:
        outcome = str(exc)
    (folder / f"rank{rank}.json").write_text(json.dumps(outcome))
    torch.distributed.barrier()  # neither tears its gloo connections down while the other still uses them
    torch.distributed.destroy_process_group()


def two_stages(folder: Path, start_free: tuple[int, int], plan_free: int) -> list[str]:
    torch.multiprocessing.spawn(_stage, args=(free_port(), folder, start_free, plan_free), nprocs=2)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_pipeline_stages_on_one_machine_count_each_others_ram_and_stop_together(tmp_path, monkeypatch):
    start, later = _needs()
    alone = RESERVE + start + start // 2  # one stage's need fits, two do not
    roomy = RESERVE + 4 * (start + later)
    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)
    Host.available = alone
    config = SwapConfig.of(host_optimizer=SPEC, clip_grads=False, vram_budget=middle_budget(full_layers()))
    with LayerSwapper(full_layers(), config, device=CPU, log=None):
        pass  # the control: one process alone starts on this host

    # rank 1 reads more free RAM than rank 0 (another moment): rank 0 refuses, and rank 1 stops with its line
    both = two_stages(tmp_path / "start", (alone, roomy), roomy)
    assert both[0] == both[1], "every process stops with the same line"
    assert "the job's 1 other process on this machine" in both[0] and "of host RAM (masters" in both[0], both[0]

    plan = RESERVE + later + later // 2  # room for one stage's state at the plan, not for both
    both = two_stages(tmp_path / "plan", (roomy, roomy), plan)
    assert both[0] == both[1], "every process stops with the same line"
    assert both[0].startswith("the VRAM budget's plan streams "), both[0]
    assert "at their first update, the job's 1 other process on this machine" in both[0], both[0]

    assert two_stages(tmp_path / "room", (roomy, roomy), roomy) == ["trained", "trained"]


@pytest.fixture(autouse=True)
def _folders(tmp_path):
    for name in ("start", "plan", "room"):
        (tmp_path / name).mkdir()
