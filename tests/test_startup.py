"""Start-up on a CPU (issue 39): no C++ build, no wait on a build's lock, /dev/shm checked, Ctrl-C one line.

DeepSpeed's ``init_distributed`` used to load its CPU shared-memory op (``deepspeed_shm_comm``), building
it on the first run (minutes, in silence) and waiting forever on the build's ``lock`` file once a build
was killed; DGLS runs keep it out (utils/dgls/trainers/shm_op.py). An op DGLS does load (``--host_adam
deepspeed``'s) is announced before it is compiled, and a stale lock is refused (utils/dgls/training/jit_ops.py).
The processes of a data-parallel job share their host copy through /dev/shm, which is checked before
anything is written there (utils/dgls/memory/shm_space.py). The stale lock is made in a temporary
``TORCH_EXTENSIONS_DIR``; torch's wait on it raises in the fast tests (so that a run that would wait fails
instead of hanging). The real read-only or 1 MiB /dev/shm needs a private mount namespace (root and
``unshare``): the slow tests that use one skip without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import FAKE, FAKE_TABLES, deepspeed_cmd, demo_toml, fake_config, python_cmd, run_in_process
from conftest import ROOT
from helpers import child_env

from utils.dgls.errors import DGLSUserError
from utils.dgls.memory.peers import sharing_problems
from utils.dgls.memory.shm_space import check_before_start, shm_problem
from utils.dgls.program.distributed import DistEnv
from utils.dgls.program.launch import entry
from utils.dgls.trainers.shm_op import without_shm_op

SHM_OP = "deepspeed_shm_comm"
MiB = 2**20


def stale_lock(folder: Path) -> Path:
    """What a killed build leaves: the op's build folder with only its ``lock`` file."""
    lock = folder / SHM_OP / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    return lock


@pytest.fixture
def locked_extensions(tmp_path, monkeypatch):
    """An extensions folder with a stale lock, as the one torch builds in; nothing loaded before (an
    earlier test of this process may have loaded the op, and DeepSpeed would not look again); waiting
    on the lock raises."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from torch.utils.file_baton import FileBaton

    folder = tmp_path / "torch_extensions"
    lock = stale_lock(folder)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})

    def wait(baton):
        raise AssertionError(f"waited on {baton.lock_file_path}")

    monkeypatch.setattr(FileBaton, "wait", wait)
    return SimpleNamespace(folder=folder, lock=lock)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------------ DeepSpeed's CPU shared-memory op


def test_inside_without_shm_op_deepspeed_neither_builds_nor_waits_for_its_cpu_op(locked_extensions):
    """The decision DeepSpeed's TorchBackend makes at init_distributed (``build_shm_op``), with the
    installed DeepSpeed (CI: also 0.18.4); its table of compatible ops is as before afterwards."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    before = dict(deepspeed.ops.__compatible_ops__)
    with without_shm_op():
        assert build_shm_op() is None
    assert deepspeed.ops.__compatible_ops__ == before
    assert files_under(locked_extensions.folder) == [SHM_OP, f"{SHM_OP}/lock"]


def test_the_one_process_demo_starts_past_a_stale_build_lock_and_builds_nothing(
    tmp_path, user_env, locked_extensions, capsys
):
    """A one-process CPU run needs no shared-memory all-reduce: the demo neither builds the op nor
    waits on the lock a killed build left (it used to wait forever, in silence)."""
    assert not torch.distributed.is_initialized(), "an earlier test left a process group behind"
    code, out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=1))], capsys)
    assert code == 0, err
    assert "LoRA saved to" in out
    assert files_under(locked_extensions.folder) == [SHM_OP, f"{SHM_OP}/lock"]


def test_the_drop_in_runs_train_py_without_the_shm_op(tmp_path, user_env, locked_extensions, monkeypatch):
    """diffusion-pipe's train.py calls ``deepspeed.init_distributed()`` itself: it runs inside
    ``without_shm_op`` (train.py stands in here: what DeepSpeed decides when it starts)."""
    import runpy

    from deepspeed.comm.torch import build_shm_op

    from utils.dgls.program.validate import prepare
    from utils.dgls.trainers.diffusion_pipe import run_drop_in

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    config = fake_config(tmp_path / "cfg")
    run = prepare(["--config", str(config), "--diffusion_pipe", str(FAKE), "--no-dynamic_swapping"], ROOT)
    built = []
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name: built.append(build_shm_op()))
    run_drop_in(run)
    assert built == [None]


