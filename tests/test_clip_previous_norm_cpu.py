"""``clip_mode = "previous_norm"`` on the CPU (utils/dgls/training/previous_norm.py): each streamed layer's update
starts as its gradients land, scaled by the previous step's clip coefficient. Its numbers are bitwise a reference
that clips every step after the first with the previous step's coefficient (tests/full_ft.py, ``previous_norm``),
step 1 is exact clipping, the updates start before the backward ends, the default stays exact, and what the mode
cannot combine with is refused in one line."""

import pytest
import torch
from cli_helpers import demo_toml, run_in_process, snapshot
from full_ft import (
    DEVICE,
    FUSED,
    MAX_NORM,
    NEVER_CLIPS,
    SGD,
    SPEC,
    SPLIT,
    assert_same,
    differs,
    full_layers,
    host_trained_names,
    loss_of_a_layer_run_twice,
    train_dgls,
    train_reference,
)

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.streaming.config import TrainingPolicy
from utils.dgls.training import host_training
from utils.dgls.training.host_optimizer import HostOptimizerSpec

CPU = torch.device("cpu")
BF16 = torch.bfloat16
# steps that clip and one that does not: the coefficient applied changes from step to step
NORMS = [MAX_NORM, MAX_NORM, NEVER_CLIPS, MAX_NORM, 0.02]


def previous_norm_run(
    spec, dtype=BF16, accumulate=1, norms=NORMS, exact_reference=False, lines=None, stray_grads=None,
    untouched_last=frozenset(), **kw
):  # fmt: skip
    """DGLS with clip_mode previous_norm and the reference (clipping by the previous step's coefficient, or
    with ``exact_reference`` by each step's own); ``stray_grads``: steps whose norm a param outside the model joins
    (tests/full_ft.py); ``untouched_last``: params without a gradient in a step's last micro-batch."""
    layers = full_layers(dtype)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=accumulate, clip_mode="previous_norm", **kw)
    with LayerSwapper(layers, cfg, device=CPU, log=lines.append if lines is not None else None) as swapper:
        names = host_trained_names(layers, swapper)
        got = train_dgls(
            layers, swapper, CPU, "nonreentrant", steps=len(norms), accumulate=accumulate, dtype=dtype,
            max_norm=norms, stray_grads=stray_grads, untouched_last=untouched_last,
        )  # fmt: skip
        training = swapper.training
    reference_spec = FUSED if spec.on_device and spec.type == "adamw" else spec
    want = train_reference(
        full_layers(dtype), names, CPU, "nonreentrant", steps=len(norms), accumulate=accumulate, dtype=dtype,
        max_norm=norms, host_spec=reference_spec, previous_norm=not exact_reference, stray_grads=stray_grads,
        untouched_last=untouched_last,
    )  # fmt: skip
    return got, want, training


@pytest.mark.parametrize(
    "spec, dtype, accumulate, threading",
    [
        (SPEC, torch.float32, 2, False),  # fp32 sums, their norms from the accumulate job and the norms job
        (FUSED, BF16, 1, False),  # the landings read directly, their norms taken on the device
        (FUSED, BF16, 1, True),  # the job worker's thread
        (SGD, BF16, 1, False),  # SGD: the coefficient scales the step itself
        (DEVICE, BF16, 1, False),  # device updates of flat layers
        (SPLIT, BF16, 2, False),
    ],
    ids=["host-fp32-sums", "host-fused-bf16", "host-fused-bf16-threaded", "sgd-host", "device-flat", "split-sums"],
)
def test_updates_at_the_previous_coefficient_equal_the_reference_bitwise(spec, dtype, accumulate, threading):
    got, want, training = previous_norm_run(spec, dtype, accumulate, threading=threading)
    assert_same(got, want)
    layers = len(training.layers)
    assert training.previous_norm.early_updates == (len(NORMS) - 1) * layers  # every step after the first
    assert training.speculation.spares == {}  # no old values kept: nothing is undone in this mode


