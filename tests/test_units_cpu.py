"""Sub-layer swap units on the CPU: layers split into the child modules they run train bitwise as unsplit.

The small demo model's blocks are split at 0.03 MB (30 KiB): a double block becomes its modulations,
projections and the two Linears of each MLP (the MLP ``Sequential`` a holder of its own), a single
block its modulation and two Linears; norms, and what no unit holds, stay resident. The deferred CPU
copier fills every slot with NaN until its copy is waited for, so a unit read before its copy landed
fails here, as does a view of a unit's slot kept past its use. With ``checkpoint_units`` the modulations
and MLPs (split or whole) also run under checkpoints of their own, nested in every layer-checkpoint mode,
and still train bitwise as unsplit.
"""

import gc
import random
import weakref
from contextlib import nullcontext
from functools import partial

import flux_autocast
import pytest
import torch
import torch.nn.functional as F
from full_ft import SPEC, assert_same, full_layers, host_trained_names, train_dgls, train_reference
from helpers import (
    SMALL,
    assert_bitwise_equal,
    host_saving_checkpoint,
    loop_mode,
    make_layers,
    run_layers,
    slow_case,
    train,
)
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.activations.activation_offload import ActivationOffloader
from utils.dgls.activations.unit_checkpoints import UnitCheckpoints
from utils.dgls.memory.copier import DeferredCopier
from utils.dgls.memory.layout import measure
from utils.dgls.planning.planner import unit_bytes_for_budget
from utils.dgls.streaming.hooks import HookAdapter
from utils.dgls.streaming.units import checkpoint_pieces, split_layers

CPU = torch.device("cpu")
UNIT_MB = 0.03
MODES = ["none", "nonreentrant", "reentrant", "unsloth"]


def checkpoint_for(mode):
    if mode == "unsloth":
        return host_saving_checkpoint
    return None  # run_layers' own (torch's, reentrant or not)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = train(*make_layers(), CPU, loop_mode(mode), checkpoint_fn=checkpoint_for(mode))
        return cache[mode]

    return get


def split_run(mode, prefetch=1, seed=None, **config):
    layers, trainable = make_layers()
    config = SwapConfig.of(prefetch=prefetch, **{"swap_unit_mb": UNIT_MB, **config})
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert any(entry.holder for entry in swapper.entries) == bool(config.placement.swap_unit_mb)
        if seed is not None:
            rng = random.Random(seed)
            swapper._victim = lambda candidates: rng.choice(candidates)
        ckpt = checkpoint_for(mode)
        acts = config.activations
        if acts.offload_activations or acts.offload_recompute or acts.keep_piece_outputs:
            ckpt = swapper.checkpoint_function(ckpt or (lambda f, *a: checkpoint(f, *a, use_reentrant=False)))
        return train(layers, trainable, CPU, loop_mode(mode), checkpoint_fn=ckpt)


# ---------------------------------------------------------------- the split
def test_a_large_layer_becomes_a_holder_and_its_children_in_order_of_definition():
    layers, _ = make_layers()
    entries = split_layers(layers, int(UNIT_MB * 2**20))
    double = [(e.part, e.holder) for e in entries if e.layer == 1]
    assert double == [
        ("", True),
        ("img_mod", False),
        ("txt_mod", False),
        ("img_qkv", False),
        ("txt_qkv", False),
        ("img_proj", False),
        ("txt_proj", False),
        ("img_mlp", True),  # larger than a unit: split again
        ("img_mlp.0", False),
        ("img_mlp.2", False),
        ("txt_mlp", True),
        ("txt_mlp.0", False),
        ("txt_mlp.2", False),
    ], "norms (no params) stay with the holder"
    assert [(e.part, e.holder) for e in entries if e.layer == 0] == [("", False)], "small layers stay whole"
    # the LoRA inside a projection is trainable: it does not count towards a split, so the PEFT Linear is one unit
    assert [e.part for e in entries if e.layer == 4] == ["", "mod", "linear1", "linear2"]
    assert [e.value for e in split_layers(layers, None)] == layers
    assert [e.value for e in split_layers(layers, 0)] == layers


