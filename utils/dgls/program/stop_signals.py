"""How a DGLS process stops when it is asked to: SIGTERM like Ctrl-C, once, also when its launcher is gone.

Python ends a process on SIGTERM at once, without running ``finally`` blocks or printing anything: no
clean-up (DeepSpeed's /dev/shm buffer stays, a half-written save stays) and no line saying what was
saved. The deepspeed launcher stops its processes with SIGTERM (right after the Ctrl-C they also got from
the terminal, or when one of them failed), as schedulers and ``kill`` do. :class:`StopSignals` turns
SIGTERM into what Ctrl-C is, a ``KeyboardInterrupt`` in the main thread, so the same clean-up and the same
one line follow.

What it cannot change is deepspeed's own launcher: Ctrl-C prints the ``deepspeed`` command's
``KeyboardInterrupt`` traceback (it waits for launch.py without a handler), and SIGTERM or Ctrl-C sent to
that command alone ends only it (on one machine it passes nothing on), leaving launch.py and every process
of the job running. For that case, each process watches its launcher and stops as on SIGTERM once the
``deepspeed`` command is gone; launch.py then sees a process fail and ends the others and itself.

Hazard: the processes' watches look once a second each, so the first to see the command gone stops, and another
one may then fail in a collective whose partner just left (gloo: "Connection closed by peer") before its own watch
looks. That failure is the same stop, not a bug: :meth:`StopSignals.stopping` looks at the launcher at once, and the
entry point and a trainer (:func:`stops_as`) that catch a failure ask it before printing a traceback. The watch's
own SIGTERM may land while that failure is handled; once :meth:`StopSignals.stopping` has said the run stops, it
raises nothing more.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_HANDLERS = (signal.SIG_DFL, signal.default_int_handler)
LAUNCH_MODULE = "deepspeed.launcher.launch"  # launch.py, started by the `deepspeed` command on each machine
WATCH_S = 1.0  # how often the launcher is looked at


class StopSignals:
    """A context manager around a whole run (``dgls_train.py``'s entry point).

    * SIGTERM raises ``KeyboardInterrupt`` in the main thread, as SIGINT does;
    * once a stop signal has arrived, SIGTERM is ignored, so the launcher's SIGTERM after the terminal's
      Ctrl-C cannot cut the clean-up short (a second Ctrl-C still interrupts it);
    * only default handlers are replaced: a signal that whoever started the process ignores (nohup, a
      background job) stays ignored; outside the main thread nothing is installed;
    * a process forked from this one (a multiprocessing pool's worker, which the pool ends with SIGTERM)
      gets Python's default behaviour back, not a KeyboardInterrupt and its traceback;
    * under deepspeed's launch.py, a daemon thread sends this process SIGTERM once the ``deepspeed`` command
      that started launch.py is gone (launch.py has a new parent, or is gone itself); :meth:`stopping` looks at
      once, for a failure that may be the stop's;
    * once :meth:`stopping` said True, a first stop signal still landing (the watch's) raises nothing: the run is
      already on its way out (one exception, one line);
    * on exit the handlers from before are back and the watch thread stops.

    Invariant: the watch sends its SIGTERM only while neither a stop signal arrived nor :meth:`stopping` found the
    launcher gone (decided under ``_lock``), so one stop never raises twice.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal
        self.launcher_gone = False
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()  # the watch's SIGTERM against stopping()'s look: one of them decides
        self._decided = False  # stopping() said True: a stop signal landing later raises nothing
        self._launcher: Callable[[], bool] | None = None  # whether the deepspeed command is gone, looked at now

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            current = signal.getsignal(signum)
            if current in DEFAULT_HANDLERS:
                self._previous[signum] = current
                signal.signal(signum, self._handle)
        if signal.SIGTERM in self._previous:
            self._watch_launcher()
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child: what Python does by default
            signal.signal(signum, self._previous[signum])
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum
            if self._decided:  # the watch's SIGTERM, after stopping() found the launcher gone: already stopping
                return
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def stopping(self) -> bool:
        """Whether this run is stopping: a stop signal arrived, or its deepspeed command is gone (looked at now, not
        at the watch's next look). Once True, a stop signal still on its way (the watch's SIGTERM) raises nothing.
        Called from the main thread, where a failure is handled: the watch's SIGTERM may land during this call, as a
        ``KeyboardInterrupt`` its caller counts as True."""
        if self.received is not None:
            return True
        with self._lock:
            if not self.launcher_gone and self._launcher is not None and self._launcher():
                self.launcher_gone = True
                self.received = signal.SIGTERM  # as the watch's SIGTERM would have: the same line and exit code
            if self.launcher_gone:  # found now, or the watch's SIGTERM is on its way
                self._decided = True
        return self.received is not None or self.launcher_gone

    @property
    def how(self) -> str:
        """How the run was stopped, for its one line."""
        if self.launcher_gone:
            return "terminated (the deepspeed command that started this job is gone)"
        return "terminated (SIGTERM)" if self.received == signal.SIGTERM else "interrupted"

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by the signal: 128 + its number (130 for Ctrl-C)."""
        return 128 + (self.received or (signal.SIGTERM if self.launcher_gone else signal.SIGINT))

    def _watch_launcher(self) -> None:
        import psutil

        try:
            launch = psutil.Process(os.getppid())
            if LAUNCH_MODULE not in launch.cmdline():
                return
            command = launch.ppid()
        except psutil.Error:
            return

        def gone() -> bool:
            try:
                return launch.ppid() != command
            except psutil.Error:
                return True

        def watch() -> None:
            while not self._done.wait(WATCH_S):
                if gone():
                    with self._lock:
                        if self.received is None and not self.launcher_gone:
                            self.launcher_gone = True
                            os.kill(os.getpid(), signal.SIGTERM)
                    return

        self._launcher = gone
        threading.Thread(target=watch, name="dgls-launcher-watch", daemon=True).start()


def stop_signal_received() -> bool:
    """Whether a stop signal has reached this process's :class:`StopSignals` (the one whose handler is
    installed now); False where none is installed (outside ``dgls_train.py``'s entry point, or in a thread).

    Why: code deep in a run (the demo's muted DeepSpeed start-up) must tell a failure that a stop signal
    caused (Ctrl-C stops the compiler DeepSpeed waits on, which then raises ``RuntimeError``) from a bug,
    and the entry point's object is not passed down that far. The installed handler is the process's own
    record of which object handles its signals, so no module-level state is kept for this.
    """
    stop = _installed()
    return stop is not None and stop.received is not None


@contextmanager
def stops_as(interrupted: Callable[[], Exception]) -> Iterator[None]:
    """A trainer's run: a stop becomes ``interrupted()`` (its :class:`~..errors.RunInterrupted`, which says what was
    saved): Ctrl-C or SIGTERM (``KeyboardInterrupt``), and a failure while this process is stopping
    (:meth:`StopSignals.stopping`: a collective whose partner saw the deepspeed command gone first). Any other
    failure goes on as it is (a bug keeps its traceback); so does everything where no :class:`StopSignals` is
    installed. The watch's SIGTERM may land while the failure is handled, at ``stopping()``'s call: it is the same
    stop."""
    try:
        yield
    except KeyboardInterrupt:
        raise interrupted() from None
    except Exception:
        stop = _installed()
        try:
            stopping = stop is not None and stop.stopping()
        except KeyboardInterrupt:  # the launcher watch's SIGTERM, landing here
            stopping = True
        if not stopping:
            raise
        raise interrupted() from None


def _installed() -> StopSignals | None:
    """The :class:`StopSignals` whose handler is installed now (the process's own record of it), or None."""
    for signum in STOP_SIGNALS:
        owner = getattr(signal.getsignal(signum), "__self__", None)
        if isinstance(owner, StopSignals):
            return owner
    return None
