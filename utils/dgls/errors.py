"""Error types that separate user mistakes from bugs.

``dgls_train.py`` prints a :class:`DGLSUserError` or a :class:`RunInterrupted` as one line
and exits; any other exception is a bug and keeps its traceback.
"""

import sys


class DGLSUserError(Exception):
    """A setting, file or machine limit the user can fix; the message says how."""


class RunInterrupted(Exception):
    """The user stopped a run (Ctrl-C) after clean-up ran; the message says what was saved and how to resume."""


class SwapWorkerError(RuntimeError):
    """The background prefetch worker failed; raised in the main thread."""


def print_line(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write. DeepSpeed's launcher starts every process with
    ``python -u``, where ``print`` writes the text and the newline separately, so the same error from three
    processes came out as ``lineline`` and two empty lines."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
