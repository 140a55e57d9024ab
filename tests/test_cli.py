"""dgls_train.py: the demo end to end through DeepSpeed, how flags and the TOML combine, --plan,
--help, the README's flag table, and what the output looks like in a log file.

Bad inputs are in test_bad_inputs.py, the launch lines and Ctrl-C in test_launch_lines.py.
"""

import os
import re

import pytest
import torch
from cli_helpers import demo_toml, python_cmd, run_in_process, run_user_command
from conftest import ROOT
from safetensors.torch import load_file

import dgls_train
from utils.dgls.demo.settings import demo_settings
from utils.dgls.errors import DGLSUserError
from utils.dgls.program import options
from utils.dgls.program.distributed import DEFAULT_PORT, dist_env
from utils.dgls.program.launch import build_parser
from utils.dgls.program.validate import prepare


def run_dirs(folder):
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


@pytest.mark.slow  # a DeepSpeed process of its own: the slowest default test
def test_demo_trains_saves_lora_and_writes_a_clean_log(tmp_path):
    """The README's demo command (6 steps, the output elsewhere), stdout and stderr to a file. The
    exact command, 30 steps with the loss going down, is in test_launch_lines.py (slow)."""
    proc = run_user_command(python_cmd("--config", str(demo_toml(tmp_path, steps=6)), "--verbose"), ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "placement" in out and "streamed" in out  # placement table
    assert "step 6: loss" in out and "swap:" in out  # per-step lines
    summary = next(line for line in out.splitlines() if line.startswith("DGLS demo finished"))
    (run_dir,) = run_dirs(tmp_path / "out")
    assert summary.endswith(f"LoRA saved to {run_dir / 'adapter_model.safetensors'}")
    lora = load_file(str(run_dir / "adapter_model.safetensors"))
    assert lora and all("lora_" in k for k in lora)
    # not a terminal: no progress-bar fragments; DeepSpeed's start-up chatter is not shown
    assert "\r" not in out and "step/s" not in out and "it/s" not in out
    for chatter in ("SEED_LAYERS", "Using topology", "stage=0 layers", "[WARNING]", "[INFO]", "built successfully"):
        assert chatter not in out, chatter
    assert proc.stderr == ""


def test_command_line_overrides_toml():
    args, _ = build_parser().parse_known_args(["--config", "x", "--prefetch", "4", "--no-threading"])
    resolved = options.resolve({"prefetch": 1, "threading": True, "gpu_layers": [0, 5]}, args, "x.toml")
    values = resolved.values
    assert values["prefetch"] == 4 and values["threading"] is False and values["gpu_layers"] == [0, 5]
    assert resolved.sources["prefetch"] == "command line" and resolved.sources["gpu_layers"] == "x.toml"
    config = options.swap_config(values)
    assert config.placement.prefetch == 4 and config.placement.gpu_layers == [0, 5]


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("threading", 1, "true or false"),
        ("prefetch", 1.0, "a whole number"),
        ("prefetch", True, "a whole number"),
        ("selective_packing", "4", "a number"),
        ("profile", "", "a path in quotes"),
        ("device_sync_mode", "always", "one of none, step, layer"),
        ("vram_budget", "lots", "a number of GiB or 'auto'"),
        ("gpu_layers", "0,x", "layer indices like [0, 1, 40] or '0,1,40'"),
        ("gpu_layers", [0, True], "a list of layer indices like [0, 1, 40]"),
    ],
)
def test_a_dgls_key_of_the_wrong_kind_says_what_it_needs(key, value, expected):
    args, _ = build_parser().parse_known_args(["--config", "x"])
    with pytest.raises(DGLSUserError) as err:
        options.resolve({key: value}, args, "x.toml")
    assert str(err.value) == f"[dgls] {key} in x.toml must be {expected}, got {value!r}"


@pytest.mark.parametrize(
    "key, value, kept",
    [
        ("vram_budget", 4, 4.0),
        ("vram_budget", "auto", "auto"),
        ("selective_packing", 2, 2.0),
        ("gpu_layers", "0, 3", [0, 3]),
    ],
)
def test_a_dgls_key_is_kept_in_its_options_type(key, value, kept):
    args, _ = build_parser().parse_known_args(["--config", "x"])
    resolved = options.resolve({key: value}, args, "x.toml")
    assert resolved.values[key] == kept and type(resolved.values[key]) is type(kept)


def test_every_option_kind_has_a_toml_type_and_a_flag():
    parser = build_parser()
    for o in options.OPTIONS:
        assert o.kind in options._TOML_TYPES, o.name
        assert any(o.flag in action.option_strings for action in parser._actions), o.name