# ------------------------------------------------------------------ ops DeepSpeed compiles on first use


@pytest.fixture
def empty_extensions(tmp_path, monkeypatch):
    """An empty extensions folder; nothing loaded before; waiting on a lock raises."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from torch.utils.file_baton import FileBaton

    folder = tmp_path / "torch_extensions"
    folder.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})

    def wait(baton):
        raise AssertionError(f"waited on {baton.lock_file_path}")

    monkeypatch.setattr(FileBaton, "wait", wait)
    return folder


def test_a_stale_lock_of_the_host_adam_op_is_one_line_naming_the_file(empty_extensions):
    """--host_adam deepspeed loads DeepSpeedCPUAdam, compiled on first use: a lock left by a killed build
    is refused with the file to delete, before torch would wait on it forever."""
    from utils.dgls.training.host_optimizer import HostOptimizerSpec

    lock = empty_extensions / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    with pytest.raises(DGLSUserError, match=f"^{lock} is left from a build of DeepSpeed's cpu_adam op") as info:
        HostOptimizerSpec(implementation="deepspeed").build([torch.zeros(4, 4)])
    assert f"delete it (rm {lock})" in str(info.value)


@pytest.mark.parametrize("drop_in", [False, True], ids=["demo", "drop-in"])
def test_a_stale_host_adam_lock_is_refused_before_deepspeed_starts(drop_in, empty_extensions, tmp_path, user_env):
    """A full fine-tune with --host_adam deepspeed: the lock is refused by the checks before anything starts
    (it was refused only once DeepSpeed had started and placed the layers); DeepSpeed is not needed to find
    it (the build folder is torch's)."""
    from utils.dgls.program.validate import prepare

    lock = empty_extensions / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    if drop_in:
        full = FAKE_TABLES.replace('[adapter]\ntype = "lora"\nrank = 4\n', "")
        argv = ["--config", str(fake_config(tmp_path / "cfg", tables=full)), "--diffusion_pipe", str(FAKE)]
    else:
        argv = ["--config", str(demo_toml(tmp_path, base="demo_full.toml"))]
    with pytest.raises(DGLSUserError, match=f"^{lock} is left from a build of DeepSpeed's cpu_adam op"):
        prepare([*argv, "--host_adam", "deepspeed", "--blocks_to_swap", "2"], ROOT)
    lock.unlink()
    prepare([*argv, "--host_adam", "deepspeed", "--blocks_to_swap", "2"], ROOT)  # without the lock it passes


def test_a_first_build_and_a_build_in_progress_are_said_before_loading(empty_extensions):
    from utils.dgls.training.jit_ops import before_loading, lock_holders

    said = []
    before_loading("CPUAdamBuilder", said.append)
    assert said == [
        f"DGLS: compiling DeepSpeed's cpu_adam op into {empty_extensions / 'cpu_adam'} (C++, once per machine "
        "and DeepSpeed version; minutes on a small CPU)"
    ]
    lock = empty_extensions / "cpu_adam" / "lock"
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's builder holds it while it builds
    try:
        said.clear()
        before_loading("CPUAdamBuilder", said.append)
        assert said == [f"DGLS: waiting for process {os.getpid()} to finish building DeepSpeed's cpu_adam op ({lock})"]
    finally:
        os.close(held)
    assert lock_holders(lock) == [], "closed: nobody builds"
    assert lock_holders(lock, empty_extensions / "no_proc") is None, "without /proc nobody can tell"


# ------------------------------------------------------------------ /dev/shm


def fake_statvfs(read_only: bool = False, free: int = 1 << 40, size: int = 1 << 40):
    block = 4096
    result = SimpleNamespace(
        f_flag=os.ST_RDONLY if read_only else 0,
        f_frsize=block,
        f_bavail=free // block,
        f_bfree=free // block,
        f_blocks=size // block,
    )
    return lambda folder: result


def test_shm_problem_says_what_is_wrong_with_the_folder_and_what_to_do(tmp_path):
    assert shm_problem(100 * MiB, tmp_path, fake_statvfs()) == ""
    read_only = shm_problem(0, tmp_path, fake_statvfs(read_only=True))
    assert read_only.startswith(f"{tmp_path} is read-only, and the processes of this job on this machine share")
    assert f"mount -o remount,rw {tmp_path}" in read_only and "\n" not in read_only
    small = shm_problem(5 * MiB, tmp_path, fake_statvfs(free=1 * MiB, size=1 * MiB))
    assert small.startswith(f"{tmp_path} has 1.0 MiB free, and the processes of this job on this machine share")
    assert "(5.0 MiB): make it at least 5.0 MiB (Docker: --shm-size" in small and "\n" not in small
    assert shm_problem(5 * MiB, tmp_path / "none", fake_statvfs(read_only=True)) == "", "no /dev/shm: no sharing"


def test_a_job_that_will_share_refuses_a_read_only_shm_before_deepspeed_starts(tmp_path):
    """Two data-parallel processes on this machine (the deepspeed launcher's LOCAL_SIZE, torchrun's
    LOCAL_WORLD_SIZE) share their streamed layers through /dev/shm; pipeline stages, one process per
    machine, or no streaming do not."""
    two, read_only = DistEnv(True, 0, 2, 0, 29500), fake_statvfs(read_only=True)
    with pytest.raises(DGLSUserError, match=f"^{tmp_path} is read-only"):
        check_before_start(two, 1, True, {"LOCAL_SIZE": "2"}, tmp_path, read_only)
    with pytest.raises(DGLSUserError, match="is read-only"):
        check_before_start(two, 1, True, {"LOCAL_WORLD_SIZE": "2"}, tmp_path, read_only)
    check_before_start(two, 1, True, {"LOCAL_SIZE": "2"}, tmp_path, fake_statvfs())
    check_before_start(two, 2, True, {"LOCAL_SIZE": "2"}, tmp_path, read_only)  # two pipeline stages: nothing shared
    check_before_start(two, 1, False, {"LOCAL_SIZE": "2"}, tmp_path, read_only)  # nothing streams
    check_before_start(two, 1, True, {"LOCAL_SIZE": "1"}, tmp_path, read_only)  # one process per machine
    check_before_start(two, 1, True, {}, tmp_path, read_only)  # not said: Peers.discover checks, with every rank


def test_the_demo_checks_shm_before_its_processes_meet(tmp_path, user_env, monkeypatch, capsys):
    """As the drop-in does: a process refuses a /dev/shm it cannot share through on its own, before it waits
    for the others (it checked inside ``peers_arrived``)."""
    import contextlib

    import utils.dgls.demo.train as demo_train

    order = []

    def check(dist, stages, streaming, environ):
        order.append("check")
        raise DGLSUserError("/dev/shm is read-only")

    @contextlib.contextmanager
    def meet(dist):
        order.append("peers")
        yield

    monkeypatch.setattr(demo_train, "check_before_start", check)
    monkeypatch.setattr(demo_train, "peers_arrived", meet)
    from utils.dgls.program.distributed import free_port

    # a free MASTER_PORT: the launcher's default (29500) may be another run's on this machine (its check comes first)
    launcher = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "MASTER_PORT": str(free_port())}
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    code, _out, err = run_in_process(["--config", str(demo_toml(tmp_path))], capsys)
    assert (code, err) == (2, "dgls: error: /dev/shm is read-only\n")
    assert order == ["check"]


