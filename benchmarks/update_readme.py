"""Copy the benchmark tables from benchmarks/results/*.md into README.md's Performance section.

The README quotes the files the benchmarks wrote; nothing is typed by hand.
    python benchmarks/update_readme.py
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the {BEGIN} ... {END} markers")
    parts = []
    for md in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        parts.append(f"From `benchmarks/results/{md.name}`:\n\n{md.read_text().strip()}\n")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}\n{chr(10).join(parts)}{END}{tail}")


if __name__ == "__main__":
    main()
