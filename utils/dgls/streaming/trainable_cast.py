"""Trainable cast: ``mixed_precision`` puts the trainable params (and any grads) in its dtype, as a feature.

- Installed last (:mod:`..engine.build` appends it after every other feature): the cast is lossy, and
  :meth:`~..engine.swapper.LayerSwapper.remove` casts back rounded, so nothing after it may fail.
- Its start-up line describes every cast the run makes (``cast_target``, ``autocast`` and this one), after the
  cast, when the number of params it changed is known.
"""

from __future__ import annotations

from ..memory.layout import modules_of
from ..memory.precision import CastRules, cast_trainable, describe
from .feature import Engine, Feature


class TrainableCast(Feature):
    """The trainable params of ``layers`` in ``mixed_precision`` (``"auto"``: left as they are)."""

    def __init__(self, layers: list, rules: CastRules | None, autocast: str | None, mixed_precision: str) -> None:
        self.layers, self.rules, self.autocast, self.mixed_precision = layers, rules, autocast, mixed_precision
        self.changed = 0  # params cast, known once installed

    def install(self, engine: Engine) -> None:
        self.changed = cast_trainable([m for _, m in modules_of(self.layers)], self.mixed_precision)

    def describe(self) -> list[str]:
        if not (self.rules or self.autocast or self.mixed_precision != "auto"):
            return []
        return [describe(self.rules, self.autocast, self.mixed_precision, self.changed)]
