"""The demo's gradient accumulation ([demo] gradient_accumulation_steps): layer-major by default, through DeepSpeed's
pipeline engine (utils/dgls/trainers/layer_major_batches.py), with the numbers of the same micro-batches run one after
another (layer_major = false), and each streamed layer copied once a direction a step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cli_helpers import demo_toml, run_in_process
from safetensors.torch import load_file

from utils.dgls.errors import DGLSUserError
from utils.dgls.program import validate
from utils.dgls.program.validate import deepspeed_too_old_for_layer_major, prepare

# DeepSpeed below 0.19 (requirements.txt's floor, CI's floors step) runs micro-batches one after another and says
# why (test_an_older_deepspeed_runs_micro_batches_one_after_another): the layer-major tests need a newer one
needs_layer_major = pytest.mark.skipif(
    deepspeed_too_old_for_layer_major() is not None, reason=str(deepspeed_too_old_for_layer_major())
)


def demo_run(folder, capsys, *flags, base="demo.toml", **demo):
    config = demo_toml(folder, steps=3, base=base, **demo)
    code, out, err = run_in_process(["--config", str(config), *flags], capsys)
    assert code == 0, err
    (saved,) = (folder / "out").glob("*/*.safetensors")
    losses = [line.split("loss ")[1].split(",")[0] for line in out.splitlines() if line.startswith("step ")]
    return load_file(str(saved)), losses, out


def streamed_bytes(out: str) -> str:
    """The summary's bytes streamed over the run."""
    (summary,) = [line for line in out.splitlines() if line.startswith("DGLS demo finished")]
    return summary.split("; streamed ")[1].split(";")[0]


@pytest.mark.parametrize(
    "flags", [(), pytest.param(("--offload_activations",), marks=pytest.mark.slow)], ids=["plain", "offload"]
)
@needs_layer_major
def test_the_demo_accumulates_layer_major_with_the_numbers_of_sequential_micro_batches(tmp_path, capsys, flags):
    layer_major, lm_losses, lm_out = demo_run(tmp_path / "lm", capsys, *flags, gradient_accumulation_steps=4)
    sequential, seq_losses, seq_out = demo_run(
        tmp_path / "seq", capsys, *flags, "--no-layer_major", gradient_accumulation_steps=4
    )
    assert "4 micro-batches a step, layer-major" in lm_out and "one after another (--no-layer_major)" in seq_out
    assert lm_losses == seq_losses and len(lm_losses) == 3
    assert layer_major.keys() == sequential.keys() and len(layer_major) > 10
    for k in layer_major:
        assert torch.equal(layer_major[k], sequential[k]), k
    one, _, one_out = demo_run(tmp_path / "one", capsys, *flags)
    assert streamed_bytes(lm_out) == streamed_bytes(one_out) != streamed_bytes(seq_out)


@needs_layer_major
def test_lazy_lora_steps_multiply_the_layer_major_micro_batches(tmp_path, capsys):
    _, _, out = demo_run(tmp_path, capsys, "--lazy_lora_steps", "2", gradient_accumulation_steps=2)
    assert "DGLS: 4 micro-batches a step, layer-major" in out


@needs_layer_major
def test_a_full_fine_tune_accumulates_layer_major_with_the_numbers_of_sequential_micro_batches(tmp_path, capsys):
    layer_major, lm_losses, _ = demo_run(tmp_path / "lm", capsys, base="demo_full.toml", gradient_accumulation_steps=2)
    sequential, seq_losses, _ = demo_run(
        tmp_path / "seq", capsys, "--no-layer_major", base="demo_full.toml", gradient_accumulation_steps=2
    )
    assert lm_losses == seq_losses
    for k in layer_major:
        assert torch.equal(layer_major[k], sequential[k]), k


@needs_layer_major
def test_an_explicit_layer_major_with_several_pipeline_stages_is_refused():
    """The check the demo and the drop-in run (before anything is built)."""
    from utils.dgls.program.options import COMMAND_LINE, Resolved
    from utils.dgls.program.validate import _check_layer_major

    given = Resolved({"layer_major": True}, {"layer_major": COMMAND_LINE})
    with pytest.raises(DGLSUserError, match="--layer_major runs a step's micro-batches layer by layer on one"):
        _check_layer_major(given, 2, "pipeline_stages in x.toml")
    _check_layer_major(given, 1, "pipeline_stages in x.toml")
    _check_layer_major(Resolved({"layer_major": True}, {"layer_major": "default"}), 2, "pipeline_stages in x.toml")


