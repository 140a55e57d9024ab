"""File-backed casts (utils/dgls/trainers/file_backed_casts.py): while installed, the dtype casts a loader makes
(accelerate's and diffusers' ``value.to(dtype)``, ``p.data = p.data.to(dtype)``, ``Module.to(dtype)``, ``.type``,
``.bfloat16()``, ...) go to unlinked scratch files: the same bytes as the cast, anonymous memory not growing with the
cast model, nothing left in the directory, every other call untouched, the mode off the stack on removal (and after
errors), no room one clear line."""

import gc
import io
import json
import os
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from accelerate.utils import modeling
from helpers import child_env, make_layers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from utils.dgls import torch_private
from utils.dgls.errors import DGLSUserError
from utils.dgls.memory.file_backed import weight_sources
from utils.dgls.trainers import file_backed_casts
from utils.dgls.trainers.file_backed_casts import MIN_BYTES, FileBackedCasts, cast_target

MiB = 2**20
# 3 float32 layers of 80 MiB: each bf16 cast (40 MiB) is above glibc's largest mmap threshold, so a cast in anonymous
# memory gets fresh pages however much freed heap earlier tests left (the control measures it)
N, ROWS, COUNT = 4096, 5120, 3


@pytest.fixture(autouse=True)
def on_a_disk(monkeypatch):
    """The tests' folders count as a disk wherever the machine's temp is tmpfs (casts there are not installed)."""
    monkeypatch.setattr(file_backed_casts, "file_system", lambda directory: "ext4")


def stack_depth() -> int:
    return torch_private.function_mode_depth()


def checkpoint(tmp_path, rows=ROWS, n=N, count=COUNT):
    path = tmp_path / "fp32.safetensors"
    torch.manual_seed(0)
    save_file({f"{i}.weight": torch.randn(rows, n) for i in range(count)} | {"0.bias": torch.randn(rows)}, str(path))
    return path


def model(n=N, rows=ROWS, count=COUNT):
    return torch.nn.Sequential(*(torch.nn.Linear(n, rows, bias=i == 0) for i in range(count)))


def load(path, dtype, setter):
    """diffusion-pipe's Wan/Qwen-Image load: a meta model, each file tensor set with the dtype it is cast to."""
    with init_empty_weights():
        loaded = model()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():
            setter(loaded, key, device="cpu", dtype=dtype, value=f.get_tensor(key))
    return loaded


def load_views(path, n=N, rows=ROWS, count=COUNT):
    """A model whose weights are views of the checkpoint file (safetensors' mmap, assigned: no copy)."""
    with torch.device("meta"):
        loaded = model(n, rows, count)
    loaded.load_state_dict(load_file(str(path)), assign=True)
    return loaded


