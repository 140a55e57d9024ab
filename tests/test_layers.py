"""The folders of utils/dgls are layers: each folder's ``__init__`` lists its modules and says which folders it may
import ("May import: ..."), and every import in the package keeps to that. The root modules (errors, spelling,
torch_private) are open to all; imports only for type checking (``if TYPE_CHECKING:``) are annotations and free."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "utils" / "dgls"
ROOT_MODULES = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
LAYERED = [f for f in FOLDERS if f != "demo"]


def docstring(folder: str) -> str:
    return ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""


def allowed(folder: str) -> set[str]:
    line = re.search(r"^May import: (.+?)(?:\n\n|\Z)", docstring(folder), re.M | re.S).group(1)
    return {name for name in re.findall(r"\b\w+\b", line.split("(")[0]) if name in FOLDERS}


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every relative import outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = list(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.append((node.lineno, ".".join([*base, node.module])))
            else:
                found.extend((node.lineno, ".".join([*base, alias.name])) for alias in node.names)
    return found


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_names_its_modules_and_its_layer(folder):
    text = docstring(folder)
    modules = {p.name for p in (PACKAGE / folder).glob("*.py")} - {"__init__.py"}
    named = set(re.findall(r"^\s*- ``(\w+\.py)``", text, re.M))
    assert named == modules, (
        f"{folder}/__init__.py: names {sorted(named - modules)}, leaves out {sorted(modules - named)}"
    )
    assert "May import:" in text, f"{folder}/__init__.py says nothing of what it may import"


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_import_keeps_to_the_layers(folder):
    may = allowed(folder) | {folder}
    wrong = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for line, module in runtime_imports(path):
            parts = module.split(".")
            target = parts[2] if len(parts) > 2 else "utils.dgls"
            if target not in ROOT_MODULES and target not in may:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, f"{folder} may import {sorted(may - {folder})} and the root modules:\n" + "\n".join(wrong)


def test_the_layers_have_no_cycle():
    """May-import lists form an order (the demo, an example trainer, is outside it)."""
    graph = {folder: allowed(folder) - {"demo"} for folder in LAYERED}
    done: set[str] = set()

    def visit(folder: str, path: tuple[str, ...]) -> None:
        assert folder not in path, f"a cycle: {' -> '.join((*path, folder))}"
        if folder not in done:
            for below in graph[folder]:
                visit(below, (*path, folder))
            done.add(folder)

    for folder in LAYERED:
        visit(folder, ())


def test_the_root_modules_import_only_each_other():
    for name in ROOT_MODULES:
        for line, module in runtime_imports(PACKAGE / f"{name}.py"):
            assert module.split(".")[2] in ROOT_MODULES, f"{name}.py:{line} imports {module}"
