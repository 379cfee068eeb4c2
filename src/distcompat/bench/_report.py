"""What ``distcompat bench`` shows: a header saying what was measured, the table, JSON and a plot.

Rank 0 writes them after :func:`~distcompat.bench._measure.measure`::

    report = BenchReport(header=BenchHeader(...), rows=rows)
    print(report.table()); report.write_json(Path("bench.json")); plot_busbw(report, path)

The plot needs matplotlib (the ``bench`` extra); :func:`require_matplotlib` says so before any
rank starts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from distcompat._extras import MissingExtraError, require
from distcompat._files import atomic_write_bytes
from distcompat.bench._stats import BenchRow, format_bytes

__all__ = ["EXTRA", "BenchHeader", "BenchReport", "MissingExtraError", "plot_busbw"]

#: The pip extra that brings matplotlib for ``--plot``.
EXTRA = "bench"

#: Which calls are timed, for the header: the path a user's code takes through distcompat.
PATH = (
    "distcompat.collectives (what distcompat.distributed and your training code call), "
    "not raw torch.distributed"
)


def require_matplotlib() -> None:
    """Raise :class:`MissingExtraError` unless matplotlib can be imported.

    Example:
        >>> try:
        ...     require_matplotlib()
        ... except MissingExtraError as exc:
        ...     "distcompat[bench]" in str(exc)
        ... else:
        ...     True
        True
    """
    require("matplotlib", extra=EXTRA, feature="--plot draws", without="--plot")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchHeader:
    """The group that was measured and how."""

    world_size: int
    num_nodes: int
    launcher: str
    backend: str | None
    device: str
    dtype: str
    iterations: int
    warmup: int
    torch_version: str
    path: str = PATH
    compared: bool = False  # --compare-shm: a shared-memory row and a gloo row per op and size

    def describe(self) -> str:
        """Return the lines printed above the table, each starting with ``#``."""
        lines = [
            f"# distcompat bench: {self.world_size} ranks on {self.num_nodes} node(s) "
            f"({self.launcher}), backend {self.backend}, device {self.device}, "
            f"{self.dtype}, torch {self.torch_version}",
            f"# calls: {self.path}",
            f"# latency: p50/p95 over {self.iterations} calls after {self.warmup} warm-up, "
            "each call timed on its slowest rank; size = the op's whole buffer",
            "# algbw = size / p50; busbw = algbw * nccl-tests' factor (all_reduce 2(n-1)/n; "
            "all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast 1)",
        ]
        if self.compared:
            lines.append(
                "# paths: each call through shared memory and through gloo in turn "
                "(DISTCOMPAT_SHM=on / off for it); speedup = gloo p50 / shared-memory p50; "
                "ops the path does not carry go to gloo both times"
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchReport:
    """The header and one row per op and size."""

    header: BenchHeader
    rows: list[BenchRow]

    def table(self) -> str:
        """Return the header, then a fixed-width table (GB/s = 1e9 bytes per second).

        Example:
            >>> row = BenchRow.from_times("broadcast", nbytes=1024, count=256, world_size=2,
            ...     times_s=[1e-5])
            >>> header = BenchHeader(world_size=2, num_nodes=1, launcher="env", backend="gloo",
            ...     device="cpu", dtype="float32", iterations=1, warmup=0, torch_version="2")
            >>> print(BenchReport(header=header, rows=[row]).table().splitlines()[-1])
            broadcast                  1 KiB         256      10.0      10.0     0.102     0.102
        """
        paths = any(r.path for r in self.rows)
        head = (
            f"{'op':<22} {'size':>9} {'count':>11} {'p50 us':>9} {'p95 us':>9} "
            f"{'algbw':>9} {'busbw':>9}"
        )
        lines = [self.header.describe(), head + (f" {'path':<14} {'speedup':>8}" if paths else "")]
        gloo = {(r.op, r.nbytes): r.p50_us for r in self.rows if r.path == "gloo"}
        for r in self.rows:
            line = (
                f"{r.op:<22} {format_bytes(r.nbytes):>9} {r.count:>11} {r.p50_us:>9.1f} "
                f"{r.p95_us:>9.1f} {r.algbw_gbps:>9.3f} {r.busbw_gbps:>9.3f}"
            )
            if paths:
                base = gloo.get((r.op, r.nbytes))
                ratio = "" if r.path == "gloo" or not base else f"{base / r.p50_us:.2f}x"
                line += f" {r.path:<14} {ratio:>8}"
            lines.append(line)
        return "\n".join(lines)

    def to_json(self) -> str:
        """``{"header": {...}, "rows": [{...}, ...]}``, bandwidths in GB/s, latencies in us."""
        return json.dumps(
            {"header": asdict(self.header), "rows": [asdict(r) for r in self.rows]}, indent=1
        )

    def write_json(self, path: Path) -> Path:
        """Write :meth:`to_json` to ``path`` atomically; return the path."""
        atomic_write_bytes(path, (self.to_json() + "\n").encode())
        return path


def plot_busbw(report: BenchReport, path: Path) -> Path:
    """Draw busbw against size, one line per op, to ``path`` (PNG, SVG, ... from its suffix).

    Example:
        >>> plot_busbw(report, Path("busbw.png"))  # doctest: +SKIP
        PosixPath('busbw.png')
    """
    require_matplotlib()
    # Optional dependency (the bench extra). Figure is the Agg canvas: no display, no pyplot state.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0, 4.0), dpi=120)
    axes = figure.add_subplot()
    for op in dict.fromkeys(r.op for r in report.rows):
        rows = [r for r in report.rows if r.op == op]
        axes.plot([r.nbytes for r in rows], [r.busbw_gbps for r in rows], marker="o", label=op)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    head = report.header
    axes.set_title(f"{head.world_size} ranks, {head.backend} on {head.device}", fontsize=9)
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
