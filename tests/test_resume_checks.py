"""Resuming a diffusion-pipe run: the checkpoint is checked before start-up (utils/dgls/program/resume.py, from
dp_config.check_resume) and again where DeepSpeed loads it (the layer files against the layers, DGLS's host
optimizer state against the host training), each problem one line naming the file and what to do.

The refusals before start-up through dgls_train.py are cases of tests/test_bad_inputs.py; here the checks
that pass, and the ones inside a run, with stand-in engines (no process group: :func:`resume.agree` raises
in this process alone).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import FAKE, write_checkpoint
from full_ft import SPEC, full_layers, train_dgls
from torch import nn

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.program.dp_config import check_resume
from utils.dgls.program.resume import ResumeChecks, layer_fit_problem, torch_file_problem
from utils.dgls.trainers.engine_hooks import EngineHooks
from utils.dgls.training.data_parallel import agree
from utils.dgls.training.host_optimizer import HostOptimizerSpec

CPU = torch.device("cpu")
LORA = {"output_dir": "out", "model": {"type": "flux"}, "adapter": {"type": "lora", "rank": 2}}
FULL = {"output_dir": "out", "model": {"type": "flux"}}


def resume(tmp_path: Path, config: dict, *flags: str, swapping: bool = True, stages: int = 1) -> None:
    check_resume({**config, "output_dir": str(tmp_path / "out")}, "x.toml", list(flags), FAKE, swapping, stages)


def test_checkpoints_that_can_be_resumed_pass(tmp_path):
    run = tmp_path / "out" / "20250101_00-00-00"
    write_checkpoint(run)
    resume(tmp_path, LORA, "--resume_from_checkpoint")
    resume(tmp_path, LORA, "--resume_from_checkpoint", "20250101_00-00-00")
    resume(tmp_path, {**LORA, "resume_from_checkpoint": True})
    (run / "x.toml").write_text('[model]\ntype = "flux"\n')  # train.py's copy of the config: the same model
    resume(tmp_path, LORA, "--resume_from_checkpoint")
    resume(tmp_path, LORA)  # no resume: nothing read
    later = tmp_path / "out" / "20250102_00-00-00"  # the most recent run folder is the one resumed
    write_checkpoint(later, adapter=False, host_stages=1)
    resume(tmp_path, FULL, "--resume_from_checkpoint")
    resume(tmp_path, FULL, "--resume_from_checkpoint", "--reset_optimizer", swapping=False)
    with pytest.raises(DGLSUserError, match="is a full fine-tune's checkpoint"):
        resume(tmp_path, LORA, "--resume_from_checkpoint")
    resume(tmp_path, LORA, "--resume_from_checkpoint=20250101_00-00-00")
    (later / "global_step2" / "dgls_host_optimizer_stage0.pt").unlink()  # saved by train.py without DGLS
    resume(tmp_path, FULL, "--resume_from_checkpoint", swapping=False)
    resume(tmp_path, FULL, "--resume_from_checkpoint", "--reset_optimizer")  # the host optimizer starts afresh


def test_a_whole_step_host_state_passes_the_check_before_start_up(tmp_path):
    """Prodigy and D-Adaptation save one state dict over every param of the stage ({"whole_step": ..., "layers",
    "resident"}), not one per layer: the check before start-up reads it as DGLS's host state (it refused it, so a
    whole-step full fine-tune could not resume through dgls_train.py)."""
    from utils.dgls.training.whole_step import STATE_KEY

    run = tmp_path / "out" / "20250101_00-00-00"
    write_checkpoint(run, adapter=False, host_stages=1)
    whole = {STATE_KEY: {"state": {}, "param_groups": [{"params": [0]}]}, "layers": [1, 2], "resident": 3}
    torch.save(whole, run / "global_step2" / "dgls_host_optimizer_stage0.pt")
    resume(tmp_path, FULL, "--resume_from_checkpoint")
    torch.save({STATE_KEY: {"param_groups": []}, "layers": [1]}, run / "global_step2" / "dgls_host_optimizer_stage0.pt")
    with pytest.raises(DGLSUserError, match="holds no DGLS host optimizer state"):
        resume(tmp_path, FULL, "--resume_from_checkpoint")


def test_a_whole_torch_file_is_told_from_a_damaged_one(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"a": torch.zeros(100)}, path)
    assert torch_file_problem(path) is None
    data = path.read_bytes()
    for cut in (1, 22, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        assert torch_file_problem(path) == "is cut short or is not a file torch.save wrote", cut
    path.write_bytes(b"")
    assert torch_file_problem(path) == "is empty"
    assert torch_file_problem(tmp_path / "none.pt") == "is missing"


class ExtraState:
    """What a module's get_extra_state may return: an object torch.load(weights_only=True) refuses to build."""


