#!/usr/bin/env python
"""DGLS entry point: flags and TOML in, the demo or diffusion-pipe's own train.py out.

    python dgls_train.py --config toml/demo.toml
    python dgls_train.py --config my_flux.toml --blocks_to_swap 30 --prefetch 2

User mistakes end with one line on stderr and exit code 2; bugs keep their traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from utils.dgls import options  # noqa: E402
from utils.dgls.errors import DGLSUserError  # noqa: E402
from utils.dgls.launch import DEMO_MODEL_TYPE, build_parser, load_toml, model_type  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    config = load_toml(args.config)
    values = options.resolve(config.get("dgls"), args)
    kind = model_type(config, args.config)
    if kind == DEMO_MODEL_TYPE:
        if rest:
            raise DGLSUserError(f"unknown argument(s) for the demo: {' '.join(rest)}")
        from utils.dgls.demo.train import run_demo

        run_demo(config, values)
        return 0
    raise DGLSUserError(
        f"model type '{kind}' is a diffusion-pipe model: the diffusion-pipe drop-in is not available in this "
        f"version of DGLS; run the demo with --config toml/demo.toml"
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DGLSUserError as exc:
        print(f"dgls: error: {exc}", file=sys.stderr)
        sys.exit(2)
