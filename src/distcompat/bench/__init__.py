"""``distcompat bench``: measure your own group's collectives the way nccl-tests does.

Ops x sizes, p50/p95 latency, algbw and busbw (nccl-tests' factors), through distcompat's
collectives, under any launcher or on local ranks it starts itself::

    distcompat bench --quick                                   # 2 local ranks, a few seconds
    torchrun --nproc-per-node=4 --no-python distcompat bench --json bench.json

From Python, on a group that exists (every rank calls it)::

    rows = distcompat.bench.measure(BenchConfig(sizes=[1 << 20]), device=info.device)

``_stats`` holds the arithmetic (sizes, percentiles, bus factors), ``_measure`` the timing loop,
``_report`` the table / JSON / plot, ``_spawn`` the local ranks, ``_cli`` the subcommand.
"""

from distcompat.bench._measure import BenchConfig, measure
from distcompat.bench._report import BenchHeader, BenchReport, MissingExtraError, plot_busbw
from distcompat.bench._stats import OPS, BenchRow, bus_factor, geometric_sizes, percentile

__all__ = [
    "OPS",
    "BenchConfig",
    "BenchHeader",
    "BenchReport",
    "BenchRow",
    "MissingExtraError",
    "bus_factor",
    "geometric_sizes",
    "measure",
    "percentile",
    "plot_busbw",
]
