"""``clip_mode = "previous_norm"`` on CUDA, with the delays of tests/test_host_training_gpu.py (weight copies, gradient
copies home and compute all slowed): each streamed layer's update starts as its gradients land (a host job, or the
GPU's kernel enqueued during the backward), scaled by the previous step's clip coefficient; bitwise a reference that
clips every step after the first with the previous step's coefficient (tests/full_ft.py, ``previous_norm``)."""

import pytest
from full_ft import DEVICE, FUSED, MAX_NORM, NEVER_CLIPS, SGD_DEVICE, SPEC, assert_same, full_layers
from test_host_training_gpu import BF16, WIDE, reference, swapped
from test_ordering_gpu import deterministic, device  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu
NORMS = [MAX_NORM, NEVER_CLIPS, MAX_NORM]  # step 2 is scaled by step 1's coefficient, step 3 by step 2's (1)


@pytest.fixture(scope="module")
def template():
    return full_layers(BF16, WIDE)


@pytest.mark.parametrize(
    "spec, accumulate",
    [(SPEC, 1), (DEVICE, 1), (DEVICE, 2), (SGD_DEVICE, 1)],
    ids=["host", "device-flat", "device-sums", "sgd-device"],
)
def test_updates_at_the_previous_coefficient_with_delays_equal_the_reference(template, monkeypatch, spec, accumulate):
    seen = []
    got, names = swapped(
        template, "nonreentrant", monkeypatch, accumulate=accumulate, max_norm=NORMS, steps=3, seen=seen, spec=spec,
        prefetch=2, threading=True, clip_mode="previous_norm",
    )  # fmt: skip
    kw = {"accumulate": accumulate, "max_norm": NORMS, "steps": 3, "previous_norm": True}
    if spec is SPEC:  # host AdamW reading the landings: norms taken on the GPU before the grads left
        on_cpu = lambda s, n: "cpu"  # noqa: E731
        want = reference(template, names, "nonreentrant", **kw, master_device=device(), update_device=on_cpu)
    elif accumulate == 1:  # flat layers read from their landings: norms on the GPU, the GPU's fused kernel
        host_spec = FUSED if spec.type == "adamw" else spec
        want = reference(template, names, "nonreentrant", **kw, host_spec=host_spec, master_device=device())
    else:  # from the host's sums: their norms on the CPU, the update on the GPU
        want = reference(template, names, "nonreentrant", **kw, host_spec=FUSED, update_device=lambda s, n: device())
    assert_same(got, want)
    training = seen[0]
    assert training.previous_norm.early_updates == 2 * len(training.layers)
