"""Data-parallel full fine-tuning over the processes' one shared host copy (utils/dgls/training/data_parallel.py).

Each rank is a process of tests/fixtures/dp_full_rank.py (gloo on the CPU; NCCL on two GPUs): the small demo model,
every weight trained, its streamed layers by the host optimizer, each rank updating its share of them. With the
same global batch, 2 and 3 processes train what one process trains, up to the order of summation (each process's
mean over its rows, then the mean over processes; the norm summed in another order): the losses of every
micro-batch, and every weight on every rank (an owner's update must be in the shared copy before any rank reads
it: without the wait for a layer's version, or with a version published before its update is written, ranks read
weights a step old, about 1e-2 off; without the reduction, weights move about 6e-2 off).
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
        # one reduction per host-trained layer and backward pass (its bucket), not one per param
        assert rank["collectives"] == [len(one["owned"]) * rank["backwards"]] * len(rank["collectives"])
        assert any("gradient buckets during the backward" in line for line in rank["started"]), rank["started"]
    assert not any("gradient buckets" in line for line in one["started"]), "one process reduces nothing"
    owned = [set(rank["owned"]) for rank in many]
    assert all(owned) and set.union(*owned) == set(one["owned"]) and sum(map(len, owned)) == len(one["owned"])
    return many


@pytest.mark.slow  # starts 3 processes with torch
@pytest.mark.parametrize("reductions", [(), ("--async_gloo",)], ids=["late", "async"])
def test_two_processes_train_what_one_trains_with_the_global_batch(tmp_path, reductions):
    """``late``: on the CPU each bucket's reduction runs when waited for (a missing wait reads unreduced bytes);
    ``async``: gloo's run beside the backward, as NCCL's do."""
    assert_trains_like_one_process(tmp_path, 2, *reductions)


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
def test_adamw8bit_owners_step_their_share_on_the_device_and_train_what_one_process_trains(tmp_path):
    """Each owner steps its layers with bitsandbytes' own kernel through the device updater (the CPU here), on the
    8-bit state it alone holds. Tolerance 1e-3 of the weights' scale: the reduction's summation order moves a moment
    across an 8-bit code now and then (a step of a few percent of it), which measured 4e-4 of the scale (1.5% of one
    lr step); a lost or doubled update is a whole lr step (1e-2, 2.6e-2 of the scale)."""
    pytest.importorskip("bitsandbytes")
    assert_trains_like_one_process(tmp_path, 2, "--adamw8bit", tolerance=1e-3)


@pytest.mark.slow  # starts 3 processes with torch
def test_a_bf16_model_keeps_each_owners_fp32_masters_beside_the_shared_bf16_copies(tmp_path):
    """bf16: an owner's fp32 masters are its own, the bf16 copies every process streams are shared; the same training
    within two bf16 steps of the weights' scale (each process's rows are computed in bf16, then averaged)."""
    assert_trains_like_one_process(tmp_path, 2, "--bf16", "--sgd", tolerance=2**-7)


@pytest.mark.slow  # starts 4 processes with torch
def test_three_processes_train_what_one_trains_with_the_global_batch(tmp_path):
    assert_trains_like_one_process(tmp_path, 3)


@pytest.mark.slow  # starts 3 processes with torch
def test_with_the_job_thread_each_layer_is_fetched_only_once_its_owner_published_its_update(tmp_path):
    """The host updates and each layer's publication run on the job thread (as on CUDA), every update 50 ms late: a
    rank's next forward reaches the other owner's layers before their updates are written, and waits for each
    layer's version (a version stored before its update's writes, or a fetch that does not wait, reads the weights
    a step old)."""
    assert_trains_like_one_process(tmp_path, 2, "--threading", "--delay_updates")


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


def assert_reader_saves_every_owners_masters(tmp_path, *extra: str) -> list[dict]:
    """A bf16 model's save read on rank 0 holds rank 1's fp32 masters exactly (rank 1's own weights are its
    masters), not its layers' shared bf16 copies."""
    run_ranks(tmp_path, 2, "--bf16", "--sgd", "--save_masters", *extra)
    reader, owner = records(tmp_path, 2)
    theirs = [k for k in owner["weights"] if int(k.split(".")[0]) in owner["owned"]]
    assert theirs and all(torch.equal(reader["weights"][k], owner["weights"][k]) for k in theirs)
    assert any(not torch.equal(w, w.bfloat16().float()) for w in (owner["weights"][k] for k in theirs)), "fp32 values"
    assert reader["largest_master"] > 0 and owner["largest_master"] == reader["largest_master"], "the same sends"
    return [reader, owner]


