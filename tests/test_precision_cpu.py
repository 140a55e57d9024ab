"""Precision on CPU: cast_target rules, fp8 storage equal to a fake-quantized model, autocast under
checkpointing, mixed_precision, state dicts with casts, refusals."""

import pytest
import torch
from helpers import SMALL, assert_bitwise_equal, make_layers, train
from torch import nn

from utils.dgls import DGLSUserError, LayerSwapper, Listener, SwapConfig
from utils.dgls.memory.precision import CastRules, ParamCast, dequantize, fake_quantize, quantize
from utils.dgls.streaming.forward_patches import ForwardPatches

CPU = torch.device("cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MODES = ["none", "nonreentrant", "reentrant"]


class RMSNormLike(nn.Module):
    """Not an nn norm class, but named like one: must be skipped too."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)  # f32
        self.b = nn.Linear(8, 8).to(BF16)
        self.c = nn.Linear(8, 8).to(F16)
        self.norm = nn.LayerNorm(8)
        self.group = nn.GroupNorm(2, 8)
        self.custom = RMSNormLike(8)
        self.lora = nn.Parameter(torch.zeros(8, 8))
        for p in self.parameters():
            p.requires_grad_(False)
        self.lora.requires_grad_(True)


def cast_all(layers, config, fn):
    """Apply ``fn(param, ParamCast)`` to what cast_target casts: in every layer, wherever it lives."""
    rules = CastRules.from_policy(config.compute)
    with torch.no_grad():
        for layer in layers:
            casts = rules.plan(layer)
            for p in layer.parameters():
                if id(p) in casts:
                    fn(p, casts[id(p)])


def fake_quantized_layers(config):
    layers, trainable = make_layers()

    def fq(p, cast):
        p.copy_(fake_quantize(p, cast.stored))

    cast_all(layers, config, fq)
    return layers, trainable


# ---------------------------------------------------------------- rules
def test_cast_rules_pick_frozen_non_norm_params_once():
    m = Mixed()
    plan = CastRules((( F32, BF16), (BF16, E4M3)), cast_norms=False).plan(m)  # fmt: skip
    got = {name: plan.get(id(p)) for name, p in m.named_parameters()}
    assert got["a.weight"] == ParamCast(BF16, BF16) and got["a.bias"] == ParamCast(BF16, BF16)  # not chained to fp8
    assert got["b.weight"] == ParamCast(BF16, E4M3) and got["b.weight"].scaled
    assert got["c.weight"] is None  # f16 is not a FROM here
    for name in ("norm.weight", "norm.bias", "group.weight", "custom.weight", "lora"):
        assert got[name] is None, name
    with_norms = CastRules(((F32, BF16),), cast_norms=True).plan(m)
    assert {id(m.norm.weight), id(m.group.bias), id(m.custom.weight)} <= set(with_norms)
    assert id(m.lora) not in with_norms  # trainable params never


def frozen_f32_bytes(index):
    """Bytes of a layer's frozen params as built (before DGLS points them at placeholders)."""
    return sum(p.numel() * 4 for p in make_layers()[0][index].parameters() if not p.requires_grad)


def test_casts_apply_wherever_a_layer_lives():
    """Resident layers take the cast too, so placement never changes the numbers."""
    layers, _ = make_layers()
    config = SwapConfig.of(cast_target=[("f32", "bf16")], autocast="bf16", prefetch=0)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        first, streamed = layers[0], layers[swapper.streamed_layers[0]]
        assert 0 not in swapper.streamed_layers and first.img_in.weight.dtype == BF16
        assert streamed.img_qkv.base_layer.weight.dtype == BF16  # the placeholder has the new dtype
        assert streamed.img_qkv.lora_A["default"].weight.dtype == F32
        host = swapper.store.layers[swapper.streamed_layers[0]]
        assert all(master.dtype == BF16 for master in map(host.master_view, range(len(host.layout.params))))
        f32_bytes = frozen_f32_bytes(swapper.streamed_layers[0])
        assert host.buffer.numel() <= f32_bytes // 2 + 256 * len(host.layout.params)


def test_fp8_storage_keeps_fp8_bytes_on_the_host_and_copies_them():
    config = SwapConfig.of(cast_target=[("f32", "f8_e4m3")], prefetch=1)
    layers, trainable = make_layers()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        streamed = swapper.streamed_layers
        for i in streamed:
            s, host = swapper.placement.sizes[i], swapper.store.layers[i]
            f32_bytes = frozen_f32_bytes(i)
            assert host.buffer.numel() == s.copy_bytes < f32_bytes / 3  # fp8: about a quarter of f32
            assert s.slot_bytes >= f32_bytes and s.scale_bytes > 0  # slots hold the f32 compute layout
        assert swapper.pool.slots[0].buffer.numel() == max(swapper.placement.sizes[i].slot_bytes for i in streamed)
        copies = []
        swapper.add_listener(type("Copies", (Listener,), {"fetched": lambda self, token: copies.append(token)})())
        train(layers, trainable, CPU, "none", steps=1, accumulate=1, eval_between=False)
        assert copies and swapper.step_stats().bytes_moved == sum(t.nbytes for t in copies)
        assert all(t.nbytes == swapper.placement.sizes[t.layer].copy_bytes for t in copies)


def test_fp8_storage_numbers_do_not_depend_on_placement():
    """Resident fp8-cast layers hold the same rounded values as streamed ones, also across re-placement."""
    config = SwapConfig.of(cast_target=[("f32", "f8_e4m3")])
    records = []
    for streamed in ([1, 2, 3, 4, 5, 6], [2, 5]):
        layers, trainable = make_layers()
        with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
            swapper.apply_placement(streamed, 1)

            def shuffle(step, swapper=swapper):
                swapper.apply_placement([1, 3, 4] if step % 2 else [2, 6], 2)

            records.append(train(layers, trainable, CPU, "nonreentrant", on_step=shuffle))
    assert_bitwise_equal(*records)


# ---------------------------------------------------------------- fp8 numerics
@pytest.mark.parametrize("fp8, mantissa, min_normal", [(E4M3, 3, 2.0**-6), (E5M2, 2, 2.0**-14)])
def test_fp8_round_trip_error_bound(fp8, mantissa, min_normal):
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 2, 64)[:, None]  # rows from 1e-6 to 1e2
    x = torch.randn(64, 256, generator=g) * magnitudes
    q, scale = quantize(x, fp8)
    assert q.dtype == fp8 and scale.shape == (64,) and scale.dtype == F32
    back = dequantize(q, scale, F32)
    err = (back - x).abs()
    # per element: half an ulp relative for normals, half the subnormal spacing (in scaled units) below
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), scale[:, None] * min_normal * 2.0 ** -(mantissa + 1))
    assert (err <= bound * (1 + 1e-6)).all()
    rel_rms = (err.square().mean(1).sqrt() / x.square().mean(1).sqrt()).max().item()
    assert rel_rms < (0.04 if fp8 is E4M3 else 0.08)  # every row, the 1e-6 one included
    # per-tensor scaling would lose the small rows (underflow): that is why scales are per row
    flat_q, flat_scale = quantize(x.flatten(), fp8)
    assert flat_scale.shape == (1,)
    if fp8 is E4M3:  # e5m2's wide range still covers these rows per tensor, coarsely
        assert (dequantize(flat_q, flat_scale, F32).view_as(x)[0] == 0).all()


