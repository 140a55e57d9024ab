"""What a data-parallel full fine-tune saves, and how a resume reads it back (:mod:`.data_parallel`).

Each process of a data-parallel full fine-tune holds the fp32 masters and the host optimizer state of its *share*
of the streamed layers only; the other layers it sees as the shared packed copy (bf16 for a bf16 model). A trainer
saves from one process (diffusion-pipe: DeepSpeed's layer files and ``Saver.save_full_model`` from data-parallel
rank 0, through state dicts and :meth:`~..engine.swapper.LayerSwapper.true_weights`), so:

- Masters (:meth:`SharedSaves.owners_masters`, around each save): every process enters it together; each owner
  sends the fp32 masters of its layers to the *reader* (rank 0, the one that writes), one flat message a layer in
  layer order (its masters one after another in layout order, split back into the params' shapes on receipt, each
  a tensor of its own; ``torch.distributed.send``/``recv`` of CPU tensors over a gloo group made at start-up for
  the saves, so NCCL's jobs put no masters on the GPU; without one, the default group's), only the params
  with a master of their own (an fp32 param outside a flat layer has none: its master is the shared packed copy,
  which the reader reads as it is once its owner published it: the reader's flush waits for every other owner's
  layer, :meth:`~.data_parallel.SharedGradients.wait_published`), and the reader's
  :class:`~.training_feature.TrainingFeature` gives them as the true values of those params for the block (the state
  dicts and ``true_weights`` read them as a single process reads its own masters). Why a gather at save time, not
  the masters in a shared segment: the host training's allocation stays as it is, and the cost is the reader's
  RAM for the other owners' masters while a save runs (what the saver's own copies already cost, in fp32).
- Optimizer state (:func:`host_state_files`, :func:`merged_host_state`; the files' names, made and parsed here
  only: :class:`HostStateName`): each process writes its share's file,
  ``dgls_host_optimizer_stage<S>_rank<R>.pt`` (its layers' optimizer state dicts, no gather: each owner writes its
  own bytes, in parallel); one process per stage writes ``dgls_host_optimizer_stage<S>.pt``. A resume reads every
  file of its stage, one at a time, keeping only the layers this process updates: the files together must hold
  exactly the stage's host-trained layers, each in one file. So a resume with another number of processes (and so
  other owners) works: the masters are in the layer files, and each layer's optimizer state goes to its new owner.

Invariants
    - Every process of the job enters :meth:`SharedSaves.owners_masters` (a save is collective: train.py calls its
      saves on every rank); the transfers are matched by their order (layers in layout order, one message each).
    - Outside the block the reader's true values are its own masters (loads write only owned masters).
    - The reader is rank 0 of the default group: data parallel runs on one pipeline stage, whose data-parallel
      rank 0 is the job's rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .data_parallel import Ownership, SharedGradients, peer_failure

if TYPE_CHECKING:
    from ..engine.swapper import LayerSwapper

READER = 0  # the rank that writes a data-parallel job's saves (its stage's data-parallel rank 0)
HOST_STATE_PREFIX = "dgls_host_optimizer_stage"  # every host optimizer file's name starts with it
_HOST_STATE_NAME = re.compile(rf"{HOST_STATE_PREFIX}(\d+)(?:_rank(\d+))?\.pt")


@dataclass(frozen=True)
class HostStateName:
    """The name of a host optimizer file in a checkpoint's tag folder: pipeline ``stage``'s one file,
    ``dgls_host_optimizer_stage<S>.pt`` (``rank`` None: one process trains the stage's host layers), or data-parallel
    ``rank``'s share of it, ``dgls_host_optimizer_stage<S>_rank<R>.pt``. The one place these names are made and read
    (the saves, the resume and the check before start-up, :mod:`..program.resume`)."""

    stage: int
    rank: int | None = None

    @property
    def name(self) -> str:
        share = f"_rank{self.rank}" if self.rank is not None else ""
        return f"{HOST_STATE_PREFIX}{self.stage}{share}.pt"

    @classmethod
    def parse(cls, name: str) -> HostStateName | None:
        """The stage and rank a file ``name`` says, or None for a name that is not a host optimizer file's."""
        if (match := _HOST_STATE_NAME.fullmatch(name)) is None:
            return None
        return cls(int(match[1]), int(match[2]) if match[2] is not None else None)


@dataclass(frozen=True)
class SharedSaves:
    """The saves of one data-parallel process: ``gradients``, its :class:`~.data_parallel.SharedGradients` (held,
    not copied: set at start-up, they do not change), whose ``ownership``, trained ``params`` of every host-trained
    layer (entry -> params in layout order, the same on every process), full shapes (``shape_of``: a streamed param
    is an empty placeholder while it is out), ``own_masters`` (the ``id`` of each param with an fp32 master of its
    own: the ones a save sends; None: every param) and ``save_group`` (the gloo process group of every rank that the
    masters go through, on the CPU; None: the default group, through the GPU where it is NCCL's) a save reads;
    ``master_of`` (this process's masters), ``flush`` (its queued updates written) and ``lend`` (the reader's true
    values for the block: ``{}`` ends them)."""

    gradients: SharedGradients
    master_of: Callable[[nn.Parameter], torch.Tensor | None]
    flush: Callable[[], None]
    lend: Callable[[dict[int, torch.Tensor]], None]

    @classmethod
    def of(cls, swapper: LayerSwapper | None) -> SharedSaves | None:
        """A swapper's saves when it trains its share of a data-parallel full fine-tune, else None."""
        from .training_feature import TrainingFeature

        feature = swapper.feature(TrainingFeature) if swapper is not None else None
        if feature is None or feature.shared is None:
            return None

        def lend(values: dict[int, torch.Tensor]) -> None:
            feature.lent = values

        return cls(feature.shared, feature.training.master_of, feature.flush, lend)

    @property
    def ownership(self) -> Ownership:
        return self.gradients.ownership

    @property
    def layers(self) -> set[int]:
        """Every host-trained layer of the stage (each process's share together)."""
        return set(self.ownership.owners)

    def sent(self, idx: int) -> list[nn.Parameter]:
        """Layer ``idx``'s params whose masters a save sends: those with an fp32 master of their own (an fp32
        param's is the shared packed copy, which the reader reads as it is)."""
        own = self.gradients.own_masters
        return [param for param in self.gradients.params[idx] if own is None or id(param) in own]

    @contextmanager
    def owners_masters(self) -> Iterator[None]:
        """Every process together: inside the block the reader's true values of the other owners' params are their
        fp32 masters (see the module doc)."""
        dist = torch.distributed
        rank = self.ownership.rank
        group = self.gradients.save_group
        nccl = group is None and dist.get_backend() == "nccl"  # no gloo group: the default one's device
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        lent: dict[int, torch.Tensor] = {}
        self.flush()  # this owner's queued updates are in its masters
        with peer_failure("a save of the streamed layers' masters"):
            for idx in sorted(self.ownership.owners):
                owner = self.ownership.owners[idx]
                if owner == READER or rank not in (owner, READER):
                    continue
                params = self.sent(idx)
                if not params:
                    continue
                if rank == owner:  # one message a layer: its masters, flat, in layout order
                    dist.send(self._flat_masters(idx, params).to(device or "cpu"), dst=READER, group=group)
                else:
                    shapes = [self.gradients.shape_of(param) for param in params]
                    received = torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32, device=device or "cpu")
                    dist.recv(received, src=owner, group=group)
                    pieces = received.split([s.numel() for s in shapes])
                    for param, shape, piece in zip(params, shapes, pieces, strict=True):
                        lent[id(param)] = piece.view(shape).to("cpu", copy=True)  # a storage of its own bytes
                    del received, pieces
        self.lend(lent)
        try:
            yield
        finally:
            self.lend({})

    def _flat_masters(self, idx: int, params: Sequence[nn.Parameter]) -> torch.Tensor:
        """Layer ``idx``'s fp32 masters of ``params``, one after another in one flat CPU tensor."""
        flat = torch.empty(sum(self.gradients.shape_of(param).numel() for param in params), dtype=torch.float32)
        start = 0
        for param in params:
            master = self.master_of(param)
            if master is None:
                raise AssertionError(f"the owner of layer {idx} holds no master for one of its params")
            flat[start : start + master.numel()].copy_(master.reshape(-1))  # one copy, cast on the way
            start += master.numel()
        return flat


