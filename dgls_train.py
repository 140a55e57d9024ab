#!/usr/bin/env python
"""DGLS entry point: flags and TOML in, the demo or diffusion-pipe's own train.py out.

    python dgls_train.py --config toml/demo.toml
    python dgls_train.py --config my_flux.toml --blocks_to_swap 30 --prefetch 2

User mistakes end with one line on stderr and exit code 2; bugs keep their traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

try:
    from utils.dgls import options
    from utils.dgls.errors import DGLSUserError
    from utils.dgls.launch import DEMO_MODEL_TYPE, build_parser, check_known_type, load_toml, model_type
except ModuleNotFoundError as exc:  # an incomplete copy into a checkout, or a package not installed
    missing = exc.name or str(exc)
    if missing.split(".")[0] == "utils":
        path = missing.replace(".", "/") + (".py" if missing.count(".") >= 2 else "/")
        print(
            f"dgls: error: {path} is missing next to {Path(__file__).name} in {HERE}: "
            "copy the whole utils/dgls folder along with dgls_train.py (see the README)",
            file=sys.stderr,
        )
    else:
        print(
            f"dgls: error: the Python package {missing!r} is not installed: pip install -r requirements.txt",
            file=sys.stderr,
        )
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    config = load_toml(args.config)
    values = options.resolve(config.get("dgls"), args)
    for note in options.startup_notes(values):
        print(note)
    kind = model_type(config, args.config)
    if kind == DEMO_MODEL_TYPE:
        if rest:
            raise DGLSUserError(f"unknown argument(s) for the demo: {' '.join(rest)}")
        from utils.dgls.demo.train import run_demo

        run_demo(config, values)
        return 0
    from utils.dgls import diffusion_pipe

    try:
        checkout = diffusion_pipe.find_checkout(args.diffusion_pipe, Path(__file__).resolve().parent)
    except DGLSUserError:
        check_known_type(kind, None)  # a typo reads better as "unknown model type" than "no checkout"
        raise
    check_known_type(kind, checkout)
    diffusion_pipe.check_dataset_files(config, args.config, checkout)
    if values["dynamic_swapping"]:
        diffusion_pipe.check_train_config(config, args.config)
        for note in diffusion_pipe.startup_notes(config):
            print(note)
    config_path = diffusion_pipe.with_lazy_lora_steps(config, args.config, values["lazy_lora_steps"])
    diffusion_pipe.run_train_py(checkout, config_path, rest, values)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DGLSUserError as exc:
        print(f"dgls: error: {exc}", file=sys.stderr)
        sys.exit(2)
