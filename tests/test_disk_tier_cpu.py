"""The disk tier on the CPU: a host RAM budget smaller than the streamed layers spills some of them to a file.

- A LoRA run with layers on disk equals the all-in-RAM run bitwise (every checkpoint mode, fp8 storage, the
  copy thread, state dicts and re-placement).
- The CPU transport poisons a disk read's destination (a staging ring buffer) until the read is waited for:
  a weight copy that does not wait for its read, or a read that does not wait for the ring buffer's previous
  reader, computes with NaN (the mutations below).
- The file has no name (gone on exit and after ``kill -9``); a named fallback is unlinked at once and stale
  named files of dead processes go at the next start, nothing else; a full or read-only directory, or a budget
  too small even with everything on disk, is one clear line before anything is packed.
"""

import contextlib
import errno
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from helpers import assert_bitwise_equal, child_env, make_layers, skip_waits, train

from utils.dgls import DGLSUserError, LayerSwapper, Listener, SwapConfig
from utils.dgls.memory import disk_tier
from utils.dgls.memory.copier import DeferredCopier
from utils.dgls.memory.device_pool import DevicePool
from utils.dgls.memory.disk_io import AioReader, ThreadReader, aio_handle
from utils.dgls.memory.disk_tier import DiskFile, DiskTier
from utils.dgls.memory.host_store import HostStore
from utils.dgls.memory.layout import measure
from utils.dgls.memory.pinned import page_aligned_empty, whole_pages
from utils.dgls.memory.transport import Copy, CudaTransport, Direction, Transport
from utils.dgls.planning.disk_check import DiskPlanCheck
from utils.dgls.planning.disk_plan import DiskCosts, forecast
from utils.dgls.planning.planner import UseTiming
from utils.dgls.program import options
from utils.dgls.streaming.schedule import Phase
from utils.dgls.streaming.tiers import plan_tiers, spread

CPU = torch.device("cpu")
MODES = ["none", "nonreentrant", "reentrant"]
# SMALL's streamed layers: 3 double blocks (152 KiB each in whole pages) and 3 single blocks (64 KiB); with
# the ring is 2 buffers of the largest spilled layer: this budget keeps a double and a single block in RAM
BUDGET = 0.0006
FP8 = [("f32", "f8_e4m3")]


def disk_config(tmp_path, **kw):
    return SwapConfig.of(**{"host_ram_budget": BUDGET, "disk_dir": str(tmp_path), "prefetch": 1, **kw})


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(mode, **kw):
        key = (mode, repr(sorted(kw.items())))
        if key not in cache:
            layers, trainable = make_layers()
            with LayerSwapper(layers, SwapConfig.of(prefetch=1, **kw), device=CPU, log=None):
                cache[key] = train(layers, trainable, CPU, mode)
        return cache[key]

    return get


def disk_run(tmp_path, mode, on_disk=(4, 5, 6), **kw):
    """A run with ``on_disk`` spilled (the disk plan's choice), the other streamed layers in RAM."""
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path, **kw), device=CPU, log=None) as swapper:
        assert swapper.store.disk_layers == list(on_disk) if on_disk is not None else swapper.store.disk_layers
        assert set(swapper.streamed_layers) - set(swapper.store.disk_layers)  # some stream from RAM: three tiers
        return train(layers, trainable, CPU, mode)


@pytest.mark.parametrize("mode", MODES)
def test_lora_with_layers_on_disk_equals_all_in_ram(tmp_path, references, mode):
    assert_bitwise_equal(references(mode), disk_run(tmp_path, mode))


def test_disk_layers_with_the_copy_thread_equal_all_in_ram(tmp_path, references):
    assert_bitwise_equal(references("nonreentrant", threading=True), disk_run(tmp_path, "nonreentrant", threading=True))


def test_fp8_stored_layers_on_disk_equal_fp8_all_in_ram(tmp_path, references):
    """fp8 storage reads a quarter of the bytes from disk; the upcast reads the staging buffer, not the file."""
    got = disk_run(tmp_path, "nonreentrant", None, cast_target=FP8, host_ram_budget=0.00015)
    assert_bitwise_equal(references("nonreentrant", cast_target=FP8), got)


