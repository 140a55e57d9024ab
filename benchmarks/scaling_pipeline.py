"""One process of bench_scaling.py's pipeline rows: a stage of ONE model, as diffusion-pipe runs ``pipeline_stages``.

The bench's layer list (flux.py, wan.py) goes into DeepSpeed's ``PipelineModule`` (partitioned as diffusion-pipe's
default, by trainable parameters), ``deepspeed.initialize`` and ``train_batch``, with DGLS taking over each stage's
layers as the demo and the drop-in do (:class:`utils.dgls.trainers.pipeline_hook.StageHook`): each process places
and streams its own stage's layers under its own GPU's budget (or memory cap), from a host copy of its stage alone.

- The model is built on the meta device in every process; a stage gives weights (random, on its GPU) to its own
  layers only, when DeepSpeed has built it and before DGLS places it: no process holds another stage's weights.
- A step is ``train_batch``: ``micro_batches`` micro-batches of one sample through the stages (DeepSpeed's 1F1B
  schedule: stages overlap only across micro-batches), then every stage's optimizer step. DeepSpeed's config is
  diffusion-pipe's (no bf16 section, gradient clipping 1.0): the LoRA trains in the bench's dtype with AdamW, as
  the data-parallel rows' does.
- DeepSpeed 0.18.5 to 0.19.8 run a stage's backward once per floating tensor the stage sends on (``out.backward`` for
  each, graph retained); 0.18.4 (diffusion-pipe's pin) runs one ``torch.autograd.backward`` over them all. Where two of
  them come out of the whole stage (Flux's image and text streams), 0.19.8 runs the stage's backward, recomputation
  and weight copies twice. ``--one_backward`` runs each step under the product's joined backward
  (utils/dgls/trainers/joined_backward.py, as the demo and diffusion-pipe runs with several stages do): one backward
  per stage and micro-batch, as 0.18.4's; without it the bench measures the installed DeepSpeed's own pass.
- The wrappers below only make the bench's layers fit between stages (every tensor passed on is contiguous and, if
  floating, has a gradient to send back); what a layer computes is the bench's.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from models import materialize
from torch import nn


# ---------------------------------------------------------------- the layers between stages
class StageFirst(nn.Module):
    """The embedding layer: its floating outputs that carry no gradient (rotary tables, the timestep embedding
    of frozen weights) are made leaves that take one: DeepSpeed runs a backward from every floating tensor a stage
    sends on, and that refuses a tensor without a gradient."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        outputs = tuple(t.contiguous() for t in self.layer(inputs))
        if torch.is_grad_enabled():
            for t in outputs:
                if t.is_floating_point() and not t.requires_grad:
                    t.requires_grad_(True)
        return outputs


class StageBlock(nn.Module):
    """A block: its outputs contiguous (the Flux blocks return slices of the joint stream), since a stage sends
    its last block's outputs to the next stage whole."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        return tuple(t.contiguous() for t in self.layer(inputs))


class StageLast(nn.Module):
    """The output layer: it reads two of the tensors the blocks pass on, and the others get a zero gradient, so a
    stage holding this layer alone still sends one back for every floating input (DeepSpeed asserts each)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        out = self.layer(inputs)
        untouched = [t.sum().float() for t in inputs if t.is_floating_point() and t.requires_grad]
        return out + 0 * torch.stack(untouched).sum().to(out.dtype) if untouched else out


def stage_layers(layers: list[nn.Module]) -> list[nn.Module]:
    """The bench's layer list as PipelineModule layers: first, blocks, last."""
    return [StageFirst(layers[0]), *(StageBlock(layer) for layer in layers[1:-1]), StageLast(layers[-1])]


def give_weights(layers: list, start: int, device: torch.device, dtype: torch.dtype, train_all: bool = False) -> None:
    """The stage's meta weights made real on ``device`` (:func:`models.materialize`), each layer's from a seed of
    its own (its index in the whole list: every layout trains the same model), its LoRA trainable again (B zero, as
    a fresh LoRA's); ``train_all`` (a full fine-tune): every weight trainable."""
    for index, layer in enumerate(layers, start):
        if not isinstance(layer, nn.Module):
            continue
        materialize([layer], device, dtype, seed=index)
        if train_all:
            layer.requires_grad_(True)
        for name, p in layer.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)
                if "lora_B" in name:
                    p.data.zero_()


def batches(bench) -> Iterator[tuple]:
    """The bench's one sample, every micro-batch (the first stage takes the inputs, the last the target)."""
    while True:
        yield bench.inputs, bench.target


# ---------------------------------------------------------------- one stage's process
def init_distributed(rank: int, world: int, port: str, cuda: bool) -> None:
    """DeepSpeed's process group over this job's processes (one per stage), as its launcher would set it up."""
    import deepspeed

    from utils.dgls.trainers.shm_op import without_shm_op

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    with without_shm_op():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)


