"""Result files: NAME.json (every figure), NAME.md (its table), NAME.png (model benchmarks) and README.md.

The JSON is the record. The Markdown, the plot and the results index (README.md beside them) are
rendered from the JSONs, so they can be rewritten at any time and are never edited by hand. The index
of benchmarks/results/ also carries benchmarks/findings.md, the hand-written findings across results
(each line quotes the result it links; tests/test_readme.py checks the figures). A result
carries its own words, written by the benchmark that measured it: ``title``, ``description`` (what
was measured), ``environment`` (where), ``command`` (what produced it) and ``notes`` (how to read
it). This module only lays them out around the table of the result's ``benchmark`` (the script:
models, fp8, planner, overlap, transfer, host, full, disk). It imports no torch, so re-rendering is quick.

    python benchmarks/report.py           # rewrite every NAME.md, NAME.png and README.md from the JSONs
    python benchmarks/report.py --index   # only README.md
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from units import GiB

RESULTS = Path(__file__).resolve().parent / "results"
FINDINGS = Path(__file__).resolve().parent / "findings.md"  # for RESULTS' index only
INDEX = "README.md"


def results_dir(tiny: bool) -> Path:
    """Where a run writes: results/, or results/tiny/ (git-ignored) for a --tiny smoke run."""
    return RESULTS / "tiny" if tiny else RESULTS


def command_line(script: str, argv: list[str]) -> str:
    """The command that runs ``script`` (a benchmarks/ file) with ``argv``, for the result to record."""
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *argv])


# ---------------------------------------------------------------- tables
Cell = Callable[[dict, dict], str]  # (row, result) -> the cell's text


@dataclass(frozen=True)
class Table:
    """The columns of one benchmark's table, and which of its records are the table's rows."""

    columns: tuple[tuple[str, Cell], ...]
    rows: Callable[[dict], list[dict]] = lambda result: result["rows"]
    optional: tuple[str, ...] = ()  # headers of columns shown only when some row has a value there


def _f(value, fmt: str, suffix: str = "") -> str:
    """``value`` formatted, or "-" where it was not measured."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt) + suffix


def _key(key: str, fmt: str, suffix: str = "", scale: float = 1.0) -> Cell:
    def cell(row: dict, _result: dict) -> str:
        value = row.get(key)
        return _f(value * scale if isinstance(value, (int, float)) else value, fmt, suffix)

    return cell


def _state_counted_held(row: dict, _result: dict) -> str:
    """Full fine-tuning: the host optimizer state the RAM check counted, and what the optimizers held."""
    if "host_state_counted_gib" not in row:
        return "-"
    return f"{_f(row['host_state_counted_gib'], '.3g')} / {_f(row.get('host_state_held_gib'), '.3g')}"


def _on_disk(row: dict, _result: dict) -> str:
    """Full fine-tuning under a host RAM budget: layers whose state and whose weights live on disk, and the GiB read
    and written per step."""
    if not row.get("state_layers_on_disk") and not row.get("weight_layers_on_disk"):
        return "-"
    return (
        f"{row['state_layers_on_disk']} / {row['weight_layers_on_disk']}; "
        f"{_f(row['disk_read_gib_per_step'], '.2f')} / {_f(row['disk_written_gib_per_step'], '.2f')}"
    )


def _accumulated(cell: Cell) -> Cell:
    """Full fine-tuning: ``cell`` in rows of several micro-batches a step, "-" in the others."""
    return lambda row, result: cell(row, result) if row.get("micro_batches", 1) > 1 else "-"


def _copied(row: dict, _result: dict) -> str:
    """Full fine-tuning: GiB a step copied to the device and home (the disk tier's reads are host work: not here)."""
    per = row.get("copied_gib_per_step")
    if per is None:
        return "-"
    to_device = sum(v for k, v in per.items() if k.endswith(" in"))
    home = sum(v for k, v in per.items() if k.endswith((" home", " out")))
    return f"{to_device:.3g} / {home:.3g}"


def _mallocs(row: dict, _result: dict) -> str:
    """The caching allocator's cudaMalloc calls and retries over a row's warm-up and timed steps."""
    if "device_mallocs" not in row:
        return "-"
    return f"{row['device_mallocs']} / {row.get('alloc_retries', 0)}"