def cast_in_place(module, dtype):
    """diffusion-pipe's Flux, Chroma and LTX ``transformer_dtype`` casts."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_accelerates_casts_go_to_a_scratch_file_with_the_same_bytes(tmp_path):
    path, scratch = checkpoint(tmp_path), tmp_path / "scratch"
    plain = load(path, torch.bfloat16, modeling.set_module_tensor_to_device)
    casts = FileBackedCasts(scratch)
    casts.install()
    try:
        cast = load(path, torch.bfloat16, modeling.set_module_tensor_to_device)
        sources = weight_sources([cast])
    finally:
        casts.remove()
    for (name, a), (_, b) in zip(plain.named_parameters(), cast.named_parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and same_bits(a, b), name
    cast_bytes = (COUNT * ROWS * N + ROWS) * 2
    assert sources.scratch_bytes == cast_bytes and not sources.copied_bytes and casts.scratch.bytes == cast_bytes
    assert "cast into a scratch file" in sources.line()
    assert os.listdir(scratch) == [], "scratch files are unlinked once mapped"


CASTS = {
    "to(dtype)": lambda x, d: x.to(d),
    "to(dtype=)": lambda x, d: x.to(dtype=d),
    "to(device, dtype)": lambda x, d: x.to("cpu", d),
    "to(other)": lambda x, d: x.to(torch.empty(0, dtype=d)),
    "to(copy=True)": lambda x, d: x.to(d, copy=True),
    "to(non_blocking)": lambda x, d: x.to(d, non_blocking=True),
    "type(dtype)": lambda x, d: x.type(d),
    "type(str)": lambda x, d: x.type({torch.bfloat16: "torch.BFloat16Tensor"}.get(d, "torch.HalfTensor")),
    "type_as": lambda x, d: x.type_as(torch.empty(0, dtype=d)),
    "TensorBase.to": lambda x, d: torch._C.TensorBase.to(x, d),
}
FIXED = {"bfloat16()": torch.Tensor.bfloat16, "half()": torch.Tensor.half, "double()": torch.Tensor.double}


@pytest.mark.parametrize("how", list(CASTS) + list(FIXED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_cast_form_gives_the_casts_bits_in_a_scratch_file(tmp_path, how, dtype):
    torch.manual_seed(0)
    source = torch.randn(64, 33) * 300  # beyond fp8's range too: saturation and rounding must match
    source[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    make = CASTS.get(how) or (lambda x, d: FIXED[how](x))
    expected = make(source, dtype)
    casts = FileBackedCasts(tmp_path)
    casts.install()
    try:
        cast = make(source, dtype)
        with torch.no_grad():  # Module._apply casts the Parameter itself, under no_grad
            param_cast = make(torch.nn.Parameter(source.clone()), dtype)
    finally:
        casts.remove()
    assert casts.scratch.bytes == 2 * expected.numel() * expected.element_size()
    for got in (cast, param_cast):
        assert same_bits(got, expected) and got.is_contiguous() and type(got) is torch.Tensor
        assert not got.requires_grad and got.untyped_storage().nbytes() == expected.numel() * expected.element_size()
    assert weight_sources([torch.nn.Linear(1, 1)]).scratch_bytes == 0  # a plain module is not scratch
    holder = torch.nn.Module()
    holder.p = torch.nn.Parameter(cast, requires_grad=False)
    assert weight_sources([holder]).scratch_bytes == cast.numel() * cast.element_size()


def test_a_cast_method_wrapped_by_something_else_is_still_caught(tmp_path, monkeypatch):
    """A library (or the tests' CPU shim) that puts a wrapper in ``torch.Tensor.to``'s place: the mode is handed the
    wrapper, which still casts through torch's own method."""
    own = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: own(self, *args, **kwargs))
    source = torch.randn(64, 64)
    casts = FileBackedCasts(tmp_path)
    casts.install()
    try:
        cast = source.to(torch.bfloat16)
    finally:
        casts.remove()
    assert casts.scratch.bytes == cast.numel() * 2 and same_bits(cast, own(source, torch.bfloat16))


def test_the_cast_rules_are_built_once_at_install_not_per_call(tmp_path, monkeypatch):
    """The mode looks each call up in the function -> rule table it built at install: no per-call loop over the cast
    methods (built once, the casts still caught)."""
    built, original = [], file_backed_casts.cast_rules
    monkeypatch.setattr(file_backed_casts, "cast_rules", lambda: built.append(1) or original())
    casts = FileBackedCasts(tmp_path)
    casts.install()
    try:
        casts_made = [torch.randn(64, 64).to(torch.bfloat16), torch.randn(64, 64).half(), torch.randn(8) + 1]
    finally:
        casts.remove()
    assert len(built) == 1 and casts.scratch.bytes == 2 * 64 * 64 * 2 and len(casts_made) == 3


