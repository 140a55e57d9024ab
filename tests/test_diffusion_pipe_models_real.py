"""The model types users train most, through diffusion-pipe's real train.py, plain and under DGLS.

For each type in tests/fixtures/tiny_models (a tiny random model built at test time, in that
type's own file layout): train.py --cache_only once, then per case a plain seeded run and a
run through dgls_train.py with most layers streamed (``--blocks_to_swap N --prefetch 1``),
both reading that cache with the same seed. The DGLS run must reach TRAINING COMPLETE!,
print a placement table that streams N layers, and save a LoRA bitwise equal to the plain
run's. Activation checkpointing is on (the common setting); two types also run without it
and with 'unsloth'.

``test_float8_transformer`` runs diffusion-pipe's ``transformer_dtype = 'float8'`` (the setting
its Flux documentation recommends): the same LoRA as plain diffusion-pipe, and DGLS streaming
the fp8 bytes as they are, about half the bytes of the same model in bf16.

Opt-in and slow (marked ``slow``): set DGLS_DIFFUSION_PIPE to a diffusion-pipe checkout. A
type whose submodule or package is missing is skipped with the reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dp_runs import DTYPE, FIXTURES, checkout_or_skip, only_run_dir, requires_checkout, run_train, saved_lora
from helpers import child_env

sys.path.insert(0, str(FIXTURES))
from tiny_models import SPECS, ModelSpec, files  # noqa: E402
from tiny_models.checkout import shadow_checkout  # noqa: E402
from tiny_models.flux import build_tiny_flux  # noqa: E402

from utils.dgls.program.dp_model import layer_count  # noqa: E402

pytestmark = [pytest.mark.slow, requires_checkout]

STEPS = 3
CASES = [pytest.param(name, True, id=f"{name}-ckpt") for name in SPECS] + [
    pytest.param(name, mode, id=f"{name}-{label}")
    for name in ("hunyuan-video", "chroma")
    for mode, label in ((False, "no-ckpt"), ("unsloth", "unsloth"))
]
# A row of DGLS's placement table: index, layer class (or function) name, MB, placement.
TABLE_ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+[\d.]+\s+(streamed|resident)", re.MULTILINE)
# The table's last line: "...; N layers (X MB) stream".
STREAMED_MB = re.compile(r"\d+ layers \(([\d.]+) MB\) stream")


@dataclass(frozen=True)
class Prepared:
    """A built tiny model with its dataset, cached once; what each case's runs share."""

    spec: ModelSpec
    checkout: Path  # the checkout itself, or a shadow with tiny configs/
    model: dict
    env: dict[str, str]
    data: Path
    eval_data: Path

    def configs(self, out: Path, name: str, checkpointing, **model) -> Path:
        return files.write_configs(
            out / f"cfg_{name}",
            {**self.model, **model},
            self.data,
            out / f"out_{name}",
            eval_data_dir=self.eval_data,
            max_steps=STEPS,
            dtype=DTYPE,
            activation_checkpointing=checkpointing,
        )

    def run(self, config: Path, log: Path, *extra: str, dgls: str | None = None) -> str:
        runner_args = tuple(self.spec.runner_args())
        return run_train(self.checkout, config, log, *extra, dgls=dgls, runner_args=runner_args, env=self.env)


@pytest.fixture(scope="module")
def checkout():
    return checkout_or_skip()


@pytest.fixture(scope="module")
def prepare(checkout, tmp_path_factory):
    """prepare(type) -> Prepared: built and cached on first use, then reused by the module's cases."""
    done: dict[str, Prepared] = {}

    def get(name: str) -> Prepared:
        if name not in done:
            spec = SPECS[name]
            if reason := spec.missing(checkout):
                pytest.skip(reason)
            done[name] = _prepare(spec, checkout, tmp_path_factory.mktemp(name.replace("-", "_")))
        return done[name]

    return get


