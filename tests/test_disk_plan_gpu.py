"""The disk plan on CUDA (marked gpu): the copy bandwidth the builder measures, and a LoRA planned by the VRAM planner
with layers on disk: the probe's profile carries their reads, the plan is said with what it reads from disk, and the
numbers equal the resident run bitwise (the planner makes layers on disk resident mid-run, read from their extents)."""

import pytest
import test_ordering_gpu as ordering
from helpers import assert_bitwise_equal, make_layers, train

from utils.dgls import LayerSwapper
from utils.dgls.engine.disk_planning import copy_bytes_per_ms

pytestmark = pytest.mark.gpu
deterministic = ordering.deterministic  # the ordering tests' autouse fixture: deterministic kernels
BF16, WIDTH = ordering.BF16, ordering.FLUX_WIDTH


@pytest.fixture(scope="module")
def model():
    return make_layers(BF16, WIDTH)[0]


def test_the_copy_bandwidth_is_measured_on_cuda():
    assert copy_bytes_per_ms(ordering.device()) > 1e6  # over 1 GB/s: any PCIe or NVLink host link


def test_a_vram_budget_with_layers_on_disk_plans_knowing_their_reads_and_trains_bitwise(model, tmp_path):
    lines, device = [], ordering.device()
    layers, trainable = ordering.fresh(model)
    config = ordering.disk_config(model, tmp_path, vram_budget=40.0)  # every block fits: the plan keeps them resident
    with LayerSwapper(layers, config, device=device, log=lines.append) as swapper:
        on_disk = list(swapper.store.disk_layers)
        got = train(layers, trainable, device, "nonreentrant", steps=4, dtype=BF16, cfg=WIDTH)
        profile = swapper.driver.profile
        assert sorted(profile.disk_reads) == on_disk and profile.read_bytes_per_ms > 0
    assert on_disk and any(line.startswith("DGLS disk plan: ") for line in lines)
    resident, resident_trainable = ordering.fresh(model)
    for layer in resident:
        layer.to(device)
    assert_bitwise_equal(
        train(resident, resident_trainable, device, "nonreentrant", steps=4, dtype=BF16, cfg=WIDTH), got
    )