def test_an_empty_profile_path_is_refused_as_a_flag():
    with pytest.raises(DGLSUserError, match="argument --profile: expected a file path such as trace.json, got ''"):
        build_parser().parse_known_args(["--config", "x", "--profile", ""])


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--blocks_to_swap", "3"], "blocks_to_swap", 3),
        (["--gpu_layers", "0,1"], "gpu_layers", [0, 1]),
        (["--vram_budget", "1"], "vram_budget", 1.0),
    ],
)
def test_placement_on_the_command_line_replaces_the_tomls(tmp_path, user_env, flags, field, value):
    """toml/demo.toml keeps the ends resident (initial/final_gpu_layers); a placement style given on
    the command line replaces that before anything is built, and start-up says so."""
    run = prepare(["--config", str(ROOT / "toml" / "demo.toml"), *flags], ROOT)
    assert getattr(run.swap.placement, field) == value
    assert run.swap.placement.initial_gpu_layers is None and run.swap.placement.final_gpu_layers is None
    (note,) = run.notes
    replaced = "initial_gpu_layers = 1, final_gpu_layers = 1" + (", prefetch = 2" if field == "vram_budget" else "")
    assert (
        note
        == f"DGLS: {flags[0]} {flags[1]} on the command line replaces {replaced} from {ROOT / 'toml' / 'demo.toml'}"
    )


def test_same_style_on_the_command_line_keeps_the_tomls_other_end(tmp_path, user_env):
    run = prepare(["--config", str(ROOT / "toml" / "demo.toml"), "--initial_gpu_layers", "3"], ROOT)
    assert (run.swap.placement.initial_gpu_layers, run.swap.placement.final_gpu_layers) == (3, 1) and run.notes == ()


def test_gpu_layers_flag_parses_lists():
    args, _ = build_parser().parse_known_args(["--config", "x", "--gpu_layers", "0,1, 9"])
    assert args.gpu_layers == [0, 1, 9]