def test_the_start_up_table_shows_the_three_tiers(tmp_path):
    lines = []
    layers, _ = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=lines.append):
        pass
    table = lines[0].splitlines()
    assert table[1].endswith("resident") and "streamed from RAM" in table[2] and "streamed from disk" in table[5]
    assert any(line.startswith("DGLS host RAM budget ") and "3 streamed layers" in line for line in lines)
    (tier,) = [line for line in lines if line.startswith("DGLS disk tier: 3 streamed layers")]
    assert "os.preadv" in tier and "2 staging buffers" in tier  # which reader runs is said
    assert re.search(r"measured [0-9.]+ GB/s here, so one read of them all takes at least [0-9.]+ s", tier)
    (plan,) = [line for line in lines if line.startswith("DGLS disk plan: 3 of 6 streamed layers read from disk")]
    assert re.search(r"disk floor [0-9.]+ ms against [0-9.]+ ms of compute a step \(estimated from param counts", plan)
    assert lines.index(plan) == lines.index(tier) - 1  # after the host RAM budget's line, before the tier's


def test_without_a_vram_budget_the_disk_plan_is_said_again_with_pass_2s_compute_measured(tmp_path, references):
    """The start-up line estimates the compute from param counts; the second pass measures it, and the line comes
    once more with it (planning/disk_check.py), once in the run, with the numbers unchanged."""
    lines = []
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=lines.append) as swapper:
        # one micro-batch a step: an eval forward runs between pass 1 and pass 2, and is no part of the recording
        got = train(layers, trainable, CPU, "nonreentrant", steps=3, accumulate=1)
        check = swapper.feature(DiskPlanCheck)
    (measured,) = [line for line in lines if line.startswith("DGLS disk plan, measured: 3 of 6 streamed layers")]
    assert re.search(r"disk floor [0-9.]+ ms against [0-9.]+ ms of compute a step \(measured on pass 2\)", measured)
    phases = [use.phase for use in check.uses]
    assert Phase.NO_GRAD not in phases and phases.count(Phase.FORWARD) == len(layers)  # one training pass
    layers, trainable = make_layers()
    with LayerSwapper(layers, SwapConfig.of(prefetch=1), device=CPU, log=None):
        assert_bitwise_equal(train(layers, trainable, CPU, "nonreentrant", steps=3, accumulate=1), got)


def test_the_measured_line_replays_the_builds_choice_over_the_measured_uses():
    """A step that computes for seconds hides reads the estimate (as long as the copies) said would add time."""
    uses = tuple(UseTiming(i, Phase.FORWARD, 0.01) for i in range(4)) + tuple(
        UseTiming(i, Phase.BACKWARD, 0.02) for i in reversed(range(4))
    )
    costs = DiskCosts(
        uses=uses,
        copy_bytes=dict.fromkeys(range(4), 1000),
        read_bytes=dict.fromkeys(range(4), 100_000),
        copy_bytes_per_ms=1000.0,
        read_bytes_per_ms=1000.0,
        prefetch=1,
    )
    check = DiskPlanCheck(costs, [0, 1, 2, 3], [1, 3], CPU, lambda line: None)
    assert "the reads add" in forecast(costs, [0, 1, 2, 3], [1, 3]).line()
    long = [UseTiming(u.layer, u.phase, 500.0) for u in uses]
    line = check.line(long, on_pass=2)
    assert line.startswith("DGLS disk plan, measured: 2 of 4 streamed layers") and "the reads hide" in line
    assert "(measured on pass 2)" in line


@pytest.mark.parametrize("fp8", [False, True])
def test_a_read_that_is_not_waited_for_differs(tmp_path, references, monkeypatch, fp8):
    """The mutation: the CPU transport never lands disk reads, so the staging buffers keep their NaN bytes (with
    fp8 storage the upcast reads them too: every weight of a spilled layer comes through the ring)."""
    skip_waits(monkeypatch, Direction.DISK_IN)
    kw = {"cast_target": FP8, "host_ram_budget": 0.00015} if fp8 else {}
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path, **kw), device=CPU, log=None):
        got = train(layers, trainable, CPU, "nonreentrant", steps=1, accumulate=1, eval_between=False)
    assert all(torch.isnan(loss).all() for loss in got.losses)


