"""Data-parallel full fine-tuning over shared host memory (ZeRO-1 style, one machine).

Data-parallel processes on one machine already stream from one host copy of the streamed layers' weights
(:mod:`..memory.peers`). To train those layers, each process updates only its *share* of them:

- Ownership (:class:`Ownership`): every host-trained layer has one owner, the same on every process (assigned
  in layer order to the process with the fewest trained params so far; the entries of one module share an owner).
  Only the owner builds the layer's fp32 master, gradient landings and optimizer state, so the machine holds one
  copy of each; for an fp32 model the shared packed copy is the master itself.
- Gradients (:class:`SharedGradients`): a post-accumulate-grad hook on every trained param of a streamed layer,
  installed before the host training's own, reduces the param's gradient to the layer's owner
  (``torch.distributed.reduce``, SUM, then divided by the number of processes: the mean, as DeepSpeed's
  data-parallel reduction of the resident params' gradients). On the owner the mean goes on into the host
  training (its landings, sums, norms and update); elsewhere the gradient is dropped once the reduce has sent it
  (a non-owner waits for a layer's reduces when the next layer's first one starts, and for the last layer's when
  the backward ends: at most one layer's gradients are in flight, never the whole model's). The reduce of a layer
  runs as its gradients are ready, inside the backward.
- Layer-major steps (:mod:`..engine.layer_major`): the hook first adds each micro-batch's gradient to the step's
  device sum (:mod:`.device_sums`, the host training's same object) and reduces that sum once, at the layer's last
  micro-batch: one reduce a step, not one per micro-batch; the owner's host training gets the reduced sum as the
  step's one gradient.
- Clipping: the host part of the squared gradient norm is summed over the processes (each owner counts its own
  layers once); the resident params' gradients are already the same everywhere and count once.
- Publication: after the step's updates are queued, every process waits for its own updates to be written
  (:meth:`~.host_training.HostTraining.finish`: the shared packed copies hold the new weights) and then meets the
  others at ``torch.distributed.barrier()`` (the default group). A process passes the barrier only after every
  owner's writes, so the next forward's fetches read the updated weights; every streamed trained layer is
  evicted when a backward ends, so no slot keeps an old copy.

Streams (NCCL)
    - An owner's reduce is waited for on the compute stream before its gradient goes home (the copy home is
      ordered after the compute stream); a non-owner's runs on NCCL's stream beside the backward, its gradient kept
      referenced until it is waited for (the next layer's first reduce, or the backward's end).

Refused (one line each)
    - An optimizer whose step sums over every param (Prodigy's d): each instance would see one share.
    - A VRAM budget's planner: it may make layers resident after its probe, and owners are fixed at start-up.
    - Processes that do not all map the one host copy (several machines, no ``/dev/shm``, pipeline stages).
    - A collective whose partner process is gone (killed, crashed): :func:`peer_failure`, instead of a traceback.
    - Under diffusion-pipe's train.py (``program/validate.py``, tested end to end in
      tests/test_diffusion_pipe_data_parallel_real.py): its saves read every param on data-parallel rank 0
      (``Saver.save_full_model`` directly, DeepSpeed's layer files through state dicts), and rank 0 holds fp32
      masters only for its own share, so other owners' layers would be saved as the shared bf16 copy; DeepSpeed
      saves one optimizer state, and the host state is split among owners. What it takes:

      1. each owner's fp32 masters in a ``/dev/shm`` segment of its own (``..memory.peers``' protocol: create,
         barrier, every process maps every owner's, barrier, unlink), laid out from the ownership and sizes every
         process knows, so rank 0's ``true_value`` reads any layer's true master after the step's barrier,
         without a gather or a second copy (writes stay the owner's; a load writes only owned masters);
      2. each owner's host optimizer state in its own file beside the checkpoint
         (``dgls_host_optimizer_stage0_rank{R}.pt``) from ``EngineHooks``' save on every rank, and a resume that
         reads each rank's file, refused (one line, through ``agree``) when the number of processes or the
         ownership differs from the saved one;
      3. ``_drop_in_full_fine_tune`` then sets ``data_parallel`` on one stage with the demo's refusals (a VRAM
         budget's planner, a whole-step optimizer; ``gradient_release``, which diffusion-pipe itself keeps to
         one process per stage), and the test compares against the plain two-process run it already makes
         (saved model and a resume, in bf16 so that the shared copy differs from the masters).

Invariants
    - Every process runs the same backward (the same layers, the same params with gradients, in the same order):
      the reduces are collectives matched by order. A param without a gradient on one process must have none on
      all (the demo's and diffusion-pipe's models give every trained param one).
    - Equal to one process with the global batch up to the order of summation (each process's mean over its rows,
      then the mean over processes).
    - The processes of the job are the processes that host these layers, all on one machine (one pipeline stage);
      checked at start-up.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import DGLSUserError
from .device_sums import DeviceSums
from .host_optimizer import HostOptimizerSpec


@dataclass(frozen=True)
class Ownership:
    """Which process updates each host-trained layer (entry index -> rank of the default group)."""

    rank: int
    size: int
    owners: dict[int, int]

    @classmethod
    def assign(cls, numels: Mapping[int, int], groups: Mapping[int, int], rank: int, size: int) -> Ownership:
        """Owners for the layers ``numels`` (entry -> trained params) in layer order: each module (``groups``:
        entry -> its module) goes to the process with the fewest trained params so far (the lowest rank on ties).
        The same on every process: it reads only the layers' sizes."""
        load = [0] * size
        by_module: dict[int, int] = {}
        owners = {}
        for idx in sorted(numels):
            module = groups.get(idx, idx)
            if module not in by_module:
                by_module[module] = min(range(size), key=lambda r: (load[r], r))
            owners[idx] = by_module[module]
            load[owners[idx]] += numels[idx]
        return cls(rank, size, owners)

    @property
    def owned(self) -> list[int]:
        return [idx for idx, owner in self.owners.items() if owner == self.rank]

    @property
    def foreign(self) -> list[int]:
        return [idx for idx, owner in self.owners.items() if owner != self.rank]

    def line(self) -> str:
        counts = [sum(1 for o in self.owners.values() if o == r) for r in range(self.size)]
        return (
            f"DGLS data parallel: each of the {self.size} processes updates its share of the {len(self.owners)} "
            f"host-trained layers ({'/'.join(map(str, counts))}), with one copy of their masters and optimizer state "
            "on this machine; gradients are reduced to each layer's owner during the backward, and the updates are "
            "published at a barrier after each step"
        )