def test_every_rank_refuses_when_one_that_would_share_found_no_room():
    """Peers.discover gathers each rank's /dev/shm verdict, made before any rank writes: every rank
    gets the same list, so all refuse together and none waits in a barrier for a peer that stopped."""
    entry_of = lambda host, rank, problem="": (host, "", "sig", rank, 100 + rank, "tok", problem)  # noqa: E731
    full = "/dev/shm has 1.0 MiB free, ..."
    assert sharing_problems([entry_of("a", 0), entry_of("a", 1, full)]) == [full]
    assert sharing_problems([entry_of("a", 0, full), entry_of("a", 1, full), entry_of("b", 2)]) == [full]
    assert sharing_problems([entry_of("a", 0, full), entry_of("b", 1)]) == [], "alone on its machine: no sharing"
    assert sharing_problems([entry_of("a", 0), entry_of("a", 1)]) == []


def test_a_one_process_run_writes_nothing_to_shm_in_its_clean_up(tmp_path, user_env, monkeypatch, capsys):
    """A read-only /dev/shm (every write there fails): the one-process demo trains and saves. It used
    to train, then fail removing DeepSpeed's buffer in its clean-up, and save nothing."""
    import pathlib

    real_unlink, real_open = pathlib.Path.unlink, os.open

    def read_only(path) -> OSError:
        return OSError(30, "Read-only file system", str(path))

    def unlink(self, missing_ok=False):
        if str(self).startswith("/dev/shm/"):
            raise read_only(self)
        return real_unlink(self, missing_ok=missing_ok)

    def open_(path, flags, *args, **kwargs):
        if str(path).startswith("/dev/shm/") and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise read_only(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    monkeypatch.setattr(os, "open", open_)
    code, out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=1))], capsys)
    assert code == 0, err
    assert list((tmp_path / "out").glob("*/adapter_model.safetensors"))


