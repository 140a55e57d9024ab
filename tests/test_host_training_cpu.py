"""Full fine-tuning with streamed layers on the CPU: bitwise equal to the same training without streaming.

Streamed layers' params are trained on the host (fp32 masters, gradients copied home, the host
optimizer); the first and last layer stay resident and train with the trainer's optimizer. Every
checkpoint mode, prefetch 0-3, with gradient accumulation, clipping and eval passes between steps.
The deferred copiers make the two orderings this depends on fail here when removed: a gradient read
before its copy landed, and a fetch that does not wait for its layer's update.
"""

import dataclasses
import threading

import pytest
import torch
from full_ft import (
    DEVICE,
    FUSED,
    MAX_NORM,
    SPEC,
    SPLIT,
    FullRecord,
    assert_same,
    differs,
    flip_sides_every_step,
    full_layers,
    params_of,
    train_dgls,
    train_reference,
)
from helpers import skip_waits

from utils.dgls import DGLSUserError, LayerSwapper, SwapConfig
from utils.dgls.memory import host_store
from utils.dgls.memory.peers import Others
from utils.dgls.memory.transport import Direction, Transport
from utils.dgls.training import device_update, grad_return, host_training
from utils.dgls.training.grad_return import GradReturn, GradState
from utils.dgls.training.host_optimizer import HostOptimizerSpec
from utils.dgls.training.host_training import HostTraining
from utils.dgls.training.update_split import UpdateSplit
from utils.dgls.training.updaters import DeviceSide

CPU = torch.device("cpu")
MODES = ["none", "nonreentrant", "reentrant"]


def config(**kw) -> SwapConfig:
    return SwapConfig.of(host_optimizer=SPEC, accumulation_steps=2, **kw)


def host_names(swapper, layers) -> set[str]:
    return {
        f"{i}.{n}" for i, layer in enumerate(layers) for n, p in layer.named_parameters() if swapper.training.owns(p)
    }


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(mode, names):
        key = (mode, frozenset(names))
        if key not in cache:
            cache[key] = train_reference(full_layers(), names, CPU, mode)
        return cache[key]

    return get


def dgls_run(mode, **kw):
    layers = full_layers()
    with LayerSwapper(layers, config(**kw), device=CPU, log=None) as swapper:
        names = host_names(swapper, layers)
        record = train_dgls(layers, swapper, CPU, mode)
    return record, names


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_full_fine_tuning_equals_unstreamed_training(references, mode, prefetch):
    record, names = dgls_run(mode, prefetch=prefetch)
    assert len(names) > 0
    assert_same(record, references(mode, names))


@pytest.mark.parametrize("mode", MODES)
def test_full_fine_tuning_with_worker_threads_equals_unstreamed_training(references, mode):
    record, names = dgls_run(mode, prefetch=2, threading=True)
    assert_same(record, references(mode, names))


def threads_of_each_adamw_step(monkeypatch, local_size: str | None) -> tuple[set, FullRecord, list]:
    """A threaded run with 4 intra-op threads and the launcher's LOCAL_SIZE (None: unset; no OMP_NUM_THREADS):
    the (thread, intra-op threads) of every AdamW step, the record and the names; the count restored after it."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    if local_size is not None:
        monkeypatch.setenv("LOCAL_SIZE", local_size)
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # the worker thread starts from this count
    seen = set()
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.add((threading.current_thread().name, torch.get_num_threads()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    try:
        record, names = dgls_run("nonreentrant", prefetch=2, threading=True)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
    return seen, record, names


def test_host_updates_on_the_worker_use_three_quarters_of_the_threads_and_leave_the_training_threads_alone(
    references, monkeypatch
):
    """The worker's AdamW runs with 3 of 4 intra-op threads (the training thread launches kernels meanwhile);
    the count is restored after each update, the training thread's never changes, and the numbers stay."""
    seen, record, names = threads_of_each_adamw_step(monkeypatch, None)
    assert seen == {("dgls-jobs", 3), ("MainThread", 4)}  # the host's, and the trainer's own AdamW
    assert_same(record, references("nonreentrant", names))


