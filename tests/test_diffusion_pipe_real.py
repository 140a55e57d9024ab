"""diffusion-pipe's real, unmodified train.py on a tiny random Flux, offline.

Opt-in and slow (marked ``slow``; about 2 minutes on 2 CPU cores): set DGLS_DIFFUSION_PIPE to a
diffusion-pipe checkout (with submodules/HunyuanVideo; ComfyUI is replaced by the
stand-ins in tests/fixtures/dp_shims). Without it every test here is skipped.

The model, data and TOMLs come from tests/fixtures/tiny_flux.py; train.py runs in a
subprocess through tests/fixtures/run_dp_train.py (see dp_runs.py). The other model types
are in test_diffusion_pipe_models_real.py.
"""

import importlib.util
from pathlib import Path

import pytest
from dp_runs import DTYPE, ENV, FIXTURES, checkout_or_skip, only_run_dir, requires_checkout, run_train, saved_model

STEPS = 3

pytestmark = [pytest.mark.slow, requires_checkout]


def _load_fixture(name):
    spec = importlib.util.spec_from_file_location(f"dgls_fixture_{name}", FIXTURES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checkout():
    return checkout_or_skip()


def _eval_runs(tmp_path, names, model_kw=None, **config_kw) -> dict:
    """A tiny Flux, a 4-image dataset and a 1-image eval set; one config per name, each with its own output dir."""
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, **(model_kw or {}))
    data = tiny.write_dataset(tmp_path / "data", n=4, size=64, seed=0)
    eval_data = tiny.write_dataset(tmp_path / "eval_data", n=1, size=64, seed=0, offset=4)
    return {
        name: tiny.write_configs(
            tmp_path / f"cfg_{name}",
            model,
            data,
            tmp_path / f"out_{name}",
            eval_data_dir=eval_data,
            max_steps=STEPS,
            dtype=DTYPE,
            **config_kw,
        )
        for name in names
    }


def test_plain_train_py_runs_and_is_repeatable(checkout, tmp_path):
    """--cache_only, then two seeded training runs reading that cache: both reach
    TRAINING COMPLETE!, save step LoRAs, a DeepSpeed checkpoint and TensorBoard events,
    and their LoRAs are bitwise equal."""
    from safetensors.torch import load_file

    configs = _eval_runs(tmp_path, ("a", "b"))

    cache_log = run_train(checkout, configs["a"], tmp_path / "cache.log", "--cache_only")
    assert "TRAINING COMPLETE!" not in cache_log
    assert not (tmp_path / "out_a").exists() or not any((tmp_path / "out_a").iterdir())

    loras = {}
    for name, config in configs.items():
        log = run_train(checkout, config, tmp_path / f"train_{name}.log")
        assert "TRAINING COMPLETE!" in log
        assert "Creating new shard" not in log, "the training run re-cached instead of reading the shared cache"
        assert log.count("Running eval") == 2  # before step 1 and at step 2
        run_dir = only_run_dir(tmp_path / f"out_{name}")
        for sub in ("step2", f"step{STEPS}"):
            assert (run_dir / sub / "pytorch_lora_weights.safetensors").is_file(), sorted(run_dir.iterdir())
        assert (run_dir / f"global_step{STEPS}" / "mp_rank_00_model_states.pt").is_file()
        assert (run_dir / "latest").read_text().strip() == f"global_step{STEPS}"
        assert list(run_dir.glob("events.out.tfevents.*")), "no TensorBoard events in the run dir"
        loras[name] = run_dir / f"step{STEPS}" / "pytorch_lora_weights.safetensors"

    sd = load_file(loras["a"])
    assert sd and all(k.startswith("transformer.") and ".lora_" in k for k in sd)
    assert any(v.abs().max() > 0 for k, v in sd.items() if ".lora_B." in k), "LoRA B is still zero: no training step"
    assert loras["a"].read_bytes() == loras["b"].read_bytes(), "two seeded runs gave different LoRAs"


