"""bitsandbytes' 8-bit AdamW step on the device: ``[optimizer] type = 'AdamW8bit'`` for streamed layers.

Why
    diffusion-pipe's ``AdamW8bit`` is ``bitsandbytes.optim.AdamW8bit``: two moments kept as blockwise 8-bit codes
    (2 bytes a param with their scales, against AdamW's 8), the state that brings a Flux-dev full fine-tune's host
    RAM within 128 GiB (benchmarks/results/host_ram_flux.md). On the host its step is bitsandbytes' CPU code,
    whose (de)quantization ran on one core: 15 ns a param with 24 of the lent machine's 32 cores, 20 s a step for 1.3B
    trained params (benchmarks/results/full_flux_small_AdamW8bit.md), three minutes for Flux-dev's 11.9B. On the
    device the same class's CUDA kernel steps a param in one pass over its bytes.

What runs
    The layer's own ``AdamW8bit`` (built on the host masters, as for host updates) keeps the state and the
    hyper-parameters; checkpoints are its own. Each step, :class:`~.device_update.DeviceUpdater` copies a param's
    master, gradient and state tensors (:meth:`Bitsandbytes8bitKernel.keys_of`) into its scratch, and
    :meth:`Bitsandbytes8bitKernel.step_params` makes the calls the class's ``update_step`` makes, with the class's
    own config (:meth:`get_config`): ``optimizer_update_8bit_blockwise`` for a param with 8-bit state,
    ``optimizer_update_32bit`` for one below ``min_8bit_size`` (bitsandbytes keeps those moments in fp32). State
    is created by the class's ``init_state`` at the param's first update (under a VRAM budget, after the plan:
    only the layers it streams hold it), then page-locked. The numbers are the class's on that device: on
    the CPU (tests) bitwise those of a host update.

Layout of a param's state (the class's): ``state1``, ``state2`` (uint8 codes shaped as the param, or fp32 below
``min_8bit_size``), ``absmax1``, ``absmax2`` (fp32, one per 256 elements; 8-bit only), ``qmap1``, ``qmap2`` (the
256 code values, one pair shared by a layer's optimizer; each distinct pair is copied to the device once, on the
in-stream before any kernel of its chunk, and kept), ``step`` (a Python int, counted by the updater before the
kernel runs).

Hazards handled
    - bitsandbytes launches its CUDA kernels on the device's legacy default stream, not on torch's current
      stream (the updater's in-stream): around a chunk's calls the default stream waits for everything queued on
      the in-stream so far (the chunk's copies in, its code maps', and through the in-stream's gates the
      gradients' copies home and the previous chunk's copy home), and the in-stream (the copies home) waits for
      everything queued on the default stream so far. The default stream is the training's compute stream: the
      backward queued after a layer's update waits for the layer's gradients to go home and its state to come in,
      about 10 bytes a param over the link (a tenth of a second for a Flux-dev double block at 25 GB/s), so the
      update's transfers are on the step's critical path, where AdamW's and SGD's overlap the backward. Its cost
      is measured by ``bench_full``'s rows (its 'GPU wait' column).
    - ``launch = "triton"`` (:data:`LAUNCHES`; the library API's and the benchmarks' choice) steps with
      bitsandbytes' Triton kernels of the same updates, written for Intel GPUs and launched on torch's current
      stream: the updater's in-stream, so the compute stream waits for nothing. Their (de)quantization is their
      own: the numbers are bitsandbytes' AdamW8bit, not bitwise those of its CUDA kernel. CUDA only; ``skip_zeros``
      is refused by them. Measured on an H200 in DGLS with every copy delayed (tests/test_host_training_gpu.py, its
      Triton tests), against resident training on the CUDA kernel: step 1's calls get the same inputs in both
      launches; each Triton call's outputs equal the same call's on fresh copies of its arguments, its master
      within 1e-5 of the CUDA kernel's; after two steps the fp32 masters part in their last bits almost everywhere
      (98.5% of 500M), by 0.43% of the move on average and by more than half the learning rate at 0.05% (codes
      that round the other way), the same with the device synchronized around every call: no ordering sets them.
      Not the default, since its numbers are not those of the class diffusion-pipe runs (its CUDA kernel).
    - Settings bitsandbytes' kernels read from extra state (paged state, ``max_unorm``'s norm vector) are not
      built by DGLS; a class with them is refused by :func:`check_class` (the start-up probe, and its first step).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch

from ..errors import DGLSUserError
from .optimizer_kernels import OptimizerKernel, Zeros

LAUNCHES = ("cuda", "triton")  # bitsandbytes' CUDA kernels (the default stream), or its Triton ones (module doc)
BLOCK_STATE = ("state1", "state2", "absmax1", "absmax2")  # a param with 8-bit moments
FULL_STATE = ("state1", "state2")  # a param below min_8bit_size: fp32 moments
TRITON_SKIP_ZEROS = "bitsandbytes' Triton kernels (launch 'triton') refuse skip_zeros: launch 'cuda'"
MIN_ELEMENTS = 4  # the smallest min_8bit_size whose scales fit the scratch's 1 byte an element


def check_class(optimizer: torch.optim.Optimizer) -> None:
    """One line for an ``AdamW8bit`` built with a setting whose state the device update does not move: paged
    state (``is_paged``, CUDA unified memory) or a ``max_unorm`` norm vector (set through bitsandbytes' ``args``);
    or with 8-bit state on params of fewer than 4 elements (``min_8bit_size``), whose scales the scratch slots are
    not sized for."""
    args = getattr(optimizer, "args", None)
    if getattr(optimizer, "is_paged", False) or getattr(args, "max_unorm", 0.0) > 0.0:
        raise DGLSUserError(
            "[optimizer] type = 'AdamW8bit' with is_paged (or max_unorm) keeps state the device update does not "
            "move: drop it (DGLS keeps the state in host memory), or pass --host_adam torch (its class on the CPU)"
        )
    if getattr(args, "min_8bit_size", MIN_ELEMENTS) < MIN_ELEMENTS:
        raise DGLSUserError(
            f"[optimizer] min_8bit_size must be {MIN_ELEMENTS} or more for the device update (bitsandbytes' default is "
            "4096), or pass --host_adam torch (its class on the CPU)"
        )


class Bitsandbytes8bitKernel(OptimizerKernel):
    """``bitsandbytes.optim.AdamW8bit``'s step on the tensors of its own state (see the module doc)."""

    state_keys = ()  # none of its state is fp32 shaped as the param for every param: no flat layer holds it
    counts_steps = True
    flat = False
    steps_on_device = False

    def __init__(self, launch: str = "cuda") -> None:
        if launch not in LAUNCHES:
            raise DGLSUserError(f"bitsandbytes' kernels launch as one of {', '.join(LAUNCHES)}, got {launch!r}")
        self.launch = launch
        self._maps: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # state1, state2: uint8 codes (1 byte an element) or, below min_8bit_size, fp32 moments (4); absmax1, absmax2:
    # 4 bytes per 256 elements, at most 1 an element for params of 4 elements and more (check_class: min_8bit_size)
    slot_bytes = (4, 4, 1, 1)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        check_class(optimizer)
        if self.launch == "triton" and getattr(getattr(optimizer, "args", None), "skip_zeros", False):
            raise DGLSUserError(TRITON_SKIP_ZEROS)

    def check_device(self, device: torch.device) -> None:
        if self.launch != "triton":
            return
        if device.type != "cuda":
            raise DGLSUserError("bitsandbytes' Triton kernels (launch 'triton') run on CUDA only: launch 'cuda'")
        if importlib.util.find_spec("triton") is None:
            raise DGLSUserError("bitsandbytes' Triton kernels (launch 'triton') need triton: pip install triton")

    def keys_of(self, state: dict) -> tuple[str, ...]:
        return BLOCK_STATE if state["state1"].dtype == torch.uint8 else FULL_STATE

    def new_state(self, state: dict, shape: torch.Size, zeros: Zeros) -> None:
        raise AssertionError("bitsandbytes' state is made by its class (create_state)")

    def create_state(self, optimizer: torch.optim.Optimizer, master: torch.Tensor, zeros: Zeros) -> None:
        check_class(optimizer)
        gindex, pindex = _index(optimizer)[id(master)]
        optimizer.init_state(optimizer.param_groups[gindex], master, gindex, pindex)
        state = optimizer.state[master]
        for key in BLOCK_STATE:
            if key in state:
                state[key] = zeros(state[key].shape, state[key].dtype).copy_(state[key])

    def step(self, masters, grads, state, steps, group, lr) -> None:
        raise AssertionError("bitsandbytes' kernel steps each param with its own state (step_params)")

    def step_params(self, optimizer, hosts, masters, grads, states, steps, group, lr) -> None:
        functional = self._functions()
        where = _index(optimizer)
        # the code maps a first chunk copies in are queued on the in-stream before any kernel of the chunk reads them
        # (the CUDA kernels' default stream waits for the in-stream when it is entered)
        maps = [
            self._qmaps(optimizer.state[host], m.device) if len(tensors) == len(BLOCK_STATE) else None
            for host, m, tensors in zip(hosts, masters, states)
        ]
        device = masters[0].device if masters else None
        around = contextlib.nullcontext() if self.launch == "triton" else _on_default_stream(device)
        with around:
            for host, m, g, tensors, step, qmaps in zip(hosts, masters, grads, states, steps, maps):
                config = optimizer.get_config(*where[id(host)], group)
                if self.launch == "triton" and config["skip_zeros"]:  # a per-param override check() cannot see
                    raise DGLSUserError(TRITON_SKIP_ZEROS)
                beta1, beta2, *rest = config["betas"]
                beta3, alpha = (rest[0] if rest else 0.0), config.get("alpha", 0.0)
                rate = config["lr"] if lr is None else lr
                eps, decay, skip = config["eps"], config["weight_decay"], config["skip_zeros"]
                if qmaps is not None:
                    state1, state2, absmax1, absmax2 = tensors
                    functional.optimizer_update_8bit_blockwise(
                        optimizer.optimizer_name, g, m, state1, state2, beta1, beta2, beta3, alpha, eps, int(step),
                        rate, *qmaps, absmax1, absmax2, decay, gnorm_scale=1.0, skip_zeros=skip,
                    )  # fmt: skip
                elif self.launch == "triton":  # the same update; its arguments in another order
                    functional.optimizer_update_32bit(
                        optimizer.optimizer_name, g, m, *tensors, None, 0.0, 0.0, beta1, beta2, beta3, alpha, eps,
                        decay, int(step), rate, 1.0, skip_zeros=skip,
                    )  # fmt: skip
                else:
                    state1, state2 = tensors
                    functional.optimizer_update_32bit(
                        optimizer.optimizer_name, g, m, state1, beta1, eps, int(step), rate, state2, beta2, beta3,
                        alpha, decay, 1.0, None, max_unorm=0.0, skip_zeros=skip,
                    )  # fmt: skip

    def _functions(self):
        """bitsandbytes' update functions of this launch: its ``functional`` (the CUDA kernels, or its CPU ones on the
        CPU), or its Triton ``ops`` (CUDA only: :meth:`check_device`)."""
        if self.launch == "triton":
            from bitsandbytes.backends.triton import ops

            return ops
        from bitsandbytes import functional

        return functional

    def _qmaps(self, state: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The param's two code maps on ``device``: copied once per map pair (a layer's optimizer shares one)."""
        host1, host2 = state["qmap1"], state["qmap2"]
        key = (id(host1), device)
        if key not in self._maps:  # the host map is held with its copies: its id stays this key's
            on = [t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t for t in (host1, host2)]
            self._maps[key] = (host1, on[0], on[1])
        return self._maps[key][1:]


def _index(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    """Each param's (group index, index in its group), as bitsandbytes' ``get_config`` and ``init_state`` take."""
    return {id(p): (g, i) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}


@contextlib.contextmanager
def _on_default_stream(device: torch.device | None) -> Iterator[None]:
    """bitsandbytes' kernels, launched on the legacy default stream, ordered after the current stream's work so
    far and before its work after (see the module doc's hazards)."""
    if device is None or device.type != "cuda":
        yield
        return
    current = torch.cuda.current_stream(device)
    legacy = torch.cuda.default_stream(device)
    if current == legacy:
        yield
        return
    legacy.wait_stream(current)
    yield
    current.wait_stream(legacy)