def test_a_layer_file_with_objects_beyond_tensors_is_left_to_deepspeed(tmp_path):
    run = tmp_path / "out" / "20250101_00-00-00"
    folder = write_checkpoint(run)
    weights = torch.load(folder / "layer_01-model_states.pt", weights_only=True)
    torch.save({**weights, "proj._extra_state": ExtraState()}, folder / "layer_01-model_states.pt")
    resume(tmp_path, LORA, "--resume_from_checkpoint")
    assert layer_fit_problem(stage([LoraLayer() for _ in range(3)]), run, "global_step2") is None


class LoraLayer(nn.Module):
    """A layer shaped like a peft LoRA's: ``proj.weight`` frozen, ``proj.lora_A/B.default.weight`` trained."""

    def __init__(self, rank: int = 2) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.proj.lora_A = nn.ModuleDict({"default": nn.Linear(4, rank, bias=False)})
        self.proj.lora_B = nn.ModuleDict({"default": nn.Linear(rank, 4, bias=False)})


class FullLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def stage(layers: list, start: int = 0, count: int | None = None) -> SimpleNamespace:
    """The parts of DeepSpeed's PipelineModule the checks read: this stage's layers and where they start."""
    return SimpleNamespace(forward_funcs=layers, _local_start=start, _num_layers=count or start + len(layers))


def test_layer_files_must_fit_the_layers_they_load_into(tmp_path):
    """diffusion-pipe loads layer files non-strictly: a name that does not match would be skipped silently."""
    run = tmp_path / "run"
    write_checkpoint(run)
    assert layer_fit_problem(stage([LoraLayer() for _ in range(3)]), run, "global_step2") is None
    assert layer_fit_problem(stage([LoraLayer()], start=2, count=3), run, "global_step2") is None  # the last stage
    assert layer_fit_problem(stage([lambda x: x, LoraLayer(), LoraLayer()]), run, "global_step2") is None
    cases = [
        ([LoraLayer(rank=3) for _ in range(3)], "holds 'proj.lora_A.default.weight' of shape [2, 4], and this model's"),
        ([FullLayer() for _ in range(3)], "layer_00-model_states.pt has no 'proj.bias'"),
        ([LoraLayer() for _ in range(2)], "it holds layer_02 and this model has 2 layers"),
        ([LoraLayer() for _ in range(4)], "it has no file for layer 3 (layer_03-model_states.pt)"),
    ]
    for layers, message in cases:
        problem = layer_fit_problem(stage(layers), run, "global_step2")
        assert problem is not None and message in problem, problem
        assert problem.endswith(
            "resume with the config it was trained with, or start a new run without --resume_from_checkpoint"
        )
    (run / "global_step2" / "layer_01-model_states.pt").write_bytes(b"\0" * 50)
    problem = layer_fit_problem(stage([LoraLayer() for _ in range(3)]), run, "global_step2")
    assert "layer_01-model_states.pt (a layer's weights) is cut short" in problem


def test_deepspeed_loads_only_a_checkpoint_that_fits(tmp_path):
    loaded = []
    load = ResumeChecks._wrap_load(lambda engine, load_dir, tag, *a, **k: loaded.append(tag))
    run = tmp_path / "run"
    write_checkpoint(run)
    load(SimpleNamespace(module=stage([LoraLayer() for _ in range(3)])), str(run), load_module_strict=False)
    assert loaded == ["global_step2"]
    with pytest.raises(DGLSUserError, match="does not fit this model"):
        load(SimpleNamespace(module=stage([LoraLayer(rank=4) for _ in range(3)])), str(run))
    (run / "latest").unlink()
    with pytest.raises(DGLSUserError, match="holds global_step2 but no 'latest' file"):
        load(SimpleNamespace(module=stage([LoraLayer() for _ in range(3)])), str(run))
    assert loaded == ["global_step2"], "DeepSpeed loaded a checkpoint that was refused"