def test_the_processes_of_a_machine_share_its_cores_for_their_host_updates(references, monkeypatch):
    """With the launcher saying 2 processes run here (deepspeed: LOCAL_SIZE), each one's worker updates with 3
    quarters of its half of the threads: 4 threads give 1, not 3 (two processes at 3 each oversubscribe 4 cores);
    the numbers stay (the trainer's thread keeps 4, as the reference's run: its matmuls' sums stay the same)."""
    from utils.dgls.training.training_feature import processes_here
    from utils.dgls.training.updaters import update_threads

    assert update_threads(32) == 24 and update_threads(32, 2) == 12 and update_threads(2, 4) == 1
    assert processes_here(2, {}) == 2 and processes_here(1, {"LOCAL_SIZE": "3"}) == 3
    assert processes_here(2, {"OMP_NUM_THREADS": "8", "LOCAL_SIZE": "2"}) == 1, "OMP_NUM_THREADS: one process's count"
    seen, record, names = threads_of_each_adamw_step(monkeypatch, "2")
    assert seen == {("dgls-jobs", 1), ("MainThread", 4)}
    assert_same(record, references("nonreentrant", names))


@pytest.mark.parametrize("mode", MODES)
def test_bf16_compute_with_fp32_masters_equals_unstreamed_training(mode):
    """The slots and resident params hold bf16; streamed layers' masters and gradient sums are fp32."""
    layers = full_layers(torch.bfloat16)
    with LayerSwapper(layers, config(prefetch=2), device=CPU, log=None) as swapper:
        names = host_names(swapper, layers)
        assert all(tp.master.dtype == torch.float32 for lay in swapper.training.layers.values() for tp in lay.params)
        record = train_dgls(layers, swapper, CPU, mode, dtype=torch.bfloat16)
    assert_same(record, train_reference(full_layers(torch.bfloat16), names, CPU, mode, dtype=torch.bfloat16))


@pytest.mark.parametrize("threading", [False, True])
def test_without_clipping_updates_start_during_backward_and_equal_unstreamed_training(threading):
    """clip_grads = False: each layer's update is queued once its last micro-batch's grads are summed, before
    the backward ends; the numbers stay those of training without streaming (and without clipping)."""
    layers = full_layers()
    queued_in_backward = []
    with LayerSwapper(layers, config(clip_grads=False, threading=threading), device=CPU, log=None) as swapper:
        training = swapper.training
        original = training.backward_done

        def backward_done():
            queued = [layer.grads.state is GradState.QUEUED for layer in training.layers.values()]
            queued_in_backward.append(sum(queued))
            original()

        training.backward_done = backward_done
        names = host_names(swapper, layers)
        record = train_dgls(layers, swapper, CPU, "nonreentrant", max_norm=None)
        with pytest.raises(DGLSUserError, match="clip_grads"):
            training.clip_grad_norm_(params_of(layers), 1.0)
    assert queued_in_backward[1::2] == [len(training.layers)] * 3  # the last micro-batch of each step
    assert_same(record, train_reference(full_layers(), names, CPU, "nonreentrant", max_norm=None))


def test_every_layer_streamed_leaves_the_trainer_nothing(references):
    record, names = dgls_run("nonreentrant", gpu_layers=[])
    assert len(names) == sum(1 for p in params_of(full_layers()))
    assert_same(record, references("nonreentrant", names))


def test_a_gradient_read_before_its_copy_landed_fails(references, monkeypatch):
    skip_waits(monkeypatch, Direction.GRADS_HOME)  # the mutation
    record, names = dgls_run("nonreentrant")
    assert differs(record, references("nonreentrant", names))


def test_a_fetch_that_does_not_wait_for_its_update_fails(references, monkeypatch):
    monkeypatch.setattr(HostTraining, "wait_update", lambda self, idx: None)  # the mutation
    record, names = dgls_run("nonreentrant")
    assert differs(record, references("nonreentrant", names))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", [SPEC, FUSED], ids=["torch", "torch_fused"])
def test_host_updates_of_one_micro_batch_read_the_landings_and_equal_unstreamed_training(mode, spec):
    """One micro-batch a step: no fp32 gradient sum is kept on the host (4 bytes a param); each update
    converts the layer's landings into one reused fp32 buffer, with norms taken before the grads left."""
    layers = full_layers(torch.bfloat16)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, prefetch=2, threading=mode == "none")
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        names = host_names(swapper, layers)
        record = train_dgls(layers, swapper, CPU, mode, accumulate=1, dtype=torch.bfloat16)
        assert all(tp.acc is None for layer in swapper.training.layers.values() for tp in layer.params)
    want = train_reference(
        full_layers(torch.bfloat16), names, CPU, mode, accumulate=1, dtype=torch.bfloat16, host_spec=spec
    )
    assert_same(record, want)


