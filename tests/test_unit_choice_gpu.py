"""The swap units chosen for a layer-major step's micro-batches on CUDA (planning/unit_choice.py), with a delay on
every copy and at every layer use: the units of the scaled Flux block (flux_like.py) that the builder chooses for 4
micro-batches are each copied once a direction a step at the slots a quarter of the budget holds, the one-micro-batch
units several times, and the trained numbers are bitwise those of the same steps with every layer resident."""

import pytest
import torch
from test_ordering_gpu import ComputeDelay, delay_every_copy, deterministic
from test_unit_choice import chosen_units, copies_at_the_quarters_slots, train

pytestmark = pytest.mark.gpu
__all__ = ["deterministic"]  # the fixture, shared with test_ordering_gpu.py


def delayed(swapper) -> None:
    delay_every_copy(swapper, 5.0, 2.0)
    swapper.add_listener(ComputeDelay(1.0))


def test_on_cuda_the_units_chosen_for_the_micro_batches_copy_each_once_a_direction_and_train_the_same():
    cuda = torch.device("cuda", torch.cuda.current_device())
    single, chosen = chosen_units(1), chosen_units(4)
    assert chosen != single
    before, gains_before = copies_at_the_quarters_slots(single, device=cuda, hook=delayed)
    after, gains_after = copies_at_the_quarters_slots(chosen, device=cuda, hook=delayed)
    once, _ = copies_at_the_quarters_slots(chosen, n=1, device=cuda, hook=delayed)
    assert after == once and before > 2 * after
    _, reference, _ = train(4, None, device=cuda)
    for a, b, c in zip(reference, gains_before, gains_after):
        assert torch.equal(a, b) and torch.equal(a, c)
