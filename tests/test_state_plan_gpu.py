"""On CUDA: the state plan's choice of the layers whose masters and optimizer state live on disk trains bitwise as the
all-in-RAM run with every direction delayed, with the updates during the backward (no clipping: reads issued ahead by
earlier update jobs meet the gradients' copies home) and after it (clipping); the start-up line names those layers.
"""

import pytest
import torch
from full_ft import SPEC, assert_same, full_layers, train_dgls
from test_ordering_gpu import delay_every_copy

from utils.dgls import LayerSwapper, SwapConfig
from utils.dgls.planning.row_copies import index_ranges

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
STATES = 0.0025  # SMALL in bf16 with two micro-batches a step: most states on disk, the weights in RAM


def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def run(tmp_path, clip, budget=None, delayed=False, log=None):
    layers = full_layers(BF16)
    extra = {"host_ram_budget": budget, "disk_dir": str(tmp_path)} if budget is not None else {}
    cfg = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=2, prefetch=1, clip_grads=clip, **extra)
    with LayerSwapper(layers, cfg, device=cuda(), log=log) as swapper:
        state = swapper.training.disk_state
        spilled = sorted(state.spilled) if state is not None else []
        if delayed:
            delay_every_copy(swapper)
        record = train_dgls(layers, swapper, cuda(), "nonreentrant", steps=3, dtype=BF16,
                            max_norm=0.05 if clip else None)  # fmt: skip
    return record, spilled


@pytest.mark.parametrize("clip", [False, True])
def test_the_chosen_states_on_disk_with_every_direction_delayed_equal_all_in_ram(tmp_path, clip):
    lines = []
    got, spilled = run(tmp_path, clip, STATES, delayed=True, log=lines.append)
    assert spilled and any(f"(layers {index_ranges(spilled)})" in line for line in lines if "disk state plan" in line)
    assert_same(run(None, clip)[0], got)
