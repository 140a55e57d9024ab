#!/usr/bin/env python
"""DGLS entry point: flags and TOML in, the demo or diffusion-pipe's own train.py out.

    python dgls_train.py --config toml/demo.toml
    python dgls_train.py --config my_flux.toml --blocks_to_swap 30 --prefetch 2
    deepspeed --num_gpus=1 dgls_train.py --deepspeed --config my_flux.toml --blocks_to_swap 30

Every input is checked before anything slow starts; a user mistake ends with one line on
stderr and exit code 2, Ctrl-C or SIGTERM with one line and 130 or 143; bugs keep their traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

try:
    from utils.dgls.program.launch import run_as_program
    from utils.dgls.program.validate import DemoRun, prepare
except ModuleNotFoundError as exc:  # an incomplete copy into a checkout, or a package not installed
    missing = exc.name or str(exc)
    if missing.split(".")[0] == "utils":
        depth = missing.count(".")  # utils.dgls: the package; utils.dgls.x: a folder or a root module; deeper: a module
        path = missing.replace(".", "/") + ("/" if depth < 2 else "" if depth == 2 else ".py")
        sys.stderr.write(  # one write per line: DeepSpeed starts each process with python -u (errors.print_line)
            f"dgls: error: {path} is missing next to {Path(__file__).name} in {HERE}: "
            "copy the whole utils/dgls folder along with dgls_train.py (see the README)\n"
        )
    else:
        sys.stderr.write(
            f"dgls: error: the Python package {missing!r} is not installed: pip install -r requirements.txt\n"
        )
    sys.exit(2)
except KeyboardInterrupt:  # Ctrl-C while torch loads
    sys.stderr.write("dgls: interrupted before training started; nothing was saved\n")
    sys.exit(130)


def main(argv: list[str] | None = None) -> int:
    """Check everything, say how the settings were combined, then run the demo or train.py."""
    run = prepare(argv, HERE)
    for note in run.notes:  # each line in one write, as errors.print_line: every process of a job says them
        sys.stdout.write(note + "\n")
    if isinstance(run, DemoRun):
        from utils.dgls.demo.train import run_demo

        run_demo(run)
    else:
        from utils.dgls.trainers.diffusion_pipe import run_drop_in

        run_drop_in(run)
    return 0


if __name__ == "__main__":
    run_as_program(main)
