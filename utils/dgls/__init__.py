"""DGLS: stream transformer layers between host memory and the GPU, overlapped with compute.

The library API, for a training loop of your own (``dgls_train.py`` is the one for diffusion-pipe)::

    from utils.dgls import LayerSwapper, SwapConfig

    layers = model.to_layers()  # an ordered list of modules (plain functions in between are fine)
    # Frozen params of streamed layers go to pinned host memory; trainable params and buffers to the GPU.
    with LayerSwapper(layers, SwapConfig.of(vram_budget=10), device="cuda") as swapper:
        for batch in data:
            loss = run(layers, batch)  # checkpointing (reentrant or not), eval passes: all fine
            # with SwapConfig.of(offload_activations=True), checkpoint with swapper.checkpoint_function(checkpoint)
            loss.backward()  # DGLS sees the end of each backward by itself
            optimizer.step()
            optimizer.zero_grad()
            print(swapper.step_stats().line())  # the last backward pass; reading it changes nothing
    # leaving the block puts every param back where it was, in its dtype

A full fine-tune: give the host optimizer, and let DGLS clip and step the params it trains on the host
(they never hold a ``.grad`` at the step, so your optimizer skips them)::

    from utils.dgls.training.host_optimizer import HostOptimizerSpec

    config = SwapConfig.of(blocks_to_swap=20, host_optimizer=HostOptimizerSpec(lr=1e-5), accumulation_steps=1)
    with LayerSwapper(layers, config, device="cuda") as swapper:
        params = [p for layer in layers for p in layer.parameters()]
        optimizer = torch.optim.AdamW([p for p in params if not swapper.training.owns(p)], lr=1e-5)
        for batch in data:
            run(layers, batch).backward()
            swapper.training.clip_grad_norm_(params, 1.0)  # one norm over host and device params
            optimizer.step()
            optimizer.zero_grad()
            swapper.training.step()  # queue the host updates; the next forward waits per layer

Gradient accumulation, layer-major: each layer runs over all of a step's micro-batches before the next, so each
streamed layer is copied in once for the forward and once for the backward however many micro-batches there are,
with the numbers of the same micro-batches run one after another (:mod:`utils.dgls.engine.layer_major`)::

    from utils.dgls import layer_major_step

    run = [partial(checkpoint, layer, use_reentrant=False) for layer in layers]  # each as your loop runs it
    losses = layer_major_step(run, [inputs for inputs, _ in micro], lambda out, m: loss_fn(out, micro[m][1]), swapper)
    optimizer.step()  # a full fine-tune: build the swapper with accumulation_steps=1 (the host sees one gradient)

Where a ``vram_budget`` sizes swap units, tell the builder the step's count,
``SwapConfig.of(vram_budget=10, layer_major_micro_batches=len(micro))``: it then sizes them so each layer's units stay
in the slots over the micro-batches where a unit size allows (:mod:`utils.dgls.planning.unit_choice`); untold, it
sizes them for one, and where units then come again in each micro-batch a line says how to size them for the count.

With ``vram_budget`` instead of ``blocks_to_swap`` the plan is made at step 1 and fixed before its first update: build
the optimizer over every trainable param (those trained on the host have no ``.grad`` at its step, and the layers the
plan keeps resident bring step 1's), and let DGLS hear of the step before your optimizer does:
``clip_grad_norm_`` does, or call ``swapper.training.before_step()`` first.

A loop whose micro-batches interleave (a pipeline schedule: the forward of one before the backward of the one
before it) runs each step inside ``with swapper.one_step():``, so the planner re-places layers between steps, never
while a micro-batch awaits its backward (DGLS's DeepSpeed trainers do this with several pipeline stages).

``SwapConfig.of`` takes each setting by its option's name (``--prefetch`` is ``prefetch``); the same settings
grouped by the part that reads them are ``SwapConfig``'s policies (``config.placement.prefetch``,
``SwapConfig(placement=PlacementPolicy(blocks_to_swap=20))``, :mod:`utils.dgls.streaming.config`).

``swapper.total_stats()`` counts everything since the start (``later.since(earlier)`` gives a stretch,
such as an optimizer step of several micro-batches); neither call waits for the GPU unless asked
(``sync=True``). ``swapper.placement_table()`` shows where each layer lives, and
``swapper.placement.predicted_device_bytes`` the device memory of weights, buffers and the slot pool
before step 1 (activations come on top). ``state_dict()`` of a streamed layer returns its true weights
and ``load_state_dict()`` writes them, wherever they live.

The package, from the bottom up: each folder's ``__init__`` says what it owns and what it may import, and
``tests/test_layers.py`` holds every import to that.

    errors.py, spelling.py, torch_private.py   what everything may use: error types, "did you mean", the
                                               private torch APIs DGLS calls
    memory/       the transport (every stream, event and copy worker) and the memories it moves bytes between
    streaming/    the parts each streamed layer goes through: settings, placement, hooks, residency, masters;
                  the feature lifecycle
    watching/     listeners: statistics and the --profile timeline
    activations/  training/  planning/        the features: activation offload, full fine-tuning, the planner
    engine/       LayerSwapper and the builder that makes its parts
    program/      dgls_train.py's process: options, checks, processes, how it ends
    trainers/     demo/         diffusion-pipe's train.py and DeepSpeed's engine; the embedded demo
"""

from .engine.layer_major import layer_major_losses, layer_major_step
from .engine.swapper import LayerSwapper
from .errors import DGLSUserError, SwapWorkerError
from .streaming.config import SwapConfig
from .streaming.placement import Placement
from .watching.listener import Listener
from .watching.stats import StepStats

__all__ = [
    "DGLSUserError",
    "LayerSwapper",
    "Listener",
    "Placement",
    "StepStats",
    "SwapConfig",
    "SwapWorkerError",
    "layer_major_losses",
    "layer_major_step",
]
