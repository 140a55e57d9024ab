"""The demo as a full fine-tune (toml/demo_full.toml: no [adapter]), through DeepSpeed's pipeline engine.

Streamed blocks train on the host and the resident ends with DeepSpeed's optimizer; one gradient norm
covers both (utils/dgls/trainers/engine_hooks.py). The saved model matches the same run with every layer resident
(DGLS off), up to the optimizer kernels: the host runs torch's fused CPU AdamW, DeepSpeed the trainer's
foreach AdamW, and the clipping norms are summed in another order (tests/test_host_training_cpu.py
checks bitwise equality with one implementation).
"""

from __future__ import annotations

import importlib.util

import pytest
from cli_helpers import demo_toml, run_in_process
from conftest import ROOT
from safetensors.torch import load_file

from utils.dgls.errors import DGLSUserError
from utils.dgls.program.validate import DemoRun, prepare
from utils.dgls.trainers.engine_hooks import EngineHooks


def full_run(folder, capsys, *flags, optimizer=None):
    config = demo_toml(folder, steps=4, base="demo_full.toml", optimizer=optimizer)
    code, out, err = run_in_process(["--config", str(config), *flags], capsys)
    assert code == 0, err
    (saved,) = (folder / "out").glob("*/model.safetensors")
    return load_file(str(saved)), out


def test_demo_full_config_passes_the_checks():
    run = prepare(["--config", str(ROOT / "toml" / "demo_full.toml")], ROOT)
    assert isinstance(run, DemoRun) and run.settings.full
    assert run.swap.training.host_optimizer.type == "adamw" and run.swap.training.host_optimizer.lr == 2e-4
    assert run.swap.training.host_optimizer.implementation == "split", "auto: split for AdamW"


PRODIGY = {"type": "Prodigy", "lr": 1.0, "d0": 1e-3}  # d0: the weights move within the test's 4 steps


@pytest.mark.parametrize(
    "optimizer", [None, {"type": "sgd", "lr": 0.05, "momentum": 0.9}, PRODIGY], ids=["adamw", "sgd", "prodigy"]
)
def test_full_fine_tune_with_streaming_trains_what_resident_training_trains(tmp_path, capsys, optimizer):
    """With sgd the resident layers train with SGD too (the trainer's optimizer is the [optimizer] type's class,
    as in diffusion-pipe; it was AdamW whatever the type). Prodigy steps once after the backward, one instance over
    the streamed layers' masters and the resident layers' host copies (the engine hooks hand them over), as the
    resident run's one Prodigy over every param: the same class on the same CPU, so bitwise (Prodigy per layer, or
    beside the trainer's own, differs by 1e-3 here)."""
    if optimizer is PRODIGY and importlib.util.find_spec("pytorch_optimizer") is None:
        pytest.skip("pytorch_optimizer is not installed")
    streamed, out = full_run(tmp_path / "dgls", capsys, optimizer=optimizer)
    resident, _ = full_run(tmp_path / "plain", capsys, "--no-dynamic_swapping", optimizer=optimizer)
    assert "DGLS host training:" in out and "model saved to" in out
    assert streamed.keys() == resident.keys() and len(streamed) > 100
    scale = max(v.abs().max().item() for v in resident.values())
    tolerance = 0.0 if optimizer is PRODIGY else 1e-5 * scale
    assert max((streamed[k] - resident[k]).abs().max().item() for k in streamed) <= tolerance
    losses = [line.split("loss ")[1].split(",")[0] for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 4
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    for cls, name in ((PipelineEngine, "train_batch"), (DeepSpeedEngine, "_take_model_step")):
        assert not hasattr(cls.__dict__[name], "__wrapped__"), f"{cls.__name__}.{name} left patched"


class ZeroEngine:
    module = None

    def zero_optimization(self) -> bool:
        return True


def test_deepspeed_zero_is_refused_with_host_training():
    step = EngineHooks(lambda module: object())._wrap_step(lambda engine: None)
    with pytest.raises(DGLSUserError, match="turn zero_optimization off"):
        step(ZeroEngine())


def test_a_checkpoint_without_the_host_optimizer_state_is_refused(tmp_path):
    class Engine:
        module, grid = None, None

    load = EngineHooks(lambda module: object())._wrap_load(lambda engine, load_dir, tag, *a, **k: None)
    (tmp_path / "latest").write_text("global_step2")
    (tmp_path / "global_step2").mkdir()
    with pytest.raises(DGLSUserError, match="has no DGLS host optimizer state"):
        load(Engine(), str(tmp_path))