def test_reads_are_reported_once_each_with_their_bytes(tmp_path):
    reads, fetched = [], []

    class Reads(Listener):
        def copied(self, copy):
            if copy.direction is Direction.DISK_IN:
                reads.append(copy.nbytes)

        def fetched(self, token):
            fetched.append(token.layer)

    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None) as swapper:
        swapper.add_listener(Reads())
        train(layers, trainable, CPU, "nonreentrant", steps=1, accumulate=1, eval_between=False)
        pages = {i: swapper.store.disk.file.extents[i][1] for i in swapper.store.disk_layers}
        stats = swapper.total_stats()
    assert sorted(reads) == sorted(pages[i] for i in fetched if i in pages)
    assert stats.disk_bytes == sum(reads) and "read from disk" in stats.short()  # the step line says it


def test_state_dicts_read_and_write_layers_on_disk(tmp_path, references):
    """A disk layer's state dict holds its true weights; loaded values are what the next copy reads from disk."""
    layers, trainable = make_layers()
    before = {k: v.clone() for k, v in layers[4].state_dict().items()}
    changed = {k: v + 1 if not k.startswith("lora") else v for k, v in before.items()}
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None) as swapper:
        assert 4 in swapper.store.disk_layers
        got = layers[4].state_dict()
        assert all(torch.equal(got[k], v) for k, v in before.items())
        layers[4].load_state_dict(changed)
        record = train(layers, trainable, CPU, "none", steps=1)
    gc.collect()
    frozen = [k for k in before if "lora_" not in k]
    assert frozen and all(torch.equal(got[k], changed[k]) for k in frozen)  # its views of the file outlive the swapper
    reference_layers, reference_trainable = make_layers()
    reference_layers[4].load_state_dict(changed)
    assert_bitwise_equal(train(reference_layers, reference_trainable, CPU, "none", steps=1), record)


def test_swap_units_on_disk_equal_swap_units_in_ram(tmp_path, references):
    """Swap units are entries of their own: a layer's units spill one by one."""
    layers, trainable = make_layers()
    config = disk_config(tmp_path, swap_unit_mb=0.07, host_ram_budget=0.0004)
    with LayerSwapper(layers, config, device=CPU, log=None) as swapper:
        assert len(swapper.entries) > len(layers) and swapper.store.disk_layers
        assert set(swapper.streamed_layers) - set(swapper.store.disk_layers)
        got = train(layers, trainable, CPU, "nonreentrant")
    assert_bitwise_equal(references("nonreentrant", swap_unit_mb=0.07), got)


def test_a_disk_layer_made_resident_streams_from_its_own_extent_again(tmp_path, references):
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None) as swapper:
        used = swapper.store.disk.file.used

        def shuffle(step):
            swapper.apply_placement([1, 2, 3, 5] if step % 2 else [1, 2, 3, 4, 5, 6], 1)

        got = train(layers, trainable, CPU, "nonreentrant", on_step=shuffle)
        assert swapper.store.disk.file.used == used
    assert_bitwise_equal(references("nonreentrant"), got)


# ---------------------------------------------------------------- the ring on its own
@contextlib.contextmanager
def ring_copier(tmp_path, gated: bool):
    """Two disk layers, one ring buffer: the second read reuses the buffer the first copy reads. Yields the copier,
    the two host layers, the pool, the store and the transport; closes the transport and releases the store."""
    layers, _ = make_layers()
    layouts = measure(layers)
    store = HostStore(CPU, None, 0)
    store.attach_disk(DiskTier.open(tmp_path, {1: layouts[1].host_bytes, 2: layouts[2].host_bytes}, 1, pin=False))
    transport = Transport(CPU)
    transport.read_from(store.disk.reader)
    hosts = [store.add_layer(layouts[1]), store.add_layer(layouts[2])]
    if not gated:
        store.disk.ring.readers = _Forgetful()
    pool = DevicePool(CPU, 2, layouts[1].slot_bytes)
    try:
        yield DeferredCopier(store, use_thread=False, transport=transport), hosts, pool, store, transport
    finally:
        transport.close()
        store.release()


def slots_hold(pool, *hosts) -> list[bool]:
    """Per host layer: whether slot k holds host k's first param."""
    return [
        torch.equal(slot.buffer[: host.layout.params[0].nbytes].view(torch.float32), host.master_view(0).flatten())
        for slot, host in zip(pool.slots, hosts)
    ]


