"""Shared fetches on the CPU transport (gloo): data-parallel processes each copy a share of every streamed layer and
gather the rest (utils/dgls/memory/fetch_share.py); tests/fetch_share_runs.py says what the processes train.

The CPU transport lands a copy only when something waits for it, and a gather runs when its write lands: a missing
gather, or a gather of another layer's shares, computes with NaN or wrong bytes, so these tests can fail (the canary
shows one that does).
"""

from __future__ import annotations

import pytest
import torch
from fetch_share_runs import run_ranks
from helpers import assert_bitwise_equal, make_layers

from utils.dgls.memory.fetch_share import ALIGN, MARGIN, FetchShare, pays
from utils.dgls.memory.host_store import HostStore
from utils.dgls.memory.layout import measure

SHARED = {"prefetch": 2, "share_fetch": "on"}


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_shares_cover_each_region_once_and_the_gather_fits_its_padding(size):
    """Every byte of a region is in exactly one share, each share starts aligned, and the gathered span stays
    within the region plus the padding every slot and landing buffer holds."""
    for nbytes in (1, ALIGN - 1, ALIGN * size, ALIGN * size + 1, 10_000_019):
        regions = [FetchShare(None, i, size).split(nbytes) for i in range(size)]
        covered = [b for r in regions for b in range(r.lo, r.hi)] if nbytes < 20_000 else None
        if covered is not None:
            assert covered == list(range(nbytes))
        assert sum(r.hi - r.lo for r in regions) == nbytes
        assert all(r.step == regions[0].step for r in regions)
        assert all(r.lo % ALIGN == 0 or r.lo == r.hi == nbytes for r in regions), "aligned, or an empty last share"
        assert size * regions[0].step <= nbytes + FetchShare(None, 0, size).padding


def test_a_share_copies_only_its_bytes_of_a_packed_layer():
    layers, _ = make_layers()
    layout = measure(layers)[1]
    store = HostStore(torch.device("cpu"), 1 << 30, 0)
    host = store.add_layer(layout)
    slot = torch.zeros(layout.host_bytes + 2 * ALIGN, dtype=torch.uint8)
    pairs, regions = FetchShare(None, 1, 2).copies(host, slot, None)
    ((device, region),) = regions
    assert device is slot and region.lo > 0 and region.hi == layout.direct_bytes
    assert sum(src.numel() for src, _ in pairs) == region.hi - region.lo
    for src, dst in pairs:
        dst.copy_(src)
    assert torch.equal(slot[region.lo : region.hi], host.buffer[region.lo : region.hi])
    assert not slot[: region.lo].any(), "nothing of the other share was copied"


@pytest.mark.parametrize(
    "world,settings",
    [
        (2, SHARED),
        (3, {**SHARED, "threading": True}),
        pytest.param(2, {**SHARED, "prefetch": 0}, marks=pytest.mark.slow),
        pytest.param(2, {**SHARED, "cast_target": [("f32", "f8_e4m3")]}, marks=pytest.mark.slow),
    ],
    ids=["2-processes", "3-processes-threaded", "2-processes-prefetch0", "2-processes-fp8"],
)
def test_processes_sharing_fetches_each_train_exactly_what_they_train_resident(tmp_path, world, settings):
    ranks = run_ranks(tmp_path, world, cuda=False, settings=settings)
    for record in ranks:
        assert record["shared"] and record["fetches"] > 0
        assert_bitwise_equal(record["resident"], record["streamed"])
    assert any(f"each of the {world} data-parallel processes" in line for line in ranks[0]["lines"]), ranks[0]["lines"]


def test_canary_processes_that_skip_the_gather_differ(tmp_path):
    ranks = run_ranks(tmp_path, 2, cuda=False, settings=SHARED, mutate="no_gather")
    for record in ranks:
        with pytest.raises(AssertionError):
            assert_bitwise_equal(record["resident"], record["streamed"])


@pytest.mark.slow  # two launches of two processes
def test_auto_does_not_share_on_the_cpu_and_off_never_does(tmp_path):
    for mode in ("auto", "off"):
        ranks = run_ranks(tmp_path, 2, cuda=False, settings={"prefetch": 2, "share_fetch": mode})
        assert not any(r["shared"] for r in ranks)
        assert not any("shared fetches" in line for line in ranks[0]["lines"])
        assert_bitwise_equal(ranks[0]["resident"], ranks[0]["streamed"])


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_copy_spans_two_page_lock_registrations_of_the_host_buffer(monkeypatch, size):
    """A layer's buffer is page-locked in registrations of COPY_CHUNK bytes from its first byte, and CUDA refuses a copy
    that spans two: every pair (a share's, the whole layer's, the fp8 landing's) stays within one, wherever the share
    or the landing region starts. (size 1: the layer's own copies, HostLayer.copies.)"""
    from utils.dgls.memory import host_store
    from utils.dgls.memory.precision import CastRules
    from utils.dgls.streaming.config import ComputePolicy

    chunk = 4096
    monkeypatch.setattr(host_store, "COPY_CHUNK", chunk)
    layers, _ = make_layers()
    fp8 = CastRules.from_policy(ComputePolicy(cast_target=[("f32", "f8_e4m3")]))
    for rules in (None, fp8):  # the slot's region; the fp8 landing region (starting past the direct bytes)
        layout = measure(layers, rules)[1]
        region = layout.host_bytes - layout.direct_bytes if rules is not None else layout.direct_bytes
        assert region > 3 * chunk, "several chunks"
        host = HostStore(torch.device("cpu"), 1 << 30, 0).add_layer(layout)
        slot = torch.zeros(layout.host_bytes + 4 * ALIGN, dtype=torch.uint8)
        landing = torch.zeros(layout.host_bytes + 4 * ALIGN, dtype=torch.uint8)
        base = host.buffer.data_ptr()
        for index in range(size):
            if size == 1:
                pairs = host.copies(slot, landing)
            else:
                pairs, _ = FetchShare(None, index, size).copies(host, slot, landing)
            assert pairs
            for src, _ in pairs:
                start = src.data_ptr() - base
                assert start // chunk == (start + src.numel() - 1) // chunk, (index, start, src.numel())


def test_auto_shares_where_a_gather_beats_the_break_even_rate():
    """Alone a layer of B bytes takes B / copy; shared, B / (N x copy) + B / gather: sharing pays where gather >
    copy x N / (N - 1), by the margin. NVLink (hundreds of GB/s) against PCIe host copies (~55) pays; a gather over
    PCIe (about the host copy's rate) does not."""
    assert pays(374, 42, 4) and pays(468, 55, 2)
    assert not pays(25, 25, 2) and not pays(50, 25, 2)
    for size in (2, 4, 8):
        even = 40 * size / (size - 1)
        assert not pays(even * MARGIN * 0.99, 40, size) and pays(even * MARGIN * 1.01, 40, size)


def test_on_in_a_process_with_nothing_to_share_says_so_and_copies_whole_layers():
    """``--share_fetch on`` is never ignored in silence: one process alone (or a pipeline stage alone on its layers)
    has no one to gather from, and says so."""
    from helpers import train

    from utils.dgls import LayerSwapper, SwapConfig

    layers, trainable = make_layers()
    lines: list[str] = []
    with LayerSwapper(layers, SwapConfig.of(prefetch=1, share_fetch="on"), device="cpu", log=lines.append) as swapper:
        assert swapper.copier.share is None
        train(layers, trainable, torch.device("cpu"), steps=1)
    said = [line for line in lines if "shared fetches" in line]
    assert len(said) == 1 and "no other process of this job on this machine holds these layers" in said[0], said
