"""Full fine-tuning as a feature of the engine: :class:`~.host_training.HostTraining` on its lifecycle.

What it adds to the engine
    - Fetch gates: a streamed layer's packed copy holds its latest update before it is copied into a slot
      (host updates are waited for; a device update's copy is a gate the weight copy waits behind; data
      parallel: another owner's layer waits for its owner's publication, :mod:`.data_parallel`).
    - A gradient arriving is a use of its layer (autograd writes ``.grad`` with the param's shape, and a
      streamed param's shape is empty while it is out).
    - After each backward: the open gradient batches are closed and every host-trained layer is evicted,
      since its slot copy is older than its next update.
    - True values: the fp32 masters of host-trained params (state dicts, ``true_weights``, ``remove``).
    - Placement is fixed: the optimizer state of streamed layers lives on the host. The one exception is the
      VRAM planner's plan (``plan_fix``), applied once before the first update: the layers it makes resident
      leave the host training, their step-1 gradients put on their device params for the trainer's optimizer
      (:mod:`..planning.autoplan`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import torch

from ..errors import DGLSUserError
from ..memory.layout import TrainingLayout, human_bytes
from ..memory.shm_space import local_processes
from ..memory.transport import Transport
from ..streaming.feature import Engine, Feature
from ..streaming.masters import Masters
from ..streaming.placement import Placement
from ..streaming.schedule import current_phase
from .data_parallel import SharedGradients, check_shared
from .device_update import DeviceUpdater
from .disk_state import DiskState
from .host_optimizer import HostOptimizerSpec
from .host_training import HostTraining


def processes_here(sharing: int, environ: Mapping[str, str] = os.environ) -> int:
    """The processes whose host updates share this machine's cores (:func:`.updaters.update_threads`): the job's
    processes here, by the launcher's count (pipeline stages too) or the processes ``sharing`` this one's host copy
    (:class:`~..memory.peers.Peers`), whichever is more; 1 where ``OMP_NUM_THREADS`` is set, since that is already
    one process's count (torchrun sets it to 1 for several processes)."""
    if "OMP_NUM_THREADS" in environ:
        return 1
    return max(local_processes(environ) or 1, sharing)


