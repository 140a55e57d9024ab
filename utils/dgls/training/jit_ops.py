"""DeepSpeed's C++ ops that are compiled on first use: said before the build, and a lock left by a killed
build refused in one line instead of waited on forever.

An op the DeepSpeed wheel does not carry is compiled the first time it is loaded, by torch's
``cpp_extension.load``, into ``<extensions folder>/<op name>/`` (``TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions/py<version>_<cpu|cuXYZ|rocmXYZ>``). torch takes a ``lock`` file in that folder
for every load, built or not: it creates the file, keeps it open while it builds, and deletes it after;
a process that finds the file polls it, with no time limit. A build that was killed (Ctrl-C at the
wrong moment, a closed terminal, an out-of-memory kill) leaves the file, and every later run waits on
it without a word. DGLS mutes DeepSpeed's start-up output, so a first build (minutes) was silent too.

:func:`before_loading` runs just before DGLS makes DeepSpeed load such an op (``--host_adam deepspeed``'s
``DeepSpeedCPUAdam``; DeepSpeed's CPU communication op is kept out of runs altogether, :mod:`..trainers.shm_op`):

- a lock that no running process holds open: :class:`DGLSUserError` naming the file to delete;
- a lock a running process holds (another run is building the op): one line saying whose build this run
  waits for;
- no library built yet: one line saying what is compiled, where, and that it takes minutes.

:func:`refuse_stale_lock` is the stale-lock refusal alone, without importing DeepSpeed, for the checks
that run before anything starts (``--host_adam deepspeed`` in a full fine-tune: a stale lock is refused
before DeepSpeed starts and places layers; the "compiling" line stays with :func:`before_loading`).

Invariants: nothing is deleted or built here; an op the wheel carries, or one this process loaded
already, is left alone (DeepSpeed takes no lock for them).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import DGLSUserError, print_line


def _say(line: str) -> None:
    print_line(line)  # stderr: DGLS mutes DeepSpeed's stdout while it starts


def before_loading(builder_name: str, log: Callable[[str], None] = _say) -> None:
    """Check the build folder of the DeepSpeed op whose builder class is ``builder_name`` (for example
    ``"CPUAdamBuilder"``), and say what will happen, before DeepSpeed loads it."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or installed_ops.get(builder.name, False) or builder.name in OpBuilder._loaded_ops:
        return
    folder = build_folder(builder.name)
    lock = folder / "lock"
    if lock.exists():
        holders = lock_holders(lock)
        if holders == []:
            raise _stale(lock, builder.name)
        if holders is None:  # no /proc: whether a build is running cannot be seen
            log(
                f"DGLS: waiting for {lock}: another run may be building DeepSpeed's {builder.name} op (if none is, "
                "stop this run and delete the file)"
            )
        else:
            pids = ", ".join(map(str, holders))
            log(f"DGLS: waiting for process {pids} to finish building DeepSpeed's {builder.name} op ({lock})")
    elif not any(folder.glob(f"{builder.name}*.so")):
        log(
            f"DGLS: compiling DeepSpeed's {builder.name} op into {folder} (C++, once per machine and DeepSpeed "
            "version; minutes on a small CPU)"
        )


def refuse_stale_lock(op_name: str) -> None:
    """Refuse a lock that no running process holds in the build folder of the DeepSpeed op ``op_name`` (its
    builder's ``NAME``, for example ``"cpu_adam"``), without importing DeepSpeed; an op the installed wheel
    carries is left alone. A lock some process holds passes: :func:`before_loading` says whose build the run
    waits for."""
    if op_in_wheel(op_name):
        return
    lock = build_folder(op_name) / "lock"
    if lock.exists() and lock_holders(lock) == []:
        raise _stale(lock, op_name)


def op_in_wheel(op_name: str) -> bool:
    """Whether the installed DeepSpeed was built with ``op_name`` (its setup.py writes ``installed_ops`` into
    ``git_version_info_installed.py``), read without importing DeepSpeed; False where that cannot be read
    (DeepSpeed then compiles the op on first use)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
        origin = Path(spec.origin).parent / "git_version_info_installed.py"  # type: ignore[union-attr, arg-type]
        tree = ast.parse(origin.read_text(encoding="utf-8"))
    except (ImportError, AttributeError, TypeError, ValueError, OSError, SyntaxError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "installed_ops" for t in node.targets):
            try:
                return bool(ast.literal_eval(node.value).get(op_name, False))
            except (ValueError, AttributeError):
                return False
    return False


def _stale(lock: Path, op_name: str) -> DGLSUserError:
    return DGLSUserError(
        f"{lock} is left from a build of DeepSpeed's {op_name} op that was stopped, and every run "
        f"would wait for it forever: delete it (rm {lock}) and start again"
    )


def build_folder(name: str) -> Path:
    """Where torch builds the extension ``name`` (created if missing, as torch does before it builds)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def lock_holders(lock: Path, proc: Path = Path("/proc")) -> list[int] | None:
    """The processes that hold ``lock`` open (torch's builder does while it builds); None where that
    cannot be seen (no /proc)."""
    if not proc.is_dir():
        return None
    target = str(lock.resolve())
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders
