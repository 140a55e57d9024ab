"""The processes of a job meet before DeepSpeed starts: a missing rank is one line naming it, within the wait
(``DGLS_RENDEZVOUS_TIMEOUT``), instead of torch's silent 10-minute wait.

The ranks here are threads of this process (each with its own store client, as a process would have), with a
1 s wait; the whole program meets a missing peer in-process through dgls_train.py's entry point. Launches
of several real processes, which go through the same meeting, are in test_multi_process.py (slow).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
from cli_helpers import FAKE, demo_toml, fake_config, run_in_process, snapshot

from utils.dgls.errors import DGLSUserError
from utils.dgls.program.distributed import LAUNCHER_KEYS, RENDEZVOUS_VAR, DistEnv, free_port
from utils.dgls.program.rendezvous import peers_arrived

WAIT_S = 1.0


def job(rank: int, world_size: int, port: int) -> DistEnv:
    return DistEnv(True, rank, world_size, rank, port, {}, "MASTER_PORT", "127.0.0.1", WAIT_S)


def meet(ranks: list[int], world_size: int, port: int | None = None, inside=None) -> dict[int, tuple[str, float]]:
    """Each rank in its own thread: 'ok' or its one line, and how long it took; ``inside(rank, port)`` runs
    within the meeting, as the process group's start-up does."""
    port = port or free_port()
    said: dict[int, tuple[str, float]] = {}

    def run(rank: int) -> None:
        start = time.monotonic()
        try:
            with peers_arrived(job(rank, world_size, port)):
                if inside is not None:
                    inside(rank, port)
                said[rank] = ("ok", time.monotonic() - start)
        except DGLSUserError as exc:
            said[rank] = (str(exc), time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return said


def test_every_rank_here_meets_at_once_and_the_process_group_shares_rank_0s_server():
    everyone = threading.Barrier(3)

    def torch_rendezvous(rank: int, port: int) -> None:
        """What torch's env:// rendezvous makes on each rank: its store binds the same port in rank 0's process;
        then, as the process group's start-up does, every rank waits for the others."""
        from torch.distributed import TCPStore

        TCPStore("127.0.0.1", port, 3, rank == 0, timedelta(seconds=5), wait_for_workers=False, multi_tenant=True)
        everyone.wait(10)

    said = meet([0, 1, 2], 3, inside=torch_rendezvous)
    assert {rank: text for rank, (text, _) in said.items()} == {0: "ok", 1: "ok", 2: "ok"}
    assert max(seconds for _, seconds in said.values()) < WAIT_S


def test_rank_0_names_the_ranks_that_did_not_arrive_and_so_do_the_ranks_that_did():
    said = meet([0, 1], 4)
    for rank in (0, 1):
        text, seconds = said[rank]
        assert text.startswith("rank(s) 2, 3 of the 4 processes (WORLD_SIZE=4) did not arrive within 1 s: "), text
        assert "deepspeed --num_gpus=4" in text and f"{RENDEZVOUS_VAR} sets the wait" in text
        assert WAIT_S <= seconds < WAIT_S + 5


def test_a_rank_without_rank_0_says_so_within_the_wait():
    port = free_port()
    (text, seconds) = meet([1], 2, port)[1]
    assert text.startswith(f"rank 1 of 2 found no rank 0 at 127.0.0.1:{port} within 1 s: start rank 0 as well"), text
    assert seconds < WAIT_S + 2


# The program that is not a torch store, and every connection it accepted, open until the test process ends: the
# meeting gives up on torch's client, whose thread goes on waiting and connecting again; a connection closed or reset
# under it makes torch log the reset with its C++ stack, outside any test's capture.
_HELD_OPEN: list[socket.socket] = []


def _accept_forever(listener: socket.socket) -> None:
    while True:
        _HELD_OPEN.append(listener.accept()[0])


def test_a_port_held_by_a_program_that_is_not_a_torch_store_is_named():
    """torch's own client waits forever there; the meeting gives up after its wait."""
    other = socket.socket()
    _HELD_OPEN.append(other)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    threading.Thread(target=_accept_forever, args=(other,), daemon=True).start()
    text, seconds = meet([1], 2, port)[1]
    assert text.startswith(f"rank 1 of 2: 127.0.0.1:{port} accepts connections but does not answer"), text
    assert f"another training run on port {port}?" in text and seconds < WAIT_S + 4
    text = meet([0], 2, port)[0][0]  # rank 0 cannot listen there either
    assert text.startswith(f"port {port} is in use by another program"), text


def test_a_one_process_job_meets_no_one():
    with peers_arrived(DistEnv(False, 0, 1, 0, free_port())):
        pass


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """A launcher's variables for a job of 2 of which only this process started (the test's folder current)."""
    saved = dict(os.environ)
    for key in (*LAUNCHER_KEYS, "MASTER_ADDR", "DGLS_DIFFUSION_PIPE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv(RENDEZVOUS_VAR, str(WAIT_S))
    monkeypatch.chdir(tmp_path)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_demo_started_alone_in_a_job_of_two_is_one_line_within_the_wait(rank, tmp_path, launched, capsys):
    launched.setenv("RANK", str(rank))
    launched.setenv("LOCAL_RANK", str(rank))
    argv = ["--config", str(demo_toml(tmp_path))]
    before = snapshot(tmp_path)
    start = time.monotonic()
    code, _out, err = run_in_process(argv, capsys)
    assert code == 2 and err.count("\n") == 1, err
    expected = "rank(s) 1 of the 2 processes" if rank == 0 else "rank 1 of 2 found no rank 0"
    assert err.startswith(f"dgls: error: {expected}"), err
    assert time.monotonic() - start < 20 and snapshot(tmp_path) == before


def test_the_drop_in_started_alone_in_a_job_of_two_is_one_line_before_train_py(tmp_path, launched, capsys):
    launched.setenv("RANK", "1")
    launched.setenv("LOCAL_RANK", "1")
    argv = ["--config", str(fake_config(tmp_path)), "--diffusion_pipe", str(FAKE)]
    code, _out, err = run_in_process(argv, capsys)
    assert code == 2 and err.startswith("dgls: error: rank 1 of 2 found no rank 0 at 127.0.0.1:"), err
    assert os.getcwd() == str(tmp_path), "train.py's checkout is entered only once the job has met"


def test_under_torchrun_its_agent_holds_the_port_and_has_gathered_the_processes():
    """torchrun's agent serves the job's store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): that busy port
    is not refused, a one-process job keeps it (torch's clients connect there), and DGLS meets no one."""
    from utils.dgls.program.distributed import dist_env
    from utils.dgls.program.rendezvous import check_port

    with socket.socket() as agent:
        agent.bind(("127.0.0.1", 0))
        agent.listen()
        port = agent.getsockname()[1]
        for world_size in (1, 2):
            environ = {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "MASTER_PORT": str(port)}
            job = dist_env({**environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}, 0, False)
            assert job.agent_store and job.port == port
            check_port(job)
            with peers_arrived(job):
                pass