def test_the_table_lists_units_under_their_layer_and_placement_settings_name_layers():
    layers, _ = make_layers()
    lines = []
    config = SwapConfig.of(swap_unit_mb=UNIT_MB, gpu_layers=[0, 2, 7])
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        table = lines[0]
        assert "  1.img_mlp.0 Linear" in table and "swap units below" in table
        owners = {swapper.entries[i].layer for i in swapper.streamed_layers}
        assert owners == {1, 3, 4, 5, 6}, "gpu_layers names the caller's layers: all units of layer 2 stay"
        assert any("run as" in line and "swap units" in line for line in lines)
    with LayerSwapper(layers, SwapConfig.of(swap_unit_mb=UNIT_MB, blocks_to_swap=2), device=CPU, log=None) as swapper:
        assert len({swapper.entries[i].layer for i in swapper.streamed_layers}) == 2


def test_a_holders_own_params_and_small_children_stay_resident():
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(swap_unit_mb=UNIT_MB), device=CPU, log=None) as swapper:
        for idx, entry in enumerate(swapper.entries):
            if entry.holder:
                assert swapper.layouts[idx].sizes.streamable_bytes == 0
                assert not swapper.is_streamed(idx)
        streamed = {id(p.param) for i in swapper.streamed_layers for p in swapper.layouts[i].params}
        double = layers[1]
        assert id(double.img_qkv.base_layer.weight) in streamed
        # each streamed param belongs to exactly one entry
        counted = [id(p.param) for layout in swapper.layouts for p in layout.params]
        assert len(counted) == len(set(counted))


@pytest.mark.parametrize("bad", [-1, float("nan"), "big"])
def test_a_bad_unit_size_is_one_line(bad):
    with pytest.raises(DGLSUserError, match="swap_unit_mb is a size in MB >= 0"):
        SwapConfig.of(swap_unit_mb=bad)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, slow_case(1), 2, slow_case(3)])  # 1 and 3 in the slow step
def test_training_with_units_is_bitwise_the_same(references, mode, prefetch):
    """Several steps of 2 micro-batches with eval passes between, each checkpoint mode."""
    assert_bitwise_equal(references(mode), split_run(mode, prefetch=prefetch))


@pytest.mark.parametrize("mode", MODES)
def test_random_slot_assignment_with_units_stays_exact(references, mode):
    for seed in range(2):
        assert_bitwise_equal(references(mode), split_run(mode, prefetch=2, seed=seed))


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant", "unsloth"])
def test_units_with_activation_offload_are_bitwise_the_same(references, mode):
    assert_bitwise_equal(references(mode), split_run(mode, prefetch=2, offload_activations=True))


@pytest.mark.parametrize("mode", ["none", "nonreentrant"])
def test_full_fine_tuning_with_units_is_bitwise_the_same(mode):
    """Streamed units' params train on the host; each holder's own params by the trainer's optimizer."""
    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=2, prefetch=2, swap_unit_mb=UNIT_MB)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert any(entry.holder for entry in swapper.entries)
        names = host_trained_names(layers, swapper)
        record = train_dgls(layers, swapper, CPU, mode)
    assert_same(record, train_reference(full_layers(), names, CPU, mode))


# ---------------------------------------------------------------- checkpoint_units
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, slow_case(1), 2, slow_case(3)])  # 1 and 3 in the slow step
@pytest.mark.parametrize("unit_mb", [UNIT_MB, slow_case(0.04), 0])
def test_checkpointed_units_train_bitwise_the_same(references, mode, prefetch, unit_mb):
    """Each swap unit (or each piece of a whole layer) under its own checkpoint, nested in every layer-checkpoint
    mode (or alone): the same numbers."""
    got = split_run(mode, prefetch=prefetch, checkpoint_units=True, swap_unit_mb=unit_mb)
    assert_bitwise_equal(references(mode), got)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant", "unsloth"])
