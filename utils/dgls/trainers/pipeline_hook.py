"""Where DGLS takes over a DeepSpeed pipeline's layers: right after a stage builds them.

DeepSpeed's ``PipelineModule.__init__`` partitions the layer list across the pipeline stages,
builds this process's stage (``_build``: its layers go into ``forward_funcs``) and then moves
the whole module to the GPU (``self.to(...)``). For the duration of a run, :class:`StageHook`
wraps ``PipelineModule._build`` so that as soon as a stage's layers are built, and before that
move, ``install(stage)`` gets them: the caller builds a :class:`~..engine.swapper.LayerSwapper` over the
stage's layers, whose streamed weights then point at empty placeholders, so the move (and the
one in ``deepspeed.initialize``) copies only resident weights.

This works the same for one stage (every layer), for several (each process its own slice), for
data-parallel replicas (each process its own swapper on its own GPU), and whatever the trainer
(the demo, diffusion-pipe's ``ManualPipelineModule``): partitioning sees the real parameter counts,
since nothing is streamed before it.

With ``offload_activations``, the built module's own ``activation_checkpoint_func`` (an attribute of
that instance, which DeepSpeed calls for each checkpointed layer range) is replaced by the swapper's
wrapper around it (:meth:`~..engine.swapper.LayerSwapper.checkpoint_function`); the module is the run's, so
nothing global changes and nothing needs restoring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DGLSUserError
from ..program.patches import Patches


@dataclass(frozen=True)
class Stage:
    """This process's part of a pipeline."""

    layers: list  # the stage's layers in order (modules, or plain functions between them)
    start: int  # index of its first layer in the whole layer list
    stage_id: int
    num_stages: int
    data_parallel_id: int  # which replica of the stage this process is
    data_parallel_size: int
    layer_count: int  # layers of the whole pipeline, every stage's together

    @property
    def stop(self) -> int:
        return self.start + len(self.layers)

    @property
    def share_group(self) -> str:
        """Processes of the same stage host the same layers (their masters are shared on a machine)."""
        return f"stage {self.stage_id}"

    @property
    def label(self) -> str:
        """'' for one stage; 'stage 2 of 4 (layers 20-39): ' otherwise, for start-up lines."""
        if self.num_stages == 1:
            return ""
        return f"stage {self.stage_id + 1} of {self.num_stages} (layers {self.start}-{self.stop - 1}): "


def check_every_stage_has_layers(parts: list[int], count: int) -> None:
    """DeepSpeed's split of the layer list (stage i holds ``parts[i]:parts[i + 1]``) leaves no stage empty.

    With more stages than layers (or a split by parameters that gives one stage nothing) the process of an
    empty stage could place nothing while the others go on into gloo and fail there. Every process sees the
    whole split, so every one of them stops here, with the same line, before any of them communicates."""
    empty = [i + 1 for i in range(len(parts) - 1) if parts[i + 1] <= parts[i]]
    if empty:
        stages = len(parts) - 1
        raise DGLSUserError(
            f"pipeline_stages = {stages} leaves pipeline stage(s) {', '.join(map(str, empty))} of {stages} without "
            f"any of the model's {count} layers: set pipeline_stages lower in the training TOML"
            + (f" ({count} at most)" if stages > count else "")
        )


class StageHook:
    """A context manager: while it is open, each ``PipelineModule`` built calls ``install(stage)``, which
    returns the stage's swapper (or None)."""

    def __init__(self, install: Callable[[Stage], Any]) -> None:
        self.install = install
        self.patches = Patches()

    def __enter__(self) -> StageHook:
        from deepspeed.runtime.pipe.module import PipelineModule

        if "_build" not in PipelineModule.__dict__:
            import deepspeed

            raise DGLSUserError(
                f"DeepSpeed {deepspeed.__version__}'s PipelineModule has no _build, where DGLS takes over a stage's "
                "layers: use the DeepSpeed version requirements.txt names, or report this one"
            )
        self.patches.replace(PipelineModule, "_build", self._wrap_build)
        return self

    def _wrap_build(self, original):
        def build_then_install(module, *args, **kwargs):
            if (parts := getattr(module, "parts", None)) is not None:  # set by _partition_layers, before _build
                check_every_stage_has_layers(parts, len(module._layer_specs))
            result = original(module, *args, **kwargs)
            grid = module._grid
            stage = Stage(
                list(module.forward_funcs),
                module._local_start,
                module.stage_id,
                module.num_stages,
                grid.get_data_parallel_id(),
                grid.get_data_parallel_world_size(),
                len(module._layer_specs),
            )
            swapper = self.install(stage)
            if swapper is not None and getattr(module, "activation_checkpoint_func", None) is not None:
                module.activation_checkpoint_func = swapper.checkpoint_function(module.activation_checkpoint_func)
            return result

        return build_then_install

    def __exit__(self, *exc) -> None:
        self.patches.restore()
