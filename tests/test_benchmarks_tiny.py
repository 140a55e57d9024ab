"""The benchmarks' --tiny modes end to end on the CPU: each writes its JSON, Markdown (and plot) with
the rows its methods promise; the Markdown and the results index re-render from the JSONs alone.
With DGLS_DIFFUSION_PIPE set, diffusion-pipe's built-in block swap (its utils/offloading.py,
imported from the checkout) is measured too; without it that row says why."""

import importlib.util
import json
import os
import sys

import pytest
import torch
from conftest import ROOT

pytestmark = pytest.mark.slow  # every tiny benchmark end to end: about 30 s on 2 cores
pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fp8  # noqa: E402
import bench_full  # noqa: E402
import bench_host  # noqa: E402
import bench_models  # noqa: E402
import bench_overlap  # noqa: E402
import bench_planner  # noqa: E402
import bench_transfer  # noqa: E402
import report  # noqa: E402
from baselines import NaiveSwap  # noqa: E402

FILES = {"flux": "flux_dev", "sdxl": "sdxl", "wan": "wan"}
KINDS = {"resident", "dgls", "ab", "dp", "auto", "naive", "offload"}
TIMED = ("median_step_s", "steps", "step_times_s", "streamed_gib", "vs_resident")
TINY = ["--tiny", "--strict"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every tiny benchmark, writing into one folder (as they do into benchmarks/results/)."""
    out = tmp_path_factory.mktemp("results")
    for model in FILES:
        methods = ["--methods", ",".join(sorted(KINDS)), "--ab_rounds", "1", "--ab_steps", "2"]
        gib = ["--gib", "0.0001"] if model == "flux" else []  # A/B at a size the tiny model has
        bench_models.main(["--model", model, *TINY, *methods, *gib, "--results_dir", str(out)])
    bench_fp8.main(["--tiny", "--steps", "2", "--warmup", "1", "--results_dir", str(out)])
    bench_transfer.main(["--tiny", "--results_dir", str(out)])
    bench_overlap.main(["--tiny", "--rounds", "1", "--steps", "2", "--results_dir", str(out)])
    bench_planner.main(["--tiny", "--steps", "1", "--warmup", "0", "--rounds", "1", "--results_dir", str(out)])
    bench_host.main(["--tiny", "--rounds", "1", "--steps", "2", "--warmup", "1", "--results_dir", str(out)])
    bench_full.main(["--tiny", "--steps", "1", "--warmup", "0", "--results_dir", str(out)])
    return out


def load(results, name):
    return json.loads((results / f"{name}.json").read_text())


@pytest.mark.parametrize("model", list(FILES))
def test_a_model_benchmark_records_every_method(results, model):
    result = load(results, FILES[model])
    assert result["benchmark"] == "models" and result["model"] == model and result["tiny"]
    assert result["command"].startswith(f"python benchmarks/bench_models.py --model {model} --tiny")
    assert result["environment"]["torch"] == torch.__version__ and result["notes"]
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    by_kind = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    assert set(by_kind) == KINDS
    for r in rows:
        if "skipped" not in r:
            assert all(k in r for k in TIMED), (r["method"], [k for k in TIMED if k not in r])
            assert r["steps"] >= 2 and r["median_step_s"] > 0
    assert by_kind["resident"][0]["vs_resident"] == 1.0
    dgls = by_kind["dgls"]
    assert [r["method"].split(" of blocks")[0] for r in dgls] == [f"DGLS {p}%" for p in (0, 25, 50, 75, 100)]
    streamed = [r["streamed_gib"] for r in dgls]
    assert streamed == sorted(streamed) and streamed[0] == 0 and streamed[-1] > 0
    # (with fewer streamed layers than pool slots nothing is copied after the first step)
    assert dgls[0]["bytes_per_step"] == 0 and dgls[-1]["bytes_per_step"] > 0
    assert all(r["hit_rate"] <= 1 and "wait_ms" in r and "copy_gbps" in r for r in dgls)
    auto = {r["method"]: r for r in by_kind["auto"]}
    assert "vram_budget auto needs a CUDA device" in auto["DGLS vram_budget=auto"]["skipped"]
    fixed = [r for r in by_kind["auto"] if "skipped" not in r]
    assert len(fixed) == 1 and fixed[0]["plan_log"] and fixed[0]["planning_steps_s"] and fixed[0]["streamed_gib"]
    (offload,) = by_kind["offload"]  # every block streamed, their inputs sent home (KiB on the tiny models)
    assert offload["activations_home_gib"] > 0 and offload["streamed_gib"] == dgls[-1]["streamed_gib"]
    naive = by_kind["naive"][0]
    assert naive["steps"] >= 2 and naive["bytes_per_step"] > 0 and naive["streamed_gib"] > 0
    dp = by_kind["dp"]
    if model == "sdxl":
        assert [r["method"] for r in dp] == ["diffusion-pipe built-in"] and "no block swap for SDXL" in dp[0]["skipped"]
    elif os.environ.get("DGLS_DIFFUSION_PIPE"):
        assert dp and all("skipped" not in r for r in dp)
        for r in dp:
            assert r["streamed_gib"] > 0 and r["bytes_per_step"] > 0 and r["d2h_bytes_per_step"] > 0
            assert r["dp_groups"] and sum(g["swapped"] for g in r["dp_groups"]) > 0
    else:
        assert dp[0]["skipped"].startswith("DGLS_DIFFUSION_PIPE is not set")


def test_ab_alternates_resident_and_dgls_at_each_size(results):
    """Two placements (blocks_to_swap's and spread) per --gib size, each against its own resident steps."""
    ab = [r for r in load(results, "flux_dev")["rows"] if r["kind"] == "ab"]
    assert len(ab) == 2 and sum("spread" in r["method"] for r in ab) == 1
    for r in ab:
        assert r["steps"] == 2 and len(r["ab_resident_times_s"]) == 2 and r["streamed_gib"] > 0
        assert r["vs_resident"] == pytest.approx(r["median_step_s"] / r["ab_resident_s"])
    sdxl_ab = [r for r in load(results, "sdxl")["rows"] if r["kind"] == "ab"]
    assert [r["skipped"] for r in sdxl_ab] == ["no --gib to stream"]


@pytest.mark.parametrize("model", list(FILES))
def test_a_model_benchmark_writes_markdown_and_a_plot(results, model):
    result = load(results, FILES[model])
    md = (results / f"{FILES[model]}.md").read_text()
    assert md.startswith(f"{result['title']} on the CPU") and "TINY config" in md
    assert "| method | steps | streamed GiB | step (s) | vs resident |" in md and "floor (2x streamed)" in md
    for r in result["rows"]:
        assert r["method"] in md
    assert f"Command: `{result['command']}`" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (results / f"{FILES[model]}.png").stat().st_size > 0


def test_fp8_storage_rows_and_their_errors(results):
    rows = {r["method"].split(" (")[0]: r for r in load(results, "fp8")["rows"]}
    assert list(rows) == [
        "all-resident",
        "DGLS bf16 storage",
        "DGLS fp8 e4m3 storage",
        "DGLS fp8 e5m2 storage",
        "DGLS bf16 storage, pageable",
        "DGLS fp8 e4m3 storage, pageable",
    ]
    assert rows["DGLS bf16 storage"]["loss_rel_err"] == 0 and rows["DGLS bf16 storage"]["vs_bf16_storage"] == 1
    fp8 = rows["DGLS fp8 e4m3 storage"]
    assert 0 < fp8["block_rel_err_mean"] < 0.1 and fp8["bytes_per_step"] < rows["DGLS bf16 storage"]["bytes_per_step"]
    assert "| DGLS fp8 e5m2 storage" in (results / "fp8.md").read_text()


def test_transfer_rows(results):
    rows = load(results, "transfer")["rows"]
    assert [r["method"] for r in rows[:2]] == ["resident", "prefetch=1 threading=off batch_move=off"]
    assert len(rows) == 1 + 12 + 2 and all(r["bytes_per_step"] > 0 for r in rows[1:])


def test_host_time_is_measured_for_the_engine_only(results):
    rows = {r["method"]: r for r in load(results, "host")["rows"]}
    assert list(rows) == ["all-resident", "DGLS (this engine)"]
    assert rows["all-resident"]["host_ms"] is None and rows["all-resident"]["vs_resident"] == 1.0
    assert rows["DGLS (this engine)"]["host_ms"] > 0 and len(rows["DGLS (this engine)"]["step_times_s"]) == 2


def test_overlap_splits_the_step_per_arm(results):
    """Three arms, the same resident block uses compared across them."""
    result = load(results, "overlap")
    rows = {r["arm"]: r for r in result["rows"]}
    assert list(rows) == ["resident", "spread", "ends"]
    assert rows["resident"]["streamed_layers"] == 0 and rows["spread"]["streamed_layers"] > 0
    assert rows["ends"]["streamed_layers"] > 0 and rows["resident"]["vs_resident"] == 1.0
    assert result["shared_uses"] > 0
    assert all(r["shared_layers_ms"] > 0 and len(r["step_times_s"]) == 2 for r in rows.values())


def test_the_planner_benchmark_compares_auto_with_the_hand_grid(results):
    result = load(results, "planner")
    rows = result["rows"]
    assert rows[0]["method"] == "all-resident"
    autos = [r for r in rows if r["method"] == "auto"]
    assert len(autos) == 2 and all(r["trials"] and r["streamed"] > 0 for r in autos[:1])
    assert [b["budget_gib"] for b in result["budgets"]] == [r["budget_gib"] for r in autos]
    assert all(b["best_hand"] and b["auto_plan"] for b in result["budgets"])
    assert f"| {autos[0]['budget_gib']:g} |" in (results / "planner.md").read_text()


def test_the_planner_merge_keeps_the_budgets_it_does_not_measure(tmp_path):
    earlier = {"command": "first", "rows": [{"budget_gib": None}, {"budget_gib": 8.0}, {"budget_gib": 16.0}]}
    (tmp_path / "planner.json").write_text(json.dumps(earlier))

    class Args:
        merge, results_dir, name = True, tmp_path, "planner"

    assert bench_planner.earlier_result(Args, [16.0])["rows"] == [{"budget_gib": 8.0}]
    Args.merge = False
    assert bench_planner.earlier_result(Args, [16.0]) is None


def test_re_rendering_from_the_json_reproduces_every_page(results):
    """The JSON is the record: the Markdown pages and the index are rendered from it alone."""
    pages = {path.name: path.read_text() for path in results.glob("*.md")}
    assert set(pages) == {f"{name}.md" for name in report.load_results(results)} | {"README.md"}
    for path in results.glob("*.md"):
        path.write_text("stale")
    report.main(["--results_dir", str(results)])
    assert {path.name: path.read_text() for path in results.glob("*.md")} == pages


def test_the_index_has_a_section_per_result_file(results, tmp_path):
    index = (results / "README.md").read_text()
    names = sorted(path.stem for path in results.glob("*.json"))
    assert len(names) == 3 + 6  # three models, fp8, transfer, overlap, planner, host, full_sdxl (tiny runs write one)
    assert [line[3:] for line in index.splitlines() if line.startswith("## ")] == names
    for name in names:
        result = load(results, name)
        assert f"[{name}.json]({name}.json)" in index and result["command"] in index and result["title"] in index
    assert "![flux_dev: step time vs peak VRAM](flux_dev.png)" in index or not (results / "flux_dev.png").exists()
    # only the JSONs present: a folder with one result lists that one
    (tmp_path / "fp8.json").write_text((results / "fp8.json").read_text())
    report.main(["--results_dir", str(tmp_path), "--index"])
    assert [line for line in (tmp_path / "README.md").read_text().splitlines() if line.startswith("## ")] == ["## fp8"]


def test_no_method_starts_past_the_deadline(tmp_path):
    result = bench_models.main(
        ["--model", "wan", *TINY, "--methods", "resident,dgls", "--deadline_s", "0", "--results_dir", str(tmp_path)]
    )
    assert [r["kind"] for r in result["rows"]] == ["resident"] + ["dgls"] * 5
    assert all(r["skipped"] == "out of time (--deadline_s)" for r in result["rows"])


def test_overlap_use_spans_leave_out_the_loss_and_the_optimizer():
    """Repeated uses of a layer stay apart (forward, recompute, backward); the last forward use (the
    loss) and the step's last use (the optimizer) are not compared."""

    def use(ts, dur, layer, phase, step=2):
        return {"cat": "compute", "ts": ts, "dur": dur, "args": {"layer": layer, "phase": phase, "step": step}}

    events = [use(0, 1000, 0, "forward"), use(1000, 2000, 1, "forward"), use(3000, 9000, 2, "forward")]
    events += [use(12000, 3000, 1, "backward"), use(15000, 4000, 1, "backward"), use(19000, 8000, 0, "backward")]
    spans = bench_overlap.use_spans({"traceEvents": events + [{"cat": "wait", "dur": 5, "args": {"step": 2}}]})
    assert spans == {
        (0, "forward", 0): [1.0],
        (1, "forward", 0): [2.0],
        (1, "backward", 0): [3.0],
        (1, "backward", 1): [4.0],
    }


def test_the_naive_swap_keeps_a_recomputed_blocks_weights_until_its_backward_is_done():
    """A recompute saves some weights themselves (a conv's): moving them out at the recompute's
    forward hook broke SDXL's backward on the GPU. They go out when the next recompute starts."""
    layers = torch.nn.ModuleList(torch.nn.Conv2d(2, 2, 3, padding=1) for _ in range(3))
    for layer in layers:
        layer.weight.requires_grad_(False)  # frozen, streamed; the bias trains
    naive = NaiveSwap(list(layers), {0, 1, 2}, torch.device("cpu"), checkpointed=frozenset({0, 1, 2}))
    moves, move = [], naive.move

    def logged_move(block, params, inward):  # the real moves (on the CPU they move nothing)
        if (id(params) in naive.inside) != inward:
            moves.append((block, inward))
        move(block, params, inward)

    naive.move = logged_move
    for i, layer in enumerate(layers):  # the block's backward, in the same log
        layer.bias.register_hook(lambda grad, i=i: moves.append((i, "backward")))
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        h = torch.randn(1, 2, 4, 4)
        for layer in layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        h.pow(2).mean().backward()
        naive.take()
    forward = [(0, True), (0, False), (1, True), (1, False), (2, True), (2, False)]
    backward = [(i, step) for i in (2, 1, 0) for step in (True, "backward", False)]
    assert moves == forward + backward
    assert not naive.inside and not naive.runs
    naive.remove(list(layers), torch.device("cpu"))


def test_the_full_fine_tuning_benchmark_measures_every_method_in_its_own_process(results):
    result = load(results, "full_sdxl")
    assert result["benchmark"] == "full" and result["tiny"]
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == set(bench_full.METHODS)
    for name, row in rows.items():
        assert "error" not in row and row["median_step_s"] > 0, row
        assert ("host_update_s" in row) == ("compute_wait_share" in row) == name.startswith("dgls"), row
    assert rows["dgls-deepspeed"]["host_optimizer"] == "DeepSpeedCPUAdam"
    assert "on the training device" in rows["dgls-device"]["host_optimizer"]


def test_the_full_fine_tuning_benchmark_trains_flux_widths_at_a_chosen_depth(tmp_path):
    """``--model flux --flux_blocks D,S``: Flux's blocks cut to a depth the host's RAM holds; every weight trains
    in both methods, and the split runs without clipping (updates queued during backward)."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "2,3", "--methods", "resident,dgls-split", "--clip", "0"]
    bench_full.main([*argv, "--steps", "1", "--warmup", "1", "--results_dir", str(tmp_path)])
    result = load(tmp_path, "full_flux")
    assert "2 double + 3 single blocks" in result["title"] and "no gradient clipping" in result["description"]
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"resident", "dgls-split"}
    assert all("error" not in row and row["median_step_s"] > 0 for row in rows.values()), rows
    assert rows["resident"]["trained_params_b"] == rows["dgls-split"]["trained_params_b"] > 0


def test_the_full_fine_tuning_benchmark_keeps_the_layers_given_by_hand_on_the_gpu(tmp_path):
    """``--gpu_layers``: the DGLS methods keep exactly those layers resident (a budget's placement without its
    probe), stream the others, and say so in the title; with --vram_budget it is one parse error."""
    bench = full_bench()
    for layer in bench.layers:
        layer.to("cpu")
    _, swapper, _ = bench_full.dgls_step(bench, torch.device("cpu"), "torch_fused", 0.001, 1, 1.0, gpu_layers=[0, 2])
    try:
        assert sorted(set(range(len(bench.layers))) - set(swapper.streamed_layers)) == [0, 2]
    finally:
        swapper.remove()
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "dgls-torch_fused", "--gpu_layers", "0,2"]
    bench_full.main([*argv, "--steps", "1", "--warmup", "0", "--results_dir", str(tmp_path)])
    result = load(tmp_path, "full_flux")
    assert "DGLS keeps layers 0, 2 on the GPU (--gpu_layers)" in result["description"]
    assert all("error" not in row for row in result["rows"]), result["rows"]
    with pytest.raises(SystemExit):
        bench_full.parse(["--tiny", "--gpu_layers", "0", "--vram_budget", "3"])


def test_the_full_fine_tuning_benchmark_runs_sgd_without_state(tmp_path):
    """``--optimizer sgd``: SGD without momentum in every method (no optimizer state on the host)."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "resident,dgls-torch_fused"]
    bench_full.main([*argv, "--optimizer", "sgd", "--steps", "1", "--warmup", "0", "--results_dir", str(tmp_path)])
    result = load(tmp_path, "full_flux")
    assert "SGD without momentum" in result["description"]
    rows = {r["method"]: r for r in result["rows"]}
    assert all("error" not in row and row["median_step_s"] > 0 for row in rows.values()), rows
    assert rows["dgls-torch_fused"]["host_optimizer"] == "torch.optim.SGD"


def test_runs_of_each_optimizer_merge_into_one_table_of_host_ram(tmp_path):
    """``--merge``: one result of runs that differ only in ``--optimizer``, each row's method naming its type and the
    description none; runs of another shape are refused, with what differs."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "dgls-torch_fused", "--steps", "1"]
    for kind in ("adamw", "sgd"):
        bench_full.main([*argv, "--optimizer", kind, "--name", f"ram_{kind}", "--results_dir", str(tmp_path)])
    bench_full.main(["--merge", "ram_adamw,ram_sgd", "--name", "ram", "--results_dir", str(tmp_path)])
    result = load(tmp_path, "ram")
    methods = [r["method"] for r in result["rows"]]
    assert methods == ["dgls-torch_fused (AdamW)", "dgls-torch_fused (SGD without momentum)"]
    assert "the optimizer each row names" in result["description"] and "SGD" not in result["description"]
    assert all(r["host_rss_gib"] > 0 for r in result["rows"])
    assert "ram_sgd" in result["command"] and "optimizer" not in result
    assert (tmp_path / "ram.md").is_file()
    bench_full.main([*argv, "--flux_blocks", "1,2", "--name", "ram_deeper", "--results_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="differ only in --optimizer"):
        bench_full.main(["--merge", "ram_adamw,ram_deeper", "--name", "bad", "--results_dir", str(tmp_path)])
    sgd = load(tmp_path, "ram_sgd")
    for field, value in (
        ("environment", {**sgd["environment"], "gpu": "another"}),
        ("command", sgd["command"] + " --steps=9"),
    ):
        (tmp_path / "ram_other.json").write_text(json.dumps({**sgd, field: value}))
        with pytest.raises(SystemExit, match="on one machine: these differ"):
            bench_full.main(["--merge", "ram_adamw,ram_other", "--name", "bad", "--results_dir", str(tmp_path)])
    # results written before runs recorded their optimizer: its type from the command
    (tmp_path / "ram_old.json").write_text(json.dumps({k: v for k, v in sgd.items() if k != "optimizer"}))
    bench_full.main(["--merge", "ram_adamw, ram_old", "--name", "ram2", "--results_dir", str(tmp_path)])
    assert load(tmp_path, "ram2")["rows"][1]["method"] == "dgls-torch_fused (SGD without momentum)"
    with pytest.raises(SystemExit, match="--merge: no result named ram_none in"):
        bench_full.main(["--merge", "ram_adamw,ram_none", "--name", "bad", "--results_dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_full.parse(["--merge", "ram_adamw,ram_sgd"])  # no --name


def test_offload_rows_with_and_without_recompute_offload(tmp_path):
    """``--offload_recompute both --checkpoint_units on``: a row each; the recompute row sends more home (what
    the recomputes save, beside the block inputs) and records that it ran with it."""
    argv = ["--model", "wan", *TINY, "--methods", "offload", "--offload_recompute", "both", "--checkpoint_units", "on"]
    result = bench_models.main([*argv, "--strict", "--results_dir", str(tmp_path)])
    rows = {r["offload_recompute"]: r for r in result["rows"]}
    assert set(rows) == {False, True} and all(r["checkpoint_units"] for r in rows.values())
    assert "offload_recompute" in rows[True]["method"] and "offload_recompute" not in rows[False]["method"]
    assert rows[True]["activations_home_gib"] > rows[False]["activations_home_gib"] > 0


@pytest.mark.slow
def test_offload_rows_with_and_without_kept_piece_outputs(tmp_path):
    """``--keep_piece_outputs both --checkpoint_units both``: a row each with checkpoint_units, none without it (the
    option needs it); the kept outputs go home beside the block inputs, and every row reports its pinned host RAM."""
    argv = ["--model", "wan", *TINY, "--methods", "offload", "--keep_piece_outputs", "both", "--checkpoint_units"]
    result = bench_models.main([*argv, "both", "--strict", "--results_dir", str(tmp_path)])
    rows = {(r["checkpoint_units"], r["keep_piece_outputs"]): r for r in result["rows"]}
    assert set(rows) == {(False, False), (True, False), (True, True)}
    assert "keep_piece_outputs" in rows[True, True]["method"]
    assert rows[True, True]["activations_home_gib"] > rows[True, False]["activations_home_gib"] > 0
    assert all(r["pinned_gib"] >= 0 for r in rows.values())  # page-locked on CUDA only


def test_the_full_fine_tuning_benchmark_places_by_a_vram_budget(tmp_path):
    """``--vram_budget``: DGLS's layers placed by the planner (its plan fixed at step 1), the row naming the
    placement as the flags that give it without the probe."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "dgls-split", "--vram_budget", "0.02"]
    bench_full.main([*argv, "--steps", "1", "--warmup", "0", "--results_dir", str(tmp_path)])
    result = load(tmp_path, "full_flux")
    (row,) = result["rows"]
    assert "error" not in row and row["median_step_s"] > 0, row
    assert "--vram_budget 0.02" in result["description"] and "--prefetch" in row["placement"], row


def test_the_full_fine_tuning_benchmark_scales_the_loss_so_that_no_step_clips(tmp_path, capsys):
    """``--loss_scale``: the random model's norm times a small factor is under the clipping limit, as a fine-tune's
    usually is: DGLS keeps every update it speculated; each method's build and steps are echoed as they come; the
    methods whose loss it cannot scale are refused."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "resident,dgls-split", "--loss_scale"]
    bench_full.main([*argv, "0.001", "--steps", "2", "--warmup", "1", "--results_dir", str(tmp_path)])
    result = load(tmp_path, "full_flux")
    assert "clipped to norm 1 (the loss times 0.001)" in result["description"]
    dgls = next(row for row in result["rows"] if row["method"] == "dgls-split")
    assert dgls["grad_norm"] < 1 and " 0 redone" in dgls["speculation"] and "0 steps clipped" in dgls["speculation"]
    assert " 0 kept" not in dgls["speculation"], dgls["speculation"]
    err = capsys.readouterr().err
    assert "bench_full: dgls-split: untimed step 2 of 2 took" in err
    assert "bench_full: resident: timed step 2 of 2 ended" in err
    with pytest.raises(SystemExit):
        bench_full.parse(["--methods", "resident,zero2-offload", "--loss_scale", "0.5"])
    assert "drop zero2-offload" in capsys.readouterr().err


def test_the_full_fine_tuning_benchmark_reports_host_ram_for_an_8bit_optimizer_type(tmp_path):
    """``--optimizer AdamW8bit`` (any [optimizer] type DGLS trains): the resident method steps the type's class, DGLS
    its own class on the host (``dgls-auto``); each row has its peak RSS, and DGLS's its pinned bytes and the host
    optimizer state the RAM check counted, equal to what the host optimizers hold (the tiny shapes are measured on
    themselves)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (its 8-bit optimizers run on the CPU from 0.50)")
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "resident,dgls-auto"]
    argv += ["--optimizer", "AdamW8bit", "--steps", "1", "--warmup", "0"]
    bench_full.main([*argv, "--results_dir", str(tmp_path)])
    result = load(tmp_path, "full_flux")
    assert "[optimizer] type 'AdamW8bit'" in result["description"]
    rows = {r["method"]: r for r in result["rows"]}
    assert all("error" not in row and row["host_rss_peak_gib"] >= row["host_rss_gib"] > 0 for row in rows.values())
    dgls = rows["dgls-auto"]
    assert "bitsandbytes.optim.AdamW8bit" in dgls["host_optimizer"] and dgls["pinned_gib"] >= 0
    assert dgls["host_state_counted_gib"] == dgls["host_state_held_gib"] > 0


def test_the_full_fine_tuning_benchmark_refuses_a_type_dgls_does_not_train():
    with pytest.raises(SystemExit):
        bench_full.main(["--tiny", "--optimizer", "ScheduleFreeWrapper"])


@pytest.mark.parametrize(
    "method, line",
    [
        ("dgls-split+triton", "kernel_launch 'triton' picks the kernel of an own class stepped on the device"),
        ("dgls-device+cudaa", "kernel_launch must be one of cuda, triton"),
        ("dgls-split-foo", "a DGLS method is dgls-IMPL, dgls-IMPL-wait or dgls-IMPL-prevnorm"),
    ],
)
def test_the_full_fine_tuning_benchmark_checks_each_dgls_method_before_any_runs(method, line, capsys):
    with pytest.raises(SystemExit):
        bench_full.main(["--tiny", "--methods", f"resident,{method}"])
    assert f"--methods {method}: {line}" in capsys.readouterr().err


def test_each_rank_of_the_scaling_benchmark_gets_its_own_block_of_physical_cores(tmp_path):
    """--bind_cores: physical cores in (package, core) order, split into contiguous blocks, each with its sibling
    threads; on 2 sockets of 4 cores (8 threads each) and 4 ranks, ranks 0 and 1 on socket 0, 2 and 3 on socket 1."""
    import bench_scaling

    # Linux numbers the first thread of every core first, then their siblings: cpu c and c + 8 share a core
    topology = {cpu: (cpu % 8 // 4, cpu % 4) for cpu in range(16)}
    blocks = [bench_scaling.rank_cores(r, 4, topology) for r in range(4)]
    assert blocks == [([0, 1, 8, 9], 2), ([2, 3, 10, 11], 2), ([4, 5, 12, 13], 2), ([6, 7, 14, 15], 2)]
    assert bench_scaling.rank_cores(2, 3, {0: (0, 0), 1: (0, 1)}) == ([0], 1), "fewer cores than ranks: shared"
    with pytest.raises(SystemExit, match="--bind_cores binds the data-parallel rows' processes"):
        bench_scaling.main(["--model", "flux", "--tiny", "--bind_cores", "--layout", "pipeline"])
    argv = ["--model", "flux", "--tiny", "--strict", "--bind_cores", "--gpus", "2", "--results_dir", str(tmp_path)]
    result = bench_scaling.main(argv)
    (row,) = result["rows"]
    assert len(row["bound_cores"]) == 2 and min(row["bound_cores"]) >= 1 and "--bind_cores" in result["description"]


@pytest.mark.parametrize("model", ["flux", "sdxl_full"])
def test_the_scaling_benchmark_runs_one_and_two_processes_sharing_one_host_copy(tmp_path, model, monkeypatch):
    """bench_scaling.py --tiny: a job of one process, then one of two (gloo), each its own processes; a row each,
    the second's ratio to the first's rate, both processes' figures, and the one host copy shared by both."""
    import bench_scaling

    monkeypatch.setenv("DGLS_BENCH_LOGS", str(tmp_path / "logs"))  # as device_session.sh sets it

    result = bench_scaling.main(["--model", model, "--tiny", "--strict", "--results_dir", str(tmp_path)])
    assert result["benchmark"] == "scaling" and result["model"] == model
    one, two = result["rows"]
    assert one["gpus"] == 1 and two["gpus"] == 2 and one["vs_1gpu"] == 1.0
    assert two["vs_1gpu"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert len(two["copy_gbps"]) == len(two["streamed_layers"]) == 2 and two["sharing_processes"] == 2
    kept = sorted(path.name for path in (tmp_path / "logs").iterdir())  # every rank's log of both jobs, kept
    assert kept == [f"scaling_{model}_data_{n}gpu_rank{r}.log" for n, r in ((1, 0), (2, 0), (2, 1))]
    assert one["sharing_processes"] == 1 and two["host_copy_gib"] > 0  # (the placement is each run's planner's)
    assert two["streamed_layers"][0] == two["streamed_layers"][1], "one placement for both (planning/agreement.py)"
    # the gradient all-reduce timed on both processes (the LoRA's; the full fine-tune's resident params'), none alone
    assert one["allreduce_ms"] == [0.0] and len(two["allreduce_ms"]) == 2 and min(two["allreduce_ms"]) > 0
    assert two["allreduce_mb"] > 0 and "sdxl_full" not in result["description"]
    assert len(two["thread_cpu_ms"]) == 2 and min(one["thread_cpu_ms"] + two["thread_cpu_ms"]) > 0
    markdown = (tmp_path / f"scaling_{model}.md").read_text()
    assert "| GPUs | samples/s | vs 1 GPU |" in markdown and "thread CPU ms per GPU" in markdown
    assert report.render(json.loads((tmp_path / f"scaling_{model}.json").read_text())) == markdown
    # one GPU count per device command, joined afterwards: the same rows, ratios to the 1-GPU row again
    merged = bench_scaling.main(["--merge", f"scaling_{model}", "--name", "merged", "--results_dir", str(tmp_path)])
    assert [r["samples_per_s"] for r in merged["rows"]] == [one["samples_per_s"], two["samples_per_s"]]
    assert merged["rows"][1]["vs_1gpu"] == pytest.approx(two["vs_1gpu"]) and (tmp_path / "merged.md").exists()


def test_the_scaling_benchmark_writes_each_row_at_once(tmp_path, monkeypatch):
    """A device call's time limit stops the benchmark between GPU counts (last session's 2-stage job): the rows
    measured before it are in the result file already. The jobs are stand-ins (one record per rank)."""
    import bench_scaling

    def record(rank: int) -> dict:
        return dict(
            rank=rank, title="Tiny", step_times_s=[1.0], warmup_steps=1, peak_allocated_gib=1.0,
            peak_reserved_gib=1.0, copy_gbps=1.0, raw_h2d_gbps=1.0, wait_ms_per_step=0.0, bytes_per_step=1.0,
            pss_gib=1.0, rss_gib=1.0, host_copy_gib=1.0, sharing_processes=1, streamed_layers=1, shape="tiny",
            entries=2, layers=2,
        )  # fmt: skip

    def job(args, argv, gpus, name, layout):
        if gpus == 2:
            raise KeyboardInterrupt  # as the call's timeout ends it
        return [record(0)], ""

    monkeypatch.setattr(bench_scaling, "run_job", job)
    with pytest.raises(KeyboardInterrupt):
        bench_scaling.main(["--model", "flux", "--tiny", "--gpus", "1,2", "--results_dir", str(tmp_path)])
    written = json.loads((tmp_path / "scaling_flux.json").read_text())
    assert [row["gpus"] for row in written["rows"]] == [1] and written["rows"][0]["samples_per_s"] == 1.0


def test_a_scaling_job_stopped_at_its_timeout_says_so(tmp_path, monkeypatch):
    """A job past --timeout_s is killed; its row's error says that, and what rank 0 printed last (the 2-stage row
    on 2x H200 said a TCPStore error instead: what another rank printed as rank 0 was killed)."""
    import bench_scaling

    monkeypatch.setenv("DGLS_BENCH_LOGS", str(tmp_path / "logs"))
    argv = ["--model", "flux", "--tiny", "--gpus", "1", "--timeout_s", "1", "--results_dir", str(tmp_path)]
    (row,) = bench_scaling.main(argv)["rows"]
    assert row["error"].startswith("stopped after 1 s (--timeout_s); rank 0's last line: "), row


@pytest.mark.parametrize("model", ["flux", "wan", "flux_full"])
def test_the_scaling_benchmark_runs_one_model_in_one_and_two_pipeline_stages(tmp_path, model):
    """bench_scaling.py --tiny --layout pipeline: the model as one stage, then as two (gloo, a process each, through
    DeepSpeed's PipelineModule and train_batch): the stages hold the layer list between them, in order, each
    streaming some of its part from its own host copy; both jobs train the same model (every step's loss equal);
    a step trains its micro-batches, and the 2-stage row's ratio is to the 1-stage row of the same micro-batches.
    flux_full: every weight trained, each stage's streamed layers on the host (toml/two_gpus_full_flux_dev.toml)."""
    import bench_scaling

    argv = ["--model", model, "--tiny", "--strict", "--layout", "pipeline", "--results_dir", str(tmp_path)]
    result = bench_scaling.main(argv + ["--max_warmup", "3"])
    one, two = result["rows"]
    assert [(r["layout"], r["gpus"], r["micro_batches"]) for r in (one, two)] == [
        ("pipeline", 1, 2),
        ("pipeline", 2, 2),
    ]
    ((start, count),) = one["stage_layers"]
    (first, middle), (second, end) = two["stage_layers"]
    assert start == first == 0 and end == count and 0 < middle == second < count
    assert all(n > 0 for n in two["streamed_layers"]) and all(b > 0 for b in two["stage_bytes_per_step"])
    assert two["host_copy_gib"] == pytest.approx(sum(two["stage_host_copy_gib"])) and two["sharing_processes"] == 1
    for row in (one, two):
        assert row["samples_per_s"] == pytest.approx(2 / row["median_step_s"])
    assert two["vs_1gpu"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["bubble_bound"] == pytest.approx(4 / 3) and one["vs_1gpu"] == 1.0
    steps = min(len(one["losses"]), len(two["losses"]))
    assert steps >= 3 and two["losses"][:steps] == pytest.approx(one["losses"][:steps], rel=1e-4)
    assert len(set(one["losses"])) > 1, "it trains: the loss moves"
    if model == "flux_full":  # every weight, each stage's streamed layers on the host; one stage layer-major
        assert "full fine-tuning" in result["title"] and "[optimizer] (adamw_optimi" in result["description"]
        assert min(one["host_rss_peak_gib"] + two["host_rss_peak_gib"]) > 0
    markdown = (tmp_path / f"scaling_{model}.md").read_text()
    assert "| layout | GPUs | micro-batches | samples/s |" in markdown and "2 micro-batches of 1 per step" in markdown
    assert report.render(json.loads((tmp_path / f"scaling_{model}.json").read_text())) == markdown


def test_the_flux_full_fine_tune_scales_in_pipeline_stages_only(capsys):
    import bench_scaling

    with pytest.raises(SystemExit, match="pipeline rows only"):
        bench_scaling.main(["--model", "flux_full", "--tiny"])


def test_the_scaling_benchmark_runs_a_row_per_share_fetch_mode_side_by_side(tmp_path):
    """--share_fetch off,on: one 1-process row, then a row per mode of the 2 processes (gloo on the CPU): on, each
    copies half of every streamed layer and gathers the rest (utils/dgls/memory/fetch_share.py); the table says
    which row is which, and both train."""
    import bench_scaling

    argv = ["--model", "flux", "--tiny", "--strict", "--share_fetch", "off,on", "--results_dir", str(tmp_path)]
    result = bench_scaling.main(argv)
    one, off, on = result["rows"]
    assert (one["gpus"], off["gpus"], on["gpus"]) == (1, 2, 2) and "shared_fetch" not in one
    assert off["shared_fetch"] is False and on["shared_fetch"] is True
    assert off["method"] == "2 GPUs, share_fetch off" and on["method"] == "2 GPUs, share_fetch on"
    markdown = (tmp_path / "scaling_flux.md").read_text()
    assert "| shared fetches |" in markdown and "share_fetch on: each of the N processes copies 1/N" in markdown
    assert "data rows above 1 GPU with share_fetch off and on" in result["description"]
    with pytest.raises(SystemExit, match="'sometimes' is not auto, on or off"):
        bench_scaling.main(["--model", "flux", "--tiny", "--share_fetch", "on,sometimes"])


def test_one_backward_runs_a_stages_backward_once_for_all_it_sent_on(tmp_path):
    """--one_backward: the first of two Flux stages (it sends on the image and the text streams) copies fewer bytes
    a step where DeepSpeed runs a backward per output (0.19), never more; the last stage's are unchanged, and every
    step's loss is the same either way."""
    import bench_scaling
    import deepspeed
    from packaging.version import Version

    argv = ["--model", "flux", "--tiny", "--strict", "--layout", "pipeline", "--gpus", "2", "--max_warmup", "3"]
    rows = []
    for extra in ([], ["--one_backward"]):
        result = bench_scaling.main([*argv, *extra, "--results_dir", str(tmp_path / (extra or ["plain"])[0])])
        rows.append(result["rows"][0])
    plain, once = rows
    assert "--one_backward" in result["description"] and once["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert once["stage_bytes_per_step"][1] == plain["stage_bytes_per_step"][1]
    first_plain, first_once = plain["stage_bytes_per_step"][0], once["stage_bytes_per_step"][0]
    if Version(deepspeed.__version__) >= Version("0.19"):
        assert first_once < 0.8 * first_plain
    else:
        assert first_once <= first_plain


@pytest.mark.parametrize("model", ["flux", "wan"])
def test_a_stage_of_the_output_layer_alone_sends_a_gradient_back_for_every_floating_input(model):
    """The pipeline wrappers in bf16 (as on a GPU: the rotary tables stay float32): the first layer's floating
    outputs all take a gradient, and a stage holding only the output layer gives every floating input one (DeepSpeed
    asserts a gradient for each it sends back), though the layer reads two of them."""
    import flux
    import scaling_pipeline
    import wan

    bench = {"flux": flux, "wan": wan}[model].build(True, torch.device("cpu"), torch.bfloat16, None, on_meta=True)
    layers = scaling_pipeline.stage_layers(bench.layers)
    scaling_pipeline.give_weights(layers, 0, torch.device("cpu"), torch.bfloat16)
    sent = bench.inputs
    for layer in layers[:-1]:
        sent = layer(sent)
    dtypes = {t.dtype for t in sent}
    assert dtypes == {torch.bfloat16, torch.float32} and all(t.requires_grad for t in sent if t.is_floating_point())
    received = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in sent)  # as the last stage gets them
    torch.nn.functional.mse_loss(layers[-1](received).float(), bench.target.float()).backward()
    assert all(t.grad is not None for t in received if t.is_floating_point())


def fake_ranks(gpus: int, step_s: float, micro: int | None = None) -> list[dict]:
    """Records as a job's processes write them (pipeline ones with their micro-batches, stage and losses)."""
    ranks = []
    for rank in range(gpus):
        record = dict(step_times_s=[step_s] * 3, warmup_steps=1, peak_allocated_gib=1.0, peak_reserved_gib=1.0)
        record.update(copy_gbps=10.0, raw_h2d_gbps=20.0, wait_ms_per_step=0.0, bytes_per_step=2.0**30, pss_gib=2.0)
        record.update(rss_gib=2.0, host_copy_gib=1.0, sharing_processes=1 if micro else gpus, streamed_layers=3)
        if micro:
            record.update(micro_batches=micro, stage_layers=[rank * 4, rank * 4 + 4], losses=[1.0])
        ranks.append(record)
    return ranks


def test_the_scaling_merge_keeps_each_layouts_rows_against_its_own_first_row(tmp_path):
    """--merge of a data-parallel result and a pipeline one: every row names its layout; each layout's ratios are to
    its own 1-GPU row; a pipeline row short of N x names the bubble's bound (M micro-batches over N stages)."""
    import bench_scaling

    args = bench_scaling.parser().parse_args(["--layout", "data,pipeline"])
    data = [bench_scaling.row_of(1, fake_ranks(1, 1.0), None)]
    data.append(bench_scaling.row_of(2, fake_ranks(2, 1.0), data[0]))
    pipe = [bench_scaling.labelled(args, "pipeline", bench_scaling.row_of(1, fake_ranks(1, 4.0, 4), None))]
    pipe.append(bench_scaling.labelled(args, "pipeline", bench_scaling.row_of(2, fake_ranks(2, 2.5, 4), pipe[0])))
    assert "layout" not in data[0] and pipe[1]["vs_1gpu"] == pytest.approx(1.6)
    assert "bubble" in pipe[1]["cap"] and "1.60x at most" in pipe[1]["cap"] and pipe[1]["host_copy_gib"] == 2.0
    once = bench_scaling.parser().parse_args(["--layout", "pipeline", "--one_backward"])
    alone = bench_scaling.labelled(once, "pipeline", bench_scaling.row_of(2, fake_ranks(2, 2.0, 4), None))
    assert alone["vs_1gpu"] == 1.0 and alone["layout"] == "pipeline, one backward"
    for name, rows in (("dp", data), ("pp", pipe), ("once", [alone])):
        part = dict(benchmark="scaling", model="flux", title="t", description=name, environment={}, tiny=True)
        report.write_result(dict(part, command=name, notes=[name], rows=rows), name, tmp_path)
    merged = bench_scaling.main(["--merge", "pp,dp,once", "--name", "both", "--results_dir", str(tmp_path)])
    layouts = [(r["layout"], r["gpus"], round(r["vs_1gpu"], 3)) for r in merged["rows"]]
    assert layouts == [
        ("data parallel", 1, 1.0),
        ("data parallel", 2, 2.0),
        ("pipeline", 1, 1.0),
        ("pipeline", 2, 1.6),
        ("pipeline, one backward", 2, 2.0),  # against the 1-stage row: one stage runs the same either way
    ]
    assert (
        merged["notes"] == ["pp", "dp", "once"]
        and "| layout | GPUs | micro-batches |" in (tmp_path / "both.md").read_text()
    )


def test_the_scaling_benchmark_refuses_pipeline_rows_of_the_data_parallel_full_fine_tune():
    """sdxl_full is the data-parallel full fine-tune; the full fine-tune in stages is flux_full's."""
    import bench_scaling

    with pytest.raises(SystemExit, match="pipeline rows are of the models flux, wan, flux_full"):
        bench_scaling.main(["--model", "sdxl_full", "--tiny", "--layout", "pipeline"])


def test_the_accumulation_rows_copy_each_streamed_layer_once_a_direction_whatever_the_micro_batches(tmp_path):
    result = bench_models.main(
        ["--model", "flux", *TINY, "--methods", "accum", "--gib", "0.001", "--prefetch", "1", "--accumulation", "1,2"]
        + ["--results_dir", str(tmp_path)]
    )
    rows = {(r["micro_batches"], r["layer_major"], "DGLS" in r["method"]): r for r in result["rows"]}
    assert len(rows) == 8 and all("per_sample_s" in r and "vs_resident" in r for r in rows.values())
    copied = {key[:2]: r["bytes_per_step"] for key, r in rows.items() if key[2]}
    assert copied[(1, False)] > 0 and copied[(2, True)] == copied[(1, True)] == copied[(1, False)]
    assert copied[(2, False)] > 1.5 * copied[(1, False)]
    assert rows[(2, True, False)]["reference_s"] == rows[(2, False, False)]["median_step_s"]


def test_accumulation_ways_keeps_the_resident_rows_both_ways_and_the_dgls_rows_one_way(tmp_path):
    result = bench_models.main(
        ["--model", "flux", *TINY, "--methods", "accum", "--gib", "0.001", "--accumulation", "2"]
        + ["--accumulation_ways", "layer-major", "--results_dir", str(tmp_path), "--steps", "1", "--warmup", "0"]
    )
    ways = sorted((("DGLS" in r["method"]), r["layer_major"]) for r in result["rows"])
    assert ways == [(False, False), (False, True), (True, True)]


def test_accumulation_ab_alternates_resident_layer_major_and_one_after_another_steps(tmp_path):
    """--accumulation_ab: one more row, layer-major steps timed alternating with one-after-another ones; its 'vs
    resident' is against those of the same rounds."""
    result = bench_models.main(
        ["--model", "flux", *TINY, "--methods", "accum", "--gib", "", "--accumulation", "2", "--accumulation_ab"]
        + ["--results_dir", str(tmp_path), "--steps", "3", "--warmup", "1"]
    )
    (ab,) = [r for r in result["rows"] if r["method"].startswith("A/B")]
    assert ab["layer_major"] and len(ab["step_times_s"]) == len(ab["ab_resident_times_s"]) == 3
    assert ab["vs_resident"] == ab["median_step_s"] / ab["ab_resident_s"]


def test_the_accumulation_rows_write_a_profile_of_one_step_per_dgls_row(tmp_path):
    """--profile_dir: each DGLS accum row leaves the trace of one step after its timed ones (a pass per micro-batch
    one after another, one pass layer-major), its summary in the row and in the Markdown; resident rows none."""
    traces = tmp_path / "traces"
    result = bench_models.main(
        ["--model", "flux", *TINY, "--methods", "accum", "--gib", "0.001", "--prefetch", "1", "--accumulation", "2"]
        + ["--profile_dir", str(traces), "--results_dir", str(tmp_path), "--name", "profiled"]
    )
    rows = [r for r in result["rows"] if "DGLS" in r["method"]]
    assert len(rows) == 2 and all("profile" not in r for r in result["rows"] if "DGLS" not in r["method"])
    for row in rows:
        trace = json.loads(open(row["profile"]).read())
        steps = trace["otherData"]["steps"]
        assert len(steps) == (1 if row["layer_major"] else 2) and steps[0] > row["steps"]  # after the timed steps
        assert list(row["profile_summary"]) == [str(s) for s in steps]
        assert sum(e.get("cat") == "compute" for e in trace["traceEvents"]) > 0
        assert "activation_wait_ms" in row
    assert sorted(p.name for p in traces.glob("*.json")) == sorted(
        p.name for p in (traces / r["profile"].split("/")[-1] for r in rows)
    )
    markdown = (tmp_path / "profiled.md").read_text()
    assert markdown.count("profiled step after the timed ones") == 2
    assert report.render(json.loads((tmp_path / "profiled.json").read_text())) == markdown


# ---------------------------------------------------------------- bench_full: accumulation and diffusion-pipe's ways
def full_bench(depth=(1, 1)):
    """The tiny Flux-width layers bench_full trains (fp32 on the CPU), every weight trainable."""
    cpu = torch.device("cpu")
    return bench_full.fresh_bench(True, cpu, torch.float32, cpu, "flux", depth)


def full_weights(bench) -> list[torch.Tensor]:
    return [p.detach().clone() for layer in bench.layers for p in layer.parameters()]


def dgls_full_run(accumulation, layer_major, steps=2, clip=1.0):
    """bench_full's DGLS step (torch's fused AdamW on the host, every layer streamed): the weights after ``steps``
    steps and the bytes copied in each direction."""
    import full_methods

    bench = full_bench()
    for layer in bench.layers:
        layer.to("cpu")
    step, swapper, _ = bench_full.dgls_step(
        bench, torch.device("cpu"), "torch_fused", 0.001, 1, clip, accumulation=accumulation, layer_major=layer_major
    )
    counter = full_methods.CopyCounter()
    swapper.add_listener(counter)
    try:
        for _ in range(steps):
            step()
    finally:
        swapper.remove()  # the trained weights back in the layers
    return full_weights(bench), counter.take()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_full_benchmarks_layer_major_dgls_step_equals_micro_batches_one_after_another(clip):
    """--accumulation 4: the layer-major step trains the same fp32 weights as 4 micro-batches one after another
    (bitwise: utils/dgls/engine/layer_major.py), copies each streamed layer in once and each gradient home once,
    where one after another copies 4 times as much."""
    seq, seq_copied = dgls_full_run(4, False, clip=clip)
    major, major_copied = dgls_full_run(4, True, clip=clip)
    one, one_copied = dgls_full_run(1, True, clip=clip)
    assert all(torch.equal(a, b) for a, b in zip(seq, major))
    assert not any(torch.equal(a, b) for a, b in zip(seq, full_weights(full_bench())))  # every weight trained
    assert major_copied == one_copied and major_copied["gradients home"] > 0 and major_copied["weights in"] > 0
    assert seq_copied["gradients home"] == 4 * major_copied["gradients home"]
    assert seq_copied["weights in"] >= 3 * major_copied["weights in"]


def test_the_full_benchmarks_resident_step_is_the_same_with_either_schedule():
    runs = {}
    for layer_major in (False, True):
        bench = full_bench()
        step = bench_full.resident_step(bench, 1.0, "adamw", accumulation=3, layer_major=layer_major)
        for _ in range(2):
            step()
        runs[layer_major] = full_weights(bench)
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


@pytest.mark.parametrize("kahan", [False, True], ids=["fallback", "kahan"])
def test_dp_recipe_steps_every_param_in_its_gradient_hook_each_micro_batch(kahan):
    """diffusion-pipe's gradient_release: an optimizer per param (betas ** (1 / N)), stepped and zeroed as its
    gradient is accumulated, every micro-batch: the same weights as stepping each param after each micro-batch's
    backward; no gradient is left on the params. Without a checkout bitsandbytes' AdamW8bit runs; with one
    (DGLS_DIFFUSION_PIPE) its AdamW8bitKahan, on bitsandbytes 0.50 with the two config keys it dropped restored."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (dp-recipe's AdamW8bit)")
    import bitsandbytes
    import full_methods

    checkout = os.environ.get("DGLS_DIFFUSION_PIPE") if kahan else "/nonexistent"
    if kahan and not checkout:
        pytest.skip("DGLS_DIFFUSION_PIPE is not set (a diffusion-pipe checkout, for its AdamW8bitKahan)")
    hyper = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
    cpu = torch.device("cpu")
    bench = full_bench()
    step, figures = full_methods.dp_recipe_step(bench, cpu, 2, checkout, hyper)
    if kahan:
        assert figures["optimizer"].startswith("diffusion-pipe's optimizers.adamw_8bit.AdamW8bitKahan")
        klass, _ = full_methods.kahan_class(checkout)
        if "old defaults" in figures["optimizer"]:
            klass = full_methods.bnb_050_compatible(klass)
    else:
        assert "bitsandbytes.optim.AdamW8bit, gradient_release (fallback from adamw8bitkahan" in figures["optimizer"]
        klass = bitsandbytes.optim.AdamW8bit
    assert figures["optimizer_steps_per_step"] == 2 and figures["clipping"].startswith("none")
    before = full_weights(bench)
    for _ in range(2):
        step()
    got = full_weights(bench)
    assert all(p.grad is None for layer in bench.layers for p in layer.parameters())

    reference = full_bench()
    params = [p for layer in reference.layers for p in layer.parameters()]
    betas = tuple(b ** (1 / 2) for b in hyper["betas"])
    optimizers = [klass([p], lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.01) for p in params]
    for _ in range(2 * 2):
        full_methods.forward_backward(reference, 1 / 2)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(got, full_weights(reference)))
    assert not any(torch.equal(a, b) for a, b in zip(got, before) if a.numel() > 1)


def test_diffusion_pipes_ways_say_why_they_cannot_run_here(monkeypatch):
    """torchao-offload needs torchao and CUDA, dp-recipe bitsandbytes: a row that cannot run says which is missing
    (the rows are measured in-process here, each library hidden in turn)."""
    args = bench_full.parse(["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--steps", "1", "--warmup", "0"])
    cpu = torch.device("cpu")
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    torchao = bench_full.measure("torchao-offload", args, cpu, torch.float32)
    assert "needs torchao, which is not installed here" in torchao["skipped"], torchao
    recipe = bench_full.measure("dp-recipe", args, cpu, torch.float32)
    assert "needs bitsandbytes, which is not installed here" in recipe["skipped"], recipe
    monkeypatch.delitem(sys.modules, "torchao")
    if importlib.util.find_spec("torchao") is not None and not torch.cuda.is_available():
        row = bench_full.measure("torchao-offload", args, cpu, torch.float32)
        assert "runs on CUDA (or XPU) only" in row["skipped"], row


def test_the_full_benchmark_compares_each_schedule_of_micro_batches_in_one_run(tmp_path):
    """--accumulation 2 --layer_major both: resident and DGLS a row each way (their own processes), the others once;
    every row records its micro-batches, schedule, per-sample time, RSS and pinned bytes; DGLS's rows the bytes copied
    each way, halved layer-major; 'vs resident' against all-resident one after another; the table shows them."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "resident,dgls-torch_fused,dp-recipe"]
    argv += ["--accumulation", "2", "--layer_major", "both", "--steps", "2", "--warmup", "0", "--clip", "0"]
    result = bench_full.main([*argv, "--results_dir", str(tmp_path)])
    rows = {(r["method"], r["layer_major"]): r for r in result["rows"]}
    assert list(rows) == [
        ("resident", False),
        ("resident", True),
        ("dgls-torch_fused", False),
        ("dgls-torch_fused", True),
        ("dp-recipe", False),
    ]
    recipe = rows.pop(("dp-recipe", False))
    if importlib.util.find_spec("bitsandbytes") is None:
        assert "needs bitsandbytes" in recipe["skipped"]
    else:
        rows[("dp-recipe", False)] = recipe
    for r in rows.values():
        assert "error" not in r and "skipped" not in r, r
        assert r["micro_batches"] == 2 and r["per_sample_s"] == pytest.approx(r["median_step_s"] / 2)
        assert r["host_rss_peak_gib"] >= r["host_rss_gib"] > 0 and r["pinned_gib"] >= 0
    assert rows[("resident", False)]["vs_resident"] == 1.0
    seq, major = rows[("dgls-torch_fused", False)], rows[("dgls-torch_fused", True)]
    for direction in ("weights in", "gradients home"):
        assert seq["copied_gib_per_step"][direction] == pytest.approx(2 * major["copied_gib_per_step"][direction])
    markdown = (tmp_path / "full_flux.md").read_text()
    assert "| micro-batches | layer-major | step (s) | per sample (s) |" in markdown
    assert "copied GiB/step (to device / home)" in markdown and "one after another and layer-major" in markdown
    assert report.render(json.loads((tmp_path / "full_flux.json").read_text())) == markdown


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torchao_offload_and_dp_recipe_train_on_cuda(tmp_path):
    """The device's smoke test of diffusion-pipe's two ways (tiny Flux widths in bf16): each runs its steps where its
    library is installed, torchao's copying every offloaded gradient home each micro-batch and the params back once."""
    argv = ["--tiny", "--model", "flux", "--flux_blocks", "1,1", "--methods", "resident,torchao-offload,dp-recipe"]
    result = bench_full.main(
        [*argv, "--accumulation", "2", "--steps", "2", "--warmup", "1", "--results_dir", str(tmp_path)]
    )
    rows = {r["method"]: r for r in result["rows"]}
    for name, library in (("torchao-offload", "torchao"), ("dp-recipe", "bitsandbytes")):
        if importlib.util.find_spec(library) is None:
            assert f"needs {library}" in rows[name]["skipped"]
            continue
        assert "error" not in rows[name] and "skipped" not in rows[name], rows[name]
        assert rows[name]["peak_reserved_gib"] >= rows[name]["peak_allocated_gib"] > 0
    if "copied_gib_per_step" in rows["torchao-offload"]:
        copied = rows["torchao-offload"]["copied_gib_per_step"]
        assert copied["grads home"] == pytest.approx(2 * copied["params in"]) and copied["params in"] > 0


def test_accumulation_units_both_gives_a_budget_row_per_unit_size_choice(tmp_path):
    """--accumulation_units both: a layer-major vram_budget row with swap units sized for its micro-batches and one
    with them sized for one (the size before), each saying which (utils/dgls/planning/unit_choice.py)."""
    result = bench_models.main(
        ["--model", "flux", *TINY, "--methods", "accum", "--gib", "", "--accumulation", "2", "--accumulation_budgets"]
        + ["--budgets", "1", "--accumulation_ways", "layer-major", "--accumulation_units", "both"]
        + ["--results_dir", str(tmp_path), "--steps", "1", "--warmup", "0"]
    )
    rows = [r for r in result["rows"] if "DGLS" in r["method"]]
    assert sorted(r["units_sized_for"] for r in rows) == [1, 2] and all("unit_mib" in r for r in rows)
    assert [r["method"].endswith("units sized for 1 micro-batch") for r in rows] == [True, False]
    # the builder was told: its start-up line for 2 layer-major micro-batches (the row records only the argument)
    told = [any("a step runs 2 micro-batches layer-major" in line for line in r["plan_log"]) for r in rows]
    assert told == [False, True], [r["plan_log"] for r in rows]


def test_the_wan_recipe_jobs_run_with_the_allocator_setting_its_config_sets(monkeypatch):
    """toml/wan_lora_long_video.toml's command line sets expandable segments; without them its 8 GiB cap ran out on
    the allocator's unused reserved blocks (2x H200). Other jobs, a budget, or the user's own setting: untouched."""
    import bench_scaling

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    args = bench_scaling.parser().parse_args(["--model", "wan"])
    assert bench_scaling.job_environment(args)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for other in (["--model", "flux"], ["--model", "wan", "--vram_budget", "8"], ["--model", "wan", "--tiny"]):
        assert "PYTORCH_CUDA_ALLOC_CONF" not in bench_scaling.job_environment(bench_scaling.parser().parse_args(other))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert bench_scaling.job_environment(args)["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native"


def test_a_pipeline_row_short_of_its_bubble_bound_names_the_stages_not_an_all_reduce():
    """Pipeline rows have no all-reduce of their own timed: their cause is the bubble, or the stages and the sends
    between them (copies kept pace), never the data-parallel rows' all-reduce words."""
    import bench_scaling

    def row(gpus: int, step: float) -> dict:
        ranks = [
            {
                "micro_batches": 4,
                "warmup_steps": 1,
                "step_times_s": [step],
                "peak_allocated_gib": 1.0,
                "peak_reserved_gib": 1.0,
                "copy_gbps": 50.0,
                "raw_h2d_gbps": 50.0,
                "wait_ms_per_step": 0.0,
                "bytes_per_step": 1.0,
                "pss_gib": 1.0,
                "rss_gib": 1.0,
                "host_copy_gib": 1.0,
                "sharing_processes": 1,
                "streamed_layers": 3,
                "stage_layers": [0, 1],
                "losses": [1.0],
            }
            for _ in range(gpus)
        ]
        return ranks

    one = bench_scaling.row_of(1, row(1, 4.0), None)
    two = bench_scaling.row_of(2, row(2, 4.0), one)  # no faster at all: far short of the bubble's 1.6x
    assert "allreduce_ms" not in two and "all-reduce" not in two["cap"]
    assert "bubble" in two["cap"] and "unequal stages, or the sends between them" in two["cap"]


def test_the_scaling_cap_names_where_a_data_parallel_step_grew():
    """A 2-GPU row short of 2x: time after the all-reduce (a full fine-tune's updates and barrier) or the forward and
    backward (contention), from its before / all-reduce / step times (the 2x H200 rows of SDXL and Flux)."""
    import bench_scaling

    base = dict(gpus=1, median_step_s=1.276, raw_h2d_gbps=[55.1], wait_ms_per_step=[0.2], copy_gbps=[54.5])
    sdxl = dict(base, gpus=2, median_step_s=1.683, raw_h2d_gbps=[50.5] * 2, wait_ms_per_step=[0.2] * 2)
    sdxl.update(efficiency=0.76, allreduce_ms=[7.0, 28.0], before_allreduce_ms=[923.0, 982.0], copy_gbps=[53.0] * 2)
    assert bench_scaling.cap_of(sdxl, base).startswith("after the all-reduce: 684 ms a step")
    flux_base = dict(base, median_step_s=1.072, copy_gbps=[54.1])
    flux = dict(sdxl, median_step_s=1.230, before_allreduce_ms=[1175.0, 1165.0], allreduce_ms=[16.0, 31.0])
    flux["copy_gbps"] = [52.5, 53.0]
    cap = bench_scaling.cap_of(flux, flux_base)
    assert cap.startswith("contention in the forward and backward: the slowest rank's took 1175 ms"), cap
    assert "one GPU's whole step of 1072 ms (its copies at 98%" in cap, cap