@pytest.mark.parametrize("unit_mb", [UNIT_MB, 0])
def test_checkpointed_units_with_activation_offload_and_random_slots_stay_exact(references, mode, unit_mb):
    for seed in (None, 0):
        got = split_run(
            mode, prefetch=2, seed=seed, offload_activations=True, checkpoint_units=True, swap_unit_mb=unit_mb
        )
        assert_bitwise_equal(references(mode), got)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant", "unsloth"])
@pytest.mark.parametrize("units", [False, True], ids=["layer-checkpoints", "checkpoint_units"])
def test_recompute_offload_with_swap_units_and_random_slots_stays_exact(references, mode, units):
    """What recomputes save goes home beside units (whose views of slots bypass it) and pieces' checkpoints."""
    for seed in (None, 0):
        got = split_run(mode, prefetch=2, seed=seed, offload_recompute=True, checkpoint_units=units)
        assert_bitwise_equal(references(mode), got)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant", "unsloth"])
@pytest.mark.parametrize("prefetch", [slow_case(0), slow_case(1), 3])  # 0 and 1 in the slow step
@pytest.mark.parametrize("unit_mb", [UNIT_MB, 0])
def test_kept_piece_outputs_train_bitwise_the_same(references, mode, prefetch, unit_mb):
    """keep_piece_outputs: the layer's recompute takes its pieces' outputs from the forward (sent home with its
    inputs and back, or kept on the device for the last ``prefetch``), each piece runs again only for its
    backward; with random slot choice, and with recompute offload on top."""
    for seed, recompute in ((None, False), (0, True)):
        got = split_run(
            mode,
            prefetch=prefetch,
            seed=seed,
            checkpoint_units=True,
            keep_piece_outputs=True,
            offload_recompute=recompute,
            swap_unit_mb=unit_mb,
        )
        assert_bitwise_equal(references(mode), got)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_mutation_a_recompute_taking_a_kept_output_before_its_restore_landed_fails(references, mode, monkeypatch):
    """The deferred CPU restore fills a storage with NaN until it is waited for: without the wait for the kept
    outputs' restores (the inputs' still waited), the recompute returns NaN."""
    wait = ActivationOffloader.wait
    monkeypatch.setattr(ActivationOffloader, "wait", lambda self, o: None if o.output else wait(self, o))
    got = split_run(mode, prefetch=1, checkpoint_units=True, keep_piece_outputs=True, swap_unit_mb=0)
    assert any(torch.isnan(loss).any() for loss in got.losses)


@pytest.mark.parametrize("unit_mb", [UNIT_MB, 0])
def test_every_piece_runs_again_in_backward_and_remove_puts_the_class_forward_back(unit_mb):
    layers, trainable = make_layers()
    config = SwapConfig.of(prefetch=1, swap_unit_mb=unit_mb, checkpoint_units=True)
    lines = []
    with LayerSwapper(layers, config, device=CPU, log=lines.append) as swapper:
        pieces = swapper.pieces
        split = {e.layer for e in swapper.entries if e.holder}
        assert all(p.is_entry == (swapper.entries[p.entry].layer in split) for p in pieces), "units are pieces"
        assert {swapper.entries[p.entry].layer for p in pieces} >= set(range(1, 7)), "every block has pieces"
        assert all("forward" in vars(piece.module) for piece in pieces)
        assert any("checkpoint_units: " in line and "run under checkpoints of their own" in line for line in lines)
        train(layers, trainable, CPU, "nonreentrant", steps=1)
        installed = swapper.feature(UnitCheckpoints)._installed
        trained = [w.reruns for w in installed if any(p.requires_grad for p in w.piece.module.parameters())]
        assert trained and min(trained) == 2, "each piece with a LoRA runs again in each micro-batch's backward"
    assert not any("forward" in vars(piece.module) for piece in pieces)


def test_layers_are_cut_at_half_their_size_skipping_modules_that_keep_only_their_input():
    layers, _ = make_layers()
    double = [path for path, _ in checkpoint_pieces(layers[1])]
    # a (LoRA) Linear keeps only its input, which its checkpoint would keep too: the projections are no pieces
    assert double == ["img_mod", "txt_mod", "img_mlp", "txt_mlp"]
    assert [path for path, _ in checkpoint_pieces(layers[4])] == ["mod"]
    assert checkpoint_pieces(nn.LayerNorm(8, elementwise_affine=False)) == []


