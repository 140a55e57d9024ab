"""The processes of a job meet before DeepSpeed starts, so that a missing one is one line, not a silent wait.

torch's ``env://`` rendezvous (inside ``deepspeed.init_distributed``: the demo's, and diffusion-pipe's
train.py's) waits for every rank as long as the process group's timeout (DeepSpeed's default: 10 minutes
in 0.19, 30 in 0.18; ``DEEPSPEED_TIMEOUT``) and says nothing meanwhile; a busy port is a
``DistNetworkError`` traceback. That timeout also bounds every collective of the run (the other ranks wait
at a barrier while rank 0 saves), so it is not the one to shorten. DGLS meets first, at the job's own
MASTER_ADDR and MASTER_PORT, with a short wait of its own (``DGLS_RENDEZVOUS_TIMEOUT``, 30 s by default):

* rank 0 hosts torch's TCPStore server on the port, multi-tenant, as torch's own rendezvous does: the
  process group's store, made later in the same process, shares that server (the port is bound once);
* every rank sets its key; rank 0 waits for all of them and then sets ``go``, or the list of the ranks
  that did not come, which every rank then names in its one line;
* the other ranks first wait until something listens on the port (a plain socket: torch's client logs a
  C++ stack on every failed try), then connect in a helper thread (torch's client waits forever on a port
  that accepts but does not answer as a TCPStore), then wait for ``go``.

Invariants:

* every wait polls from the main thread in short steps, so Ctrl-C and SIGTERM stop it at once;
* the store lives until :func:`peers_arrived` exits: the caller starts the process group inside it;
* a one-process job meets no one and binds nothing here (:func:`check_port` checks its port up front);
  nor does a job under torchrun, whose agent serves the store on MASTER_PORT and started every process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from ..errors import DGLSUserError
from .distributed import DEFAULT_PORT, RENDEZVOUS_VAR, DistEnv

PREFIX = "dgls_rendezvous/"  # the keys of this meeting; the process group's own keys have other prefixes
POLL_S = 0.05


def _port_in_use(port: int) -> bool:
    """True if another process listens on ``port``: the address TCPStore binds (IPv4, every interface,
    SO_REUSEADDR, so a connection that is merely closing does not count). A store server of this process (an
    earlier run in it, as tests make) does not count: torch's multi-tenant store shares it."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
            return False
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    mine = psutil.Process().net_connections(kind="tcp")
    return not any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in mine)


def busy_port_message(dist: DistEnv) -> str:
    """What to do about a port another program holds, by where the port came from."""
    port = dist.port
    head = f"port {port} is in use by another program (another training run?)"
    if dist.port_from == "--master_port":
        fix = "pass a free port with --master_port" + (
            "" if dist.world_size > 1 else ", or drop it (a free one is picked)"
        )
        return f"{head}: {fix}"
    if dist.port_from == "MASTER_PORT" and dist.launched and dist.world_size > 1:
        return (
            f"{head}; it is MASTER_PORT, which the deepspeed launcher sets from its --master_port (default "
            f"{DEFAULT_PORT}): launch with deepspeed --master_port N, a free port N"
        )
    if dist.port_from == "MASTER_PORT":
        return (
            f"{head}; it is the environment's MASTER_PORT: set a free one, or unset MASTER_PORT (a free one is picked)"
        )
    return f"port {port}, which DGLS picked as free, was taken meanwhile: run again"


def check_port(dist: DistEnv) -> None:
    """Up front, on the process that will host the job's store (rank 0): its port is free (under torchrun,
    its agent holds it)."""
    if dist.rank == 0 and not dist.agent_store and _port_in_use(dist.port):
        raise DGLSUserError(busy_port_message(dist))