def _reads_ahead(row: dict, _result: dict) -> str:
    """The disk tier: fetches that found their layer's read ahead, and reads ahead dropped, per timed step."""
    if "reads_ahead_taken_per_step" not in row:
        return "-"
    return f"{row['reads_ahead_taken_per_step']:.3g} / {row['reads_ahead_dropped_per_step']:.3g}"


def _text(key: str) -> Cell:
    return lambda row, _result: str(row.get(key, "-"))


def _each_step(row: dict, _result: dict) -> str:
    """Every timed step's seconds, in order (a median of few steps hides a slow first one)."""
    times = row.get("step_times_s") or []
    return ", ".join(f"{t:.2f}" for t in times) or "-"


PEAK_ALLOC = ("peak alloc GiB", _key("peak_allocated_gib", ".2f"))
COPY_GBPS = ("copy GB/s", _key("copy_gbps", ".1f"))
COPIED = ("copied/step GiB", _key("bytes_per_step", ".1f", scale=1 / GiB))
COPY_SHARE = ("copy / pinned", _key("copy_share_of_pinned", ".0%"))
VS_RESIDENT = ("vs resident", _key("vs_resident", ".2f", "x"))

TABLES: dict[str, Table] = {
    "models": Table(
        columns=(
            ("method", _text("method")),
            ("steps", _text("steps")),
            ("streamed GiB", _key("streamed_gib", ".1f")),
            ("step (s)", _key("median_step_s", ".3f")),
            ("per sample (s)", _key("per_sample_s", ".3f")),
            VS_RESIDENT,
            ("vs floor (copied)", _key("vs_floor", ".2f", "x")),
            ("vs floor (2x streamed)", _key("vs_floor_2x", ".2f", "x")),
            COPIED,
            COPY_GBPS,
            COPY_SHARE,
            ("compute waited (ms)", _key("wait_ms", ".0f")),
            ("activation waits (ms)", _key("activation_wait_ms", ".0f")),
            ("activations home GiB", _key("activations_home_gib", ".2f")),
            ("slot MiB", _key("slot_mib", ".0f")),
            ("pinned host GiB", _key("pinned_gib", ".1f")),
            PEAK_ALLOC,
            ("peak reserved GiB", _key("peak_reserved_gib", ".2f")),
            ("cudaMalloc / retries", _mallocs),
        ),
        rows=lambda result: [r for r in result["rows"] if "median_step_s" in r],
        optional=(
            "cudaMalloc / retries",
            "activation waits (ms)",
            "activations home GiB",
            "slot MiB",
            "pinned host GiB",
            "per sample (s)",
        ),
    ),
    "fp8": Table(
        columns=(
            ("method", _text("method")),
            ("copied per pass GiB", _key("streamed_gib", ".1f")),
            ("step (s)", _key("median_step_s", ".3f")),
            VS_RESIDENT,
            ("vs bf16 storage", _key("vs_bf16_storage", ".2f", "x")),
            COPIED,
            COPY_GBPS,
            ("compute waited (ms)", _key("wait_ms", ".0f")),
            PEAK_ALLOC,
            ("loss rel err", _key("loss_rel_err", ".2e")),
            ("block out rel err mean", _key("block_rel_err_mean", ".2e")),
            ("block out rel err max", _key("block_rel_err_max", ".2e")),
        )
    ),
    "planner": Table(
        columns=(
            ("budget GiB", _key("budget_gib", "g")),
            ("auto plan", _text("auto_plan")),
            ("predicted (s)", _key("predicted_s", ".3f")),
            ("auto step (s)", _key("step_s", ".3f")),
            ("auto vs resident", VS_RESIDENT[1]),
            ("best hand config (sweep)", _text("best_hand")),
            ("hand step (s)", _key("hand_step_s", ".3f")),
            ("auto / hand (sweep)", _key("auto_vs_hand", ".3f")),
            ("auto / hand (A/B)", _key("ab_ratio", ".3f")),
            (
                "A/B auto / hand step (s)",
                lambda r, _: f"{_f(r.get('ab_auto_s'), '.3f')} / {_f(r.get('ab_hand_s'), '.3f')}",
            ),
            (
                "auto peak reserved GiB",
                lambda r, _: _f(r["peak_reserved_gib"], ".2f") + ("" if r["fits"] else " (OVER)"),
            ),
            ("highest trial peak GiB", _key("highest_trial_peak_gib", ".2f")),
        ),
        rows=lambda result: result["budgets"],
    ),
    "overlap": Table(
        columns=(
            ("arm", _text("arm")),
            ("streamed layers", _text("streamed_layers")),
            ("step (ms)", _key("step_ms", ".0f")),
            VS_RESIDENT,
            ("extra vs resident (ms)", _key("extra_ms", "+.0f")),
            ("waited on copies (ms)", _key("waited_ms", ".0f")),
            (
                "block uses resident in every arm (ms)",
                lambda r, result: f"{r['shared_layers_ms']:.0f} ({result['shared_uses']} uses)",
            ),
            ("those vs resident arm", _key("shared_vs_resident", ".3f", "x")),
        )
    ),
    "host_ram": Table(
        columns=(
            ("[optimizer] type", _text("method")),
            ("runs as", _text("kernel")),
            ("packed GiB", _key("packed_gib", ".1f")),
            ("masters GiB", _key("masters_gib", ".1f")),
            ("gradients GiB", _key("gradients_gib", ".1f")),
            ("optimizer GiB", _key("optimizer_gib", ".1f")),
            ("total GiB", _key("total_gib", ".1f")),
            ("spares wanted GiB", _key("spares_wanted_gib", ".1f")),
            ("note", _text("note")),
        )
    ),
    "disk": Table(
        columns=(
            ("host RAM budget (GiB)", _text("budget")),
            ("layers on disk", _text("layers_on_disk")),
            ("GiB on disk", _key("disk_gib", ".1f")),
            ("GiB read/step", _key("read_gib_per_step", ".1f")),
            ("step (s)", _key("median_step_s", ".3f")),
            ("timed steps (s)", _each_step),
            ("vs all in RAM", _key("vs_all_in_ram", ".2f", "x")),
            ("vs all-resident", _key("vs_resident", ".2f", "x")),
            ("GiB to device/step", _key("weights_in_gib_per_step", ".1f")),
            ("two-stream floor (s)", _key("two_stream_floor_s", ".3f")),
            ("disk floor (s)", _key("disk_floor_s", ".2f")),
            ("vs floor", _key("vs_floor", ".2f", "x")),
            ("reader busy s a step", _key("reader_busy_s_per_step", ".2f")),
            ("GB/s while reading", _key("read_gbps_while_reading", ".2f")),
            ("reads ahead taken / dropped a step", _reads_ahead),
            ("peak reserved GiB", _key("peak_reserved_gib", ".2f")),
            ("RSS while training GiB", _key("training_peak_rss_gib", ".1f")),
            ("peak RSS GiB", _key("peak_rss_gib", ".1f")),
        )
    ),
    "host": Table(
        columns=(
            ("method", _text("method")),
            ("step (s)", _key("median_step_s", ".3f")),
            VS_RESIDENT,
            ("min step (s)", _key("min_step_s", ".3f")),
            ("min vs resident", _key("min_vs_resident", ".2f", "x")),
            ("host ms per step in DGLS", _key("host_ms", ".1f")),
            ("min host ms", _key("min_host_ms", ".1f")),
            ("gc ms", _key("gc_ms", ".1f")),
        )
    ),
    "full": Table(
        columns=(
            ("method", _text("method")),
            ("trained params (B)", _key("trained_params_b", ".2f")),
            ("micro-batches", _accumulated(_text("micro_batches"))),
            ("layer-major", _accumulated(lambda r, _: "yes" if r.get("layer_major") else "no")),
            ("step (s)", _key("median_step_s", ".3f")),
            ("per sample (s)", _accumulated(_key("per_sample_s", ".3f"))),
            VS_RESIDENT,
            ("host optimizer wait", _key("host_wait_share", ".0%")),
            ("GPU wait", _key("compute_wait_share", ".0%")),
            ("host: grad sums s/step", _key("host_accumulate_s", ".2f")),
            ("host: updates s/step", _key("host_update_s", ".2f")),
            ("updated on GPU", _key("device_share", ".0%")),
            ("streamed GiB", _key("streamed_gib", ".1f")),
            ("copied GiB/step (to device / home)", _copied),
            PEAK_ALLOC,
            ("peak reserved GiB", _key("peak_reserved_gib", ".2f")),
            ("host RSS GiB", _key("host_rss_gib", ".1f")),
            ("host RSS peak GiB", _key("host_rss_peak_gib", ".1f")),
            ("pinned host GiB", _key("pinned_gib", ".1f")),
            ("host optimizer state GiB (counted / held)", _state_counted_held),
            ("on disk: state / weight layers; GiB read / written a step", _on_disk),
            ("placement (--vram_budget)", _text("placement")),
            ("grad norm", _key("grad_norm", ".3g")),
            ("speculation", _text("speculation")),
            ("optimizer (diffusion-pipe's ways)", _text("optimizer")),
        ),
        optional=(
            "trained params (B)",
            "micro-batches",
            "layer-major",
            "per sample (s)",
            "copied GiB/step (to device / home)",
            "optimizer (diffusion-pipe's ways)",
            "GPU wait",
            "updated on GPU",
            "host RSS peak GiB",
            "pinned host GiB",
            "host optimizer state GiB (counted / held)",
            "on disk: state / weight layers; GiB read / written a step",
            "placement (--vram_budget)",
            "grad norm",
            "speculation",
        ),  # fmt: skip
    ),
    "engines": Table(
        columns=(
            ("case", _text("case")),
            ("row", _text("method")),
            ("step (s): this / baseline", lambda r, _: f"{_f(r['new_step_s'], '.3f')} / {_f(r['old_step_s'], '.3f')}"),
            (
                "vs resident: this / baseline",
                lambda r, _: f"{_f(r['new_vs_resident'], '.2f')}x / {_f(r['old_vs_resident'], '.2f')}x",
            ),
            ("this / baseline", _key("new_vs_old", ".3f")),
            (
                "peak reserved GiB: this / baseline",
                lambda r, _: f"{_f(r['new_peak_reserved_gib'], '.2f')} / {_f(r['old_peak_reserved_gib'], '.2f')}",
            ),
            (
                "host RSS GiB: this / baseline",
                lambda r, _: f"{_f(r['new_host_rss_gib'], '.1f')} / {_f(r['old_host_rss_gib'], '.1f')}",
            ),
        )
    ),
    "transfer": Table(
        columns=(
            ("configuration", _text("method")),
            ("step (ms)", _key("median_step_s", ".1f", scale=1000)),
            VS_RESIDENT,
            ("floor (ms)", _key("floor_s", ".1f", scale=1000)),
            ("vs floor", _key("vs_floor", ".2f", "x")),
            COPY_GBPS,
            COPY_SHARE,
            ("compute waited (ms)", _key("wait_ms", ".1f")),
            PEAK_ALLOC,
        )
    ),
}