class TrainingFeature(Feature):
    """Full fine-tuning of the streamed layers' trainable params on the host (or the device's update path)."""

    def __init__(
        self, training: HostTraining, note: str, replaceable: bool = False, shared: SharedGradients | None = None
    ) -> None:
        self.training = training
        self.shared = shared  # data parallel: the reduce hooks and the step's publication (.data_parallel)
        # data parallel, on the process that writes a save: the other owners' masters, lent for it (.shared_saves)
        self.lent: dict[int, torch.Tensor] = {}
        self.note = note  # the start-up line of its host RAM (check_host_training)
        self._replaceable = replaceable  # the VRAM planner's one re-placement, before any update, is to come
        self._evict: Callable[[Iterable[int]], None] = lambda indices: None  # the engine's, from install

    @classmethod
    def start(
        cls,
        masters: Masters,
        layout: TrainingLayout,
        transport: Transport,
        spec: HostOptimizerSpec,
        note: str,
        *,
        device: torch.device,
        threading: bool,
        accumulation_steps: int,
        clipping: bool,
        plan_fix: Callable[[bool], None] | None = None,
        speculate: bool = True,
        shared: SharedGradients | None = None,
        disk_state: DiskState | None = None,
        clip_mode: str = "exact",
    ) -> TrainingFeature:
        """fp32 masters, gradient landings and the optimizer of the streamed layers, allocated from ``layout`` (the
        same object :func:`~.host_training.check_host_training` measured before packing; ``note``: its line).
        ``plan_fix``: the VRAM planner's, called before the first step's updates (its one re-placement).
        ``shared``: data parallel, ``layout`` holding this process's share of the layers (:mod:`.data_parallel`)."""
        if shared is not None:
            check_shared(shared.ownership, masters.peers.local_ranks)
            if masters.versions is None:
                raise AssertionError("the processes share a host copy (check_shared), so it has versions")
            shared.attach_versions(masters.versions, masters.peers.running)
        elif masters.peers.shared:
            raise DGLSUserError(
                "full fine-tuning of streamed layers by data-parallel processes shares their training "
                "(data_parallel = True in the training policy; the demo and dgls_train.py set it); without it each "
                "process would update the shared host masters: set it, use pipeline_stages = number of GPUs, or "
                "train a LoRA"
            )
        cuda = device.type == "cuda"
        training = HostTraining(
            {idx: masters.host(idx) for idx in layout.layers},
            spec,
            transport,
            pin=cuda,
            threaded=cuda or threading,
            accumulation_steps=accumulation_steps,
            clipping=clipping,
            updater=DeviceUpdater(transport) if spec.on_device else None,
            layout=layout,
            first_step=plan_fix,
            speculate=speculate,
            host_norm_sum=shared.norm_sum if shared is not None else None,
            after_step=shared.publish if shared is not None else None,
            disk_state=disk_state,
            clip_mode=clip_mode,
            processes_here=processes_here(masters.peers.local_ranks),
        )
        return cls(training, note, replaceable=plan_fix is not None, shared=shared)

    def install(self, engine: Engine) -> None:
        self._evict = engine.evict
        use = lambda idx: engine.use(idx, current_phase())  # noqa: E731
        if self.shared is not None:  # its hooks first: the host training's own see the reduced gradients
            self.shared.install(use, self.training.grads.receive)
        self.training.install(use)

    def fetch_gates(self, idx: int) -> list:
        if self.shared is not None:  # a foreign layer: its owner's update in the shared copy first
            self.shared.wait_published(idx)
        gate = self.training.wait_update(idx)
        return [] if gate is None else [gate]

    def after_backward(self) -> None:
        if self.shared is not None:
            self.shared.backward_done()
        self.training.backward_done()
        self._evict(self.training.layers)
        if self.shared is not None:  # updated by their owners before the next fetch
            self._evict(self.shared.ownership.foreign)

    def before_placement(self) -> None:
        if not self._replaceable:
            raise DGLSUserError(
                "full fine-tuning places layers once: the optimizer state of streamed layers lives on the host"
            )
        self._replaceable = False  # the VRAM planner's plan, before any update: the only re-placement

    def placement_changed(self, placement: Placement, kept_activations: int | None) -> None:
        """The layers the plan made resident leave the host training; their gradients of this step go onto their
        params (on the device now), where the trainer's optimizer steps them."""
        resident = set(self.training.layers) - set(placement.streamed)
        with torch.no_grad():
            for param, grad in self.training.release(resident):
                param.grad = grad.to(param.device, param.dtype, copy=True)

    def true_value(self, param: torch.Tensor) -> torch.Tensor | None:
        lent = self.lent.get(id(param))
        return lent if lent is not None else self.training.master_of(param)

    def flush(self) -> None:
        self.training.finish()
        if self.shared is not None:  # the true values of other owners' layers: in the shared copy once published
            for idx in self.shared.ownership.foreign:
                self.shared.wait_published(idx)

    def pinned_bytes(self) -> int:
        return self.training.pinned_bytes()

    def describe(self) -> list[str]:
        scratch = self.training.device_bytes
        on_device = f" ({human_bytes(scratch)} of device buffers)" if scratch else ""
        shared = [self.shared.ownership.line()] if self.shared is not None else []
        share = f" (rank {self.shared.ownership.rank}'s share)" if self.shared is not None else ""
        return [
            f"{self.note}{share}; optimizer of the streamed layers: {self.training.implementation}{on_device}",
            *shared,
            self.training.speculation.line,
        ]

    def close(self) -> None:
        if self.shared is not None:
            self.shared.remove_hooks()
        self.training.close()