class _Forgetful(list):
    """The mutation: the ring forgets who reads its buffers, so a read does not wait for the copy before it."""

    def __getitem__(self, k):
        return None

    def __setitem__(self, k, value):
        pass


@pytest.mark.parametrize("gated", [True, False])
def test_a_ring_buffer_is_read_into_only_after_its_previous_copy(tmp_path, gated):
    with ring_copier(tmp_path, gated) as (copier, (first, second), pool, store, transport):
        (token_a,) = copier.submit([(pool.slots[0], first, False)])
        (token_b,) = copier.submit([(pool.slots[1], second, False)])
        copier.acquire(token_a)
        copier.acquire(token_b)
        assert slots_hold(pool, first)[0] == gated


def test_a_ring_buffer_reused_within_one_submit_is_read_into_after_its_copy(tmp_path):
    """Two disk layers in one submit with one ring buffer (prefetch deeper than the ring): the second read's gate is
    the first copy, not yet issued when the read is submitted. The read must still wait for it (on the CPU: the
    gate lands when the read is performed, not when it is submitted, where it was a no-op)."""
    with ring_copier(tmp_path, True) as (copier, (first, second), pool, store, transport):
        token_a, token_b = copier.submit([(pool.slots[0], first, False), (pool.slots[1], second, False)])
        copier.acquire(token_a)
        copier.acquire(token_b)
        assert slots_hold(pool, first, second) == [True, True]


def test_the_issued_event_a_disk_read_waits_on_is_set_when_its_copy_is_issued(tmp_path):
    """Without a copy worker, tokens share the copier's PENDING and ISSUED events; but the ring keeps a disk layer's
    token as the gate of the next read into its buffer, and the CUDA backend's reader thread waits on the token's
    ``issued`` event it read, maybe before the token was issued: that event must be the token's own and get set
    (a shared PENDING is never set: the reader, and the copy waiting for its read, would hang)."""
    with ring_copier(tmp_path, True) as (copier, (first, second), pool, store, transport):
        seen = []
        consumed = store.disk.consumed

        def consumed_seen(k, copy):
            seen.append(copy.issued)  # what a reader thread running now would wait on
            consumed(k, copy)

        store.disk.consumed = consumed_seen
        tokens = copier.submit([(pool.slots[0], first, False), (pool.slots[1], second, False)])
        assert len(seen) == 2 and all(event.is_set() for event in seen)
        for token in tokens:
            copier.acquire(token)


def test_the_disk_reads_ahead_of_each_fetch_in_the_order_the_step_uses_its_layers(tmp_path, references):
    """Once the predictor knows the order, the engine reads each spilled layer ahead, into a free ring buffer,
    before its fetch: every fetch of a spilled layer takes its read ahead, and none is dropped. Where the order
    changes (an eval pass between steps) a read ahead may be dropped and read again. The run equals all-in-RAM."""
    fetched = []

    class Fetches(Listener):
        def fetched(self, token):
            fetched.append(token.host.on_disk)

    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None) as swapper:
        got = train(layers, trainable, CPU, "nonreentrant")
        disk = swapper.store.disk
        assert disk.taken > 0
        swapper.add_listener(Fetches())

        def counted_from_the_second(step):
            if step == 1:  # after the first step, which follows an eval pass (the order changed)
                disk.taken = disk.dropped = 0
                fetched.clear()

        train(
            layers,
            trainable,
            CPU,
            "nonreentrant",
            steps=3,
            accumulate=1,
            eval_between=False,
            on_step=counted_from_the_second,
        )
        # 4 a step: each spilled layer's forward, and the backward of the one the turnaround evicted
        assert disk.taken == sum(fetched) == 2 * 4 and disk.dropped == 0
    assert_bitwise_equal(references("nonreentrant"), got)


def test_without_the_read_ahead_every_read_waits_for_its_fetch(tmp_path, references, monkeypatch):
    """The control: with the read-ahead off, no fetch finds a read ahead (and the numbers are the same)."""
    monkeypatch.setattr(LayerSwapper, "read_ahead", lambda self: None)
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None) as swapper:
        got = train(layers, trainable, CPU, "nonreentrant")
        assert swapper.store.disk.taken == 0
    assert_bitwise_equal(references("nonreentrant"), got)