def test_help_shows_defaults_choices_groups_and_where_other_flags_go(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "how many streamed layers ahead to copy; the pool holds prefetch+1 layers (default: 2)" in text
    assert "--device_sync_mode {none,step,layer}" in text and "--autocast {fp32,fp16,bf16} " in text
    assert "--threading, --no-threading issue copies" in text and "(default: off)" in text
    for group in ("DGLS placement:", "DGLS streaming:", "DGLS precision:", "DGLS output:"):
        assert group in text
    assert "Arguments dgls_train.py does not know are passed to diffusion-pipe's train.py" in text
    assert "sync_only_on_resume" not in text and "async_zero_grad" not in text


def test_readme_flag_table_is_current():
    readme = (ROOT / "README.md").read_text()
    assert options.markdown_table() in readme, "regenerate the README flag table from options.markdown_table()"


def test_plan_with_explicit_placement_in_the_toml_plans_and_never_trains(tmp_path, user_env, capsys):
    """toml/demo.toml places the ends explicitly; --vram_budget on the command line replaces that,
    and --plan prints the plan after the probe and stops: no training past it, nothing saved."""
    config = demo_toml(tmp_path, steps=30)
    code, out, err = run_in_process(["--config", str(config), "--vram_budget", "1", "--plan"], capsys)
    assert code == 0, err
    assert "replaces initial_gpu_layers = 1, final_gpu_layers = 1" in out
    assert "planning for a 1.00 GiB VRAM budget" in out and "DGLS plan (" in out and "predicted step" in out
    assert "nothing was saved" in out and "step 3:" not in out and "the planner is off" not in out
    assert not (tmp_path / "out").exists()


def test_a_second_run_keeps_the_first_and_tilde_means_home(tmp_path, user_env, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = demo_toml(tmp_path, steps=1, output_dir="~/loras/demo")
    first = second = None
    for _ in range(2):
        code, out, err = run_in_process(["--config", str(config), "--lazy_lora_steps", "2"], capsys)
        assert code == 0, err
        second, first = out.split("LoRA saved to ")[1].strip(), second
    assert first != second and os.path.isfile(first) and os.path.isfile(second)
    assert [str(p / "adapter_model.safetensors") for p in run_dirs(tmp_path / "home" / "loras" / "demo")] == [
        first,
        second,
    ]
    assert not (tmp_path / "~").exists()


def test_demo_settings_expand_home_and_fill_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = demo_settings({"demo": {"output_dir": "~/x"}, "adapter": {"rank": 3}}, "c.toml")
    assert settings.output_dir == tmp_path / "x" and settings.lora_rank == 3 and settings.steps == 30


def test_one_process_job_gets_a_free_port_unless_one_was_chosen():
    job = dist_env({}, gpu_id=1, gpu_id_given=True)
    assert not job.launched and job.port != DEFAULT_PORT
    assert job.env == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(job.port),
    }
    assert dist_env({"MASTER_PORT": str(DEFAULT_PORT)}, 0, False).port != DEFAULT_PORT
    assert dist_env({"MASTER_PORT": "12345"}, 0, False).port == 12345
    assert dist_env({}, 0, False, train_port="2222").port == 2222
    launched = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": str(DEFAULT_PORT)}
    one = dist_env(launched, 0, False)
    assert one.launched and one.port != DEFAULT_PORT and "RANK" not in one.env
    two = dist_env({**launched, "WORLD_SIZE": "2"}, 0, False)
    assert two.port == DEFAULT_PORT  # every process of a larger job must agree on the launcher's port


def test_lazy_lora_steps_config_is_temporary_and_keeps_the_file_name(tmp_path):
    import toml
    from utils.dgls.trainers.diffusion_pipe import config_for_train_py

    original = tmp_path / "my_flux.toml"
    config = {"gradient_accumulation_steps": 2, "dataset": "d.toml", "dgls": {"prefetch": 1}}
    original.write_text(toml.dumps(config))
    run = type("Run", (), {"values": {"lazy_lora_steps": 3}, "config": config, "config_path": str(original)})
    with config_for_train_py(run) as path:
        written = toml.load(path)
        assert os.path.basename(path) == "my_flux.toml" and path != str(original)
    assert written["gradient_accumulation_steps"] == 6 and written["dataset"] == "d.toml" and "dgls" not in written
    assert not os.path.exists(os.path.dirname(path))
    run.values = {"lazy_lora_steps": 1}
    with config_for_train_py(run) as path:
        assert path == str(original)


def test_main_raises_user_errors_for_callers():
    """dgls_train.main raises; only the program's entry point prints the one line."""
    from utils.dgls.errors import DGLSUserError

    with pytest.raises(DGLSUserError, match=re.escape("config file not found")):
        dgls_train.main(["--config", "/nonexistent/x.toml"])


def test_quick_start_commands_are_what_ci_runs():
    """The README's Quick start: two set-up commands, the demo command and the test command, each a
    line .ci/run (or, for the demo, its slow test) runs as written."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start")[1].split("\n## ")[0]
    blocks = [b.split("```")[0].strip().splitlines() for b in quick.split("```bash\n")[1:]]
    assert [len(b) for b in blocks] == [2, 1, 1], blocks
    (setup, (demo,), (tests,)) = blocks
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in [*setup, tests]:
        assert line in ci, f"{line!r} is not a line of .ci/run"
    assert demo == "python3 dgls_train.py --config toml/demo.toml"
    launch_tests = (ROOT / "tests" / "test_launch_lines.py").read_text()
    assert '[sys.executable, "dgls_train.py", "--config", "toml/demo.toml"]' in launch_tests


def test_demo_offloading_activations_trains_the_same_lora(tmp_path, user_env, capsys):
    """dgls_train.py --offload_activations (and --offload_recompute, and --checkpoint_units --keep_piece_outputs) on
    the demo: DeepSpeed's pipeline calls the wrapped checkpoint, the step lines say how much went home, and the LoRA
    is bitwise the one trained without it."""
    loras = {}
    runs = {
        "plain": [],
        "offload": ["--offload_activations"],
        "recompute": ["--offload_recompute"],
        "kept": ["--checkpoint_units", "--keep_piece_outputs"],
    }
    for name, flags in runs.items():
        config = demo_toml(tmp_path / name, steps=3)
        code, out, err = run_in_process(["--config", str(config), "--verbose", *flags], capsys)
        assert code == 0, err
        if flags:
            assert "activations home" in out
        if name == "kept":
            assert "their outputs wait in host memory for their layer's recompute" in out
        (saved,) = (tmp_path / name / "out").glob("*/adapter_model.safetensors")
        loras[name] = load_file(str(saved))
    for name in ("offload", "recompute", "kept"):
        assert loras["plain"].keys() == loras[name].keys()
        assert all(torch.equal(loras["plain"][k], loras[name][k]) for k in loras["plain"]), name


def test_start_up_notes_are_one_write_each(monkeypatch):
    """Under the deepspeed launcher every process runs ``python -u``, where print writes a line and its newline
    apart, so two processes' notes came out as ``notenote`` and two empty lines."""
    from types import SimpleNamespace

    from utils.dgls.trainers import diffusion_pipe

    writes: list[str] = []
    monkeypatch.setattr(dgls_train, "prepare", lambda argv, here: SimpleNamespace(notes=("DGLS: a", "DGLS: b")))
    monkeypatch.setattr(diffusion_pipe, "run_drop_in", lambda run: None)
    monkeypatch.setattr("sys.stdout", SimpleNamespace(write=writes.append, flush=lambda: None))
    assert dgls_train.main([]) == 0
    assert writes == ["DGLS: a\n", "DGLS: b\n"]
