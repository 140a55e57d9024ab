"""What diffusion-pipe's loaders leave in process memory, measured in its real train.py through dgls_train.py.

For each tiny model type (tests/fixtures/tiny_models, float32 files trained in float32 on CPU), DGLS's start-up line
(utils/dgls/memory/file_backed.py) says how many bytes of the layers' weights are views of the checkpoint files and
how many are copies; a cast (Flux with transformer_dtype float8) is reported as copies of that dtype.

Opt-in and slow (marked ``slow``): set DGLS_DIFFUSION_PIPE to a diffusion-pipe checkout.
"""

from __future__ import annotations

import re

import pytest
from dp_runs import requires_checkout, run_train
from test_diffusion_pipe_models_real import SPECS, checkout, prepare  # noqa: F401 (fixtures)
from tiny_models import sdxl  # noqa: E402 (on sys.path from test_diffusion_pipe_models_real)

pytestmark = [pytest.mark.slow, requires_checkout]

LOAD_LINE = re.compile(
    r"model load: ([\d.]+) (MiB|GiB) of the layers' weights are read in place from (\d+) file\(s\) \(no copy in RAM\), "
    r"([\d.]+) (MiB|GiB) are copies in process memory(.*)"
)


def load_line(log: str) -> tuple[float, float, str]:
    """(MiB read in place, MiB copied, what follows: the copies' dtypes) from a run's log."""
    found = LOAD_LINE.findall(log)
    assert len(found) == 1, f"expected one model load line, found {found}"
    mapped, mapped_unit, _, copied, copied_unit, rest = found[0]
    scale = {"MiB": 1.0, "GiB": 1024.0}
    return float(mapped) * scale[mapped_unit], float(copied) * scale[copied_unit], rest


@pytest.mark.parametrize("model_type", list(SPECS))
def test_the_load_line_says_what_was_copied(prepare, tmp_path, model_type):  # noqa: F811 (the fixture)
    p = prepare(model_type)
    log = p.run(
        p.configs(tmp_path, "dgls", True), tmp_path / "dgls.log", dgls=f"--blocks_to_swap {p.spec.swap} --prefetch 1"
    )
    assert "TRAINING COMPLETE!" in log
    mapped, copied, rest = load_line(log)
    print(f"{model_type}: {mapped:.2f} MiB in place, {copied:.2f} MiB copied{rest}")
    # every type's loader keeps the layer weights views of the file when the file's dtype is the run's, but for what
    # SDXL's single-file loader splits and transposes in its second text encoder (tiny_models/sdxl.py)
    made = sdxl.loader_copied_bytes() / 2**20 if model_type == "sdxl" else 0.0
    assert mapped > 0 and copied == round(made, 2), f"{model_type}: {mapped} MiB in place, {copied} MiB copied{rest}"


def test_a_cast_is_said_at_start_up(checkout, tmp_path):  # noqa: F811 (the fixture)
    """Flux with transformer_dtype = 'float8' (float32 files, bf16 run): diffusion-pipe casts every 2-D block
    weight outside its high-precision list, so those are copies in process memory, said as float8 bytes; the
    rest (1-D weights, whose bf16 cast is a copy too) is no longer read in place either."""
    from test_diffusion_pipe_models_real import build_tiny_flux, files, run_train

    model_dir = build_tiny_flux(tmp_path / "model", num_double=3, num_single=3, heads=8)
    model = {"type": "flux", "diffusers_path": str(model_dir), "transformer_dtype": "float8"}
    data = files.write_dataset(tmp_path / "data", n=4, size=64)
    config = files.write_configs(
        tmp_path / "cfg", model, data, tmp_path / "out", max_steps=1, dtype="bfloat16", activation_checkpointing=True
    )
    runner = ("--preload=cpu_autocast",)
    run_train(checkout, config, tmp_path / "cache.log", "--cache_only", runner_args=runner)
    log = run_train(checkout, config, tmp_path / "dgls.log", dgls="--blocks_to_swap 6 --prefetch 1", runner_args=runner)
    assert "TRAINING COMPLETE!" in log
    mapped, copied, rest = load_line(log)
    print(f"flux float8: {mapped:.2f} MiB in place, {copied:.2f} MiB copied{rest}")
    assert mapped == 0 and copied > 0 and "float8_e4m3fn" in rest and "bfloat16" in rest, rest


