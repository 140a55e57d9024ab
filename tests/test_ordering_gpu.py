"""Ordering on CUDA at Flux block width, with delays injected on the copy streams and the compute stream (and on
the disk tier's reads: a host sleep before each).

Blocks of Flux-dev's width (hidden 3072: a double block is about 680 MB in bf16, a single block about
280 MB), a few of them, tiny token counts: copies dominate. ``torch.cuda._sleep`` runs on the copy
streams before every copy of every direction (the transport's one delay hook, :func:`delay_every_copy`)
and on the compute stream at the start of every layer use, so a missing wait, an early slot reuse or a
stale binding reads the wrong bytes. With deterministic kernels and
math attention, every mode must give losses, gradients, LoRA weights and eval outputs bitwise equal
to all-resident training; two canaries with a protection patched out must differ.
"""

import copy

import pytest
import torch
from helpers import assert_bitwise_equal, make_layers, round_as_stored, train

from utils.dgls import LayerSwapper, Listener, SwapConfig
from utils.dgls.demo.model import DemoModelConfig
from utils.dgls.memory.copier import CudaCopier
from utils.dgls.memory.disk_tier import DiskTier
from utils.dgls.memory.layout import measure
from utils.dgls.memory.precision import CastRules
from utils.dgls.memory.transport import Copy, Direction
from utils.dgls.streaming.config import ComputePolicy
from utils.dgls.streaming.tiers import RING_BUFFERS

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
FLUX_WIDTH = DemoModelConfig(hidden=3072, heads=24, double_blocks=2, single_blocks=2, text_dim=64, latent_channels=16)
MS = 2_000_000  # torch.cuda._sleep cycles per millisecond at ~2 GHz (the H100's and H200's boost clock)
MODES = ["none", "nonreentrant", "reentrant"]
FP8 = [("bf16", "f8_e4m3")]


def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)  # its backward is broken on the lent GPUs' image
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.enable_flash_sdp(flags[0])
    torch.backends.cuda.enable_mem_efficient_sdp(flags[1])


@pytest.fixture(scope="module")
def template():
    """The model, built once on the CPU (random init at this width takes seconds); runs take copies."""
    return make_layers(BF16, FLUX_WIDTH)[0]


def fresh(template, fp8_rounding=False):
    layers = copy.deepcopy(template)
    if fp8_rounding:  # the reference for fp8 storage: every cast param rounded as DGLS rounds it
        round_as_stored(layers, CastRules.from_policy(ComputePolicy(cast_target=FP8)), device())
    trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    return layers, trainable


class ComputeDelay(Listener):
    """Sleep on the compute stream at the start of every layer use (forward, recompute, backward)."""

    def __init__(self, ms: float) -> None:
        self.cycles = int(ms * MS)

    def use_started(self, layer, phase, streamed, missed):
        torch.cuda._sleep(self.cycles)


def delay_every_copy(swapper, weights_ms: float = 20.0, others_ms: float = 10.0) -> None:
    """The one delay hook, on every direction at once: a ``torch.cuda._sleep`` on the copy stream before every
    copy (``weights_ms`` before each weight copy, ``others_ms`` before each copy of every other direction:
    gradients home, activations out and in, optimizer state in and out), and device destinations that hold
    NaN bytes until their copy lands (activation restores), so a reader that does not wait reads NaN."""
    for direction in Direction:
        ms = weights_ms if direction is Direction.WEIGHTS_IN else others_ms
        swapper.transport.delay[direction] = int(ms * MS)
    swapper.transport.poison = True


def resident_run(template, mode, fp8_rounding=False):
    layers, trainable = fresh(template, fp8_rounding)
    for layer in layers:
        layer.to(device())
    return train(layers, trainable, device(), mode, dtype=BF16, cfg=FLUX_WIDTH)


def swapped_run(template, mode, config, copy_ms=20.0, compute_ms=5.0, monkeypatch=None, expect_waits=True):
    layers, trainable = fresh(template)
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        if copy_ms:
            delay_every_copy(swapper, copy_ms)
        if compute_ms:
            swapper.add_listener(ComputeDelay(compute_ms))
        record = train(layers, trainable, device(), mode, dtype=BF16, cfg=FLUX_WIDTH)
        stats = swapper.total_stats(sync=True)
    assert stats.fetches > 0 and (stats.wait_ms > 0 or not expect_waits), "the delays should make compute wait"
    return record


