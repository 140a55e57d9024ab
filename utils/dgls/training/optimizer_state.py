"""Optimizer state, measured: the bytes an optimizer class keeps for a param of a given shape and dtype.

Why
    A static guess per type is wrong for the classes that matter most for host RAM: bitsandbytes' 8-bit moments
    (about 2 bytes a param, 32-bit state below 4096 elements), factored second moments (CAME: rows + columns),
    Kahan buffers in the weights' dtype, Prodigy's copy of the initial weights. The one way to be right for every
    class, including one DGLS did not read, is to build it and look: the host RAM check, the start-up line
    (:class:`~..memory.layout.TrainingLayout`) and the VRAM planner (:mod:`..engine.training_costs`) all count
    with :class:`StateRate`.

The measuring rule (:func:`measure_rate`)
    - A param's state is the sum of ``nbytes`` of the tensors of more than 0 dims in ``optimizer.state[param]``
      after one step (:func:`held_bytes`): step counts and other scalars aside, a tensor shared by several params
      (bitsandbytes' quantization maps) counted for each, as the sum over ``optimizer.state`` counts it.
    - Shapes of fewer than :data:`EXACT_BELOW` elements are measured on the shape itself (cheap; thresholds such
      as bitsandbytes' 4096 lie there), once per shape.
    - Larger ones follow a form fitted on probes: 1-D ``a + b * n``; 2-D and more
      ``a + b * numel + c * rows + d * cols`` (rows: the first dim, cols: the others), from four 2-D probes, which
      is exact for elementwise state and state factored over rows and columns; for blockwise-quantized state (a
      rate a param that is not a whole number) it errs high by at most :data:`ROUNDING` bytes a param (the last
      block's scales). A fifth probe of another size checks the fit; a class it does not fit, and a factored class
      on a param of more than 2 dims, are measured on the shape itself.

Hazards
    - A class whose state changes form above the probes' sizes (a threshold beyond :data:`EXACT_BELOW` elements)
      is counted as below it.
    - Measuring runs the class's step on CPU tensors: a class that cannot fails in :func:`measure_rate` (callers
      say what to do in one line).
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable

import torch
from torch import nn

Build = Callable[[list[torch.Tensor]], torch.optim.Optimizer]  # an optimizer over a param list
EXACT_BELOW = 1 << 16  # elements: smaller shapes are measured on the shape itself
MATRIX_PROBES = ((128, 128), (256, 128), (128, 256), (256, 256))  # rows x cols, each at least EXACT_BELOW / 4
MATRIX_CHECK = (384, 640)  # a fifth 2-D shape the fit must predict
VECTOR_PROBES = (EXACT_BELOW, 2 * EXACT_BELOW)
VECTOR_CHECK = 3 * EXACT_BELOW + 4096
ROUNDING = 8  # bytes a param the fit may miss by: the last block's scale of two blockwise-quantized moments


def held_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> int:
    """Bytes of the state tensors (more than 0 dims) ``optimizer`` holds for ``params`` (default: every param)."""
    states = optimizer.state.values() if params is None else [optimizer.state.get(p, {}) for p in params]
    return sum(t.nbytes for state in states for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def measure_shape(build: Build, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of the state ``build([param])`` keeps for one param of ``shape`` and ``dtype`` after one step."""
    param = nn.Parameter(torch.zeros(shape, dtype=dtype))
    param.grad = torch.full_like(param, 1e-3)
    with contextlib.redirect_stdout(io.StringIO()):  # some classes count their params aloud
        optimizer = build([param])
        optimizer.step()
    return held_bytes(optimizer)


class StateRate:
    """What an optimizer class keeps for a param, by shape (see the module doc for the rule).

    Invariants
        - :meth:`bytes` of a shape is what :func:`measure_shape` gives for it, or at most :data:`ROUNDING` bytes more.
        - Shapes measured on themselves are kept per instance (each measured once).
    """

    def __init__(
        self,
        build: Build,
        dtype: torch.dtype,
        vector: tuple[float, float] | None,
        matrix: tuple[float, float, float, float] | None,
    ) -> None:
        self._build, self.dtype = build, dtype
        self.vector, self.matrix = vector, matrix  # the fitted forms; None: measured on each shape
        self._measured: dict[tuple[int, ...], int] = {}

    @property
    def factored(self) -> bool:
        """The fitted 2-D form has a row or column term (state factored over the two)."""
        return self.matrix is not None and (self.matrix[2] != 0 or self.matrix[3] != 0)

    def bytes(self, shape: tuple[int, ...] | torch.Size) -> int:
        shape = tuple(shape)
        numel = math.prod(shape)
        fitted = None
        if numel >= EXACT_BELOW:
            if len(shape) == 1 and self.vector is not None:
                fitted = self.vector[0] + self.vector[1] * numel
            elif len(shape) == 2 or (len(shape) > 2 and not self.factored):
                if self.matrix is not None:
                    a, b, c, d = self.matrix
                    fitted = a + b * numel + c * shape[0] + d * (numel // shape[0])
        if fitted is not None:  # a fractional rate a param: blockwise scales, whose last block rounds up
            blockwise = self._rate(len(shape)) % 1 != 0
            return math.ceil(fitted - 1e-6) + (ROUNDING if blockwise else 0)
        if shape not in self._measured:
            self._measured[shape] = measure_shape(self._build, shape, self.dtype)
        return self._measured[shape]

    def _rate(self, dims: int) -> float:
        form = self.vector if dims == 1 else self.matrix
        return form[1] if form is not None else 0.0


def _fits(predicted: float, measured: int) -> bool:
    return abs(predicted - measured) <= ROUNDING


def measure_rate(build: Build, dtype: torch.dtype) -> StateRate:
    """The :class:`StateRate` of the optimizer ``build`` makes, for params of ``dtype`` (CPU tensors, one step)."""
    (r1, c1), (r2, _), (_, c2), _ = MATRIX_PROBES
    f11, f21, f12, f22 = (measure_shape(build, shape, dtype) for shape in MATRIX_PROBES)
    b = (f22 - f21 - f12 + f11) / ((r2 - r1) * (c2 - c1))
    c = (f21 - f11 - b * (r2 - r1) * c1) / (r2 - r1)
    d = (f12 - f11 - b * r1 * (c2 - c1)) / (c2 - c1)
    a = f11 - b * r1 * c1 - c * r1 - d * c1
    rows, cols = MATRIX_CHECK
    matrix: tuple[float, float, float, float] | None = (a, b, c, d)
    if not _fits(a + b * rows * cols + c * rows + d * cols, measure_shape(build, MATRIX_CHECK, dtype)):
        matrix = None
    n1, n2 = VECTOR_PROBES
    g1, g2 = (measure_shape(build, (n,), dtype) for n in VECTOR_PROBES)
    slope = (g2 - g1) / (n2 - n1)
    vector: tuple[float, float] | None = (g1 - slope * n1, slope)
    if not _fits(vector[0] + slope * VECTOR_CHECK, measure_shape(build, (VECTOR_CHECK,), dtype)):
        vector = None
    return StateRate(build, dtype, vector, matrix)
