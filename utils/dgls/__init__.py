"""DGLS: stream transformer layers between host memory and the GPU, overlapped with compute.

Public API::

    from utils.dgls import LayerSwapper, SwapConfig
    with LayerSwapper(layers, SwapConfig(blocks_to_swap=20, prefetch=2), device="cuda") as swapper:
        ...train...
        print(swapper.step_stats().line())
"""

from .config import SwapConfig
from .errors import DGLSUserError, SwapWorkerError
from .placement import Placement, plan_placement
from .stats import StepStats
from .swapper import LayerSwapper

__all__ = ["DGLSUserError", "LayerSwapper", "Placement", "StepStats", "SwapConfig", "SwapWorkerError", "plan_placement"]