@pytest.mark.parametrize("gated", [True, False])
def test_a_read_ahead_lands_in_its_buffer_only_after_the_copy_before_it(tmp_path, gated):
    """One ring buffer: layer 1's copy from it is submitted (not performed: the CPU copier performs it when the slot
    is acquired), then layer 2 is read ahead into the same buffer. The read must wait for that copy, or layer 1's
    slot gets layer 2's bytes (the mutation: the ring forgets who reads its buffers)."""
    with ring_copier(tmp_path, gated) as (copier, (first, second), pool, store, transport):
        (token_a,) = copier.submit([(pool.slots[0], first, False)])
        assert store.disk.stage(transport, second.index, second.nbytes)
        (token_b,) = copier.submit([(pool.slots[1], second, False)])  # takes the read ahead
        assert store.disk.taken == 1
        copier.acquire(token_b)
        copier.acquire(token_a)
        assert slots_hold(pool, first, second) == [gated, True]


def test_a_full_ring_reads_nothing_more_ahead_and_a_fetch_of_another_layer_drops_a_read_ahead(tmp_path):
    """A read ahead goes only into a buffer whose read was taken: with one buffer holding layer 2's read ahead, no
    other read ahead is issued (it would wait for a fetch that may never come). A fetch of layer 1 instead takes the
    buffer (dropping layer 2's read), and layer 2's own fetch later reads it again: both slots get their bytes."""
    with ring_copier(tmp_path, True) as (copier, (first, second), pool, store, transport):
        disk = store.disk
        assert disk.stage(transport, second.index, second.nbytes)
        assert disk.stage(transport, second.index, second.nbytes)  # already read ahead
        assert not disk.stage(transport, first.index, first.nbytes)  # the ring is full
        (token_a,) = copier.submit([(pool.slots[0], first, False)])
        assert disk.dropped == 1 and disk.taken == 0 and disk.staged == {}
        (token_b,) = copier.submit([(pool.slots[1], second, False)])
        copier.acquire(token_a)
        copier.acquire(token_b)
        assert slots_hold(pool, first, second) == [True, True]


# ---------------------------------------------------------------- files
def fds_into(directory: Path, pid: str = "self") -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_the_file_has_no_name_and_is_closed_after_the_run(tmp_path):
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None):
        train(layers, trainable, CPU, "none", steps=1, accumulate=1, eval_between=False)
        assert list(tmp_path.iterdir()) == []
        assert fds_into(tmp_path) and all("(deleted)" in t or "/#" in t for t in fds_into(tmp_path))
    assert list(tmp_path.iterdir()) == []
    # the layers came home as views of the file's mapping (the model may not fit RAM): the file goes with them
    on_disk = [p for i in (4, 5, 6) for p in layers[i].parameters() if not p.requires_grad]
    assert on_disk and fds_into(tmp_path)
    del layers, trainable, on_disk
    gc.collect()
    assert fds_into(tmp_path) == []


def test_a_named_file_is_unlinked_at_once_and_stale_ones_of_dead_processes_go(tmp_path, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"dgls-disk-{int(dead.stdout)}-abc"
    live = tmp_path / f"dgls-disk-{os.getpid()}-def"
    other = tmp_path / "model.safetensors"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    monkeypatch.setattr(DiskFile, "use_tmpfile", False)
    layers, trainable = make_layers()
    lines = []
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=lines.append) as swapper:
        assert swapper.store.disk.file.named
        assert sorted(tmp_path.iterdir()) == sorted([live, other])  # the new file is unlinked already
        train(layers, trainable, CPU, "none", steps=1, accumulate=1, eval_between=False)
    assert f"DGLS disk tier: removed 1 files of earlier runs from {tmp_path}" in lines
    assert sorted(tmp_path.iterdir()) == sorted([live, other])