def job_ownership(numels: Mapping[int, int], groups: Mapping[int, int]) -> Ownership:
    """The ownership over the processes of this ``torch.distributed`` job (its default group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise DGLSUserError(
            "data_parallel full fine-tuning shares the streamed layers' training among the processes of a "
            "torch.distributed job, and none is initialized: start the processes with a launcher (deepspeed, "
            "torchrun) and init_process_group before building the swapper, or drop data_parallel"
        )
    return Ownership.assign(numels, groups, dist.get_rank(), dist.get_world_size())


def refuse_whole_step(spec: HostOptimizerSpec) -> None:
    """An optimizer whose step sums over every param (Prodigy's and D-Adaptation's d) would see only one process's
    share of the streamed layers: refused, before anything starts where the caller knows it is data parallel."""
    if spec.whole_step:
        raise DGLSUserError(
            f"[optimizer] type {spec.type!r} steps one instance over every param (its step sums over all of them), "
            "and data-parallel full fine-tuning splits the streamed layers' updates among the processes: train it "
            "with pipeline stages or on one GPU, or pick a per-param type (adamw ...)"
        )


def check_shared(ownership: Ownership, local_ranks: int) -> None:
    """Every process of the job must map the one host copy (one machine, the same layers): an owner's update is
    then every process's weight."""
    if ownership.size > 1 and local_ranks != ownership.size:
        where = (
            "do not share a host copy (no /dev/shm here)"
            if local_ranks == 1
            else f"share a host copy {local_ranks} by {local_ranks}"
        )
        raise DGLSUserError(
            f"data-parallel full fine-tuning runs on one machine, where the processes share one host copy of the "
            f"streamed layers, and the {ownership.size} processes of this job {where}: run them on one machine with "
            "a writable /dev/shm, use pipeline stages (pipeline_stages = number of GPUs), or train a LoRA"
        )


