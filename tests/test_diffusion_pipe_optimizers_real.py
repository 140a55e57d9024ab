"""Every diffusion-pipe ``[optimizer]`` type through the real train.py and dgls_train.py (issue 35), on CPU.

For each type that trains streamed layers, plain train.py and train.py through dgls_train.py (full fine-tune, 5 of
the tiny Flux's 6 blocks streamed) run the same 4 seeded steps from one dataset cache; the saved models must agree
to the precision the type allows (:data:`CASES` says, per type, what that is and why). One type of each of DGLS's
ways to run a type (its own kernel, a class per layer, one instance stepped after the backward) stops after 2 steps
and resumes to 4 in both runs: the resumed losses and the final model agree as in the uninterrupted runs. Each
refused type is one ``dgls: error:`` line from dgls_train.py, before train.py starts.

Opt-in and slow, as test_diffusion_pipe_real.py (DGLS_DIFFUSION_PIPE names a checkout). A type whose library is not
installed skips, naming the pip package. The runs of every selected type are made once, by the module's ``runs``
fixture, in two lanes side by side.

Invariants
    - Both runs of a type share the model, the dataset cache, the seed and the thread count, so any difference
      comes from how the optimizer steps: where the arithmetic is the same the saved models are bitwise equal.
    - A tolerance is the largest ``|dgls - plain|`` over every saved weight, as a fraction of the largest change
      plain train.py made to any weight between its step-1 save and the end.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from dp_runs import FIXTURES, ROOT, checkout_or_skip, only_run_dir, requires_checkout, run_train, saved_model
from helpers import child_env

from utils.dgls.training import optimizer_types

pytestmark = [pytest.mark.slow, requires_checkout]

STEPS = 4  # one epoch of the 4-image dataset: train.py saves the end as epoch1
FIRST = 2  # the resumed runs stop here, and go on to STEPS
DGLS_FLAGS = "--blocks_to_swap 5 --prefetch 1"
LANES = 2  # runs side by side (a run is mostly imports, single-threaded: each gets one thread)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ADAM = {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.01, "eps": 1e-8}
BITWISE = "the same arithmetic on the same fp32 numbers, in the same order"


@dataclass(frozen=True)
class Case:
    """One ``[optimizer]`` table, how close the two saved models must be (see the module doc) and why."""

    table: dict
    tolerance: float
    why: str
    flags: str = ""  # DGLS flags beyond DGLS_FLAGS
    resume: bool = False  # stop after FIRST steps and resume (one type of each way DGLS runs types)
    needs: tuple[str, ...] = field(default=())  # modules beyond the type's own packages (train.py's imports)
    cuda: bool = False  # train.py's class runs only on a GPU
    fails_on_cpu: str = ""  # train.py's class fails a step on the CPU with this error (then DGLS must say so)

    @property
    def runs(self) -> str:
        return optimizer_types.lookup(self.table["type"])[1].runs


# adamw and adamw_optimi: test_diffusion_pipe_real.py's full fine-tune tests.
CASES: dict[str, Case] = {
    "sgd": Case(
        {"type": "sgd", "lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01},
        0.0,
        f"DGLS's SGD on the host is torch.optim.SGD's single-tensor step: {BITWISE}",
        resume=True,
    ),
    "offload": Case(
        {"type": "offload", **ADAM},
        0.0,
        "train.py steps torch.optim.AdamW(fused=True) on the CPU, DGLS its fused CPU kernel (--host_adam torch_fused)",
        flags="--host_adam torch_fused",
        needs=("torchao.prototype.low_bit_optim",),  # train.py imports it from there; newer torchao moved it
        cuda=True,  # CPUOffloadOptimizer asserts a CUDA or XPU device
    ),
    "adamw8bit": Case({"type": "AdamW8bit", **ADAM}, 0.0, f"bitsandbytes' own class per layer: {BITWISE}"),
    "adamw8bitkahan": Case(
        {"type": "adamw8bitkahan", **ADAM},
        0.0,
        f"diffusion-pipe's class per layer: {BITWISE}",
        # its update_step reads percentile_clipping, which bitsandbytes 0.50 (the first with CPU kernels) dropped
        fails_on_cpu="KeyError: 'percentile_clipping'",
    ),
    "stableadamw": Case({"type": "stableadamw", **ADAM}, 0.0, f"optimi's class per layer: {BITWISE}"),
    "automagic": Case({"type": "automagic", "lr": 1e-4}, 0.0, f"diffusion-pipe's class per layer: {BITWISE}"),
    **{
        name: Case({"type": name, **ADAM}, 0.0, f"pytorch_optimizer's class per layer: {BITWISE}", resume=resume)
        for name, resume in (("Lion", False), ("ADOPT", False))
    },
    "CAME": Case(
        {"type": "CAME", **ADAM, "betas": [0.9, 0.999, 0.9999]}, 0.0, f"pytorch_optimizer's class per layer: {BITWISE}"
    ),
    "AdEMAMix": Case(
        {"type": "AdEMAMix", **ADAM, "betas": [0.9, 0.99, 0.999]},
        0.0,
        f"pytorch_optimizer's class per layer: {BITWISE}",
        resume=True,
    ),
    **{
        name: Case(
            {"type": name, "lr": 1e-3, "weight_decay": 0.01, **extra}, 0.0, f"pytorch_optimizer's class: {BITWISE}"
        )
        # RAdam's rectified steps start at step 5; silent_sgd_phase = false lets steps 1 to 4 move the weights
        for name, extra in (
            ("ScheduleFreeAdamW", {}),
            ("ScheduleFreeRAdam", {"silent_sgd_phase": False}),
            ("ScheduleFreeSGD", {}),
        )
    },
    **{
        name: Case(
            {"type": name, "lr": 1.0, "weight_decay": 0.01},
            0.0,
            f"one instance over every param, as train.py's: {BITWISE}",
            resume=name == "Prodigy",
        )
        for name in ("Prodigy", "DAdaptAdam", "DAdaptAdan", "DAdaptAdaGrad", "DAdaptLion", "DAdaptSGD")
    },
}
REFUSED = [name for name, entry in optimizer_types.TYPES.items() if entry.runs == "refused"]


def _load_fixture(name):
    spec = importlib.util.spec_from_file_location(f"dgls_fixture_{name}", FIXTURES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _missing(case: Case) -> str | None:
    """Why this machine cannot run the case (a library train.py or DGLS imports), or None."""
    name, entry = optimizer_types.lookup(case.table["type"])
    if case.cuda and not torch.cuda.is_available():
        return f"train.py's type {name!r} runs only on a GPU"
    if (problem := optimizer_types.missing_package(name, entry)) is not None:
        return problem
    for module in case.needs:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"train.py imports {module} for type {name!r}, which the installed version lacks"
    return None


def _selected(request) -> list[str]:
    """The CASES whose tests this session runs (so that ``-k`` runs only what it selects)."""
    here = request.node.path if hasattr(request.node, "path") else None
    names = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if spec is not None and item.path == here and spec.params.get("name") in CASES:
            names.append(spec.params["name"])
    return sorted(set(names), key=list(CASES).index)


@dataclass
class Runs:
    """The logs and output folders of one type's two runs (plain, dgls); each log holds every segment's text, or
    the failure of the run that failed (``failed``: the side's failure)."""

    logs: dict[str, str]
    outputs: dict[str, Path]
    failed: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Runs | str]:
    """Every selected case's plain and DGLS runs; a case that cannot run here maps to why.

    The cases are dealt to :data:`LANES` lanes run side by side, each with its own copy of the dataset and its cache
    (train.py's data loading writes beside the cache: two runs reading one cache at once broke it); a case's two
    runs go one after the other in its lane, on the same cache."""
    checkout = checkout_or_skip()
    tmp = tmp_path_factory.mktemp("dp_optimizers")
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp / "model", seed=0, num_double=3, num_single=3)
    common = dict(
        activation_checkpointing=True,
        eval_every_n_steps=None,
        eval_before_first_step=False,
        dtype="float32",
        full=True,
        save_every_n_steps=1,
    )

    def config(name, side, steps, data):
        folder = tmp / f"cfg_{name}_{side}_{steps}"
        out = tmp / f"out_{name}_{side}"
        return tiny.write_configs(folder, model, data, out, max_steps=steps, optimizer=CASES[name].table, **common)

    results: dict[str, Runs | str] = {}
    todo = []
    for name in _selected(request):
        if (why := _missing(CASES[name])) is not None:
            results[name] = why
        else:
            todo.append(name)

    def run_case(name: str, side: str, data: Path) -> str:
        case = CASES[name]
        dgls = f"{DGLS_FLAGS} {case.flags}".strip() if side == "dgls" else None
        log = tmp / f"{name}_{side}.log"
        if not case.resume:
            return run_train(checkout, config(name, side, STEPS, data), log, dgls=dgls, env=ONE_THREAD)
        text = run_train(checkout, config(name, side, FIRST, data), log, dgls=dgls, env=ONE_THREAD)
        resumed = tmp / f"{name}_{side}_resumed.log"
        again = config(name, side, STEPS, data)
        return text + run_train(checkout, again, resumed, "--resume_from_checkpoint", seed=1, dgls=dgls, env=ONE_THREAD)

    def lane(index: int, names: list[str]) -> dict[str, Runs]:
        data = tiny.write_dataset(tmp / f"data{index}", n=4, size=64, seed=0)
        run_train(checkout, config(names[0], "plain", STEPS, data), tmp / f"cache{index}.log", "--cache_only")
        done = {}
        for name in names:
            outputs = {side: tmp / f"out_{name}_{side}" for side in ("plain", "dgls")}
            done[name] = Runs({}, outputs)
            for side in ("plain", "dgls"):
                try:
                    done[name].logs[side] = run_case(name, side, data)
                except (Exception, pytest.fail.Exception) as exc:  # the case's test reports it; the lane goes on
                    done[name].failed[side] = str(exc)
        return done

    lanes = [todo[i::LANES] for i in range(LANES) if todo[i::LANES]]
    with ThreadPoolExecutor(len(lanes) or 1) as pool:
        for future in [pool.submit(lane, i, names) for i, names in enumerate(lanes)]:
            results.update(future.result())
    return results


