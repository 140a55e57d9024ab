"""The disk plan on CUDA (marked gpu): the copy bandwidth the builder measures, and a LoRA planned by the VRAM planner
with layers on disk: the probe's profile carries their reads, the plan is said with what it reads from disk, and the
numbers equal the resident run bitwise (the planner makes layers on disk resident mid-run, read from their extents)."""

import pytest
import test_ordering_gpu as ordering
from helpers import assert_bitwise_equal, make_layers, train

from utils.dgls import LayerSwapper
from utils.dgls.engine.disk_planning import copy_bytes_per_ms
from utils.dgls.memory.transport import Direction

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


def test_without_a_vram_budget_the_measured_line_counts_a_slow_read_as_a_stall_not_as_compute(model, tmp_path):
    """Every block on disk, each read held back 300 ms on the host, no compute delay: the compute waits for the reads.
    The line said after pass 2 (planning/disk_check.py) must subtract those stalls from each use (a timed acquire's
    Wait starts before the host waits for the copy's issue, memory/copier.py) and say the reads add time; counted as
    compute, they would look like a long step the reads hide behind."""
    lines, device = [], ordering.device()
    layers, trainable = ordering.fresh(model)
    with LayerSwapper(layers, ordering.disk_config(model, tmp_path), device=device, log=lines.append) as swapper:
        swapper.transport.delay[Direction.DISK_IN] = 300_000_000  # ns: a host sleep before each read
        got = train(layers, trainable, device, "nonreentrant", steps=2, dtype=BF16, cfg=WIDTH)
    (measured,) = [line for line in lines if line.startswith("DGLS disk plan, measured: ")]
    assert "(measured on pass 2)" in measured and "the reads add" in measured, measured
    assert_bitwise_equal(ordering.resident_run(model, "nonreentrant"), got)
