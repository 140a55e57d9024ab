"""The swap engine on CPU: exact equality with the unswapped model, and loud failure when wrong."""

import gc
import threading
import weakref

import pytest
import torch
from helpers import SMALL, assert_bitwise_equal, make_layers, train

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig, SwapWorkerError
from utils.dgls.demo.model import DemoModelConfig, build_layers
from utils.dgls.engine.build import build
from utils.dgls.streaming.feature import Feature
from utils.dgls.streaming.schedule import Phase, UsePredictor

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(mode):
        if mode not in cache:
            layers, trainable = make_layers()
            cache[mode] = train(layers, trainable, CPU, mode)
        return cache[mode]

    return get


@pytest.mark.parametrize("threading_on", [False, True], ids=["inline", "thread"])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
def test_swapped_training_is_bitwise_equal(references, mode, prefetch, threading_on):
    layers, trainable = make_layers()
    config = SwapConfig.of(prefetch=prefetch, threading=threading_on)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        got = train(layers, trainable, CPU, mode)
        stats = swapper.step_stats()
    assert_bitwise_equal(references(mode), got)
    assert stats.fetches > 0
    if prefetch:
        assert stats.hit_rate > 0.5


def test_batch_move_and_blocks_to_swap_are_equal(references):
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(blocks_to_swap=4, prefetch=2, batch_move=True), device=CPU, log=None):
        got = train(layers, trainable, CPU, "nonreentrant")
    assert_bitwise_equal(references("nonreentrant"), got)


def test_evicted_layer_points_at_empty_placeholder():
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=0), device=CPU, log=None) as swapper:
        block = layers[swapper.streamed_layers[0]]
        assert block.img_qkv.base_layer.weight.numel() == 0
        with pytest.raises(RuntimeError):
            torch.nn.functional.linear(torch.randn(2, SMALL.hidden), block.img_qkv.base_layer.weight)
        # LoRA params stay where they are, with their real shapes.
        assert block.img_qkv.lora_A["default"].weight.numel() > 0


def test_state_dict_has_true_weights_and_load_round_trips():
    layers, _ = make_layers()
    expected = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        idx = swapper.streamed_layers[0]
        got = layers[idx].state_dict()
        for key, value in expected[idx].items():
            assert torch.equal(got[key], value), key
        changed = {k: v + 1 if not k.endswith(".weight") or "lora" in k else v * 2 for k, v in expected[idx].items()}
        layers[idx].load_state_dict(changed)
        after = layers[idx].state_dict()
        for key in changed:
            assert torch.equal(after[key], changed[key]), key
        out = layers[idx](
            (torch.randn(1, 3, SMALL.hidden), torch.randn(1, 2, SMALL.hidden), torch.randn(1, SMALL.hidden))
        )
        assert all(torch.isfinite(t).all() for t in out)


