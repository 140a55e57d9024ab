"""One placement for the data-parallel processes that hold the same layers: the planner's inputs, agreed.

Why
    - In data parallel every step ends at the gradients' all-reduce, so every process runs each step at the slowest
      process's pace, and each process's timed steps include its wait there for the others. Planners that decide
      apart rank their candidates from their own probe (slightly different compute times and activation peaks give
      different shortlists) and from those confounded step times, and settle on different placements; the steps
      then run at the pace of the slowest placement.
    - So the processes decide together: every driver (:class:`~.autoplan.PlacementDriver`) takes the same inputs at
      the same points and, being deterministic, makes the same decisions (the same shortlist, the same winner, the
      same refinement, re-plan or fall-back).

What is agreed (each a MAX all-reduce of a few CPU float64 values over a gloo group: no device wait)
    - The VRAM budget, before anything is planned from it (the swap-unit size included): the *smallest* of the
      processes' budgets. ``--vram_budget auto`` gives each GPU its own free memory; one placement for all must fit
      the GPU with the least, and fits the others; the start-up line says so when they differ.
    - The probe's profile (:meth:`PlanAgreement.profile`): each layer use's compute time, the activation peak, the
      allocator slack, the update buffers and the offload counts the *largest*; the copy and disk-read bandwidths
      the *smallest*. Every process's plan then fits its own memory (the agreed peak is the largest) and every
      driver builds the identical shortlist.
    - Every timed window's step time and peak reserved: the largest (trials, the check, the refinement's round,
      a re-plan's check alike: a peak over the budget on any process is over on all). Not after settling: each
      pass's watch is the process's own (below: a collective per pass would make every micro-batch a rendezvous).

Who agrees (:meth:`PlanAgreement.among`)
    - The processes of the ``torch.distributed`` job that host the same layers: the same ``share_group`` (the
      pipeline stage; ``""`` for a job of one stage), the same first layer, and the same layer list (each layer's
      class, and its params' names, shapes and dtypes): the data-parallel replicas of one stage, on any machine.
      Found at start-up by one ``all_gather_object`` over the default group; each set of two or more processes gets
      a gloo group (every rank makes every set's group, in one order, as ``new_group`` requires).
    - One process alone (no group, or no other process with its layers): no agreement, and the driver runs exactly
      as it always did.

Invariants
    - The replicas step their drivers at the same pass boundaries (data parallel runs the same schedule of forwards
      and backwards on every process), so each collective here is met by every member: the driver agrees only where
      it acts (its ``step`` and ``fix_plan``), never in autograd's callbacks or inside a backward.
    - The agreement lasts until the plan settles (the probe, the trials, the check, a refinement: about the first 35
      steps) and ends there: from then on each driver watches its own peaks, and a process whose steps later go over
      its budget re-plans alone (its placement may then differ from the others'; each step runs at the slowest's
      pace, but nothing waits for a collective the others do not enter). So after settling, a forward on some
      members only (a sample on rank 0 between steps) is safe; before, it would step their drivers alone into a
      collective the others never reach: the members wait (gloo's timeout), then each stops with one line that says
      this. Training loops (DeepSpeed's, the demo's, the benchmarks') run the same passes on every replica.
      Except with shared fetches (:mod:`..memory.fetch_share`, ``--share_fetch``): every fetch is then a gather of
      the members, so every forward must run on every member for the whole run, and a settled plan stays as it
      settled (the driver's ``lockstep``: a process over its budget says so and does not re-plan alone).
    - A probe whose sequence of uses (layer and phase, in order) differs between the processes cannot give one plan:
      every member raises the same line.
    - Every field of :class:`~.planner.StepProfile` has a rule here (``RULES``; a test checks the set), so a field
      added later is not silently left to each process.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..errors import DGLSUserError
from ..memory.layout import human_bytes
from .planner import StepProfile, UseTiming

MaxOf = Callable[[Sequence[float]], list[float]]  # the elementwise MAX of every member's values

# StepProfile's fields: "max" (the largest: compute, bytes, counts), "min" (the smallest: bandwidths), or agreed
# their own way ("uses": the sequence checked, each compute time the largest; "disk_reads": per entry, the largest).
RULES = {
    "uses": "uses",
    "activation_bytes": "max",
    "reserved_overhead": "max",
    "bytes_per_ms": "min",
    "sent_segments": "max",
    "segment_bytes": "max",
    "probe_kept": "max",
    "update_bytes": "max",
    "micro_batches": "max",
    "disk_reads": "disk_reads",
    "read_bytes_per_ms": "min",
}


def layer_signature(layers: Sequence) -> str:
    """A digest of the layer list: each layer's class, and its params' names, shapes and dtypes (plain functions
    between layers: their type)."""
    digest = hashlib.sha256()
    for layer in layers:
        digest.update(f"{type(layer).__module__}.{type(layer).__qualname__}|".encode())
        if isinstance(layer, nn.Module):
            for name, param in layer.named_parameters():
                digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()


def gloo_max(group, size: int) -> MaxOf:
    """The elementwise MAX over ``group`` (a gloo group of ``size`` processes) of CPU float64 values. A collective
    that fails (a member stopped, or never came: see the module doc's invariants) is one line."""

    def max_of(values: Sequence[float]) -> list[float]:
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        try:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
        except RuntimeError as exc:  # gloo's: a closed connection, a timeout
            cause = str(exc).strip().split("\n")[0][:200]
            raise DGLSUserError(
                f"the VRAM planner's agreement between the {size} data-parallel processes holding these layers "
                f"failed ({cause}): one of them stopped (see its own error), or ran a forward the others did not "
                "before the plan settled; until it settles (about the first 35 steps; with shared fetches, always), "
                "run every forward and backward on every process, or give the placement with --gpu_layers / "
                "--blocks_to_swap instead of --vram_budget"
            ) from None
        return tensor.tolist()

    return max_of


@dataclass(frozen=True)
class PlanAgreement:
    """The processes that decide one placement together (see the module doc): ``size`` of them, ``max_of`` their
    collective. Every method is a collective: every member calls it at the same point, in the same order."""

    size: int
    max_of: MaxOf

    @classmethod
    def among(cls, layers: Sequence, share_group: str, first_layer: int) -> PlanAgreement | None:
        """The processes of this job that host these layers (None: this process alone, or no job). Every rank of the
        default group must call it at the same point (the swapper's build, in lockstep, as :mod:`..memory.peers`)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        key = (share_group, int(first_layer), layer_signature(layers))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, key)
        sets: dict[tuple, list[int]] = {}
        for rank, theirs in enumerate(everyone):
            sets.setdefault(tuple(theirs), []).append(rank)
        mine = None
        for ranks in sorted(ranks for ranks in sets.values() if len(ranks) > 1):  # one order on every rank
            group = dist.new_group(ranks, backend="gloo")
            if dist.get_rank() in ranks:
                mine = cls(len(ranks), gloo_max(group, len(ranks)))
        return mine

    # ---------------------------------------------------------------- agreements
    def budget(self, budget: int) -> tuple[int, int]:
        """The smallest and the largest of the members' budgets (bytes)."""
        high, low = self.max_of([budget, -budget])
        return int(-low), int(high)

    def budget_note(self, budget: int, largest: int) -> str:
        """What the start-up line says of the agreed ``budget`` (the smallest of budgets up to ``largest``)."""
        shared = f"one placement for the {self.size} data-parallel processes holding these layers"
        if human_bytes(largest) == human_bytes(budget):  # ``auto`` on like GPUs differs by a few MiB: not worth a word
            return shared
        return f"{shared}; their budgets differ, up to {human_bytes(largest)}: planned for the smallest, which fits all"

    def measured(self, wall_ms: float, peak_reserved: int) -> tuple[float, int]:
        """A timed window's step time and peak reserved: the largest over the members."""
        wall, peak = self.max_of([wall_ms, peak_reserved])
        return wall, int(peak)

    def profile(self, profile: StepProfile, entries: int) -> StepProfile:
        """The probe's profile agreed (module doc): ``entries`` is the number of placed entries (the layer indices
        ``disk_reads`` may name)."""
        uses = profile.uses
        order = zlib.crc32(repr([(u.layer, u.phase.value) for u in uses]).encode())  # < 2**32: exact in float64
        most, fewest, highest, lowest = self.max_of([len(uses), -len(uses), order, -order])
        if most != -fewest or highest != -lowest:
            raise DGLSUserError(
                f"the {self.size} data-parallel processes holding these layers ran different probe steps (from "
                f"{int(-fewest)} to {int(most)} layer uses, or another order), so no one placement can be planned "
                "for them: every process must run the same layers in the same order each step (or give the "
                "placement with --gpu_layers / --blocks_to_swap instead of --vram_budget)"
            )
        scalars = [name for name, rule in RULES.items() if rule in ("max", "min")]
        sign = {name: -1.0 if RULES[name] == "min" else 1.0 for name in scalars}
        disk = [0.0] * entries
        for index, nbytes in profile.disk_reads.items():
            disk[index] = float(nbytes)

        def signed(name: str) -> float:
            value = float(getattr(profile, name))
            if RULES[name] == "min" and value <= 0:  # no rate measured here (no disk tier): the others' stands
                return float("-inf")
            return sign[name] * value

        agreed = self.max_of([u.compute_ms for u in uses] + [signed(name) for name in scalars] + disk)
        times, values, reads = agreed[: len(uses)], agreed[len(uses) : len(uses) + len(scalars)], agreed[-entries:]
        fields: dict = {}
        for name, value in zip(scalars, values):
            value = 0.0 if value == float("-inf") else sign[name] * value
            fields[name] = type(getattr(profile, name))(value)
        fields["uses"] = tuple(UseTiming(u.layer, u.phase, ms) for u, ms in zip(uses, times))
        fields["disk_reads"] = {i: int(nbytes) for i, nbytes in enumerate(reads) if nbytes > 0} if entries else {}
        return replace(profile, **fields)