def test_what_is_not_a_cpu_float_cast_is_untouched(tmp_path):
    """Same dtype, integers, small tensors, tracked by autograd, non-contiguous, subclasses, in-place ops and every
    other function run as without the mode."""
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    small = torch.randn(MIN_BYTES // 2 - 1)  # its bf16 cast is below MIN_BYTES
    tracked = torch.randn(64, 64, requires_grad=True)

    class Sub(torch.Tensor):
        pass

    casts = FileBackedCasts(tmp_path)
    casts.install()
    try:
        results = [
            x.to(torch.float32),
            x.to(torch.int32),
            x.to(torch.int32).to(torch.float16),  # from integers
            x.to(torch.bool),
            small.to(torch.bfloat16),
            torch.tensor(1.5).to(torch.bfloat16),  # a scalar
            x.t().to(torch.bfloat16),  # non-contiguous: its own layout
            x.to("meta", torch.bfloat16),
            torch.empty(64, 64, device="meta").to(torch.bfloat16),  # a meta source (init_empty_weights)
            x[None, None].to(torch.bfloat16, memory_format=torch.channels_last),  # a layout of its own
            x.as_subclass(Sub).to(torch.bfloat16),
            x * 2,
            x.add_(1),
            x.clone(),
        ]
        cast_tracked = tracked.to(torch.bfloat16)
        with torch.no_grad():
            in_place = torch.empty(64, 64, dtype=torch.bfloat16).copy_(x)  # an in-place cast: into its own memory
    finally:
        casts.remove()
    assert casts.scratch.bytes == 0, "nothing was cast into the scratch file"
    assert cast_tracked.grad_fn is not None, "autograd records the cast as without the mode"
    assert x.to(torch.float32) is x and results[0] is x
    assert same_bits(in_place, x.to(torch.bfloat16)) and type(results[10]) is Sub and results[8].is_meta
    assert weight_sources([]).scratch_bytes == 0


def test_a_second_install_is_a_bug_not_a_mode_left_on_the_stack(tmp_path):
    casts = FileBackedCasts(tmp_path)
    casts.install()
    try:
        with pytest.raises(RuntimeError, match="already redirected"):
            casts.install()
    finally:
        casts.remove()
    assert torch.randn(64, 64).to(torch.bfloat16).untyped_storage().nbytes() == 64 * 64 * 2


def test_cast_target_knows_gpu_and_meta_casts_are_not_cpu_casts():
    base, x = torch._C.TensorBase, torch.empty(2)
    assert cast_target(base.to, (x, "cuda", torch.bfloat16), {}) is None
    assert cast_target(base.to, (x, torch.device("cuda", 0)), {"dtype": torch.bfloat16}) is None
    assert cast_target(base.to, (x,), {"device": "meta", "dtype": torch.bfloat16}) is None
    assert cast_target(base.type, (x, "torch.cuda.HalfTensor"), {}) is None
    assert cast_target(base.to, (x, torch.bfloat16, False, False, "nonsense"), {}) is None  # not understood
    assert cast_target(base.to, (x, "cpu", torch.bfloat16), {}) is torch.bfloat16
    assert cast_target(base.add, (x, x), {}) is None


MEASURE = """
import gc, json, sys
import torch
from accelerate.utils import modeling
sys.path.insert(0, sys.argv[3])
from test_file_backed_casts_cpu import cast_in_place, load, load_views
from utils.dgls.memory.file_backed import anonymous_memory
from utils.dgls.trainers import file_backed_casts
from utils.dgls.trainers.file_backed_casts import FileBackedCasts

file_backed_casts.file_system = lambda directory: "ext4"  # as the tests' fixture: wherever the temp is tmpfs
LOADS = {
    "accelerate": lambda: load(sys.argv[1], torch.bfloat16, modeling.set_module_tensor_to_device),
    "p.data = p.data.to": lambda: cast_in_place(load_views(sys.argv[1]), torch.bfloat16),
    "module.to": lambda: load_views(sys.argv[1]).to(torch.bfloat16),
    "float8": lambda: cast_in_place(load_views(sys.argv[1]), torch.float8_e4m3fn),
}
grown = {}
for name, make in LOADS.items():
    for installed in (False, True):  # the control: the same load without the mode
        casts = FileBackedCasts(sys.argv[2])
        if installed:
            casts.install()
        gc.collect()
        before = anonymous_memory()
        loaded = make()
        grown[f"{name} {'mode' if installed else 'control'}"] = anonymous_memory() - before
        casts.remove()
        assert all(p.dtype != torch.float32 for p in loaded.parameters())
        del loaded
print(json.dumps(grown))
"""


@pytest.mark.slow  # fresh processes with torch
def test_a_cast_into_scratch_files_adds_no_anonymous_memory(tmp_path):
    """Measured in a fresh process (the suite's own threads and freed heap would blur RssAnon): each load that casts
    240 MiB of fp32 weights (accelerate's, Flux's ``p.data = p.data.to``, ``Module.to``, to float8) grows anonymous
    memory by the cast's size without the mode (the control), by next to nothing with it."""
    path = checkpoint(tmp_path)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(tmp_path / "scratch"), str(root / "tests")],
        cwd=root,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    print("RssAnon growth casting 240 MiB of fp32: " + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in grown.items()))
    for name in ("accelerate", "p.data = p.data.to", "module.to", "float8"):
        size = 60 if name == "float8" else 120
        assert grown[f"{name} control"] > size * 0.8 * MiB, f"the control: {name} allocates {size} MiB"
        assert grown[f"{name} mode"] < 16 * MiB, f"{name}: the cast grew anonymous memory by {grown[name + ' mode']}"
    assert os.listdir(tmp_path / "scratch") == []