def test_the_mode_is_not_exact_clipping_where_steps_clip():
    """The test above can fail: the same run against exact clipping differs (steps 2 on clip by another norm)."""
    got, want, _ = previous_norm_run(FUSED, exact_reference=True)
    assert differs(got, want)


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_step_whose_norm_is_not_finite_leaves_the_next_step_to_wait_for_its_own(value):
    """Step 2's norm overflows (a gradient outside the model, as a trainer's stray inf or nan): its own updates ran
    at step 1's coefficient, and step 3 does not take its coefficient (inf: 0, an update of momentum and weight decay
    only; nan: NaN weights) but waits for its own norm, as step 1 does: bitwise the reference, which clips step 3
    exactly; step 4 takes step 3's."""
    norms = [MAX_NORM] * 4
    got, want, training = previous_norm_run(FUSED, norms=norms, stray_grads={1: value})
    assert_same(got, want)
    assert training.previous_norm.early_updates == 2 * len(training.layers)  # steps 2 and 4; 1 and 3 wait
    assert training.previous_norm.not_finite == 1
    assert "1 step whose norm was not finite" in training.previous_norm.describe()


@pytest.mark.parametrize("spec", [SPEC, SPLIT], ids=["host", "split"])
def test_a_sum_the_last_micro_batch_did_not_touch_keeps_its_norm(spec):
    """A param of a streamed layer with a gradient in micro-batch 1 and none in the last (2 of 2): its sum's norm is
    taken by the norms job queued before the layer's early update (the accumulate job of the last micro-batch takes
    only those it adds to), and the step's norm and numbers are bitwise the reference's."""
    untouched = {"2.txt_mlp.2.weight", "5.linear1.bias"}
    got, want, training = previous_norm_run(spec, torch.float32, 2, norms=[MAX_NORM] * 2, untouched_last=untouched)
    assert_same(got, want)
    assert training.previous_norm.early_updates == len(training.layers)  # step 2's


def test_a_step_the_trainer_does_not_clip_is_refused_in_one_line():
    """After step 1 the host layers' updates ran at the previous coefficient; a step without clip_grad_norm_ would
    leave the resident params unscaled: the step is refused, naming the mode."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=SGD, accumulation_steps=1, clip_mode="previous_norm")
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1)
        with pytest.raises(DGLSUserError, match="clip_mode previous_norm .* this step was not clipped") as caught:
            train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1, start_step=1, max_norm=None)
    assert "\n" not in str(caught.value)


def test_the_step_after_a_load_in_the_same_process_waits_for_its_own_norm():
    """A resume (load_state_dict) has no previous coefficient, in a fresh process or this one: its first step's
    updates wait for its norm, as step 1's."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=SGD, accumulation_steps=1, clip_mode="previous_norm")
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        training = swapper.training
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=2, accumulate=1)
        early = training.previous_norm.early_updates
        assert early == len(training.layers)  # step 2's
        training.load_state_dict(training.state_dict())
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1, start_step=2)
        assert training.previous_norm.early_updates == early


def test_step_one_is_exact_clipping():
    """Step 1 has no previous norm: it waits for its own, and equals exact clipping bitwise."""
    got, want, training = previous_norm_run(FUSED, norms=[MAX_NORM], exact_reference=True)
    assert_same(got, want)
    assert training.previous_norm.early_updates == 0


def test_updates_start_before_the_backward_ends(monkeypatch):
    """The order of events: step 1's updates are queued after the norm; every later step's before the backward
    ends (the last layer's gradients closing is its last event), and none at the step."""
    events: list[str] = []
    layers = full_layers(BF16)
    cfg = SwapConfig.of(host_optimizer=FUSED, accumulation_steps=1, clip_mode="previous_norm")
    with LayerSwapper(layers, cfg, device=CPU) as swapper:
        training = swapper.training
        submit, done, clip = training.updates.submit, training.backward_done, training.clip_grad_norm_
        monkeypatch.setattr(training.updates, "submit", _recorded(events, "update", submit))
        monkeypatch.setattr(training, "backward_done", _recorded(events, "backward_done", done))
        monkeypatch.setattr(training, "clip_grad_norm_", _recorded(events, "norm", clip))
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=3, accumulate=1, dtype=BF16, max_norm=MAX_NORM)
        count = len(training.layers)
    assert count >= 2
    step = ["backward_done", "norm", *["update"] * count]
    early = [*["update"] * count, "backward_done", "norm"]
    assert events == step + early + early, events


