"""dgls_train.py with DeepSpeed's own backward pass on every pipeline stage: the demo without
:func:`utils.dgls.trainers.joined_backward.joined_backward` (the comparison run of test_joined_backward.py).

    deepspeed --num_gpus=2 tests/deepspeeds_backward.py --deepspeed --config x.toml
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import utils.dgls.demo.train as train  # noqa: E402


@contextlib.contextmanager
def deepspeeds_own(engine, log=None):
    yield


train.joined_backward = deepspeeds_own
sys.argv = [str(ROOT / "dgls_train.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "dgls_train.py"), run_name="__main__")
