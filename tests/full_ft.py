"""Full fine-tuning loops: DGLS with the host optimizer, and the same training without streaming.

The reference trains the same layers all resident, with the same arithmetic DGLS promises: params that
DGLS trains on the host (those of streamed layers) get fp32 masters, their per-micro-batch grads are
summed in fp32 (the first copied, as autograd assigns a first grad), one norm over every param in the
order given clips host and device grads alike, and the host optimizer (the same implementation, built
by the same spec) steps the masters, whose compute-dtype copies the next forward uses. The other params
train with the trainer's optimizer on the device, as in DGLS; with ``whole_step`` one instance of the host spec's
class steps every param, as train.py's one optimizer does and DGLS's whole step promises: the masters of
host-trained params, and copies of the others beside the masters (in their own dtype; on the CPU, the same numbers as
the params themselves), given the params' clipped gradients and written back after the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from helpers import SMALL, run_layers

from utils.dgls.demo.data import SyntheticLatents
from utils.dgls.demo.model import build_layers
from utils.dgls.training.host_optimizer import HostOptimizerSpec
from utils.dgls.training.host_training import grad_norms
from utils.dgls.training.update_split import UpdateSplit

SPEC = HostOptimizerSpec(lr=1e-2, weight_decay=0.01, implementation="torch")
FUSED = dataclasses.replace(SPEC, implementation="torch_fused")  # torch.optim.AdamW(fused=True) on the host
DEVICE = dataclasses.replace(SPEC, implementation="device")  # AdamW steps on the training device (--host_adam device)
SPLIT = dataclasses.replace(SPEC, implementation="split")  # each layer on the device or the CPU (--host_adam split)
SGD = HostOptimizerSpec(type="sgd", lr=1e-2, momentum=0.9, weight_decay=0.01, implementation="torch")
SGD_DEVICE = dataclasses.replace(SGD, implementation="device")
MAX_NORM = 0.05  # small enough that clipping acts on every step
NEVER_CLIPS = 1e6  # clipping on, and a coefficient of exactly 1 at every step


def norm_of_step(max_norm, step: int):
    """``max_norm`` as given (None: no clipping), or a list's entry for ``step`` (from 0): steps that clip and
    steps that do not, in one run."""
    return max_norm[step] if isinstance(max_norm, (list, tuple)) else max_norm


def full_layers(dtype=torch.float32, cfg=SMALL):
    layers = build_layers(cfg, seed=0, dtype=dtype)
    for layer in layers:
        layer.requires_grad_(True)
    return layers


def params_of(layers) -> list[torch.nn.Parameter]:
    return [p for layer in layers for p in layer.parameters()]


def loss_of_a_layer_run_twice(layers, swapper) -> torch.Tensor:
    """The loss of one forward of ``layers`` that calls layer 1 twice under reentrant checkpointing, which runs one
    backward per checkpointed call: layer 1's hooks fire twice in the one backward pass the caller runs on it."""
    data = SyntheticLatents(SMALL, samples=2, image_tokens=12, text_tokens=5)
    inputs, target = next(data.batches(2, torch.float32, torch.device("cpu")))
    inputs = (inputs[0].requires_grad_(), *inputs[1:])
    twice = layers[:2] + [layers[1]] + layers[2:]
    assert 1 in swapper.training.layers
    return F.mse_loss(run_layers(twice, inputs, "reentrant"), target)


@dataclass
class FullRecord:
    losses: list
    weights: dict
    evals: list


def _batches(device, dtype, cfg=SMALL):
    data = SyntheticLatents(cfg, samples=8, image_tokens=12, text_tokens=5, seed=3)
    return data.batches(2, dtype, device)


def _forward_backward(layers, inputs, target, mode, checkpoint_fn=None):
    if mode == "reentrant":
        inputs = (inputs[0].requires_grad_(), *inputs[1:])
    loss = F.mse_loss(run_layers(layers, inputs, mode, checkpoint_fn).float(), target.float())
    loss.backward()
    return loss.detach().cpu()


def _weights(layers) -> dict:
    return {
        f"{i}.{k}": v.detach().to("cpu", torch.float32).clone()
        for i, layer in enumerate(layers)
        for k, v in layer.state_dict().items()
    }


def host_trained_names(layers, swapper) -> set[str]:
    """'layer.param' names of the params the swapper trains on the host (what train_reference gives them)."""
    return {
        f"{i}.{n}" for i, layer in enumerate(layers) for n, p in layer.named_parameters() if swapper.training.owns(p)
    }