@pytest.mark.slow  # starts 2 processes with torch
def test_a_save_on_rank_0_holds_every_owners_fp32_masters(tmp_path):
    assert_reader_saves_every_owners_masters(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_with_nccl_a_saves_masters_go_through_the_cpu_not_the_gpu(tmp_path):
    """NCCL's default group would send each master from the GPU (and receive it there): the saves' gloo group sends
    CPU tensors, so the gather allocates less device memory than the largest master's fp32 copy on either rank."""
    for record in assert_reader_saves_every_owners_masters(tmp_path, "--cuda"):
        assert record["save_growth"] < record["largest_master"], record["save_growth"]


def test_owners_balance_trained_params_in_layer_order_and_keep_a_module_whole():
    numels = {1: 100, 2: 100, 3: 50, 4: 50, 5: 10, 6: 10}
    groups = {1: 1, 2: 2, 3: 3, 4: 3, 5: 5, 6: 6}  # entries 3 and 4 are swap units of one module
    ours = Ownership.assign(numels, groups, rank=0, size=2)
    theirs = Ownership.assign(numels, groups, rank=1, size=2)
    assert ours.owners == theirs.owners == {1: 0, 2: 1, 3: 0, 4: 0, 5: 1, 6: 1}
    assert ours.owned == [1, 3, 4] and theirs.owned == [2, 5, 6] and ours.foreign == theirs.owned
    assert "each of the 2 processes updates its share of the 6 host-trained layers (3/3)" in ours.line()


def test_a_wait_for_a_layer_whose_owner_is_gone_is_one_line_and_a_published_layer_is_not_waited_for():
    """wait_published: a foreign layer at the version of this process's step passes at once; one a step behind whose
    owner's process is gone stops within a second or two with the line of a partner gone."""
    from utils.dgls.training.data_parallel import SharedGradients

    ownership = Ownership.assign({1: 10, 2: 10}, {}, rank=0, size=2)  # layer 2 is rank 1's
    shared = SharedGradients(ownership, {1: [], 2: []})
    versions = torch.zeros(3, dtype=torch.int64)
    alive = {1: True}
    shared.attach_versions(versions, lambda rank: alive[rank])
    shared.publish(lambda written: written(1))  # this process's step 1: its own layer written
    assert shared.step == 1 and versions.tolist() == [0, 1, 0]
    versions[2] = 1
    shared.wait_published(2)  # published: no wait
    shared.publish(lambda written: written(1))
    alive[1] = False
    with pytest.raises(DGLSUserError) as caught:
        shared.wait_published(2)
    assert str(caught.value).startswith(
        "another process of this data-parallel job stopped during the update of layer 2, which it owns (its process "
        "is gone): the processes train each step together"
    ), caught.value


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


# ---------------------------------------------------------------- buckets, in-process (a fake second process)
OTHER = 100.0  # what the other process adds to every element of a bucket when its reduction runs


class FakeReduce:
    """``torch.distributed.reduce`` between this process and another whose gradients are all ``OTHER``: the sum is
    made only when the reduction runs (blocking: when called; asynchronous: when its work is waited for, as a late
    NCCL or gloo collective), so an owner that reads a bucket before waiting reads its own bytes, and a bucket
    rewritten before its wait sends another layer's. ``sent``: the bytes each reduction read, in the order they ran;
    ``calls``: reductions started; ``waiting``: asynchronous ones not waited for yet."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.calls = 0
        self.waiting = 0
        self.most_waiting = 0

    def __call__(self, tensor, dst, op=None, async_op=False):
        self.calls += 1
        if not async_op:
            self._run(tensor)
            return None
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        return _DeferredWork(self, tensor)

    def _run(self, tensor) -> None:
        self.sent.append(tensor.clone())
        tensor.add_(OTHER)


class _DeferredWork:
    def __init__(self, reduce: FakeReduce, tensor: torch.Tensor) -> None:
        self.reduce, self.tensor, self.done = reduce, tensor, False

    def wait(self) -> bool:
        if not self.done:
            self.reduce.waiting -= 1
            self.reduce._run(self.tensor)
            self.done = True
        return True


def _shared(monkeypatch, rank: int, owners: dict[int, int], numels=(4, 2), late: bool | None = None):
    from torch import nn

    from utils.dgls.training.data_parallel import SharedGradients

    reduce = FakeReduce()
    monkeypatch.setattr(torch.distributed, "reduce", reduce)
    params = {i: [nn.Parameter(torch.zeros(n)) for n in numels] for i in owners}
    shared = SharedGradients(Ownership(rank=rank, size=2, owners=owners), params, late=late)
    delivered: list[tuple[int, torch.Tensor]] = []
    by_param = {id(p): i for i, layer in params.items() for p in layer}
    shared.install(lambda idx: None, lambda param, grad: delivered.append((by_param[id(param)], grad)))
    return shared, params, reduce, delivered


def _backward(shared, params, layers, value=lambda idx, position: float(idx + 1)) -> None:
    """The hooks as a backward over ``layers`` (last layer first) calls them: each trained param's gradient, the
    layer's own value (``idx + 1``), then the backward's end."""
    for idx in layers:
        for position, p in enumerate(params[idx]):
            p.grad = torch.full_like(p, value(idx, position))
            shared._reduce(idx, p)
            assert p.grad is None, "the gradient left the param for its bucket"


@pytest.mark.parametrize("late", [None, False], ids=["cpu-late", "async"])
def test_an_owner_gets_each_params_mean_only_after_its_buckets_reduction_ran(monkeypatch, late):
    """The owner's host training reads a layer's gradients only once its bucket's reduction was waited for: a missing
    wait would give it its own gradient halved (here (idx + 1) / 2, not (idx + 1 + OTHER) / 2)."""
    shared, params, reduce, delivered = _shared(monkeypatch, rank=0, owners={i: 0 for i in range(5)}, late=late)
    _backward(shared, params, [4, 3, 2, 1, 0])
    shared.backward_done()
    assert [idx for idx, _ in delivered] == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0], "each layer's params, in layout order"
    for idx, grad in delivered:
        assert torch.equal(grad, torch.full_like(grad, (idx + 1 + OTHER) / 2)), (idx, grad)


@pytest.mark.parametrize("late", [None, False], ids=["cpu-late", "async"])
def test_a_bucket_is_rewritten_only_after_its_reduction_ran(monkeypatch, late):
    """Deeper than the pool (``in_flight + 1`` buffers), every bucket is reused: each reduction must still send
    its own layer's bytes (a buffer given back before its wait sends the layer after's)."""
    layers = list(range(7, -1, -1))
    shared, params, reduce, delivered = _shared(monkeypatch, rank=1, owners={i: 0 for i in range(8)}, late=late)
    _backward(shared, params, layers)
    assert sum(shared._allocated.values()) == shared.in_flight + 1, "the pool, not a buffer per layer"
    shared.backward_done()
    assert len(reduce.sent) == len(layers) and not delivered, "a non-owner sends and keeps nothing"
    for idx, sent in zip(layers, reduce.sent, strict=True):
        assert torch.equal(sent, torch.full((6,), float(idx + 1))), (idx, sent)
    assert not shared._free and not shared._allocated, "the pool went back to the allocator"


def test_one_reduction_per_layer_and_pass_with_a_bounded_number_in_flight(monkeypatch):
    """One collective per layer (its bucket), not one per param; at most ``in_flight`` run beside the backward, so
    the device memory they hold does not grow with depth; each overlaps the backward of the layers after it."""
    shared, params, reduce, delivered = _shared(monkeypatch, rank=0, owners={i: i % 2 for i in range(6)}, late=False)
    for step in range(2):
        calls = reduce.calls
        _backward(shared, params, [5, 4, 3, 2, 1, 0])
        assert reduce.calls - calls == 6 and reduce.waiting == shared.in_flight == 2
        shared.backward_done()
        assert reduce.waiting == 0 and shared.collectives == 6 * (step + 1)
    assert reduce.most_waiting == 2
    assert sorted({idx for idx, _ in delivered}) == [0, 2, 4], "the owner's layers only"


def test_a_param_without_a_gradient_leaves_its_layers_bucket_partial_and_sent_when_the_next_layer_begins(monkeypatch):
    """Every process runs the same backward, so a bucket that misses a param misses it everywhere: sent when another
    layer's gradients begin (or the backward ends), the owner gets the params it holds."""
    shared, params, reduce, delivered = _shared(monkeypatch, rank=0, owners={0: 0, 1: 0}, late=False)
    p = params[1][0]
    p.grad = torch.full_like(p, 2.0)
    shared._reduce(1, p)  # layer 1's second param gets no gradient
    assert reduce.calls == 0
    _backward(shared, params, [0])
    assert reduce.calls == 2
    shared.backward_done()
    assert [(idx, g.numel()) for idx, g in delivered] == [(1, 4), (0, 4), (0, 2)]
    assert torch.equal(delivered[0][1], torch.full((4,), (2 + OTHER) / 2))