def _losses(log: str) -> dict[int, float]:
    """train.py's printed loss of each step (the resumed run's steps after the first run's)."""
    return {int(step): float(loss) for step, loss in re.findall(r"^steps: (\d+) loss: ([0-9.]+)", log, re.M)}


def _worst(expected: dict, got: dict) -> float:
    assert expected.keys() == got.keys() and len(expected) > 50
    return max((expected[k].float() - got[k].float()).abs().max().item() for k in expected)


@pytest.mark.parametrize("name", list(CASES))
def test_each_optimizer_type_trains_as_in_plain_train_py(runs, name):
    """The saved model of train.py through dgls_train.py agrees with plain train.py's within the case's tolerance
    (the step-1 save and the end, and for resumed cases the save before stopping too), and the streamed blocks
    changed; the printed losses agree (after resuming too)."""
    result = runs[name]
    if isinstance(result, str):
        pytest.skip(result)
    case = CASES[name]
    if case.fails_on_cpu and "plain" in result.failed:
        # train.py's class fails with this library on the CPU: DGLS says so in one line before train.py starts
        assert case.fails_on_cpu in result.failed["plain"], result.failed["plain"][-2000:]
        error = result.failed.get("dgls", "")
        assert f"dgls: error: [optimizer] type = {name!r}" in error and "fails a step on the CPU" in error
        assert "use " in error and "steps:" not in error, error[-2000:]
        return
    assert not result.failed, "\n".join(f"{side}: {text[-3000:]}" for side, text in result.failed.items())
    assert "TRAINING COMPLETE!" in result.logs["dgls"] and "DGLS host training:" in result.logs["dgls"]
    if case.resume:
        assert result.logs["dgls"].count("Resuming training from checkpoint") == 1
        assert list(only_run_dir(result.outputs["dgls"]).glob(f"global_step{FIRST}/dgls_host_optimizer_stage0.pt"))
    plain = {save: saved_model(result.outputs["plain"], save) for save in ("step1", f"step{FIRST}", "epoch1")}
    dgls = {save: saved_model(result.outputs["dgls"], save) for save in plain}
    change = _worst(plain["step1"], plain["epoch1"])
    worsts = {save: _worst(plain[save], dgls[save]) for save in plain}
    print(f"{name} ({case.runs}): worst |dgls - plain| {worsts} over a largest change of {change:.3g}")
    for save, worst in worsts.items():
        assert worst <= case.tolerance * change, f"{save}: {worst:.3g} > {case.tolerance} x {change:.3g}: {case.why}"
    assert any(
        not (dgls["step1"][k] == dgls["epoch1"][k]).all() for k in dgls["step1"] if k.startswith("single_blocks.")
    ), "the streamed blocks' saved weights did not change"
    losses = {side: _losses(log) for side, log in result.logs.items()}
    assert sorted(losses["plain"]) == list(range(1, STEPS + 1)), losses["plain"]
    assert losses["dgls"].keys() == losses["plain"].keys()
    for step, loss in losses["plain"].items():
        assert abs(losses["dgls"][step] - loss) <= 1e-4 + case.tolerance, (step, losses)


