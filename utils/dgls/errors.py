"""Error types that separate user mistakes from bugs, and the two one-write line printers.

``dgls_train.py`` prints a :class:`DGLSUserError` or a :class:`RunInterrupted` as one line
and exits; any other exception is a bug and keeps its traceback.

Every process of a job writes to the same pipe, and DeepSpeed's launcher starts each with ``python -u``,
where ``print`` writes the text and its newline in two writes: another process's line can land between
them, and a line then starts in the middle of another (a CI log lost ``step 4: loss ...`` that way).
:func:`say` (stdout) and :func:`print_line` (stderr) write a line and its newline in one write, which a
pipe keeps whole up to 4 KiB; every default ``log`` of the package is :func:`say`.
"""

import sys


class DGLSUserError(Exception):
    """A setting, file or machine limit the user can fix; the message says how."""


class RunInterrupted(Exception):
    """The user stopped a run (Ctrl-C) after clean-up ran; the message says what was saved and how to resume."""


class SwapWorkerError(RuntimeError):
    """The background prefetch worker failed; raised in the main thread."""


def say(line: str) -> None:
    """Write ``line`` and its newline to stdout in one write (module doc: a line stays whole across processes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_line(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write. DeepSpeed's launcher starts every process with
    ``python -u``, where ``print`` writes the text and the newline separately, so the same error from three
    processes came out as ``lineline`` and two empty lines."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