# ---------------------------------------------------------------- DGLS's host optimizer state, at load


def host_state(tmp_path: Path, spec=SPEC, blocks_to_swap: int = 3) -> tuple[Path, dict]:
    """Two steps of host training, its optimizer state saved where EngineHooks saves it; returns the run folder
    and the state."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, blocks_to_swap=blocks_to_swap)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        train_dgls(layers, swapper, CPU, "none", steps=2, accumulate=1, adopt=spec.whole_step)
        state = swapper.training.state_dict()
    run = tmp_path / "run"
    (run / "global_step2").mkdir(parents=True)
    (run / "latest").write_text("global_step2")
    torch.save(state, run / "global_step2" / "dgls_host_optimizer_stage0.pt")
    return run, state


def load_into(run: Path, spec=SPEC, blocks_to_swap: int = 3, keep: bool = False, **kwargs):
    """EngineHooks' load_checkpoint on a stand-in engine whose module is trained by a new swapper."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, blocks_to_swap=blocks_to_swap)
    loaded = []
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        hooks = EngineHooks(lambda module: swapper.training, keep_hyper_parameters=keep)
        load = hooks._wrap_load(lambda engine, load_dir, tag, *a, **k: loaded.append(tag))
        load(SimpleNamespace(module=nn.ModuleList(layers), grid=None), str(run), **kwargs)
        return swapper.training, loaded


def test_the_host_optimizer_state_is_loaded_when_it_fits(tmp_path):
    run, state = host_state(tmp_path)
    training, loaded = load_into(run, load_optimizer_states=True)
    assert loaded == ["global_step2"]
    for idx, layer in training.layers.items():
        saved = state[idx]["state"]
        for i, p in enumerate(p for g in layer.optimizer.param_groups for p in g["params"]):
            assert torch.equal(layer.optimizer.state[p]["exp_avg"], saved[i]["exp_avg"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.write_bytes(b"garbage" * 10), "(DGLS's host optimizer state) is cut short or is not a file"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "is cut short"),
        (lambda p: p.write_bytes(b""), "is empty: the checkpoint was not saved completely"),
        (lambda p: p.unlink(), "has no DGLS host optimizer state (dgls_host_optimizer_stage0.pt)"),
        (lambda p: torch.save({"a": 1}, p), "dgls_host_optimizer_stage0.pt holds no per-layer optimizer states"),
    ],
    ids=["garbage", "truncated", "empty", "missing", "not-a-state"],
)
def test_a_damaged_or_missing_host_state_is_one_line_before_deepspeed_loads(tmp_path, change, message):
    run, _ = host_state(tmp_path)
    change(run / "global_step2" / "dgls_host_optimizer_stage0.pt")
    with pytest.raises(DGLSUserError, match="^[^\n]*$") as caught:
        load_into(run)
    assert message in str(caught.value), caught.value
    assert str(run) in str(caught.value)


def test_a_host_state_of_another_placement_or_optimizer_is_refused(tmp_path):
    run, state = host_state(tmp_path)
    with pytest.raises(DGLSUserError, match=r"holds the optimizer state of layers \[.*\] of this pipeline stage, and"):
        load_into(run, blocks_to_swap=2)
    with pytest.raises(DGLSUserError, match="holds AdamW state for layer .*, and \\[optimizer\\] type is 'sgd'"):
        load_into(run, spec=dataclasses.replace(SPEC, type="sgd", implementation="torch_fused", momentum=0.9))
    idx = next(iter(state))
    state[idx]["state"][0]["exp_avg"] = torch.zeros(3)
    torch.save(state, run / "global_step2" / "dgls_host_optimizer_stage0.pt")
    with pytest.raises(DGLSUserError, match=r"holds exp_avg of shape \[3\] for a param of layer"):
        load_into(run)


def test_reset_optimizer_reads_no_host_state_and_reset_params_keeps_the_settings(tmp_path):
    run, _ = host_state(tmp_path)
    (run / "global_step2" / "dgls_host_optimizer_stage0.pt").write_bytes(b"")
    _, loaded = load_into(run, load_optimizer_states=False)  # train.py's --reset_optimizer
    assert loaded == [None], "DeepSpeed reads latest itself"
    run, _ = host_state(tmp_path / "b")
    changed = dataclasses.replace(SPEC, betas=(0.5, 0.6), weight_decay=0.2)
    training, _ = load_into(run, spec=changed)
    assert all(g["betas"] == SPEC.betas for layer in training.layers.values() for g in layer.optimizer.param_groups)
    training, _ = load_into(run, spec=changed, keep=True)  # train.py's --reset_optimizer_params
    groups = [g for layer in training.layers.values() for g in layer.optimizer.param_groups]
    assert all(g["betas"] == (0.5, 0.6) for g in groups) and {g["weight_decay"] for g in groups} == {0.0, 0.2}


