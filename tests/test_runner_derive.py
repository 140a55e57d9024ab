"""benchmarks/runner.py's ``derive`` on rows measured on a GPU (a copy bandwidth known): an A/B run has no
all-resident row of its own, so its floors use the resident steps of its own rounds (the device run of
``bench_engines.py --cases=flux_ab_spread20`` once failed there with a None)."""

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import runner  # noqa: E402


def test_an_ab_run_without_a_resident_row_gets_its_floors_from_its_own_resident_steps():
    row = {"kind": "ab", "median_step_s": 1.0, "ab_resident_s": 0.8, "bytes_per_step": 40e9, "streamed_gib": 20.0}
    result = {"rows": [row], "pinned_h2d_gbps": 50.0}
    runner.derive(result)
    assert row["vs_resident"] == 1.0 / 0.8
    assert row["floor_s"] == 0.8  # 40 GB at 50 GB/s is 0.8 s too
    assert row["floor_2x_s"] > 0.8  # 2 x 20 GiB is more than 40 GB


def test_rows_with_a_resident_row_keep_it_as_their_floor():
    rows = [{"kind": "resident", "median_step_s": 0.5}, {"kind": "dgls", "median_step_s": 0.6, "bytes_per_step": 1e9}]
    runner.derive({"rows": rows, "pinned_h2d_gbps": 50.0})
    assert rows[1]["floor_s"] == 0.5 and rows[1]["vs_resident"] == 0.6 / 0.5
