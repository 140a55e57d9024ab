"""The demo's gradient accumulation ([demo] gradient_accumulation_steps): layer-major by default, through DeepSpeed's
pipeline engine (utils/dgls/trainers/layer_major_batches.py), with the numbers of the same micro-batches run one after
another (layer_major = false), and each streamed layer copied once a direction a step."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import demo_toml, run_in_process
from safetensors.torch import load_file

from utils.dgls.errors import DGLSUserError
from utils.dgls.program.validate import prepare


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
def test_the_demo_accumulates_layer_major_with_the_numbers_of_sequential_micro_batches(tmp_path, capsys, flags):
    layer_major, lm_losses, lm_out = demo_run(tmp_path / "lm", capsys, *flags, gradient_accumulation_steps=4)
    sequential, seq_losses, seq_out = demo_run(
        tmp_path / "seq", capsys, *flags, gradient_accumulation_steps=4, layer_major=False
    )
    assert "4 micro-batches a step, layer-major" in lm_out and "one after another (layer_major = false)" in seq_out
    assert lm_losses == seq_losses and len(lm_losses) == 3
    assert layer_major.keys() == sequential.keys() and len(layer_major) > 10
    for k in layer_major:
        assert torch.equal(layer_major[k], sequential[k]), k
    one, _, one_out = demo_run(tmp_path / "one", capsys, *flags)
    assert streamed_bytes(lm_out) == streamed_bytes(one_out) != streamed_bytes(seq_out)


def test_lazy_lora_steps_multiply_the_layer_major_micro_batches(tmp_path, capsys):
    _, _, out = demo_run(tmp_path, capsys, "--lazy_lora_steps", "2", gradient_accumulation_steps=2)
    assert "DGLS: 4 micro-batches a step, layer-major" in out


def test_a_full_fine_tune_accumulates_layer_major_with_the_numbers_of_sequential_micro_batches(tmp_path, capsys):
    layer_major, lm_losses, _ = demo_run(tmp_path / "lm", capsys, base="demo_full.toml", gradient_accumulation_steps=2)
    sequential, seq_losses, _ = demo_run(
        tmp_path / "seq", capsys, base="demo_full.toml", gradient_accumulation_steps=2, layer_major=False
    )
    assert lm_losses == seq_losses
    for k in layer_major:
        assert torch.equal(layer_major[k], sequential[k]), k


def test_layer_major_with_several_pipeline_stages_is_refused(tmp_path):
    config = demo_toml(tmp_path, pipeline_stages=2, layer_major=True)
    with pytest.raises(DGLSUserError, match="layer_major = true runs a step's micro-batches layer by layer on one"):
        prepare(["--config", str(config)], tmp_path)


def test_several_stages_say_their_micro_batches_run_one_after_another():
    from utils.dgls.demo.train import accumulation_line

    class S:
        layer_major, pipeline_stages = True, 2

        def micro_batches(self, lazy):
            return 4

        def runs_layer_major(self, lazy):
            return False

    assert "one after another: layer-major runs one pipeline stage, and this run has 2" in accumulation_line(S(), 1)


@pytest.mark.slow
def test_a_bf16_lora_accumulates_layer_major_with_the_numbers_of_sequential_micro_batches(tmp_path, capsys):
    """DeepSpeed's bf16 optimizer adds each micro-batch's gradient into its fp32 sums (immediate_grad_update, which the
    demo sets when it runs layer-major): the same sums as one backward a micro-batch."""
    bf16 = {"dtype": "bfloat16"}
    layer_major, lm_losses, _ = demo_run(tmp_path / "lm", capsys, model=bf16, gradient_accumulation_steps=4)
    sequential, seq_losses, _ = demo_run(
        tmp_path / "seq", capsys, model=bf16, gradient_accumulation_steps=4, layer_major=False
    )
    assert lm_losses == seq_losses
    for k in layer_major:
        assert torch.equal(layer_major[k], sequential[k]), k


class FakeEngine:
    """What layer_major_batches.refusal reads of a DeepSpeed pipeline engine."""

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