def test_remove_restores_modules_and_frees_everything():
    layers, trainable = make_layers()
    before = {(i, n): p.detach().clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    threads_before = threading.active_count()
    swapper = LayerSwapper(layers, SwapConfig.of(prefetch=2, threading=True), device=CPU, log=None)
    train(layers, trainable, CPU, "nonreentrant", steps=1, accumulate=1, eval_between=False)
    swapper.remove()
    assert threading.active_count() == threads_before
    for i, layer in enumerate(layers):
        assert not layer._forward_hooks and not layer._forward_pre_hooks
        assert not layer._state_dict_hooks and not layer._load_state_dict_pre_hooks
        for n, p in layer.named_parameters():
            assert p.shape == before[(i, n)].shape
            if not p.requires_grad:
                assert torch.equal(p, before[(i, n)])
    assert swapper.store.pinned_bytes == 0 and not swapper.pool.slots


@pytest.mark.parametrize("threading_on", [False, True])
def test_remove_frees_the_slots_at_once_not_at_the_next_garbage_collection(threading_on):
    """Tokens and the copier's slot states form reference cycles with the swapper; the slots' memory must not
    wait for the cycle collector (a second swapper, or the next benchmark row, would count it as its own)."""
    layers, trainable = make_layers()
    gc.collect()
    gc.disable()
    try:
        swapper = LayerSwapper(layers, SwapConfig.of(prefetch=2, threading=threading_on), device=CPU, log=None)
        buffers = [weakref.ref(slot.buffer) for slot in swapper.pool.slots]
        train(layers, trainable, CPU, "nonreentrant", steps=1, accumulate=1, eval_between=False)
        swapper.remove()
        assert all(ref() is None for ref in buffers)
    finally:
        gc.enable()


def test_worker_error_surfaces_in_main_thread(monkeypatch):
    layers, trainable = make_layers()
    swapper = LayerSwapper(layers, SwapConfig.of(prefetch=2, threading=True), device=CPU, log=None)

    def broken(tokens):
        raise OSError("simulated copy failure")

    monkeypatch.setattr(swapper.copier, "_issue", broken)
    with pytest.raises(SwapWorkerError, match="simulated copy failure"):
        train(layers, trainable, CPU, "none", steps=1, accumulate=1)
    swapper.remove()


def test_layer_returning_a_view_of_its_weights_is_refused():
    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

        def forward(self, x):
            return self.table[0]

    layers = [torch.nn.Linear(4, 4), Leaky(), torch.nn.Linear(4, 4)]
    with LayerSwapper(layers, SwapConfig(), device=CPU, log=None):
        with pytest.raises(DGLSUserError, match="view of its own weights"):
            layers[1](torch.randn(4))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prefetch=-1), "prefetch"),
        (dict(blocks_to_swap=-2), "blocks_to_swap"),
        (dict(initial_gpu_layers=-1), "initial_gpu_layers"),
        (dict(cuda_streams=0), "cuda_streams"),
        (dict(gpu_layers=[0], blocks_to_swap=2), "gpu_layers"),
        (dict(blocks_to_swap=2, final_gpu_layers=1), "blocks_to_swap"),
    ],
)
def test_bad_config_values(kwargs, message):
    with pytest.raises(DGLSUserError, match=message):
        SwapConfig.of(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gpu_layers=[0, 99]), "out of range"),
        (dict(blocks_to_swap=50), "blocks_to_swap=50"),
        (dict(initial_gpu_layers=20), "initial_gpu_layers=20"),
    ],
)
def test_settings_that_do_not_fit_the_model(kwargs, message):
    layers, _ = make_layers()
    with pytest.raises(DGLSUserError, match=message):
        LayerSwapper(layers, SwapConfig.of(**kwargs), device=CPU, log=None)


def test_placement_by_blocks_to_swap_keeps_both_ends():
    layers = build_layers(DemoModelConfig(double_blocks=4, single_blocks=4))
    with LayerSwapper(layers, SwapConfig.of(blocks_to_swap=6), device=CPU, log=None) as swapper:
        assert swapper.streamed_layers == (2, 3, 4, 5, 6, 7)
        table = swapper.placement_table()
    assert "DoubleBlock" in table and "streamed" in table and "before activations" in table


def test_too_little_ram_is_a_clear_error(monkeypatch):
    import utils.dgls.memory.host_store as host_store

    class Tiny:
        available = 1024
        total = 2048

    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Tiny)
    layers, _ = make_layers()
    for layer in layers:  # pretend the weights are not in RAM yet, so they all need new RAM
        layer.to("meta")
    with pytest.raises(DGLSUserError, match="too little RAM"):
        LayerSwapper(layers, SwapConfig(), device=CPU, log=None)


def test_predictor_learns_turnarounds_and_eval():
    F, B, N = Phase.FORWARD, Phase.BACKWARD, Phase.NO_GRAD
    p = UsePredictor(4)
    train_step = [(0, F), (1, F), (2, F), (3, F), (3, B), (2, B), (1, B), (0, B)]
    eval_pass = [(0, N), (1, N), (2, N), (3, N)]
    for use in train_step + eval_pass + train_step:
        p.observe(use)
    assert list(p.upcoming(4)) == [(0, N), (1, N), (2, N), (3, N)]
    q = UsePredictor(4)
    q.observe((1, B))
    assert list(q.upcoming(3)) == [(0, B)]


def test_compile_wraps_resident_layers_only_and_stays_exact(references):
    layers, trainable = make_layers()
    config = SwapConfig.of(compile=True, compile_backend="eager", prefetch=1)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        compiled = {i for i, layer in enumerate(layers) if "forward" in vars(layer)}
        assert compiled == set(range(len(layers))) - set(swapper.streamed_layers) and compiled
        got = train(layers, trainable, CPU, "nonreentrant")
        swapper.apply_placement([0, 2], prefetch=1)  # layer 0 streams now: back to eager
        assert "forward" not in vars(layers[0]) and "forward" in vars(layers[1])
    assert not any("forward" in vars(layer) for layer in layers)
    assert_bitwise_equal(references("nonreentrant"), got)


