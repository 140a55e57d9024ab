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

    from utils.dgls.host_optimizer import HostOptimizerSpec

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

``SwapConfig.of`` takes each setting by its option's name (``--prefetch`` is ``prefetch``); the same settings
grouped by the part that reads them are ``SwapConfig``'s policies (``config.placement.prefetch``,
``SwapConfig(placement=PlacementPolicy(blocks_to_swap=20))``, :mod:`utils.dgls.config`).

``swapper.total_stats()`` counts everything since the start (``later.since(earlier)`` gives a stretch,
such as an optimizer step of several micro-batches); neither call waits for the GPU unless asked
(``sync=True``). ``swapper.placement_table()`` shows where each layer lives, and
``swapper.placement.predicted_device_bytes`` the device memory of weights, buffers and the slot pool
before step 1 (activations come on top). ``state_dict()`` of a streamed layer returns its true weights
and ``load_state_dict()`` writes them, wherever they live.
"""

from .config import SwapConfig
from .errors import DGLSUserError, SwapWorkerError
from .listener import Listener
from .placement import Placement
from .stats import StepStats
from .swapper import LayerSwapper

__all__ = ["DGLSUserError", "LayerSwapper", "Listener", "Placement", "StepStats", "SwapConfig", "SwapWorkerError"]