def test_a_landing_read_before_its_copy_landed_fails_with_one_micro_batch(monkeypatch):
    layers = full_layers()
    with LayerSwapper(
        layers, SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1), device=CPU, log=None
    ) as swapper:
        names = host_names(swapper, layers)
        good = train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=1)
    skip_waits(monkeypatch, Direction.GRADS_HOME)  # the mutation
    layers = full_layers()
    with LayerSwapper(
        layers, SwapConfig.of(host_optimizer=SPEC, accumulation_steps=1), device=CPU, log=None
    ) as swapper:
        assert host_names(swapper, layers) == names
        assert differs(train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=1), good)


@pytest.mark.parametrize(
    "spec, dtype, accumulate",
    [
        (SPEC, torch.float32, 2),
        (DEVICE, torch.bfloat16, 1),
        (SPLIT, torch.bfloat16, 1),
        (dataclasses.replace(SPEC, type="sgd", momentum=0.9, implementation="device"), torch.bfloat16, 1),
    ],
    ids=["host", "device-flat", "split-flat", "sgd-device-flat"],
)
def test_save_and_resume_equal_an_uninterrupted_run(spec, dtype, accumulate):
    """Two steps, save (model state dict with the true weights, host and trainer optimizer states); a new
    model and swapper load them and run the third step: the same losses and weights as three in a row.
    Device and split updates in bf16 keep their moments (SGD: its momentum buffers) in flat buffers, which a load
    refills."""
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=accumulate)
    kw = {"accumulate": accumulate, "dtype": dtype}
    layers = full_layers(dtype)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        whole = train_dgls(layers, swapper, CPU, "nonreentrant", **kw)
    part1, saved = train_and_save(cfg, steps=2, **kw)
    part2 = resume(saved, cfg, steps=1, start_step=2, **kw)
    assert torch.equal(torch.stack(part1.losses + part2.losses), torch.stack(whole.losses))
    assert part2.weights.keys() == whole.weights.keys()
    for k, v in whole.weights.items():
        assert torch.equal(part2.weights[k], v), k


def train_and_save(cfg: SwapConfig, steps: int, **kw):
    """``steps`` steps of a new model under ``cfg``, then what a checkpoint holds: the model's state dict (the true
    weights), the host optimizer state and the trainer's optimizer state."""
    saved = {}
    layers = full_layers(kw["dtype"])
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:

        def save(step, trainer):
            saved["model"] = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
            saved["host"] = swapper.training.state_dict()
            saved["trainer"] = trainer.state_dict()

        result = train_dgls(layers, swapper, CPU, "nonreentrant", steps=steps, on_step=save, **kw)
    return result, saved


def resume(saved: dict, cfg: SwapConfig, steps: int, start_step: int, keep: bool = False, **kw):
    """A new model and swapper under ``cfg`` load ``saved`` (:func:`train_and_save`) and train ``steps`` more."""
    layers = full_layers(kw["dtype"])
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        for layer, state in zip(layers, saved["model"]):
            layer.load_state_dict(state)
        swapper.training.load_state_dict(saved["host"], keep_hyper_parameters=keep)
        return train_dgls(
            layers, swapper, CPU, "nonreentrant", steps=steps, start_step=start_step, trainer_state=saved["trainer"],
            **kw,
        )  # fmt: skip


def resumed(spec, saved_spec, dtype=torch.bfloat16, keep=False):
    """One step with ``saved_spec`` and its host optimizer state saved; a new run with ``spec`` loads it (its
    hyper-parameters as saved, unless ``keep``) and takes one more step, at the param groups' lr."""
    kw = {"accumulate": 1, "dtype": dtype}
    _, saved = train_and_save(SwapConfig.of(host_optimizer=saved_spec, accumulation_steps=1), steps=1, **kw)
    return resume(saved, SwapConfig.of(host_optimizer=spec, accumulation_steps=1), 1, 1, keep=keep, **kw)


@pytest.mark.parametrize("implementation", ["device", "split"])
def test_device_updates_after_a_resume_use_the_hyper_parameters_it_loaded(monkeypatch, implementation):
    """A checkpoint saved with another lr and weight decay: torch's load replaces the optimizer's param groups, and
    the device's kernel must read the new ones, as the host's optimizer does (split: both sides alike)."""
    if implementation == "split":
        flip_sides_every_step(monkeypatch)
    spec = dataclasses.replace(SPEC, implementation=implementation)
    before = dataclasses.replace(spec, lr=3e-2, weight_decay=0.3)
    want = resumed(FUSED, dataclasses.replace(before, implementation="torch_fused"))
    assert_same(resumed(spec, before), want)
    assert differs(resumed(spec, spec), want)  # the saved hyper-parameters do change the numbers


