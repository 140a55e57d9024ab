"""Data-parallel full fine-tuning over the processes' one shared host copy (utils/dgls/training/data_parallel.py).

Each rank is a process of tests/fixtures/dp_full_rank.py (gloo on the CPU; NCCL on two GPUs): the small demo model,
every weight trained, its streamed layers by the host optimizer, each rank updating its share of them. With the
same global batch, 2 and 3 processes train what one process trains, up to the order of summation (each process's
mean over its rows, then the mean over processes; the norm summed in another order): the losses of every
micro-batch, and every weight on every rank (an owner's update must be in the shared copy before any rank reads
it: without the step's barrier, or with an owner's updates not written before it, ranks read weights a step old,
about 1e-2 off; without the reduction, weights move about 6e-2 off).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from helpers import child_env

from utils.dgls.errors import DGLSUserError
from utils.dgls.memory import peers
from utils.dgls.program.distributed import free_port
from utils.dgls.training.data_parallel import Ownership, check_shared, peer_failure

RANK = ROOT / "tests" / "fixtures" / "dp_full_rank.py"
TOLERANCE = 1e-4  # of the weights' scale: summation order (about 1e-5 measured); the mutations above are 1e-2 and more


def run_ranks(folder, world: int, *extra: str, expect: int = 0) -> list[subprocess.CompletedProcess]:
    folder.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK), str(r), str(world), port, str(folder), *extra],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        outs.append((proc.returncode, out))
    if expect == 0:
        for code, out in outs:
            assert code == 0, out[-3000:]
    return outs


def records(folder, world: int) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_trains_like_one_process(tmp_path, world: int, *extra: str, tolerance: float = TOLERANCE) -> list[dict]:
    """``tolerance``: of the weights' scale (the losses: a tenth of it, relative)."""
    run_ranks(tmp_path / "one", 1, *extra)
    run_ranks(tmp_path / "many", world, *extra)
    (one,) = records(tmp_path / "one", 1)
    many = records(tmp_path / "many", world)
    scale = max(v.abs().max().item() for v in one["weights"].values())
    rows = one["eval"].shape[0] // world
    for r, rank in enumerate(many):
        losses = torch.stack(rank["losses"])
        assert torch.allclose(losses, torch.stack(one["losses"]), rtol=max(1e-5, tolerance / 10), atol=1e-6)
        assert rank["weights"].keys() == one["weights"].keys()
        worst = max((rank["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"])
        assert worst <= tolerance * scale, (worst, scale)
        evaluated = one["eval"][r * rows : (r + 1) * rows]  # its rows of the global batch, after the last step
        assert (rank["eval"] - evaluated).abs().max().item() <= max(1e-3, tolerance) * evaluated.abs().max().item()
        assert rank["named"] == [], "the shared segments lose their names once every rank mapped them"
    owned = [set(rank["owned"]) for rank in many]
    assert all(owned) and set.union(*owned) == set(one["owned"]) and sum(map(len, owned)) == len(one["owned"])
    return many


@pytest.mark.slow  # starts 3 processes with torch
def test_two_processes_train_what_one_trains_with_the_global_batch(tmp_path):
    assert_trains_like_one_process(tmp_path, 2)


@pytest.mark.slow  # starts 3 processes with torch
def test_without_clipping_the_owners_update_during_the_backward_and_train_what_one_process_trains(tmp_path):
    """No clipping: each owner's update starts as its layer's last gradient is reduced, inside the backward. SGD: AdamW
    would turn the last-bit noise of an attention key's bias (zero in exact arithmetic) into steps of the lr."""
    assert_trains_like_one_process(tmp_path, 2, "--no_clip", "--sgd", tolerance=1e-5)


@pytest.mark.slow  # starts 3 processes with torch
@pytest.mark.parametrize("clip", [(), ("--no_clip", "--sgd")], ids=["clipped", "updates-in-backward"])
def test_layer_major_steps_train_what_one_process_trains(tmp_path, clip):
    """Layer-major accumulation (each layer's gradients summed on the device, one gradient a step home): every
    micro-batch's gradients are reduced to the layer's owner, and the owner's device sum goes home once."""
    assert_trains_like_one_process(tmp_path, 2, "--layer_major", *clip, tolerance=1e-5 if clip else TOLERANCE)


@pytest.mark.slow  # starts 3 processes with torch
def test_a_bf16_model_keeps_each_owners_fp32_masters_beside_the_shared_bf16_copies(tmp_path):
    """bf16: an owner's fp32 masters are its own, the bf16 copies every process streams are shared; the same training
    within two bf16 steps of the weights' scale (each process's rows are computed in bf16, then averaged)."""
    assert_trains_like_one_process(tmp_path, 2, "--bf16", "--sgd", tolerance=2**-7)


@pytest.mark.slow  # starts 4 processes with torch
def test_three_processes_train_what_one_trains_with_the_global_batch(tmp_path):
    assert_trains_like_one_process(tmp_path, 3)


@pytest.mark.slow  # starts 2 processes with torch
def test_a_process_killed_mid_step_leaves_no_segment_and_the_other_stops_with_one_line(tmp_path):
    outs = run_ranks(tmp_path, 2, "--die_at_step", "2", expect=1)
    (code0, out0), (code1, _) = outs
    assert code1 == -signal.SIGKILL
    assert code0 == 2, out0[-3000:]
    lines = out0.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "dgls: error: another process of this data-parallel job stopped during the reduction of the streamed layers' "
        "gradients ("
    ), out0
    assert not list(peers.SHM.glob(f"{peers.PREFIX}*")) or all(
        peers._running(int(p.name[len(peers.PREFIX) :].split("-", 1)[0])) for p in peers.SHM.glob(f"{peers.PREFIX}*")
    ), "a segment of this job was left in /dev/shm"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("variant", ["fp32", "bf16", "fp32-layer-major"])
