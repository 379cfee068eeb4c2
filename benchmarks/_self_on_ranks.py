"""Run the calling benchmark script again as N local rank processes and print rank 0's output.

    if args.rank:
        _rank(...)                      # the measured part, on every rank
    else:
        run_self(__file__, 2, ("--rank", "--pairs=40"))

The ranks follow torchrun's worker contract (``tests/_rank_processes.run_ranks``); a rank that
fails ends the benchmark with its stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_self(script: str, world: int, args: Sequence[str], timeout: float = 1800) -> None:
    """Run ``script`` with ``args`` on ``world`` ranks; print rank 0's stdout."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _rank_processes import run_ranks

    ended = run_ranks(Path(script), world, args=tuple(args), timeout=timeout)
    for one in ended:
        if one.returncode != 0:
            sys.exit(one.stderr[-3000:])
    print(ended[0].stdout, end="")