TABLES["clip_modes"] = Table(  # benchmarks/clip_modes.py: exact clipping vs clip_mode previous_norm
    columns=(
        ("optimizer, limit", _text("method")),
        ("limit (median norm)", lambda r, _: f"{_f(r['limit'], '.3g')} ({_f(r['median_norm'], '.3g')})"),
        (
            "clipped: exact / previous_norm",
            lambda r, _: f"{r['clipped_share']:.0%} / {r['clipped_share_previous_norm']:.0%}",
        ),
        (
            "mean loss: exact / previous_norm",
            lambda r, _: f"{r['mean_loss_exact']:.4f} / {r['mean_loss_previous_norm']:.4f}",
        ),
        (
            "final loss: exact / previous_norm",
            lambda r, _: f"{r['final_loss_exact']:.4f} / {r['final_loss_previous_norm']:.4f}",
        ),
        ("mean loss diff", lambda r, _: f"{r['mean_loss_diff'] / r['mean_loss_exact']:+.2%}"),
        ("final loss diff", lambda r, _: f"{r['final_loss_rel_diff']:+.2%}"),
        ("max curve diff", lambda r, _: f"{r['max_smoothed_rel_diff']:.2%}"),
        ("weights apart", lambda r, _: f"{r['weights_apart_rel']:.3f}"),
        ("no clipping: final loss diff", lambda r, _: f"{r['unclipped_final_rel_diff']:+.2%}"),
    )
)


