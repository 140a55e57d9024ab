"""Several processes of one job on a machine keep one host copy of the masters (gloo; CPU, and one GPU).

Each rank is a separate process (tests/fixtures/shared_masters_rank.py) that builds the same model
and a swapper: the first packs the masters into /dev/shm, the other maps them, and the names are
removed as soon as both have mapped them, so nothing is left behind even when a rank is killed.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from helpers import assert_bitwise_equal, child_env, make_layers, train

from utils.dgls.memory import peers

RANK = ROOT / "tests" / "fixtures" / "shared_masters_rank.py"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def start_ranks(tmp_path, world=2, *extra):
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(RANK), str(r), str(world), port, str(tmp_path), *extra],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def run_two_ranks(tmp_path, *extra):
    procs = start_ranks(tmp_path, 2, *extra)
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_two_ranks_map_one_copy_of_the_masters_and_train_exactly(tmp_path):
    ranks = run_two_ranks(tmp_path)
    reference = train(*make_layers(), torch.device("cpu"), "nonreentrant", steps=2)
    for rank in ranks:
        assert_bitwise_equal(reference, rank["record"])
        assert rank["named"] == [], "segments must lose their names once every rank has mapped them"
        assert not rank["versioned"]  # a LoRA's shared copy never changes: no versions segment
    assert ranks[0]["maps"] == ranks[1]["maps"] and len(ranks[0]["maps"]) > 0
    masters = ranks[0]["masters"]["bytes"]
    assert all(r["masters"]["rss"] >= masters for r in ranks), [r["masters"] for r in ranks]  # each reads all ...
    assert sum(r["masters"]["pss"] for r in ranks) < 1.3 * masters  # ... but together they hold it once


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_pin_the_same_shared_pages(tmp_path):
    """cudaHostRegister on a shared mapping, from two processes: both copy from the one host copy."""
    ranks = run_two_ranks(tmp_path, "--cuda")
    assert all(rank["pinned"] for rank in ranks) and ranks[0]["maps"] == ranks[1]["maps"]
    assert_bitwise_equal(ranks[0]["record"], ranks[1]["record"])
    assert sum(r["masters"]["pss"] for r in ranks) < 1.3 * ranks[0]["masters"]["bytes"]


@pytest.mark.slow  # starts processes (or probes and measures plans): the default run stays within 4 minutes
def test_a_killed_rank_leaves_no_segment_behind(tmp_path):
    procs = start_ranks(tmp_path, 2, "--hold")
    deadline = time.time() + 300
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.2)
    token = (tmp_path / "ready0").read_text()
    assert token
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert not list(peers.SHM.glob(f"dgls-{token}-*"))


def test_segments_of_a_leader_that_died_during_start_up_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = peers.SHM / f"dgls-{int(dead.stdout)}-feed-1"
    alive = peers.SHM / f"dgls-{os.getpid()}-feed-1"
    orphan.write_bytes(b"x")
    alive.write_bytes(b"x")
    try:
        assert orphan in peers.remove_orphans()
        assert not orphan.exists() and alive.exists()
    finally:
        orphan.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)