@needs_layer_major
def test_how_a_steps_micro_batches_run_is_said_at_start_up(tmp_path):
    from utils.dgls.demo.train import accumulation_line

    run = prepare(["--config", str(demo_toml(tmp_path, gradient_accumulation_steps=4))], tmp_path)
    for stages, values, said in [
        (1, {}, "layer-major: each layer runs all of them"),
        (2, {}, "one after another: layer-major runs one pipeline stage, and this run has 2"),
        (1, {"layer_major": False}, "one after another (--no-layer_major)"),
        (1, {"dynamic_swapping": False}, "one after another (dynamic swapping is off)"),
    ]:
        line = accumulation_line(dataclasses.replace(run.settings, pipeline_stages=stages), {**run.values, **values})
        assert said in line and line.startswith("DGLS: 4 micro-batches a step"), line


@pytest.mark.slow
@needs_layer_major
def test_a_bf16_lora_accumulates_layer_major_with_the_numbers_of_sequential_micro_batches(tmp_path, capsys):
    """DeepSpeed's bf16 optimizer adds each micro-batch's gradient into its fp32 sums (immediate_grad_update, which the
    demo sets when it runs layer-major): the same sums as one backward a micro-batch."""
    bf16 = {"dtype": "bfloat16"}
    layer_major, lm_losses, _ = demo_run(tmp_path / "lm", capsys, model=bf16, gradient_accumulation_steps=4)
    sequential, seq_losses, _ = demo_run(
        tmp_path / "seq", capsys, "--no-layer_major", model=bf16, gradient_accumulation_steps=4
    )
    assert lm_losses == seq_losses
    for k in layer_major:
        assert torch.equal(layer_major[k], sequential[k]), k


class FakeEngine:
    """What layer_major_batches reads of a DeepSpeed pipeline engine (its refusals, the class's instruction map and
    schedule runner)."""

    _INSTRUCTION_MAP: dict = {}

    def _exec_schedule(self, pipe_schedule) -> None:
        pass

    def __init__(self, stages=1, interval=1, seed_layers=False, fp16=False, bf16=False, immediate=False):
        self.num_stages = stages
        self.module = type("M", (), {"activation_checkpoint_interval": interval, "seed_layers": seed_layers})()
        self._fp16, self._bf16 = fp16, bf16
        self._config = type("C", (), {"bfloat16_config": type("B", (), {"immediate_grad_update": immediate})()})()

    def fp16_enabled(self):
        return self._fp16

    def bfloat16_enabled(self):
        return self._bf16


@pytest.mark.parametrize(
    "engine, message",
    [
        (FakeEngine(stages=2), "runs one pipeline stage, and this run has 2"),
        (FakeEngine(interval=2), "the checkpoint interval is 2"),
        (FakeEngine(seed_layers=True), "seed_layers"),
        (FakeEngine(fp16=True), "fp16 loss scaling"),
        (FakeEngine(bf16=True), "immediate_grad_update = true"),
        (FakeEngine(bf16=True, immediate=True), None),
        (FakeEngine(interval=0), None),
    ],
)
def test_what_layer_major_batches_refuse(engine, message):
    from utils.dgls.trainers.layer_major_batches import layer_major_batches, refusal

    why = refusal(engine)
    assert why is None if message is None else message in why
    if message is not None:
        with pytest.raises(DGLSUserError, match="layer_major = false|pipeline_stages = 1"):
            with layer_major_batches(engine, None):
                pass


@needs_layer_major
def test_a_drop_in_full_fine_tune_runs_layer_major_by_default_and_its_host_sees_one_micro_batch(tmp_path, monkeypatch):
    """Through dgls_train.py's checks (the stand-in checkout): gradient_accumulation_steps 4 on one stage is one
    gradient a step for the host training (summed on the device), unless --no-layer_major or several stages."""
    from cli_helpers import FAKE, fake_config
    from conftest import ROOT

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    tables = '[model]\ntype = "flux"\ndtype = "float32"\n[optimizer]\ntype = "adamw"\nlr = 1e-4\n'
    config = fake_config(tmp_path, top="gradient_accumulation_steps = 4", tables=tables)
    argv = ["--config", str(config), "--diffusion_pipe", str(FAKE), "--blocks_to_swap", "1"]
    assert prepare(argv, ROOT).swap.training.accumulation_steps == 1
    assert prepare([*argv, "--no-layer_major"], ROOT).swap.training.accumulation_steps == 4
    assert prepare([*argv, "--lazy_lora_steps", "2", "--no-layer_major"], ROOT).swap.training.accumulation_steps == 8


