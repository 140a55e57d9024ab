"""What the README says stays true: every performance figure stands in the results file it cites (and every
figure of the results index's findings, benchmarks/findings.md, in the result it links), its troubleshooting
messages are messages DGLS prints, "How it works" names every module of utils/dgls, it stays within 400 lines,
and the Quick start's virtual-environment command works as written (the set-up, demo and test commands are
checked in test_cli.py, run by .ci/run and test_launch_lines.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

README = ROOT / "README.md"
FIGURE = r"(\d+(?:\.\d+)?) GiB|(\d+\.\d+x)|(\d+\.\d+) ms"


def section(title: str) -> str:
    """The README's section under ``## title``, up to the next ``## ``."""
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def cited_figures(text: str) -> list[tuple[str, str]]:
    """(results file, figure) for every 'N GiB', 'N.NNx' and 'N.N ms' in a paragraph, bullet or table row
    that cites a benchmarks/results/ file, checked against the first file it cites."""
    found = []
    for part in re.split(r"\n\s*\n|\n- |\n(?=\|)", text):
        sources = re.findall(r"benchmarks/results/[\w.]+\.md", part)
        for figure in re.findall(FIGURE, part):
            value = next(v for v in figure if v)
            found += [(source, value) for source in sources[:1]]
    return found


def test_every_performance_figure_is_in_the_results_it_cites():
    figures = cited_figures(section("Performance"))
    assert len(figures) >= 10, figures
    for source, figure in figures:
        assert figure in (ROOT / source).read_text(), f"the README quotes {figure} from {source}, which lacks it"


def test_every_finding_quotes_the_result_it_links():
    """benchmarks/findings.md links a result by its section of the index, ``[name](#name)``."""
    findings = (ROOT / "benchmarks" / "findings.md").read_text()
    figures = cited_figures(re.sub(r"\]\(#(\w+)\)", r"] benchmarks/results/\1.md", findings))
    assert len(figures) >= 40, figures
    for source, figure in figures:
        assert figure in (ROOT / source).read_text(), f"findings.md quotes {figure} from {source}, which lacks it"


def test_the_results_index_is_generated_with_the_findings():
    """benchmarks/results/README.md is what report.py writes: the findings moved there through the generator."""
    index = report.index(report.load_results(report.RESULTS), report.RESULTS, report.FINDINGS.read_text())
    assert (report.RESULTS / report.INDEX).read_text() == index, "run python benchmarks/report.py --index"
    assert "\n## Findings\n" in index


def source_strings() -> Iterator[str]:
    """Every string literal of dgls_train.py and utils/, an f-string with NUL where its fields go (adjacent
    literals are one string to ast, so a message split over lines is whole here)."""
    for path in [ROOT / "dgls_train.py", *sorted((ROOT / "utils").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield node.value
            elif isinstance(node, ast.JoinedStr):
                yield "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)


def test_every_troubleshooting_message_is_one_dgls_prints():
    """A row names a message by its words, ``...``, ``N`` and ``M`` standing for what varies."""
    strings = list(source_strings())
    rows = [line for line in section("Troubleshooting").splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 10, rows
    for row in rows:
        for message in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            for words in filter(None, (w.strip() for w in re.split(r"\.\.\.|\bN\b|\bM\b", message))):
                assert any(words in s for s in strings), f"troubleshooting row {message!r}: no message has {words!r}"


def test_how_it_works_names_every_module_and_no_other():
    """One row a folder of utils/dgls (the first: the package's own modules), naming each of its modules."""
    text = section("How it works")
    package = ROOT / "utils" / "dgls"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    modules -= {p for p in modules if p.endswith("/__init__.py")}
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][1:]
    named = set()
    for cells in rows:
        folder = re.fullmatch(r"\| `([\w/]+/)`", cells[0]).group(1)
        prefix = "" if folder == "utils/dgls/" else folder
        named |= {prefix + name for name in re.findall(r"`(\w+\.py)`", cells[1])}
    assert not modules - named, f"How it works leaves out {sorted(modules - named)}"
    assert not named - modules, f"How it works names modules that do not exist: {sorted(named - modules)}"


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 400, f"the README has {lines} lines: details go to module docstrings or benchmarks/findings.md"


@pytest.mark.slow
def test_the_virtual_environment_command_works_as_written(tmp_path):
    """The Quick start's own command, run in bash from an empty folder: afterwards python3 is the new
    environment's, with pip for the set-up commands."""
    (command,) = [c for c in re.findall(r"`([^`]+)`", section("Quick start")) if " -m venv " in c]
    script = f"{command} && python3 -c 'import sys; print(sys.prefix)' && python3 -m pip --version"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(proc.stdout.splitlines()[0]).resolve() == (tmp_path / ".venv").resolve()