def build_engine(
    args,
    bench,
    device: torch.device,
    dtype: torch.dtype,
    stages: int,
    config_for: Callable[[list[nn.Module]], object],
    log,
    train_all: bool = False,
):
    """The PipelineModule of ``stages`` stages over the bench's layers, this process's stage placed by DGLS
    (``config_for(stage layers)``: its SwapConfig), and DeepSpeed's engine; (engine, swapper). ``train_all``: a full
    fine-tune (every weight trained: DeepSpeed's optimizer gets them all, as train.py's does, and the stage's
    streamed ones train on the host, :func:`host_training_hooks`)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from torch.utils.checkpoint import checkpoint

    from utils.dgls import LayerSwapper
    from utils.dgls.trainers.pipeline_hook import StageHook

    placed = {}

    def install(stage):
        give_weights(stage.layers, stage.start, device, dtype, train_all)
        config = config_for(stage.layers).for_stage(stage.start, stage.stop, stage.layer_count)
        placed["swapper"] = LayerSwapper(
            stage.layers, config, device=device, log=lambda line: log(stage.label + line), share_group=stage.share_group
        )
        return placed["swapper"]

    layers = stage_layers(bench.layers)
    with StageHook(install):
        pipeline = PipelineModule(
            layers=layers,
            num_stages=stages,
            loss_fn=lambda out, target: F.mse_loss(out.float(), target.float()),
            partition_method=args.partition,
            activation_checkpoint_interval=1,
            activation_checkpoint_func=partial(checkpoint, use_reentrant=False),
            checkpointable_layers=[StageBlock.__name__],
        )
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": args.micro_batches,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    trained = [p for p in pipeline.parameters() if p.requires_grad]
    spec = placed["swapper"].config.training.host_optimizer  # a full fine-tune: the class train.py builds for its table
    optimizer = spec.trainer_optimizer(trained) if spec is not None else torch.optim.AdamW(trained, lr=1e-5)
    engine, _, _, _ = deepspeed.initialize(model=pipeline, optimizer=optimizer, config=ds_config)
    return engine, placed["swapper"]


def host_training_hooks(swapper):
    """A full fine-tune's stage: DGLS's hooks on DeepSpeed's engine (:class:`utils.dgls.trainers.engine_hooks
    .EngineHooks`: one gradient norm over the engine's and the host's params, then the host updates with the
    trainer's step), as the demo and dgls_train.py install them; a LoRA's: nothing."""
    from utils.dgls.trainers.engine_hooks import EngineHooks

    training = swapper.training
    return EngineHooks(lambda module: training) if training is not None else contextlib.nullcontext()


def step_order(engine, swapper):
    """A step's micro-batches layer-major where the stage's config says so (a full fine-tune on one stage, as
    dgls_train.py runs it: :func:`utils.dgls.trainers.layer_major_batches.layer_major_batches`); otherwise as
    DeepSpeed's schedule runs them."""
    from utils.dgls.trainers.layer_major_batches import layer_major_batches

    if swapper.config.placement.layer_major_micro_batches > 1:
        return layer_major_batches(engine, swapper)
    return contextlib.nullcontext()


def stage_step(engine, bench, losses: list[float], swapper, joined: bool = False, log=None) -> Callable[[], float]:
    """One training step (``train_batch``), returning its loss (the micro-batches' mean, on every stage) and
    adding it to ``losses`` (every step's, untimed ones too). Each step is one step for the stage's ``swapper``
    (:func:`~utils.dgls.trainers.interleaved_steps.train_batch_block`: with several stages the planner re-places layers
    between steps only), as in the demo and diffusion-pipe's ``train_batch``. ``joined`` (``--one_backward``): each
    step under the product's :func:`~utils.dgls.trainers.joined_backward.joined_backward`, as the demo and
    diffusion-pipe's ``train_batch`` run it with several stages (``log``: the stage's, told once)."""
    from utils.dgls.trainers import interleaved_steps
    from utils.dgls.trainers.joined_backward import SaidOnce, joined_backward

    data = batches(bench)
    said = SaidOnce(log or (lambda line: None))  # the block is entered every step

    def step() -> float:
        with joined_backward(engine, said.log) if joined else contextlib.nullcontext():
            with interleaved_steps.train_batch_block(engine, swapper):
                losses.append(engine.train_batch(data_iter=data).item())
        return losses[-1]

    return step


def timed_steps(
    step: Callable[[], float], steps: int, sync, dist, thread_cpu: list[float] | None = None
) -> list[float]:
    """``steps`` steps, each started together by every stage (a barrier) and timed to its device's end;
    ``thread_cpu``: each step's CPU seconds of this (the training) thread appended (its sync's spin included)."""
    times = []
    for _ in range(steps):
        sync()
        dist.barrier()
        start, cpu = time.perf_counter(), time.thread_time()
        step()
        sync()
        times.append(time.perf_counter() - start)
        if thread_cpu is not None:
            thread_cpu.append(time.thread_time() - cpu)
    return times


def tight_budget_gib(layers: list) -> float:
    """As :meth:`models.Bench.tight_budget_gib`, for a stage's own layers (the tiny models' budget)."""
    from utils.dgls.memory.layout import measure

    sizes = [layout.sizes for layout in measure(layers)]
    fixed = sum(s.fixed_bytes for s in sizes)
    return (fixed + 2.5 * max(s.streamable_bytes for s in sizes)) / 2**30