def test_fake_quantize_keeps_dtype_and_zero_rows():
    x = torch.randn(4, 8, dtype=BF16)
    x[1] = 0
    y = fake_quantize(x, E4M3)
    assert y.dtype == BF16 and (y[1] == 0).all()
    assert fake_quantize(torch.tensor([0.5, -2.0]), E5M2).tolist() == [0.5, -2.0]


@pytest.mark.parametrize(
    "mode, prefetch, threading_on",
    [
        ("none", 0, False),
        ("none", 2, False),
        ("nonreentrant", 2, False),
        ("reentrant", 1, False),
        ("nonreentrant", 2, True),
    ],
)
def test_fp8_storage_equals_fake_quantized_model(mode, prefetch, threading_on):
    config = SwapConfig.of(cast_target=[("f32", "f8_e4m3")], prefetch=prefetch, threading=threading_on)
    reference = train(*fake_quantized_layers(config), CPU, mode)
    layers, trainable = make_layers()
    with LayerSwapper(layers, config, device=CPU, log=None):
        got = train(layers, trainable, CPU, mode)
    assert_bitwise_equal(reference, got)


def test_fp8_storage_differs_from_full_precision_by_little():
    config = SwapConfig.of(cast_target=[("f32", "f8_e4m3")], prefetch=2)
    full = train(*make_layers(), CPU, "none")
    layers, trainable = make_layers()
    with LayerSwapper(layers, config, device=CPU, log=None):
        got = train(layers, trainable, CPU, "none")
    for a, b in zip(full.losses, got.losses):
        assert 0 < abs(a - b) / a < 0.05


