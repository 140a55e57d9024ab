"""diffusion-pipe's real train.py as two data-parallel processes of one machine (CPU, gloo), offline.

Opt-in and slow, as test_diffusion_pipe_real.py (set DGLS_DIFFUSION_PIPE to a checkout): the tiny random Flux of
tests/fixtures/tiny_flux.py, each rank started by run_dp_train.py --rank/--world_size as ``deepspeed --num_gpus=2``
would start it (dp_runs.run_train_ranks).

A full fine-tune through dgls_train.py with two processes trains data parallel: each process updates its share of the
streamed blocks over the one shared host copy (utils/dgls/training/data_parallel.py), rank 0 saves every owner's
masters, each process its share of the host optimizer state (utils/dgls/training/shared_saves.py).

The baseline is plain train.py with the same two processes: one process with the same global batch draws other
noise and timesteps (train.py draws them per process, and both processes start from one seed), so it trains other
numbers; plain DeepSpeed's data parallel is the reference for what two processes train. Equal up to the order of
summation (the gradient norm is summed over the owners in another order), on CPU in float32.
"""

import pytest
from dp_runs import DTYPE, checkout_or_skip, only_run_dir, requires_checkout, run_train, run_train_ranks, saved_model
from test_diffusion_pipe_real import _load_fixture

pytestmark = [pytest.mark.slow, requires_checkout]

WORLD = 2
DGLS = "--blocks_to_swap 5 --prefetch 1 --host_adam torch"
TOLERANCE = 1e-5 if DTYPE == "float32" else 1e-2  # of the weights' scale; the losses: relative


@pytest.fixture(scope="module")
def checkout():
    return checkout_or_skip()


def train_losses(output_dir) -> list[float]:
    """train.py's ``train/loss`` per step (rank 0's TensorBoard events; a resumed run writes into the same folder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(only_run_dir(output_dir)))
    events.Reload()
    return [e.value for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]


def assert_close_models(expected: dict, got: dict, least: int = 50) -> None:
    assert expected.keys() == got.keys() and len(expected) > least
    scale = max(v.abs().max().item() for v in expected.values())
    worst = max((expected[k].float() - got[k].float()).abs().max().item() for k in expected)
    assert worst <= TOLERANCE * scale, (worst, scale)


def test_two_processes_full_fine_tune_with_dgls_train_and_resume_what_plain_train_py_does(checkout, tmp_path):
    """2 steps (one epoch of 4 images over 2 processes), a checkpoint, then --resume_from_checkpoint to step 4, each
    as two data-parallel processes, then one process resumes that to step 6: with DGLS the saved models of steps 2,
    4 and 6 and every step's loss are plain train.py's; the two processes' checkpoint holds each one's share of the
    host optimizer state, and one process takes every layer's state from the two files."""
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(tmp_path / "data", n=4, size=64, seed=0)
    common = dict(epochs=5, eval_every_n_steps=None, eval_before_first_step=False, dtype=DTYPE, full=True)
    models, losses = {}, {}
    for name, dgls in (("plain", None), ("dgls", DGLS)):
        out = tmp_path / f"out_{name}"
        first = tiny.write_configs(tmp_path / f"cfg1_{name}", model, data, out, max_steps=2, **common)
        second = tiny.write_configs(tmp_path / f"cfg2_{name}", model, data, out, max_steps=4, **common)
        if name == "plain":
            run_train(checkout, first, tmp_path / "cache.log", "--cache_only")
        logs = run_train_ranks(checkout, first, tmp_path / f"{name}_1", WORLD, dgls=dgls)
        assert "TRAINING COMPLETE!" in logs[0]
        resumed = run_train_ranks(
            checkout, second, tmp_path / f"{name}_2", WORLD, "--resume_from_checkpoint", dgls=dgls
        )
        assert "Resuming training from checkpoint" in resumed[0] and "TRAINING COMPLETE!" in resumed[0]
        third = tiny.write_configs(tmp_path / f"cfg3_{name}", model, data, out, max_steps=6, **common)
        alone = run_train(checkout, third, tmp_path / f"{name}_3.log", "--resume_from_checkpoint", seed=1, dgls=dgls)
        assert "Resuming training from checkpoint" in alone and "TRAINING COMPLETE!" in alone
        if dgls is not None:
            for log in (logs[0], resumed[0]):
                assert "DGLS data parallel: each of the 2 processes updates its share" in log, log[-3000:]
                assert not any(line.startswith("dgls: ") for line in log.splitlines())
        models[name] = {step: saved_model(out, f"step{step}") for step in (2, 4, 6)}
        losses[name] = train_losses(out)
    tag = only_run_dir(tmp_path / "out_dgls") / "global_step2"
    shares = sorted(p.name for p in tag.glob("dgls_host_optimizer_stage*.pt"))
    assert shares == [f"dgls_host_optimizer_stage0_rank{r}.pt" for r in range(WORLD)], shares
    assert len(losses["plain"]) == len(losses["dgls"]) == 6, losses
    for plain, dgls in zip(losses["plain"], losses["dgls"]):
        assert abs(plain - dgls) <= TOLERANCE * abs(plain) * 10, losses
    for step in (2, 4, 6):
        assert_close_models(models["plain"][step], models["dgls"][step])
    moved = [k for k in models["dgls"][2] if k.startswith("single_blocks.")]
    assert any(not (models["dgls"][2][k] == models["dgls"][4][k]).all() for k in moved), "the resume trained nothing"