CHILD = """
import sys, time, torch
sys.path[:0] = [{root!r}, {tests!r}]
from helpers import make_layers
from utils.dgls import LayerSwapper, SwapConfig
layers, _ = make_layers()
config = SwapConfig.of(host_ram_budget={budget}, disk_dir={dir!r}, prefetch=1)
swapper = LayerSwapper(layers, config, device="cpu", log=None)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # starts a process: about 8 s each on 2 cores
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["kill -9", "Ctrl-C"])
def test_a_killed_or_interrupted_run_leaves_no_file(tmp_path, stop):
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), budget=BUDGET, dir=str(tmp_path))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env()
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert fds_into(tmp_path, str(child.pid))  # it holds the disk tier's file
        free = disk_tier.free_bytes(tmp_path)
        child.send_signal(stop)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert list(tmp_path.iterdir()) == []
    assert disk_tier.free_bytes(tmp_path) >= free  # its blocks were given back


# ---------------------------------------------------------------- one clear line before anything is packed
def refused(config, match):
    layers, _ = make_layers()
    params = [p for layer in layers for p in layer.parameters()]
    before = [p.detach().clone() for p in params]
    with pytest.raises(DGLSUserError, match=match):
        LayerSwapper(layers, config, device=CPU, log=None)
    assert all(torch.equal(a, p) for a, p in zip(before, params))  # the model is untouched


def test_a_full_disk_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "free_bytes", lambda directory: 1024 * 1024)
    refused(disk_config(tmp_path), rf"disk_dir {tmp_path} has 1.0 MiB free; the layers that do not fit the host RAM")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_directory_is_one_line(tmp_path):
    if os.geteuid() == 0:  # root writes through file modes: /proc/self is read-only for everyone
        directory = Path("/proc/self")
    else:
        directory = tmp_path / "ro"
        directory.mkdir(mode=0o555)
    refused(disk_config(directory), rf"disk_dir {directory} is not writable: name another directory with --disk_dir")


def test_a_file_where_the_directory_should_be_is_one_line(tmp_path):
    (tmp_path / "f").write_text("")
    refused(disk_config(tmp_path / "f"), "is not a directory")


def test_a_budget_below_the_staging_ring_is_one_line(tmp_path):
    refused(disk_config(tmp_path, host_ram_budget=0.0001), r"host_ram_budget 0.1 MiB is too small: .* at least 0.01")
    assert list(tmp_path.iterdir()) == []


def test_a_budget_that_holds_everything_reads_nothing_from_disk(tmp_path):
    lines = []
    layers, _ = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path, host_ram_budget="auto"), device=CPU, log=lines.append) as s:
        assert s.store.disk is None
    assert any("nothing is read from disk" in line for line in lines)


def test_the_flags_and_toml_keys_reach_the_config(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    options.add_arguments(parser)
    cli = parser.parse_args(["--host_ram_budget", "8", "--disk_dir", str(tmp_path)])
    resolved = options.resolve({"host_ram_budget": "auto"}, cli)
    config = options.swap_config(resolved.values)
    assert config.transfer.host_ram_budget == 8.0 and config.transfer.disk_dir == str(tmp_path)
    resolved = options.resolve({"host_ram_budget": "auto"}, parser.parse_args([]))
    assert options.swap_config(resolved.values).transfer.host_ram_budget == "auto"


def mapped_rss_kib(directory: Path) -> int:
    """Resident KiB of this process's mappings of files in ``directory`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(str(directory))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_packed_layers_leave_no_page_in_ram(tmp_path):
    """Packing writes a spilled layer through the file's mapping; once packed, none of its pages stays resident
    (they would count as RSS and hold the RAM the budget saves)."""
    layers, trainable = make_layers()
    with LayerSwapper(layers, disk_config(tmp_path), device=CPU, log=None) as swapper:
        assert swapper.store.disk_layers and mapped_rss_kib(tmp_path) == 0
        train(layers, trainable, CPU, "none", steps=1, accumulate=1, eval_between=False)
        assert mapped_rss_kib(tmp_path) == 0  # copies read the ring, never the mapping


def test_the_start_up_checks_refuse_an_unwritable_disk_dir_before_the_model_loads(tmp_path, user_env):
    """dgls_train.py checks the directory with the other inputs (a drop-in run loads its model after them)."""
    from utils.dgls.program.validate import prepare

    toml = str(ROOT / "toml" / "demo.toml")
    with pytest.raises(DGLSUserError, match="disk_dir /proc/self is not writable"):
        prepare(["--config", toml, "--host_ram_budget", "1", "--disk_dir", "/proc/self"], ROOT)
    (tmp_path / "f").write_text("")
    with pytest.raises(DGLSUserError, match=f"disk_dir {tmp_path / 'f' / 'x'}: {tmp_path / 'f'} is not a directory"):
        prepare(["--config", toml, "--host_ram_budget", "1", "--disk_dir", str(tmp_path / "f" / "x")], ROOT)
    run = prepare(["--config", toml, "--host_ram_budget", "auto", "--disk_dir", str(tmp_path / "new")], ROOT)
    assert run.swap.transfer.host_ram_budget == "auto" and not (tmp_path / "new").exists()  # nothing written yet


