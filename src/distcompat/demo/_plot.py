"""The ``--sweep`` plot: tokens/s for 1..N ranks, drawn with matplotlib (an optional extra).

The two lines the CLI writes::

    require_matplotlib()                         # before any rank starts: fail fast, name the extra
    plot_scaling(points, out / "scaling.png")    # points: [(ranks, tokens_per_sec), ...]
"""

from __future__ import annotations

from pathlib import Path

from distcompat._extras import MissingExtraError, require

__all__ = ["EXTRA", "MissingExtraError", "plot_scaling", "require_matplotlib"]

#: The pip extra that brings matplotlib for the plot.
EXTRA = "demo"


def require_matplotlib() -> None:
    """Raise :class:`MissingExtraError` unless matplotlib can be imported.

    Example:
        >>> try:
        ...     require_matplotlib()
        ... except MissingExtraError as exc:
        ...     "distcompat[demo]" in str(exc)
        ... else:
        ...     True
        True
    """
    require("matplotlib", extra=EXTRA, feature="--sweep draws scaling.png", without="--sweep")


def plot_scaling(points: list[tuple[int, float]], path: Path) -> Path:
    """Draw tokens/s against the number of ranks, with the ideal linear line from 1 rank.

    Example:
        >>> plot_scaling([(1, 1000.0), (2, 1800.0)], Path("scaling.png"))  # doctest: +SKIP
        PosixPath('scaling.png')
    """
    require_matplotlib()
    # Optional dependency (the demo extra). Figure is the Agg canvas: no display, no global backend.
    from matplotlib.figure import Figure

    ranks = [n for n, _ in points]
    rates = [rate for _, rate in points]
    base = dict(points).get(1)
    figure = Figure(figsize=(5.0, 3.5), dpi=120)
    axes = figure.add_subplot()
    axes.plot(ranks, rates, marker="o", label="measured")
    if base is not None:
        axes.plot(ranks, [base * n for n in ranks], linestyle="--", color="grey", label="linear")
    for n, rate in points:
        label = f"{rate:,.0f}" + (f" ({rate / base:.2f}x)" if base else "")
        axes.annotate(label, (n, rate), textcoords="offset points", xytext=(4, -12), fontsize=8)
    axes.set_xlabel("ranks (gloo processes on this machine)")
    axes.set_ylabel("tokens / s")
    axes.set_xticks(ranks)
    axes.set_ylim(bottom=0)
    axes.set_title("distcompat demo: throughput vs ranks")
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    return path
