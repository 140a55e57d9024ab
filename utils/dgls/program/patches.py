"""Patches: attributes of other libraries replaced for one run and put back afterwards.

Every replacement DGLS makes goes through :class:`Patches` and is documented where it is
installed (:mod:`..trainers.pipeline_hook`, :mod:`..trainers.diffusion_pipe`); :meth:`Patches.restore` undoes them in
reverse order, and each replacement carries the original as ``__wrapped__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Patches:
    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name]
        replacement = make(original)
        replacement.__wrapped__ = original
        self._saved.append((owner, name, original))
        setattr(owner, name, replacement)

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