def test_a_whole_step_state_loads_through_the_engine_hooks_and_reset_params_keeps_the_built_groups(tmp_path):
    """Prodigy (one instance over every param of the stage): the hooks hand the engine's params over before they
    check the file, so the instance holds the resident params' host copies as the saved one did; its step size d and
    moments load; with train.py's --reset_optimizer_params the param groups are the built ones (d back to d0), as
    train.py puts its built groups back."""
    if importlib.util.find_spec("pytorch_optimizer") is None:
        pytest.skip("pytorch_optimizer is not installed")
    spec = HostOptimizerSpec.from_table({"type": "Prodigy", "lr": 1.0, "d0": 1e-3})
    run, state = host_state(tmp_path, spec=spec)
    assert state["resident"] > 0
    training, loaded = load_into(run, spec=spec)
    assert loaded == ["global_step2"]
    saved, here = state["whole_step"], training.whole.optimizer.state_dict()
    for got, want in zip(here["param_groups"], saved["param_groups"]):  # d and its running sums, as saved
        assert torch.equal(got.pop("d_numerator"), want.pop("d_numerator")) and got == want
    assert all(torch.equal(here["state"][i]["exp_avg"], saved["state"][i]["exp_avg"]) for i in saved["state"])
    training, _ = load_into(run, spec=spec, keep=True)
    assert all(g["d"] == 1e-3 and "d_numerator" not in g for g in training.whole.optimizer.param_groups)
    with pytest.raises(DGLSUserError, match="holds per-layer optimizer states, and \\[optimizer\\] type 'Prodigy'"):
        load_into(host_state(tmp_path / "b")[0], spec=spec)


def test_a_stage_without_host_training_refuses_a_host_state_for_it(tmp_path):
    run, _ = host_state(tmp_path)
    load = EngineHooks(lambda module: None)._wrap_load(lambda engine, load_dir, tag, *a, **k: None)
    with pytest.raises(DGLSUserError, match="this run trains no layer of this pipeline stage on the host"):
        load(SimpleNamespace(module=None, grid=None), str(run))


def _agree_in(rank: int, port: int, folder: Path) -> None:
    """One of two processes: rank 1 finds a problem, rank 0 none; each writes what agree() raised."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for problem in (None, "stage 1's file is damaged" if rank == 1 else None):
            try:
                agree(problem)
                said = "nothing"
            except DGLSUserError as exc:
                said = str(exc)
            with open(folder / f"rank{rank}.txt", "a") as f:
                f.write(said + "\n")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two processes with torch and gloo
def test_every_process_raises_the_problem_one_found(tmp_path):
    """A process that raised alone would leave the others waiting in DeepSpeed's collectives."""
    from utils.dgls.program.distributed import free_port

    torch.multiprocessing.spawn(_agree_in, args=(free_port(), tmp_path), nprocs=2)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "nothing\nstage 1's file is damaged\n"


# ---------------------------------------------------------------- real DeepSpeed checkpoints, in this process
# Slow: DeepSpeed's CPU process group start and peft's import take most of 20 s.


@pytest.fixture
def process_group(monkeypatch):
    """A one-process gloo group, as train.py has when it loads a checkpoint; ended afterwards."""
    import deepspeed

    from utils.dgls.program.distributed import destroy_process_group, free_port
    from utils.dgls.trainers.shm_op import without_shm_op

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**env, "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    with without_shm_op():  # as every DGLS run starts DeepSpeed: no C++ build, nothing in /dev/shm
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    yield
    destroy_process_group()


