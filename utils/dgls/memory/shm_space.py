"""Room in ``/dev/shm`` for the host copy that the processes of a job on one machine share, checked
before anything is written there.

Data-parallel processes on one machine keep one copy of the streamed layers' weights, in files under
``/dev/shm`` (:mod:`.peers`). Without room there they failed without a word: with ``/dev/shm``
read-only the first process could not create its files while the others waited for it (a hang),
and with ``/dev/shm`` smaller than the weights (Docker's default is 64 MB) the first process died of
SIGBUS while filling them (tmpfs finds the pages when they are written, not when a file is sized).
So:

- :func:`check_before_start`, before DeepSpeed starts: a job whose processes will share (several on
  this machine, data parallel, layers streamed) needs a writable ``/dev/shm``;
- :func:`shm_problem`, from ``Peers.discover`` once the layers are known: every process checks the
  room for the bytes its machine's first process will write, *before* the exchange that starts the
  sharing (so before anything is written), and every process of the job refuses if any one found a
  problem: one line each, and none waits on a peer that stopped.

Invariants: the checks only read (``statvfs``, ``access``); a machine without ``/dev/shm`` is no
problem here (the processes then keep their own copies, :meth:`.peers.Peers.discover`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DGLSUserError
from .layout import human_bytes

if TYPE_CHECKING:  # the job's processes, as the caller read them
    from ..program.distributed import DistEnv

SHM = Path("/dev/shm")
WHO = "the processes of this job on this machine share the streamed layers' weights through files there"


def shm_problem(nbytes: int, folder: Path = SHM, statvfs: Callable[[Path], os.statvfs_result] = os.statvfs) -> str:
    """Why ``folder`` cannot take ``nbytes`` of new shared files, as a line that says what to do; ""
    when it can (or when there is no such folder). ``nbytes`` 0: only whether files can be created."""
    if not folder.is_dir():
        return ""
    try:
        st = statvfs(folder)
    except OSError as exc:
        return f"{folder} cannot be read ({exc.strerror}), and {WHO}: fix {folder}, or start one process per machine"
    if st.f_flag & os.ST_RDONLY or not os.access(folder, os.W_OK):
        return (
            f"{folder} is read-only, and {WHO}: make it writable (as root: mount -o remount,rw {folder}), or start "
            "one process per machine"
        )
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return (
            f"{folder} has {human_bytes(free)} free, and {WHO} ({human_bytes(nbytes)}): make it at least "
            f"{human_bytes(used + nbytes)} (Docker: --shm-size; otherwise as root: mount -o remount,size=... "
            f"{folder}), or free it, or start one process per machine"
        )
    return ""


def local_processes(environ: Mapping[str, str]) -> int | None:
    """Processes of this job on this machine, as the launcher tells them (deepspeed: LOCAL_SIZE,
    torchrun: LOCAL_WORLD_SIZE); None when it does not say."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return None


def check_before_start(
    dist: DistEnv,
    stages: int,
    streaming: bool,
    environ: Mapping[str, str],
    folder: Path = SHM,
    statvfs: Callable[[Path], os.statvfs_result] = os.statvfs,
) -> None:
    """Before DeepSpeed starts: refuse a job that will share its host copy through a ``folder`` where no
    file can be created. Sharing needs several data-parallel processes (``world_size / stages``) on this
    machine and streamed layers; a launcher that does not say how many processes run here is left to
    the check at ``Peers.discover``."""
    local = local_processes(environ)
    if not streaming or local is None or local < 2 or dist.world_size // stages < 2:
        return
    if problem := shm_problem(0, folder, statvfs):
        raise DGLSUserError(problem)
