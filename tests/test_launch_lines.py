"""The launch lines users type, run as they type them: no RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR or MASTER_PORT in the environment (CI has no mpi4py either, so a launch that
leaves DeepSpeed to discover an MPI job fails here as it would on a user's machine), and
Ctrl-C in the middle of a run.

The deepspeed launcher and the README's exact demo command take 20-60 s each on 2 cores: they
are marked slow (``python3 -m pytest -m slow tests``; .ci/run runs them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from cli_helpers import FAKE, deepspeed_cmd, demo_toml, fake_config, python_cmd, run_user_command, user_env
from conftest import ROOT

from utils.dgls.program.distributed import free_port


def only_run_dir(folder: Path) -> Path:
    (run_dir,) = [p for p in folder.iterdir() if p.is_dir()]
    return run_dir


def fake_facts(proc) -> dict:
    import json

    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAKE_TRAIN "))
    return json.loads(line[len("FAKE_TRAIN ") :])


@pytest.mark.slow  # dgls_train.py in fresh processes
def test_user_error_from_the_real_entry_point_is_one_line_exit_2(tmp_path):
    proc = run_user_command(python_cmd("--config", str(tmp_path / "missing.toml"), "--prefetch", "x"), tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("dgls: error: argument --prefetch: expected a whole number, got 'x'")


def _interrupt(cmd: list[str], cwd: Path, after: str) -> tuple[int, str, str, int]:
    """Start ``cmd``, send SIGINT (Ctrl-C) once a stdout line starts with ``after``.

    Returns (exit code, stdout, stderr, pid)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(after):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + out, err, proc.pid


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_ctrl_c_in_the_demo_is_one_line_and_cleans_up(tmp_path):
    cmd = [sys.executable, "-u", *python_cmd("--config", str(demo_toml(tmp_path, steps=30)), "--threading")[1:]]
    code, out, err, pid = _interrupt(cmd, ROOT, "step 2:")
    assert code == 130, err
    assert err.count("\n") == 1 and err.startswith("dgls: interrupted: stopped at step "), err
    assert "of 30; nothing was saved (the demo saves its LoRA at the end" in err
    assert not psutil.pid_exists(pid) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ctrl_c_in_the_drop_in_is_one_line_and_cleans_up(tmp_path):
    config = fake_config(tmp_path / "cfg", top="max_steps = 1000\ncheckpoint_every_n_steps = 1")
    cmd = [sys.executable, "-u", *python_cmd("--config", str(config), "--diffusion_pipe", str(FAKE), "--verbose")[1:]]
    code, out, err, pid = _interrupt(cmd, tmp_path, "dgls step 2:")
    assert code == 130, err
    run_dir = only_run_dir(tmp_path / "cfg" / "out")
    assert err == (
        f"dgls: interrupted: diffusion-pipe's run folder is {run_dir} (no LoRA saved yet); to go on from its last "
        "checkpoint, run the same command with --resume_from_checkpoint\n"
    ), err
    assert not psutil.pid_exists(pid)


@pytest.mark.slow
def test_readme_demo_command_exactly_as_written():
    """`python3 dgls_train.py --config toml/demo.toml` from the repository: 30 steps, the loss goes
    down, a new run folder under output/demo (removed afterwards)."""
    before = set((ROOT / "output" / "demo").glob("*"))
    proc = run_user_command([sys.executable, "dgls_train.py", "--config", "toml/demo.toml"], ROOT)
    made = set((ROOT / "output" / "demo").glob("*")) - before
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = next(line for line in proc.stdout.splitlines() if line.startswith("DGLS demo finished"))
        start, end = (float(x) for x in summary.split("loss ")[1].split(" over")[0].split(" -> "))
        assert end < 0.9 * start and "over 30 steps" in summary, summary
        (run_dir,) = made
        assert summary.endswith(f"LoRA saved to output/demo/{run_dir.name}/adapter_model.safetensors")
        assert proc.stderr == ""
    finally:
        for path in made:
            shutil.rmtree(path)