def test_the_spilled_layers_are_spread_over_the_order_and_the_least_read_go_first():
    layers, _ = make_layers()
    layouts = measure(layers)
    hosted = streamed = [1, 2, 3, 4, 5, 6]
    need = sum(whole_pages(layouts[i].host_bytes) for i in hosted)
    assert list(plan_tiers(layouts, hosted, streamed, need, 1).spilled) == []  # everything fits
    # a byte less: one layer on disk frees no more than its staging buffer takes (1 buffer here), two do
    assert list(plan_tiers(layouts, hosted, streamed, need - 1, 1).spilled) == [2, 5]  # spread: not 1, 2
    reads = {i: 1 if i in (1, 3) else 2 for i in streamed}  # 1 and 3 read less often than the others
    assert list(plan_tiers(layouts, hosted, streamed, need - 1, 1, reads).spilled) == [1, 3]
    assert spread([10, 11, 12, 13, 14, 15, 16, 17], 2) == [12, 16] and spread([1, 2, 3], 3) == [1, 2, 3]


def written_file(tmp_path, nbytes):
    file = DiskFile(tmp_path, nbytes)
    data = torch.randint(0, 256, (file.nbytes,), dtype=torch.uint8)
    os.pwrite(file.fd, data.numpy().tobytes(), 0)
    return file, data


@pytest.mark.parametrize("reader", ["direct, 1 thread", "direct, 8 threads", "buffered", "DeepSpeed aio"])
def test_each_reader_reads_the_bytes_at_their_offset(tmp_path, reader):
    file, data = written_file(tmp_path, 40 * 1024 * 1024)  # reads of more than one chunk (16 MiB)
    if reader == "DeepSpeed aio":
        handle, why = aio_handle(2)
        if handle is None:
            pytest.skip(why)
        got = AioReader(file.fd, handle, 2)
    else:
        got = ThreadReader(file.fd, 8 if "8" in reader else 1, direct=reader != "buffered")
        assert got.direct == (reader != "buffered") and ("O_DIRECT" in got.name) == got.direct
    try:
        dst = page_aligned_empty(36 * 1024 * 1024)
        got.read(dst, 4096 * 3)
        assert torch.equal(dst, data[4096 * 3 : 4096 * 3 + dst.numel()])
    finally:
        got.close()
        got.close()  # closing twice is harmless (the transport and the tier both close it)
        file.close()


def test_a_cuda_read_starts_only_once_the_copy_it_waits_for_was_issued(tmp_path):
    """The CUDA backend's read runs on the reader's thread: it waits for its gate, a weight copy the copy worker may
    issue later (an event not yet recorded would not be waited for), then reads; ``land`` waits for the read.
    Checked without a GPU: the backend's read uses no stream."""
    file, data = written_file(tmp_path, 1024 * 1024)
    transport = object.__new__(CudaTransport)  # no streams: only read() and land() are used
    transport.delay, transport.listeners = {Direction.DISK_IN: 1_000_000}, []
    transport.read_from(ThreadReader(file.fd, 2))
    gate = Copy(direction=Direction.WEIGHTS_IN, issued=threading.Event())
    dst = page_aligned_empty(file.nbytes).zero_()  # direct I/O reads into page-aligned memory
    try:
        read = transport.read(dst, 0, [gate])
        time.sleep(0.2)
        assert not read.io.done() and not dst.any()  # still waiting for the copy that reads dst
        gate.issued.set()
        transport.land(read)
        assert read.io.done() and torch.equal(dst, data) and read.span is not None
    finally:
        gate.issued.set()
        transport.reader.close()
        file.close()


