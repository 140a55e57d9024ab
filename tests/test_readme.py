"""The README's performance figures: each one stands in the results file its sentence cites."""

import re

from conftest import ROOT


def cited_figures(section: str) -> list[tuple[str, str]]:
    """(results file, figure) for every 'N GiB', 'N.NNx' and 'N.N ms' in a paragraph or bullet that
    cites a benchmarks/results/ file."""
    found = []
    for part in re.split(r"\n\s*\n|\n- ", section):
        sources = re.findall(r"benchmarks/results/[\w.]+\.md", part)
        for figure in re.findall(r"(\d+(?:\.\d+)?) GiB|(\d+\.\d+x)|(\d+\.\d+) ms", part):
            value = next(v for v in figure if v)
            found += [(source, value) for source in sources[:1]]
    return found


def test_every_performance_figure_is_in_the_results_it_cites():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    figures = cited_figures(section)
    assert len(figures) >= 10, figures
    for source, figure in figures:
        assert figure in (ROOT / source).read_text(), f"the README quotes {figure} from {source}, which lacks it"
