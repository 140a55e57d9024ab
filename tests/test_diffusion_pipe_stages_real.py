"""diffusion-pipe's real train.py in two pipeline stages (CPU, gloo), offline, under a VRAM budget.

Opt-in and slow, as test_diffusion_pipe_real.py (set DGLS_DIFFUSION_PIPE to a checkout): the tiny random Flux of
tests/fixtures/tiny_flux.py, each stage started by run_dp_train.py --rank/--world_size as ``deepspeed --num_gpus=2``
would start it (dp_runs.run_train_ranks).

With ``pipeline_stages = 2`` and 4 micro-batches a step, DeepSpeed's schedule runs the first stage's forward of
micro-batch 2 before its backward of micro-batch 1. ``--vram_budget``'s planner re-places the layers from step 3 (its
probe streams every one), between steps only (utils/dgls/trainers/interleaved_steps.py): re-placed between those
micro-batches, a recompute ran under another placement than its forward (torch's CheckpointError). The LoRA and every
step's loss are plain train.py's in the same two stages (up to summation order, as
test_diffusion_pipe_data_parallel_real.py).
"""

import pytest
from dp_runs import DTYPE, checkout_or_skip, requires_checkout, run_train, run_train_ranks, saved_lora
from safetensors.torch import load_file
from test_diffusion_pipe_data_parallel_real import train_losses
from test_diffusion_pipe_real import _load_fixture

pytestmark = [pytest.mark.slow, requires_checkout]

STEPS = 6
TOLERANCE = 1e-5 if DTYPE == "float32" else 1e-2


@pytest.fixture(scope="module")
def checkout():
    return checkout_or_skip()


def test_two_stages_under_a_vram_budget_train_what_plain_train_py_trains(checkout, tmp_path):
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(tmp_path / "data", n=8, size=64, seed=0)
    common = dict(
        epochs=10, max_steps=STEPS, save_every_n_steps=STEPS, eval_every_n_steps=None, eval_before_first_step=False,
        dtype=DTYPE, gradient_accumulation_steps=4, activation_checkpointing=True, extra={"pipeline_stages": 2},
    )  # fmt: skip
    loras, losses, logs = {}, {}, {}
    for name, dgls in (("plain", None), ("dgls", "--vram_budget 0.0006 --swap_unit_mb 0.02")):
        out = tmp_path / f"out_{name}"
        config = tiny.write_configs(tmp_path / f"cfg_{name}", model, data, out, **common)
        if name == "plain":
            run_train(checkout, config, tmp_path / "cache.log", "--cache_only")
        logs[name] = run_train_ranks(checkout, config, tmp_path / name, 2, dgls=dgls)
        assert "TRAINING COMPLETE!" in logs[name][0]
        loras[name] = load_file(saved_lora(out, f"step{STEPS}"))
        losses[name] = train_losses(out)
    first_stage = logs["dgls"][0].splitlines()
    plans = [line for line in first_stage if "DGLS plan (" in line]
    assert plans, logs["dgls"][0][-4000:]  # the first stage re-placed its layers while training (from step 3)
    assert len(losses["plain"]) == len(losses["dgls"]) == STEPS, losses
    for plain, dgls in zip(losses["plain"], losses["dgls"], strict=True):
        assert abs(plain - dgls) <= TOLERANCE * abs(plain) * 10, losses
    assert loras["plain"].keys() == loras["dgls"].keys() and loras["plain"]
    scale = max(v.abs().max().item() for v in loras["plain"].values())
    worst = max((loras["plain"][k].float() - loras["dgls"][k].float()).abs().max().item() for k in loras["plain"])
    assert worst <= TOLERANCE * scale * 10, (worst, scale)
