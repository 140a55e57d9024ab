"""Several processes under the deepspeed launcher, on the CPU with gloo (the launch line users type).

Data parallel: N processes with per-process batch B train what one process trains with batch N x B
(each takes its rows of the global batch; gradients are averaged). Pipeline stages: each process
streams its own stage's layers. Either way the losses of every step are the same as one process's,
and the LoRA is the same up to the order of summation: gradients averaged over processes, a gradient
norm summed over stages, gradients of the tensors every block passes on (the timestep vector) summed
on both sides of a stage boundary. Adam turns last-bit differences of near-zero gradients into
differences of about 1e-4 of the LoRA's scale after a few steps, which is the tolerance here. Per
step, rank 0 alone prints the stats of every process together. The one shared host copy and the
clean-up after a killed rank are in test_peers_cpu.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import FAKE, deepspeed_cmd, demo_toml, fake_config, python_cmd, run_user_command
from conftest import ROOT
from safetensors.torch import load_file

from utils.dgls.program.distributed import free_port

pytestmark = pytest.mark.slow  # each launch starts 1-2 Python processes with torch and deepspeed: 20-60 s


def two_processes(*args: str) -> list[str]:
    """The deepspeed launcher's command for 2 processes on a free port (29500 may be another run's)."""
    return deepspeed_cmd("--num_gpus=2", f"--master_port={free_port()}", *args)


def demo_lora(folder: Path, launch: list[str], **demo) -> tuple[dict, str]:
    config = demo_toml(folder, steps=3, **demo)
    proc = run_user_command([*launch, "--config", str(config)], ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (run_dir,) = [p for p in (folder / "out").iterdir() if p.is_dir()]
    (saved,) = run_dir.glob("*.safetensors")  # adapter_model (LoRA) or model (full fine-tune)
    return load_file(str(saved)), proc.stdout


def assert_same_training(a: dict, b: dict, a_out: str, b_out: str) -> None:
    """The same losses at every step (as printed), and LoRAs equal up to summation order (see the module doc)."""
    assert a.keys() == b.keys() and a
    scale = max(v.abs().max().item() for v in b.values())
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-3 * scale
    losses = [
        [line.split("loss ")[1].split(",")[0] for line in out.splitlines() if line.startswith("step ")]
        for out in (a_out, b_out)
    ]
    assert losses[0] == losses[1] and losses[0], losses


def test_demo_data_parallel_trains_what_one_process_trains_with_the_global_batch(tmp_path):
    one, one_out = demo_lora(tmp_path / "one", python_cmd(), batch_size=8)
    two, out = demo_lora(tmp_path / "two", two_processes("dgls_train.py", "--deepspeed"), batch_size=4)
    assert_same_training(two, one, out, one_out)
    assert out.count("step 3: loss") == 1, "rank 0 alone prints the steps"
    assert "one copy shared by the 2 processes on this machine" in out


@pytest.mark.parametrize("base", ["demo.toml", "demo_full.toml"])
def test_demo_data_parallel_with_shared_fetches_trains_bitwise_what_it_trains_without(tmp_path, base):
    """``share_fetch = "on"`` (each process copies half of every streamed layer and gathers the other half over gloo:
    utils/dgls/memory/fetch_share.py), the LoRA and the data-parallel full fine-tune (each process updating its share
    of the layers, every fetch gathered from both): the saved weights and every step's loss are those of the same
    two processes copying whole layers."""
    import toml

    table = toml.loads((ROOT / "toml" / base).read_text())["dgls"]
    runs = {}
    for mode in ("off", "on"):
        launch = two_processes("dgls_train.py", "--deepspeed")
        runs[mode] = demo_lora(tmp_path / mode, launch, base=base, dgls={**table, "share_fetch": mode})
    (off, off_out), (on, on_out) = runs["off"], runs["on"]
    runs_out = (off_out, on_out)
    assert "each of the 2 data-parallel processes on this machine copies 1/2" in on_out
    assert "shared fetches" not in off_out
    assert off.keys() == on.keys() and all(torch.equal(off[k], on[k]) for k in off)
    losses = [[line.split(",")[0] for line in out.splitlines() if line.startswith("step ")] for out in runs_out]
    assert losses[0] == losses[1] and losses[0]


def test_demo_pipeline_stages_stream_their_own_layers_and_train_exactly(tmp_path):
    one, one_out = demo_lora(tmp_path / "one", python_cmd())
    two, out = demo_lora(tmp_path / "two", two_processes("dgls_train.py", "--deepspeed"), pipeline_stages=2)
    assert_same_training(two, one, out, one_out)
    assert "stage 1 of 2 (layers 0-4):" in out and "stage 2 of 2 (layers 5-9):" in out
    # DeepSpeed's CPU allreduce buffers (66 MB each, never unlinked by DeepSpeed) never appear
    # (utils/dgls/trainers/shm_op.py)
    assert not list(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*_29500_*"))


def test_demo_pipeline_stages_under_a_vram_budget_re_place_layers_between_steps_only(tmp_path):
    """Two stages, 4 micro-batches a step: DeepSpeed's schedule runs stage 1's forward of micro-batch 2 before its
    backward of micro-batch 1. The planner measures other placements from step 3 (swap units checkpointed or not);
    re-placed between those micro-batches, micro-batch 1's recompute ran under another placement than its forward
    (torch's CheckpointError). Re-placed between steps (utils/dgls/trainers/interleaved_steps.py), the stages train
    what one process trains."""
    steps, demo = 6, {"gradient_accumulation_steps": 4, "dgls": {"vram_budget": 0.002}}
    runs = []
    for name, launch, stages in (
        ("one", python_cmd(), {}),
        ("two", two_processes("dgls_train.py", "--deepspeed"), {"pipeline_stages": 2}),
    ):
        config = demo_toml(tmp_path / name, steps=steps, **demo, **stages)
        proc = run_user_command([*launch, "--config", str(config)], ROOT)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        (saved,) = (tmp_path / name / "out").glob("*/adapter_model.safetensors")
        runs.append((load_file(str(saved)), proc.stdout))
    (one, one_out), (two, out) = runs
    assert_same_training(two, one, out, one_out)
    plans = [line for line in out.splitlines() if line.startswith("stage 1 of 2") and "DGLS plan (" in line]
    assert len(plans) >= 2, out  # stage 1 measured other placements during the run


def test_demo_full_fine_tune_in_pipeline_stages_trains_what_one_process_trains(tmp_path):
    """Every weight trains; each stage keeps its streamed layers' masters and AdamW state on the host, and the
    clipping norm is summed over the stages: the same losses and weights (up to summation order) as one
    process."""
    one, one_out = demo_lora(tmp_path / "one", python_cmd(), base="demo_full.toml")
    two, out = demo_lora(
        tmp_path / "two",
        two_processes("dgls_train.py", "--deepspeed"),
        base="demo_full.toml",
        pipeline_stages=2,
    )
    assert_same_training(two, one, out, one_out)
    assert out.count("DGLS host training:") == 2, "each stage trains its own streamed layers on the host"


def test_demo_full_fine_tune_data_parallel_trains_what_one_process_trains_with_the_global_batch(tmp_path):
    """Two processes on one stage: each updates its share of the streamed layers over the one shared host copy
    (utils/dgls/training/data_parallel.py), each saves the layers it owns; the same losses (the global batch's
    mean, as printed) and weights as one process with the global batch."""
    one, one_out = demo_lora(tmp_path / "one", python_cmd(), base="demo_full.toml", batch_size=8)
    two, out = demo_lora(
        tmp_path / "two",
        two_processes("dgls_train.py", "--deepspeed"),
        base="demo_full.toml",
        batch_size=4,
    )
    assert_same_training(two, one, out, one_out)
    assert "DGLS data parallel: each of the 2 processes updates its share" in out
    assert out.count("step 3: loss") == 1, "rank 0 alone prints the steps"


def assert_close_training(a: dict, b: dict, a_out: str, b_out: str, tolerance: float) -> None:
    """On GPUs: losses and weights within ``tolerance`` of their scale (the reduction order of NCCL and cuBLAS)."""
    assert a.keys() == b.keys() and a
    scale = max(v.abs().max().item() for v in b.values())
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= tolerance * scale
    losses = [
        [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("step ")]
        for out in (a_out, b_out)
    ]
    assert len(losses[0]) == len(losses[1]) > 0
    assert all(abs(x - y) <= tolerance * max(abs(y), 1.0) for x, y in zip(*losses)), losses


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("base", ["demo.toml", "demo_full.toml"])
def test_demo_data_parallel_on_two_gpus_trains_what_one_gpu_trains_with_the_global_batch(tmp_path, base):
    """The LoRA (DeepSpeed's gradient all-reduce over NCCL) and the full fine-tune (each GPU's process updates its
    share of the streamed layers; their gradients reduced to the owner over NCCL), against one GPU."""
    one, one_out = demo_lora(tmp_path / "one", python_cmd(), base=base, batch_size=8, device="cuda")
    two, out = demo_lora(
        tmp_path / "two",
        two_processes("dgls_train.py", "--deepspeed"),
        base=base,
        batch_size=4,
        device="cuda",
    )
    assert_close_training(two, one, out, one_out, 5e-3)  # AdamW: noise of zero-in-theory gradients, to lr x steps
    assert "one copy shared by the 2 processes on this machine" in out


def test_demo_pipeline_stages_offloading_activations_train_what_one_process_trains(tmp_path):
    """--offload_activations under the launcher: each stage's pipeline module gets the wrapped checkpoint
    function of its own swapper; the losses and LoRA are one process's, and the step lines count both
    stages' activations."""
    one, one_out = demo_lora(tmp_path / "one", python_cmd())
    launch = two_processes("dgls_train.py", "--deepspeed", "--offload_activations")
    two, out = demo_lora(tmp_path / "two", launch, pipeline_stages=2)
    assert_same_training(two, one, out, one_out)
    assert "activations home" in out


def fake_run(folder: Path, launch: list[str], top: str) -> tuple[dict, str]:
    config = fake_config(folder, top="max_steps = 3\n" + top)
    proc = run_user_command([*launch, "--config", str(config), "--diffusion_pipe", str(FAKE), "--verbose"], folder)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lora = {}
    for path in sorted((folder / "out").glob("lora*.safetensors")):
        lora.update(load_file(str(path)))
    return lora, proc.stdout


def fake_losses(out: str) -> str:
    """The stand-in's losses as lines the way the demo prints them (for assert_same_training)."""
    facts = json.loads(next(x for x in out.splitlines() if x.startswith("FAKE_TRAIN "))[len("FAKE_TRAIN ") :])
    return "\n".join(f"step {i}: loss {loss:.6f}, x" for i, loss in enumerate(facts["losses"], 1))


def test_drop_in_data_parallel_and_pipeline_stages_on_the_stand_in_checkout(tmp_path):
    dgls = str(ROOT / "dgls_train.py")
    one, one_out = fake_run(tmp_path / "one", python_cmd(), "micro_batch_size_per_gpu = 4")
    dp, out = fake_run(tmp_path / "dp", two_processes(dgls, "--deepspeed"), "micro_batch_size_per_gpu = 2")
    assert_same_training(dp, one, fake_losses(out), fake_losses(one_out))
    assert out.count("dgls step 3:") == 1, "rank 0 alone prints the stats (of both processes)"
    stages, out = fake_run(
        tmp_path / "pp",
        two_processes(dgls, "--deepspeed"),
        "micro_batch_size_per_gpu = 4\npipeline_stages = 2",
    )
    assert_same_training(stages, one, fake_losses(out), fake_losses(one_out))
    assert "stage 2 of 2" in out


def test_drop_in_with_more_pipeline_stages_than_layers_is_one_line_on_every_process(tmp_path):
    """The stand-in's model made 2 layers, split over 3 stages: every process stops with the line that names
    pipeline_stages, before any of them communicates (before: the empty stage's 'the layer list is empty', and
    gloo tracebacks on the others). A process the launcher stops first, once another failed, says so instead."""
    config = fake_config(tmp_path, top="pipeline_stages = 3\nfake_model = {double_blocks = 0, single_blocks = 0}")
    cmd = deepspeed_cmd("--num_gpus=3", f"--master_port={free_port()}", str(ROOT / "dgls_train.py"), "--deepspeed")
    proc = run_user_command([*cmd, "--config", str(config), "--diffusion_pipe", str(FAKE)], tmp_path)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    expected = (
        "dgls: error: pipeline_stages = 3 leaves pipeline stage(s) 3 of 3 without any of the model's 2 layers: set "
        "pipeline_stages lower in the training TOML (2 at most)"
    )
    stopped = "dgls: terminated (SIGTERM) before training started; nothing was saved"
    lines = proc.stderr.splitlines()
    assert expected in lines and set(lines) <= {expected, stopped}, proc.stderr