def host_state_files(folder: Path, stage: int) -> list[Path]:
    """The host optimizer files of ``stage`` in a checkpoint's tag ``folder``: the one file of a stage with one
    process, else the data-parallel processes' (by rank)."""
    whole = folder / HostStateName(stage).name
    if whole.exists():
        return [whole]
    return [path for _, path in _shares(folder, stage)]


def stale_host_state_files(folder: Path, stage: int, processes: int | None) -> list[Path]:
    """Files of ``stage`` in ``folder`` that a save by ``processes`` data-parallel processes (None: one process,
    which writes the stage's one file) does not write: an earlier save of the same tag by another number of
    processes left them, and a resume would read them with the new ones."""
    shares = _shares(folder, stage)
    if processes is None:
        return [path for _, path in shares]
    whole = folder / HostStateName(stage).name
    return ([whole] if whole.exists() else []) + [path for rank, path in shares if rank >= processes]


def _shares(folder: Path, stage: int) -> list[tuple[int, Path]]:
    """(rank, file) of each data-parallel process's share of ``stage`` in ``folder``, by rank."""
    named = ((HostStateName.parse(path.name), path) for path in folder.glob(f"{HOST_STATE_PREFIX}*.pt"))
    return sorted((n.rank, path) for n, path in named if n is not None and n.stage == stage and n.rank is not None)


