"""On CUDA: full fine-tuning with the masters and optimizer state of some layers on disk equals the all-in-RAM run
bitwise, with every direction delayed (disk reads and write-backs a host sleep each on the reader's thread); the
profile draws the disk reads and writes (their host spans, on the trace's clock).
"""

import json

import pytest
import torch
from full_ft import SPEC, assert_same, full_layers, train_dgls
from test_ordering_gpu import delay_every_copy

from utils.dgls import LayerSwapper, SwapConfig

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
STATES = 0.0025  # SMALL in bf16 with two micro-batches a step: five of six states on disk, the weights in RAM


def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def run(tmp_path, budget=None, delayed=False, **kw):
    layers = full_layers(BF16)
    extra = {"host_ram_budget": budget, "disk_dir": str(tmp_path)} if budget is not None else {}
    cfg = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=2, prefetch=1, **extra, **kw)
    with LayerSwapper(layers, cfg, device=cuda(), log=None) as swapper:
        state = swapper.training.disk_state
        assert (state is not None) == (budget is not None)
        if delayed:
            delay_every_copy(swapper)
        return train_dgls(layers, swapper, cuda(), "nonreentrant", steps=3, dtype=BF16)


def test_states_on_disk_with_every_direction_delayed_equal_all_in_ram(tmp_path):
    assert_same(run(None), run(tmp_path, STATES, delayed=True))


def test_the_profile_draws_disk_reads_and_write_backs(tmp_path):
    trace = tmp_path / "trace.json"
    # three passes: the clipped update of the first step (two micro-batches) runs after its second pass
    run(tmp_path, STATES, profile=str(trace), profile_warmup_steps=0, profile_steps=3)
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["name"] for e in events if e.get("cat") == "transfer"}
    assert {"disk reads", "disk writes"} <= lanes
    steps = [e for e in events if e.get("cat") == "step"]
    first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    disk = [e for e in events if e.get("name") in ("disk reads", "disk writes")]
    assert all(first - 1e5 <= e["ts"] <= last + 1e5 for e in disk), "placed on the trace's clock"
