"""Why a rank process could not start, told to the user: the main guard, imports, its stderr.

Rank processes are started with ``spawn``: each one runs the parent's main script again (as
``__mp_main__``) before it can receive a task. A script that calls ``run_on_ranks`` at its top
level, without ``if __name__ == "__main__":``, would start ranks from every rank; it is refused
before anything is spawned::

    check_main_guard()   # raises MainGuardError naming the script and line

Each rank's stderr goes through a pipe that the parent copies to its own stderr as it arrives
(nothing is hidden) and keeps the end of (:class:`StderrTail`), so that a rank which dies is
reported with what it printed, and :func:`startup_hint` says what that usually means.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import sys
import threading
from pathlib import Path
from types import FrameType

__all__ = ["MainGuardError", "StderrTail", "check_main_guard", "load_hint", "startup_hint"]

#: How much of a rank's stderr is kept for the error message.
_TAIL_BYTES = 8192

_GUARD_FIX = (
    'put the code that calls run_on_ranks under `if __name__ == "__main__":` (each rank process '
    "imports the main script again, because ranks are started with spawn; functions the ranks "
    "run stay at module level, outside the guard)"
)


class MainGuardError(RuntimeError):
    """``run_on_ranks`` was called from a script's top level, outside ``if __name__ == ...``."""


def _reads_name(node: ast.expr) -> bool:
    """Return True when a test reads ``__name__`` anywhere (``__name__ == "__main__" and x``).

    Lenient on purpose: a test of the guard written another way is taken as a guard, since a
    wrong refusal blocks a working script, while a missed one still ends with the rank's own
    "bootstrapping phase" error, explained by :func:`startup_hint`.
    """
    return any(isinstance(part, ast.Name) and part.id == "__name__" for part in ast.walk(node))


def _guarded(tree: ast.Module, line: int) -> bool:
    """Return True when ``line`` lies inside the body of an ``if`` that tests ``__name__``.

    The ``else`` of ``if __name__ != "__main__":`` counts too, as does an ``elif``.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _reads_name(node.test):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end:
                return True
    return False


def _main_frame(frame: FrameType | None) -> FrameType | None:
    """Return the main script's top-level frame on the current stack, if the call runs in it."""
    main = sys.modules.get("__main__")
    top_level = vars(main) if main is not None else None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is top_level:
            return frame
        frame = frame.f_back
    return None


def check_main_guard() -> None:
    """Raise :class:`MainGuardError` if the main script calls this without the main guard.

    Only a script file can be re-run by a rank (``python -c``, a REPL or a notebook has none),
    and only a call made while that script's top-level code runs is affected.
    """
    frame = _main_frame(inspect.currentframe())
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if frame is None or path is None:
        return
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return  # nothing to read: let the ranks start, their stderr will say what happened
    line = frame.f_lineno
    if not _guarded(tree, line):
        raise MainGuardError(
            f"run_on_ranks was called from the top level of {path} (line {line}) without an "
            f'`if __name__ == "__main__":` guard: {_GUARD_FIX}'
        )


def startup_hint(stderr: str) -> str:
    """Return what a rank that died while starting most likely needs, judged from its stderr."""
    if "bootstrapping phase" in stderr or "freeze_support" in stderr:
        return f"the main script started rank processes again from a rank: {_GUARD_FIX}"
    if "ModuleNotFoundError" in stderr or "ImportError" in stderr:
        return (
            "the rank process could not import a module that the main script (or the function's "
            "module) imports; ranks re-import the main script, so it must import cleanly from the "
            "same directory and environment"
        )
    if not stderr.strip():
        return "it printed nothing to stderr (killed by a signal, or out of memory?)"
    return "its stderr is below"


def load_hint(exc: BaseException) -> str:
    """Explain a task the rank could not unpickle: usually a function it cannot import."""
    text = f"{type(exc).__name__}: {exc}"
    if "__mp_main__" in text or isinstance(exc, AttributeError):
        return (
            f"the rank process could not load the function ({text}); define it at module level "
            'of the main script (outside `if __name__ == "__main__":`) or of an importable '
            "module; not in a notebook cell, a REPL, or inside another function"
        )
    if isinstance(exc, ImportError):
        return (
            f"the rank process could not import the function's module ({text}); it must be "
            "importable from the rank process's directory and environment"
        )
    return f"the rank process could not unpickle the task ({text})"


class StderrTail:
    """Copy a child's stderr (a pipe) to ours as it arrives, keeping its last bytes."""

    def __init__(self, read_fd: int, copy_to: int) -> None:
        self._fd = read_fd
        self._copy_to = copy_to
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="distcompat-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            while chunk := os.read(self._fd, 65536):
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-_TAIL_BYTES]
                with contextlib.suppress(OSError):  # our stderr is gone: keep collecting the tail
                    os.write(self._copy_to, chunk)
        finally:
            os.close(self._fd)

    def text(self, wait_s: float = 1.0) -> str:
        """Return the tail so far, after giving the pipe ``wait_s`` to reach its end."""
        self._thread.join(wait_s)
        with self._lock:
            return self._tail.decode(errors="replace")