class SharedGradients:
    """The reduce hooks of every trained param of the streamed layers, and the step's publication (see the
    module doc). ``params``: entry -> its trained params (layout order), for every host-trained layer."""

    def __init__(self, ownership: Ownership, params: Mapping[int, Sequence[nn.Parameter]]) -> None:
        self.ownership = ownership
        self.params = dict(params)
        self._hooks: list = []
        self._pending: list[tuple[int, object, torch.Tensor]] = []  # a non-owner's reduces not waited for: one layer's
        # The layer-major schedule's (the host training's same object): a layer's gradients summed on the device over
        # the step's micro-batches, reduced once at its last (:mod:`.device_sums`)
        self.device_sums: DeviceSums | None = None
        # The host training's intake of an owned gradient given outside its hook (a device sum flushed after its
        # layer's micro-batches): :meth:`~.grad_return.GradReturn.receive`, set at install (:mod:`.training_feature`)
        self.hand_on: Callable[[nn.Parameter, torch.Tensor], None] = _unset_hand_on

    def install(self, grad_arriving: Callable[[int], None]) -> None:
        """Hooks on every trained param; call before the host training installs its own (post-accumulate-grad
        hooks run in the order they were registered). A foreign layer's gradient arriving is a use of it, as the
        host training makes it for its own layers."""
        owned = set(self.ownership.owned)
        for idx, params in self.params.items():
            for param in params:
                if idx not in owned:
                    self._hooks.append(param.register_hook(partial(_arriving, grad_arriving, idx)))
                self._hooks.append(param.register_post_accumulate_grad_hook(partial(self._reduce, idx)))

    def _reduce(self, idx: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if self.device_sums is not None:  # None: summed on the device until the layer's last micro-batch
            grad = self.device_sums.add(param, grad, partial(self._reduce_sum, idx, param))
            if grad is None:
                return
        mean = self._send(idx, grad)
        if mean is not None:
            param.grad = mean  # the host training's hook, after this one, takes it

    def _reduce_sum(self, idx: int, param: nn.Parameter, grad: torch.Tensor) -> None:
        """A layer-major device sum sent after its layer's micro-batches (:meth:`~.device_sums.DeviceSums.flush`):
        reduced as in the hook; the owner hands the mean to the host training itself (no hook runs now)."""
        mean = self._send(idx, grad)
        if mean is not None:
            self.hand_on(param, mean)

    def _send(self, idx: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Reduce ``grad`` to the layer's owner: the owner gets the mean, the others ``None``."""
        grad = grad.contiguous()
        owner = self.ownership.owners[idx]
        dist = torch.distributed
        with peer_failure("the reduction of the streamed layers' gradients"):
            if owner == self.ownership.rank:
                dist.reduce(grad, dst=owner, op=dist.ReduceOp.SUM)
                return grad.div_(self.ownership.size)
            if self._pending and self._pending[-1][0] != idx:  # the layer before's: its gradients may go
                self._wait_pending()
            work = dist.reduce(grad, dst=owner, op=dist.ReduceOp.SUM, async_op=True)
            self._pending.append((idx, work, grad))
            return None

    def backward_done(self) -> None:
        """The backward ended: every reduce this process started has sent its gradient."""
        with peer_failure("the reduction of the streamed layers' gradients"):
            self._wait_pending()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, []
        for _idx, work, _grad in pending:
            work.wait()

    def norm_sum(self, squared: torch.Tensor) -> torch.Tensor:
        """The host part of the squared gradient norm, summed over the processes (each owner holds its layers')."""
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        value = squared.to(device, torch.float32)
        with peer_failure("the gradient norm"):
            dist.all_reduce(value)
        return value.cpu()

    def publish(self, finish: Callable[[], None]) -> None:
        """After the step's updates were queued: this process's updates written (``finish``), then the barrier that
        lets no process fetch a layer before its owner wrote it. A foreign layer's params lose any gradient a
        trainer zero-filled (DeepSpeed's reduction does), as the host training's own do."""
        for idx in self.ownership.foreign:
            for param in self.params[idx]:
                param.grad = None
        finish()
        with peer_failure("the end of the step"):
            torch.distributed.barrier()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _unset_hand_on(param: nn.Parameter, grad: torch.Tensor) -> None:
    raise AssertionError("SharedGradients.hand_on was never set: the host training must set it at install")


PEER_GONE = re.compile(r"peer|connection|timed out|timeout|NCCL", re.IGNORECASE)  # a collective's partner is gone


@contextmanager
def peer_failure(what: str) -> Iterator[None]:
    """A collective that fails because another process of the job is gone (killed, crashed: its connections
    closed) is one line: the processes share each step, so none can go on alone, and nothing of the step is kept."""
    try:
        yield
    except RuntimeError as exc:  # gloo's (plain RuntimeErrors) and NCCL's (DistBackendError is one)
        if not (isinstance(exc, torch.distributed.DistError) or PEER_GONE.search(str(exc))):
            raise
        raise DGLSUserError(
            f"another process of this data-parallel job stopped during {what} ({_first_sentence(exc)}): the processes "
            "train each step together, so this one stops too; see that process's own error for why"
        ) from None


def _first_sentence(exc: Exception) -> str:
    """gloo's and NCCL's message without its source location and advice: 'Read error ...: Connection reset by peer'."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().split("\n")[0])
    return text.split(". ")[0].rstrip(".") or type(exc).__name__


def _arriving(grad_arriving: Callable[[int], None], idx: int, grad: torch.Tensor) -> None:
    grad_arriving(idx)