def _per_gpu(key: str, fmt: str) -> Cell:
    """A list of per-GPU figures (rank order) as 'a / b / c'."""

    def cell(row: dict, _result: dict) -> str:
        values = row.get(key)
        return " / ".join(_f(v, fmt) for v in values) if isinstance(values, list) else "-"

    return cell


def _shared_fetch(row: dict, _result: dict) -> str:
    """A data row's share_fetch: 'on' (each process copied 1/N of every layer and gathered the rest), 'off', or '-'
    (one GPU, or a result from before the flag)."""
    value = row.get("shared_fetch")
    return "-" if value is None else ("on" if value else "off")


TABLES["scaling"] = Table(
    columns=(
        ("layout", _text("layout")),  # results with pipeline rows (bench_scaling.py --layout)
        ("GPUs", _text("gpus")),
        ("micro-batches", _text("micro_batches")),
        ("samples/s", _key("samples_per_s", ".3f")),
        ("vs 1 GPU", _key("vs_1gpu", ".2f", "x")),
        ("step (s)", _key("median_step_s", ".3f")),
        ("peak alloc GiB per GPU", _per_gpu("peak_allocated_gib", ".1f")),
        ("copy GB/s per GPU", _per_gpu("copy_gbps", ".1f")),
        ("raw H2D GB/s per GPU (all at once)", _per_gpu("raw_h2d_gbps", ".1f")),
        ("before ms per GPU", _per_gpu("before_allreduce_ms", ".0f")),
        ("all-reduce ms per GPU", _per_gpu("allreduce_ms", ".0f")),
        ("thread CPU ms per GPU", _per_gpu("thread_cpu_ms", ".0f")),  # bench_scaling.py since 2026-11-27
        ("bound cores per GPU", _per_gpu("bound_cores", "d")),  # --bind_cores: each process's physical cores
        ("shared fetches", _shared_fetch),  # --share_fetch: data rows above 1 GPU (utils/dgls/memory/fetch_share.py)
        (
            "host GiB (shared GiB)",
            lambda r, _: f"{_f(r.get('host_pss_gib'), '.1f')} ({_f(r.get('host_copy_gib'), '.1f')})",
        ),  # noqa: E501
        ("cap", lambda r, _: r.get("cap") or "-"),
    ),
    optional=("layout", "micro-batches", "thread CPU ms per GPU", "bound cores per GPU", "shared fetches"),
)


