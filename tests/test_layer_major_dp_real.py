"""Layer-major accumulation inside diffusion-pipe's real, unmodified train.py (``gradient_accumulation_steps = 4``).

The tiny Flux and Wan of tests/fixtures/tiny_models, as test_diffusion_pipe_models_real.py builds and caches them:
a plain seeded run and a run through dgls_train.py with most layers streamed, both with 4 micro-batches a step. Under
DGLS the step's micro-batches run layer-major (the default ``--layer_major``: start-up says so) and the LoRA (the
model, for a full fine-tune) must be bitwise plain train.py's, with the streamed bytes of a step those of one
micro-batch's forward and backward (``--no-layer_major``: four times as many).

Opt-in and slow (marked ``slow``): set DGLS_DIFFUSION_PIPE to a diffusion-pipe checkout.
"""

from __future__ import annotations

import pytest
from dp_runs import DTYPE, requires_checkout, saved_model
from test_diffusion_pipe_models_real import assert_same_lora, checkout, files, prepare, streamed_bytes

pytestmark = [pytest.mark.slow, requires_checkout]
__all__ = ["checkout", "prepare"]  # the fixtures, shared with test_diffusion_pipe_models_real.py

STEPS, MICRO_BATCHES = 3, 4
SAVED = f"epoch{STEPS}"  # one step an epoch: the run ends at an epoch's end, and train.py saves under epoch{n}


def configs(p, out, name, **kw):
    """4 images and 4 micro-batches a step: one step an epoch, STEPS epochs."""
    return files.write_configs(
        out / f"cfg_{name}",
        p.model,
        p.data,
        out / f"out_{name}",
        eval_data_dir=p.eval_data,
        max_steps=STEPS,
        epochs=STEPS,
        dtype=DTYPE,
        activation_checkpointing=True,
        gradient_accumulation_steps=MICRO_BATCHES,
        **kw,
    )


@pytest.mark.parametrize("model_type", ["flux", "wan"])
def test_layer_major_accumulation_matches_plain_train_py(prepare, tmp_path, model_type):
    p = prepare(model_type)
    flags = f"--blocks_to_swap {p.spec.swap} --prefetch 1 --verbose"
    plain_log = p.run(configs(p, tmp_path, "plain"), tmp_path / "plain.log")
    log = p.run(configs(p, tmp_path, "dgls"), tmp_path / "dgls.log", dgls=flags)
    assert "TRAINING COMPLETE!" in plain_log and "TRAINING COMPLETE!" in log
    assert f"DGLS: {MICRO_BATCHES} micro-batches a step, layer-major" in log
    assert_same_lora(tmp_path / "out_plain", tmp_path / "out_dgls", SAVED)
    sequential = p.run(configs(p, tmp_path, "seq"), tmp_path / "seq.log", dgls=flags + " --no-layer_major")
    assert "one after another (--no-layer_major)" in sequential
    assert_same_lora(tmp_path / "out_plain", tmp_path / "out_seq", SAVED)
    layer_major, one_by_one = streamed_bytes(tmp_path / "out_dgls"), streamed_bytes(tmp_path / "out_seq")
    assert layer_major and one_by_one and layer_major[-1] * 2 < one_by_one[-1], (layer_major, one_by_one)


def test_layer_major_full_fine_tune_matches_plain_train_py(prepare, tmp_path):
    """No [adapter]: each streamed block's gradients are summed on the device over the 4 micro-batches and go home
    once; the host steps (``--host_adam torch``) give the plain full fine-tune's model bitwise on the CPU."""
    p = prepare("flux")
    plain_log = p.run(configs(p, tmp_path, "plain", full=True), tmp_path / "plain.log")
    flags = f"--blocks_to_swap {p.spec.swap} --prefetch 1 --host_adam torch"
    log = p.run(configs(p, tmp_path, "dgls", full=True), tmp_path / "dgls.log", dgls=flags)
    assert "TRAINING COMPLETE!" in plain_log and "TRAINING COMPLETE!" in log
    assert f"DGLS: {MICRO_BATCHES} micro-batches a step, layer-major" in log
    plain, got = saved_model(tmp_path / "out_plain", SAVED), saved_model(tmp_path / "out_dgls", SAVED)
    assert plain.keys() == got.keys() and len(plain) > 10
    for key, value in plain.items():
        if DTYPE == "float32":
            assert (got[key] == value).all(), key
        else:
            assert (got[key].float() - value.float()).abs().max() <= 1e-2 * value.float().abs().max().clamp(min=1), key
