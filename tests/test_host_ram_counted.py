"""benchmarks/host_ram_counted.py: the host RAM a full fine-tune's streamed layers take, counted per type."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("diffusers")
pytestmark = pytest.mark.slow  # a benchmark's test, as tests/test_benchmarks_tiny.py's (diffusers' model classes)

import host_ram_counted  # noqa: E402


def test_the_counted_parts_follow_each_types_state_and_a_refused_type_is_a_row_with_its_line(tmp_path):
    result = host_ram_counted.main(
        ["--tiny", "--optimizers", "adamw,sgd,NoSuchOptimizer", "--clip", "0", "--results_dir", str(tmp_path)]
    )
    rows = {row["method"]: row for row in result["rows"]}
    adamw, sgd = rows["adamw"], rows["sgd"]
    assert adamw["masters_gib"] > 0
    # bf16 packed copies and landings: half the fp32 masters; AdamW two fp32 moments, SGD with momentum one
    assert adamw["packed_gib"] == pytest.approx(adamw["masters_gib"] / 2, rel=0.05)
    assert adamw["optimizer_gib"] == pytest.approx(2 * adamw["masters_gib"])
    assert sgd["optimizer_gib"] == pytest.approx(sgd["masters_gib"])
    parts = ("packed_gib", "masters_gib", "gradients_gib", "optimizer_gib")
    assert adamw["total_gib"] == pytest.approx(sum(adamw[k] for k in parts))
    assert adamw["spares_wanted_gib"] == 0  # no clipping: nothing speculates
    assert "NoSuchOptimizer" in rows["NoSuchOptimizer"]["note"]
    assert (tmp_path / "host_ram_flux.md").read_text().count("\n|") >= 4
