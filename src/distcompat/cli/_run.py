"""``distcompat run CMD [ARGS...]``: run a command with the bootstrap first on ``PYTHONPATH``.

The command line's half of :mod:`distcompat.run` (which holds the bootstrap and what it patches)::

    distcompat run torchrun --standalone --nproc-per-node=2 train.py
    distcompat run python train.py          # a Lightning script that re-launches itself
    DISTCOMPAT_RUN=off distcompat run ...   # the same command on torch's own init

The command replaces this process (``exec``): signals, exit codes and the process tree are the
command's own. Every Python process beneath inherits ``PYTHONPATH`` and so runs the bootstrap
(``distcompat/run/bootstrap/sitecustomize.py``). Python started with ``-I``, ``-E`` or ``-S``
skips it; the command line given here is checked for those flags and each is named on stderr.
``distcompat run`` imports neither torch nor the rest of distcompat (``cli._entry`` sends it
here before the other commands' parser is imported).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence

# The bootstrap's module only (standard library): `distcompat run` itself imports no torch
from distcompat.run.bootstrap.sitecustomize import HERE, RUN_VARIABLE, run_enabled, switch_error

__all__ = ["BOOTSTRAP_DIR", "prepare_environ", "python_flag_warnings", "run_command"]

#: The folder put first on ``PYTHONPATH`` (the bootstrap's ``sitecustomize.py`` is in it).
BOOTSTRAP_DIR = HERE
_FLAG_EFFECT = {
    "I": "-I (isolated mode) ignores PYTHONPATH",
    "E": "-E ignores PYTHON* variables, PYTHONPATH included",
    "S": "-S skips the site module, which runs sitecustomize",
}


def prepare_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """Return ``environ`` with the bootstrap folder first on ``PYTHONPATH`` (once).

    With ``DISTCOMPAT_RUN=off`` the environment is returned unchanged.

    Example:
        >>> prepare_environ({"PYTHONPATH": "/src"})["PYTHONPATH"] == f"{BOOTSTRAP_DIR}:/src"
        True
    """
    prepared = dict(environ)
    if not run_enabled(environ):
        return prepared
    rest = [
        entry
        for entry in environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and os.path.abspath(entry) != BOOTSTRAP_DIR
    ]
    prepared["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *rest])
    return prepared


def python_flag_warnings(command: Sequence[str]) -> list[str]:
    """Name each interpreter flag of ``command`` that keeps the bootstrap out of that process.

    Example:
        >>> python_flag_warnings(["python3", "-I", "train.py"])[0].split(": ")[1]
        '-I (isolated mode) ignores PYTHONPATH'
        >>> python_flag_warnings(["torchrun", "-I", "train.py"])
        []
    """
    name = os.path.basename(command[0]) if command else ""
    if not name.startswith("python") or name[len("python") :].strip("0123456789."):
        return []  # not an interpreter (python, python3, python3.11): its flags are its own
    found = []
    args = iter(command[1:])
    for arg in args:
        if not arg.startswith("-") or arg.startswith("--") or arg in ("-", "-m", "-c"):
            break  # the script, the module or the code: the rest is the program's
        if arg in ("-W", "-X"):
            next(args, None)  # the option's value is the next argument
            continue
        for letter in arg[1:]:
            if letter in _FLAG_EFFECT:
                found.append(
                    f"{os.path.basename(command[0])} {arg}: {_FLAG_EFFECT[letter]}: this "
                    "process (and multiprocessing children, which get the same flags) runs "
                    "torch's own init"
                )
            if letter in "WXmc":  # the rest of the argument is the option's value
                break
    return found


def run_command(command: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Exec ``command`` with the bootstrap on ``PYTHONPATH``; return an exit code if it cannot.

    2 for no command or a bad ``DISTCOMPAT_RUN`` value, 127 for a command not found; each said
    on stderr.

    Example:
        >>> run_command([], environ={})
        2
    """
    if not command:
        sys.stderr.write(
            "distcompat run: give the command to run, e.g. "
            "distcompat run torchrun --nproc-per-node=2 train.py\n"
        )
        return 2
    environ = os.environ if environ is None else environ
    error = switch_error(environ)
    if error is not None:
        sys.stderr.write(f"distcompat run: {error}\n")
        return 2
    prepared = prepare_environ(environ)
    if not run_enabled(environ):
        sys.stderr.write(f"distcompat run: {RUN_VARIABLE}=off: running the command unchanged\n")
    for warning in python_flag_warnings(command):
        sys.stderr.write(f"distcompat run: {warning}\n")
    executable = shutil.which(command[0], path=prepared.get("PATH"))
    if executable is None:
        sys.stderr.write(f"distcompat run: command not found: {command[0]}\n")
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, list(command), prepared)  # does not return: the command is the process