def counted_step(mode, keep):
    """One micro-batch with swap units as pieces: (class-forward runs of pieces, uses of piece entries, replays,
    pieces)."""
    layers, trainable = make_layers()
    config = SwapConfig.of(prefetch=1, swap_unit_mb=UNIT_MB, checkpoint_units=True, keep_piece_outputs=keep)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        entries = {p.entry for p in swapper.pieces if p.is_entry}
        uses, runs, use = [], [], swapper.use
        swapper.use = lambda idx, phase: (uses.append(idx), use(idx, phase))[1]
        unit_checkpoints = swapper.feature(UnitCheckpoints)
        for wrapper in unit_checkpoints._installed:
            wrapper.forward = lambda *a, _f=wrapper.forward, **k: (runs.append(1), _f(*a, **k))[1]
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=mode == "reentrant"))
        train(layers, trainable, CPU, mode, steps=1, accumulate=1, eval_between=False, checkpoint_fn=ckpt)
        return len(runs), sum(idx in entries for idx in uses), unit_checkpoints.replayed, len(swapper.pieces)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_kept_outputs_run_each_piece_once_fewer_and_its_recompute_starts_no_use(mode):
    """keep_piece_outputs: a piece runs in the forward and for its backward, not in its layer's recompute, and
    the engine starts no use of a swap unit there (so no copy brings its weights)."""
    runs_off, uses_off, none, _ = counted_step(mode, False)
    runs_on, uses_on, replayed, pieces = counted_step(mode, True)
    assert none == 0 and replayed == pieces, "every piece of every block, once per micro-batch"
    assert runs_on == runs_off - replayed
    assert uses_on < uses_off  # units replayed start no use (pieces that are not entries had none to skip)


class Gate(nn.Module):
    """A piece taking ``None`` and a keyword argument, drawing random numbers, returning ``None`` beside a tensor
    that its own backward reads (a sigmoid saves its output: the rerun's output must not be freed)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask=None, *, scale):
        assert mask is None
        return torch.sigmoid(F.dropout(self.mlp(x), 0.5, training=True) * scale), None


class RandomBlock(nn.Module):
    """Two pieces, with random draws in them and between them (the layer's own dropout)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first, self.second = Gate(width), Gate(width)

    def forward(self, x):
        x = x + self.first(x, None, scale=x[:, :1])[0]
        x = F.dropout(x, 0.25, training=True)
        return x + self.second(x, scale=x[:, 1:2])[0]


def assert_kept_equals_plain(build, shape, mode: str, reseed: int | None = None) -> None:
    """Three frozen layers from ``build`` (two pieces each) under per-layer checkpoints: the output and input
    gradient with ``keep_piece_outputs`` (every piece replayed) are bitwise those of plain checkpointing.
    ``reseed``: the RNG seed set again just before the forward (layers that draw random numbers)."""

    def run(keep):
        torch.manual_seed(0)
        layers = build()
        x = torch.randn(*shape, requires_grad=True)
        ckpt = partial(checkpoint, use_reentrant=mode == "reentrant")
        config = SwapConfig.of(prefetch=1, checkpoint_units=True, keep_piece_outputs=True)
        with LayerSwapper(layers, config, device=CPU, log=None) if keep else nullcontext() as swapper:
            ckpt = swapper.checkpoint_function(ckpt) if keep else ckpt
            if reseed is not None:
                torch.manual_seed(reseed)
            h = x
            for layer in layers:
                h = ckpt(layer, h)
            h.square().sum().backward()
            assert not keep or swapper.feature(UnitCheckpoints).replayed == 6
        return h.detach(), x.grad

    (out, grad), (kept_out, kept_grad) = run(False), run(True)
    assert torch.equal(out, kept_out) and torch.equal(grad, kept_grad)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_kept_outputs_reproduce_random_draws_none_arguments_and_keywords(mode):
    """Kept outputs, bitwise as plain per-layer checkpointing: each piece's rerun draws the dropout mask of its
    first run, the recompute leaves the RNG where the skipped piece left it (the layer's own dropout after it
    draws the same), and ``None`` inputs, keyword inputs and a ``None`` output pass through."""

    assert_kept_equals_plain(lambda: [RandomBlock().requires_grad_(False) for _ in range(3)], (4, 64), mode, 1)


AUTOCAST_SHAPE = flux_autocast.FluxShape(heads=4, image_side=8, text_tokens=16)  # Flux's head width, 4 heads


@pytest.fixture(scope="module")
def autocast_references():
    """The Flux-shaped layers that autocast inside their forward, and all-resident training per checkpoint mode."""
    template = flux_autocast.build_layers(AUTOCAST_SHAPE, diffusers=False)
    cache = {}

    def get(reentrant):
        if reentrant not in cache:
            layers, trainable = flux_autocast.fresh(template, CPU)
            cache[reentrant] = flux_autocast.train(layers, trainable, AUTOCAST_SHAPE, CPU, reentrant)
        return cache[reentrant]

    return template, get


def kept_autocast_run(template, shape, reentrant, unit_mb):
    layers, trainable = flux_autocast.fresh(template, None)
    config = SwapConfig.of(prefetch=1, checkpoint_units=True, keep_piece_outputs=True, swap_unit_mb=unit_mb)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert {type(p.module).__name__ for p in swapper.pieces} >= {"TimeModulation", "Modulation", "Sequential"}
        assert any(entry.holder for entry in swapper.entries) == bool(unit_mb)
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=reentrant))
        record = flux_autocast.train(layers, trainable, shape, CPU, reentrant, checkpoint_fn=ckpt)
        assert swapper.feature(UnitCheckpoints).replayed == 3 * len(swapper.pieces), "every piece's output, every step"
    return record


