"""How a run stops: SIGTERM as Ctrl-C (one line, clean-up done, 143), a second SIGTERM not cutting the
clean-up short, and what a process forked from a run does on SIGTERM.

The demo runs in this process through dgls_train.py's entry point; signals are sent to this process from
inside the run. The launcher's own behaviour is in test_launch_lines.py (slow).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from cli_helpers import demo_toml, run_in_process

import utils.dgls.demo.train as demo_train
from utils.dgls.distributed import LAUNCHER_KEYS
from utils.dgls.stop_signals import StopSignals


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """No torch.distributed variables; the test's folder current; os.environ restored afterwards."""
    saved = dict(os.environ)
    for key in (*LAUNCHER_KEYS, "MASTER_ADDR", "MASTER_PORT", "DGLS_DIFFUSION_PIPE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_sigterm_raises_keyboard_interrupt_once_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.1)  # a bytecode boundary, where Python runs the handler
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM after the first stop: the clean-up goes on
        signal.sigtimedwait([], 0.1)
        assert (stop.how, stop.exit_code) == ("terminated (SIGTERM)", 143)
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C still interrupts
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_signal_ignored_by_whoever_started_the_process_stays_ignored(monkeypatch):
    """nohup, or a shell's background job: SIG_IGN is kept."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.1)
            assert stop.received is None
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_forked_child_ends_on_sigterm_as_python_would():
    """A multiprocessing pool (diffusion-pipe's caching) forks workers and ends them with SIGTERM: they die as
    before, without a KeyboardInterrupt traceback each."""
    ready, told = os.pipe()
    with StopSignals():
        pid = os.fork()
        if pid == 0:  # the child: wait for the signal; a KeyboardInterrupt would exit 3
            try:
                os.write(told, b"x")  # Python drops signals that arrive while it sets up a forked child
                time.sleep(30)
            except BaseException:
                os._exit(3)
            os._exit(0)
        os.read(ready, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    os.close(ready)
    os.close(told)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def signal_at_step(monkeypatch, signum: int, step: int) -> None:
    """Send ``signum`` to this process when the demo reads memory after step ``step`` (once per step; the step
    then counts as not done)."""
    read = demo_train.MemoryMonitor.read
    seen = []

    def read_then_signal(monitor):
        seen.append(1)
        if len(seen) == step:
            os.kill(os.getpid(), signum)
        return read(monitor)

    monkeypatch.setattr(demo_train.MemoryMonitor, "read", read_then_signal)


def test_sigterm_in_the_demo_is_one_line_like_ctrl_c(tmp_path, user_env, monkeypatch, capsys):
    """Before: Python's default ended the process at once, with no line and no clean-up."""
    signal_at_step(monkeypatch, signal.SIGTERM, 3)
    code, _out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=30))], capsys)
    assert code == 143, err
    assert err == (
        "dgls: terminated (SIGTERM): stopped at step 2 of 30; nothing was saved (the demo saves its LoRA at the end, "
        "and has no checkpoint to resume from)\n"
    )
    assert not (tmp_path / "out").exists()