@pytest.mark.parametrize("saved, here", [(0.9, 0.0), (0.0, 0.9)])
def test_an_sgd_resume_that_would_switch_the_devices_momentum_buffer_is_one_line_unless_kept(saved, here):
    """SGD on the device keeps a momentum buffer only with momentum (:mod:`~utils.dgls.training.optimizer_kernels`):
    a checkpoint whose momentum is zero where this run's is not (or the reverse) would run the kernel with the
    checkpoint's momentum on the wrong state; refused in one line, and with the run's hyper-parameters kept the
    resumed step equals torch.optim.SGD's."""
    sgd = HostOptimizerSpec(type="sgd", lr=1e-2, weight_decay=0.01, implementation="device")
    with pytest.raises(DGLSUserError, match=f"momentum {saved} for layer .* momentum is {here} here"):
        resumed(dataclasses.replace(sgd, momentum=here), dataclasses.replace(sgd, momentum=saved))
    torch_sgd = dataclasses.replace(sgd, implementation="torch")
    want = resumed(
        dataclasses.replace(torch_sgd, momentum=here), dataclasses.replace(torch_sgd, momentum=saved), keep=True
    )
    got = resumed(dataclasses.replace(sgd, momentum=here), dataclasses.replace(sgd, momentum=saved), keep=True)
    assert_same(got, want)


def test_refusals_are_one_clear_line():
    with pytest.raises(DGLSUserError, match="cannot run on the host"):
        type(SPEC)(type="prodigy")
    layers = full_layers()
    with LayerSwapper(layers, config(), device=CPU, log=None) as swapper:
        with pytest.raises(DGLSUserError, match="places layers once"):
            swapper.apply_placement([1, 2], 1)


def test_the_trainer_optimizer_is_the_class_the_type_names_with_diffusion_pipes_groups():
    """What train.py builds for the params it keeps: torch.optim.AdamW or SGD with the table's settings, 1-D params
    without weight decay (the host's kernel choice is the host's only)."""
    params = [torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))]
    adamw = dataclasses.replace(SPEC, implementation="split", betas=(0.8, 0.9)).trainer_optimizer(params)
    assert type(adamw) is torch.optim.AdamW and not adamw.defaults["fused"] and adamw.defaults["betas"] == (0.8, 0.9)
    assert [(len(g["params"]), g["weight_decay"]) for g in adamw.param_groups] == [(1, 0.01), (1, 0.0)]
    sgd = dataclasses.replace(SPEC, type="sgd", implementation="torch_fused", momentum=0.9).trainer_optimizer(params)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9


def test_start_up_says_how_much_host_ram_training_takes():
    lines = []
    with LayerSwapper(full_layers(), config(), device=CPU, log=lines.append):
        pass
    (line,) = [x for x in lines if x.startswith("DGLS host training:")]
    assert "masters" in line and "gradients" in line and "optimizer" in line


def test_a_host_without_the_ram_for_training_is_refused_with_the_numbers(monkeypatch):
    """The masters, gradients and optimizer state must fit beside the host's reserve (a tenth of its RAM,
    2 GiB at least), checked before anything is packed."""
    lines = []
    with LayerSwapper(full_layers(), config(), device=CPU, log=lines.append):
        pass
    (line,) = [x for x in lines if x.startswith("DGLS host training:")]

    class Host:
        total = 16 * 2**30  # reserve: 2 GiB
        available = 2 * 2**30 + 1024  # 1 KiB beside the reserve

    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)
    with pytest.raises(DGLSUserError, match=r"needs .* of host RAM .* and 2\.00 GiB is free, of which 2\.00 GiB stays"):
        LayerSwapper(full_layers(), config(), device=CPU, log=None)
    # under a VRAM budget the first step streams every layer (the probe): the advice is the placement by hand
    budget = r"stays for the rest of the host: a VRAM budget's first step streams every layer"
    with pytest.raises(DGLSUserError, match=budget) as err:
        LayerSwapper(full_layers(), config(vram_budget=1.0), device=CPU, log=None)
    assert "replace the budget with a placement by hand (gpu_layers or blocks_to_swap;" in str(err.value)
    assert "stream fewer layers" not in str(err.value)
    assert "MiB of host RAM" in line  # the small model needs less than the GiB left beside the reserve here:
    Host.available = 3 * 2**30
    with LayerSwapper(full_layers(), config(), device=CPU, log=None):
        pass