def scratch_mappings() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "dgls-cast-" in line]


def test_a_parameter_set_to_a_cast_keeps_its_mapping_until_it_is_freed(tmp_path):
    path = checkpoint(tmp_path, rows=64, n=64)
    expected = cast_in_place(load_views(path, 64, 64), torch.float8_e4m3fn)
    casts = FileBackedCasts(tmp_path / "scratch")
    casts.install()
    loaded = cast_in_place(load_views(path, 64, 64), torch.float8_e4m3fn)
    casts.remove()
    gc.collect()
    assert len(scratch_mappings()) == 1, "the parameters hold the chunk"
    assert all(same_bits(a.data, b.data) for a, b in zip(expected.parameters(), loaded.parameters(), strict=True))
    del loaded
    gc.collect()
    assert scratch_mappings() == [], "freed with the last tensor cast into it"


def test_a_cast_sent_to_another_process_is_copied_alone(tmp_path):
    """torch's pickling for another process moves a tensor into shared memory: a cast tensor has a storage of its own
    bytes, so only it moves (a view of the whole chunk could not be sent at all)."""
    import torch.multiprocessing  # noqa: F401 (registers torch's reductions)

    casts = FileBackedCasts(tmp_path)
    casts.install()
    kept, sent = torch.randn(256).to(torch.bfloat16), torch.randn(256).to(torch.bfloat16)
    casts.remove()
    sent_bits = sent.clone()
    ForkingPickler(io.BytesIO()).dump(sent)
    assert same_bits(sent, sent_bits) and sent.untyped_storage().is_shared()
    assert weight_sources([_holder(kept)]).scratch_bytes == 512 and weight_sources([_holder(sent)]).scratch_bytes == 0


def _holder(tensor):
    holder = torch.nn.Module()
    holder.p = torch.nn.Parameter(tensor, requires_grad=False)
    return holder


FORKED = """
import os, sys
import torch
from utils.dgls.trainers import file_backed_casts
from utils.dgls.trainers.file_backed_casts import FileBackedCasts
from utils.dgls.memory.file_backed import file_mappings

file_backed_casts.file_system = lambda directory: "ext4"  # as the tests' fixture: wherever the temp is tmpfs
casts = FileBackedCasts(sys.argv[1])
casts.install()
parent = torch.randn(64, 64).to(torch.bfloat16)  # the chunk is mapped now, shared with a child
read, write = os.pipe()
child = os.fork()
if child == 0:  # train.py's caching worker: a fork of the process that loads
    cast = torch.full((64, 64), 7.0).to(torch.bfloat16)
    mapped = any(start <= cast.data_ptr() < end for start, end, _ in file_mappings())
    os.write(write, b"mapped" if mapped else b"anonymous")
    os._exit(0)
os.waitpid(child, 0)
after = torch.randn(64, 64).to(torch.bfloat16)  # the parent's next cast, in the bytes after its first
casts.remove()
print(os.read(read, 64).decode(), casts.scratch.bytes == 2 * 64 * 64 * 2)
"""


