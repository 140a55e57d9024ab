"""Activation offload's bookkeeping per checkpointed call does not grow with the calls before it.

A layer-major step of N micro-batches makes N times one forward's checkpointed calls before the first backward, all
of them with inputs at home; a call that looked at every earlier call's offloads (to restore a storage it takes
again, or to reclaim a dropped graph's buffers) made a step's host work grow as the square of N. The count of
storage lookups per call is the measure here (timings are too noisy for CI).
"""

import torch
from torch.utils.checkpoint import checkpoint

from utils.dgls.activations import activation_offload
from utils.dgls.activations.activation_offload import ActivationOffloader

CPU = torch.device("cpu")


def lookups_per_call(monkeypatch, calls: int) -> float:
    counted = [0]
    real = activation_offload._storage_key

    def counting(tensor):
        counted[0] += 1
        return real(tensor)

    monkeypatch.setattr(activation_offload, "_storage_key", counting)
    offloader = ActivationOffloader(CPU, keep=1, min_bytes=0, pin=False)
    ckpt = offloader.wrap(lambda f, *a: checkpoint(f, *a, use_reentrant=False))
    weight, shared = torch.randn(8, 8, requires_grad=True), torch.randn(8)  # ``shared``: taken by every call
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    for _ in range(calls):
        x, y = ckpt(lambda a, b, v: (a @ weight + v, b * 2), x, y, shared)
    x.sum().backward()
    assert offloader.segments_sent >= calls - 1 and offloader.restored_bytes == offloader.offloaded_bytes
    monkeypatch.undo()
    return counted[0] / calls


def test_storage_lookups_per_call_do_not_grow_with_the_calls_before_it(monkeypatch):
    few, many = lookups_per_call(monkeypatch, 25), lookups_per_call(monkeypatch, 200)
    assert many <= 1.2 * few + 1, f"{few:.1f} lookups a call over 25 calls, {many:.1f} over 200"


def test_a_storage_a_later_call_takes_again_comes_back_first():
    """A tensor sent home with one call and taken again by a later one (not a pipeline's pattern) is restored before
    that call runs, found through the index of what is at home."""
    offloader = ActivationOffloader(CPU, keep=1, min_bytes=0, pin=False)
    ckpt = offloader.wrap(lambda f, *a: checkpoint(f, *a, use_reentrant=False))
    weight = torch.randn(8, 8, requires_grad=True)
    first = torch.randn(4, 8, requires_grad=True)
    kept = first * 1.0  # a non-leaf: its storage can go home
    a = ckpt(lambda t: t @ weight, kept)
    b = ckpt(lambda t: t @ weight, a)  # ``kept`` goes home here (keep=1)
    assert kept.untyped_storage().nbytes() == 0
    c = ckpt(lambda t, u: t @ weight + u, b, kept)  # takes ``kept`` again: back first
    assert offloader.demand_restores == 1 and kept.untyped_storage().nbytes() > 0
    (c.sum()).backward()
    expected = torch.autograd.grad(((first * 1.0) @ weight @ weight @ weight + first * 1.0).sum(), first)[0]
    assert torch.equal(first.grad, expected)
