"""The private torch APIs DGLS calls sit in one module, and start-up checks them against the installed torch."""

from __future__ import annotations

import ast
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from utils.dgls import torch_private
from utils.dgls.errors import DGLSUserError


def test_every_used_private_api_exists_in_this_torch():
    assert torch_private.missing_apis() == []
    assert torch_private.check_torch() == ""


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0"])
def test_the_tested_range_starts_without_a_notice(version):
    assert torch_private.check_torch(version) == ""


@pytest.mark.parametrize("version", ["2.10.0", "2.14.0.dev20270101", "3.0.0"])
def test_a_torch_outside_the_tested_range_gets_one_notice(version):
    notice = torch_private.check_torch(version)
    assert notice.startswith(f"DGLS: torch {version} is outside the tested range (2.11 to 2.13)")
    assert "\n" not in notice


def test_a_torch_without_one_of_the_apis_is_refused_in_one_line_naming_it():
    fake = SimpleNamespace(_C=SimpleNamespace(_autograd=SimpleNamespace()))
    with pytest.raises(DGLSUserError) as caught:
        torch_private.check_torch("2.15.0", root=fake)
    message = str(caught.value)
    assert "torch 2.15.0 lacks torch._C._current_autograd_node, torch._C._autograd._top_saved" in message
    assert message.endswith("install torch 2.11 to 2.13 (pip install 'torch>=2.11,<2.14')")
    assert "\n" not in message


def test_every_private_name_the_module_spells_is_in_what_start_up_checks():
    """A private attribute, module or class name in torch_private.py's code is the last part of a USED entry, so
    a torch that renamed it is refused at start-up, not found in a step (or, for a class name compared as a
    string, never found)."""
    tree = ast.parse((ROOT / "utils" / "dgls" / "torch_private.py").read_text())
    spelled = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            spelled.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            spelled.update([*(node.module or "").split("."), *(alias.name for alias in node.names)])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            spelled.add(node.value)
    private = {name for name in spelled if re.fullmatch(r"_[A-Za-z]\w*", name) and not name.startswith("__")}
    checked = {part for name in torch_private.USED for part in name.split(".")}
    assert private <= checked, f"not in torch_private.USED: {sorted(private - checked)}"


def test_a_selective_checkpoint_of_this_torch_is_recognised():
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    seen = []

    def body(x):
        seen.append(torch_private.under_selective_checkpoint())
        return x.sin()

    context = partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE)
    checkpoint(body, torch.ones(2, requires_grad=True), use_reentrant=False, context_fn=context).sum().backward()
    assert seen[0] is True  # the selective checkpoint's forward
    seen.clear()
    checkpoint(body, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
    assert seen == [False, False]  # a plain checkpoint's forward and recompute


def test_the_tested_range_is_the_one_requirements_txt_states():
    line = next(x for x in (ROOT / "requirements.txt").read_text().splitlines() if x.startswith("torch"))
    (low, high) = torch_private.TESTED
    assert line == f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


def test_the_helpers_do_what_torch_does():
    x = torch.arange(6.0)
    assert torch_private.storage_key(x[2:]) == torch_private.storage_key(x)
    assert torch_private.is_view(x[2:]) and not torch_private.is_view(x)
    assert torch_private.view_base(x[2:]) is x
    norms = torch_private.foreach_norm([x, -x[:2]])
    assert torch.equal(torch.stack(norms), torch.stack([x.norm(), x[:2].norm()]))


def test_no_other_module_calls_a_private_torch_api():
    """Only torch_private.py spells ``torch._`` or a private name under any torch module (``torch.cuda._sleep``,
    ``torch.utils._pytree``; docstrings and comments aside)."""
    pattern = re.compile(r"\btorch(\.[A-Za-z]\w*)*\._[A-Za-z]|_execution_engine|\._cdata|\._is_view\(|\._base\b")
    found = []
    for path in sorted((ROOT / "utils" / "dgls").rglob("*.py")):
        if path.name == "torch_private.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and not code.lstrip().startswith(('f"', '"', "'")):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_torch_outside_the_range_is_said_once_when_the_engine_is_built(monkeypatch):
    from utils.dgls import LayerSwapper, SwapConfig

    monkeypatch.setattr(torch, "__version__", "2.14.0")
    lines: list[str] = []
    layers = [torch.nn.Linear(4, 4).requires_grad_(False) for _ in range(2)]
    with LayerSwapper(layers, SwapConfig.of(blocks_to_swap=1), device="cpu", log=lines.append):
        pass
    assert sum("torch 2.14.0 is outside the tested range" in line for line in lines) == 1, lines


def test_the_program_refuses_a_torch_without_the_apis_before_reading_the_config(monkeypatch, tmp_path, capsys):
    from cli_helpers import run_in_process

    monkeypatch.delattr(torch, "_fused_sgd_")
    code, _, err = run_in_process(["--config", str(tmp_path / "absent.toml")], capsys)
    assert code == 2 and err.startswith("dgls: error: torch ") and "lacks torch._fused_sgd_," in err, err
