"""Several machines, as one machine can show them: two launcher nodes on one host (torchrun --nnodes=2, one
invocation per node rank, the static rendezvous at 127.0.0.1), CPU and gloo.

Each node keeps its own host copy of the streamed weights, shared by its own processes only
(utils/dgls/memory/peers.py: a machine is its host name and the launcher's node rank), as two machines would;
the LoRA demo trains what one process trains with the same global batch; a data-parallel full fine-tune, which
needs every process to map one host copy, is refused with one line on every process of both nodes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import demo_toml, python_cmd, user_env
from conftest import ROOT
from safetensors.torch import load_file
from test_multi_process import assert_same_training, demo_lora

from utils.dgls.memory.peers import PREFIX, SHM, machine_name
from utils.dgls.program.distributed import free_port

NODES, PER_NODE = 2, 2


def test_a_machine_is_its_host_name_and_the_launchers_node_rank():
    assert machine_name({}, "gpu7") == "gpu7"
    assert machine_name({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "gpu7") == "gpu7#node1"  # torchrun
    assert machine_name({"CROSS_RANK": "0", "LOCAL_SIZE": "2"}, "gpu7") == "gpu7#node0"  # deepspeed's launch.py
    assert machine_name({"GROUP_RANK": "0"}, "h") != machine_name({"GROUP_RANK": "1"}, "h")
    assert machine_name({"GROUP_RANK": ""}, "h") == "h"


def launch_nodes(config: Path, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Both nodes' torchrun invocations at once (each waits for the other at the rendezvous)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={NODES}",
                f"--node_rank={node}",
                f"--nproc_per_node={PER_NODE}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(ROOT / "dgls_train.py"),
                "--config",
                str(config),
            ],
            cwd=ROOT,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(NODES)
    ]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def ours() -> set[str]:
    return {p.name for p in SHM.glob(f"{PREFIX}*")} if SHM.is_dir() else set()


@pytest.mark.slow  # 2 x 2 processes with torch and deepspeed, and a one-process run: about a minute on 2 cores
def test_two_nodes_on_one_host_each_share_their_own_copy_and_train_what_one_process_trains(tmp_path):
    before = ours()
    one, one_out = demo_lora(tmp_path / "one", python_cmd(), batch_size=8)
    config = demo_toml(tmp_path / "two", steps=3, batch_size=8 // (NODES * PER_NODE))
    nodes = launch_nodes(config)
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, f"node {node}: {(proc.stdout + proc.stderr)[-3000:]}"
    (run_dir,) = [p for p in (tmp_path / "two" / "out").iterdir() if p.is_dir()]
    (saved,) = run_dir.glob("*.safetensors")
    out = nodes[0].stdout
    assert_same_training(load_file(str(saved)), one, out, one_out)
    # rank 0 speaks for its machine: its node's 2 processes share one copy, not the job's 4
    assert f"one copy shared by the {PER_NODE} processes on this machine" in out
    assert "step 3: loss" not in nodes[1].stdout, "rank 0 alone prints the steps"
    assert ours() <= before, "a node left shared segments behind"


@pytest.mark.slow  # 2 x 2 processes start, then stop at the check: about 10-20 s on 2 cores
def test_a_data_parallel_full_fine_tune_over_two_nodes_is_one_line_on_every_process(tmp_path):
    config = demo_toml(tmp_path, steps=2, batch_size=2, base="demo_full.toml")
    expected = (
        "dgls: error: data-parallel full fine-tuning runs on one machine, where the processes share one host copy "
        f"of the streamed layers, and the {NODES * PER_NODE} processes of this job share a host copy "
        f"{PER_NODE} by {PER_NODE}"
    )
    nodes = launch_nodes(config)
    for node, proc in enumerate(nodes):
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if line.startswith("dgls: ")]
        assert len(lines) == PER_NODE and all(line.startswith(expected) for line in lines), (node, lines)