@pytest.fixture(scope="module")
def references(template):
    cache = {}

    def get(mode, fp8=False):
        if (mode, fp8) not in cache:
            first, second = resident_run(template, mode, fp8), resident_run(template, mode, fp8)
            assert_bitwise_equal(first, second)  # deterministic kernels, or this test cannot judge
            cache[(mode, fp8)] = first
        return cache[(mode, fp8)]

    return get


CONFIGS = {
    "pf0": SwapConfig.of(prefetch=0),
    "pf1": SwapConfig.of(prefetch=1),
    "pf2": SwapConfig.of(prefetch=2),
    "pf3": SwapConfig.of(prefetch=3),
    "thread": SwapConfig.of(prefetch=2, threading=True),
    "batch-2streams": SwapConfig.of(prefetch=2, batch_move=True, cuda_streams=2),
    "pageable": SwapConfig.of(prefetch=2, pinned_ram_budget_gb=0.0),
    "fp8": SwapConfig.of(prefetch=2, cast_target=FP8),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_delayed_copies_and_compute_stay_bitwise_equal(template, references, monkeypatch, name, mode):
    got = swapped_run(template, mode, CONFIGS[name], monkeypatch=monkeypatch)
    assert_bitwise_equal(references(mode, fp8=name == "fp8"), got)


def test_fp8_landing_buffers_grow_when_a_larger_layer_starts_streaming(template, references, monkeypatch):
    """Re-placement sizes the landing buffers anew (streaming only single blocks first, then a double)."""
    layers, trainable = fresh(template)
    config = SwapConfig.of(gpu_layers=[0, 1, 2, 5], prefetch=1, cast_target=FP8)
    with LayerSwapper(layers, config, device=device(), log=None) as s:
        small = s.copier.landing_bytes

        def replace(step):
            s.apply_placement([1, 2, 3, 4], prefetch=2)

        record = train(layers, trainable, device(), "nonreentrant", dtype=BF16, cfg=FLUX_WIDTH, on_step=replace)
        assert s.copier.landing_bytes > small
    assert_bitwise_equal(references("nonreentrant", fp8=True), record)


def test_canary_without_the_compute_side_wait_differs(template, references, monkeypatch):
    def no_wait(self, token):
        self._wait_issued(token)  # the copy is issued, but compute does not wait for it

    monkeypatch.setattr(CudaCopier, "_wait", no_wait)
    config = SwapConfig.of(prefetch=1)
    got = swapped_run(template, "nonreentrant", config, compute_ms=0, monkeypatch=monkeypatch, expect_waits=False)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("nonreentrant"), got)


def test_canary_without_the_release_gate_differs(template, references, monkeypatch):
    original = CudaCopier._issue

    def ungated(self, tokens):
        for token in tokens:
            token.gates = []  # copies no longer wait for the kernels that read their slot
        original(self, tokens)

    monkeypatch.setattr(CudaCopier, "_issue", ungated)
    layers, trainable = fresh(template)
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=device(), log=None) as swapper:
        swapper.add_listener(ComputeDelay(50))  # slow compute: the next copies land while it still reads
        got = train(layers, trainable, device(), "nonreentrant", dtype=BF16, cfg=FLUX_WIDTH)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("nonreentrant"), got)


# ---------------------------------------------------------------- the disk tier (host RAM budget): reads delayed too
def disk_config(template, tmp_path, **kw):
    """A host RAM budget that holds only the disk tier's staging ring (2 buffers of the largest block): every
    streamed block (FLUX_WIDTH: 2 double blocks, 2 single) is read from disk each time it streams. (At this
    depth a budget that keeps some blocks in RAM and the ring is larger than the model; the CPU tests mix both.)"""
    rules = CastRules.from_policy(ComputePolicy(cast_target=kw["cast_target"])) if "cast_target" in kw else None
    layouts = measure(template, rules)
    largest = max(layout.host_bytes for layout in layouts[1:-1])
    kept = sum(lay.host_bytes for lay in (layouts[0], layouts[-1]) if any(p.scaled for p in lay.params))  # fp8 masters
    budget = (RING_BUFFERS * largest + kept + (1 << 20)) / 2**30
    return SwapConfig.of(**{"host_ram_budget": budget, "disk_dir": str(tmp_path), "prefetch": 1, **kw})