@pytest.mark.parametrize("reentrant, unit_mb", [(False, 0), (True, 0), (False, 4)])
def test_kept_outputs_of_layers_that_autocast_inside_train_bitwise_the_same(autocast_references, reentrant, unit_mb):
    """Flux-shaped blocks at Flux's head width, each forward under bf16 autocast and its modulation called in a
    nested float32 region, LoRA r16 on every Linear: with keep_piece_outputs (whole layers, or 4 MB swap units)
    three AdamW steps give all-resident training's losses and LoRA weights. The pieces' inputs are float32 (the
    norms' output) that each LoRA Linear casts twice, once per use; a rerun that took them as leaves (one cast
    shared by both uses, their gradients summed in bf16) differed from step 2."""
    template, reference = autocast_references
    flux_autocast.assert_same(reference(reentrant), kept_autocast_run(template, AUTOCAST_SHAPE, reentrant, unit_mb))


@pytest.mark.slow  # importing diffusers alone takes 6 to 20 s on 2 cores
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_kept_outputs_of_diffusers_flux_blocks_under_autocast_train_bitwise_the_same(reentrant):
    """diffusers' own Flux blocks (their attention a piece whose float32 input feeds six projections), 4 heads of
    Flux's 128, under bf16 autocast: as above."""
    pytest.importorskip("diffusers")
    template = flux_autocast.build_layers(AUTOCAST_SHAPE, diffusers=True)
    expected = flux_autocast.train(*flux_autocast.fresh(template, CPU), AUTOCAST_SHAPE, CPU, reentrant)
    layers, trainable = flux_autocast.fresh(template, None)
    config = SwapConfig.of(prefetch=1, checkpoint_units=True, keep_piece_outputs=True, swap_unit_mb=0)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert "FluxAttention" in {type(p.module).__name__ for p in swapper.pieces}
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=reentrant))
        got = flux_autocast.train(layers, trainable, AUTOCAST_SHAPE, CPU, reentrant, checkpoint_fn=ckpt)
    flux_autocast.assert_same(expected, got)


