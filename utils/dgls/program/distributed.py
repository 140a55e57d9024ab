"""The torch.distributed environment of a run: what a launcher set, or a one-process job.

DeepSpeed's ``init_distributed()`` needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; without all of them it falls into MPI discovery, which fails where mpi4py is
not installed (most machines). The deepspeed launcher sets them and adds
``--local_rank=N`` to the script's arguments. ``python dgls_train.py ...`` has no launcher,
so DGLS fills in a one-process job itself: rank 0 of 1 on the GPU ``--gpu_id`` names.

diffusion-pipe's train.py overwrites MASTER_PORT with its own ``--master_port`` flag
(default 29500, the deepspeed launcher's default too), so two one-process runs on one
machine would collide there. A one-process run therefore gets a free port unless one was
chosen (train.py's ``--master_port``, or a MASTER_PORT other than 29500), and train.py is
told the port the run uses.

Every variable is checked here, before anything starts: ranks count from 0 to WORLD_SIZE - 1, and
``DGLS_RENDEZVOUS_TIMEOUT`` (seconds) is how long the processes of a job wait for each other at
start-up (:mod:`.rendezvous`).
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import DGLSUserError

LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
DEFAULT_PORT = 29500  # the deepspeed launcher's and diffusion-pipe's train.py's default
RENDEZVOUS_VAR = "DGLS_RENDEZVOUS_TIMEOUT"
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"  # set by torchrun: its agent serves the store on MASTER_PORT
DEFAULT_RENDEZVOUS_S = 30.0  # how long the processes of a job wait for each other (see rendezvous.py)


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, and the environment to set before the trainer starts."""

    launched: bool  # started by a launcher (deepspeed, torchrun): RANK/WORLD_SIZE/LOCAL_RANK were set
    rank: int
    world_size: int
    local_rank: int
    port: int
    env: dict[str, str] = field(default_factory=dict)  # to put into os.environ
    # where the port came from, for messages: "free" (DGLS chose it), "MASTER_PORT" (the environment: the
    # deepspeed launcher's --master_port under it), "--master_port" (train.py's flag)
    port_from: str = "free"
    addr: str = "127.0.0.1"  # MASTER_ADDR: where rank 0 listens
    rendezvous_s: float = DEFAULT_RENDEZVOUS_S
    # torchrun: its agent holds the job's store on MASTER_PORT and has gathered the processes itself
    agent_store: bool = False