def _concat(inputs):
    """A plain function between blocks, as diffusion-pipe's Chroma/HunyuanVideo to_layers() have one."""
    img, txt, vec = inputs
    return (img * 1.0, txt, vec)


@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
def test_plain_functions_in_the_layer_list_are_kept_and_not_streamed(mode):
    def with_function():
        layers, trainable = make_layers()
        return layers[:4] + [_concat] + layers[4:], trainable

    reference = train(*with_function(), CPU, mode)
    layers, trainable = with_function()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        assert 4 not in swapper.streamed_layers and len(swapper.placement.sizes) == len(layers)
        assert "_concat" in swapper.placement_table()
        got = train(layers, trainable, CPU, mode)
    assert_bitwise_equal(reference, got)


def test_remove_restores_dtypes_changed_by_mixed_precision_and_casts():
    layers, trainable = make_layers()
    frozen = next(p for p in layers[0].parameters() if not p.requires_grad)
    config = SwapConfig.of(mixed_precision="bf16", cast_target=[("f32", "bf16")], autocast="bf16", prefetch=1)
    swapper = LayerSwapper(layers, config, device=CPU, log=None)
    assert all(p.dtype == torch.bfloat16 for p in trainable) and frozen.dtype == torch.bfloat16
    train(layers, trainable, CPU, "nonreentrant", steps=1, accumulate=1, eval_between=False)
    swapper.remove()
    assert all(p.dtype == torch.float32 and p.grad is None or p.grad.dtype == torch.float32 for p in trainable)
    assert all(p.dtype == torch.float32 for layer in layers for p in layer.parameters())


def test_a_pass_ends_at_every_backward_and_stats_are_pure_reads():
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        assert swapper.step_stats().passes == 0
        train(layers, trainable, CPU, "reentrant", steps=2, accumulate=2, eval_between=True)
        total = swapper.total_stats()
        assert total.passes == 4  # one per backward; eval passes end none
        last = swapper.step_stats()
        assert last == swapper.step_stats() and total == swapper.total_stats()  # reads change nothing
        assert last.passes == 1 and 0 < last.fetches < total.fetches
        assert total.bytes_moved > last.bytes_moved > 0 and total.since(total).bytes_moved == 0


def test_load_state_dict_with_assign_keeps_the_layer_streaming():
    """assign=True puts new Parameter objects in: they are adopted (packed), not silently left resident."""
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None) as swapper:
        idx = swapper.streamed_layers[0]
        state = {k: v.clone() * 2 if "lora" not in k else v.clone() for k, v in layers[idx].state_dict().items()}
        layers[idx].load_state_dict(state, assign=True)
        weight = layers[idx].img_qkv.base_layer.weight
        assert weight.numel() == 0  # a placeholder again: the new param streams
        got = layers[idx].state_dict()
        assert all(torch.equal(got[k], state[k]) for k in state)
        train(layers, [p for layer in layers for p in layer.parameters() if p.requires_grad], CPU, "none", steps=1)
        assert swapper.total_stats().fetches > 0


def test_a_pool_larger_than_what_streams_is_said_at_start_up():
    layers, _ = make_layers()
    lines = []
    with LayerSwapper(layers, SwapConfig.of(blocks_to_swap=2, prefetch=2), device=CPU, log=lines.append) as swapper:
        assert swapper.placement.saved_bytes <= 0
    assert any("so it saves no VRAM" in line for line in lines)
    lines.clear()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=lines.append):
        pass
    assert not any("so it saves no VRAM" in line for line in lines)


def test_ram_short_says_where_a_need_cuts_into_the_reserve(monkeypatch):
    """The RAM checks' one rule (host_store.ram_short): a need fits while the reserve (a tenth of RAM, 2 GiB at least)
    stays free; otherwise the bytes available and the reserve, for the caller's line."""
    import utils.dgls.memory.host_store as host_store

    class Host:
        total = 16 * 2**30  # reserve: 2 GiB
        available = 3 * 2**30

    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)
    assert host_store.ram_short(2**30) is None
    assert host_store.ram_short(2**30 + 1) == (3 * 2**30, 2 * 2**30)


def test_a_cast_that_matches_no_param_is_refused():
    layers, _ = make_layers()  # float32 model
    with pytest.raises(DGLSUserError, match="cast_target bf16 f8_e4m3 casts nothing"):
        LayerSwapper(layers, SwapConfig.of(cast_target=[("bf16", "f8_e4m3")]), device=CPU, log=None)
    assert all(p.dtype == torch.float32 and p.numel() > 0 for layer in layers for p in layer.parameters())