class Projections(nn.Module):
    """Two projections of one input: under bf16 autocast each casts a float32 input, or both share one cast."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.a(x) * self.b(x)


class CastingBlock(nn.Module):
    """Under bf16 autocast: a piece given the layer's own float32 input (a leaf where the layer's input is one:
    the first layer's, or any in a reentrant recompute), then one given an intermediate. Each input is read by its
    piece alone (see the module docstring of unit_checkpoints)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first, self.second = Projections(width), Projections(width)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.first(x)
            return (h + self.second(F.layer_norm(h.float(), h.shape[-1:]))).float()


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_a_reruns_inputs_are_leaves_where_the_pieces_inputs_were(mode):
    """Autocast casts a float32 leaf that requires grad once per region (the uses share the cast, and their
    gradients add in bf16 before one cast back), any other input once per use. A piece's rerun for its backward
    takes an input as a leaf only where the piece's own call had a leaf there: the input gradient is bitwise that
    of plain checkpointing (a rerun of leaves alone differs at the second piece, one of views alone at the
    first)."""

    assert_kept_equals_plain(lambda: [CastingBlock().requires_grad_(False) for _ in range(3)], (4, 8, 64), mode)


class ReordersInRecompute(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first, self.second = Gate(width), Gate(width)

    def forward(self, x):
        order = (
            (self.second, self.first) if torch._C._current_autograd_node() is not None else (self.first, self.second)
        )
        for piece in order:
            x = x + piece(x, scale=1.0)[0]
        return x


def test_a_recompute_calling_its_pieces_in_another_order_is_one_line():
    layers = [ReordersInRecompute().requires_grad_(False) for _ in range(2)]
    x = torch.randn(4, 64, requires_grad=True)
    config = SwapConfig.of(prefetch=1, checkpoint_units=True, keep_piece_outputs=True)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
        h = x
        for layer in layers:
            h = ckpt(layer, h)
        with pytest.raises(DGLSUserError, match="called its pieces in another order than its forward did"):
            h.sum().backward()


@pytest.mark.parametrize("keep", [False, True], ids=["rerun", "keep_piece_outputs"])
@pytest.mark.parametrize("unit_mb", [UNIT_MB, 0])
def test_checkpointed_units_in_eval_and_full_fine_tuning(unit_mb, keep):
    reference_layers, _ = make_layers()
    layers, _ = make_layers()
    data = train.__globals__["SyntheticLatents"](SMALL, samples=2, image_tokens=4, text_tokens=2, seed=0)
    inputs, _ = next(data.batches(2, torch.float32, CPU))
    config = SwapConfig.of(swap_unit_mb=unit_mb, checkpoint_units=True, keep_piece_outputs=keep)
    with torch.no_grad():
        expected = run_layers(reference_layers, inputs, "none")
        with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
            ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False))
            assert torch.equal(run_layers(layers, inputs, "nonreentrant", ckpt), expected)
            assert swapper.feature(UnitCheckpoints).reruns == swapper.feature(UnitCheckpoints).replayed == 0
    layers = full_layers()
    config = SwapConfig.of(
        host_optimizer=SPEC,
        accumulation_steps=2,
        prefetch=2,
        swap_unit_mb=unit_mb,
        checkpoint_units=True,
        keep_piece_outputs=keep,
    )
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        names = host_trained_names(layers, swapper)
        ckpt = swapper.checkpoint_function(partial(checkpoint, use_reentrant=False)) if keep else None
        record = train_dgls(layers, swapper, CPU, "nonreentrant", checkpoint_fn=ckpt)
        assert swapper.feature(UnitCheckpoints).replayed > 0 or not keep
    assert_same(record, train_reference(full_layers(), names, CPU, "nonreentrant"))


