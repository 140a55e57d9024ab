"""DeepSpeed's CPU shared-memory all-reduce op (``deepspeed_shm_comm``), kept out of DGLS runs.

On DeepSpeed's CPU accelerator, ``deepspeed.init_distributed`` builds its communication backend
(``deepspeed/comm/torch.py``: ``TorchBackend.__init__`` calls ``build_shm_op``), which loads this C++
op, compiling it into torch's extensions folder (``TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions/<python>_cpu``) the first time. Under a launcher (``LOCAL_SIZE`` set) the
op's ``initialize`` then creates a 66 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` per process, which
DeepSpeed never unlinks.

A DGLS run has no use for the op, with one process or several: DeepSpeed 0.18.4 to 0.19.8 call it only
from ``inference_all_reduce`` (the tensor-parallel layers of ``deepspeed/module_inject``, for
inference); training's collectives (the gradient all-reduce, the pipeline's send and receive) go to
``torch.distributed`` (gloo on a CPU) either way. Loading it cost DGLS users:

- minutes of silence on the first run (a C++ build; DGLS mutes DeepSpeed's start-up output);
- a wait forever on the build's ``lock`` file once a build was killed (torch's ``FileBaton`` polls it
  with no time limit, also when the op is built already);
- a rebuild at each switch between virtual environments that share the extensions folder;
- a crash in clean-up, a hang or a SIGBUS when ``/dev/shm`` is read-only or small, and 66 MB left
  in ``/dev/shm`` per process after a crash.

How: ``build_shm_op`` returns None, and DeepSpeed goes on without the op, when DeepSpeed's table of
compatible ops (``deepspeed.ops.__compatible_ops__``, a dict filled once per process and read there
before building) says the op is not compatible. :func:`without_shm_op` sets that entry to False for
the duration of a run and restores it after; no function is replaced. Installed around
``init_distributed`` by the demo (``demo/train.py``) and around diffusion-pipe's train.py by the
drop-in (``diffusion_pipe.run_drop_in``; train.py calls ``deepspeed.init_distributed()`` itself).

Invariants:

- only the op's own entry of the table changes, only inside the ``with`` block, and it is restored
  (also after an exception or Ctrl-C);
- the table is touched only where DeepSpeed's accelerator has the op (the CPU accelerator); on CUDA
  ``build_shm_op`` returns None before reading it, and nothing changes;
- tests/test_startup.py checks, with the installed DeepSpeed (CI: also 0.18.4), that ``build_shm_op``
  builds nothing under it: a DeepSpeed that decides otherwise fails there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

SHM_OP_BUILDER = "ShareMemCommBuilder"  # the accelerator's builder class name, as build_shm_op asks for it
_ABSENT = object()


@contextlib.contextmanager
def without_shm_op() -> Iterator[None]:
    """Inside the block, ``deepspeed.init_distributed`` neither builds nor loads ``deepspeed_shm_comm``."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_OP_BUILDER)
    if builder is None:  # no such op on this accelerator (CUDA): DeepSpeed never builds it
        yield
        return
    table = deepspeed.ops.__compatible_ops__
    before = table.get(builder.NAME, _ABSENT)
    table[builder.NAME] = False
    try:
        yield
    finally:
        if before is _ABSENT:
            table.pop(builder.NAME, None)
        else:
            table[builder.NAME] = before