def _prepare(spec: ModelSpec, checkout: Path, root: Path) -> Prepared:
    model_dir = root / "model"
    subprocess.run(
        [sys.executable, "-m", "tiny_models", spec.name, str(model_dir), "--checkout", str(checkout)],
        cwd=FIXTURES,
        env=child_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    built = json.loads((model_dir / "built.json").read_text())
    if built["configs"]:
        checkout = shadow_checkout(checkout, {k: Path(v) for k, v in built["configs"].items()}, root / "checkout")
    prepared = Prepared(
        spec,
        checkout,
        built["model"],
        built["env"],
        files.write_dataset(root / "data", n=4, size=64, seed=0),
        files.write_dataset(root / "eval_data", n=1, size=64, seed=0, offset=4),
    )
    log = prepared.run(prepared.configs(root, "cache", True), root / "cache.log", "--cache_only")
    assert "TRAINING COMPLETE!" not in log
    return prepared


def placement(log: str) -> dict[str, list[str]]:
    """DGLS's placement table from a log: layer names by placement."""
    rows: dict[str, list[str]] = {"streamed": [], "resident": []}
    for _, name, where in TABLE_ROW.findall(log):
        rows[where].append(name)
    return rows


def assert_same_lora(plain_out: Path, dgls_out: Path, step: str = f"step{STEPS}") -> None:
    from safetensors.torch import load_file

    plain, dgls = load_file(saved_lora(plain_out, step)), load_file(saved_lora(dgls_out, step))
    assert plain and plain.keys() == dgls.keys()
    up = [v for k, v in plain.items() if "lora_B" in k or "lora_up" in k]  # PEFT / kohya (SDXL) names
    assert up and any(v.abs().max() > 0 for v in up), "LoRA B is still zero: no training step"
    differ = {k: (dgls[k] - v).abs().max().item() for k, v in plain.items() if not (dgls[k] == v).all()}
    assert not differ, f"{len(differ)} of {len(plain)} LoRA tensors differ with DGLS (max abs diff): {differ}"


@pytest.mark.parametrize("model_type, checkpointing", CASES)
def test_dgls_matches_plain_train_py(prepare, tmp_path, model_type, checkpointing):
    p = prepare(model_type)
    swap = p.spec.swap
    plain_log = p.run(p.configs(tmp_path, "plain", checkpointing), tmp_path / "plain.log")
    assert "TRAINING COMPLETE!" in plain_log
    log = p.run(
        p.configs(tmp_path, "dgls", checkpointing),
        tmp_path / "dgls.log",
        dgls=f"--blocks_to_swap {swap} --prefetch 1 --verbose",
    )
    assert "TRAINING COMPLETE!" in log and log.count("Running eval") == 2
    assert "Creating new shard" not in plain_log + log, "a training run re-cached instead of reading the shared cache"
    rows = placement(log)
    assert len(rows["streamed"]) == swap and f"; {swap} layers (" in log, f"DGLS streamed {rows}"
    if (known := layer_count({"model": p.model}, p.checkout)) is not None:  # the count placement is checked with
        assert known[0] == len(rows["streamed"]) + len(rows["resident"]), f"{known} for the layers {rows}"
    assert f"dgls step {STEPS}: swap:" in log, "no per-step DGLS stats with --verbose"
    assert_same_lora(tmp_path / "out_plain", tmp_path / "out_dgls")


@pytest.mark.parametrize("model_type", ["sdxl", "wan", "hunyuan-video", "qwen_image", "ltx-video"])
def test_swap_units_match_plain_train_py(prepare, tmp_path, model_type):
    """--swap_unit_mb splits the streamed layers into the child modules they run (SDXL's layers hold
    transformer blocks, Wan's blocks their attentions and MLP): the LoRA is still bitwise plain train.py's."""
    p = prepare(model_type)
    swap = p.spec.swap
    p.run(p.configs(tmp_path, "plain", True), tmp_path / "plain.log")
    log = p.run(
        p.configs(tmp_path, "dgls", True),
        tmp_path / "dgls.log",
        dgls=f"--blocks_to_swap {swap} --prefetch 1 --swap_unit_mb 0.01 --verbose",
    )
    assert "TRAINING COMPLETE!" in log and "swap units below" in log and "layers and units" in log
    assert_same_lora(tmp_path / "out_plain", tmp_path / "out_dgls")


@pytest.mark.parametrize(
    "model_type, checkpointing, units",
    [
        pytest.param("sdxl", True, "", id="sdxl"),
        pytest.param("wan", True, "--swap_unit_mb 0.01 ", id="wan-units"),
        pytest.param("hunyuan-video", "unsloth", "", id="hunyuan-video-unsloth"),
        pytest.param("ltx-video", True, "", id="ltx-video"),
        pytest.param("wan", True, "--swap_unit_mb 0.01 --offload_recompute ", id="wan-units-recompute"),
        pytest.param("hunyuan-video", "unsloth", "--offload_recompute ", id="hunyuan-video-unsloth-recompute"),
    ],
)
def test_checkpoint_units_match_plain_train_py(prepare, tmp_path, model_type, checkpointing, units):
    """--checkpoint_units runs the child modules of every layer (or its swap units) under checkpoints of their
    own, nested in diffusion-pipe's layer checkpoints, with activation offload (and with --offload_recompute,
    what each layer's recompute saves going home too): still bitwise plain train.py."""
    p = prepare(model_type)
    p.run(p.configs(tmp_path, "plain", checkpointing), tmp_path / "plain.log")
    log = p.run(
        p.configs(tmp_path, "dgls", checkpointing),
        tmp_path / "dgls.log",
        dgls=f"--blocks_to_swap {p.spec.swap} --prefetch 1 {units}--offload_activations --checkpoint_units --verbose",
    )
    assert "TRAINING COMPLETE!" in log and "run under checkpoints of their own" in log
    assert_same_lora(tmp_path / "out_plain", tmp_path / "out_dgls")


def streamed_bytes(output_dir: Path) -> list[float]:
    """DGLS's ``dgls/bytes_moved`` per step, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(only_run_dir(output_dir)))
    events.Reload()
    return [e.value for e in events.Scalars("dgls/bytes_moved")]


def test_float8_transformer(checkout, tmp_path):
    """transformer_dtype = 'float8' (Flux): diffusion-pipe stores every 2-D transformer weight outside
    its high-precision list as float8_e4m3fn and computes through autocast. Under DGLS the LoRA is
    bitwise plain diffusion-pipe's, and the streamed bytes are the fp8 bytes: about half of the
    same run in bf16 (1-D params stay bf16, and every packed param starts on a 256-byte boundary).

    bf16 compute: diffusion-pipe's forwards rely on ``torch.autocast('cuda')`` to meet fp8 (and bf16)
    weights with their inputs; without CUDA the runner's ``cpu_autocast`` stand-in makes that the
    CPU's autocast (a no-op where CUDA is present)."""
    from safetensors.torch import load_file

    model_dir = build_tiny_flux(tmp_path / "model", num_double=3, num_single=3, heads=8)  # hidden 128
    model = {"type": "flux", "diffusers_path": str(model_dir), "timestep_sample_method": "logit_normal"}
    data = files.write_dataset(tmp_path / "data", n=4, size=64)
    eval_data = files.write_dataset(tmp_path / "eval_data", n=1, size=64, offset=4)

    def configs(name: str, **extra) -> Path:
        return files.write_configs(
            tmp_path / f"cfg_{name}",
            {**model, **extra},
            data,
            tmp_path / f"out_{name}",
            eval_data_dir=eval_data,
            max_steps=STEPS,
            dtype="bfloat16",
            activation_checkpointing=True,
        )

    def run(name: str, *extra: str, dgls: str | None = None, **model_extra) -> str:
        log = tmp_path / f"{name}.log"
        return run_train(
            checkout, configs(name, **model_extra), log, *extra, dgls=dgls, runner_args=("--preload=cpu_autocast",)
        )

    swap = "--blocks_to_swap 6 --prefetch 1 --verbose"
    run("fp8_plain", "--cache_only", transformer_dtype="float8")
    assert "TRAINING COMPLETE!" in run("fp8_plain", transformer_dtype="float8")
    fp8_log = run("fp8_dgls", dgls=swap, transformer_dtype="float8")
    bf16_log = run("bf16_dgls", dgls=swap)
    assert "TRAINING COMPLETE!" in fp8_log and "TRAINING COMPLETE!" in bf16_log
    table_mb = [float(STREAMED_MB.search(log).group(1)) for log in (fp8_log, bf16_log)]
    assert 0.45 < table_mb[0] / table_mb[1] < 0.55, f"placement tables: fp8 vs bf16 MB streamed {table_mb}"
    assert_same_lora(tmp_path / "out_fp8_plain", tmp_path / "out_fp8_dgls")
    fp8, bf16 = streamed_bytes(tmp_path / "out_fp8_dgls"), streamed_bytes(tmp_path / "out_bf16_dgls")
    assert len(fp8) == len(bf16) == STEPS and all(bf16)
    ratios = [a / b for a, b in zip(fp8, bf16)]
    assert all(0.45 < r < 0.55 for r in ratios), f"fp8/bf16 bytes streamed per step: {ratios}"
    lora = load_file(saved_lora(tmp_path / "out_fp8_plain", f"step{STEPS}"))
    assert all(v.dtype == torch.bfloat16 for v in lora.values()), "the LoRA trains in bf16 next to fp8 weights"