def test_a_second_gradient_of_a_param_in_one_pass_launches_the_bucket_holding_the_first(monkeypatch):
    """Reentrant checkpointing runs a layer's backward twice in one pass: each gradient is reduced, in its own
    bucket, and the owner's host training gets both (it sums them, as one process's would)."""
    shared, params, reduce, delivered = _shared(monkeypatch, rank=0, owners={0: 0}, late=False)
    a, b = params[0]
    for value in (1.0, 3.0):
        for p in (a, b):
            p.grad = torch.full_like(p, value)
            shared._reduce(0, p)
    shared.backward_done()
    assert reduce.calls == 2
    assert [g[0].item() for _, g in delivered] == [(1 + OTHER) / 2] * 2 + [(3 + OTHER) / 2] * 2


def test_layer_major_reduces_each_layers_device_sum_once_a_step(monkeypatch):
    """Under the layer-major schedule a layer's gradients are summed on the device over the step's micro-batches
    (training/device_sums.py): the reduce to the owner sends that sum, once a step and layer (its bucket), not each
    micro-batch's gradients (N times the bytes and collectives)."""
    from utils.dgls.training.device_sums import DeviceSums

    shared, params, reduce, delivered = _shared(monkeypatch, rank=1, owners={0: 0, 1: 1, 2: 0}, late=False)
    shared.device_sums = sums = DeviceSums()
    for idx in (2, 1, 0):  # the backward: last layer first, each over its 4 micro-batches
        for m in range(4):
            sums.final = m == 3
            for p in params[idx]:
                p.grad = torch.full_like(p, float(m + 1))
                shared._reduce(idx, p)
                assert p.grad is None
    shared.backward_done()
    assert reduce.calls == 3 and all(torch.equal(t, torch.full((6,), 10.0)) for t in reduce.sent)
    assert [idx for idx, _ in delivered] == [1, 1], "the owner's layer, its params"
    assert all(torch.equal(g, torch.full_like(g, (10.0 + OTHER) / 2)) for _, g in delivered)
    assert sums.pending == 0


