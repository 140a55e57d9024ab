"""A pipeline stage's backward once for all the tensors it sends on (utils/dgls/trainers/joined_backward.py).

Fast: DeepSpeed's own ``_exec_backward_pass`` run on a stand-in stage (the attributes the pass reads; its class's
instruction map is ``PipelineEngine``'s) whose checkpointed layer counts its recomputes and whose outputs are three
tensors of the whole stage, as the demo's first stage sends on (image, text, timestep vector). Slow: the demo in two
pipeline stages under the deepspeed launcher (gloo), against DeepSpeed's own pass and one process.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from cli_helpers import python_cmd
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils.dgls.trainers import joined_backward as jb

pipe_engine = pytest.importorskip("deepspeed.runtime.pipe.engine")
schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")

per_tensor = pytest.mark.skipif(
    not jb.backward_per_tensor(), reason="the installed DeepSpeed's pass runs one backward already (up to 0.18.4)"
)


class Block(nn.Module):
    """Image, text and vector in and out, each output depending on all the inputs; counts its forwards."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.img, self.txt, self.vec = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.runs = 0

    def forward(self, img, txt, vec):
        self.runs += 1
        mix = img.mean(1, keepdim=True) + txt.mean(1, keepdim=True) + vec
        return torch.tanh(self.img(img) + mix), torch.tanh(self.txt(txt) + mix), torch.tanh(self.vec(vec) + mix)


class Stage:
    """What DeepSpeed's ``_exec_backward_pass`` reads of a first stage of two (not partitioned, no bf16 optimizer)."""

    _INSTRUCTION_MAP = pipe_engine.PipelineEngine._INSTRUCTION_MAP
    num_stages = 2
    is_pipe_partitioned = is_grad_partitioned = using_bf16_optimizer = False

    def __init__(self, last: bool = False) -> None:
        self.blocks = [Block(1), Block(2)]
        self.optimizer = object()
        self.last = last
        self.pipe_buffers = {"outputs": [None], "output_tensors": [None]}
        self.grad_layer = None
        self._running_engine_backward = False

    def is_last_stage(self) -> bool:
        return self.last

    def wall_clock_breakdown(self) -> bool:
        return False

    def params(self) -> list[torch.Tensor]:
        return [p for b in self.blocks for p in b.parameters()]

    def forward(self, inputs):
        x = inputs
        for block in self.blocks:
            x = checkpoint(block, *x, use_reentrant=False)
        self.pipe_buffers["outputs"][0] = x
        return x

    def recomputes(self) -> int:
        return sum(b.runs for b in self.blocks) - len(self.blocks)  # less each block's forward


def inputs():
    torch.manual_seed(0)
    return tuple(torch.randn(2, 3, 8) for _ in range(2)) + (torch.randn(2, 1, 8),)


def received(outputs):
    torch.manual_seed(1)
    return tuple(torch.randn_like(o) for o in outputs)


def backward_of(stage: Stage, how: str) -> tuple[list[torch.Tensor], int]:
    """The stage's forward, then its backward from the received gradients: 'joined' (under joined_backward),
    'deepspeed' (DeepSpeed's own pass) or 'one' (one torch.autograd.backward over them all, as 0.18.4's);
    (parameter gradients, recomputes)."""
    outputs = stage.forward(inputs())
    grads = received(outputs)
    stage.grad_layer = grads
    if how == "one":
        torch.autograd.backward(outputs, grads)
    elif how == "deepspeed":
        type(stage)._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
    else:
        with jb.joined_backward(stage, log=lines.append):
            stage._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
        assert "_INSTRUCTION_MAP" not in vars(stage), "the engine's own attribute is gone after the block"
        assert stage.grad_layer is grads, "the receive buffers are the engine's again"
    if how != "one":
        assert stage.pipe_buffers["outputs"][0] is None, "DeepSpeed's pass freed the outputs"
    return [p.grad.clone() for p in stage.params()], stage.recomputes()


lines: list[str] = []


@per_tensor
def test_a_stage_sending_three_tensors_recomputes_each_layer_once_with_the_gradients_of_one_backward():
    lines.clear()
    joined, joined_runs = backward_of(Stage(), "joined")
    deepspeeds, deepspeed_runs = backward_of(Stage(), "deepspeed")
    one, one_runs = backward_of(Stage(), "one")
    assert (joined_runs, one_runs, deepspeed_runs) == (2, 2, 6), "each block recomputed once, not once per tensor"
    assert all(torch.equal(a, b) for a, b in zip(joined, one, strict=True)), "0.18.4's single backward, bitwise"
    gap = max((a - b).abs().max().item() for a, b in zip(joined, deepspeeds, strict=True))
    assert gap <= 1e-6 * max(b.abs().max().item() for b in deepspeeds), "DeepSpeed's: up to summation order"
    (line,) = lines
    assert "backward runs once for the 3 tensors it sends on" in line and "one backward per tensor" in line


