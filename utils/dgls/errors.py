"""Error types that separate user mistakes from bugs.

``dgls_train.py`` prints a :class:`DGLSUserError` as one line and exits; any other
exception is a bug and keeps its traceback.
"""


class DGLSUserError(Exception):
    """A setting, file or machine limit the user can fix; the message says how."""


class SwapWorkerError(RuntimeError):
    """The background prefetch worker failed; raised in the main thread."""