def test_a_layer_major_sum_without_a_last_micro_batch_gradient_is_reduced_once_at_the_flush(monkeypatch):
    """A param whose last micro-batches gave no gradient: its device sum goes into its layer's bucket when the
    layer's micro-batches end (DeviceSums.flush), reduced once, and the owner hands the mean to the host training
    (no hook runs then)."""
    from utils.dgls.training.device_sums import DeviceSums

    shared, params, reduce, delivered = _shared(monkeypatch, rank=1, owners={0: 0, 1: 1}, numels=(3,), late=False)
    shared.device_sums = sums = DeviceSums()
    for idx in (1, 0):
        (p,) = params[idx]
        for m in range(4):
            sums.final = m == 3
            if m < 2:  # the last two micro-batches skip the param
                p.grad = torch.full((3,), float(m + 1))
                shared._reduce(idx, p)
                assert p.grad is None, "summed on the device, nothing sent yet"
        sums.flush()
    shared.backward_done()
    assert reduce.calls == 2 and all(torch.equal(t, torch.full((3,), 3.0)) for t in reduce.sent)
    assert [(idx, g.tolist()) for idx, g in delivered] == [(1, [(3.0 + OTHER) / 2] * 3)], "the owner's layer only"
    assert sums.pending == 0


def test_the_bucket_pool_is_in_flight_plus_one_of_the_largest_layers_segment_per_dtype_and_on_the_placement_line():
    """The reduction's device memory at its largest, which the start-up placement line shows (the user places the
    layers of a data-parallel full fine-tune): ``in_flight + 1`` buffers of each dtype, each the largest layer's."""
    from torch import nn

    from utils.dgls.memory.layout import LayerSizes
    from utils.dgls.streaming.placement import Placement
    from utils.dgls.training.data_parallel import SharedGradients

    params = {
        0: [nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(24, dtype=torch.bfloat16))],
        1: [nn.Parameter(torch.zeros(3000))],
    }
    shared = SharedGradients(Ownership(rank=0, size=2, owners={0: 0, 1: 1}), params, in_flight=2)
    assert shared.pool_bytes == 3 * (3000 * 4 + 24 * 2)
    sizes = (LayerSizes(0, "Block", 1 << 20, 0),)
    line = Placement(sizes, streamed=(0,), prefetch=1, reduce_bytes=shared.pool_bytes).table().splitlines()[-1]
    assert f"(+ {shared.pool_bytes / 1e6:.1f} MB of data parallel's gradient buckets during the backward)" in line
    assert "gradient buckets" not in Placement(sizes, streamed=(0,), prefetch=1).table()
