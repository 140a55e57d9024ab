"""Names users misspell: a flag, a ``[dgls]`` key or a table name that nothing reads is refused
with the closest known name, before anything starts.

Why: a misspelled setting is not an error anywhere else. A ``[DGLS]`` or ``[dlgs]`` table is just
another TOML table nobody reads, and diffusion-pipe's train.py takes the arguments DGLS does not
know, so ``--vram_buget 10`` would reach its argparse (a usage dump after the imports) and a
``[dlgs]`` table would train with the defaults without a word.

- Suggestions come from :func:`difflib.get_close_matches`; a name with no close match gets none.
- Nothing here refuses a name someone reads: train.py's own flags pass (an unambiguous
  abbreviation, which its argparse accepts, is written out in full), and so do every top-level key
  of a diffusion-pipe config but those that are spelled like ``dgls``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import DGLSUserError

TABLE = "dgls"
# What deepspeed.add_config_arguments adds to train.py's parser.
DEEPSPEED_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepscale", "--deepscale_config")
_ADD_ARGUMENT = re.compile(r"""add_argument\(\s*['"](--[\w-]+)['"]""")


def did_you_mean(name: str, known: Iterable[str], form: str = "{}") -> str:
    """' (did you mean X?)' for the known name closest to ``name`` (shown through ``form``), or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return f" (did you mean {form.format(close[0])}?)" if close else ""


def check_dgls_table_name(config: dict[str, Any], path: str) -> None:
    """A top-level key spelled like ``dgls`` but not it (``[DGLS]``, ``[dlgs]``, ``[dgsl]``) would be ignored."""
    for key in config:
        if key != TABLE and difflib.get_close_matches(key.lower(), [TABLE], n=1, cutoff=0.7):
            shown = f"[{key}]" if isinstance(config[key], dict) else f"{key} = ..."
            case = " (TOML names are case-sensitive)" if key.lower() == TABLE else ""
            raise DGLSUserError(
                f"{path}: {shown} is not read: DGLS takes its settings from a table named [{TABLE}]{case}; "
                f"rename {shown} to [{TABLE}]"
            )


def check_top_level(config: dict[str, Any], path: str, known: Iterable[str], what: str) -> None:
    """Every top-level key of a config that only ``known`` tables make sense in (``what`` names the run)."""
    known = list(known)
    for key in config:
        if key not in known:
            shown = f"[{key}] table" if isinstance(config[key], dict) else f"top-level key {key}"
            raise DGLSUserError(
                f"{path}: {what} reads no {shown}{did_you_mean(key, known, '[{}]')}; it reads the tables "
                f"{', '.join(f'[{k}]' for k in known)}: rename or remove it"
            )


def train_py_flags(checkout: Path) -> set[str]:
    """The flags the checkout's train.py declares (``parser.add_argument('--x', ...)``, plus DeepSpeed's
    config arguments); empty if train.py declares none this way (then nothing is refused)."""
    try:
        text = (checkout / "train.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    found = set(_ADD_ARGUMENT.findall(text))
    return found | set(DEEPSPEED_FLAGS) if found else set()


def check_passthrough_flags(args: list[str], checkout: Path, dgls_flags: Iterable[str]) -> list[str]:
    """The arguments dgls_train.py does not know, as train.py is to receive them: each abbreviation of one of
    train.py's flags written out in full (``--resume`` -> ``--resume_from_checkpoint``).

    Why: a flag train.py does not know either would stop it after its imports with a usage dump (or be
    dropped, by a parser that ignores extras); an ambiguous abbreviation (``--reset``: three ``--reset_*``
    flags) would too; and DGLS's own checks of train.py's flags (the resume check, ``--reset_optimizer``)
    match full names only, so an abbreviation passed on as written would slip past them.

    - A flag spelled out in full stays as it is; ``--flag=value`` keeps its value.
    - Everything after a bare ``--`` is positional for argparse and passes unchanged.
    - If train.py declares no flags this way, nothing is refused or expanded.
    """
    known = train_py_flags(checkout)
    if not known:
        return list(args)
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + list(args[i:])
        if not arg.startswith("--"):
            out.append(arg)
            continue
        flag, sep, value = arg.partition("=")
        if flag in known:
            out.append(arg)
            continue
        matches = sorted(k for k in known if k.startswith(flag))  # argparse takes an unambiguous abbreviation
        if len(matches) == 1:
            out.append(matches[0] + sep + value)
            continue
        if matches:
            raise DGLSUserError(
                f"{flag} is ambiguous: it abbreviates train.py's {', '.join(matches)}: write the flag in full"
            )
        candidates = sorted(set(dgls_flags) | known)
        raise DGLSUserError(
            f"unknown argument {flag}{did_you_mean(flag, candidates)}: neither dgls_train.py nor this "
            f"checkout's train.py takes it (dgls_train.py --help lists the flags)"
        )
    return out