def disk_run(template, tmp_path, mode, config, copy_ms=20.0, compute_ms=5.0):
    layers, trainable = fresh(template)
    with LayerSwapper(layers, config, device=device(), log=None) as swapper:
        assert swapper.store.disk_layers == list(swapper.streamed_layers), "every streamed block is on disk"
        if copy_ms:
            delay_every_copy(swapper, copy_ms)  # DISK_IN too: a host sleep before every read
        if compute_ms:
            swapper.add_listener(ComputeDelay(compute_ms))
        return train(layers, trainable, device(), mode, dtype=BF16, cfg=FLUX_WIDTH)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_delayed_disk_reads_and_copies_stay_bitwise_equal(template, references, tmp_path, mode, prefetch):
    got = disk_run(template, tmp_path, mode, disk_config(template, tmp_path, prefetch=prefetch))
    assert_bitwise_equal(references(mode), got)


DISK_SETTINGS = {
    "2streams": {"cuda_streams": 2, "batch_move": True},
    "sync": {"event_sync": False},
    "fp8": {"cast_target": FP8},
}


@pytest.mark.parametrize("name", list(DISK_SETTINGS))
def test_delayed_disk_reads_with_other_copy_settings(template, references, tmp_path, name):
    got = disk_run(template, tmp_path, "nonreentrant", disk_config(template, tmp_path, **DISK_SETTINGS[name]))
    assert_bitwise_equal(references("nonreentrant", fp8=name == "fp8"), got)


def test_canary_weight_copies_that_do_not_wait_for_their_reads_differ(template, references, tmp_path, monkeypatch):
    original = DiskTier.read

    def unwaited(self, transport, index, nbytes):
        k, buffer, _ = original(self, transport, index, nbytes)  # the read runs, but nothing waits for it
        return k, buffer, Copy(direction=Direction.DISK_IN)

    monkeypatch.setattr(DiskTier, "read", unwaited)
    got = disk_run(template, tmp_path, "nonreentrant", disk_config(template, tmp_path), copy_ms=50.0, compute_ms=0)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("nonreentrant"), got)


@pytest.mark.parametrize("copy_ms", [20.0, 600.0])
def test_delayed_reads_ahead_are_taken_and_stay_bitwise_equal(template, references, tmp_path, copy_ms):
    """The engine reads the spilled blocks ahead of their fetches (LayerSwapper.read_ahead), on the reader's thread,
    with every read and copy delayed: the fetches take those reads, and the run is bitwise the all-in-RAM one.
    600 ms: the canary's delays below, where each copy runs after the next read into its buffer was issued."""
    layers, trainable = fresh(template)
    with LayerSwapper(layers, disk_config(template, tmp_path), device=device(), log=None) as swapper:
        delay_every_copy(swapper, copy_ms)
        swapper.add_listener(ComputeDelay(5.0))
        got = train(layers, trainable, device(), "nonreentrant", dtype=BF16, cfg=FLUX_WIDTH)
        assert swapper.store.disk.taken > 0
    assert_bitwise_equal(references("nonreentrant"), got)


def test_canary_reads_ahead_that_do_not_wait_for_the_buffers_last_copy_differ(
    template, references, tmp_path, monkeypatch
):
    """The mutation: a read ahead forgets the copy that still reads its ring buffer, and lands while that copy has
    not read it yet. Each weight copy waits 600 ms on its stream first: longer than a block's read from the disk
    (a double block's 680 MB take about 370 ms at 1.8 GB/s), so the read issued right after a copy lands before that
    copy runs. (With 50 ms, the reads, slower than the copies, left every copy done before the next read into its
    buffer began, and the mutation changed nothing: the lent H200, 2026-11-27.)"""
    original = DiskTier.stage

    def ungated(self, transport, index, nbytes):
        if self._holder(self.ring.next) is None:
            self.ring.readers[self.ring.next] = None
        return original(self, transport, index, nbytes)

    monkeypatch.setattr(DiskTier, "stage", ungated)
    got = disk_run(template, tmp_path, "nonreentrant", disk_config(template, tmp_path), copy_ms=600.0, compute_ms=0)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(references("nonreentrant"), got)


def test_the_disk_tier_reads_with_direct_io_and_says_which_reader(template, tmp_path):
    lines = []
    layers, _ = fresh(template)
    with LayerSwapper(layers, disk_config(template, tmp_path), device=device(), log=lines.append) as swapper:
        reader = swapper.transport.reader
        assert reader is not None and "O_DIRECT" in reader.name
        assert swapper.store.disk.pinned_bytes > 0
    assert any(line.startswith("DGLS disk tier: ") and reader.name in line for line in lines)