def _int_var(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise DGLSUserError(f"the environment variable {key}={environ[key]!r} is not a whole number") from None


def _check_ranks(rank: int, world_size: int, local_rank: int) -> None:
    """A launcher's variables that no job can have: one line instead of a silent wait for ranks that never come."""
    if world_size < 1:
        raise DGLSUserError(
            f"the environment variable WORLD_SIZE={world_size} must be 1 or more (the number of processes)"
        )
    for key, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if not 0 <= value < world_size:
            raise DGLSUserError(
                f"the environment variable {key}={value} must be from 0 to WORLD_SIZE - 1 = {world_size - 1}: start "
                "the processes with a launcher (deepspeed --num_gpus=N ...), which sets them, or correct them"
            )


def rendezvous_timeout(environ: Mapping[str, str]) -> float:
    """Seconds the processes of a job wait for each other at start-up: ``DGLS_RENDEZVOUS_TIMEOUT``, or 30."""
    text = environ.get(RENDEZVOUS_VAR)
    if text is None:
        return DEFAULT_RENDEZVOUS_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise DGLSUserError(
            f"the environment variable {RENDEZVOUS_VAR}={text!r} must be a number of seconds > 0 (default "
            f"{DEFAULT_RENDEZVOUS_S:g})"
        )
    return seconds


def option_value(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in an argument list, or None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def dist_env(environ: Mapping[str, str], gpu_id: int, gpu_id_given: bool, train_port: str | None = None) -> DistEnv:
    """The job this process belongs to. ``train_port``: train.py's ``--master_port`` if the user gave one."""
    given = [k for k in LAUNCHER_KEYS if k in environ]
    if given and len(given) < len(LAUNCHER_KEYS):
        missing = [k for k in LAUNCHER_KEYS if k not in environ]
        raise DGLSUserError(
            f"{', '.join(given)} set in the environment but not {', '.join(missing)}: start dgls_train.py with a "
            "launcher (deepspeed --num_gpus=1 ...) or unset them for a one-process run"
        )
    port = None
    if train_port is not None:
        try:
            port = int(train_port)
        except ValueError:
            raise DGLSUserError(f"--master_port {train_port!r} is not a port number") from None
    if given:
        if gpu_id_given:
            raise DGLSUserError(
                "--gpu_id does nothing under the deepspeed launcher, which gives each process its GPU: choose GPUs "
                "with the launcher (deepspeed --include localhost:N ...) and drop --gpu_id"
            )
        rank, world_size = _int_var(environ, "RANK"), _int_var(environ, "WORLD_SIZE")
        local_rank = _int_var(environ, "LOCAL_RANK")
        _check_ranks(rank, world_size, local_rank)
        env_port = int(environ["MASTER_PORT"]) if environ.get("MASTER_PORT", "").isdigit() else None
        port_from = "--master_port" if port is not None else "MASTER_PORT"
        agent_store = environ.get(AGENT_STORE_VAR) == "True"  # as torch.distributed.rendezvous reads it
        if port is None and (world_size > 1 or agent_store):
            port = env_port or DEFAULT_PORT  # every process must agree: the launcher's port
        elif port is None:
            port = env_port if env_port not in (None, DEFAULT_PORT) else free_port()
            port_from = "MASTER_PORT" if port == env_port else "free"
        env = {"MASTER_PORT": str(port)}
        if "MASTER_ADDR" not in environ:
            env["MASTER_ADDR"] = "127.0.0.1"
        addr = environ.get("MASTER_ADDR", "127.0.0.1")
        wait = rendezvous_timeout(environ)
        return DistEnv(True, rank, world_size, local_rank, port, env, port_from, addr, wait, agent_store)
    port_from = "--master_port" if port is not None else "free"
    if port is None:
        env_port = environ.get("MASTER_PORT", "")
        if env_port.isdigit() and int(env_port) != DEFAULT_PORT:
            port, port_from = int(env_port), "MASTER_PORT"
        else:
            port = free_port()
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(gpu_id), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    return DistEnv(False, 0, 1, gpu_id, port, env, port_from, addr, rendezvous_timeout(environ))


def destroy_process_group() -> None:
    """End this process's process group, once training returned normally.

    diffusion-pipe's train.py never calls ``destroy_process_group``. With gloo, a process that exits
    with its group alive can abort in interpreter finalization ("terminate called without an active
    exception", SIGABRT: gloo's worker threads still hold work whose tensors need the GIL; see
    pytorch/pytorch#190489): one of two ranks did so in about one CI run in ten, after training and
    saving had finished. Not called after an exception: destroying a group while a peer is still inside
    a collective can hang (pytorch/torchtitan#1342)."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def group_alive() -> bool:
    """Whether this process has a torch.distributed process group (never imports torch to find out)."""
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and distributed.is_available() and distributed.is_initialized()


def end_with_group_alive(code: int) -> None:
    """A run that ends with its process group still alive (it failed, was stopped, or train.py quit early, as
    ``--cache_only`` does): end the process now with ``code``; without a group, return.

    The group cannot be destroyed safely then (a peer may be inside a collective, or gone), and a process that
    leaves it alive can abort in interpreter finalization instead of exiting with ``code`` ("terminate called
    without an active exception", SIGABRT from gloo's threads; see :func:`destroy_process_group`): a CI run saw it
    after a peer was killed mid-step. So the process ends with ``os._exit`` after what a normal exit would keep:

    - the ``atexit`` handlers (logging's flush, ``weakref.finalize`` clean-ups among them), run through the
      interpreter's own ``atexit._run_exitfuncs`` (private, but it is what exit runs, and there is no public way);
    - the Python-level buffers of files the run left open, and of TensorBoard writers (diffusion-pipe's flushes
      every 120 s): :func:`_flush_open_files`; then stdout and stderr.

    Skipped: the interpreter's teardown (module globals' ``__del__``, the joins of non-daemon threads), which is
    where the abort happens. DGLS's own clean-up does not depend on it: the swapper's removal ran on the way out,
    shared segments are unlinked once mapped, and disk-tier files have no name."""
    if not group_alive():
        return
    atexit._run_exitfuncs()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _flush_open_files() -> None:
    """Flush every writable file object and TensorBoard ``SummaryWriter`` still open (best effort: one that fails
    to flush, a closed pipe say, is left as a normal exit would leave it)."""
    import gc
    import io

    tensorboard = sys.modules.get("torch.utils.tensorboard")
    kinds = (io.IOBase, getattr(tensorboard, "SummaryWriter", io.IOBase))
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some objects warn on (torch's reduce_op)
        if not issubclass(kind, kinds):
            continue
        try:
            if not issubclass(kind, io.IOBase) or (not obj.closed and obj.writable()):
                obj.flush()
        except (OSError, ValueError):
            pass
