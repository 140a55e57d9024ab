"""Copy the benchmark tables from benchmarks/results/*.md into README.md's Performance section.

The README quotes the files the benchmarks wrote; nothing is typed by hand. A block
``<!-- results:NAME:begin -->`` ... ``<!-- results:NAME:end -->`` quotes results/NAME.md (and links
NAME.png when there is one); the block ``<!-- results:begin -->`` ... ``<!-- results:end -->``
quotes every other results/*.md, the model benchmarks (flux_dev, wan, sdxl) first.
    python benchmarks/update_readme.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NAMED = re.compile(r"<!-- results:([\w.-]+):begin -->.*?<!-- results:\1:end -->", re.S)
FIRST = ("flux_dev", "wan", "sdxl")  # the model benchmarks lead the catch-all block


def quote(stem: str) -> str:
    md = RESULTS / f"{stem}.md"
    if not md.exists():
        return f"`benchmarks/results/{stem}.md` is not written yet: run its benchmark on the GPU.\n"
    text = f"From `benchmarks/results/{stem}.md`:\n\n{md.read_text().strip()}\n"
    if (RESULTS / f"{stem}.png").exists():
        text += f"\n![{stem}: step time vs peak VRAM](benchmarks/results/{stem}.png)\n"
    return text


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the {BEGIN} ... {END} markers")
    named: set[str] = set()

    def fill(match: re.Match) -> str:
        stem = match.group(1)
        named.add(stem)
        return f"<!-- results:{stem}:begin -->\n{quote(stem)}<!-- results:{stem}:end -->"

    text = NAMED.sub(fill, text)
    stems = sorted(md.stem for md in RESULTS.glob("*.md") if md.stem not in named)
    stems = [s for s in FIRST if s in stems] + [s for s in stems if s not in FIRST]
    parts = [quote(s) for s in stems]
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{chr(10).join(parts)}{END}{tail}"


def main() -> None:
    readme = ROOT / "README.md"
    readme.write_text(render(readme.read_text()))


if __name__ == "__main__":
    main()