class KeywordBlock(nn.Module):
    """Calls its first MLP with a keyword argument, as a Flux block calls its attention."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.second = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.inputs: list[weakref.ref] = []

    def forward(self, x):
        h = x * 2
        self.inputs.append(weakref.ref(h))
        x = x + self.first(input=h)
        return x + self.second(x)


def test_a_pieces_keyword_inputs_are_not_held_from_forward_to_backward():
    """Under a non-reentrant layer checkpoint nothing of the forward stays but the layers' inputs: a piece's
    keyword argument must reach its checkpoint as a saved input, not through a closure that keeps it alive."""
    torch.manual_seed(0)
    layers = [KeywordBlock() for _ in range(3)]
    for p in (p for layer in layers for p in layer.parameters()):
        p.requires_grad_(False)
    x = torch.randn(4, 64, requires_grad=True)

    def loss():
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return h.square().sum()

    loss().backward()
    expected, x.grad = x.grad, None
    with LayerSwapper(layers, SwapConfig.of(checkpoint_units=True, prefetch=1), device=CPU, log=None) as swapper:
        assert [type(p.module).__name__ for p in swapper.pieces] == ["Sequential"] * 6
        value = loss()
        gc.collect()
        assert all(ref() is None for layer in layers for ref in layer.inputs), "a keyword input is kept alive"
        value.backward()
    assert torch.equal(x.grad, expected)


def test_checkpoint_units_without_child_modules_is_refused_in_one_line():
    layers = [nn.Linear(8, 8) for _ in range(3)]
    with pytest.raises(DGLSUserError, match="no layer has child modules with params: drop checkpoint_units"):
        LayerSwapper(layers, SwapConfig.of(checkpoint_units=True), device=CPU, log=None)


def test_a_piece_with_a_forward_of_its_own_is_refused_before_anything_changes():
    layers, _ = make_layers()
    mlp = layers[1].img_mlp
    mlp.forward = mlp.forward  # as torch.compile(module.forward) or a trainer's patch would
    devices = {p.device for layer in layers for p in layer.parameters()}
    with pytest.raises(DGLSUserError, match="Sequential already has a forward of its own"):
        LayerSwapper(layers, SwapConfig.of(checkpoint_units=True), device=CPU, log=None)
    assert {p.device for layer in layers for p in layer.parameters()} == devices
    assert not layers[1]._forward_pre_hooks, "nothing was installed"


def test_mutation_no_hooks_above_a_units_checkpoint_is_caught(monkeypatch):
    """At 0.04 MB a double block's MLP is one unit, and a piece: without DGLS's hooks above its checkpoint in its
    first run, views of its slot are counted by the checkpoint in the forward but bypass it in the rerun (whose
    module call pushes them): torch refuses the mismatch."""
    monkeypatch.setattr(HookAdapter, "saved_tensor_hooks", lambda self, idx: nullcontext())
    with pytest.raises(CheckpointError, match="different number of tensors"):
        split_run("nonreentrant", checkpoint_units=True, swap_unit_mb=0.04)


# ---------------------------------------------------------------- mutations
@pytest.mark.parametrize("mode", ["none", "nonreentrant"])
@pytest.mark.parametrize("checkpointed", [None, UNIT_MB, 0])
def test_mutation_no_compute_side_wait_reads_poison(references, mode, checkpointed, monkeypatch):
    monkeypatch.setattr(DeferredCopier, "_wait", lambda self, token: None)
    config = {} if checkpointed is None else {"checkpoint_units": True, "swap_unit_mb": checkpointed}
    got = split_run(mode, **config)
    assert any(torch.isnan(loss).any() for loss in got.losses)


@pytest.mark.parametrize("mode", ["none", "nonreentrant"])
def test_mutation_no_saved_tensor_protection_differs(references, mode, monkeypatch):
    """The units of a checkpointed layer share its region: without DGLS's hooks over the checkpoint's, its
    recompute keeps views of slots that other units overwrite before backward reads them."""
    monkeypatch.setattr(HookAdapter, "_push_saved_tensor_hooks", lambda self, outer: None)
    with pytest.raises(AssertionError):
        for seed in (None, 0):
            assert_bitwise_equal(references(mode), split_run(mode, prefetch=1, seed=seed))


# ---------------------------------------------------------------- a holder that reads a unit's weights itself
class ReadsChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.second = nn.Linear(64, 64)

    def forward(self, x):
        return F.linear(self.first(x), self.second.weight)  # never calls self.second


def test_a_holder_reading_a_units_weights_fails_with_a_note_naming_the_setting():
    layers = [nn.Linear(64, 64), ReadsChildWeight(), ReadsChildWeight(), nn.Linear(64, 64)]
    for p in (p for layer in layers for p in layer.parameters()):
        p.requires_grad_(False)
    with LayerSwapper(layers, SwapConfig.of(swap_unit_mb=0.01, prefetch=0), device=CPU, log=None):
        with pytest.raises(RuntimeError) as failure:
            x = torch.randn(2, 64)
            for layer in layers:
                x = layer(x)
    notes = "\n".join(getattr(failure.value, "__notes__", []))
    assert "swap_unit_mb = 0" in notes and "layer 1 (ReadsChildWeight)" in notes


# ---------------------------------------------------------------- the planner's choice
def test_the_planner_splits_only_when_two_slots_crowd_the_budget():
    layers, _ = make_layers()
    sizes = [layout.sizes for layout in measure(layers)]
    largest = max(s.slot_bytes for s in sizes)
    assert unit_bytes_for_budget(sizes, 8 * largest) is None
    assert unit_bytes_for_budget(sizes, 8 * largest - 8) == (8 * largest - 8) // 24


def test_under_a_tight_vram_budget_layers_are_split_and_training_stays_exact(references):
    layers, trainable = make_layers()
    lines = []
    budget_gb = 2**20 / 2**30  # 1 MiB: two slots of a whole double block take over a quarter
    with LayerSwapper(layers, SwapConfig.of(vram_budget=budget_gb), device=CPU, log=lines.append) as swapper:
        assert any(entry.holder for entry in swapper.entries)
        assert any("stream as swap units" in line for line in lines)
        got = train(layers, trainable, CPU, "nonreentrant", steps=4)
    assert_bitwise_equal(train(*make_layers(), CPU, "nonreentrant", steps=4), got)
    with LayerSwapper(*make_layers()[:1], SwapConfig.of(vram_budget=1.0), device=CPU, log=None) as swapper:
        assert not any(entry.holder for entry in swapper.entries), "a roomy budget keeps layers whole"


def test_a_unit_size_under_a_byte_still_splits_and_trains_bitwise_the_same(references):
    """``--swap_unit_mb 1e-9`` (a thousandth of a byte) asks for the smallest units, not for whole layers: it
    rounds up to one byte, so every child with weights is a unit of its own (weightless ones are never units)."""
    layers, _ = make_layers()
    with LayerSwapper(layers, SwapConfig.of(swap_unit_mb=1e-9), device=CPU, log=None) as swapper:
        assert swapper.unit_bytes == 1
        parts = [e for e in swapper.entries if e.part and not e.holder]
        assert parts and all(any(True for _ in e.value.parameters()) for e in parts)
        assert {e.layer for e in swapper.entries if e.holder} == set(range(len(layers)))
    assert_bitwise_equal(references("nonreentrant"), split_run("nonreentrant", swap_unit_mb=1e-9))


def test_swap_unit_mb_zero_keeps_layers_whole_under_any_budget():
    layers, _ = make_layers()
    config = SwapConfig.of(vram_budget=2**20 / 2**30, swap_unit_mb=0)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert not any(entry.holder for entry in swapper.entries)


def test_units_forward_in_eval_mode_matches():
    """A forward without grad (eval, sampling) through split layers gives the unsplit outputs."""
    reference_layers, _ = make_layers()
    layers, _ = make_layers()
    data = train.__globals__["SyntheticLatents"](SMALL, samples=2, image_tokens=4, text_tokens=2, seed=0)
    inputs, _ = next(data.batches(2, torch.float32, CPU))
    with torch.no_grad():
        expected = run_layers(reference_layers, inputs, "none")
        with LayerSwapper(layers, SwapConfig.of(swap_unit_mb=UNIT_MB), device=CPU, log=None):
            assert torch.equal(run_layers(layers, inputs, "none"), expected)