@pytest.mark.parametrize("model_type", ["hunyuan-video", "wan", "qwen_image", "lumina_2"])
def test_casts_go_to_a_scratch_file_under_a_host_ram_budget(prepare, tmp_path, model_type):  # noqa: F811
    """Loaders that cast through accelerate's set_module_tensor_to_device (float32 files, a bf16 run): with a host
    RAM budget the casts are in DGLS's scratch file, not in process memory (trainers/file_backed_casts.py); the run
    trains as without the budget."""
    from test_diffusion_pipe_models_real import files

    p = prepare(model_type)
    runner_args = (*p.spec.runner_args(), "--preload=cpu_autocast")

    def run(name: str, dgls: str) -> str:
        config = files.write_configs(
            tmp_path / f"cfg_{name}", p.model, p.data, tmp_path / f"out_{name}", max_steps=2, dtype="bfloat16"
        )
        return run_train(p.checkout, config, tmp_path / f"{name}.log", dgls=dgls, runner_args=runner_args, env=p.env)

    swap = f"--blocks_to_swap {p.spec.swap} --prefetch 1 --verbose"
    budget = run("budget", f"{swap} --host_ram_budget 1 --disk_dir {tmp_path / 'disk'}")
    plain = run("plain", swap)
    mapped, copied, rest = load_line(budget)
    print(f"{model_type} bf16 under a budget: {mapped:.2f} MiB in place, {copied:.2f} MiB copied{rest}")
    assert "cast into a scratch file" in rest and copied == 0, rest
    assert "cast into a scratch file" not in load_line(plain)[2] and load_line(plain)[1] > 0
    losses = [re.findall(r"steps: \d+ loss: (\S+)", log) for log in (budget, plain)]
    assert losses[0] and losses[0] == losses[1], losses


def test_flux_float8_casts_go_to_a_scratch_file_under_a_host_ram_budget(checkout, tmp_path):  # noqa: F811
    """Flux with transformer_dtype = 'float8' (float32 files, a bf16 run) casts twice, neither through accelerate:
    diffusers' torch_dtype cast of every weight, then diffusion-pipe's ``p.data = p.data.to(float8)``. Under a host RAM
    budget both are in DGLS's scratch file (trainers/file_backed_casts.py): no byte of the layers is a copy in process
    memory, and the run trains as without the budget."""
    from test_diffusion_pipe_models_real import build_tiny_flux, files, run_train

    model_dir = build_tiny_flux(tmp_path / "model", num_double=3, num_single=3, heads=8)
    model = {"type": "flux", "diffusers_path": str(model_dir), "transformer_dtype": "float8"}
    data = files.write_dataset(tmp_path / "data", n=4, size=64)
    runner = ("--preload=cpu_autocast",)

    def config(name: str):
        return files.write_configs(
            tmp_path / f"cfg_{name}", model, data, tmp_path / f"out_{name}", max_steps=2, dtype="bfloat16",
            activation_checkpointing=True,
        )  # fmt: skip

    def run(name: str, dgls: str) -> str:
        return run_train(checkout, config(name), tmp_path / f"{name}.log", dgls=dgls, runner_args=runner)

    # the cache first: a run that caches draws from the RNG (the VAE's sample), so both runs start alike
    run_train(checkout, config("cache"), tmp_path / "cache.log", "--cache_only", runner_args=runner)
    swap = "--blocks_to_swap 6 --prefetch 1 --verbose"
    budget = run("budget", f"{swap} --host_ram_budget 1 --disk_dir {tmp_path / 'disk'}")
    plain = run("plain", swap)
    assert "TRAINING COMPLETE!" in budget and "TRAINING COMPLETE!" in plain
    mapped, copied, rest = load_line(budget)
    print(f"flux float8 under a budget: {mapped:.2f} MiB in place, {copied:.2f} MiB copied{rest}")
    assert copied == 0 and "cast into a scratch file" in rest and "float8" not in rest, rest
    assert load_line(plain)[1] > 0, "without the budget the casts are copies"
    assert list((tmp_path / "disk").iterdir()) == [], "no scratch file is left"
    losses = [re.findall(r"steps: \d+ loss: (\S+)", log) for log in (budget, plain)]
    assert losses[0] and losses[0] == losses[1], losses