def test_a_data_parallel_saves_copy_of_the_other_owners_masters_is_counted_in_the_ram_check(monkeypatch):
    """While a save runs, a data-parallel job's reader also holds the other owners' fp32 masters
    (training/shared_saves.py): a host with room for the training state but not for that copy is refused up front,
    naming it, rather than running out of RAM at the first save."""
    with LayerSwapper(full_layers(torch.bfloat16), config(), device=CPU, log=None) as swapper:
        layout = swapper.training.layout
    need = sum(v for k, v in layout.parts().items() if k != "speculation")

    class Host:
        total = 16 * 2**30  # reserve: 2 GiB
        available = 2 * 2**30 + need + 1024

    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)
    assert host_training.check_host_training(layout).startswith("DGLS host training:")
    with pytest.raises(DGLSUserError, match=r"a save's copy of the other processes' masters 0\.2 MiB\) beyond"):
        host_training.check_host_training(layout, save_copy=200 * 1024)


def test_the_room_for_spares_is_shared_by_the_processes_on_the_machine(monkeypatch):
    """The optional spares of speculated updates take half of what is left beside the reserve, the need and what the
    process holds besides (its packed copies): on a machine with other processes of the job (pipeline stages, or data
    parallel's other shares), what they need and hold is taken off first and each process gets its share of the
    rest, so the processes together keep half of it free for saves and the data loader."""
    with LayerSwapper(full_layers(torch.bfloat16), config(), device=CPU, log=None) as swapper:
        layout = swapper.training.layout
    assert layout.spares_wanted, "clipping with host AdamW speculates"
    need = host_training.host_training_need(layout)
    beside = host_training.host_training_beside(layout)
    every = sum(layout.spare_bytes(idx) for idx in layout.spares_wanted)

    class Host:
        total = 16 * 2**30  # reserve: 2 GiB
        available = 2 * 2**30 + need + beside + 2 * every  # alone: room for every spare in half of what is left

    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)

    def spares(others) -> int:
        host_training.check_host_training(layout, others=others)
        return sum(layout.spare_bytes(idx) for idx in layout.spares)

    assert spares(Others()) == every
    assert spares(Others(0, 1, 0)) <= every // 2, "two processes: each half of its own half"
    Host.available += need + beside  # room for a second process's need and holdings: each still gets half
    assert spares(Others(need, 1, beside)) <= every // 2 < spares(Others())
    assert 0 < spares(Others(need, 1, beside))