def train_dgls(
    layers,
    swapper,
    device,
    mode,
    steps=3,
    accumulate=2,
    dtype=torch.float32,
    start_step=0,
    trainer_state=None,
    on_step=None,
    cfg=SMALL,
    max_norm=MAX_NORM,
    checkpoint_fn=None,
    adopt=False,
    before_clip=None,
    stray_grads=None,
    untouched_last=frozenset(),
):
    """Train with a swapper built with ``host_optimizer=SPEC``: resident params by the trainer's optimizer.
    ``start_step``/``trainer_state``: continue a run saved after that many steps; ``on_step(step, trainer)``
    runs after each step; ``checkpoint_fn``: the blocks' checkpoint (e.g. the swapper's, offloading); ``adopt``: the
    trainer hands its params to the host training and, after clipping, its resident params' gradients (as DGLS's
    engine hooks do: a whole step's instance then trains every param, and the trainer's optimizer finds none);
    ``max_norm``: one for every step or a list (:func:`norm_of_step`); ``before_clip(training)``: after a step's
    backward passes, before its norm; ``stray_grads``: {step: value}, a param outside the model whose gradient is
    ``value`` (inf, nan: an overflow) joins that step's norm, last; ``untouched_last``: ``"i.name"`` of params that get
    no gradient in a step's last micro-batch (``requires_grad`` off for it), only in the others."""
    training = swapper.training
    params = params_of(layers)
    if adopt:
        training.adopt(params)
    resident = [p for p in params if not training.owns(p)]
    trainer = SPEC.build(resident) if resident else None
    if trainer_state is not None:
        trainer.load_state_dict(trainer_state)
    batches = _batches(device, dtype, cfg)
    for _ in range(start_step * (accumulate + 1)):
        next(batches)
    losses, evals = [], []
    for step in range(start_step, start_step + steps):
        for micro in range(accumulate):
            inputs, target = next(batches)
            with _frozen(layers, untouched_last if micro == accumulate - 1 else ()):
                losses.append(_forward_backward(layers, inputs, target, mode, checkpoint_fn))
        if before_clip is not None:
            before_clip(training)
        if norm_of_step(max_norm, step) is not None:
            training.clip_grad_norm_(params + _stray(stray_grads, step), norm_of_step(max_norm, step))
        if adopt:
            training.take_resident_grads()
        if trainer is not None:
            trainer.step()
            trainer.zero_grad()
        training.step()
        if on_step is not None:
            on_step(step + 1, trainer)
        with torch.no_grad():
            inputs, _ = next(batches)
            evals.append(run_layers(layers, inputs, mode).cpu())
    return FullRecord(losses, _weights(layers), evals)


