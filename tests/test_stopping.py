"""How a run stops: SIGTERM as Ctrl-C (one line, clean-up done, 143), and a save that is whole or absent and
reported as it is (Ctrl-C while saving, a disk that fills at the save).

The demo runs in this process through dgls_train.py's entry point; signals are sent to this process from
inside the run (at a step, or at the save). The launcher's own behaviour is in test_launch_lines.py (slow).
"""

from __future__ import annotations

import errno
import io
import os
import signal
import time

import pytest
from cli_helpers import demo_toml, run_in_process

import utils.dgls.demo.train as demo_train
from utils.dgls.program.stop_signals import StopSignals


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


def test_stopping_found_the_launcher_gone_and_the_watchs_sigterm_after_it_raises_nothing():
    """A rank whose collective failed because a partner saw the deepspeed command gone first asks ``stopping()``;
    it looks at the launcher at once (the watch looks once a second) and counts the stop as the watch's SIGTERM,
    which, landing next, must not raise a second exception into the failure's handling."""
    with StopSignals() as stop:
        stop._launcher = lambda: False  # the command is still there: a failure is a bug
        assert not stop.stopping() and stop.received is None
        stop._launcher = lambda: True  # gone now, before the watch's next look
        assert stop.stopping()
        assert (stop.how, stop.exit_code) == ("terminated (the deepspeed command that started this job is gone)", 143)
        os.kill(os.getpid(), signal.SIGTERM)  # the watch's, sent before it saw the stop decided
        signal.sigtimedwait([], 0.1)
        with pytest.raises(KeyboardInterrupt):  # a Ctrl-C still interrupts the clean-up
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)


def test_stopping_after_the_watch_sent_its_sigterm_counts_it_and_it_then_raises_nothing():
    """The other order: the watch saw the command gone and sent SIGTERM, which has not landed when the failure is
    handled (the run asks ``stopping()`` first): True, and the SIGTERM landing after it only records itself."""
    with StopSignals() as stop:
        stop.launcher_gone = True  # what the watch sets, under the lock, before its os.kill
        assert stop.stopping() and stop.received is None
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.1)
        assert (stop.received, stop.exit_code) == (signal.SIGTERM, 143)


def test_a_collective_failing_after_the_launcher_went_is_the_demos_stop_line(tmp_path, user_env, monkeypatch, capsys):
    """Two ranks whose deepspeed command is gone: the first to see it stops and leaves, and the other's next
    collective fails ('Connection closed by peer') before its own watch looks (CI saw a traceback there). Its
    launcher is gone too, so the failure is the stop: the demo's stop line and 143; with the launcher still there
    the same failure is a bug and keeps its traceback. The launcher is a stand-in looked at by ``stopping()``
    (``_watch_launcher`` replaced for the test: no thread, no launch.py)."""
    launcher = {"gone": True}

    def no_watch(stop: StopSignals) -> None:
        stop._launcher = lambda: launcher["gone"]

    monkeypatch.setattr(StopSignals, "_watch_launcher", no_watch)
    read = demo_train.MemoryMonitor.read
    seen = []

    def partner_left_at_step_3(monitor):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
        return read(monitor)

    monkeypatch.setattr(demo_train.MemoryMonitor, "read", partner_left_at_step_3)
    code, _out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=30))], capsys)
    assert code == 143, err
    assert err == (
        "dgls: terminated (the deepspeed command that started this job is gone): stopped at step 2 of 30; nothing "
        "was saved (the demo saves its LoRA at the end, and has no checkpoint to resume from)\n"
    )
    launcher["gone"] = False
    seen.clear()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        run_in_process(["--config", str(demo_toml(tmp_path, steps=30))], capsys)


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


