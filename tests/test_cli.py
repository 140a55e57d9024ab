"""dgls_train.py: the demo end to end through DeepSpeed, and one-line errors for user mistakes."""

import subprocess
import sys

import pytest
from conftest import ROOT
from helpers import child_env
from safetensors.torch import load_file

import dgls_train
from utils.dgls import options
from utils.dgls.errors import DGLSUserError
from utils.dgls.launch import build_parser


def run_cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "dgls_train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )


def test_demo_trains_loss_goes_down_and_saves_lora(tmp_path):
    config = (
        (ROOT / "toml" / "demo.toml").read_text().replace('output_dir = "output/demo"', f'output_dir = "{tmp_path}"')
    )
    (tmp_path / "demo.toml").write_text(config)
    proc = run_cli("--config", str(tmp_path / "demo.toml"), "--verbose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "placement" in out and "streamed" in out  # placement table
    assert "step 30: loss" in out and "swap:" in out  # per-step lines
    summary = next(line for line in out.splitlines() if line.startswith("DGLS demo finished"))
    start, end = (float(x) for x in summary.split("loss ")[1].split(" over")[0].split(" -> "))
    assert end < 0.9 * start, summary
    lora = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert lora and all("lora_" in k for k in lora)


@pytest.mark.parametrize(
    "toml_text, message",
    [
        (None, "config file not found"),
        ("[model\ntype=", "is not valid TOML"),
        ('[model]\ntype = "dgls_demo"\n[dgls]\nprefetc = 2\n', "unknown [dgls] key 'prefetc'"),
        ('[model]\ntype = "dgls_demo"\n[dgls]\nthreading = "yes"\n', "threading must be true or false"),
        ('[model]\ntype = "flux"\n', "diffusion-pipe"),
        ("[adapter]\nrank = 4\n", "no [model] type"),
        ('[model]\ntype = "dgls_demo"\n[dgls]\nprefetch = -3\n', "prefetch must be"),
    ],
)
def test_user_errors_are_one_line(tmp_path, monkeypatch, toml_text, message):
    monkeypatch.delenv("DGLS_DIFFUSION_PIPE", raising=False)  # the flux case expects no checkout to be found
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "x.toml"
    if toml_text is not None:
        path.write_text(toml_text)
    with pytest.raises(DGLSUserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dgls_train.main(["--config", str(path)])


def test_user_error_exits_2_without_traceback(tmp_path):
    proc = run_cli("--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("dgls: error: config file not found")


def test_command_line_overrides_toml():
    args, _ = build_parser().parse_known_args(["--config", "x", "--prefetch", "4", "--no-threading"])
    values = options.resolve({"prefetch": 1, "threading": True, "gpu_layers": [0, 5]}, args)
    assert values["prefetch"] == 4 and values["threading"] is False and values["gpu_layers"] == [0, 5]
    config = options.swap_config(values)
    assert config.prefetch == 4 and config.gpu_layers == [0, 5]


def test_gpu_layers_flag_parses_lists():
    args, _ = build_parser().parse_known_args(["--config", "x", "--gpu_layers", "0,1, 9"])
    assert args.gpu_layers == [0, 1, 9]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", "x", "--gpu_layers", "a,b"])


def test_readme_flag_table_is_current():
    readme = (ROOT / "README.md").read_text()
    assert options.markdown_table() in readme, "regenerate the README flag table from options.markdown_table()"


def _demo_toml(tmp_path, extra=""):
    config = (
        (ROOT / "toml" / "demo.toml").read_text().replace('output_dir = "output/demo"', f'output_dir = "{tmp_path}"')
    )
    config = config.replace("steps = 30", "steps = 4").replace("[dgls]\n", "[dgls]\n" + extra)
    lines = [line for line in config.splitlines() if not line.startswith(("initial_gpu_layers", "final_gpu_layers"))]
    path = tmp_path / "demo.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_prints_the_plan_and_exits_without_saving(tmp_path):
    proc = run_cli("--config", str(_demo_toml(tmp_path)), "--vram_budget", "0.05", "--plan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "planning for a 51.2 MiB VRAM budget" in out
    assert "DGLS plan (" in out and "predicted step" in out
    assert "nothing was saved" in out
    assert not (tmp_path / "adapter_model.safetensors").exists()


def test_compatibility_flags_say_what_they_map_to_and_lazy_steps_accumulate(tmp_path):
    proc = run_cli(
        "--config", str(_demo_toml(tmp_path)), "--async_zero_grad", "--sync_only_on_resume", "--lazy_lora_steps", "2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "--async_zero_grad has nothing to do here: trainable (LoRA) params are always resident" in out
    assert "--sync_only_on_resume has nothing to do here" in out
    assert "step 4: loss" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plan"], "--plan needs --vram_budget"),
        (["--lazy_lora_steps", "0"], "lazy_lora_steps must be"),
    ],
)
def test_flag_errors(tmp_path, args, message):
    with pytest.raises(DGLSUserError, match=message):
        dgls_train.main(["--config", str(_demo_toml(tmp_path)), *args])


@pytest.mark.parametrize("value, message", [("fast", "device_sync_mode"), ("lots", "vram_budget")])
def test_bad_choice_values_in_toml(tmp_path, value, message):
    key = "device_sync_mode" if message == "device_sync_mode" else "vram_budget"
    path = _demo_toml(tmp_path, f'{key} = "{value}"\n')
    with pytest.raises(DGLSUserError, match=message):
        dgls_train.main(["--config", str(path)])


def test_lazy_lora_steps_multiplies_gradient_accumulation(tmp_path):
    import toml
    from utils.dgls.diffusion_pipe import with_lazy_lora_steps

    config = {"gradient_accumulation_steps": 2, "dataset": "d.toml", "dgls": {"prefetch": 1}}
    path = with_lazy_lora_steps(config, "orig.toml", 3)
    written = toml.load(path)
    assert written["gradient_accumulation_steps"] == 6 and written["dataset"] == "d.toml" and "dgls" not in written
    assert with_lazy_lora_steps(config, "orig.toml", 1) == "orig.toml"