def merged_host_state(
    paths: Sequence[Path], read: Callable[[Path], object], keep: set[int], expected: set[int]
) -> tuple[object, str | None]:
    """The per-layer states of the layers ``keep`` from the files ``paths`` (``read`` gives what one holds; they
    are read one at a time, and only the kept layers' states are held), checked: together the files must hold
    exactly the ``expected`` layers, each in one file. Returns (state, None), or (None, why not: words that follow
    the checkpoint folder's name). A single file that is not per-layer (a whole step's) is returned whole (the
    host training's check names what it holds).

    - ``read`` may map the files (``torch.load(mmap=True)``: a process reads only its layers' bytes, not every
      file whole): the returned tensors are copies (:func:`owned`), never views of a file, which a later save of
      the same tag rewrites under them (an optimizer's ``load_state_dict`` keeps a tensor of its dtype as it is)."""
    merged: dict = {}
    seen: dict[int, str] = {}
    for path in paths:
        state = read(path)
        if not isinstance(state, dict) or not all(_is_layer(k) for k in state):
            if len(paths) == 1:
                return owned(state), None
            return None, f"holds {path.name}, with no per-layer optimizer states"
        for key, value in state.items():
            idx = int(key)
            if idx in seen:
                return None, f"holds the optimizer state of layer {idx} twice, in {seen[idx]} and {path.name}"
            seen[idx] = path.name
            if idx in keep:
                merged[idx] = owned(value)
        del state  # the next file is read without this one's other layers held
    if set(seen) != expected:
        missing = sorted(expected - set(seen))
        lost = f"; the file holding layers {missing} is missing" if missing and not set(seen) - expected else ""
        return None, (
            f"holds the optimizer state of layers {sorted(seen)} of this pipeline stage, and this run trains layers "
            f"{sorted(expected)} of it on the host ({len(paths)} file(s) read{lost}): resume with the placement it "
            "was saved with (the same --blocks_to_swap or --gpu_layers, and pipeline_stages), or pass "
            "--reset_optimizer to start the optimizer afresh"
        )
    return merged, None


def _is_layer(key: object) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def owned(value: object) -> object:
    """``value`` with every tensor in it (through dicts, lists and tuples) copied into memory of its own."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: owned(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(owned(item) for item in value)
    return value