@pytest.mark.slow
def test_demo_under_the_deepspeed_launcher(tmp_path):
    """diffusion-pipe's launch convention; the launcher adds --local_rank=0 and sets the job's variables."""
    config = demo_toml(tmp_path, steps=3)
    proc = run_user_command(
        deepspeed_cmd("--num_gpus=1", "dgls_train.py", "--deepspeed", "--config", str(config)), ROOT
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "step 3: loss" in proc.stdout and "DGLS demo finished" in proc.stdout
    assert (only_run_dir(tmp_path / "out") / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_drop_in_under_the_deepspeed_launcher_from_inside_a_checkout(tmp_path):
    checkout = tmp_path / "dp"
    shutil.copytree(FAKE, checkout)
    config = fake_config(tmp_path / "cfg")
    cmd = deepspeed_cmd("--num_gpus=1", str(ROOT / "dgls_train.py"), "--deepspeed", "--config", str(config))
    facts = fake_facts(run_user_command([*cmd, "--blocks_to_swap", "6"], checkout))
    assert facts["placeholders"] > 0 and Path(facts["cwd"]).resolve() == checkout.resolve()
    assert facts["env"]["WORLD_SIZE"] == "1" and "--local_rank=0" in facts["argv"] and "--deepspeed" in facts["argv"]
    assert facts["env"]["MASTER_PORT"] != "29500"  # a one-process job gets a free port, not the launcher's default


def _session_alive(sid: int) -> list[int]:
    """The processes still in session ``sid`` (one launch: the deepspeed command, launch.py, the ranks)."""
    alive = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except (OSError, psutil.Error):
            pass
    return alive


def _launch_then_signal(cmd: list[str], cwd: Path, after: str, signum: int, group: bool) -> tuple[str, list[int]]:
    """Start ``cmd`` in a session of its own, send ``signum`` once a stdout line starts with ``after``: to the
    whole process group (what a terminal's Ctrl-C does) or to the deepspeed command alone. Returns stderr and
    the processes of the session still there 40 s later (none, when every one stopped)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env(), start_new_session=True
    )
    for line in proc.stdout:
        if line.startswith(after):
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            break
    deadline = time.monotonic() + 40
    while _session_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _session_alive(proc.pid)
    for pid in left:  # this test's own processes only (its session)
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    return err, left


def _dgls_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("dgls:")]


STOPPED_AT = re.compile(
    r"dgls: (interrupted|terminated \((SIGTERM|the deepspeed command that started this job is gone)\)): stopped at "
    r"step \d+ of 300; nothing was saved \(the demo saves its LoRA at the end, and has no checkpoint to resume from\)"
)


@pytest.mark.slow
def test_ctrl_c_under_the_deepspeed_launcher_stops_every_process_with_one_line_each(tmp_path):
    """The terminal's Ctrl-C reaches every process; launch.py then sends SIGTERM to the ranks, which no longer cuts
    their clean-up short. Left as it is (deepspeed's, documented in the README): the deepspeed command's own
    KeyboardInterrupt traceback."""
    config = demo_toml(tmp_path, steps=300)
    cmd = deepspeed_cmd("--num_gpus=2", f"--master_port={free_port()}", "dgls_train.py", "--deepspeed", "--config")
    err, left = _launch_then_signal([*cmd, str(config)], ROOT, "step 2:", signal.SIGINT, group=True)
    assert not left, "every process of the launch is gone"
    lines = _dgls_lines(err)
    assert len(lines) == 2 and all(STOPPED_AT.fullmatch(line) for line in lines), err
    assert all(line.startswith("dgls: interrupted: ") for line in lines), err
    assert "utils/dgls" not in err and "dgls_train.py" not in err, "no traceback from DGLS's processes"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sigterm_to_the_deepspeed_command_alone_stops_the_whole_launch(tmp_path):
    """The deepspeed command passes no signal on (on one machine): before, launch.py and both ranks went on
    training with nothing to stop them. Each rank sees its launcher gone and stops with one line; launch.py
    follows."""
    config = demo_toml(tmp_path, steps=300)
    cmd = deepspeed_cmd("--num_gpus=2", f"--master_port={free_port()}", "dgls_train.py", "--deepspeed", "--config")
    err, left = _launch_then_signal([*cmd, str(config)], ROOT, "step 2:", signal.SIGTERM, group=False)
    assert not left, "launch.py and the ranks stop too"
    lines = _dgls_lines(err)
    assert lines and all(STOPPED_AT.fullmatch(line) for line in lines), err
    assert any("the deepspeed command that started this job is gone" in line for line in lines), err
    assert "Traceback" not in err
