"""Lines stay whole when every process of a job writes to one pipe (utils/dgls/errors.py's module doc).

DeepSpeed's launcher starts each process with ``python -u``; there ``print`` writes a line's text and its newline
separately, and a CI run lost ``step 4: loss ...`` into the middle of another process's line. The package writes
through :func:`say` and :func:`print_line`, one write a line, and calls ``print`` nowhere.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from utils.dgls.errors import print_line, say

PACKAGE = ROOT / "utils" / "dgls"
WRITER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("errors", {errors!r})  # errors.py alone: no torch to import
errors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(errors)
say = errors.say
while time.time() < {start}:  # every writer starts at once, so that their writes meet
    pass
for i in range({lines}):
    {call}(f"process {{sys.argv[1]}} line {{i}} " + "x" * 60)
"""


class Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("printer,stream", [(say, "stdout"), (print_line, "stderr")])
def test_a_line_and_its_newline_are_one_write(monkeypatch, printer, stream):
    recorder = Recorder()
    monkeypatch.setattr(sys, stream, recorder)
    printer("step 4: loss 1.7896")
    assert recorder.writes == ["step 4: loss 1.7896\n"]


def test_the_package_calls_print_nowhere():
    """Neither a call nor a default ``log=print``: each would write a line in two writes under ``python -u``."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name) and node.id == "print"
    ]
    assert not found, f"print (two writes a line under python -u) at {found}: use errors.say"


def run_writers(call: str, processes: int = 4, lines: int = 3000) -> list[str]:
    """``processes`` unbuffered Pythons writing ``lines`` lines each into one pipe, as the launcher's children do."""
    start = time.time() + 1.5  # after every writer has started (each imports errors.py alone)
    code = WRITER.format(errors=str(PACKAGE / "errors.py"), lines=lines, call=call, start=start)
    shell = " & ".join(f"{sys.executable} -u -c {_quote(code)} {n}" for n in range(processes)) + " & wait"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120).stdout
    return out.splitlines()


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_lines_from_several_unbuffered_processes_stay_whole():
    lines = run_writers("say")
    expected = {f"process {n} line {i} " + "x" * 60 for n in range(4) for i in range(3000)}
    assert len(lines) == len(expected) and set(lines) == expected