# ------------------------------------------------------------------ Ctrl-C


def test_ctrl_c_during_start_up_is_the_line_training_prints(tmp_path, user_env, monkeypatch, capsys):
    """Ctrl-C while DeepSpeed starts: the line of a Ctrl-C during training, at step 0, and nothing of
    DeepSpeed's muted start-up output."""
    import deepspeed

    def interrupted(*args, **kwargs):
        print("DeepSpeed chatter that stays muted")
        raise KeyboardInterrupt

    monkeypatch.setattr(deepspeed, "init_distributed", interrupted)
    code, out, err = run_in_process(["--config", str(demo_toml(tmp_path, steps=3))], capsys)
    assert code == 130
    assert err == (
        "dgls: interrupted: stopped at step 0 of 3; nothing was saved (the demo saves its LoRA at the end, and has "
        "no checkpoint to resume from)\n"
    )


def test_what_a_ctrl_c_makes_a_child_process_raise_is_one_line(capsys):
    """A compiler stopped by the same Ctrl-C ends the build with ninja's "interrupted by user", which
    torch raises as a RuntimeError: one line and 130, not a 48-line traceback. Without a Ctrl-C the
    same error is a bug and keeps its traceback."""

    def build_interrupted() -> int:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise RuntimeError(
                "Error building extension 'deepspeed_shm_comm': [1/3] c++ -c shm.cpp\n"
                "ninja: build stopped: interrupted by user."
            ) from None
        return 0

    handler = signal.getsignal(signal.SIGINT)
    assert entry(build_interrupted) == 130
    assert capsys.readouterr().err == (
        "dgls: interrupted: Ctrl-C stopped the run (RuntimeError: ninja: build stopped: interrupted by user.)\n"
    )
    assert signal.getsignal(signal.SIGINT) is handler, "the handler is restored"

    def build_failed() -> int:
        raise RuntimeError("Error building extension 'x'")

    with pytest.raises(RuntimeError, match="Error building extension"):
        entry(build_failed)


def test_every_one_line_message_is_one_write_as_under_python_u(monkeypatch):
    """DeepSpeed's launcher starts each process with ``python -u``, where ``print`` writes a line's text and
    its newline in two writes: three processes refusing the same setting printed ``lineline`` and empty
    lines (CI, test_multi_process). Each message must reach stderr whole, in one write."""
    writes: list[str] = []
    monkeypatch.setattr(sys, "stderr", SimpleNamespace(write=writes.append, flush=lambda: None))

    def refused() -> int:
        raise DGLSUserError("pipeline_stages = 3 leaves a stage without layers")

    assert entry(refused) == 2
    assert writes == ["dgls: error: pipeline_stages = 3 leaves a stage without layers\n"]


GROUPED_FAILURE = """
import atexit, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from utils.dgls.errors import DGLSUserError
from utils.dgls.program.distributed import free_port
from utils.dgls.program.launch import run_as_program
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
class TornDown:  # says so in the interpreter's teardown, which the failed grouped process must skip
    def __del__(self):
        sys.stdout.write("torn down\\n")
kept, logs = TornDown(), []
def main():
    logs.append(open(sys.argv[2], "w"))  # left open, its line in Python's buffer: a trainer's log
    logs[0].write("logged\\n")
    if sys.argv[1] == "user":
        raise DGLSUserError("another process of this data-parallel job stopped")
    if sys.argv[1] == "quit":  # train.py's quit() after --cache_only
        sys.exit()
    raise ValueError("a bug")
run_as_program(main)
"""