class Built(Exception):
    """Stops a build at its SharedGradients (the test has no torch.distributed job to go on with)."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_builder_counts_a_saves_copy_of_the_other_owners_own_masters_only(monkeypatch, dtype):
    """engine/build.py's data-parallel share: with 2 owners, a bf16 model's reader holds rank 1's fp32 masters while a
    save runs: a host with room for the training state only is refused, naming that copy, and every param has a
    master of its own to send; an fp32 model's masters are the shared copies: nothing to count, nothing sent. The
    saves' gloo group is made there, on every rank (the masters go over it on the CPU), after every process agreed on
    the RAM check."""
    from utils.dgls.engine import build
    from utils.dgls.training.data_parallel import Ownership

    with LayerSwapper(full_layers(dtype), config(), device=CPU, log=None) as swapper:
        layout = swapper.training.layout  # one process's: every share together
    need = sum(v for k, v in layout.parts().items() if k != "speculation")

    class Host:
        total = 16 * 2**30  # reserve: 2 GiB
        available = 2 * 2**30 + need + 1024

    built, groups = [], []

    def shared_gradients(ownership, params, shapes, **kwargs):
        built.append((params, kwargs["own_masters"]))
        assert kwargs["save_group"] is groups[-1][0], "the saves' gloo group, made before"
        raise Built

    agreed = []  # every process agrees on one's refusal before the collectives (each reads its own free RAM)

    def agree(problem):
        agreed.append(problem)
        if problem:
            raise DGLSUserError(problem)

    monkeypatch.setattr(build, "agree", agree)
    monkeypatch.setattr(host_store.psutil, "virtual_memory", lambda: Host)
    monkeypatch.setattr(build, "job_ownership", lambda numels, groups: Ownership.assign(numels, groups, 0, 2))
    monkeypatch.setattr(build, "SharedGradients", shared_gradients)
    monkeypatch.setattr(torch.distributed, "new_group", lambda **kw: groups.append((object(), kw)) or groups[-1][0])
    if dtype == torch.bfloat16:
        with pytest.raises(DGLSUserError, match=r"a save's copy of the other processes' masters"):
            LayerSwapper(full_layers(dtype), config(data_parallel=True), device=CPU, log=None)
        Host.available = 3 * 2**30 + 2 * need
    with pytest.raises(Built):
        LayerSwapper(full_layers(dtype), config(data_parallel=True), device=CPU, log=None)
    params, own = built[0]
    every = {id(p) for layer in params.values() for p in layer}
    assert own == (every if dtype == torch.bfloat16 else set())
    assert [kw for _, kw in groups] == [{"backend": "gloo"}], "one gloo group for the saves, made by every rank"
    assert [bool(problem) for problem in agreed] == ([True, False] if dtype == torch.bfloat16 else [False])


def test_remove_puts_the_trained_weights_back():
    layers = full_layers()
    with LayerSwapper(layers, config(), device=CPU, log=None) as swapper:
        record = train_dgls(layers, swapper, CPU, "none", steps=1)
    for i, layer in enumerate(layers):
        for k, v in layer.state_dict().items():
            assert torch.equal(v, record.weights[f"{i}.{k}"]), (i, k)


# ---------------------------------------------------------------- device updates (--host_adam device)
# On the CPU the "device" is the CPU: the same streamed steps (state copied into scratch buffers, torch's
# fused AdamW kernel, copied back) with the numbers of torch.optim.AdamW(fused=True) on the CPU.


def device_run(
    mode, accumulate, dtype=torch.float32, max_norm=MAX_NORM, spec=DEVICE, seen=None, build=full_layers, **kw
):
    """``build(dtype)``: the layers, for DGLS and (built again) for the reference."""
    layers = build(dtype)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=accumulate, **kw)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        names = host_names(swapper, layers)
        record = train_dgls(layers, swapper, CPU, mode, accumulate=accumulate, dtype=dtype, max_norm=max_norm)
        direct = swapper.training.direct
        if seen is not None:
            seen.append(swapper.training)
    reference = train_reference(
        build(dtype),
        names,
        CPU,
        mode,
        accumulate=accumulate,
        dtype=dtype,
        max_norm=max_norm,
        host_spec=FUSED,
    )
    return record, reference, direct


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_device_updates_equal_unstreamed_training_with_torch_fused_adamw(mode, accumulate):
    """One micro-batch a step: the update reads the gradient landings directly (no host sum); two: from the
    host's fp32 sums."""
    record, reference, direct = device_run(mode, accumulate, prefetch=2)
    assert direct == (accumulate == 1)
    assert_same(record, reference)


def test_gradient_release_device_updates_of_flat_layers_equal_unstreamed_training():
    """gradient_release: the optimizer's params are one group in layout order (a Linear's bias between
    two weights), and a flat layer's masters, state and landings follow that order, not diffusion-pipe's two
    groups' (2-D first): the device's kernel steps the flat buffers as the groups say, bitwise as the reference."""
    fused = dataclasses.replace(FUSED, gradient_release=True)
    spec = dataclasses.replace(DEVICE, gradient_release=True)
    layers = full_layers(torch.bfloat16)
    cfg = SwapConfig.of(host_optimizer=spec, accumulation_steps=1, clip_grads=False)
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        names = host_names(swapper, layers)
        assert swapper.training.layers and all(layer.flat is not None for layer in swapper.training.layers.values())
        record = train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=1, dtype=torch.bfloat16, max_norm=None)
    kw = {"accumulate": 1, "dtype": torch.bfloat16, "max_norm": None}
    want = train_reference(full_layers(torch.bfloat16), names, CPU, "nonreentrant", **kw, host_spec=fused)
    assert_same(record, want)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_device_updates_in_small_chunks_with_threads_and_bf16_compute_equal_unstreamed_training(
    monkeypatch, accumulate
):
    """Scratch buffers of 1000 params: every layer's step runs in several chunks, the two buffers alternating,
    and params larger than a chunk alone."""
    monkeypatch.setattr(device_update, "DEFAULT_CAPACITY", 1000)
    record, reference, _ = device_run("nonreentrant", accumulate, torch.bfloat16, prefetch=1, threading=True)
    assert_same(record, reference)


