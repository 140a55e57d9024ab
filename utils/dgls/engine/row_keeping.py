"""Row keeping: a layer's swap units stay in their slots over a layer-major step's micro-batches of that layer.

A layer-major step (:mod:`.layer_major`) runs each of the caller's layers (a *row*) over all N micro-batches before
the next. A layer streamed whole is one use per micro-batch, repeated, so it is fetched once. A layer streamed as swap
units (:mod:`..streaming.units`) runs its units one after another in each micro-batch (holder, unit 1, ..., unit k,
holder, unit 1, ...): left to the slot policy, the prefetch after unit k reaches for the next layer's units and
evicts unit 1, which the next micro-batch needs at once, so each unit was fetched about once per micro-batch.

What :class:`RowKeeping` tells the engine (:meth:`~.swapper.LayerSwapper.keep_for_repeats`), per micro-batch of a row
    - Kept: in every micro-batch but the row's last, the row's streamed entries, when they fit the slots (no more of
      them than the pool has slots): no prefetch evicts them, so each stays resident from its first fetch to the
      row's last micro-batch. In the last micro-batch nothing is kept and the slot policy is the one of a single
      micro-batch (a unit the layer is done with makes room for the next layer's). Layers whose units outnumber the
      slots keep nothing (keeping some would leave the others no slot): their units are fetched per micro-batch.
    - Repeating: in every micro-batch but the row's first, the uses repeat the first's: the use predictor moves
      without learning (:meth:`~..streaming.schedule.UsePredictor.relocate`), so its tables stay those of one
      micro-batch, and in the last micro-batch it predicts the next layer's units after unit k (the prefetch of one
      micro-batch), not unit 1 again.

Invariants
    - Correctness never depends on it: it changes only which slots a prefetch may take and what the predictor learns.
      A demand fetch may still evict a kept entry (a use the first micro-batch did not make), and every fetch,
      release and wait is the engine's as before.
    - The row's index is the caller's layer index of the engine's entries (:attr:`~..streaming.units.Entry.layer`):
      the schedule's layers are the swapper's layers, one each (the demo's and diffusion-pipe's stage lists). When
      their counts differ nothing is kept (the predictor's repeats still hold: they concern the schedule alone).
    - Between steps nothing is kept or repeating (:meth:`close`).
"""

from __future__ import annotations

from .swapper import LayerSwapper


class RowKeeping:
    """The engine's side of one layer-major step's rows (see the module doc)."""

    def __init__(self, swapper: LayerSwapper, rows: int, micro_batches: int) -> None:
        self.swapper, self.count = swapper, micro_batches
        units: dict[int, list[int]] = {}
        for idx, entry in enumerate(swapper.entries):
            units.setdefault(entry.layer, []).append(idx)
        self._entries = units if len(units) == rows else {}  # caller's layer -> its entries (see the invariants)

    def micro_batch(self, row: int, position: int) -> None:
        """``position``: the micro-batch's place in the row's run (0: the row's first, ``count - 1``: its last)."""
        kept: frozenset[int] = frozenset()
        if position < self.count - 1:
            streamed = [i for i in self._entries.get(row, ()) if self.swapper.is_streamed(i)]
            if len(streamed) <= len(self.swapper.pool.slots):
                kept = frozenset(streamed)
        self.swapper.keep_for_repeats(kept, repeating=position > 0)

    def close(self) -> None:
        self.swapper.keep_for_repeats(frozenset(), repeating=False)