def _quiet_fd2(call: Callable[[], Any]) -> Any:
    """``call()`` with file descriptor 2 on /dev/null: torch's TCPStore logs a C++ stack trace on stderr
    before each error it raises (a peer gone), which DGLS turns into one line itself."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                return call()
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _wait_until(deadline: float, ready: Callable[[], bool]) -> bool:
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def _client(dist: DistEnv, deadline: float):
    """A TCPStore client of rank 0's server, connected in a helper thread (see the module docstring)."""
    from torch.distributed import TCPStore

    made: dict[str, Any] = {}

    def connect() -> None:
        try:
            wait = timedelta(seconds=max(deadline - time.monotonic(), 1))
            # wait_for_workers=False: this client does not count in torch's own "every worker connected" tally
            made["store"] = TCPStore(dist.addr, dist.port, dist.world_size, False, wait, wait_for_workers=False)
        except Exception as exc:  # torch's DistError: reported from the main thread
            made["error"] = exc

    thread = threading.Thread(target=connect, name="dgls-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive() and time.monotonic() < deadline + 1:
        thread.join(POLL_S)
    return made.get("store")


def _unreached(dist: DistEnv, seconds: float) -> DGLSUserError:
    return DGLSUserError(
        f"rank {dist.rank} of {dist.world_size} found no rank 0 at {dist.addr}:{dist.port} within {seconds:g} s: start "
        "rank 0 as well (deepspeed --num_gpus=N ... starts every rank), or set MASTER_ADDR and MASTER_PORT to where it "
        f"runs; {RENDEZVOUS_VAR} sets the wait in seconds"
    )


def _foreign(dist: DistEnv, seconds: float, what: str) -> DGLSUserError:
    return DGLSUserError(
        f"rank {dist.rank} of {dist.world_size}: {dist.addr}:{dist.port} {what} within {seconds:g} s, so it is not "
        f"this job's rank 0 (another training run on port {dist.port}?): launch with deepspeed --master_port N, a "
        "free port N"
    )


def _missing_message(dist: DistEnv, missing: list[int], seconds: float) -> str:
    names = ", ".join(str(r) for r in missing)
    return (
        f"rank(s) {names} of the {dist.world_size} processes (WORLD_SIZE={dist.world_size}) did not arrive within "
        f"{seconds:g} s: start every rank (deepspeed --num_gpus={dist.world_size} ... starts them all), or check "
        f"that they reach {dist.addr}:{dist.port} (MASTER_ADDR, MASTER_PORT); {RENDEZVOUS_VAR} sets the wait in seconds"
    )


def _host(dist: DistEnv, seconds: float):
    """Rank 0: serve, wait for every rank, say go (or who is missing)."""
    from torch.distributed import DistError, TCPStore

    try:
        store = TCPStore(
            dist.addr,
            dist.port,
            dist.world_size,
            True,
            timedelta(seconds=seconds),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except DistError as exc:
        if "EADDRINUSE" in str(exc):
            raise DGLSUserError(busy_port_message(dist)) from None
        raise
    store.set(f"{PREFIX}0", "1")
    keys = [f"{PREFIX}{r}" for r in range(dist.world_size)]
    if not _wait_until(time.monotonic() + seconds, lambda: store.check(keys)):
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        store.set(f"{PREFIX}missing", ",".join(map(str, missing)))
        # the ranks that came read that before this process (and its server) ends, to name the missing too
        heard = [f"{PREFIX}heard/{r}" for r in range(1, dist.world_size) if r not in missing]
        _wait_until(time.monotonic() + 2, lambda: store.check(heard))
        raise DGLSUserError(_missing_message(dist, missing, seconds))
    store.set(f"{PREFIX}go", "1")
    return store


def _join(dist: DistEnv, seconds: float):
    """Another rank: find rank 0, say here, wait for go."""
    from torch.distributed import DistError

    deadline = time.monotonic() + seconds
    if not _wait_until(deadline, lambda: _listening(dist.addr, dist.port)):
        raise _unreached(dist, seconds)
    store = _client(dist, deadline)
    if store is None:
        raise _foreign(dist, seconds, "accepts connections but does not answer as a torch.distributed store")
    try:
        _quiet_fd2(lambda: store.set(f"{PREFIX}{dist.rank}", "1"))
        # rank 0 listened before this rank connected, so it gives up before this wait ends: this rank hears who
        # was missing
        said = lambda: _quiet_fd2(lambda: store.check([f"{PREFIX}go"]) or store.check([f"{PREFIX}missing"]))  # noqa: E731
        if not _wait_until(time.monotonic() + seconds + 5, said):
            raise _foreign(dist, seconds, "answers but never let this job start")
        if not _quiet_fd2(lambda: store.check([f"{PREFIX}go"])):
            missing = [int(r) for r in _quiet_fd2(lambda: store.get(f"{PREFIX}missing")).decode().split(",")]
            _quiet_fd2(lambda: store.set(f"{PREFIX}heard/{dist.rank}", "1"))
            raise DGLSUserError(_missing_message(dist, missing, seconds))
    except DistError:
        raise DGLSUserError(
            f"rank {dist.rank} of {dist.world_size}: rank 0 stopped before the job started (its own output says why)"
        ) from None
    return store


@contextlib.contextmanager
def peers_arrived(dist: DistEnv) -> Iterator[None]:
    """Return once every process of the job is here (or raise one line saying who is not); start the
    process group inside the block. Nothing to do for a one-process job, nor under torchrun (its agent
    started every process, and serves the store)."""
    if dist.world_size == 1 or dist.agent_store:
        yield
        return
    store = _host(dist, dist.rendezvous_s) if dist.rank == 0 else _join(dist, dist.rendezvous_s)
    try:
        yield
    finally:
        del store  # the process group's own store keeps rank 0's server from here on