def _recorded(events: list[str], name: str, call):
    """``call``, which first appends ``name`` to ``events``."""

    def run(*args, **kwargs):
        events.append(name)
        return call(*args, **kwargs)

    return run


def test_the_default_is_exact_and_takes_its_spares():
    assert TrainingPolicy().clip_mode == "exact"
    lines: list[str] = []
    layers = full_layers(BF16)
    cfg = SwapConfig.of(host_optimizer=FUSED, accumulation_steps=1)
    with LayerSwapper(layers, cfg, device=CPU, log=lines.append) as swapper:
        assert swapper.training.previous_norm is None and swapper.training.speculation.spares
    assert not any("previous_norm" in line for line in lines)


def test_the_start_up_line_says_what_the_mode_does(monkeypatch):
    """Only the line shown is built: the exact mode's (speculation's) line is not made to be dropped."""

    def exact_line(*args):
        raise AssertionError("the exact mode's clipping line built under previous_norm")

    monkeypatch.setattr(host_training, "clipping_line", exact_line)
    lines: list[str] = []
    previous_norm_run(FUSED, norms=[MAX_NORM], lines=lines)
    said = [line for line in lines if line.startswith("DGLS clipping: ")]
    assert len(said) == 1 and "clip_mode previous_norm (inexact, opt-in)" in said[0], lines
    assert "scaled by the previous step's clip coefficient" in said[0] and "step 1 waits" in said[0]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(clip_grads=False), "this run does not clip"),
        (dict(data_parallel=True), "is not built for data-parallel full fine-tuning"),
        (dict(clip_mode="previous"), "clip_mode"),
    ],
    ids=["no-clipping", "data-parallel", "unknown-mode"],
)
def test_the_policy_refuses_what_the_mode_cannot_combine_with_in_one_line(settings, message):
    settings = {"clip_mode": "previous_norm", **settings}
    with pytest.raises(DGLSUserError, match=message) as caught:
        TrainingPolicy(host_optimizer=FUSED, **settings)
    assert "\n" not in str(caught.value)


def test_a_whole_step_optimizer_is_refused_in_one_line():
    whole = next((s for s in _whole_step_specs() if s.whole_step), None)
    if whole is None:
        pytest.skip("pytorch_optimizer is not installed")
    with pytest.raises(DGLSUserError, match="no update can start earlier") as caught:
        TrainingPolicy(host_optimizer=whole, clip_mode="previous_norm")
    assert "\n" not in str(caught.value)


def _whole_step_specs():
    try:
        yield HostOptimizerSpec.from_table({"type": "Prodigy", "lr": 1.0})
    except DGLSUserError:
        return