@pytest.mark.parametrize(
    "checkpointing, offload, units",
    [
        (True, False, False),
        (False, False, False),
        ("unsloth", False, False),
        (True, True, False),
        ("unsloth", True, False),
        (True, False, True),
        ("unsloth", True, True),
    ],
    ids=["ckpt", "no-ckpt", "unsloth", "ckpt-offload", "unsloth-offload", "ckpt-units", "unsloth-offload-units"],
)
def test_dgls_train_matches_plain_train_py(checkout, tmp_path, checkpointing, offload, units):
    """train.py through dgls_train.py with most blocks streamed (with --offload_activations the checkpointed
    blocks' inputs sent home; with --swap_unit_mb the blocks streamed as their child modules): eval, saves
    and checkpoint as without DGLS, and the LoRA bitwise equal to the plain run's (same seed, shared cache)."""
    from safetensors.torch import load_file

    configs = _eval_runs(
        tmp_path, ("plain", "dgls"), dict(num_double=3, num_single=3), activation_checkpointing=checkpointing
    )
    run_train(checkout, configs["plain"], tmp_path / "cache.log", "--cache_only")
    run_train(checkout, configs["plain"], tmp_path / "plain.log")
    flags = "--blocks_to_swap 5 --prefetch 1 --verbose" + (" --offload_activations" if offload else "")
    flags += " --swap_unit_mb 0.01" if units else ""
    log = run_train(checkout, configs["dgls"], tmp_path / "dgls.log", dgls=flags)
    assert "TRAINING COMPLETE!" in log and log.count("Running eval") == 2
    assert ("activations home" in log) == offload
    assert ("swap units below" in log and "layers and units" in log) == units
    assert "streamed" in log and ("layers and units" if units else "5 layers") in log, "no DGLS placement table"
    assert f"dgls step {STEPS}: swap:" in log, "no per-step DGLS stats with --verbose"
    events = b"".join(p.read_bytes() for p in only_run_dir(tmp_path / "out_dgls").glob("events.out.tfevents.*"))
    assert b"dgls/bytes_moved" in events and b"train/loss" in events, "DGLS stats missing from TensorBoard"
    loras = {}
    for name in ("plain", "dgls"):
        run_dir = only_run_dir(tmp_path / f"out_{name}")
        assert (run_dir / f"global_step{STEPS}" / "mp_rank_00_model_states.pt").is_file()
        loras[name] = load_file(run_dir / f"step{STEPS}" / "pytorch_lora_weights.safetensors")
    assert loras["plain"].keys() == loras["dgls"].keys()
    for key, value in loras["plain"].items():
        assert (loras["dgls"][key] == value).all(), f"{key} differs with DGLS"


def test_dgls_resume_matches_plain_resume(checkout, tmp_path):
    """Stop after 2 steps, --resume_from_checkpoint to step 4: with DGLS the resumed run
    loads the checkpoint into its placement and ends bitwise where the plain resumed run ends."""
    from safetensors.torch import load_file

    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(tmp_path / "data", n=4, size=64, seed=0)
    finals, logs = {}, {}
    for name, dgls in (("plain", None), ("dgls", "--blocks_to_swap 5 --prefetch 1")):
        out = tmp_path / f"out_{name}"
        common = dict(activation_checkpointing=True, eval_every_n_steps=None, eval_before_first_step=False, dtype=DTYPE)
        first = tiny.write_configs(tmp_path / f"cfg1_{name}", model, data, out, max_steps=2, **common)
        second = tiny.write_configs(tmp_path / f"cfg2_{name}", model, data, out, max_steps=4, **common)
        if name == "plain":
            run_train(checkout, first, tmp_path / "cache.log", "--cache_only")
        run_train(checkout, first, tmp_path / f"{name}_1.log", dgls=dgls)
        second_log = tmp_path / f"{name}_2.log"
        logs[name] = run_train(checkout, second, second_log, "--resume_from_checkpoint", seed=1, dgls=dgls)
        assert "Resuming training from checkpoint" in logs[name]
        finals[name] = load_file(only_run_dir(out) / "epoch1" / "pytorch_lora_weights.safetensors")
    assert "streamed" in logs["dgls"], "the resumed run did not place layers with DGLS"
    for key, value in finals["plain"].items():
        assert (finals["dgls"][key] == value).all(), f"{key} differs after resuming with DGLS"