@pytest.mark.parametrize("group_bytes", [1, 20000], ids=["one-param", "several"])
@pytest.mark.parametrize("spec", [SPEC, DEVICE], ids=["host", "device"])
def test_gradients_sent_home_in_groups_equal_unstreamed_training(references, monkeypatch, group_bytes, spec):
    """A layer's grads go home in groups of at least ``SEND_GROUP_BYTES`` (one param at a time, or several
    groups a layer with its last one sent when the layer closes): the sums, the direct reads and the norms
    (taken a group at a time) stay those of training without streaming."""
    monkeypatch.setattr(grad_return, "SEND_GROUP_BYTES", group_bytes)
    sizes = []
    submit = Transport.submit

    def counting(self, direction, pairs, *args, **kw):
        if direction is Direction.GRADS_HOME:
            sizes.append(len(pairs))
        return submit(self, direction, pairs, *args, **kw)

    monkeypatch.setattr(Transport, "submit", counting)
    if spec is SPEC:
        record, names = dgls_run("nonreentrant")
        assert_same(record, references("nonreentrant", names))
    else:
        record, reference, direct = device_run("nonreentrant", 1, prefetch=1)
        assert direct
        assert_same(record, reference)
    assert max(sizes) == 1 if group_bytes == 1 else 1 < max(sizes) < 20  # a streamed layer has 20 params


@pytest.mark.parametrize("spec", [SPEC, DEVICE], ids=["host", "device"])
def test_a_param_without_a_grad_does_not_hold_its_layers_group_until_backward_ends(monkeypatch, spec):
    """Every streamed layer gets a param no forward uses, so its batch stays open to the end of the
    backward: its grads still go home once another layer's grads arrive (at most one layer holds unsent
    grads at any time), and the numbers stay those of training without streaming."""
    monkeypatch.setattr(grad_return, "SEND_GROUP_BYTES", 2**30)
    open_groups = []
    ready = GradReturn._grad_ready

    def counting(self, layer, tp, param):
        ready(self, layer, tp, param)
        open_groups.append(sum(1 for trained in self.layers.values() if trained.grads.group))

    monkeypatch.setattr(GradReturn, "_grad_ready", counting)

    def with_unused(dtype=torch.float32):
        layers = full_layers(dtype)
        for layer in layers:
            layer.register_parameter("unused", torch.nn.Parameter(torch.ones(3, dtype=dtype)))
        return layers

    if spec is SPEC:
        layers = with_unused()
        with LayerSwapper(layers, config(), device=CPU, log=None) as swapper:
            names = host_names(swapper, layers)
            record = train_dgls(layers, swapper, CPU, "nonreentrant")
        assert_same(record, train_reference(with_unused(), names, CPU, "nonreentrant"))
    else:
        record, reference, _ = device_run("nonreentrant", 1, prefetch=1, build=with_unused)
        assert_same(record, reference)
    assert open_groups and max(open_groups) == 1


def test_device_updates_without_clipping_equal_unstreamed_training():
    record, reference, _ = device_run("nonreentrant", 1, max_norm=None, clip_grads=False)
    assert_same(record, reference)


