"""Row keeping: a layer's swap units stay in their slots over a layer-major step's micro-batches of that layer.

A layer-major step (:mod:`.layer_major`) runs each of the caller's layers (a *row*) over all N micro-batches before
the next. A layer streamed whole is one use per micro-batch, repeated, so it is fetched once. A layer streamed as swap
units (:mod:`..streaming.units`) runs its units one after another in each micro-batch (holder, unit 1, ..., unit k,
holder, unit 1, ...): left to the slot policy, the prefetch after unit k reaches for the next layer's units and
evicts unit 1, which the next micro-batch needs at once, so each unit was fetched about once per micro-batch.

What :class:`RowKeeping` tells the engine (:meth:`~.swapper.LayerSwapper.keep_for_repeats`), per micro-batch of a row
    - Kept: in every micro-batch but the row's last, the units :func:`~..planning.row_copies.plan_row` keeps (the one
      rule, which the planner's model replays): all of the row's streamed units when they fit the slots (each then
      stays resident from its first fetch to the row's last micro-batch); when they outnumber the slots, as many as
      leave two slots to the others (one read while the next is filled), chosen for the fewest bytes fetched again
      (a demand fetch evicts a kept unit only when no other slot is free to take); the others
      are fetched again in each micro-batch, and meanwhile a prefetch takes only the row's own units (the next
      layer's would take a slot the row needs again). In the last micro-batch nothing is kept and the slot policy
      is the one of a single micro-batch (a unit the layer is done with makes room for the next layer's).
    - The units and their order come from the row's uses in the first micro-batch of the same direction (recorded
      by :class:`RowMemory`, a listener of the engine, kept over steps): the first micro-batch of a step keeps
      what the previous step's did; before any was recorded, the row's streamed units in their order.
    - Repeating: in every micro-batch but the row's first, the uses repeat the first's: the use predictor moves
      without learning (:meth:`~..streaming.schedule.UsePredictor.relocate`), so its tables stay those of one
      micro-batch, and in the last micro-batch it predicts the next layer's units after unit k (the prefetch of one
      micro-batch), not unit 1 again.
    - Said once (:meth:`RowKeeping.report`, the first step with N > 1 whose rows fetch units again): which layers'
      units come again per micro-batch and the bytes the rule predicts that adds a step
      (:func:`~..planning.row_copies.refetch_line`); where a VRAM budget's units were sized for another count of
      micro-batches (``layer_major_micro_batches``: :mod:`..planning.unit_choice`), how to size them for this one.

Invariants
    - Correctness never depends on it: it changes only which slots a prefetch may take (and which entries it may
      fetch) and what the predictor learns. A demand fetch may still evict a kept entry (a use the first
      micro-batch did not make), and every fetch, release and wait is the engine's as before.
    - The row's index is the caller's layer index of the engine's entries (:attr:`~..streaming.units.Entry.layer`):
      the schedule's layers are the swapper's layers, one each (the demo's and diffusion-pipe's stage lists). When
      their counts differ nothing is kept (the predictor's repeats still hold: they concern the schedule alone).
    - Between steps nothing is kept, restricted or repeating (:meth:`close`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..planning.row_copies import RowPlan, plan_row, refetch_line
from ..streaming.schedule import Phase
from ..watching.listener import Listener

if TYPE_CHECKING:
    from .swapper import LayerSwapper

Key = tuple[int, bool]  # (row, backward)


class RowMemory(Listener):
    """The streamed entries each row's first micro-batch used, per direction, in order (consecutive uses as one):
    recorded while a row's first micro-batch runs, kept over steps; and the plans made from them (the same uses and
    slots give the same plan: one is made once, not per row and step)."""

    def __init__(self) -> None:
        self.uses: dict[Key, list[int]] = {}
        self.plans: dict[tuple[tuple[int, ...], int], RowPlan] = {}  # (uses, slots) -> plan_row's plan
        self.reported = False
        self._key: Key | None = None

    def record(self, key: Key | None) -> None:
        """Record the uses from now on under ``key`` (None: stop)."""
        self._key = key
        if key is not None:
            self.uses[key] = []

    def use_started(self, layer: int, phase: Phase, streamed: bool, missed: bool) -> None:
        if self._key is not None and streamed:
            uses = self.uses[self._key]
            if not uses or uses[-1] != layer:
                uses.append(layer)


class RowKeeping:
    """The engine's side of one layer-major step's rows (see the module doc)."""

    def __init__(self, swapper: LayerSwapper, rows: int, micro_batches: int) -> None:
        self.swapper, self.count = swapper, micro_batches
        units: dict[int, list[int]] = {}
        for idx, entry in enumerate(swapper.entries):
            units.setdefault(entry.layer, []).append(idx)
        self._entries = units if len(units) == rows else {}  # caller's layer -> its entries (see the invariants)
        memory = swapper.row_memory
        if not isinstance(memory, RowMemory):
            memory = swapper.row_memory = RowMemory()
            swapper.add_listener(memory)
        self.memory = memory
        self._plans: dict[Key, RowPlan] = {}  # this step's, from the first micro-batch's uses
        self._bytes = {i: layout.sizes.copy_bytes for i, layout in enumerate(swapper.layouts)}

    def micro_batch(self, row: int, position: int, backward: bool = False) -> None:
        """``position``: the micro-batch's place in the row's run (0: the row's first, ``count - 1``: its last);
        ``backward``: the row runs in the step's backward."""
        key = (row, backward)
        kept, within = frozenset(), None
        if position < self.count - 1 and row in self._entries:
            plan = self._plan(key, row, first=position == 0)  # before this micro-batch's record replaces the last
            kept, within = plan.kept, plan.within
        elif position == self.count - 1 > 0 and row in self._entries:
            self._plan(key, row, first=False)  # the last keeps nothing; its plan is for report() (2: no middle one)
        self.memory.record(key if position == 0 and self.count > 1 and row in self._entries else None)
        self.swapper.keep_for_repeats(kept, repeating=position > 0, within=within)

    def _plan(self, key: Key, row: int, first: bool) -> RowPlan:
        """The row's plan from the uses its first micro-batch made (in the step's first micro-batch: the previous
        step's, or before any, the row's streamed entries in order)."""
        if not first and key in self._plans:
            return self._plans[key]
        swapper = self.swapper
        recorded = self.memory.uses.get(key)
        uses = tuple(i for i in (recorded or self._entries[row]) if swapper.is_streamed(i))
        slots = len(swapper.pool.slots)
        plan = self.memory.plans.get((uses, slots))
        if plan is None:
            plan = self.memory.plans[(uses, slots)] = plan_row(list(uses), slots, self._bytes)
        if not first:
            self._plans[key] = plan
        return plan

    def report(self) -> None:
        """Once per engine: the line saying which layers' units this step fetched again per micro-batch (none: no
        line, and the next step with such rows may say it)."""
        if self.memory.reported or self.count < 2:
            return
        refetched = {key: plan for key, plan in self._plans.items() if plan.refetched}
        if not refetched:
            return
        self.memory.reported = True
        extra = (self.count - 1) * sum(self._bytes[e] for plan in refetched.values() for e in plan.refetched)
        kept = min(len(plan.kept) for plan in refetched.values())  # the line says "at least"
        layers = sorted({row for row, _ in refetched})
        line = refetch_line(self.count, len(self.swapper.pool.slots), layers, extra, kept)
        if line and self.swapper.log is not None:
            self.swapper.log(line + self._sized_for())

    def _sized_for(self) -> str:
        """Where the builder chose the unit size for other micro-batches than this step's (the library's own loop
        did not say its count: :mod:`..planning.unit_choice`), how to size them for these ('' otherwise)."""
        placement = self.swapper.config.placement
        told = placement.layer_major_micro_batches
        if placement.swap_unit_mb is not None or not self.swapper.unit_bytes or told == self.count:
            return ""
        return (
            f" (the VRAM budget's swap units were sized for {told} layer-major micro-batch(es) a step: "
            f"layer_major_micro_batches = {self.count} in the SwapConfig sizes them for {self.count})"
        )

    def close(self) -> None:
        self.memory.record(None)
        self.swapper.keep_for_repeats(frozenset(), repeating=False)