@pytest.mark.slow  # a fresh process with torch, and a fork
def test_a_forked_process_casts_as_without_the_mode(tmp_path):
    """The child inherits the mode and the chunk's shared mapping: it must not carve from it (the parent hands out the
    same bytes next)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", FORKED, str(tmp_path)], cwd=root, env=child_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["anonymous", "True"], out.stdout


def test_the_mode_is_off_the_stack_after_removal_and_training_is_untouched(tmp_path):
    depth = stack_depth()
    layers, trainable = make_layers()
    casts = FileBackedCasts(tmp_path)
    casts.install()
    assert stack_depth() == depth + 1
    with torch.device("meta"):  # a loader's mode, entered and left while the casts are on
        torch.empty(1)
    for layer in layers:
        layer.to(torch.bfloat16)
    cast_bytes = casts.scratch.bytes
    assert cast_bytes > 0
    casts.remove()
    casts.remove()  # idempotent
    assert stack_depth() == depth
    x = torch.randn(4, 4)
    assert x.to(torch.bfloat16) is not None and casts.scratch.bytes == cast_bytes, "off: a cast is the plain one"
    # training after the load: gradients as with weights cast in process memory
    plain, _ = make_layers()
    for layer in plain:
        layer.to(torch.bfloat16)
    for a, b in zip(layers, plain, strict=True):
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert same_bits(p.data, q.data), name
    lora = [p for layer in layers for name, p in layer.named_parameters() if "lora_" in name]
    plain_lora = [p for layer in plain for name, p in layer.named_parameters() if "lora_" in name]
    lin, plain_lin = _first_linear(layers), _first_linear(plain)
    torch.manual_seed(3)
    inputs = torch.randn(3, lin.in_features, dtype=torch.bfloat16)
    lin(inputs).float().square().sum().backward()
    plain_lin(inputs).float().square().sum().backward()
    grads = [(p.grad, q.grad) for p, q in zip(lora, plain_lora, strict=True) if p.grad is not None]
    assert grads and all(same_bits(g, h) for g, h in grads)
    assert trainable


def _first_linear(layers):
    return next(m for layer in layers for m in layer.modules() if hasattr(m, "lora_A"))


def test_a_mode_entered_after_the_casts_and_never_left_keeps_its_place(tmp_path):
    depth = stack_depth()
    casts = FileBackedCasts(tmp_path)
    casts.install()
    other = torch.device("meta")
    other.__enter__()  # a loader that entered a device context and never left it (the stage is built inside it)
    try:
        casts.remove()
        assert stack_depth() == depth + 1 and torch.empty(1).is_meta, "the other mode stays on"
    finally:
        other.__exit__(None, None, None)
    assert stack_depth() == depth and not torch.empty(1).is_meta


def interception(tmp_path, lines):
    from utils.dgls import SwapConfig
    from utils.dgls.trainers.diffusion_pipe import PipelineInterception

    values = {"verbose": False, "verbose_every": 10, "plan": False, "host_ram_budget": 1.0, "disk_dir": str(tmp_path)}
    return PipelineInterception(values, log=lines.append, swap=SwapConfig.of(blocks_to_swap=2, prefetch=1))


def test_the_interception_takes_the_mode_off_before_it_places_the_layers(tmp_path, monkeypatch):
    """train.py's stage is built: the casts are off before DGLS places (and later trains) the layers, and the start-up
    line counts the cast weights as in the scratch file, none copied."""
    from utils.dgls.trainers.pipeline_hook import Stage

    lines, depth = [], stack_depth()
    run = interception(tmp_path, lines)
    run.casts.install()  # what __enter__ does last
    layers, _ = make_layers()
    for layer in layers:
        layer.to(torch.bfloat16)  # diffusers' torch_dtype cast
    from utils.dgls.trainers import diffusion_pipe

    on_while_placing = []
    swapper_class = diffusion_pipe.LayerSwapper

    def placing(*args, **kwargs):  # the stage's swapper, built after the casts are off
        on_while_placing.append(stack_depth() - depth)
        return swapper_class(*args, **kwargs)

    monkeypatch.setattr(diffusion_pipe, "LayerSwapper", placing)
    stage = Stage(
        layers, start=0, stage_id=0, num_stages=1, data_parallel_id=0, data_parallel_size=1, layer_count=len(layers)
    )
    swapper = run.install(stage)
    try:
        assert stack_depth() == depth and on_while_placing == [0]
        assert "0.00 MiB are copies in process memory" in lines[0] and "cast into a scratch file" in lines[0]
    finally:
        swapper.remove()
        run.casts.remove()


def test_an_error_during_the_load_leaves_the_mode_off_and_no_file(tmp_path):
    """A train.py that fails while it loads: the interception's exit takes the mode off; nothing stays in the
    disk_dir."""
    depth = stack_depth()
    run = interception(tmp_path, [])
    run.casts.install()
    assert stack_depth() == depth + 1
    kept = torch.randn(64, 64).to(torch.bfloat16)
    run.__exit__(ZeroDivisionError, ZeroDivisionError(), None)
    assert stack_depth() == depth and os.listdir(tmp_path) == [] and run.casts.scratch.bytes == kept.numel() * 2


def test_a_disk_without_room_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(file_backed_casts, "check_directory", _no_room)
    casts = FileBackedCasts(tmp_path)
    with pytest.raises(DGLSUserError, match="no room"):
        casts.scratch.empty(torch.Size([4]), torch.bfloat16)
    depth = stack_depth()
    casts.install()
    try:
        with pytest.raises(DGLSUserError, match="no room") as raised:
            torch.randn(64, 64).to(torch.bfloat16)  # the loader's cast, under the mode
    finally:
        casts.remove()
    assert "\n" not in str(raised.value) and stack_depth() == depth and os.listdir(tmp_path) == []


def _no_room(directory, nbytes, purpose):
    assert purpose == "the model load's casts"
    raise DGLSUserError(f"disk_dir {directory} has no room for {nbytes} bytes")


def test_a_disk_that_fills_after_the_check_is_one_line_not_a_sigbus(tmp_path, monkeypatch):
    """The scratch file's blocks are allocated before it is mapped: a sparse file's mapping would take them as the
    casts write, and a disk filled meanwhile would kill the process (SIGBUS). A file system that cannot allocate
    ahead keeps the free-space check alone."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DGLSUserError, match="no room for a .* scratch file of the model load's casts") as raised:
        FileBackedCasts(tmp_path).scratch.empty(torch.Size([4]), torch.bfloat16)
    assert "\n" not in str(raised.value) and not list(tmp_path.iterdir()), "one line, and no file left"

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    cast = FileBackedCasts(tmp_path).scratch.empty(torch.Size([4]), torch.bfloat16)
    assert cast.shape == (4,)