@pytest.mark.parametrize(
    "base, flags, message",
    [
        ("demo.toml", ("--clip_mode", "previous_norm"), "--clip_mode previous_norm scales the host updates"),
        ("demo.toml", (), "[dgls] clip_mode in"),
    ],
    ids=["flag-with-lora", "toml-key-with-lora"],
)
def test_the_demo_refuses_the_mode_where_no_streamed_layer_trains_on_the_host(
    base, flags, message, tmp_path, capsys, user_env
):
    dgls = None if flags else {"clip_mode": "previous_norm"}
    path = demo_toml(tmp_path, base=base, dgls=dgls if dgls is not None else "keep")
    before = snapshot(tmp_path)
    code, _out, err = run_in_process(["--config", str(path), *flags], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgls: error: ") and message in lines[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["flag", "toml"])
def test_the_demo_full_fine_tune_takes_the_mode_from_the_flag_or_the_toml(where, tmp_path, user_env):
    from conftest import ROOT

    from utils.dgls.program.validate import prepare

    dgls = "keep"
    if where == "toml":
        import toml

        dgls = {
            **toml.loads((ROOT / "toml" / "demo_full.toml").read_text()).get("dgls", {}),
            "clip_mode": "previous_norm",
        }
    path = demo_toml(tmp_path, base="demo_full.toml", dgls=dgls)
    flags = ["--clip_mode", "previous_norm"] if where == "flag" else []
    run = prepare(["--config", str(path), *flags], ROOT)
    assert run.swap.training.clip_mode == "previous_norm" and not run.swap.training.speculates
    assert prepare(
        ["--config", str(demo_toml(tmp_path / "exact", base="demo_full.toml"))], ROOT
    ).swap.training.speculates


def test_a_gradient_after_an_early_update_is_refused_in_one_line_that_names_the_mode():
    """After step 1 a layer's update starts once its step's last micro-batch closed: a further backward before the
    step (more micro-batches than accumulation_steps) has no step to go to."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=SGD, accumulation_steps=1, clip_mode="previous_norm")
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1)  # step 1 waits: nothing early
        with pytest.raises(DGLSUserError, match="with clip_mode previous_norm its update had started") as caught:
            train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=2, start_step=1)
    assert "\n" not in str(caught.value)


def test_a_layer_run_twice_under_reentrant_checkpointing_is_refused_with_the_mode_named():
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=SGD, accumulation_steps=1, clip_mode="previous_norm")
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        train_dgls(layers, swapper, CPU, "nonreentrant", steps=1, accumulate=1)
        loss = loss_of_a_layer_run_twice(layers, swapper)
        with pytest.raises(DGLSUserError, match="second gradient in one backward pass .* use clip_mode exact"):
            loss.backward()


def test_a_drop_in_full_fine_tune_takes_the_mode_and_refuses_it_without_clipping(tmp_path, user_env):
    """diffusion-pipe's train.py (the stand-in checkout): the mode reaches the training policy; with
    ``gradient_clipping = 0`` there is nothing to scale, and the line says so."""
    from cli_helpers import FAKE, FAKE_TABLES, fake_config
    from conftest import ROOT

    from utils.dgls.program.validate import prepare

    full = FAKE_TABLES.replace('[adapter]\ntype = "lora"\nrank = 4\n', "")
    flags = ["--diffusion_pipe", str(FAKE), "--clip_mode", "previous_norm"]
    run = prepare(["--config", str(fake_config(tmp_path / "a", tables=full)), *flags], ROOT)
    assert run.swap.training.clip_mode == "previous_norm" and run.swap.training.clip_grads
    config = fake_config(tmp_path / "b", top="gradient_clipping = 0", tables=full)
    with pytest.raises(DGLSUserError, match="previous step's clip coefficient, and this run does not clip") as caught:
        prepare(["--config", str(config), *flags], ROOT)
    assert "\n" not in str(caught.value)
    lora = fake_config(tmp_path / "c")
    with pytest.raises(DGLSUserError, match="--clip_mode previous_norm scales the host updates"):
        prepare(["--config", str(lora), *flags], ROOT)


class _Training:
    """A host training's part in DeepSpeed's step, whose norm is 3.5."""

    clipping = True

    def __init__(self) -> None:
        self.lr: float | None = None

    def before_step(self) -> None:
        pass

    def adopt(self, params) -> None:
        pass

    def clip_grad_norm_(self, params, max_norm, reduce=None) -> torch.Tensor:
        return torch.tensor(3.5)

    def take_resident_grads(self) -> None:
        pass

    def step(self, lr=None) -> None:
        self.lr = lr

    def mirror_logged_state(self, optimizer, device) -> None:
        pass


def test_the_norm_clipping_took_is_the_one_deepspeed_gives_the_trainers_log():
    """The module doc's promise: the step's norm (host-trained params included) reaches the trainer, through
    DeepSpeed's ``get_global_grad_norm()`` (train.py logs it); DeepSpeed's own step, its clipping held off, left its
    attribute None."""
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    from utils.dgls.trainers.engine_hooks import EngineHooks

    def deepspeed_step(engine) -> None:
        assert engine._config.gradient_clipping == 0.0
        engine._global_grad_norm = None

    training = _Training()
    step = EngineHooks(lambda module: training)._wrap_step(deepspeed_step)
    engine = SimpleNamespace(
        module=torch.nn.Linear(2, 2), zero_optimization=lambda: False, gradient_clipping=lambda: 1.0,
        optimizer=SimpleNamespace(param_groups=[{"lr": 0.5}]), _config=SimpleNamespace(gradient_clipping=1.0),
        device=CPU, _global_grad_norm=None,
    )  # fmt: skip
    step(engine)
    assert DeepSpeedEngine.get_global_grad_norm(engine) == 3.5 and training.lr == 0.5
