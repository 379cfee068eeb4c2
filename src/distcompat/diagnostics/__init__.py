"""Hang and desync diagnostics that name the rank: watchdog, single-rank regions, post-mortem.

The lines a training script writes::

    info = distcompat.init_distributed(device="cpu", watchdog=60)   # or: with watchdog(60):
    with distcompat.single_rank_region("eval on rank 0"):           # collectives here raise
        ...

* :func:`watchdog`: a collective that does not complete within ``timeout`` makes every rank dump
  its stacks and recent collectives, the report names the ranks that are behind, gone, or in a
  different collective, and the stuck rank raises :class:`HangError` (a ``TimeoutError``).
* :func:`single_rank_region` (also the body of ``@rank_zero_only`` functions): any collective
  inside raises :class:`SingleRankCollectiveError` at once, naming the call site.
* :func:`read_dumps` / ``distcompat diagnose DIR``: the dumps side by side after the fact.
* :func:`launch_pitfalls`: launch mistakes that end in hangs (reported by ``distcompat doctor``).

See docs/hangs.md for the symptom-by-symptom guide.
"""

from distcompat.diagnostics._config import WatchdogConfig
from distcompat.diagnostics._errors import HangError, SingleRankCollectiveError
from distcompat.diagnostics._launch_log import log_launch_pitfalls
from distcompat.diagnostics._postmortem import DumpReadError, PostMortem, read_dumps
from distcompat.diagnostics._records import CollectiveRecord
from distcompat.diagnostics._regions import in_single_rank_region, single_rank_region
from distcompat.diagnostics._report import HangReport, RankState
from distcompat.diagnostics._watchdog import Watchdog, watchdog
from distcompat.launch import Pitfall, launch_pitfalls, torchrun_prefix_pitfalls

__all__ = [
    "CollectiveRecord",
    "DumpReadError",
    "HangError",
    "HangReport",
    "Pitfall",
    "PostMortem",
    "RankState",
    "SingleRankCollectiveError",
    "Watchdog",
    "WatchdogConfig",
    "in_single_rank_region",
    "launch_pitfalls",
    "log_launch_pitfalls",
    "read_dumps",
    "single_rank_region",
    "torchrun_prefix_pitfalls",
    "watchdog",
]
