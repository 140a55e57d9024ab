"""Shared fetches on 2 GPUs (NCCL), at Flux block width, with delays injected: each process copies half of every
streamed layer from host memory and gathers the other half from the other GPU (utils/dgls/memory/fetch_share.py).

tests/fetch_share_runs.py: each process trains the same model alone; a sleep before every copy on every copy stream
(20 ms before each weight copy) and, on one process, before every layer use on the compute stream, so a gather that
read a share before it landed, a slot the other process still reads, or another layer's share would change the
numbers. With deterministic kernels each process's run must be bitwise its all-resident run; the canary (no gather)
must differ. bf16 blocks, and fp8 storage (the landing buffers' region gathered too, then upcast).
"""

from __future__ import annotations

import pytest
import torch
from fetch_share_runs import run_ranks
from helpers import assert_bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

CASES = {
    "prefetch2": {"prefetch": 2, "share_fetch": "on"},
    "threaded-2streams": {"prefetch": 2, "share_fetch": "on", "threading": True, "cuda_streams": 2},
    "fp8": {"prefetch": 2, "share_fetch": "on", "cast_target": [("bf16", "f8_e4m3")]},
}


@pytest.mark.parametrize("name", list(CASES))
def test_two_gpus_sharing_fetches_train_bitwise_what_they_train_resident(tmp_path, name):
    ranks = run_ranks(tmp_path, 2, cuda=True, settings=CASES[name])
    for record in ranks:
        assert record["shared"] and record["fetches"] > 0
        assert_bitwise_equal(record["resident"], record["streamed"])
    assert any("gather" in line and "GB/s" in line for line in ranks[0]["lines"]), ranks[0]["lines"]


def test_canary_two_gpus_that_skip_the_gather_differ(tmp_path):
    ranks = run_ranks(tmp_path, 2, cuda=True, settings=CASES["prefetch2"], mutate="no_gather")
    for record in ranks:
        with pytest.raises(AssertionError):
            assert_bitwise_equal(record["resident"], record["streamed"])


def test_auto_shares_where_the_gpus_gather_faster_than_the_host_copies_and_says_so(tmp_path):
    """On the lent machines (NVLink between the GPUs) auto shares; elsewhere it says why not. Either way one line
    with both measured rates, and the training is exact."""
    ranks = run_ranks(tmp_path, 2, cuda=True, settings={"prefetch": 2, "share_fetch": "auto"})
    line = next(line for line in ranks[0]["lines"] if "shared fetches" in line)
    assert "gather" in line and "host copy" in line
    assert ranks[0]["shared"] == ranks[1]["shared"] == ("off" not in line.split(":")[1][:5])
    print(line)
    for record in ranks:
        assert_bitwise_equal(record["resident"], record["streamed"])


def test_auto_that_finds_the_gather_too_slow_copies_whole_layers_and_says_why(tmp_path):
    """The decline path (forced: the margin made unreachable): one line with both rates, the group released, every
    layer copied whole by each process, exact."""
    ranks = run_ranks(tmp_path, 2, cuda=True, settings={"prefetch": 2, "share_fetch": "auto"}, mutate="slow_gather")
    line = next(line for line in ranks[0]["lines"] if "shared fetches" in line)
    assert "off, the gather between the 2 GPUs" in line and "host copy" in line, line
    for record in ranks:
        assert not record["shared"]
        assert_bitwise_equal(record["resident"], record["streamed"])