def test_a_disk_dir_without_a_host_ram_budget_is_refused_not_ignored(tmp_path, user_env):
    """--disk_dir names where --host_ram_budget's spilled layers go: alone it would do nothing, silently."""
    from utils.dgls.program.validate import prepare

    toml = str(ROOT / "toml" / "demo.toml")
    with pytest.raises(DGLSUserError, match="--disk_dir .* --host_ram_budget"):
        prepare(["--config", toml, "--disk_dir", str(tmp_path)], ROOT)
    prepare(["--config", toml, "--disk_dir", str(tmp_path), "--host_ram_budget", "auto"], ROOT)


# ---------------------------------------------------------------- with layer-major accumulation
def _disk_reads(tmp_path, accumulate: int, layer_major: bool, steps: int = 2):
    """A LoRA run of ``accumulate`` micro-batches a step with layers on disk; its record and the bytes read."""
    from layer_major_runs import train_lora

    read = []

    class Reads(Listener):
        def copied(self, copy):
            if copy.direction is Direction.DISK_IN:
                read.append(copy.nbytes)

    def hook(swapper):
        assert swapper.store.disk_layers
        swapper.add_listener(Reads())

    got = train_lora(
        "nonreentrant", accumulate, layer_major, swap=disk_config(tmp_path), steps=steps, swapper_hook=hook
    )
    return got, sum(read)


def test_layer_major_with_layers_on_disk_equals_sequential_all_in_ram_and_reads_what_one_micro_batch_reads(tmp_path):
    """Each micro-batch beyond the first reads nothing more from disk (the issue's goal); the numbers are sequential
    micro-batches' with every layer in RAM."""
    from layer_major_runs import train_lora

    reference = train_lora("nonreentrant", 4, False, swap=SwapConfig.of(prefetch=1))
    got, read = _disk_reads(tmp_path, 4, True)
    assert_bitwise_equal(reference, got)
    _, one = _disk_reads(tmp_path, 1, True)
    _, sequential = _disk_reads(tmp_path, 4, False)
    assert 0 < read == one and sequential > 2 * one  # (the slots keep a few layers across micro-batches)


def test_mutation_a_disk_read_not_waited_for_differs_under_layer_major(tmp_path, monkeypatch):
    skip_waits(monkeypatch, Direction.DISK_IN)
    got, _ = _disk_reads(tmp_path, 2, True, steps=1)
    assert all(torch.isnan(loss).all() for loss in got.losses)


def test_a_file_system_that_refuses_direct_io_is_read_by_threads_not_the_async_io_op(tmp_path, monkeypatch):
    """DeepSpeed's async I/O op opens the file O_DIRECT itself: where the file system refuses that (tmpfs before
    Linux 6.6, a common /tmp), every read would fail mid-start-up; the threads read buffered, and the line says why."""
    from utils.dgls.memory import disk_io

    monkeypatch.setattr(disk_io, "aio_handle", lambda threads: (object(), ""))  # the op builds and loads
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    file = DiskFile(tmp_path, 4096)
    try:
        reader = disk_io.open_reader(file.fd, 2, use_aio=True)
        try:
            assert isinstance(reader, ThreadReader) and not reader.direct
            assert "buffered reads" in reader.name and "refuses direct I/O" in reader.name
        finally:
            reader.close()
    finally:
        file.close()


def test_the_start_up_probe_times_reads_of_the_spilled_layers_size_after_an_untimed_one(tmp_path, monkeypatch):
    """The disk plan's bandwidth comes from reads as training makes them (a spilled layer's size each), not from one
    read whose threads start inside it; the first read is not timed."""
    reads: list[int] = []
    opened = disk_tier.open_reader

    def recording(*args, **kwargs):
        reader = opened(*args, **kwargs)
        read = reader.read
        reader.read = lambda dst, offset: (reads.append(dst.numel()), read(dst, offset))[1]
        return reader

    monkeypatch.setattr(disk_tier, "open_reader", recording)
    mib = 2**20
    gbps, name = disk_tier.probe_read_gbps(tmp_path, 8 * mib, pin=False, request=3 * mib)
    assert gbps > 0 and "threads" in name
    assert reads == [3 * mib, 3 * mib, 3 * mib], reads  # untimed (at most PROBE_WARM), then whole requests
    reads.clear()
    disk_tier.probe_read_gbps(tmp_path, 64 * mib, pin=False, request=48 * mib)
    assert reads == [min(disk_tier.PROBE_WARM, 48 * mib), 48 * mib], reads
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
