"""The example configs in toml/: each passes dgls_train.py's checks, and every figure their
comments quote stands in the benchmark results file they cite."""

from __future__ import annotations

import importlib.util
import re
import shutil

import pytest
import torch
from cli_helpers import FAKE
from conftest import ROOT

from utils.dgls import DGLSUserError
from utils.dgls.program.validate import DemoRun, DropInRun, prepare

FLUX_CONFIGS = sorted(p.name for p in (ROOT / "toml").glob("flux_*.toml"))
FULL_CONFIGS = sorted(p.name for p in (ROOT / "toml").glob("full_*.toml"))  # full fine-tunes on one GPU
TWO_GPU_LORA = "two_gpus_flux_lora.toml"  # data parallel
TWO_GPU_FULL = "two_gpus_full_flux_dev.toml"  # a full fine-tune as two pipeline stages
FULL_8BIT = "full_flux_dev_128gb.toml"  # AdamW8bit (bitsandbytes), placed by the planner
TWO_GPU_CONFIGS = [TWO_GPU_LORA, TWO_GPU_FULL]  # launched with deepspeed --num_gpus=2
DP_CONFIGS = [*FLUX_CONFIGS, "wan_lora_long_video.toml", *FULL_CONFIGS, *TWO_GPU_CONFIGS]  # diffusion-pipe's


def cited_figures(text: str) -> list[tuple[str, str]]:
    """(results file, figure) for every 'N GiB' and 'N.NNx' in the comments, each under the last
    benchmarks/results/ file a comment named."""
    figures, source = [], None
    for line in text.splitlines():
        if "#" not in line:
            continue
        comment = line.split("#", 1)[1]
        if match := re.search(r"benchmarks/results/[\w.]+\.md", comment):
            source = match.group(0)
            comment = comment[match.end() :]
        for figure in re.findall(r"(\d+(?:\.\d+)?) GiB|(\d+\.\d+x)", comment):
            value = figure[0] or figure[1]
            if source is not None:
                figures.append((source, value))
    return figures


@pytest.mark.parametrize("name", DP_CONFIGS)
def test_diffusion_pipe_config_passes_the_checks(name, tmp_path, monkeypatch):
    """On a checkout with the dataset the config names, with its model folders (/models/... moved under the
    test's folder), on a (pretended) one-GPU machine."""
    checkout = tmp_path / "dp"
    shutil.copytree(FAKE, checkout)
    (checkout / "examples").mkdir()
    (checkout / "images").mkdir()
    (checkout / "examples" / "dataset.toml").write_text('[[directory]]\npath = "images"\n')
    text = (ROOT / "toml" / name).read_text()
    for folder in re.findall(r'"/models/([^"]+)"', text):
        (tmp_path / "models" / folder).mkdir(parents=True)
    config = tmp_path / name
    config.write_text(text.replace('"/models/', f'"{tmp_path}/models/'))
    if name == FULL_8BIT and importlib.util.find_spec("bitsandbytes") is not None:
        importlib.import_module("bitsandbytes")  # imported on what the machine has: not the pretended GPU below
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if name in TWO_GPU_CONFIGS else 1)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    if name in TWO_GPU_CONFIGS:  # rank 0 of the deepspeed launcher's two processes
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_SIZE", "2")):
            monkeypatch.setenv(key, value)
    argv = ["--config", str(config), "--diffusion_pipe", str(checkout)]
    if name == FULL_8BIT and importlib.util.find_spec("bitsandbytes") is None:  # optional (.ci/run's last step)
        refused = r"^\S+: \[optimizer\] type = 'AdamW8bit' needs the bitsandbytes package: pip install bitsandbytes$"
        with pytest.raises(DGLSUserError, match=refused):
            prepare(argv, ROOT)
        return
    run = prepare(argv, ROOT)
    assert isinstance(run, DropInRun)
    if name == TWO_GPU_LORA:  # data parallel: every process its own budget, no pipeline stages
        assert run.dist.world_size == 2 and run.swap.placement.vram_budget == 8 and run.config["pipeline_stages"] == 1
    elif name == TWO_GPU_FULL:  # one process per stage, each stage planned under its own GPU's budget
        assert run.dist.world_size == 2 and run.config["pipeline_stages"] == 2
        assert run.swap.placement.planned and run.swap.placement.vram_budget == 21
        assert run.swap.training.host_optimizer is not None and not run.swap.training.data_parallel
    elif name in FLUX_CONFIGS:
        assert run.swap.placement.vram_budget is not None
    elif name == FULL_8BIT:  # every weight trains; the planner places the layers under a 24 GB card's budget
        assert run.swap.placement.planned and run.swap.placement.vram_budget == 21
        assert run.swap.training.host_optimizer.type == "adamw8bit"  # diffusion-pipe matches types in lower case
    elif name in FULL_CONFIGS:  # every weight trains; the planner places the layers, fixed from step 1
        assert run.swap.placement.planned and run.swap.training.host_optimizer is not None
    else:  # the long-video recipe, set by hand as measured
        acts = run.swap.activations
        assert acts.checkpoint_units and acts.keep_piece_outputs and acts.offload_recompute
        assert run.swap.placement.prefetch == 1


def test_demo_config_passes_the_checks():
    assert isinstance(prepare(["--config", str(ROOT / "toml" / "demo.toml")], ROOT), DemoRun)


def test_the_full_fine_tune_configs_are_the_sdxl_24gb_and_flux_dev_recipes():
    assert FULL_CONFIGS == ["full_flux_dev.toml", "full_flux_dev_128gb.toml", "full_sdxl_24gb.toml"]


def test_every_two_gpu_config_is_checked_as_one():
    assert sorted(p.name for p in (ROOT / "toml").glob("two_gpus_*.toml")) == sorted(TWO_GPU_CONFIGS)


@pytest.mark.parametrize("name", [TWO_GPU_FULL])
def test_a_config_without_its_figures_names_the_benchmark_that_measures_them(name):
    """Until measured, a full fine-tune config says which benchmark command gives its figures; once quoted, they
    are checked as the others' are (move the config's name to the figures' test)."""
    text = (ROOT / "toml" / name).read_text()
    benchmark = {TWO_GPU_FULL: "python benchmarks/bench_scaling.py --model flux_full"}.get(name, "bench_full.py")
    assert "TODO(measure)" in text and benchmark in text
    if name == TWO_GPU_FULL:  # one stage and two side by side (bench_scaling.py's flux_full pipeline rows)
        assert "--layout pipeline" in text and "deepspeed --num_gpus=2 dgls_train.py" in text
    assert "--vram_budget" in text or "vram_budget = " in text


@pytest.mark.parametrize("name", [*FLUX_CONFIGS, "wan_lora_long_video.toml", TWO_GPU_LORA, *FULL_CONFIGS])
def test_every_quoted_figure_is_in_the_results_it_cites(name):
    figures = cited_figures((ROOT / "toml" / name).read_text())
    assert len(figures) >= 6, figures
    for source, figure in figures:
        assert figure in (ROOT / source).read_text(), f"{name} quotes {figure} from {source}, which does not have it"
