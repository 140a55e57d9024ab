"""This checkout's engine against an older one, side by side: the same benchmark cases run in both trees.

Each case is an existing benchmark command (bench_models.py or bench_full.py). A round runs it once in
each tree, in alternating order (this tree first in odd rounds), each in a process of its own with the
all-resident row measured in that same process, so each engine's ratio to all-resident is taken against
its own reference and drift over minutes cancels across rounds. The older tree is a copy of an earlier
commit (``git archive COMMIT benchmarks utils | tar -x -C .old``).

    python3 benchmarks/bench_engines.py --baseline .old --cases flux_budget8,sdxl_full_noclip [--rounds 2]
    python3 benchmarks/bench_engines.py --baseline .old --cases sdxl_full_noclip --tiny   # CPU smoke test

Writes benchmarks/results/<name>.json and .md (default name engines; results/tiny/ with --tiny).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import machine  # noqa: E402
from report import command_line, results_dir, write_result  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One benchmark command and the row of its result that is compared (``method`` of that row)."""

    script: str
    argv: tuple[str, ...]
    method: str  # the compared row's method
    tiny_argv: tuple[str, ...] = ("--tiny",)
    # the compared row's own field with its all-resident reference (A/B rows: resident steps interleaved with
    # the swapped ones in that row's rounds); None: the run's all-resident row
    reference: str | None = None
    also_contains: str = ""  # and the compared row's method contains this


CASES = {
    "flux_budget8": Case(
        "bench_models.py",
        ("--model=flux", "--methods=resident,auto", "--budgets=8", "--steps=6", "--warmup=2"),
        "DGLS vram_budget",
    ),
    # the engine's mechanics at one fixed placement (the planner's spread, ~20 GiB streamed, no planning whose
    # trials depend on the machine's noise), each arm's steps interleaved with all-resident ones in rounds
    "flux_ab_spread20": Case(
        "bench_models.py",
        ("--model=flux", "--methods=ab", "--gib=20", "--ab_rounds=3", "--ab_steps=3"),
        "A/B: DGLS ~",
        ("--tiny", "--gib=0.0001"),
        reference="ab_resident_s",
        also_contains="(spread",
    ),
    "sdxl_full_noclip": Case(
        "bench_full.py", ("--methods=resident,dgls-split", "--clip=0", "--steps=4", "--warmup=3"), "dgls-split"
    ),
    "sdxl_full_clip": Case(
        "bench_full.py", ("--methods=resident,dgls-split", "--clip=1", "--steps=4", "--warmup=3"), "dgls-split"
    ),
    "wan9_cap4": Case(
        "bench_models.py",
        (
            "--model=wan",
            "--unit_mb=128",
            "--prefetch=3",
            "--methods=resident,offload",
            "--memory_cap_gib=4",
            "--steps=4",
            "--warmup=2",
        ),
        "DGLS + offload_activations",
    ),
}
TREE_NAMES = ("this checkout", "baseline")


def run_case(tree: Path, case: Case, tiny: bool, out: Path) -> dict:
    """Run ``case`` in ``tree``; its result's all-resident row and the compared row, with the wall time."""
    argv = [*case.argv, *(case.tiny_argv if tiny else ()), f"--results_dir={out}", "--name=case"]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{case.script}", *argv], cwd=tree, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(
            f"{case.script} failed in {tree} (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads((out / "case.json").read_text())
    rows = {row["method"]: row for row in result["rows"] if "median_step_s" in row}
    compared = next(
        (row for method, row in rows.items() if method.startswith(case.method) and case.also_contains in method), None
    )
    if compared is None:
        raise SystemExit(f"{case.script} in {tree}: no row starting {case.method!r} in {sorted(rows)}")
    if case.reference is not None:
        resident = {"method": "all-resident (interleaved)", "median_step_s": compared[case.reference]}
    else:
        resident = next(row for method, row in rows.items() if method.startswith(("resident", "all-resident")))
    return {"resident": resident, "row": compared, "wall_s": time.perf_counter() - start}


def compare(case_name: str, case: Case, trees: tuple[Path, Path], rounds: int, tiny: bool, first: int = 1) -> dict:
    """Alternate the trees over ``rounds`` (numbered from ``first``: odd rounds run this tree first, so a
    second call with ``first=2`` continues the alternation); the medians of each tree's step, ratio, peak and
    host RSS, and every run's step and ratio."""
    runs: dict[str, list[dict]] = {name: [] for name in TREE_NAMES}
    for r in range(first - 1, first - 1 + rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            with tempfile.TemporaryDirectory() as tmp:
                runs[TREE_NAMES[i]].append(run_case(trees[i], case, tiny, Path(tmp)))
                step = runs[TREE_NAMES[i]][-1]["row"]["median_step_s"]
                wall = runs[TREE_NAMES[i]][-1]["wall_s"]
                print(f"{case_name} round {r + 1} {TREE_NAMES[i]}: {step:.3f} s (run took {wall:.0f} s)")
    row: dict = {"case": case_name, "method": case.method, "rounds": rounds, "first_round": first}
    for name, key in zip(TREE_NAMES, ("new", "old")):
        got = runs[name]
        row[f"{key}_step_s"] = statistics.median(g["row"]["median_step_s"] for g in got)
        row[f"{key}_vs_resident"] = statistics.median(
            g["row"]["median_step_s"] / g["resident"]["median_step_s"] for g in got
        )
        row[f"{key}_peak_reserved_gib"] = max(g["row"].get("peak_reserved_gib") or 0.0 for g in got)
        rss = [g["row"]["host_rss_gib"] for g in got if g["row"].get("host_rss_gib") is not None]
        row[f"{key}_host_rss_gib"] = max(rss) if rss else None
    row["new_vs_old"] = row["new_vs_resident"] / row["old_vs_resident"]
    # every run's compared row (its plan, copy rate, waits ...: what tells a slower run's cause), less its log
    row["runs"] = {
        name: [
            {
                "step_s": g["row"]["median_step_s"],
                "vs_resident": g["row"]["median_step_s"] / g["resident"]["median_step_s"],
                "resident_step_s": g["resident"]["median_step_s"],
                "row": {k: v for k, v in g["row"].items() if k != "plan_log"},
            }
            for g in got
        ]
        for name, got in runs.items()
    }
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the older tree (with benchmarks/ and utils/)")
    parser.add_argument("--baseline_label", default=None, help="what the baseline is, e.g. its commit")
    parser.add_argument("--cases", default="flux_budget8,sdxl_full_noclip", help=f"comma list of {','.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--first_round", type=int, default=1, help="number of the first round (2: the baseline runs first)"
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--name", default="engines")
    parser.add_argument("--results_dir", type=Path, default=None)
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    trees = (HERE.parent, args.baseline.resolve())
    rows = [compare(name, CASES[name], trees, args.rounds, args.tiny, args.first_round) for name in names]
    label = args.baseline_label or str(args.baseline)
    result = {
        "benchmark": "engines",
        "title": f"This engine against {label}",
        "description": (
            "each case run in both trees, alternating over the rounds; each run's ratio is to the all-resident "
            "step of its own process; medians over the rounds"
        ),
        "environment": machine.environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "tiny": args.tiny,
        "rows": rows,
        "notes": [f"Cases: {'; '.join(f'{n}: {command_line(CASES[n].script, list(CASES[n].argv))}' for n in names)}"],
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
    }
    write_result(result, args.name, args.results_dir or results_dir(args.tiny), plot_it=False, echo=True)
    return result


if __name__ == "__main__":
    main()