@pytest.mark.parametrize("spec", [DEVICE, SPLIT], ids=["device", "split"])
@pytest.mark.parametrize("mutation", ["land", "wait_update"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["per-param", "flat"])
def test_device_updates_that_skip_a_wait_fail(monkeypatch, mutation, spec, dtype):
    """Reading the gradient landings before their copies landed, or fetching a layer before its update was
    written back: the numbers differ (split: on either side)."""
    if mutation == "land":
        skip_waits(monkeypatch, Direction.GRADS_HOME)
    else:
        monkeypatch.setattr(HostTraining, "wait_update", lambda self, idx: None)
    record, reference, _ = device_run("nonreentrant", 1, dtype, spec=spec)
    assert differs(record, reference)


def test_device_updates_sum_on_the_host_when_a_layer_gets_a_second_batch_in_a_step():
    """Told one micro-batch a step but given two: each layer's first batch, meant to be read from its
    landings, is summed on the host before the second one lands; the numbers stay the reference's."""
    layers = full_layers()
    cfg = SwapConfig.of(host_optimizer=DEVICE, accumulation_steps=1, prefetch=2)
    promoted = []
    with LayerSwapper(layers, cfg, device=CPU, log=None) as swapper:
        training = swapper.training
        original = training.grads._promote

        def promote(layer):
            promoted.append(layer.index)
            original(layer)

        training.grads._promote = promote
        names = host_names(swapper, layers)
        record = train_dgls(layers, swapper, CPU, "nonreentrant", accumulate=2)
    assert len(promoted) == 3 * len(training.layers)  # every layer, every step: direct again after each update
    assert_same(record, train_reference(full_layers(), names, CPU, "nonreentrant", accumulate=2, host_spec=FUSED))


# ---------------------------------------------------------------- split updates (--host_adam split)
# Each layer's step on the "device" (the CPU here, the streamed kernel) or on the host (torch's fused CPU
# AdamW): the same numbers either way, whichever side each layer takes and however often it changes side.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_split_updates_equal_unstreamed_training_with_torch_fused_adamw(monkeypatch, mode, accumulate):
    flip_sides_every_step(monkeypatch)
    seen = []
    record, reference, direct = device_run(mode, accumulate, spec=SPLIT, prefetch=2, seen=seen)
    assert direct == (accumulate == 1)
    assert seen[0].split.calls == 4  # start-up and one per step
    assert_same(record, reference)


def test_split_updates_without_clipping_run_where_they_were_queued_though_the_step_changes_sides(monkeypatch):
    """Without clipping a layer's update is queued during backward with the sides then in force, and may run
    only after the step assigned new ones (deferred here: when the next forward waits for it). It must run on
    the side it was queued for: a host job that went to the device instead ran beside the training thread's
    device updates, from the worker (the GPU test of this case gave other numbers)."""
    on_device = flip_sides_every_step(monkeypatch)
    ran: list[tuple[object, str]] = []
    original_device, original_step = DeviceSide.enqueue, torch.optim.AdamW.step

    def enqueue(self, layer, grads, coef, lr, previous, *speculated):
        ran.append((layer.index, "device"))
        return original_device(self, layer, grads, coef, lr, previous, *speculated)

    def step(self, *args, **kwargs):
        ran.append((self, "host"))  # a layer's optimizer or the trainer's own (told apart below)
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(DeviceSide, "enqueue", enqueue)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    seen = []
    record, reference, _ = device_run(
        "nonreentrant", 1, max_norm=None, spec=SPLIT, prefetch=2, clip_grads=False, seen=seen
    )
    layers = seen[0].layers
    index_of = {id(layer.optimizer): idx for idx, layer in layers.items()}
    sides: dict[int, list[bool]] = {idx: [] for idx in layers}
    for who, side in ran:
        idx = who if side == "device" else index_of.get(id(who))
        if idx is not None:
            sides[idx].append(side == "device")
    ranks = {idx: rank for rank, idx in enumerate(sorted(layers))}
    # queued in the backward of step s, before that step's own assignment: the sides of step s + 1 (flip's count)
    assert sides == {idx: [on_device(s + 1, ranks[idx]) for s in range(3)] for idx in layers}
    assert_same(record, reference)


@pytest.mark.parametrize("max_norm", [MAX_NORM, None], ids=["clip", "noclip"])
def test_split_updates_with_threads_bf16_compute_and_measured_rates_equal_unstreamed_training(max_norm):
    """The split the measured rates give (not forced), with bf16 gradients a host update converts in its
    reused buffer, the host optimizer on its worker thread; without clipping, updates start in backward."""
    seen = []
    kw = {} if max_norm else {"clip_grads": False}
    record, reference, _ = device_run(
        "nonreentrant",
        1,
        torch.bfloat16,
        max_norm=max_norm,
        spec=SPLIT,
        prefetch=1,
        threading=True,
        seen=seen,
        **kw,
    )
    assert_same(record, reference)
    split = seen[0].split
    assert split.rates["host"] is not None and split.rates["device"] is not None


def test_device_busy_time_counts_overlapping_chunks_once_and_leaves_out_waits_for_gradients():
    """Without clipping the device's rate comes from the union of its chunks' intervals: two chunks overlap
    (one comes in while the other goes home), then a gap while the device waits for the next gradients."""
    assert device_update.busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert device_update.busy_seconds([(5.0, 6.0), (0.0, 4.0), (1.0, 2.0)]) == 5.0  # any order; one inside another
    assert device_update.busy_seconds([]) == 0.0


def test_split_gives_each_layer_to_the_side_that_finishes_it_sooner():
    split = UpdateSplit({0: 100, 1: 100, 2: 100, 3: 100, 4: 100, 5: 100, 6: 100, 7: 100})
    assert split.device_share == 0.5  # nothing measured: both sides taken as equally fast
    assert [split.on_device[i] for i in range(4)] == [True, False, True, False]  # alternately, in update order
    split.record_device(300, 1.0)
    split.record_host(100, 1.0)
    split.assign()
    assert split.device_share == 0.75  # three times as fast: three layers of every four
    assert sum(split.on_device[i] for i in range(4)) == 3  # spread over the order, not the first ones only
    split.record_device(100, 1.0)  # a slower step moves the rate half way: 200 params/s
    assert split.rates["device"] == 200
    assert "device 75% of the params" in split.describe()