def test_on_a_ram_file_system_the_casts_stay_and_a_line_says_why(tmp_path, monkeypatch):
    """A scratch file on tmpfs is RAM too: nothing is installed, and the start-up note says what to change."""
    monkeypatch.setattr(file_backed_casts, "file_system", lambda directory: "tmpfs")
    depth = stack_depth()
    casts = FileBackedCasts(tmp_path)
    casts.install()
    assert stack_depth() == depth and casts.mode is None
    torch.randn(64, 64).to(torch.bfloat16)
    assert casts.scratch.bytes == 0
    assert "is on tmpfs, which is RAM" in casts.note and "--disk_dir" in casts.note
    casts.remove()


def test_removal_lets_go_of_the_chunk_being_carved(tmp_path):
    casts = FileBackedCasts(tmp_path)
    casts.install()
    casts.scratch.empty(torch.Size([4]), torch.bfloat16)
    assert casts.scratch._chunk is not None
    casts.remove()
    assert casts.scratch._chunk is None


@pytest.mark.gpu
def test_casts_to_the_gpu_are_untouched_and_a_cast_tensor_moves_there(tmp_path):
    """A cast that goes to the GPU (``.to('cuda', dtype)``, ``.cuda()`` after a CPU cast) is torch's own; a scratch
    tensor moves to the GPU with its bytes, as a weight does when DGLS places it."""
    source = torch.randn(256, 256)
    casts = FileBackedCasts(tmp_path)
    casts.install()
    try:
        on_gpu = source.to("cuda", torch.bfloat16)
        cast = source.to(torch.float8_e4m3fn)
        gpu_source = source.cuda()
        from_gpu = gpu_source.to(torch.bfloat16)
        moved = cast.to("cuda")
    finally:
        casts.remove()
    assert on_gpu.is_cuda and from_gpu.is_cuda and casts.scratch.bytes == cast.numel()
    assert same_bits(moved.cpu(), source.to(torch.float8_e4m3fn)) and same_bits(on_gpu.cpu(), source.bfloat16())
