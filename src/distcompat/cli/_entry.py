"""The ``distcompat`` console script's entry: ``run`` first, every other command through ``_main``.

    distcompat run torchrun --nproc-per-node=2 train.py   # exec'd without importing torch
    distcompat doctor                                      # the full parser (``_main``)

``distcompat run`` wraps every launch of a job, so it must cost what ``exec`` costs: the other
commands' parser imports torch and most of distcompat (about a second), which ``run`` never
needs. Its ``--help`` goes to the full parser, which describes it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from distcompat.cli._run import run_command

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distcompat`` console script; returns the exit code.

    Example:
        >>> main(["run"])  # no command: says what to give, exits 2
        2
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"] and args[1:2] not in (["-h"], ["--help"]):
        return run_command(args[1:])
    # Imported for the other commands only: their parser imports torch (see the docstring)
    from distcompat.cli._main import main as parse_and_run

    return parse_and_run(args)