@per_tensor
def test_the_stage_says_it_once_per_block_and_the_drop_in_once_a_run_not_once_a_step():
    """The block says its line at its first joined backward (the demo enters it once a run); diffusion-pipe's
    wrapper enters it every step and passes the log only until it was told."""
    from utils.dgls.program.options import OPTIONS
    from utils.dgls.trainers.diffusion_pipe import PipelineInterception

    lines.clear()
    stage = Stage()
    with jb.joined_backward(stage, log=lines.append):
        for _ in range(2):
            outputs = stage.forward(inputs())
            stage.grad_layer = received(outputs)
            stage._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
    assert len(lines) == 1
    lines.clear()
    interception = PipelineInterception({o.name: o.default for o in OPTIONS}, log=lines.append)
    stage.micro_batches = 4
    for _ in range(3):  # three steps
        with interception._layer_major(stage):
            outputs = stage.forward(inputs())
            stage.grad_layer = received(outputs)
            stage._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
    assert len(lines) == 1 and "backward runs once for the 3 tensors" in lines[0]


def test_where_it_does_not_apply_the_engine_keeps_deepspeeds_pass():
    """The last stage, a partitioned pipeline, one stage: nothing of the engine changes inside the block."""
    last, partitioned, alone = Stage(last=True), Stage(), Stage()
    partitioned.is_pipe_partitioned = True
    alone.num_stages = 1
    for stage in (last, partitioned, alone):
        with jb.joined_backward(stage):
            assert "_INSTRUCTION_MAP" not in vars(stage)


@per_tensor
def test_the_drop_ins_train_batch_joins_the_backward_of_a_first_stage_of_two():
    """PipelineInterception's train_batch wrapper: with several stages (layer-major does not apply), the step runs
    under joined_backward (the engine's own instruction map, removed after)."""
    from utils.dgls.program.options import OPTIONS
    from utils.dgls.trainers.diffusion_pipe import PipelineInterception

    lines.clear()
    interception = PipelineInterception({o.name: o.default for o in OPTIONS}, log=lines.append)
    stage = Stage()
    stage.micro_batches = 4
    with interception._layer_major(stage):
        assert schedule.BackwardPass in vars(stage)["_INSTRUCTION_MAP"]
        outputs = stage.forward(inputs())
        stage.grad_layer = received(outputs)
        stage._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
    assert "_INSTRUCTION_MAP" not in vars(stage) and stage.recomputes() == 2 and len(lines) == 1


class Bf16Optimizer:
    """What DeepSpeed's pass calls of its bf16 optimizer on a stage that is not the last."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def clear_lp_grads(self) -> None:
        self.calls.append("clear")

    def update_hp_grads(self, clear_lp_grads: bool) -> None:
        self.calls.append("update")


@per_tensor
def test_the_bf16_optimizers_calls_around_the_backward_stay_deepspeeds_once_per_micro_batch():
    stage = Stage()
    stage.using_bf16_optimizer, stage.optimizer = True, Bf16Optimizer()
    stage._config = types.SimpleNamespace(bfloat16_config=types.SimpleNamespace(immediate_grad_update=False))
    _, runs = backward_of(stage, "joined")
    assert runs == 2 and stage.optimizer.calls == ["clear", "update"]


@per_tensor
def test_a_single_output_or_outputs_without_gradients_go_to_deepspeeds_pass_as_they_came():
    """A tensor alone runs DeepSpeed's single-tensor branch with its own gradient; a float output that takes no
    gradient is left out of the joined sum (the other two still run one backward)."""
    stage = Stage()
    out = stage.forward(inputs())[0]
    stage.pipe_buffers["outputs"][0] = out
    stage.grad_layer = grad = torch.randn_like(out)
    with jb.joined_backward(stage):
        stage._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
    assert stage.grad_layer is grad and stage.recomputes() == 2
    reference = Stage()
    out = reference.forward(inputs())[0]
    out.backward(grad)
    pairs = list(zip(stage.params(), reference.params(), strict=True))
    assert all((a.grad is None) == (b.grad is None) for a, b in pairs)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs if a.grad is not None)

    stage = Stage()
    outputs = stage.forward(inputs())
    stage.pipe_buffers["outputs"][0] = (*outputs[:2], outputs[2].detach())
    stage.grad_layer = received(outputs)
    with jb.joined_backward(stage):
        stage._INSTRUCTION_MAP[schedule.BackwardPass](stage, 0)
    assert stage.recomputes() == 2


# ---------------------------------------------------------------- the demo in two stages, under the launcher
def streamed(out: str) -> str:
    (summary,) = [line for line in out.splitlines() if line.startswith("DGLS demo finished")]
    return summary.split("; streamed ")[1].split(";")[0]


@pytest.mark.slow  # three launches, each 20-60 s on 2 cores
@per_tensor
def test_the_demos_first_stage_runs_one_backward_for_what_it_sends_on(tmp_path):
    """Two stages, a pool of two for three streamed layers a stage (--prefetch 1: every backward copies them again):
    with the joined backward the run streams fewer bytes than under DeepSpeed's own pass (which recomputes stage 1
    and copies its layers once per tensor it sends on: three); the losses as printed are the same, and the LoRA is
    one process's bitwise (DeepSpeed's own pass: equal up to summation order, about 1e-5 of the LoRA's scale)."""
    from test_multi_process import assert_same_training, demo_lora
    from test_multi_process import two_processes as launch

    flags = ("--deepspeed", "--prefetch", "1")
    joined, joined_out = demo_lora(tmp_path / "joined", launch("dgls_train.py", *flags), pipeline_stages=2)
    driver = str(Path(__file__).parent / "deepspeeds_backward.py")  # the demo with DeepSpeed's own pass
    own, own_out = demo_lora(tmp_path / "own", launch(driver, *flags), pipeline_stages=2)
    one, one_out = demo_lora(tmp_path / "one", python_cmd("--prefetch", "1"))
    assert "stage 1 of 2 (layers 0-4): DGLS: this stage's backward runs once for the 3 tensors" in joined_out
    assert "backward runs once" not in own_out + one_out
    assert_same_training(joined, own, joined_out, own_out)
    assert_same_training(joined, one, joined_out, one_out)
    assert all(torch.equal(joined[k], one[k]) for k in one), "two stages train one process's LoRA, bitwise"
    sizes = {name: parse_size(streamed(out)) for name, out in (("joined", joined_out), ("own", own_out))}
    assert sizes["joined"] < 0.7 * sizes["own"], sizes  # measured: 6.5 MiB against 12.7 MiB