def test_plan_only_with_explicit_placement_never_trains():
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(blocks_to_swap=2, plan=True), device=CPU, log=None) as swapper:
        assert swapper.plan_finished


@pytest.mark.parametrize("where", ["host RAM", "device pool", "a feature"])
def test_a_swapper_that_fails_to_start_changes_nothing(monkeypatch, where):
    """Failing while packing the masters, while building the pool, or later (a feature's install: after layers
    were streamed and the hooks installed) leaves the modules exactly as they were, dtypes included
    (mixed_precision is applied last)."""
    layers, trainable = make_layers()
    before = {id(p): (p.detach().clone(), p.dtype) for layer in layers for p in layer.parameters()}

    def fail(*args, **kwargs):
        raise DGLSUserError(f"{where} ran out (simulated)")

    if where == "host RAM":
        monkeypatch.setattr("utils.dgls.streaming.masters.check_ram", fail)
    elif where == "device pool":
        monkeypatch.setattr("utils.dgls.engine.build.DevicePool", fail)
    else:
        monkeypatch.setattr("utils.dgls.streaming.forward_patches.ForwardPatches.install", fail)
    with pytest.raises(DGLSUserError, match="ran out"):
        LayerSwapper(layers, SwapConfig.of(mixed_precision="bf16", prefetch=1), device=CPU, log=None)
    for layer in layers:
        assert not layer._forward_pre_hooks and not layer._state_dict_hooks
        for p in layer.parameters():
            value, dtype = before[id(p)]
            assert p.dtype == dtype and torch.equal(p, value)


class RecordingFeature(Feature):
    """Records the engine's calls of each lifecycle hook; gates every fetch on a copy it owns."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gated: list[int] = []

    def install(self, engine) -> None:
        self.calls.append("install")

    def fetch_gates(self, idx: int) -> list:
        self.gated.append(idx)
        return []

    def after_backward(self) -> None:
        self.calls.append("after_backward")

    def before_placement(self) -> None:
        self.calls.append("before_placement")

    def placement_changed(self, placement, kept_activations) -> None:
        self.calls.append(f"placement_changed {placement.streamed} {kept_activations}")

    def wrap_checkpoint(self, checkpoint):
        self.calls.append("wrap_checkpoint")
        return checkpoint

    def flush(self) -> None:
        self.calls.append("flush")

    def pinned_bytes(self) -> int:
        return 7

    def describe(self) -> list[str]:
        return ["recording feature"]

    def close(self) -> None:
        self.calls.append("close")


def test_a_feature_hears_each_hook_in_lifecycle_order(monkeypatch):
    """The engine calls a feature's hooks at the points feature.py promises: install once, a fetch gate for
    every copy of a streamed layer, after_backward once per backward, the placement hooks around a
    re-placement, flush before true weights are read, close once at removal; its lines join the report."""
    recorder = RecordingFeature()

    def with_recorder(*args, **kwargs):
        parts = build(*args, **kwargs)
        parts.features.append(recorder)
        return parts

    monkeypatch.setattr("utils.dgls.engine.swapper.build", with_recorder)
    layers, trainable = make_layers()
    lines: list[str] = []
    with LayerSwapper(layers, SwapConfig.of(blocks_to_swap=4, prefetch=1), device=CPU, log=lines.append) as swapper:
        assert recorder.calls == ["install"] and "recording feature" in lines
        swapper.checkpoint_function(torch.utils.checkpoint.checkpoint)
        pinned = swapper.store.pinned_bytes
        assert swapper.pinned_bytes == pinned + 7
        train(layers, trainable, CPU, "nonreentrant", steps=1, accumulate=2, eval_between=False)
        assert recorder.calls == ["install", "wrap_checkpoint", "after_backward", "after_backward"]
        assert set(recorder.gated) == set(swapper.streamed_layers), "every streamed layer's copies ask for gates"
        resident = swapper.streamed_layers[0]
        streamed = tuple(i for i in swapper.streamed_layers if i != resident)
        swapper.apply_placement(streamed, 1, 3)
        with swapper.true_weights():
            pass
        del recorder.calls[:4]
        assert recorder.calls == ["before_placement", f"placement_changed {streamed} 3", "flush"]
    assert recorder.calls[-1] == "close" and recorder.calls.count("close") == 1
