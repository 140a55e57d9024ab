"""A pipeline stage's ``train_batch`` as one step for DGLS: :func:`train_batch_block`.

Why
    - With several pipeline stages, DeepSpeed's ``TrainSchedule`` interleaves a stage's micro-batches (1F1B: on
      the first of two stages, micro-batch 2's forward runs before micro-batch 1's backward).
    - DGLS acts between passes (the VRAM planner measures a placement, then re-places layers: swap units
      checkpointed or not, the inputs of checkpointed calls kept or sent home). Acting after micro-batch 0's
      backward would change the placement while micro-batch 1 awaits its backward: its recompute would run under
      another placement than its forward and save other tensors (torch's ``CheckpointError`` on the CPU; on two
      H200s the 2-stage Flux benchmark's first stage stopped at its planner's first trial).
    - So the stage's step runs inside :meth:`~..engine.swapper.LayerSwapper.one_step`: the planner acts before the
      next step starts (or at an eval forward between steps). Each backward still ends its pass (the planner counts
      every micro-batch's pass).

With one stage the schedule runs each micro-batch's forward, then its backward: nothing changes.

Not changed here: the planner's windows still run from one pass end to the next, so on an interleaved stage its probe
records a mix of micro-batches (the first stage's F0 F1 B0), not one micro-batch's pass; its predictions are of that
mix, and each trial is checked by measured step times.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from deepspeed.runtime.pipe.engine import PipelineEngine

    from ..engine.swapper import LayerSwapper


def train_batch_block(engine: PipelineEngine, swapper: LayerSwapper | None) -> AbstractContextManager[None]:
    """The block around one ``engine.train_batch``: :meth:`~..engine.swapper.LayerSwapper.one_step` with several
    pipeline stages (see the module doc), nothing otherwise (or without a swapper)."""
    if swapper is None or engine.num_stages == 1:
        return contextlib.nullcontext()
    return swapper.one_step()
