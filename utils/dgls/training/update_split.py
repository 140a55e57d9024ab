"""Update split: which host-trained layers take their optimizer step on the device, and which on the CPU.

Why
    A streamed layer's step (AdamW, or SGD: :mod:`.optimizer_kernels`) can run on the CPU (torch's fused
    kernel, bound by the cores and host memory) or on the device (:mod:`.device_update`, bound by the link:
    for AdamW 14 bytes in and 14 out per param). The strategy that uses this is :class:`~.updaters.SplitUpdater`.
    The two use different resources, so running both at once updates a step's params faster than either
    alone. With gradient clipping every update waits for the end of backward, and the next forward
    waits for each layer's update in turn: how fast all updates are done, in the forward's order, is
    what the step waits for.

Rule (:meth:`UpdateSplit.assign`, before a step's updates are queued)
    Layers are taken in the order they are updated (the next forward's); each goes to whichever side
    would finish it sooner, given the work already given to that side this step and its rate (params
    per second). Both sides then progress through the forward's order together, and finish together.

Rates
    Each side's rate is measured on the steps it ran (:meth:`record_host`, :meth:`record_device`): the
    host's from the seconds its update jobs took, the device's from its streams: with clipping every
    update of a step is queued at once, and their span is timed; without, the updates trickle in during
    backward, so each chunk is timed from the moment its waits (the gradients' copy home) are met to its
    last copy home, and the union of those intervals is the time the device spent on them
    (:func:`~.device_update.busy_seconds`; the gaps where it waited for gradients are left out). A new
    measurement is averaged with the last rate, so a noisy step moves the split by half. Until a side has
    been measured, both sides are taken to be equally fast: the first step splits the params in half.

Invariants
    - Every layer is on exactly one side for a step; the split only changes between steps.
    - Which side updates a layer never changes its numbers: both run the same fused arithmetic (AdamW or
      SGD) on the same host state (checked bitwise on the CPU), so the split is a matter of speed alone.
"""

from __future__ import annotations

from collections.abc import Iterable


class UpdateSplit:
    """Layer sizes in params, per-side rates, and the current assignment (see the module doc)."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = dict(sizes)  # layer index -> trained params, in update order
        self.rates: dict[str, float | None] = {"host": None, "device": None}  # params per second
        self.on_device: dict[int, bool] = {}
        self.assign()

    def record_host(self, params: int, seconds: float) -> None:
        self._record("host", params, seconds)

    def record_device(self, params: int, seconds: float) -> None:
        self._record("device", params, seconds)

    def _record(self, side: str, params: int, seconds: float) -> None:
        if params <= 0 or seconds <= 0:
            return
        measured = params / seconds
        last = self.rates[side]
        self.rates[side] = measured if last is None else (last + measured) / 2

    def assign(self, order: Iterable[int] | None = None) -> dict[int, bool]:
        """Give each layer (in ``order``, default: index order) to the side that would finish it sooner."""
        host, device = self.rates["host"], self.rates["device"]
        if host is None or device is None:
            host = device = 1.0
        busy = {"host": 0.0, "device": 0.0}
        for idx in order if order is not None else sorted(self.sizes):
            n = self.sizes[idx]
            on_host, on_device = busy["host"] + n / host, busy["device"] + n / device
            self.on_device[idx] = on_device <= on_host
            busy["device" if self.on_device[idx] else "host"] = min(on_host, on_device)
        return self.on_device

    @property
    def device_share(self) -> float:
        """The share of the params the device updates under the current assignment."""
        total = sum(self.sizes.values())
        return sum(n for idx, n in self.sizes.items() if self.on_device.get(idx)) / total if total else 0.0

    def describe(self) -> str:
        rates = ", ".join(f"{side} {rate / 1e9:.2f}G params/s" for side, rate in self.rates.items() if rate is not None)
        return f"device {self.device_share:.0%} of the params" + (f" ({rates})" if rates else "")