# ---------------------------------------------------------------- bf16 cast and autocast
def autocast_forward(layers, dtype):
    """The reference for per-layer autocast: each layer's own forward wrapped in torch.autocast
    (not the whole loop: backward must not run under autocast)."""
    for layer in layers:
        layer.forward = torch.autocast("cpu", dtype=dtype)(layer.forward)
    return layers


def bf16_reference(config, mode):
    layers, trainable = make_layers()

    def to_bf16(p, cast):
        p.data = p.data.to(cast.dtype)

    cast_all(layers, config, to_bf16)
    return train(autocast_forward(layers, BF16), trainable, CPU, mode)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_cast_training_equals_unswapped_bf16_model(mode):
    config = SwapConfig.of(cast_target=[("f32", "bf16")], autocast="bf16", prefetch=1)
    reference = bf16_reference(config, mode)
    layers, trainable = make_layers()
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        got = train(layers, trainable, CPU, mode)
        assert not swapper.feature(ForwardPatches)._contexts and not torch.is_autocast_enabled("cpu")
    assert_bitwise_equal(reference, got)


@pytest.mark.parametrize("mode", MODES)
def test_autocast_hooks_under_checkpointing(mode):
    layers, trainable = make_layers()
    reference = train(autocast_forward(layers, BF16), trainable, CPU, mode)
    layers, trainable = make_layers()
    seen = []
    handle = layers[2].img_qkv.base_layer.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with LayerSwapper(layers, SwapConfig.of(autocast="bf16", prefetch=2), device=CPU, log=None) as swapper:
        got = train(layers, trainable, CPU, mode)
        assert not swapper.feature(ForwardPatches)._contexts
    handle.remove()
    assert not torch.is_autocast_enabled("cpu")
    assert set(seen) == {BF16}
    assert_bitwise_equal(reference, got)


def test_autocast_fp32_turns_an_outer_autocast_off_inside_layers():
    layers, _ = make_layers()
    seen = []
    layers[1].img_qkv.base_layer.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with LayerSwapper(layers, SwapConfig.of(autocast="fp32"), device=CPU, log=None):
        inputs = (torch.randn(1, 3, SMALL.latent_channels), torch.randn(1, 2, SMALL.text_dim), torch.rand(1))
        with torch.autocast("cpu", dtype=BF16):
            h = inputs
            for layer in layers:
                h = layer(h)
            assert torch.is_autocast_enabled("cpu")
    assert seen == [F32]


def test_mixed_precision_casts_trainable_params_only():
    layers, trainable = make_layers()
    frozen_before = {id(p): p.dtype for layer in layers for p in layer.parameters() if not p.requires_grad}
    lines = []
    with LayerSwapper(layers, SwapConfig.of(mixed_precision="bf16"), device=CPU, log=lines.append):
        assert all(p.dtype == BF16 for p in trainable)
        record = train(layers, trainable, CPU, "nonreentrant", steps=1)
        assert all(g.dtype == BF16 for g in record.grads[0])
        assert all(torch.isfinite(g).all() for g in record.grads[0])
    assert any("trainable params bf16" in line for line in lines)
    assert all(p.dtype == frozen_before[id(p)] for layer in layers for p in layer.parameters() if not p.requires_grad)
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(mixed_precision="auto"), device=CPU, log=None):
        assert all(p.dtype == F32 for p in trainable)


