"""benchmarks/bench_disk.py --tiny end to end on the CPU: the read bandwidth of each reader, and the tiny Flux
LoRA step at three host RAM budgets (all in RAM, then layers on disk), its JSON and Markdown."""

import json
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # builds the tiny Flux model and runs three arms
pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_disk  # noqa: E402
import report  # noqa: E402


def test_the_disk_benchmark_measures_bandwidth_and_each_budget(tmp_path):
    out = tmp_path / "results"
    argv = ["--tiny", "--steps", "1", "--warmup", "1", "--greedy_alone", "each", "--disk_dir", str(tmp_path)]
    argv += ["--ring", "3", "--ring_budgets", "each"]
    bench_disk.main([*argv, "--results_dir", str(out)])
    result = json.loads((out / "disk_flux.json").read_text())
    assert result["benchmark"] == "disk" and result["tiny"]
    # --greedy_alone each: every budget's arm again, the greedy alone choosing, after the others
    greedy = [row for row in result["rows"] if row["budget"].endswith(", greedy alone")]
    # --ring 3 --ring_budgets each: every budget's arm again with three staging buffers
    rings = [row for row in result["rows"] if row["budget"].endswith(", ring of 3")]
    result["rows"] = [row for row in result["rows"] if row not in greedy and row not in rings]
    assert [r["budget"] for r in rings] == [f"{r['budget']}, ring of 3" for r in result["rows"][1:]]
    assert all(r["staging_buffers"] == 3 for r in rings if r["layers_on_disk"])
    assert all(r["staging_buffers"] == bench_disk.RING_BUFFERS for r in result["rows"] if r["layers_on_disk"])
    assert bench_disk.build.RING_BUFFERS == bench_disk.disk_planning.RING_BUFFERS == 2  # restored after the arms
    assert [g["budget"] for g in greedy] == [f"{r['budget']}, greedy alone" for r in result["rows"][1:]]
    assert all(g["layers_on_disk"] > 0 for g in greedy) and any("greedy alone:" in n for n in result["notes"])
    assert bench_disk.disk_plan.spread_choice.__name__ == "spread_choice"  # restored after the arms
    readers = [r["reader"] for r in result["read_bandwidth"]]
    assert any("1 threads" in r for r in readers) and any("8 threads" in r for r in readers)
    assert all(r["gbps"] > 0 for r in result["read_bandwidth"] if "gbps" in r)
    all_in_ram, *budgets = result["rows"]
    assert all_in_ram["budget"] == "all" and all_in_ram["layers_on_disk"] == 0 and all_in_ram["read_gib_per_step"] == 0
    assert budgets[-1]["layers_on_disk"] > budgets[0]["layers_on_disk"] >= 0
    assert budgets[-1]["read_gib_per_step"] > 0 and budgets[-1]["disk_floor_s"] > 0
    assert all(row["peak_rss_gib"] > 0 for row in result["rows"])
    resident = result["resident"]["median_step_s"]  # every layer on the device: the two-stream floor's start
    for row in result["rows"]:
        assert row["vs_resident"] == row["median_step_s"] / resident and row["two_stream_floor_s"] >= resident
        assert row["floor_s"] == max(row["two_stream_floor_s"], row["disk_floor_s"])
    assert budgets[-1]["weights_in_gib_per_step"] > 0  # the streamed layers' copies are counted
    # after the warm-up step the engine reads the spilled layers ahead of their fetches; RSS while training is measured
    assert budgets[-1]["reads_ahead_taken_per_step"] > 0 and all_in_ram["reads_ahead_taken_per_step"] == 0
    # the reader's time in its reads, and their rate while it read (none without reads)
    assert budgets[-1]["reader_busy_s_per_step"] > 0 and budgets[-1]["read_gbps_while_reading"] > 0
    assert all_in_ram["reader_busy_s_per_step"] == 0 and all_in_ram["read_gbps_while_reading"] is None
    assert all(0 < row["training_peak_rss_gib"] <= row["peak_rss_gib"] for row in result["rows"])
    assert all_in_ram["disk_plan"] == [] and budgets[-1]["disk_plan"][0].startswith("DGLS disk plan: ")
    assert any("DGLS disk plan: " in note for note in result["notes"])  # the prediction beside the measured step
    assert (out / "disk_flux.md").read_text() == report.render(json.loads((out / "disk_flux.json").read_text()))
    assert list(tmp_path.iterdir()) == [out]  # the bandwidth file and the disk tier's files are gone


def test_the_disk_benchmark_with_a_vram_budget_times_the_settled_plan(tmp_path):
    """--vram_budget: the planner places the layers; each arm is timed once it settled, and its plan and the disk
    plan's lines (the start-up one, the settled one) are in the notes."""
    out = tmp_path / "results"
    argv = ["--tiny", "--vram_budget", "1", "--steps", "1", "--warmup", "1", "--disk_dir", str(tmp_path)]
    bench_disk.main([*argv, "--results_dir", str(out)])
    rows = json.loads((out / "disk_flux.json").read_text())["rows"]
    assert all(row["plan"] and row["plan"][0].startswith("DGLS plan (") for row in rows)
    assert rows[0]["disk_plan"] == [] and all(len(row["disk_plan"]) == 2 for row in rows[1:])