def test_two_gpus_train_what_one_gpu_trains_with_the_global_batch(tmp_path, variant):
    """NCCL: the reduces to each layer's owner run on the device, the host updates on each owner's host side;
    layer-major: each layer's device sum over the step's micro-batches is what is reduced."""
    if variant == "bf16":
        assert_trains_like_one_process(tmp_path, 2, "--cuda", "--bf16", "--sgd", tolerance=2**-7)
    elif variant == "fp32-layer-major":
        assert_trains_like_one_process(tmp_path, 2, "--cuda", "--sgd", "--layer_major", tolerance=1e-4)
    else:
        assert_trains_like_one_process(tmp_path, 2, "--cuda", "--sgd", tolerance=1e-4)


def test_owners_balance_trained_params_in_layer_order_and_keep_a_module_whole():
    numels = {1: 100, 2: 100, 3: 50, 4: 50, 5: 10, 6: 10}
    groups = {1: 1, 2: 2, 3: 3, 4: 3, 5: 5, 6: 6}  # entries 3 and 4 are swap units of one module
    ours = Ownership.assign(numels, groups, rank=0, size=2)
    theirs = Ownership.assign(numels, groups, rank=1, size=2)
    assert ours.owners == theirs.owners == {1: 0, 2: 1, 3: 0, 4: 0, 5: 1, 6: 1}
    assert ours.owned == [1, 3, 4] and theirs.owned == [2, 5, 6] and ours.foreign == theirs.owned
    assert "each of the 2 processes updates its share of the 6 host-trained layers (3/3)" in ours.line()


def test_processes_that_do_not_share_one_host_copy_are_refused():
    ownership = Ownership.assign({1: 1, 2: 1}, {}, rank=0, size=2)
    check_shared(ownership, 2)
    with pytest.raises(DGLSUserError, match="runs on one machine.*do not share a host copy"):
        check_shared(ownership, 1)


def test_a_collective_whose_partner_is_gone_is_one_line_and_other_errors_stay_themselves():
    with pytest.raises(DGLSUserError) as caught:
        with peer_failure("the end of the step"):
            raise RuntimeError(
                "[../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:5: Connection reset by peer. More"
            )
    assert str(caught.value).startswith(
        "another process of this data-parallel job stopped during the end of the step (Read error [10.0.0.2]:5: "
        "Connection reset by peer): "
    )
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        with peer_failure("the end of the step"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"gpu_layers": [0]},
            "data_parallel full fine-tuning shares the streamed layers' training among the processes",
        ),
        ({"vram_budget": 1.0}, "data-parallel full fine-tuning fixes each streamed layer's owner at start-up"),
        # --plan only shows the plan (a full fine-tune's probe placement stays), as the demo's refusal of a VRAM
        # budget advises: past that refusal, to the process group's
        ({"vram_budget": 1.0, "plan": True}, "data_parallel full fine-tuning shares the streamed layers' training"),
    ],
)
def test_what_the_library_cannot_share_is_refused_before_anything_is_built(settings, expected):
    from full_ft import SPEC, full_layers

    from utils.dgls import LayerSwapper, SwapConfig

    layers = full_layers()
    config = SwapConfig.of(host_optimizer=SPEC, data_parallel=True, **settings)
    with pytest.raises(DGLSUserError, match=expected):
        LayerSwapper(layers, config, device="cpu", log=None)
    assert all(p.device.type == "cpu" and p.numel() for layer in layers for p in layer.parameters())