def off_bf16_grid(tensor) -> bool:
    """An fp32 value that bf16 cannot hold: a master, not the shared bf16 copy (which is the master rounded)."""
    import torch

    return tensor.dtype == torch.float32 and bool((tensor != tensor.bfloat16().float()).any())


def test_a_bf16_full_fine_tune_of_two_processes_saves_every_owners_fp32_masters(checkout, tmp_path):
    """A bf16 model: each process holds fp32 masters only for its share of the streamed blocks, the other blocks
    as the shared bf16 copy. Rank 0 writes the checkpoint's layer files and the saved model, and both hold every
    streamed block's fp32 master (rank 1's too, sent for the save), as one process saves its own."""
    import torch

    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(tmp_path / "data", n=4, size=64, seed=0)
    # on CPU train.py computes in the model's dtype (no autocast): an fp32 model whose streamed weights DGLS stores
    # and computes in bf16 (the trainable ones keep fp32 masters, as a bf16 model's do)
    dtype, extra = ("bfloat16", "") if DTYPE != "float32" else ("float32", " --mixed_precision bf16 --autocast bf16")
    common = dict(epochs=1, eval_every_n_steps=None, eval_before_first_step=False, dtype=dtype, full=True)
    config = tiny.write_configs(tmp_path / "cfg", model, data, tmp_path / "out", max_steps=2, **common)
    run_train(checkout, config, tmp_path / "cache.log", "--cache_only")
    logs = run_train_ranks(checkout, config, tmp_path / "dgls", WORLD, dgls=DGLS + extra)
    assert "updates its share of the 5 host-trained layers (3/2)" in logs[0], logs[0][-3000:]
    tag = only_run_dir(tmp_path / "out") / "global_step2"
    masters = []
    for path in sorted(tag.glob("layer_*-model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if any(off_bf16_grid(v) for v in state.values()):
            masters.append(path.name)
            assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point()), path.name
    assert len(masters) == 5, masters  # every streamed block, whichever process updates it
    saved = saved_model(tmp_path / "out", "epoch1")  # 4 images over 2 processes: an epoch is 2 steps
    blocks = {".".join(k.split(".")[:2]) for k, v in saved.items() if off_bf16_grid(v)}
    assert len(blocks) == 5, sorted(blocks)


def test_two_processes_sharing_fetches_train_and_evaluate_what_plain_train_py_does(checkout, tmp_path):
    """A LoRA of two data-parallel processes with ``--share_fetch on`` (each copies half of every streamed block and
    gathers the other half from the other process: utils/dgls/memory/fetch_share.py), evaluating before step 1 and
    every 2 steps: train.py's eval passes run on both processes, so their gathers meet. The losses and the LoRA are
    plain train.py's with the same two processes."""
    tiny = _load_fixture("tiny_flux")
    built = tiny.build_all(tmp_path / "fixture", n_images=4, eval_images=2, num_double=3, num_single=3, dtype=DTYPE)
    loras, losses = {}, {}
    for name, dgls in (("plain", None), ("dgls", "--blocks_to_swap 5 --prefetch 1 --share_fetch on")):
        out = tmp_path / f"out_{name}"
        config = tiny.write_configs(
            tmp_path / f"cfg_{name}", built["model"], built["data"], out, eval_data_dir=built["eval_data"],
            max_steps=4, epochs=4, dtype=DTYPE, eval_every_n_steps=2,
        )  # fmt: skip
        if name == "plain":
            run_train(checkout, config, tmp_path / "cache.log", "--cache_only")
        logs = run_train_ranks(checkout, config, tmp_path / name, WORLD, dgls=dgls)
        assert "TRAINING COMPLETE!" in logs[0]
        if dgls is not None:
            assert "DGLS shared fetches: each of the 2 data-parallel processes" in logs[0], logs[0][-3000:]
        loras[name] = saved_model(out, "step4")
        losses[name] = train_losses(out)
    assert len(losses["plain"]) == len(losses["dgls"]) == 4, losses
    for plain, dgls in zip(losses["plain"], losses["dgls"]):
        assert abs(plain - dgls) <= TOLERANCE * abs(plain) * 10, losses
    assert_close_models(loras["plain"], loras["dgls"], least=10)  # a LoRA's tensors