def parse_size(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.mark.slow  # two launches
@per_tensor
def test_a_drop_in_run_in_two_stages_runs_the_first_stages_backward_once(tmp_path):
    """diffusion-pipe's own train.py (the stand-in checkout) in two stages: each train_batch runs under the joined
    backward (PipelineInterception._layer_major), the first stage says so once, and it trains what one process
    trains, bitwise."""
    from conftest import ROOT
    from test_multi_process import assert_same_training, fake_losses, fake_run, two_processes

    one, one_out = fake_run(tmp_path / "one", python_cmd(), "micro_batch_size_per_gpu = 4")
    launch = two_processes(str(ROOT / "dgls_train.py"), "--deepspeed")
    stages, out = fake_run(tmp_path / "pp", launch, "micro_batch_size_per_gpu = 4\npipeline_stages = 2")
    (line,) = [x for x in out.splitlines() if "DGLS: this stage's backward runs once for the" in x]
    assert line.startswith("stage 1 of 2 (layers 0-"), line
    assert_same_training(stages, one, fake_losses(out), fake_losses(one_out))
    assert all(torch.equal(stages[k], one[k]) for k in one), "bitwise, as the demo's"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_the_demo_in_two_stages_on_two_gpus_streams_less_with_the_joined_backward(tmp_path):
    """On two GPUs (NCCL): the joined backward against DeepSpeed's own pass and one GPU: fewer bytes streamed, the
    same training up to the GPUs' reduction order. In fp32: in bf16 the two runs' LoRAs ended 2.6% of their scale
    apart (H200), which the passes' different rounding of the summed gradients (one autograd sum against two
    accumulations), grown by AdamW to lr x steps, allows; the bf16 scalar is bitwise one backward's (the CPU test
    below)."""
    from test_multi_process import assert_close_training, demo_lora, two_processes

    flags = ("--deepspeed", "--prefetch", "1")
    driver = str(Path(__file__).parent / "deepspeeds_backward.py")  # the demo with DeepSpeed's own pass
    runs = {}
    for name, script in (("joined", "dgls_train.py"), ("own", driver)):
        launch = two_processes(script, *flags)
        runs[name] = demo_lora(tmp_path / name, launch, pipeline_stages=2, device="cuda")
    (joined, joined_out), (own, own_out) = runs["joined"], runs["own"]
    one, one_out = demo_lora(tmp_path / "one", python_cmd("--prefetch", "1"), device="cuda")
    assert "DGLS: this stage's backward runs once for the 3 tensors" in joined_out
    assert_close_training(joined, own, joined_out, own_out, 5e-3)
    assert_close_training(joined, one, joined_out, one_out, 5e-3)
    assert parse_size(streamed(joined_out)) < 0.7 * parse_size(streamed(own_out))


def test_the_joined_scalar_hands_each_output_its_received_gradient_itself_in_bf16():
    """JoinedOutputs: each output's gradient is the received buffer (same storage: no copy, no cast), and the
    parameter gradients are one torch.autograd.backward's, bitwise, in bf16."""
    torch.manual_seed(0)
    weight = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.bfloat16)

    def outputs():
        h = x @ weight
        return h * 2, h.tanh()

    a, b = outputs()
    grads = (torch.randn_like(a), torch.randn_like(b))
    torch.autograd.backward((a, b), grads)
    expected, weight.grad = weight.grad.clone(), None
    a, b = outputs()
    seen = []
    a.register_hook(lambda g: seen.append(g.data_ptr()))
    b.register_hook(lambda g: seen.append(g.data_ptr()))
    joined = jb.JoinedOutputs.apply(grads, a, b)
    assert joined.dtype == torch.float32 and joined.item() == 0.0
    joined.backward(torch.ones_like(joined))
    assert torch.equal(weight.grad, expected)
    assert sorted(seen) == sorted(g.data_ptr() for g in grads), "the received buffers themselves"
