"""Peers: the processes of one training job on this machine, and the host memory they share.

Data-parallel training runs one process per GPU, each holding the same model. Each would pack (and
pin) its own copy of every streamed layer's master: N copies of the model in RAM for N GPUs. Instead
the first rank on each machine (its *leader*) packs the masters into files under ``/dev/shm``, and
the other ranks on the machine map those files and register them for pinned copies too, so host RAM
does not grow with the number of GPUs.

Protocol (every rank builds its swapper in lockstep, over the same layer list):

1. agree: every rank learns its machine's leader and a token that names this job's files
   (``all_gather_object`` over the default process group). Only processes that host the same layers
   share: the same ``group`` (the pipeline stage) and the same layout signature (class names and
   sizes of the layers they host); pipeline stages on one machine each get their own leader and files.
   Each rank also says whether ``/dev/shm`` has room for its leader's files, measured before the exchange
   (so before anything is written): if any sharing rank found none, every rank refuses (:mod:`.shm_space`);
2. the leader creates and fills one file per layer it hosts: ``dgls-<token>-<layer>``;
3. barrier; the other ranks of the machine map the files;
4. barrier; the leader unlinks them. From here on a segment lives exactly as long as a process maps
   it, so a rank that crashes or is stopped (Ctrl-C, SIGKILL) leaves nothing behind in ``/dev/shm``.

A machine is its host name and the launcher's node rank (:func:`machine_name`): the processes one launcher
started on one node share, and two nodes never do, even where a test puts both on one host.

Hazard: between steps 2 and 4 (start-up only) a crash of the leader would leave its files. Their names
carry the leader's PID; :func:`remove_orphans` (run by every leader first) deletes files whose leader
is no longer running.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import DGLSUserError
from .shm_space import SHM, shm_problem

PREFIX = "dgls-"
# The node rank each launcher gives its processes: torchrun's (torch.distributed.run) and deepspeed's launch.py.
NODE_RANK_KEYS = ("GROUP_RANK", "CROSS_RANK")


def machine_name(environ: Mapping[str, str], host: str) -> str:
    """The machine a process shares its host copy on: ``host`` (its host name), and the node rank its launcher
    gave it (``host#node1``) when the launcher names one. On several machines the host names differ anyway; two
    launcher nodes on one host (a test of several machines on one) then each keep their own copy, as two
    machines would, instead of one copy shared across what the job counts as two nodes."""
    for key in NODE_RANK_KEYS:
        if environ.get(key, "").isdigit():
            return f"{host}#node{int(environ[key])}"
    return host


@dataclass
class Peers:
    """This process's place among the job's processes on its machine."""

    local_ranks: int = 1  # processes of this job on this machine (1: nothing to share)
    leader: bool = True  # this process packs the masters
    token: str = ""  # names this job's files: "<leader pid>-<random>"
    pids: dict[int, int] = field(default_factory=dict)  # rank -> process id, of the processes sharing with this one
    # every set of two or more processes of the job that share a copy (on any machine), the same on every rank: the
    # groups of shared fetches (:mod:`.fetch_share`) are made from it, by every rank in one order
    sets: tuple[tuple[int, ...], ...] = ()
    _segments: list[mmap.mmap] = field(default_factory=list)
    _created: list[Path] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        return self.local_ranks > 1

    @classmethod
    def discover(cls, group: str = "", signature: str = "", nbytes: int = 0) -> Peers:
        """The processes of a ``torch.distributed`` job on this machine that host the same layers (``group``,
        ``signature``); a single process when torch.distributed is not initialized. Every rank must call it.
        ``nbytes``: what a leader would write to ``/dev/shm``. Each rank checks the room there before the
        exchange (before any leader writes), and if any rank that would share found none, every rank of the
        job raises the same :class:`DGLSUserError` (:mod:`.shm_space`)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not SHM.is_dir():
            return cls()
        problem = shm_problem(nbytes, SHM)
        mine = (
            machine_name(os.environ, socket.gethostname()),
            group,
            signature,
            dist.get_rank(),
            os.getpid(),
            secrets.token_hex(4),
            problem,
        )
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if problems := sharing_problems(everyone):
            raise DGLSUserError(problems[0])
        here = sorted((e for e in everyone if e[:3] == mine[:3]), key=lambda e: e[3])
        leader = here[0]
        pids = {e[3]: e[4] for e in here}
        return cls(
            local_ranks=len(here),
            leader=leader[3] == mine[3],
            token=f"{leader[4]}-{leader[5]}",
            pids=pids,
            sets=sharing_sets(everyone),
        )

    def barrier(self) -> None:
        if self.shared:
            torch.distributed.barrier()

    def running(self, rank: int) -> bool:
        """Whether the process of ``rank`` (one sharing with this one) still runs."""
        return _running(self.pids[rank])

    # ---------------------------------------------------------------- segments
    def path(self, key: int | str) -> Path:
        return SHM / f"{PREFIX}{self.token}-{key}"

    def create(self, key: int | str, nbytes: int) -> torch.Tensor:
        """The leader: a new shared segment of ``nbytes`` (page-aligned, zero-filled) as uint8."""
        path = self.path(key)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._created.append(path)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            return self._map(fd, nbytes)
        finally:
            os.close(fd)

    def attach(self, key: int | str, nbytes: int) -> torch.Tensor:
        """Another local rank: the leader's segment for ``key``."""
        fd = os.open(self.path(key), os.O_RDWR)
        try:
            return self._map(fd, nbytes)
        finally:
            os.close(fd)

    def _map(self, fd: int, nbytes: int) -> torch.Tensor:
        segment = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._segments.append(segment)  # kept mapped as long as this process lives (tensors view it)
        return torch.frombuffer(segment, dtype=torch.uint8)[:nbytes]

    def close(self) -> None:
        """Unmap the segments nothing views anymore (the rest go when the process ends)."""
        kept = []
        for segment in self._segments:
            try:
                segment.close()
            except BufferError:  # a tensor still views it
                kept.append(segment)
        self._segments = kept

    def unlink_created(self) -> None:
        """The leader, once every local rank has mapped its files: take the names away (see the module doc)."""
        for path in self._created:
            path.unlink(missing_ok=True)
        self._created.clear()


class Others(NamedTuple):
    """The job's other processes on this machine, as a RAM check counts them (:func:`others_on_machine`)."""

    need: int = 0  # bytes they need, together
    count: int = 0  # how many of them need any
    holdings: int = 0  # bytes they hold besides (packed copies, state made later): the room optional spares leave


NO_OTHERS = Others()  # a process alone on its machine (or one whose check counts every share itself)


def others_on_machine(need: int, extra: int = 0) -> Others:
    """What the job's other processes on this machine need of its host RAM beside this one's ``need`` (bytes), how
    many of them need any, and the sum of their ``extra`` (what they hold beside their need: their packed copies, the
    state made later; for sizing what is optional): processes that each train their own layers (pipeline stages) draw
    on one host's RAM, so each RAM check counts them all. Every rank must call it (``all_gather_object`` over the
    default group, where every rank builds or fixes its plan in lockstep); none in a single process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return NO_OTHERS
    here = machine_name(os.environ, socket.gethostname())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (here, dist.get_rank(), int(need), int(extra)))
    others = [(n, x) for machine, rank, n, x in everyone if machine == here and rank != dist.get_rank() and n > 0]
    return Others(sum(n for n, _ in others), len(others), sum(x for _, x in others))


def sharing_sets(everyone: list[tuple]) -> tuple[tuple[int, ...], ...]:
    """Every set of two or more ranks that share a copy (the same machine, group and signature), from every rank's
    ``discover`` entry: sorted, the same on every rank."""
    sets: dict[tuple, list[int]] = {}
    for e in everyone:
        sets.setdefault(e[:3], []).append(e[3])
    return tuple(sorted(tuple(sorted(ranks)) for ranks in sets.values() if len(ranks) > 1))


def sharing_problems(everyone: list[tuple]) -> list[str]:
    """The /dev/shm problems found by ranks that would share (others on their machine host the same layers),
    from every rank's ``discover`` entry: the same list on every rank."""
    machines = Counter(e[:3] for e in everyone)
    return sorted({e[-1] for e in everyone if e[-1] and machines[e[:3]] > 1})


def remove_orphans() -> list[Path]:
    """Delete DGLS segments left by a leader that is no longer running (a crash during start-up)."""
    removed = []
    for path in SHM.glob(f"{PREFIX}*") if SHM.is_dir() else []:
        try:
            pid = int(path.name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if not _running(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