def train_reference(
    layers,
    host_names: set[str],
    device,
    mode,
    steps=3,
    accumulate=2,
    dtype=torch.float32,
    cfg=SMALL,
    max_norm=MAX_NORM,
    host_spec=SPEC,
    master_device="cpu",
    update_device=None,
    whole_step=False,
    previous_norm=False,
    stray_grads=None,
    untouched_last=frozenset(),
):
    """The same training without streaming (see the module doc). ``host_names``: ``"i.name"`` of the params
    DGLS trains on the host, with ``host_spec``'s optimizer, masters, sums and their norms on ``master_device``
    (device updates on CUDA: torch's fused AdamW on the GPU, whose kernel they run, and grad norms taken
    there). ``update_device(step, name)``: where that param's update of ``step`` (from 0) runs instead (split
    updates): its master, state and gradient move there for the step (the norms stay on ``master_device``).
    ``whole_step``: one instance of ``host_spec``'s class over every param, in order (see the module doc).
    ``previous_norm``: every step after the first is clipped with the previous step's coefficient (DGLS's
    ``clip_mode = "previous_norm"``), the first with its own, and so is a step after one whose norm is not finite;
    ``stray_grads``, ``untouched_last``: as :func:`train_dgls`'s."""
    named = [(f"{i}.{n}", p) for i, layer in enumerate(layers) for n, p in layer.named_parameters()]
    host = [(n, p) for n, p in named if n in host_names]
    masters = {id(p): p.detach().to(master_device, torch.float32, copy=True) for _, p in host}
    acc: dict[int, torch.Tensor | None] = {id(p): None for _, p in host}
    host_opt = host_spec.build([masters[id(p)] for _, p in host]) if host else None
    device_params = [p for n, p in named if n not in host_names]
    trainer = SPEC.build(device_params) if device_params else None
    copies = {id(p): p.detach().to(master_device, copy=True) for p in device_params} if whole_step else {}
    if whole_step:
        host_opt, trainer = host_spec.build([masters.get(id(p), copies.get(id(p))) for _, p in named]), None
    batches = _batches(device, dtype, cfg)
    losses, evals = [], []
    previous = None  # the last step's coefficient (previous_norm)
    for step in range(steps):
        for micro in range(accumulate):
            inputs, target = next(batches)
            with _frozen(layers, untouched_last if micro == accumulate - 1 else ()):
                losses.append(_forward_backward(layers, inputs, target, mode))
            for _, p in host:
                if p.grad is None:
                    continue
                g = p.grad.detach().to(master_device, torch.float32)
                acc[id(p)] = g.clone() if acc[id(p)] is None else acc[id(p)].add_(g)
                p.grad = None
        norms = []
        for _, p in named:
            if id(p) in acc:
                if acc[id(p)] is not None:
                    norms.append(grad_norms([acc[id(p)]])[0].cpu())
            elif p.grad is not None:
                norms.append(torch.linalg.vector_norm(p.grad.detach().float(), 2).cpu())
        for p in _stray(stray_grads, step):
            norms.append(torch.linalg.vector_norm(p.grad.float(), 2))
        coef = None
        if norm_of_step(max_norm, step) is not None:
            total = torch.stack(norms).square().sum().sqrt()
            limit = torch.tensor(float(norm_of_step(max_norm, step)), dtype=torch.float32)
            coef = torch.clamp(limit / (total + 1e-6), max=1.0)
            if previous_norm:
                coef, previous = (previous if previous is not None else coef), (coef if total.isfinite() else None)
            for p in device_params:
                if p.grad is not None:
                    p.grad.detach().mul_(coef.to(p.grad.device))
        if trainer is not None:
            trainer.step()
            trainer.zero_grad()
        if host_opt is not None:
            with torch.no_grad():
                for n, p in host:
                    g = acc[id(p)]
                    if update_device is not None:
                        g = _move_for_update(host_opt, masters[id(p)], g, update_device(step, n))
                    masters[id(p)].grad = (
                        (g.mul_(coef.to(g.device)) if coef is not None else g) if g is not None else None
                    )
                for p in device_params if whole_step else ():
                    copies[id(p)].grad = p.grad.to(master_device) if p.grad is not None else None
                host_opt.step()
                for p in device_params if whole_step else ():
                    if p.grad is not None:
                        p.data.copy_(copies[id(p)])
                    p.grad = copies[id(p)].grad = None
                for _, p in host:
                    masters[id(p)].grad = None
                    acc[id(p)] = None
                    p.data.copy_(masters[id(p)])
        with torch.no_grad():
            inputs, _ = next(batches)
            evals.append(run_layers(layers, inputs, mode).cpu())
    weights = _weights(layers)
    for n, p in host:  # the true weights are the masters
        weights[n] = masters[id(p)].cpu().clone()
    return FullRecord(losses, weights, evals)


@contextmanager
def _frozen(layers, names) -> Iterator[None]:
    """``requires_grad`` off for the params named ``"i.name"`` (no gradient this micro-batch), back on after."""
    params = [p for i, layer in enumerate(layers) for n, p in layer.named_parameters() if f"{i}.{n}" in names]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _stray(stray_grads: dict[int, float] | None, step: int) -> list[torch.nn.Parameter]:
    """A param outside the model with a gradient of ``stray_grads[step]`` everywhere, or none that step."""
    if not stray_grads or step not in stray_grads:
        return []
    stray = torch.nn.Parameter(torch.zeros(3))
    stray.grad = torch.full((3,), float(stray_grads[step]))
    return [stray]


def _move_for_update(optimizer, master: torch.Tensor, grad: torch.Tensor | None, device) -> torch.Tensor | None:
    """Move ``master`` (in place: the optimizer keys on it) and its state to ``device``; return ``grad`` there."""
    master.data = master.data.to(device)
    state = optimizer.state[master]
    for key, value in state.items():  # AdamW's moments and step, SGD's momentum buffer
        if isinstance(value, torch.Tensor):
            state[key] = value.to(device)
    return grad.to(device) if grad is not None else None


def flip_sides_every_step(monkeypatch) -> Callable[[int, int], bool]:
    """Split updates: patch :class:`UpdateSplit` so that every layer changes side at every step; returns
    ``on_device(step, rank)`` (``rank``: the layer's place among the host-trained layers) for a reference.
    ``assign`` runs once at start-up and then once per step before its updates: step s uses call s + 2."""

    def assign(self, order=None):
        self.calls = getattr(self, "calls", 0) + 1
        for rank, idx in enumerate(sorted(self.sizes)):
            self.on_device[idx] = (rank + self.calls) % 2 == 0
        return self.on_device

    monkeypatch.setattr(UpdateSplit, "assign", assign)
    return lambda step, rank: (rank + step) % 2 == 0


def assert_same(a: FullRecord, b: FullRecord) -> None:
    assert len(a.losses) == len(b.losses)
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(x, y), (i, x, y)
    assert a.weights.keys() == b.weights.keys()
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k]), k
    for x, y in zip(a.evals, b.evals):
        assert torch.equal(x, y)


def differs(a: FullRecord, b: FullRecord) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return True
    return False