@needs_layer_major
def test_the_drop_ins_train_batch_runs_layer_major_where_it_applies():
    """PipelineInterception's train_batch wrapper: DeepSpeed's schedule is replaced for the step on one stage with
    several micro-batches (the engine's instance attributes, removed after), and left alone otherwise; it says
    nothing (start-up said how the micro-batches run)."""
    from utils.dgls.program.options import OPTIONS
    from utils.dgls.trainers.diffusion_pipe import PipelineInterception

    values = {o.name: o.default for o in OPTIONS}
    lines = []
    interception = PipelineInterception(values, log=lines.append)
    engine = FakeEngine()
    engine.micro_batches = 4
    with interception._layer_major(engine):
        assert "_exec_schedule" in vars(engine) and "_INSTRUCTION_MAP" in vars(engine)
    assert "_exec_schedule" not in vars(engine)
    staged = FakeEngine(stages=2)
    staged.micro_batches = 4
    staged.is_last_stage = lambda: True  # the last of 2 keeps DeepSpeed's backward too (test_joined_backward.py)
    staged.is_pipe_partitioned = staged.is_grad_partitioned = False
    with interception._layer_major(staged):
        assert "_exec_schedule" not in vars(staged) and "_INSTRUCTION_MAP" not in vars(staged)
    off = PipelineInterception({**values, "layer_major": False}, log=lines.append)
    with off._layer_major(engine):
        assert "_exec_schedule" not in vars(engine)
    assert lines == []


def _drop_in_argv(tmp_path, monkeypatch, top="gradient_accumulation_steps = 4", world_size=1):
    from cli_helpers import FAKE, fake_config

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    if world_size > 1:  # as the deepspeed launcher starts rank 0 of a job
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world_size))):
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29512")
    return ["--config", str(fake_config(tmp_path, top=top)), "--diffusion_pipe", str(FAKE), "--blocks_to_swap", "1"]


@needs_layer_major
def test_the_drop_in_says_how_a_steps_micro_batches_run_before_the_model_loads(tmp_path, monkeypatch):
    """dgls_train.py's checks (the stand-in checkout) say it in the start-up notes, from the TOML and the flags (it
    came at train.py's first step, after the model loaded)."""
    from conftest import ROOT

    argv = _drop_in_argv(tmp_path, monkeypatch)
    layer_major = "DGLS: 4 micro-batches a step, layer-major: each layer runs all of them before the next"
    assert any(note.startswith(layer_major) for note in prepare(argv, ROOT).notes)
    notes = prepare([*argv, "--no-layer_major"], ROOT).notes
    assert "DGLS: 4 micro-batches a step, one after another (--no-layer_major)" in notes
    notes = prepare([*argv, "--lazy_lora_steps", "2"], ROOT).notes
    assert any(note.startswith("DGLS: 8 micro-batches a step, layer-major") for note in notes)
    one = _drop_in_argv(tmp_path / "one", monkeypatch, top="gradient_accumulation_steps = 1")
    assert not any("micro-batches a step" in note for note in prepare(one, ROOT).notes)


@needs_layer_major
def test_the_drop_ins_layer_major_refusals_come_from_the_start_up_checks(tmp_path, monkeypatch):
    """What the TOML and the flags decide is refused by dgls_train.py's checks, before train.py runs: an explicit
    --layer_major with several pipeline stages (the default says it runs them one after another) and with a DeepSpeed
    older than 0.19."""
    import importlib.metadata

    from conftest import ROOT

    staged = _drop_in_argv(
        tmp_path, monkeypatch, top="gradient_accumulation_steps = 4\npipeline_stages = 2", world_size=2
    )
    with pytest.raises(DGLSUserError, match="--layer_major runs a step's micro-batches layer by layer on one pipeline"):
        prepare([*staged, "--layer_major"], ROOT)
    said = "DGLS: 4 micro-batches a step, one after another: layer-major runs one pipeline stage, and this run has 2"
    assert said in prepare(staged, ROOT).notes
    argv = _drop_in_argv(tmp_path / "old", monkeypatch)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.18.4")
    with pytest.raises(DGLSUserError, match="layer-major needs DeepSpeed 0.19 or newer"):
        prepare([*argv, "--layer_major"], ROOT)
    assert any("one after another: layer-major needs DeepSpeed 0.19" in note for note in prepare(argv, ROOT).notes)


def test_an_older_deepspeed_runs_micro_batches_one_after_another(monkeypatch):
    """DeepSpeed 0.18 (the floor): layer-major does not apply (start-up says why), and an explicit --layer_major is
    one line."""
    import importlib.metadata

    from utils.dgls.program.options import COMMAND_LINE, Resolved

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.18.4")
    why = deepspeed_too_old_for_layer_major()
    assert why is not None and "0.19" in why and "0.18.4" in why
    values = {"layer_major": True, "dynamic_swapping": True}
    assert not validate.layer_major_applies(values, 1, 4)
    given = Resolved({"layer_major": True}, {"layer_major": COMMAND_LINE})
    with pytest.raises(DGLSUserError, match="layer-major needs DeepSpeed 0.19"):
        validate._check_layer_major(given, 1, "x.toml")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.8")
    assert deepspeed_too_old_for_layer_major() is None and validate.layer_major_applies(values, 1, 4)
