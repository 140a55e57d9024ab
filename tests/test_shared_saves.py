"""What a data-parallel full fine-tune saves and resumes (utils/dgls/training/shared_saves.py), in-process.

The collectives are stand-ins (a queue of sends that the reader's receives take in order), the processes run one
after another: each owner's masters reach the reader's true values for a save, each process writes its share of the
host optimizer state, and a resume takes every layer's state from whichever file holds it (another number of
processes included). tests/test_diffusion_pipe_data_parallel_real.py runs the real thing through train.py.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_resume_checks import host_state, load_into
from torch import nn

from utils.dgls import DGLSUserError
from utils.dgls.trainers.engine_hooks import EngineHooks, _read_host_state
from utils.dgls.training.data_parallel import Ownership, SharedGradients
from utils.dgls.training.shared_saves import (
    HostStateName,
    SharedSaves,
    host_state_files,
    merged_host_state,
    stale_host_state_files,
)
from utils.dgls.training.training_feature import TrainingFeature

OWNERS = {0: 0, 1: 1, 2: 1, 3: 0}  # layer -> rank
SHAPES = {0: [(3, 2), (2,)], 1: [(4,), (2, 2)], 2: [(5,)], 3: [(1, 3)]}  # layer -> its params' shapes


class FakeP2P:
    """``torch.distributed.send``/``recv`` between processes run one after another: a send is queued, a receive
    takes the oldest (of the same source and shape: a transfer out of order fails)."""

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.rank = 0
        self.groups: list = []  # the group of each send and receive, in order

    def send(self, tensor: torch.Tensor, dst: int, group=None) -> None:
        self.groups.append(group)
        self.queue.append((self.rank, dst, tensor.clone()))

    def recv(self, tensor: torch.Tensor, src: int, group=None) -> None:
        self.groups.append(group)
        sender, dst, sent = self.queue.popleft()
        assert (sender, dst, sent.shape, sent.dtype) == (src, self.rank, tensor.shape, tensor.dtype)
        tensor.copy_(sent)


@pytest.fixture
def p2p(monkeypatch) -> FakeP2P:
    fake = FakeP2P()
    monkeypatch.setattr(torch.distributed, "send", fake.send)
    monkeypatch.setattr(torch.distributed, "recv", fake.recv)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    return fake


def process(
    rank: int, seed: int, fp32: frozenset[int] = frozenset(), group: object | None = None
) -> tuple[TrainingFeature, dict[int, list[nn.Parameter]], dict[int, torch.Tensor]]:
    """One process's training feature: every host-trained layer's params (empty placeholders, as streamed params
    are), its own layers' fp32 masters (random, by ``id`` of the param). The layers ``fp32`` compute in fp32: their
    params' masters are the shared packed copies (none of their own)."""
    gen = torch.Generator().manual_seed(seed)
    params = {idx: [nn.Parameter(torch.empty(0)) for _ in shapes] for idx, shapes in SHAPES.items()}
    masters = {
        id(p): torch.randn(shape, generator=gen)
        for idx, shapes in SHAPES.items()
        if OWNERS[idx] == rank and idx not in fp32
        for p, shape in zip(params[idx], shapes)
    }
    dtype = {idx: torch.float32 if idx in fp32 else torch.bfloat16 for idx in SHAPES}
    shapes = {idx: [(torch.Size(s), dtype[idx]) for s in SHAPES[idx]] for idx in SHAPES}
    own = frozenset(id(p) for idx, layer in params.items() if idx not in fp32 for p in layer)
    shared = SharedGradients(Ownership(rank, 2, OWNERS), params, shapes, own_masters=own, save_group=group)
    training = SimpleNamespace(master_of=lambda p: masters.get(id(p)), finish=lambda: None)
    return TrainingFeature(training, "", shared=shared), params, masters


def layer_numel(idx: int) -> torch.Size:
    """The shape of layer ``idx``'s one message: its params' elements, flat."""
    return torch.Size([sum(torch.Size(shape).numel() for shape in SHAPES[idx])])