def test_dgls_train_from_inside_the_checkout(checkout, tmp_path):
    """The documented ``python dgls_train.py --config train.toml``, run inside a checkout with neither
    --diffusion_pipe nor DGLS_DIFFUSION_PIPE: dgls_train.py takes the working directory as the
    checkout and the relative config from there, and streams the layers. The checkout is a shadow of
    the real one (symlinks; the TOMLs and data go next to them). It runs through the fixture runner,
    which adds the CPU shims; the command in a clean environment needs a GPU machine."""
    tiny = _load_fixture("tiny_flux")  # puts tests/fixtures (tiny_models) on sys.path
    from tiny_models.checkout import shadow_checkout

    inside = shadow_checkout(checkout, {}, tmp_path / "checkout")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(inside / "tiny_data", n=4, size=64, seed=0)
    tiny.write_configs(inside, model, data, tmp_path / "out", max_steps=2, dtype=DTYPE, eval_every_n_steps=None)
    log = run_train(
        inside,
        Path("train.toml"),
        tmp_path / "dgls.log",
        dgls="--blocks_to_swap 5 --prefetch 1",
        runner_args=("--dgls_finds_checkout",),
        unset=(ENV,),
    )
    assert "TRAINING COMPLETE!" in log and "5 layers (" in log
    assert (only_run_dir(tmp_path / "out") / "step2" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("host_adam", ["torch", "device"])
def test_dgls_full_fine_tune_matches_plain_train_py(checkout, tmp_path, host_adam):
    """No [adapter]: streamed blocks keep fp32 masters and AdamW moments on the host and send their gradients
    home, the rest train with train.py's own AdamW, one clipping norm over both. With ``--host_adam torch`` (the
    kernel train.py's AdamW runs on CPU tensors) the saved model is bitwise the plain full fine-tune's on CPU;
    with ``device`` (torch's fused AdamW kernel on the training device, the state streamed) and on a GPU, within
    the rounding of one kernel against another."""
    configs = _eval_runs(tmp_path, ("plain", "dgls"), dict(num_double=3, num_single=3), full=True)
    run_train(checkout, configs["plain"], tmp_path / "cache.log", "--cache_only")
    run_train(checkout, configs["plain"], tmp_path / "plain.log")
    dgls = f"--blocks_to_swap 5 --prefetch 1 --host_adam {host_adam}"
    log = run_train(checkout, configs["dgls"], tmp_path / "dgls.log", dgls=dgls)
    kernel = "(single-tensor)" if host_adam == "torch" else "on the training device"
    assert "TRAINING COMPLETE!" in log and "DGLS host training:" in log and kernel in log
    plain, got = (
        saved_model(tmp_path / "out_plain", f"step{STEPS}"),
        saved_model(tmp_path / "out_dgls", f"step{STEPS}"),
    )
    _assert_same_model(plain, got, exact=host_adam == "torch")
    first = saved_model(tmp_path / "out_dgls", "step2")
    assert any(not (first[k] == got[k]).all() for k in first if k.startswith("single_blocks.")), (
        "the streamed blocks' saved weights did not change between steps 2 and 3"
    )


def test_dgls_full_fine_tune_with_adamw_optimi_matches_plain_train_py(checkout, tmp_path):
    """diffusion-pipe's example optimizer, ``adamw_optimi``: plain train.py steps every weight with optimi's AdamW;
    DGLS steps the streamed blocks' fp32 masters with AdamW (start-up says so) and the rest with train.py's optimi.
    optimi keeps its moments debiased, so the two agree to rounding, not bitwise."""
    pytest.importorskip("optimi", reason="adamw_optimi needs torch-optimi (diffusion-pipe's requirements have it)")
    table = {"type": "adamw_optimi", "lr": 1e-3, "weight_decay": 0.01}
    configs = _eval_runs(tmp_path, ("plain", "dgls"), dict(num_double=3, num_single=3), full=True, optimizer=table)
    run_train(checkout, configs["plain"], tmp_path / "cache.log", "--cache_only")
    run_train(checkout, configs["plain"], tmp_path / "plain.log")
    log = run_train(checkout, configs["dgls"], tmp_path / "dgls.log", dgls="--blocks_to_swap 5 --prefetch 1")
    assert "TRAINING COMPLETE!" in log and "type 'adamw_optimi': optimi's AdamW is AdamW" in log
    plain, got = (
        saved_model(tmp_path / "out_plain", f"step{STEPS}"),
        saved_model(tmp_path / "out_dgls", f"step{STEPS}"),
    )
    _assert_same_model(plain, got, exact=False)
    first = saved_model(tmp_path / "out_dgls", "step2")
    assert any(not (first[k] == got[k]).all() for k in first if k.startswith("single_blocks.")), (
        "the streamed blocks' saved weights did not change between steps 2 and 3"
    )


def _assert_same_model(expected: dict, got: dict, exact: bool = True) -> None:
    assert expected.keys() == got.keys() and len(expected) > 50
    if DTYPE == "float32" and exact:
        for key, value in expected.items():
            assert (got[key] == value).all(), f"{key} differs with DGLS"
        return
    scale = max(v.abs().max().item() for v in expected.values())
    worst = max((expected[k].float() - got[k].float()).abs().max().item() for k in expected)
    assert worst <= (1e-2 if DTYPE != "float32" else 1e-5) * scale, worst


def test_dgls_full_fine_tune_resume_matches_plain_resume(checkout, tmp_path):
    """Full fine-tune: 2 steps, then --resume_from_checkpoint to 4. DGLS restores the masters from the model
    states and the host optimizer's moments from its file beside them, and ends where plain train.py's resumed
    run ends (bitwise on CPU with --host_adam torch)."""
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(tmp_path / "data", n=4, size=64, seed=0)
    common = dict(
        activation_checkpointing=True, eval_every_n_steps=None, eval_before_first_step=False, dtype=DTYPE, full=True
    )
    finals = {}
    for name, dgls in (("plain", None), ("dgls", "--blocks_to_swap 5 --prefetch 1 --host_adam torch")):
        out = tmp_path / f"out_{name}"
        first = tiny.write_configs(tmp_path / f"cfg1_{name}", model, data, out, max_steps=2, **common)
        second = tiny.write_configs(tmp_path / f"cfg2_{name}", model, data, out, max_steps=4, **common)
        if name == "plain":
            run_train(checkout, first, tmp_path / "cache.log", "--cache_only")
        run_train(checkout, first, tmp_path / f"{name}_1.log", dgls=dgls)
        log = run_train(checkout, second, tmp_path / f"{name}_2.log", "--resume_from_checkpoint", seed=1, dgls=dgls)
        assert "Resuming training from checkpoint" in log
        finals[name] = saved_model(out, "epoch1")
    assert list(only_run_dir(tmp_path / "out_dgls").glob("global_step2/dgls_host_optimizer_stage0.pt"))
    _assert_same_model(finals["plain"], finals["dgls"])
