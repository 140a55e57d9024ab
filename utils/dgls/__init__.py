"""DGLS: stream transformer layers between host memory and the GPU, overlapped with compute.

Public API::

    from utils.dgls import LayerSwapper, SwapConfig
    with LayerSwapper(layers, SwapConfig(blocks_to_swap=20, prefetch=2), device="cuda") as swapper:
        ...train...
        print(swapper.step_stats().line())  # the last backward pass
"""

from .config import SwapConfig
from .errors import DGLSUserError, SwapWorkerError
from .listener import Listener
from .placement import Placement
from .stats import StepStats
from .swapper import LayerSwapper

__all__ = ["DGLSUserError", "LayerSwapper", "Listener", "Placement", "StepStats", "SwapConfig", "SwapWorkerError"]