def test_the_reader_saves_each_owners_fp32_masters_and_only_inside_the_block(p2p):
    """Rank 1 sends its layers' masters, one flat message a layer (its params' masters in layout order); rank 0's
    true values of those params are them inside the block (what its state dicts and ``true_weights`` read), bitwise,
    each in its own shape and a storage of its own bytes (a save writes each alone), its own stay its own, and after
    the block it holds none of rank 1's."""
    reader, reader_params, reader_masters = process(0, seed=0)
    owner, owner_params, owner_masters = process(1, seed=1)
    saves = {
        rank: SharedSaves.of(SimpleNamespace(feature=lambda kind, f=f: f)) for rank, f in ((0, reader), (1, owner))
    }
    p2p.rank = 1
    with saves[1].owners_masters():
        assert owner.lent == {}, "only the reader holds other owners' masters"
    sent = list(p2p.queue)
    assert [entry[2].shape for entry in sent] == [layer_numel(idx) for idx in (1, 2)], "one flat message a layer"
    for (_, _, flat), idx in zip(sent, (1, 2), strict=True):
        assert torch.equal(flat, torch.cat([owner_masters[id(p)].reshape(-1) for p in owner_params[idx]]))
    p2p.rank = 0
    with saves[0].owners_masters():
        for idx, params in reader_params.items():
            for k, param in enumerate(params):
                value = reader.true_value(param)
                if OWNERS[idx] == 0:
                    assert value is reader_masters[id(param)]
                else:
                    theirs = owner_masters[id(owner_params[idx][k])]
                    assert value.dtype == torch.float32 and value.shape == theirs.shape
                    assert torch.equal(value.view(torch.int32), theirs.view(torch.int32)), "the same bytes"
                    assert value.untyped_storage().nbytes() == theirs.numel() * 4, "a storage of its own bytes"
    assert not p2p.queue, "every send was received"
    assert all(reader.true_value(p) is None for idx in (1, 2) for p in reader_params[idx])


def test_params_whose_master_is_the_shared_fp32_copy_are_not_sent(p2p):
    """An fp32 layer's master is the shared packed copy, which the reader reads as it is: nothing of it is sent (nor
    counted in the RAM check), and the reader's true value of it stays the packed copy's (None: no master); a bf16
    layer's fp32 masters are sent."""
    reader, reader_params, _ = process(0, seed=0, fp32=frozenset({2}))
    owner, _, owner_masters = process(1, seed=1, fp32=frozenset({2}))
    p2p.rank = 1
    with SharedSaves.of(SimpleNamespace(feature=lambda kind: owner)).owners_masters():
        pass
    assert [entry[2].shape for entry in p2p.queue] == [layer_numel(1)], "layer 1's only"
    p2p.rank = 0
    with SharedSaves.of(SimpleNamespace(feature=lambda kind: reader)).owners_masters():
        assert all(reader.true_value(p) is None for p in reader_params[2]), "layer 2: the shared fp32 copy"
        sent = [reader.true_value(p) for p in reader_params[1]]
        assert [m.shape for m in sent] == [torch.Size(s) for s in SHAPES[1]]
        assert all(any(torch.equal(m, theirs) for theirs in owner_masters.values()) for m in sent)
    assert not p2p.queue

    every_fp32 = frozenset(SHAPES)
    owner, _, _ = process(1, seed=1, fp32=every_fp32)
    p2p.rank = 1
    with SharedSaves.of(SimpleNamespace(feature=lambda kind: owner)).owners_masters():
        pass
    assert not p2p.queue, "an fp32 model's save sends nothing"


