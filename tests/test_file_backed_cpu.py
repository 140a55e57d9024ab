"""File-backed weights (utils/dgls/memory/file_backed.py), and the load paths diffusion-pipe uses, measured:
safetensors' CPU reads (load_file, safe_open's get_tensor) and what diffusers and accelerate build from them are
views of the file (anonymous memory does not grow with the file's size); a dtype cast or a load_state_dict into real
weights is a copy, and the accounting counts it by dtype."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from utils.dgls.memory.file_backed import file_mappings, weight_sources

MiB = 2**20


class Two(torch.nn.Module):
    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.a = torch.nn.Linear(n, n)
        self.b = torch.nn.Linear(n, n, bias=False)


def saved(tmp_path, module: torch.nn.Module, name: str = "m.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


def total_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_the_maps_parser_keeps_files_only():
    maps = (
        "7f0000000000-7f0000001000 r--p 00000000 fd:01 1234 /models/flux.safetensors\n"
        "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 \n"
        "7f0000004000-7f0000005000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0000006000-7f0000007000 r--p 00000000 fd:01 99 /tmp/x (deleted)\n"
    )
    assert file_mappings(maps) == [
        (0x7F0000000000, 0x7F0000001000, "/models/flux.safetensors"),
        (0x7F0000006000, 0x7F0000007000, "/tmp/x"),
    ]


def test_safetensors_reads_are_views_of_the_file(tmp_path):
    torch.manual_seed(0)
    path = saved(tmp_path, Two())
    state = load_file(str(path))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(state["a.weight"], requires_grad=False)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        model.v = torch.nn.Parameter(f.get_tensor("b.weight"), requires_grad=False)
    sources = weight_sources([model, "a function between layers"])
    assert sources.file_bytes == {str(path): 2 * 64 * 64 * 4} and not sources.copied_bytes
    assert "0.00 MiB are copies" in sources.line() and "the process holds" in sources.line()


def test_an_adapters_weights_are_not_counted(tmp_path):
    """A LoRA's weights are made by the run (PEFT's lora_A/lora_B), not loaded: only the base weights count."""
    import peft

    torch.manual_seed(0)
    path = saved(tmp_path, Two())
    with torch.device("meta"):
        model = Two()
    model.load_state_dict(load_file(str(path)), assign=True)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["a", "b"]))
    assert any("lora_A" in name for name, _ in model.named_parameters())
    sources = weight_sources([model])
    assert sources.mapped == (64 * 64 * 2 + 64) * 4 and not sources.copied_bytes


def test_accelerate_set_module_tensor_keeps_views_and_a_cast_copies(tmp_path):
    """diffusion-pipe's Wan, HunyuanVideo, Lumina, Qwen-Image loaders: a meta model, then
    set_module_tensor_to_device(..., dtype=...) with each tensor of the file."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    torch.manual_seed(0)
    path = saved(tmp_path, Two())
    state = load_file(str(path))
    for dtype, expect_copied in ((torch.float32, {}), (torch.bfloat16, {torch.bfloat16: (64 * 64 * 2 + 64) * 2})):
        with init_empty_weights():
            model = Two()
        for name, _ in list(model.named_parameters()):
            set_module_tensor_to_device(model, name, device="cpu", dtype=dtype, value=state[name])
        sources = weight_sources([model])
        assert sources.copied_bytes == expect_copied, dtype
        assert sources.mapped == (total_bytes(model) if not expect_copied else 0), dtype
    assert "bfloat16" in sources.line() and "by a cast" in sources.line()


def test_load_state_dict_assign_keeps_views_and_copy_into_real_weights_copies(tmp_path):
    """Chroma's and Cosmos' loaders assign (views); a model built with real weights gets copies."""
    torch.manual_seed(0)
    path = saved(tmp_path, Two())
    with torch.device("meta"):
        assigned = Two()
    assigned.load_state_dict(load_file(str(path)), assign=True)
    copied = Two()
    copied.load_state_dict(load_file(str(path)))
    assert weight_sources([assigned]).mapped == total_bytes(assigned)
    assert weight_sources([copied]).copied_bytes == {torch.float32: total_bytes(copied)}


def tiny_flux(dtype):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    ).to(dtype)


@pytest.mark.slow  # diffusers' Flux class needs a newer peft than requirements.txt's floor (CI's floors run)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_diffusers_from_pretrained_keeps_views_unless_it_casts(tmp_path):
    """Flux and SD3 (diffusers' from_pretrained with torch_dtype): the checkpoint's dtype gives views; another
    dtype gives copies of the whole model."""
    from diffusers import FluxTransformer2DModel

    tiny_flux(torch.bfloat16).save_pretrained(tmp_path / "transformer")
    same = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer", torch_dtype=torch.bfloat16)
    cast = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer", torch_dtype=torch.float32)
    total = total_bytes(same)
    assert weight_sources([same]).mapped == total and not weight_sources([same]).copied_bytes
    assert weight_sources([cast]).copied_bytes == {torch.float32: 2 * total}


MEASURE = """
import json, sys
import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from utils.dgls.memory.file_backed import anonymous_memory, weight_sources

path, n, rows, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def load(dtype):
    with init_empty_weights():
        model = torch.nn.Sequential(*(torch.nn.Linear(n, rows, bias=False) for _ in range(count)))
    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():
            set_module_tensor_to_device(model, key, device="cpu", dtype=dtype, value=f.get_tensor(key))
    read = sum(float(p.detach().float().sum()) for p in model.parameters())  # every page
    assert read == rows * n * sum(range(count)), read
    return model

before = anonymous_memory()
in_place = load(torch.float32)
grown_in_place = anonymous_memory() - before
sources = weight_sources([in_place])
del in_place
before = anonymous_memory()
cast = load(torch.bfloat16)
grown_cast = anonymous_memory() - before
copied = weight_sources([cast]).copied_bytes
print(json.dumps([grown_in_place, sources.mapped, grown_cast, {str(k): v for k, v in copied.items()}]))
"""


@pytest.mark.slow  # fresh processes with torch
def test_anonymous_memory_does_not_grow_with_the_file(tmp_path):
    """A 240 MiB checkpoint read through safetensors and set into a meta model (the Wan/Qwen-Image path), every
    byte read, in a fresh process (the suite's threads and freed heap would blur RssAnon): anonymous memory grows by
    far less than the file; the same model cast to bf16 grows by the cast's size (the measurement's control)."""
    # 3 float32 layers of 80 MiB: each bf16 cast (40 MiB) is above glibc's largest mmap threshold (32 MiB)
    n, rows, count = 4096, 5120, 3
    path = tmp_path / "big.safetensors"
    save_file({f"{i}.weight": torch.full((rows, n), float(i)) for i in range(count)}, str(path))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(n), str(rows), str(count)],
        cwd=root,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    grown_in_place, mapped, grown_cast, copied = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"RssAnon growth, 240 MiB file: in place {grown_in_place / MiB:.1f} MiB, cast {grown_cast / MiB:.1f} MiB")
    assert mapped == count * rows * n * 4 and copied == {"torch.bfloat16": count * rows * n * 2}
    assert grown_cast > 100 * MiB, "the control: the bf16 cast allocates 120 MiB"
    assert grown_in_place < 24 * MiB, f"views grew anonymous memory by {grown_in_place / MiB:.1f} MiB"