def test_the_resumed_cases_cover_each_way_dgls_runs_a_type():
    runs_by = {case.runs for case in CASES.values() if case.resume}
    assert runs_by == {"sgd", "per_layer", "whole_step"}, runs_by


def test_every_type_that_trains_has_a_case():
    named = {optimizer_types.lookup(case.table["type"])[0] for case in CASES.values()}
    assert set(optimizer_types.RUNNING) - named == {"adamw", "adamw_optimi"}  # test_diffusion_pipe_real.py's


@pytest.mark.parametrize("given", REFUSED)
def test_a_refused_type_is_one_line_before_train_py_starts(given, tmp_path):
    """dgls_train.py as users run it: exit 2 with one ``dgls: error:`` line naming the type, and no training."""
    checkout = checkout_or_skip()
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=1, num_single=1)
    data = tiny.write_dataset(tmp_path / "data", n=1, size=64, seed=0)
    config = tiny.write_configs(tmp_path, model, data, tmp_path / "out", full=True, optimizer={"type": given, "lr": 1})
    command = [sys.executable, str(ROOT / "dgls_train.py"), "--config", str(config), "--diffusion_pipe", str(checkout)]
    proc = subprocess.run(
        [*command, "--blocks_to_swap", "1"], capture_output=True, text=True, env=child_env(), timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("dgls: error: "), proc.stderr
    assert f"[optimizer] type = {given!r} cannot train streamed layers: use '" in lines[0]
    assert "steps:" not in proc.stdout
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_gradient_release_for_flux_fails_in_plain_train_py_and_is_one_line_through_dgls(tmp_path):
    """train.py's gradient release reads each param group's lr, which Flux's groups (models/base.py's) lack: plain
    train.py fails with KeyError: 'lr' once the model has loaded; dgls_train.py says so in one line first."""
    checkout = checkout_or_skip()
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=1, num_single=1)
    data = tiny.write_dataset(tmp_path / "data", n=1, size=64, seed=0)
    table = {"type": "adamw", "lr": 1e-3, "gradient_release": True}
    config = tiny.write_configs(tmp_path, model, data, tmp_path / "out", full=True, optimizer=table, max_steps=1)
    with pytest.raises(Exception, match="KeyError: 'lr'"):
        run_train(checkout, config, tmp_path / "plain.log", env=ONE_THREAD)
    command = [sys.executable, str(ROOT / "dgls_train.py"), "--config", str(config), "--diffusion_pipe", str(checkout)]
    proc = subprocess.run(
        [*command, "--blocks_to_swap", "1"], capture_output=True, text=True, env=child_env(), timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert (
        lines[0].startswith("dgls: error: ") and "gradient_release = true fails in this checkout's train.py" in lines[0]
    )
    assert "steps:" not in proc.stdout