def test_with_nccl_the_masters_go_over_the_saves_gloo_group_on_the_cpu(p2p, monkeypatch):
    """The default group is NCCL's (which sends from the GPU: two fp32 copies of a param there at a save, hours in);
    the masters go over the gloo group made at start-up instead, as CPU tensors (no CUDA here: a GPU path fails)."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    group = object()
    reader, reader_params, _ = process(0, seed=0, group=group)
    owner, _, owner_masters = process(1, seed=1, group=group)
    p2p.rank = 1
    with SharedSaves.of(SimpleNamespace(feature=lambda kind: owner)).owners_masters():
        pass
    assert all(entry[2].device.type == "cpu" for entry in p2p.queue) and len(p2p.queue) == 2
    p2p.rank = 0
    with SharedSaves.of(SimpleNamespace(feature=lambda kind: reader)).owners_masters():
        got = [reader.true_value(p) for idx in (1, 2) for p in reader_params[idx]]
        assert all(any(torch.equal(m, theirs) for theirs in owner_masters.values()) for m in got)
    assert p2p.groups == [group] * 4, "every send and receive over the saves' group"


def test_an_owner_writes_its_queued_updates_into_its_masters_before_it_sends_them(p2p, monkeypatch):
    """The host training's ``finish`` (its queued updates written) runs before the first send: else the reader
    saves masters a step old."""
    owner, _, _ = process(1, seed=1)
    order = []
    owner.training.finish = lambda: order.append("finish")
    send = p2p.send
    monkeypatch.setattr(torch.distributed, "send", lambda *a, **k: (order.append("send"), send(*a, **k)))
    p2p.rank = 1
    with SharedSaves.of(SimpleNamespace(feature=lambda kind: owner)).owners_masters():
        pass
    assert order == ["finish", "send", "send"], order


def test_an_owner_without_a_master_for_its_param_is_a_bug_not_a_save(p2p):
    owner, params, masters = process(1, seed=1)
    masters.clear()
    saves = SharedSaves.of(SimpleNamespace(feature=lambda kind: owner))
    with pytest.raises(AssertionError, match="holds no master"), saves.owners_masters():
        pass


def fake_engine(rank: int) -> SimpleNamespace:
    grid = SimpleNamespace(get_pipe_parallel_rank=lambda: 0, get_data_parallel_id=lambda: rank)
    return SimpleNamespace(module=nn.Linear(1, 1), global_steps=2, grid=grid)


def layer_state(idx: int) -> dict:
    return {"state": {0: {"exp_avg": torch.full((2,), float(idx))}}, "param_groups": [{"params": [0], "lr": 1.0}]}


def test_every_process_saves_its_share_of_the_host_state_and_rank_0_writes_while_holding_the_masters(
    tmp_path, monkeypatch
):
    """Each rank's file holds the layers it owns (a save from rank 0 only would lose rank 1's); DeepSpeed's own
    save (rank 0 writes every layer's masters, and ``latest`` last) runs inside the masters' block, on every rank,
    after every share is written (its torch.save, then the barrier): a save that stops part way leaves no
    ``latest`` naming a checkpoint without its shares. The tag folder is made if DeepSpeed has not made it."""
    events: list[str] = []
    save = torch.save
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: events.append("barrier"))
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (events.append(f"save {Path(f).name}"), save(obj, f)))
    inside = []
    for rank in (0, 1, 0, 1):  # a save into no tag folder (DeepSpeed's save makes it after the shares), then again
        if inside == [True, True]:  # the same tag again, with an earlier save's files in it, which rank 0 removes
            for stale in ("dgls_host_optimizer_stage0.pt", "dgls_host_optimizer_stage0_rank2.pt"):
                save({5: layer_state(5)}, tmp_path / "global_step2" / stale)
            events.clear()
        owned = [idx for idx, owner in OWNERS.items() if owner == rank]
        training = SimpleNamespace(adopt=lambda params: None, state_dict=lambda o=owned: {i: layer_state(i) for i in o})
        lent = []

        @contextmanager
        def owners_masters(lent=lent):
            events.append("masters")
            lent.append(True)
            yield
            lent.pop()

        def deepspeed(engine, save_dir, tag, *a, lent=lent, **k):
            events.append("deepspeed")
            inside.append(bool(lent))

        shared = SimpleNamespace(ownership=Ownership(rank, 2, OWNERS), owners_masters=owners_masters)
        hooks = EngineHooks(lambda module, t=training: t, shared=lambda module, s=shared: s)
        hooks._wrap_save(deepspeed)(fake_engine(rank), tmp_path, "global_step2")
        share = f"save dgls_host_optimizer_stage0_rank{rank}.pt"
        assert events == [share, "barrier", "masters", "deepspeed"], events
        events.clear()
    assert inside == [True] * 4
    files = host_state_files(tmp_path / "global_step2", 0)
    assert [p.name for p in files] == ["dgls_host_optimizer_stage0_rank0.pt", "dgls_host_optimizer_stage0_rank1.pt"]
    held = [sorted(torch.load(p, weights_only=True)) for p in files]
    assert held == [[0, 3], [1, 2]]

    training = SimpleNamespace(adopt=lambda params: None, state_dict=lambda: {i: layer_state(i) for i in OWNERS})
    one = EngineHooks(lambda module: training)._wrap_save(lambda *a, **k: events.append("deepspeed"))
    one(fake_engine(0), tmp_path, "global_step2")  # one process saves the same tag again: its file alone is read
    assert events == ["save dgls_host_optimizer_stage0.pt", "deepspeed"], "its file before DeepSpeed's latest"
    files = host_state_files(tmp_path / "global_step2", 0)
    assert [p.name for p in files] == ["dgls_host_optimizer_stage0.pt"]
    assert not list((tmp_path / "global_step2").glob("*_rank*.pt"))


def test_a_save_without_host_training_or_off_data_parallel_rank_0_writes_no_host_state(tmp_path):
    """Without host training (or, one process per stage, on a data-parallel rank other than 0) DeepSpeed's save runs
    alone, with the tag resolved as for a save that writes (``global_step<N>``)."""
    calls = []
    training = SimpleNamespace(adopt=lambda params: None, state_dict=lambda: {0: layer_state(0)})
    for find, rank in ((lambda module: None, 0), (lambda module: training, 1)):
        EngineHooks(find)._wrap_save(lambda engine, save_dir, tag, *a, **k: calls.append(tag))(
            fake_engine(rank), tmp_path
        )
    assert calls == ["global_step2", "global_step2"]
    assert not list(tmp_path.rglob("*.pt"))


def test_a_host_state_files_name_is_made_and_parsed_in_one_place(tmp_path):
    """The names DGLS writes (the stage's one file, a data-parallel process's share) parse back to what made them,
    names saved before (these are the files of older checkpoints) parse as they did, other files are not host state;
    the listing of a stage's files takes its own stage's shares only, by rank, or its one file alone."""
    for made in (HostStateName(0), HostStateName(3), HostStateName(0, 0), HostStateName(2, 11)):
        assert HostStateName.parse(made.name) == made
    assert HostStateName(1).name == "dgls_host_optimizer_stage1.pt"
    assert HostStateName(1, 2).name == "dgls_host_optimizer_stage1_rank2.pt"
    assert HostStateName.parse("dgls_host_optimizer_stage0.pt") == HostStateName(0, None)
    assert HostStateName.parse("dgls_host_optimizer_stage12_rank3.pt") == HostStateName(12, 3)
    others = ["layer_00-model_states.pt", "mp_rank_00_model_states.pt", "dgls_host_optimizer_stage.pt"]
    others += [
        "dgls_host_optimizer_stage0_rank.pt",
        "dgls_host_optimizer_stage0.pt.tmp",
        "x_dgls_host_optimizer_stage0.pt",
    ]
    for other in others:
        assert HostStateName.parse(other) is None, other
    shares = [f"dgls_host_optimizer_stage0_rank{rank}.pt" for rank in (0, 2, 10)]  # by rank, not by name
    for name in [*shares, "dgls_host_optimizer_stage1_rank0.pt", "notes.pt"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in host_state_files(tmp_path, 0)] == shares
    assert [p.name for p in stale_host_state_files(tmp_path, 0, 2)] == shares[1:]
    (tmp_path / "dgls_host_optimizer_stage0.pt").write_bytes(b"")
    assert [p.name for p in host_state_files(tmp_path, 0)] == ["dgls_host_optimizer_stage0.pt"]
    assert [p.name for p in stale_host_state_files(tmp_path, 0, None)] == shares
    assert [p.name for p in stale_host_state_files(tmp_path, 0, 2)] == ["dgls_host_optimizer_stage0.pt", *shares[1:]]
    assert [p.name for p in host_state_files(tmp_path, 1)] == ["dgls_host_optimizer_stage1_rank0.pt"]


def read(path: Path) -> object:
    return torch.load(path, weights_only=True)


def write_shares(folder: Path, shares: list[list[int]], whole: dict | None = None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, layers in enumerate(shares):
        state = {i: (whole[i] if whole is not None else layer_state(i)) for i in layers}
        torch.save(state, folder / f"dgls_host_optimizer_stage0_rank{rank}.pt")
        paths.append(folder / f"dgls_host_optimizer_stage0_rank{rank}.pt")
    return paths


@pytest.mark.parametrize(
    "saved, keep",
    [([[0, 3], [1, 2]], {1, 2}), ([[0, 3], [1, 2]], {0, 1, 2, 3}), ([[0, 1, 2, 3]], {0, 3}), ([[0], [1], [2, 3]], {3})],
    ids=["same-owners", "two-into-one", "one-into-two", "three-into-two"],
)
def test_a_resume_takes_each_layers_state_from_whichever_file_holds_it(tmp_path, saved, keep):
    paths = write_shares(tmp_path, saved)
    state, problem = merged_host_state(paths, read, keep, set(OWNERS))
    assert problem is None and sorted(state) == sorted(keep)
    for idx, value in state.items():
        assert torch.equal(value["state"][0]["exp_avg"], layer_state(idx)["state"][0]["exp_avg"])


def test_a_missing_or_doubled_share_is_one_line(tmp_path):
    paths = write_shares(tmp_path / "a", [[0, 3], [1, 2]])
    state, problem = merged_host_state(paths[:1], read, {0, 3}, set(OWNERS))
    assert state is None and "the file holding layers [1, 2] is missing" in problem and "\n" not in problem
    paths = write_shares(tmp_path / "b", [[0, 3], [1, 2, 3]])
    state, problem = merged_host_state(paths, read, {0, 3}, set(OWNERS))
    assert state is None and "holds the optimizer state of layer 3 twice" in problem


def test_a_whole_step_state_in_the_one_file_goes_to_the_host_trainings_check(tmp_path):
    torch.save({"optimizer": {}, "layers": [0]}, tmp_path / "dgls_host_optimizer_stage0.pt")
    state, problem = merged_host_state([tmp_path / "dgls_host_optimizer_stage0.pt"], read, {0}, {0})
    assert problem is None and state == {"optimizer": {}, "layers": [0]}


def test_a_data_parallel_process_reads_only_its_layers_from_a_one_process_checkpoint(tmp_path):
    folder = tmp_path / "global_step2"
    folder.mkdir()
    torch.save({i: layer_state(i) for i in OWNERS}, folder / "dgls_host_optimizer_stage0.pt")
    training = SimpleNamespace(
        layers={1: None, 2: None},
        adopt=lambda params: None,
        state_problem=lambda state, keep: None if sorted(state) == [1, 2] else f"holds {sorted(state)}",
    )
    shared = SimpleNamespace(layers=set(OWNERS))
    state = _read_host_state(training, nn.Linear(1, 1), tmp_path, "global_step2", 0, False, shared)
    assert sorted(state) == [1, 2]


def test_one_process_resumes_the_shares_two_processes_saved(tmp_path):
    """A real host training (one process) loads the state two processes saved, split by owner: each layer's moments
    as saved; with one share gone, one line before DeepSpeed loads."""
    run, state = host_state(tmp_path)
    folder = run / "global_step2"
    (folder / "dgls_host_optimizer_stage0.pt").unlink()
    layers = sorted(state)
    write_shares(folder, [layers[::2], layers[1::2]], whole=state)
    training, loaded = load_into(run)
    assert loaded == ["global_step2"]
    for idx, layer in training.layers.items():
        for i, p in enumerate(p for g in layer.optimizer.param_groups for p in g["params"]):
            assert torch.equal(layer.optimizer.state[p]["exp_avg"], state[idx]["state"][i]["exp_avg"])
    (folder / "dgls_host_optimizer_stage0_rank1.pt").unlink()
    with pytest.raises(DGLSUserError, match="^[^\n]*$") as caught:
        load_into(run)
    assert f"the file holding layers {layers[1::2]} is missing" in str(caught.value)


def test_the_check_before_start_up_takes_the_shares_of_a_stage_as_that_stage(tmp_path):
    """Before start-up (program/resume.py): the processes' files of stage 0 are stage 0's, not stages of their own."""
    from cli_helpers import write_checkpoint
    from test_resume_checks import FULL, resume

    folder = write_checkpoint(tmp_path / "out" / "20250101_00-00-00", adapter=False, host_stages=1)
    (folder / "dgls_host_optimizer_stage0.pt").rename(folder / "dgls_host_optimizer_stage0_rank0.pt")
    torch.save({2: layer_state(2)}, folder / "dgls_host_optimizer_stage0_rank1.pt")
    resume(tmp_path, FULL, "--resume_from_checkpoint")
    torch.save({2: layer_state(2)}, folder / "dgls_host_optimizer_stage1_rank0.pt")
    with pytest.raises(
        DGLSUserError, match="holds DGLS host optimizer states of 2 pipeline stages, and this run has 1"
    ):
        resume(tmp_path, FULL, "--resume_from_checkpoint")


def test_a_resume_maps_each_file_and_keeps_copies_of_its_layers_only(tmp_path, monkeypatch):
    """N processes resuming a one-process checkpoint map the file (each reads only its layers' bytes, not the whole
    file at once), and keep copies: a view of the mapped file would stay in the optimizer (its ``load_state_dict``
    keeps a tensor of its dtype) and a later save of the same tag rewrites the file under it."""
    folder = tmp_path / "global_step2"
    folder.mkdir()
    torch.save({i: layer_state(i) for i in OWNERS}, folder / "dgls_host_optimizer_stage0.pt")
    loads, mapped = [], []
    load = torch.load

    def spy(*args, **kwargs):
        loads.append(kwargs.get("mmap", False))
        state = load(*args, **kwargs)
        mapped.extend(v["state"][0]["exp_avg"].untyped_storage().data_ptr() for v in state.values())
        return state

    monkeypatch.setattr(torch, "load", spy)
    training = SimpleNamespace(layers={1: None, 2: None}, adopt=lambda params: None, state_problem=lambda s, k: None)
    shared = SimpleNamespace(layers=set(OWNERS))
    state = _read_host_state(training, nn.Linear(1, 1), tmp_path, "global_step2", 0, False, shared)
    assert loads == [True], "the file is mapped, not read whole"
    assert sorted(state) == [1, 2]
    for idx, value in state.items():
        kept = value["state"][0]["exp_avg"]
        assert kept.untyped_storage().data_ptr() not in mapped, f"layer {idx}'s state is a view of the mapped file"
        assert torch.equal(kept, layer_state(idx)["state"][0]["exp_avg"])


def test_a_whole_step_state_is_copied_out_of_its_file_too(tmp_path):
    torch.save({"optimizer": {"state": {0: torch.ones(3)}}}, tmp_path / "dgls_host_optimizer_stage0.pt")
    held = []

    def mapped(path):
        held.append(torch.load(path, weights_only=True, mmap=True))
        return held[-1]

    state, problem = merged_host_state([tmp_path / "dgls_host_optimizer_stage0.pt"], mapped, {0}, {0})
    assert problem is None and torch.equal(state["optimizer"]["state"][0], torch.ones(3))
    assert state["optimizer"]["state"][0].data_ptr() != held[0]["optimizer"]["state"][0].data_ptr()


def test_the_check_before_start_up_finds_a_missing_share_and_a_layer_in_two_shares(tmp_path):
    """Before start-up, not after the model's load: share files with a rank missing between (rank 1 of 0..2), or
    with one layer in two of them, are one line naming the file or the layer."""
    from cli_helpers import write_checkpoint
    from test_resume_checks import FULL, resume

    folder = write_checkpoint(tmp_path / "out" / "20250101_00-00-00", adapter=False, host_stages=1)
    (folder / "dgls_host_optimizer_stage0.pt").unlink()
    for rank, layers in enumerate([[0], [1], [2]]):
        torch.save({i: layer_state(i) for i in layers}, folder / f"dgls_host_optimizer_stage0_rank{rank}.pt")
    resume(tmp_path, FULL, "--resume_from_checkpoint")
    (folder / "dgls_host_optimizer_stage0_rank1.pt").unlink()
    with pytest.raises(DGLSUserError, match="^[^\n]*$") as caught:
        resume(tmp_path, FULL, "--resume_from_checkpoint")
    assert "processes [0, 2] of pipeline stage 0 and no dgls_host_optimizer_stage0_rank1.pt" in str(caught.value)
    torch.save({2: layer_state(2)}, folder / "dgls_host_optimizer_stage0_rank1.pt")
    with pytest.raises(DGLSUserError, match="^[^\n]*$") as caught:
        resume(tmp_path, FULL, "--resume_from_checkpoint")
    assert "layer 2 twice, in dgls_host_optimizer_stage0_rank1.pt and dgls_host_optimizer_stage0_rank2.pt" in str(
        caught.value
    )
