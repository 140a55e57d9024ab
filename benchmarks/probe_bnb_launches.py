"""Probe (not a benchmark): bitsandbytes' two AdamW8bit launches on the same inputs, outside DGLS.

python benchmarks/probe_bnb_launches.py [--grad_scale 0.01] [--elements 1048576]

One fp32 param (and a bf16 copy of it) stepped three times by ``optimizer_update_8bit_blockwise`` of bitsandbytes'
CUDA backend and of its Triton ops, each from its own ``AdamW8bit`` state, with the same gradients; torch's AdamW
steps an fp32 copy as the reference. Prints, after each step, the mean distance of each launch from the reference
and from each other, the share of 8-bit codes that differ, and for the bf16 params the share that differ against
the share the steps changed. Why: in DGLS's device update the Triton launch's weights differ from the CUDA
kernel's far more than this (utils/dgls/training/bitsandbytes_kernel.py); if the kernels agree here, the difference
is in how DGLS calls them. On an H200 (2026-11-28), for gradients of 1e-2, 1e-6 and 1e-7: the fp32 params at most
6.5e-6 apart after three steps (a mean move of 1.7e-4), no 8-bit code different; bf16 params stepped directly,
0.1% of all of them different. CUDA with bitsandbytes and triton installed.
"""

from __future__ import annotations

import argparse

import torch


def steps(update, p0: torch.Tensor, grads: list[torch.Tensor], count: int, dtype: torch.dtype):
    """``count`` steps of ``update`` (one launch's ``optimizer_update_8bit_blockwise``) on a copy of ``p0`` in
    ``dtype``, its state built by ``AdamW8bit`` as the class builds it; the param (fp32) and the state."""
    import bitsandbytes as bnb

    p = p0.clone().to(dtype)
    optimizer = bnb.optim.AdamW8bit([p], lr=1e-4, weight_decay=0.01)
    optimizer.init_state(optimizer.param_groups[0], p, 0, 0)
    state = optimizer.state[p]
    for step in range(1, count + 1):
        config = optimizer.get_config(0, 0, optimizer.param_groups[0])
        beta1, beta2, *rest = config["betas"]
        update(
            optimizer.optimizer_name, grads[step - 1].to(dtype), p, state["state1"], state["state2"], beta1, beta2,
            rest[0] if rest else 0.0, config.get("alpha", 0.0), config["eps"], step, config["lr"], state["qmap1"],
            state["qmap2"], state["absmax1"], state["absmax2"], config["weight_decay"], gnorm_scale=1.0,
            skip_zeros=False,
        )  # fmt: skip
    torch.cuda.synchronize()
    return p.float(), state


def reference(p0: torch.Tensor, grads: list[torch.Tensor], count: int) -> torch.Tensor:
    """torch's AdamW with AdamW8bit's defaults, ``count`` steps on an fp32 copy of ``p0``."""
    p = p0.clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    for step in range(count):
        p.grad = grads[step].clone()
        optimizer.step()
    return p.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grad_scale", type=float, default=0.01)
    parser.add_argument("--elements", type=int, default=1 << 20)
    args = parser.parse_args()
    from bitsandbytes import functional
    from bitsandbytes.backends.triton import ops

    torch.manual_seed(0)
    p0 = torch.randn(args.elements, device="cuda") * 0.02
    grads = [torch.randn(args.elements, device="cuda") * args.grad_scale for _ in range(3)]
    for count in (1, 2, 3):
        cuda, cuda_state = steps(functional.optimizer_update_8bit_blockwise, p0, grads, count, torch.float32)
        triton, triton_state = steps(ops.optimizer_update_8bit_blockwise, p0, grads, count, torch.float32)
        want = reference(p0, grads, count)
        codes = [(cuda_state[k] != triton_state[k]).float().mean().item() for k in ("state1", "state2")]
        print(
            f"{count} step(s): moved {(want - p0).abs().mean().item():.3e} on average; from torch's AdamW: cuda "
            f"{(cuda - want).abs().mean().item():.3e}, triton {(triton - want).abs().mean().item():.3e}; cuda-triton "
            f"{(cuda - triton).abs().mean().item():.3e} (largest {(cuda - triton).abs().max().item():.3e}); codes "
            f"that differ {codes[0]:.3f}, {codes[1]:.3f}"
        )
        cuda16, _ = steps(functional.optimizer_update_8bit_blockwise, p0, grads, count, torch.bfloat16)
        triton16, _ = steps(ops.optimizer_update_8bit_blockwise, p0, grads, count, torch.bfloat16)
        changed = (cuda16 != p0.bfloat16().float()).float().mean().item()
        print(f"  bf16 params: {(cuda16 != triton16).float().mean().item():.3f} differ, {changed:.3f} changed")


if __name__ == "__main__":
    main()
