"""diffusion-pipe's real train.py as two data-parallel processes of one machine (CPU, gloo), offline.

Opt-in and slow, as test_diffusion_pipe_real.py (set DGLS_DIFFUSION_PIPE to a checkout): the tiny random Flux of
tests/fixtures/tiny_flux.py, each rank started by run_dp_train.py --rank/--world_size as ``deepspeed --num_gpus=2``
would start it (dp_runs.run_train_ranks).

A full fine-tune through train.py trains data parallel without DGLS, and dgls_train.py refuses it with one line on
every rank before training: its checkpoints would hold, for the layers another process updates, the shared
bf16 copy instead of the fp32 master, and only one process's share of the host optimizer state (what it would take
is in utils/dgls/training/data_parallel.py). The plain run here is the baseline such a run would be compared with.
"""

import pytest
from dp_runs import DTYPE, checkout_or_skip, requires_checkout, run_train, run_train_ranks, saved_model
from test_diffusion_pipe_real import _load_fixture

pytestmark = [pytest.mark.slow, requires_checkout]

STEPS = 2
WORLD = 2


@pytest.fixture(scope="module")
def checkout():
    return checkout_or_skip()


def test_a_data_parallel_full_fine_tune_runs_plain_and_is_one_line_on_every_rank_with_dgls(checkout, tmp_path):
    tiny = _load_fixture("tiny_flux")
    model = tiny.build_tiny_flux(tmp_path / "model", seed=0, num_double=3, num_single=3)
    data = tiny.write_dataset(tmp_path / "data", n=4, size=64, seed=0)
    common = dict(max_steps=STEPS, eval_every_n_steps=None, eval_before_first_step=False, dtype=DTYPE, full=True)
    configs = {
        name: tiny.write_configs(tmp_path / f"cfg_{name}", model, data, tmp_path / f"out_{name}", **common)
        for name in ("plain", "dgls")
    }
    run_train(checkout, configs["plain"], tmp_path / "cache.log", "--cache_only")

    logs = run_train_ranks(checkout, configs["plain"], tmp_path / "plain", WORLD)
    assert "TRAINING COMPLETE!" in logs[0]
    weights = saved_model(tmp_path / "out_plain", "epoch1")  # 4 images over 2 ranks: an epoch is 2 steps
    assert weights and any(k.startswith("single_blocks.") for k in weights)

    logs = run_train_ranks(
        checkout, configs["dgls"], tmp_path / "dgls", WORLD, dgls="--blocks_to_swap 5 --prefetch 1", expect=2
    )
    expected = (
        f"dgls: error: {configs['dgls']} has no [adapter] (a full fine-tune), and {WORLD} processes on 1 pipeline "
        "stage(s) would be data parallel"
    )
    for rank, log in enumerate(logs):
        errors = [line for line in log.splitlines() if line.startswith("dgls: ")]
        assert len(errors) == 1 and errors[0].startswith(expected), (rank, errors)
        assert "TRAINING COMPLETE!" not in log and "Traceback" not in log, rank
    assert not (tmp_path / "out_dgls").exists() or not any((tmp_path / "out_dgls").iterdir())
