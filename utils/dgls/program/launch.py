"""Command-line wiring for ``dgls_train.py``: the parser, the TOML, which path a config takes,
and how the process ends (one line on stderr for a user mistake or an interrupt)."""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ..errors import DGLSUserError, RunInterrupted, print_line
from . import options as opts
from .distributed import end_with_group_alive, group_alive
from .stop_signals import StopSignals

DEMO_MODEL_TYPE = "dgls_demo"
# diffusion-pipe's model types (models/*.py) as of 2026; a checkout may know more (checked there).
DIFFUSION_PIPE_MODEL_TYPES = frozenset(
    {
        "flux",
        "flux2",
        "chroma",
        "sdxl",
        "sd3",
        "ltx-video",
        "hunyuan-video",
        "hunyuan_image",
        "cosmos",
        "cosmos_predict2",
        "lumina",
        "lumina_2",
        "wan",
        "hidream",
        "omnigen2",
        "qwen_image",
        "qwen_image_edit",
        "auraflow",
        "z_image",
        "kandinsky5",
    }
)
USER_ERROR_EXIT = 2

EPILOG = """\
Arguments dgls_train.py does not know are passed to diffusion-pipe's train.py (--resume_from_checkpoint,
--regenerate_cache, --cache_only, --trust_cache, --master_port, the deepspeed launcher's --local_rank ...);
one the checkout's train.py does not declare either is refused, as the demo refuses them. Every DGLS
flag is also a key of a [dgls] table in the training TOML; the command line wins.

  python dgls_train.py --config toml/demo.toml
  python dgls_train.py --config my_flux.toml --vram_budget 10 --diffusion_pipe /path/to/diffusion-pipe
  deepspeed --num_gpus=1 dgls_train.py --deepspeed --config my_flux.toml --blocks_to_swap 30
"""


class _HelpFormatter(argparse.HelpFormatter):
    """Flag help wrapped to the terminal; the epilog (examples) kept as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return text if "\n" in text else super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line (no 23-line usage before it), raised so that callers and tests see it."""

    def error(self, message: str) -> NoReturn:
        raise DGLSUserError(f"{message} (dgls_train.py --help lists the flags)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dgls_train.py",
        usage="%(prog)s --config TOML [DGLS flags] [train.py arguments]",
        description="Train with DGLS layer swapping: the built-in demo, or diffusion-pipe's own train.py.",
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="training TOML (toml/demo.toml for the demo)")
    parser.add_argument(
        "--diffusion_pipe",
        default=None,
        metavar="PATH",
        help="diffusion-pipe checkout (default: $DGLS_DIFFUSION_PIPE, the current folder, or the one "
        "dgls_train.py is in)",
    )
    opts.add_arguments(parser)
    return parser


def read_toml(path: Path, label: str) -> dict[str, Any]:
    """A TOML file's tables; a file that is not UTF-8 or not TOML is one line naming it by ``label``."""
    import toml

    try:
        return toml.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DGLSUserError(f"{label} is not UTF-8 text: save it as UTF-8") from None
    except toml.TomlDecodeError as exc:
        raise DGLSUserError(f"{label} is not valid TOML: {exc}") from None


def load_toml(path: str) -> dict[str, Any]:
    """Read the training TOML; any problem is one line that names the file."""
    p = Path(path)
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "not found"
        raise DGLSUserError(f"config file {what}: {path} (pass --config with the path to a training TOML)")
    return read_toml(p, f"config file {path}")


def model_type(config: dict[str, Any], path: str) -> str:
    model = config.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("type"), str):
        raise DGLSUserError(f"{path} has no [model] type: set type = '{DEMO_MODEL_TYPE}' or a diffusion-pipe model")
    return model["type"]


def check_known_type(kind: str, checkout: Path | None) -> None:
    """An unknown model type is a typo until a checkout says otherwise."""
    if kind == DEMO_MODEL_TYPE or kind in DIFFUSION_PIPE_MODEL_TYPES:
        return
    if checkout is not None and (checkout / "models" / f"{kind.replace('-', '_')}.py").is_file():
        return
    known = ", ".join(sorted(DIFFUSION_PIPE_MODEL_TYPES))
    raise DGLSUserError(f"unknown model type '{kind}': use '{DEMO_MODEL_TYPE}' or a diffusion-pipe type ({known})")


def entry(main: Callable[[], int]) -> int:
    """Run ``main`` as the program: a user mistake is one line and exit code 2, Ctrl-C or SIGTERM one line
    (what was saved, how to resume) and 130 or 143 (:mod:`.stop_signals`); the runs' own clean-up has
    happened by then. Anything else is a bug and keeps its traceback, unless it followed a stop signal: a
    child process stopped by the same Ctrl-C (a compiler: "ninja: build stopped: interrupted by user") can
    make the code waiting on it raise something other than ``KeyboardInterrupt``, and a process whose deepspeed
    command is gone may fail in a collective with a process that saw it first."""
    with StopSignals() as stop:
        try:
            return main()
        except DGLSUserError as exc:
            print_line(f"dgls: error: {exc}")
            return USER_ERROR_EXIT
        except RunInterrupted as exc:
            print_line(f"dgls: {stop.how}: {exc}")
            return stop.exit_code
        except KeyboardInterrupt:
            print_line(f"dgls: {stop.how} before training started; nothing was saved")
            return stop.exit_code
        except Exception as exc:
            try:
                stopping = stop.stopping()  # a collective whose partner stopped first: the same stop (stop_signals)
            except KeyboardInterrupt:  # the launcher watch's SIGTERM, landing here
                stopping = True
            if not stopping:
                raise
            what = (str(exc).strip().splitlines() or [""])[-1][:200]
            signal_name = "Ctrl-C" if stop.received == signal.SIGINT else "SIGTERM"
            print_line(f"dgls: {stop.how}: {signal_name} stopped the run ({type(exc).__name__}: {what})")
            return stop.exit_code


def run_as_program(main: Callable[[], int]) -> NoReturn:
    """``dgls_train.py``'s ``__main__``: :func:`entry`, then exit with its code. A run that ends with its process
    group still alive (a failure, a stop, train.py's own ``quit()`` after ``--cache_only``, ``--plan``'s early
    exit) ends through :func:`.distributed.end_with_group_alive`, since gloo's threads can abort a plain exit. A
    bug's traceback is printed first (``traceback.print_exc``, as Python's default hook would) with exit code 1."""
    try:
        code = entry(main)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except Exception:
        if group_alive():
            traceback.print_exc()
            end_with_group_alive(1)
        raise
    end_with_group_alive(code)
    sys.exit(code)


def _exit_code(code: object) -> int:
    """The exit status Python gives ``SystemExit(code)``: None is 0, a number itself, anything else is printed to
    stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print_line(str(code))
    return 1