# ---------------------------------------------------------------- Markdown
def where(environment: dict) -> str:
    """The device a result was measured on, in words."""
    if not environment.get("gpu"):
        return f"the CPU (torch {environment.get('torch', '?')})"
    link = f"PCIe gen {environment['pcie_gen']} x{environment['pcie_width']}, " if "pcie_gen" in environment else ""
    alloc = f", PYTORCH_CUDA_ALLOC_CONF={environment['alloc_conf']}" if environment.get("alloc_conf") else ""
    return f"{environment['gpu']} ({link}torch {environment.get('torch')}, CUDA {environment.get('cuda')}{alloc})"


def table(result: dict) -> list[str]:
    spec = TABLES[result["benchmark"]]
    rows = spec.rows(result)
    columns = [
        (header, cell)
        for header, cell in spec.columns
        if header not in spec.optional or any(cell(row, result) != "-" for row in rows)
    ]
    lines = [
        "| " + " | ".join(header for header, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, result) for _, cell in columns) + " |")
    return lines


def row_notes(result: dict) -> list[str]:
    """A line per row that was skipped, failed, or carries the planner's log."""
    notes = []
    for r in result["rows"]:
        name = r.get("method") or r.get("arm")
        if "skipped" in r:
            notes.append(f"- {name}: skipped: {r['skipped']}")
        elif "error" in r:
            notes.append(f"- {name}: failed: {r['error']}")
        elif r.get("plan_log"):
            fits = {True: " (peak reserved within the budget)", False: " (peak reserved OVER the budget)"}
            notes.append(f"- {name}: {' / '.join(r['plan_log'])}{fits.get(r.get('fits_budget'), '')}")
        if r.get("profile_summary"):
            notes.append(f"- {name}: {profile_note(r)}")
        if r.get("device_gaps"):
            notes.append(f"- {name}: {gaps_note(r['device_gaps'])}")
    return notes


def gaps_note(gaps: dict) -> str:
    """blocking.device_gaps of a row (--profile_dir): how much of one step the busiest stream ran kernels."""
    return (
        f"one more step under torch.profiler (device activity only): the busiest stream ran {gaps['kernels']} "
        f"kernels for {gaps['busy_ms']:.2f} ms of {gaps['span_ms']:.2f} ms, and waited {gaps['gap_ms']:.2f} ms "
        f"between them ({gaps['gaps_of_100us_or_more']} gaps of 100 us or more): the device waiting for the host to "
        "issue work (or on an event)"
    )