# ---------------------------------------------------------------- state dicts and removal
def test_state_dict_and_load_with_fp8_storage():
    config = SwapConfig.of(cast_target=[("f32", "f8_e4m3")], prefetch=1)
    layers, _ = make_layers()
    original = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        idx = swapper.streamed_layers[0]
        block = layers[idx]
        got = block.state_dict()
        key = "img_qkv.base_layer.weight"
        assert got[key].dtype == F32 and torch.equal(got[key], fake_quantize(original[idx][key], E4M3))
        lora_key = "img_qkv.lora_A.default.weight"
        assert torch.equal(got[lora_key], original[idx][lora_key])
        changed = {k: v * 3 if "base_layer" in k else v for k, v in original[idx].items()}
        block.load_state_dict(changed)
        after = block.state_dict()
        for k, v in changed.items():
            expected = v if "lora_" in k else fake_quantize(v, E4M3)  # every frozen param of a block is cast
            assert torch.equal(after[k], expected), k
        inputs = (torch.randn(1, 3, SMALL.hidden), torch.randn(1, 2, SMALL.hidden), torch.randn(1, SMALL.hidden))
        out = block(inputs)
    reference, _ = make_layers()
    reference[idx].load_state_dict({k: after[k] for k in changed})
    assert all(torch.equal(a, b) for a, b in zip(out, reference[idx](inputs)))


def test_remove_restores_cast_params_in_their_original_dtype():
    config = SwapConfig.of(cast_target=[("f32", "f8_e5m2")])
    layers, _ = make_layers()
    before = {(i, n): p.detach().clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    with LayerSwapper(layers, config, device=CPU, log=None):
        pass
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            expected = before[(i, n)] if p.requires_grad else fake_quantize(before[(i, n)], E5M2)
            assert p.dtype == F32 and torch.equal(p, expected), (i, n)

    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(cast_target=[("f32", "bf16")]), device=CPU, log=None) as swapper:
        idx = swapper.streamed_layers[0]
    weight = layers[idx].img_qkv.base_layer.weight
    assert weight.dtype == F32 and torch.equal(weight, before[(idx, "img_qkv.base_layer.weight")].to(BF16).float())


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cast_target=[("f32", "f4")]), "unknown dtype 'f4'"),
        (dict(cast_target=[("bf16", "bf16")]), "casts a dtype to itself"),
        (dict(cast_target=[("f8_e4m3", "f8_e5m2")]), "needs a 16- or 32-bit FROM"),
        (dict(cast_target=[("bf16", "f8_e4m3"), ("bf16", "f16")]), "FROM bf16 twice"),
        (dict(cast_target=["bf16"]), r"\[FROM, TO\] pairs"),
        (dict(cast_target="bf16 f8_e4m3"), r"\[FROM, TO\] pairs"),
        (dict(autocast="f8_e4m3"), "cast_target bf16 f8_e4m3"),
        (dict(autocast="int8"), "autocast must be one of"),
        (dict(mixed_precision="f8_e4m3"), "mixed_precision must be one of"),
    ],
)
def test_bad_precision_settings(kwargs, message):
    with pytest.raises(DGLSUserError, match=message):
        SwapConfig.of(**kwargs)


def test_aliases_and_several_pairs_are_accepted():
    config = SwapConfig.of(cast_target=[["fp32", "bf16"], ("bf16", "f8_e4m3")], autocast="fp16", mixed_precision="fp32")
    assert config.compute.cast_target == [("f32", "bf16"), ("bf16", "f8_e4m3")]
    assert (config.compute.autocast, config.compute.mixed_precision) == ("f16", "f32")


def test_torch_without_fp8_is_refused(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(DGLSUserError, match="has no float8_e4m3fn"):
        SwapConfig.of(cast_target=[("bf16", "f8_e4m3")])


def test_a_cast_the_device_cannot_do_is_refused_at_start_up(monkeypatch):
    import utils.dgls.memory.precision as precision

    def broken(*args, **kwargs):
        raise RuntimeError("float8 copy not implemented for this device\nmore detail")

    monkeypatch.setattr(precision, "quantize", broken)
    layers, _ = make_layers()
    with pytest.raises(DGLSUserError, match=r"cast_target f32 f8_e4m3 does not run on cpu .*not implemented.*drop"):
        LayerSwapper(layers, SwapConfig.of(cast_target=[("f32", "f8_e4m3")]), device=CPU, log=None)
