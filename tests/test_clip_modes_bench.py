"""benchmarks/clip_modes.py at a tiny size: it writes its JSON and Markdown with a row per optimizer and limit; the
two modes' curves agree until step 2's update (step 1 is exact in both) and part where steps clip."""

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import clip_modes  # noqa: E402


def test_the_loss_curve_benchmark_runs_tiny(tmp_path):
    args = ["--tiny", "--steps", "12", "--optimizers", "adamw", "--results_dir", str(tmp_path)]
    clip_modes.main(args)
    result = json.loads((tmp_path / "clip_modes.json").read_text())
    assert result["benchmark"] == "clip_modes" and result["tiny"] and result["steps"] == 12
    assert [r["method"] for r in result["rows"]] == ["adamw, clips most steps", "adamw, clips rarely"]
    most = result["rows"][0]
    exact, delayed = most["losses"]["exact"], most["losses"]["previous_norm"]
    assert len(exact) == len(delayed) == 12
    assert exact[:2] == delayed[:2]  # step 1's update is exact clipping in both: step 2's loss is the same
    assert exact != delayed and most["clipped_share"] > 0.5 and most["weights_apart_rel"] > 0
    assert "previous_norm" in (tmp_path / "clip_modes.md").read_text()