class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True


def test_a_non_owner_keeps_one_layers_gradients_in_flight_not_the_whole_models(monkeypatch):
    """A non-owner's reduces run beside the backward; each layer's are waited for when the next layer's start, so
    the gradients they keep alive are one layer's (N micro-batches' of it, layer-major), not every layer's of the
    backward (N times the model's, layer-major: the device memory streaming exists to save)."""
    from torch import nn

    from utils.dgls.training.data_parallel import SharedGradients

    works: list[_Work] = []

    def reduce(tensor, dst, op, async_op=False):
        works.append(_Work())
        return works[-1]

    monkeypatch.setattr(torch.distributed, "reduce", reduce)
    params = {i: [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))] for i in range(3)}
    shared = SharedGradients(Ownership(rank=1, size=2, owners={0: 0, 1: 0, 2: 0}), params)
    for idx in range(3):
        for _micro_batch in range(2):  # layer-major: a layer's micro-batches in a row
            for p in params[idx]:
                p.grad = torch.ones_like(p)
                shared._reduce(idx, p)
                assert p.grad is None
    assert [w.waited for w in works] == [True] * 8 + [False] * 4
    assert {idx for idx, _, _ in shared._pending} == {2}
    shared.backward_done()
    assert all(w.waited for w in works) and not shared._pending


def test_layer_major_reduces_each_layers_device_sum_once_a_step(monkeypatch):
    """Under the layer-major schedule a layer's gradients are summed on the device over the step's micro-batches
    (training/device_sums.py): the reduce to the owner sends that sum, once a step, not each micro-batch's gradient
    (N times the bytes and collectives)."""
    from torch import nn

    from utils.dgls.training.data_parallel import SharedGradients
    from utils.dgls.training.device_sums import DeviceSums

    sent: list[torch.Tensor] = []

    def reduce(tensor, dst, op, async_op=False):
        sent.append(tensor.clone())
        return _Work() if async_op else None

    monkeypatch.setattr(torch.distributed, "reduce", reduce)
    params = {i: [nn.Parameter(torch.zeros(3))] for i in range(2)}
    shared = SharedGradients(Ownership(rank=1, size=2, owners={0: 0, 1: 1}), params)
    shared.device_sums = sums = DeviceSums()
    for idx in (1, 0):  # the backward: last layer first, each over its 4 micro-batches
        for m in range(4):
            sums.final = m == 3
            (p,) = params[idx]
            p.grad = torch.full((3,), float(m + 1))
            shared._reduce(idx, p)
            if m < 3:
                assert p.grad is None, "summed on the device, nothing sent yet"
    assert len(sent) == 2 and all(torch.equal(t, torch.full((3,), 10.0)) for t in sent)
    assert torch.equal(params[1][0].grad, torch.full((3,), 5.0)), "the owner's: the mean over the 2 processes"
    assert params[0][0].grad is None and sums.pending == 0


def test_a_layer_major_sum_without_a_last_micro_batch_gradient_is_reduced_once_at_the_flush(monkeypatch):
    """A param whose last micro-batch gave no gradient: its device sum is reduced when its layer's micro-batches end
    (DeviceSums.flush), and the owner hands the mean to the host training (no hook runs then)."""
    from torch import nn

    from utils.dgls.training.data_parallel import SharedGradients
    from utils.dgls.training.device_sums import DeviceSums

    sent: list[torch.Tensor] = []

    def reduce(tensor, dst, op, async_op=False):
        sent.append(tensor.clone())
        return _Work() if async_op else None

    monkeypatch.setattr(torch.distributed, "reduce", reduce)
    params = {i: [nn.Parameter(torch.zeros(3))] for i in range(2)}
    shared = SharedGradients(Ownership(rank=1, size=2, owners={0: 0, 1: 1}), params)
    handed: list[tuple[nn.Parameter, torch.Tensor]] = []
    shared.hand_on = lambda param, grad: handed.append((param, grad))
    shared.device_sums = sums = DeviceSums()
    for idx in (1, 0):
        (p,) = params[idx]
        for m in range(4):
            sums.final = m == 3
            if m < 2:  # the last two micro-batches skip the param
                p.grad = torch.full((3,), float(m + 1))
                shared._reduce(idx, p)
        assert not sent or len(sent) == 1
        sums.flush()
    assert len(sent) == 2 and all(torch.equal(t, torch.full((3,), 3.0)) for t in sent)
    assert [(p is params[1][0], g.tolist()) for p, g in handed] == [(True, [1.5] * 3)]
    assert sums.pending == 0 and shared._pending