def profile_note(row: dict) -> str:
    """A profiled row (--profile_dir): where its trace is, and the profiled step's summary."""
    parts = []
    for step in row["profile_summary"].values():
        text = f"{step['ms']:.0f} ms, compute waited {step['wait_ms']:.1f} ms for weights"
        text += f" and {step.get('other_wait_ms', 0.0):.1f} ms for activation restores"
        if "host_lead_ms_median" in step:
            text += f", host ahead of the device by {step['host_lead_ms_median']:.1f} ms median"
            text += f" ({step['host_lead_ms_min']:.1f} ms least)"
        parts.append(text)
    return f"profiled step after the timed ones ({row['profile']}): {'; '.join(parts)}"


def render(result: dict) -> str:
    """NAME.md: what was measured and where, the table, the notes, the command."""
    lines = [f"{result['title']} on {where(result['environment'])}: {result['description']}", "", *table(result)]
    for note in result.get("notes", []):
        lines += ["", note]
    footnotes = row_notes(result)
    if footnotes:
        lines += ["", *footnotes]
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- plot
MARKERS = {"resident": "*", "dgls": "o", "ab": "P", "options": ".", "auto": "D", "dp": "s", "naive": "x"}


def plot(result: dict, path: Path) -> bool:
    """Step time against peak allocated VRAM, a point per timed row (model benchmarks); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in result["rows"] if "median_step_s" in r]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for r in timed:
        marker = MARKERS.get(r["kind"], "o")
        ax.scatter(r.get("peak_allocated_gib", 0), r["median_step_s"], label=r["method"], marker=marker)
    ax.set_yscale("log")
    ax.set_xlabel("peak allocated VRAM (GiB)")
    ax.set_ylabel("median step (s, log scale)")
    ax.set_title(f"{result['title']}: time vs VRAM (lower left is better)", fontsize=9)
    if timed:
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- files
def write_result(result: dict, name: str, out: Path, plot_it: bool = True, echo: bool = False) -> None:
    """NAME.json, NAME.md and (model benchmarks, with matplotlib) NAME.png in ``out``; then its index."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = render(result)
    (out / f"{name}.md").write_text(md)
    if echo:
        print(md)
    if plot_it and result["benchmark"] == "models" and not plot(result, out / f"{name}.png") and echo:
        print("matplotlib not installed: no plot written (pip install matplotlib)")
    write_index(out)


def load_results(out: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}


def index(results: dict[str, dict], out: Path, findings: str = "") -> str:
    """README.md of a results folder: a contents list, the findings (if given), then each result's page
    and links to its files."""
    intro = (
        "Generated by `python benchmarks/report.py --index` from the JSON files in this folder (every benchmark "
        "run rewrites it): do not edit. Each section is one result file: what was measured and on which device, "
        "the table, notes, the command that produced it, and the plot."
    )
    if findings:
        intro += " The [findings](#findings) across them (benchmarks/findings.md) follow the contents."
    lines = ["# Benchmark results", "", intro, ""]
    for name, result in results.items():
        lines.append(f"- [{name}](#{name}): {result['title']} ({result['environment'].get('gpu') or 'CPU'})")
    if findings:
        lines += ["", findings.strip("\n")]
    for name, result in results.items():
        lines += ["", f"## {name}", "", render(result).rstrip("\n"), ""]
        files = [f"[{name}.json]({name}.json)", f"[{name}.md]({name}.md)"]
        lines.append("Files: " + ", ".join(files))
        if (out / f"{name}.png").exists():
            caption = "loss curves" if result["benchmark"] == "clip_modes" else "step time vs peak VRAM"
            lines += ["", f"![{name}: {caption}]({name}.png)"]
    return "\n".join(lines) + "\n"


def write_index(out: Path) -> None:
    findings = FINDINGS.read_text() if out.resolve() == RESULTS and FINDINGS.exists() else ""
    (out / INDEX).write_text(index(load_results(out), out, findings))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results_dir", type=Path, default=RESULTS)
    parser.add_argument("--index", action="store_true", help="only rewrite README.md")
    args = parser.parse_args(argv)
    if not args.index:
        for name, result in load_results(args.results_dir).items():
            write_result(result, name, args.results_dir)
    write_index(args.results_dir)


if __name__ == "__main__":
    main()