def test_a_failure_after_ctrl_c_at_start_up_is_one_line_without_deepspeeds_muted_output(
    tmp_path, user_env, monkeypatch, capsys
):
    """Ctrl-C while DeepSpeed compiles an op stops the compiler too, and torch raises ``RuntimeError``
    ("ninja: build stopped: interrupted by user"): the muted start-up output is not replayed (it was, above
    the one line); a failure there without a stop signal (a bug) still replays it."""
    stop_now = {"signal": True}

    def start_up(run):
        print("DeepSpeed start-up chatter")
        if stop_now["signal"]:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                signal.sigtimedwait([], 0.1)
            except KeyboardInterrupt:  # what torch's build does: the interrupted ninja fails
                raise RuntimeError("Error building extension: ninja: build stopped: interrupted by user") from None
        raise RuntimeError("a bug")

    monkeypatch.setattr(demo_train, "_init_distributed", start_up)
    code, out, err = run_in_process(["--config", str(demo_toml(tmp_path))], capsys)
    assert code == 130, err
    assert err == (
        "dgls: interrupted: Ctrl-C stopped the run (RuntimeError: Error building extension: ninja: build stopped: "
        "interrupted by user)\n"
    )
    stop_now["signal"] = False
    with pytest.raises(RuntimeError, match="a bug"):
        run_in_process(["--config", str(demo_toml(tmp_path))], capsys)
    assert "DeepSpeed start-up chatter" in capsys.readouterr().err


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


def test_ctrl_c_while_saving_says_the_lora_was_saved_when_it_was(tmp_path, user_env, monkeypatch, capsys):
    """Ctrl-C once the file is written (during the summary): before, 'interrupted before training started;
    nothing was saved' while the LoRA was on disk."""

    def interrupted(result):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_train, "summary", interrupted)
    code, _out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=2))], capsys)
    (run_dir,) = (tmp_path / "out").iterdir()
    saved = run_dir / "adapter_model.safetensors"
    assert code == 130 and saved.is_file() and list(run_dir.iterdir()) == [saved], err
    assert err == f"dgls: interrupted: stopped after all 2 steps, while saving; the LoRA was saved to {saved}\n"


def test_ctrl_c_before_the_save_is_whole_leaves_no_file_and_no_run_folder(tmp_path, user_env, monkeypatch, capsys):
    """A save interrupted before its file is complete: nothing under the file's name, and no empty run folder."""

    def interrupted_rename(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_train.os, "replace", interrupted_rename)
    code, _out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=2))], capsys)
    assert code == 130, err
    assert err == "dgls: interrupted: stopped after all 2 steps, while saving; nothing was saved\n"
    assert list((tmp_path / "out").iterdir()) == []


class FullDisk(io.BytesIO):
    """A file on a disk that fills after 100 bytes."""

    def write(self, data: bytes) -> int:
        super().write(data[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_disk_that_fills_at_the_save_is_one_line_and_leaves_no_empty_run_folder(
    tmp_path, user_env, monkeypatch, capsys
):
    """The free space was checked before training; something else filled the disk meanwhile."""
    written = []

    def open_on_full_disk(path, mode):
        written.append(path)
        open(path, mode).close()  # the partial file exists, as on a real disk
        return FullDisk()

    monkeypatch.setattr(demo_train, "open", open_on_full_disk, raising=False)
    out = tmp_path / "out"
    code, _out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=2))], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"dgls: error: could not save the trained LoRA (0.4 MiB) under {out}: its disk is full; ")
    assert "nothing was saved and no run folder was left: free space there" in err
    assert written and list(out.iterdir()) == []


def test_the_drop_in_interrupt_line_names_a_save_cut_short_as_incomplete(tmp_path):
    """diffusion-pipe writes each save through a tmp folder inside it, removed once the save is written: Ctrl-C
    while saving leaves it, and that save is not reported as saved."""
    import time

    from utils.dgls.trainers.diffusion_pipe import _what_was_saved

    started = time.time() - 1
    run_dir = tmp_path / "20260101_00-00-00"
    (run_dir / "epoch1").mkdir(parents=True)
    (run_dir / "epoch1" / "adapter_model.safetensors").write_bytes(b"x")
    (run_dir / "epoch2" / "tmp").mkdir(parents=True)
    assert _what_was_saved(tmp_path, started) == (
        f"diffusion-pipe's run folder is {run_dir} (saved: epoch1, epoch2 (incomplete: stopped while saving)); it has "
        "no checkpoint to resume from yet"
    )