def engine_with_dgls(layers, swap: SwapConfig, hooks=None):
    """DeepSpeed's pipeline engine over ``layers``, DGLS placing them as train.py's would be (the stage hook),
    the trainer's optimizer over what DGLS does not train on the host; returns (engine, swapper)."""
    import deepspeed
    import torch.nn.functional as F
    from deepspeed.pipe import PipelineModule

    from utils.dgls.trainers.pipeline_hook import StageHook

    placed = {}

    def install(stage):
        placed["swapper"] = LayerSwapper(stage.layers, swap, device=CPU, log=None, share_group=stage.share_group)
        return placed["swapper"]

    with StageHook(install):
        module = PipelineModule(layers=layers, num_stages=1, loss_fn=lambda out, t: F.mse_loss(out, t))
        training = placed["swapper"].training
        params = [p for p in module.parameters() if p.requires_grad and not (training and training.owns(p))]
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(params, lr=1e-3), config=config)
    return engine, placed["swapper"]


def one_step_and_save(engine, folder: Path) -> None:
    from helpers import SMALL

    from utils.dgls.demo.data import SyntheticLatents

    data = SyntheticLatents(SMALL, samples=4, image_tokens=6, text_tokens=3).batches(2, torch.float32, CPU, (0, 1))
    engine.train_batch(data_iter=data)
    engine.save_checkpoint(str(folder), client_state={"step": 1}, exclude_frozen_parameters=True)


def lora_layers(rank: int):
    from helpers import SMALL

    from utils.dgls.demo.model import add_lora, build_layers

    layers = build_layers(SMALL, seed=0)
    add_lora(layers, rank=rank, seed=1, zero_init=False)
    return layers


@pytest.mark.slow
def test_a_real_lora_checkpoint_of_another_rank_is_refused_before_deepspeed_loads(tmp_path, process_group):
    """train.py's load_checkpoint(load_module_strict=False) under DGLS: a LoRA of rank 2 loads into rank 2 layers
    (streamed ones included), and into rank 3 layers it is one line before DeepSpeed reads a file."""
    swap = SwapConfig.of(blocks_to_swap=3)
    engine, swapper = engine_with_dgls(lora_layers(2), swap)
    with swapper:
        one_step_and_save(engine, tmp_path)
    engine, swapper = engine_with_dgls(lora_layers(2), swap)
    with swapper, ResumeChecks():
        path, client = engine.load_checkpoint(str(tmp_path), load_module_strict=False)
        assert path is not None and client["step"] == 1
    engine, swapper = engine_with_dgls(lora_layers(3), swap)
    with swapper, ResumeChecks():
        with pytest.raises(DGLSUserError, match="lora_A.default.weight' of shape \\[2, 32\\], and this model's is"):
            engine.load_checkpoint(str(tmp_path), load_module_strict=False)


@pytest.mark.slow
def test_a_real_full_fine_tune_checkpoint_resumes_only_with_its_placement(tmp_path, process_group):
    """DGLS's full fine-tune saves its host optimizer state beside DeepSpeed's files; a resume with another
    placement, or with that file damaged, is one line before DeepSpeed loads (its own optimizer load would
    otherwise fail with a traceback: the resident params differ)."""
    swap = SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1, blocks_to_swap=3)
    engine, swapper = engine_with_dgls(full_layers(), swap)
    with swapper, EngineHooks(lambda module: swapper.training):
        one_step_and_save(engine, tmp_path)
    state_file = tmp_path / "global_step1" / "dgls_host_optimizer_stage0.pt"
    assert state_file.is_file()
    engine, swapper = engine_with_dgls(full_layers(), swap)
    with swapper, EngineHooks(lambda module: swapper.training), ResumeChecks():
        path, _ = engine.load_checkpoint(str(tmp_path), load_module_strict=False)
        assert path is not None and all(layer.optimizer.state for layer in swapper.training.layers.values())
    engine, swapper = engine_with_dgls(full_layers(), swap.replace(blocks_to_swap=2))
    with swapper, EngineHooks(lambda module: swapper.training), ResumeChecks():
        with pytest.raises(DGLSUserError, match="resume with the placement it was saved with"):
            engine.load_checkpoint(str(tmp_path), load_module_strict=False)
    state_file.write_bytes(state_file.read_bytes()[:-64])
    engine, swapper = engine_with_dgls(full_layers(), swap)
    with swapper, EngineHooks(lambda module: swapper.training), ResumeChecks():
        with pytest.raises(DGLSUserError, match="dgls_host_optimizer_stage0.pt \\(DGLS's host optimizer state\\) is"):
            engine.load_checkpoint(str(tmp_path), load_module_strict=False)
