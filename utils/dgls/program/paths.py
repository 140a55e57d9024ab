"""Output paths, checked before training: a run must not do all its work and then fail to
write it (a folder where a file goes, a read-only or full disk), and must not replace an
earlier run's output without a word."""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from ..errors import DGLSUserError

MiB = 1 << 20


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or ".")


def _writable_dir(folder: Path) -> str | None:
    """None if a file can be created in ``folder``, else why not (a probe file, removed at once:
    permission bits alone do not show a read-only mount, nor what root may do)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "is not writable"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"is not writable ({exc.strerror or exc})"
    return None


def check_output_dir(path: Path, label: str, need_bytes: int = 0) -> None:
    """``path`` is, or can be made, a folder that takes ``need_bytes`` more; ``label`` is how the
    user named it (``--profile x.json``, ``[demo] output_dir = '...'``)."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise DGLSUserError(f"{label}: {base} is a file, not a folder: choose another path")
    if (why := _writable_dir(base)) is not None:
        raise DGLSUserError(f"{label}: {base} {why}: choose another path")
    if need_bytes:
        free = shutil.disk_usage(base).free
        if free < need_bytes:
            raise DGLSUserError(
                f"{label}: only {free / MiB:.1f} MiB free on its disk and the run writes {need_bytes / MiB:.1f} MiB: "
                "free some space or choose another path"
            )


def check_output_file(path: Path, label: str) -> str | None:
    """``path`` can be written as a file; returns a start-up note if an existing file will be replaced."""
    if path.is_dir():
        raise DGLSUserError(f"{label} is a folder: give a file path such as {path / 'trace.json'}")
    check_output_dir(path.parent, label)
    if path.exists():
        if not os.access(path, os.W_OK):
            raise DGLSUserError(f"{label} exists and is not writable: choose another path")
        return f"DGLS: {label} exists and will be replaced"
    return None


def new_run_dir(output_dir: Path) -> Path:
    """A new folder for this run under ``output_dir``, named by the UTC time as diffusion-pipe names its
    run folders, so earlier runs are kept."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d_%H-%M-%S")
    for n in range(1, 1000):
        run_dir = output_dir / (stamp if n == 1 else f"{stamp}_{n}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
    raise DGLSUserError(f"could not make a new run folder in {output_dir}: clean it up")