@pytest.mark.slow  # a process with torch and gloo per case
@pytest.mark.parametrize("kind", ["user", "bug", "quit"])
def test_a_process_that_ends_with_its_group_alive_ends_with_its_own_exit_code(tmp_path, kind):
    """A run that ends with its process group alive (a peer killed mid-step: CI saw this; train.py's quit()) must
    not leave it to interpreter finalization, where gloo's threads can abort the process ("terminate called without
    an active exception", exit -6): it ends with 2 and its one line (a bug: 1 and its traceback once; quit: 0),
    atexit handlers run, a file left open keeps what was written to it, the teardown is skipped."""
    script, log = tmp_path / "fail.py", tmp_path / "train.log"
    script.write_text(GROUPED_FAILURE.format(root=str(ROOT)))
    proc = subprocess.run(
        [sys.executable, str(script), kind, str(log)], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.stdout == "atexit ran\n" and log.read_text() == "logged\n"
    if kind == "user":
        assert (proc.returncode, proc.stderr) == (2, "dgls: error: another process of this data-parallel job stopped\n")
    elif kind == "quit":
        assert (proc.returncode, proc.stderr) == (0, "")
    else:
        assert proc.returncode == 1 and proc.stderr.count("ValueError: a bug") == 1, proc.stderr


# ------------------------------------------------------------------ the real program (slow)


def run_program(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """(exit code, stdout and stderr together); killed whole, and failed, after ``timeout`` seconds."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran over {timeout} s (waiting on something?); output:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.slow
def test_the_demo_and_the_drop_in_start_past_a_stale_lock(tmp_path):
    """The issue's case as a user meets it: a build killed once left its lock, and every later CPU run
    waited on it forever. Now the demo and the drop-in (the stand-in checkout) train, build nothing,
    and leave the lock alone."""
    folder = tmp_path / "torch_extensions"
    stale_lock(folder)
    env = {**child_env("DGLS_DIFFUSION_PIPE", "LOCAL_SIZE"), "TORCH_EXTENSIONS_DIR": str(folder)}
    code, out = run_program(python_cmd("--config", str(demo_toml(tmp_path / "demo", steps=2))), ROOT, env, 300)
    assert code == 0 and "LoRA saved to" in out, out[-3000:]
    config = fake_config(tmp_path / "dp", top="max_steps = 2")
    code, out = run_program(python_cmd("--config", str(config), "--diffusion_pipe", str(FAKE)), tmp_path, env, 300)
    assert code == 0, out[-3000:]
    assert files_under(folder) == [SHM_OP, f"{SHM_OP}/lock"]


def private_shm_prefix(mode: str) -> list[str]:
    """A command prefix that runs under a fresh tmpfs on /dev/shm (``ro``: read-only; ``1m``: 1 MiB) in
    a private mount namespace; the machine's /dev/shm is untouched. Skips where that is not allowed."""
    opts = {"ro": "ro,size=64m", "1m": "size=1m"}[mode]
    script = f'mount -t tmpfs -o {opts} dgls-test /dev/shm && exec "$@"'
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("needs a private mount namespace (root and unshare) to give /dev/shm another size")
    return prefix


@pytest.mark.slow
def test_one_process_trains_and_saves_with_a_read_only_shm(tmp_path):
    prefix = private_shm_prefix("ro")
    env = child_env("DGLS_DIFFUSION_PIPE", "LOCAL_SIZE")
    code, out = run_program([*prefix, *python_cmd("--config", str(demo_toml(tmp_path, steps=2)))], ROOT, env, 300)
    assert code == 0 and "LoRA saved to" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, message",
    [
        ("ro", "dgls: error: /dev/shm is read-only, and the processes of this job on this machine share"),
        ("1m", "dgls: error: /dev/shm has 1.0 MiB free, and the processes of this job on this machine share"),
    ],
)
def test_two_processes_refuse_a_shm_without_room_in_one_line_each(tmp_path, mode, message):
    """Two data-parallel processes under the deepspeed launcher: a read-only /dev/shm used to hang, a
    1 MiB one to kill a rank with SIGBUS and no message. Now each rank says so in one line (the
    read-only one before DeepSpeed starts) and the job ends; DeepSpeed's 66 MB buffers never appear."""
    prefix = private_shm_prefix(mode)
    config = demo_toml(tmp_path, steps=2, batch_size=2)
    port = str(29700 + os.getpid() % 200)
    launch = deepspeed_cmd("--num_gpus=2", f"--master_port={port}", "dgls_train.py", "--deepspeed")
    env = child_env("DGLS_DIFFUSION_PIPE", "LOCAL_SIZE")
    code, out = run_program([*prefix, *launch, "--config", str(config)], ROOT, env, 300)
    assert code != 0
    assert out.count(message) == 2, out[-4000:]
    assert "Traceback" not in out and "return code = -7" not in out, out[-4000:]
    assert "shared_create" not in out, "DeepSpeed's shm op was loaded"
