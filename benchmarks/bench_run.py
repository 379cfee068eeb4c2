"""What ``distcompat run`` adds to a Python process that never imports torch (issue 48).

Usage::

    .venv/bin/python benchmarks/bench_run.py [--pairs 40]

Two measurements, each of paired fresh processes in alternating order, the median of the
per-pair differences (and of each side):

* **per process**: ``python -c pass`` with and without the bootstrap folder first on
  ``PYTHONPATH``: what every Python process beneath ``distcompat run`` pays (its
  ``sitecustomize`` adds a finder and looks for a shadowed ``sitecustomize``). The goal of
  issue 48 is under 5 ms;
* **once per command**: ``distcompat run python -c pass`` against ``python -c pass``: the
  wrapper's own start (an interpreter, ``distcompat.cli._run``, then ``exec``).

The bootstrap is compiled to bytecode first (``compileall``), as ``pip install`` does.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import time

from distcompat.run import BOOTSTRAP_DIR


def _seconds(command: list[str], environ: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, env=environ, check=True, capture_output=True)
    return time.perf_counter() - started


def _paired(
    pairs: int,
    plain: list[str],
    wrapped: list[str],
    plain_env: dict[str, str],
    wrapped_env: dict[str, str],
) -> tuple[float, float, float]:
    """Medians (ms) of the plain side, the wrapped side and the per-pair difference."""
    a, b, diff = [], [], []
    for pair in range(pairs):
        if pair % 2:
            y = _seconds(wrapped, wrapped_env)
            x = _seconds(plain, plain_env)
        else:
            x = _seconds(plain, plain_env)
            y = _seconds(wrapped, wrapped_env)
        a.append(x)
        b.append(y)
        diff.append(y - x)
    return tuple(1000 * statistics.median(v) for v in (a, b, diff))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    options = parser.parse_args()
    compileall.compile_dir(BOOTSTRAP_DIR, quiet=1)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DISTCOMPAT_RUN")}
    with_bootstrap = dict(base, PYTHONPATH=BOOTSTRAP_DIR)
    python = [sys.executable, "-c", "pass"]
    for _ in range(3):  # warm the file cache
        _seconds(python, with_bootstrap)
    plain, wrapped, diff = _paired(options.pairs, python, python, base, with_bootstrap)
    print(f"per process ({options.pairs} pairs): python -c pass {plain:.1f} ms, with the "
          f"bootstrap {wrapped:.1f} ms, difference (median of pairs) {diff:+.2f} ms")  # fmt: skip
    script = shutil.which("distcompat", path=os.path.dirname(sys.executable))
    if script is None:
        raise SystemExit("no distcompat console script next to this python: pip install -e .")
    plain, wrapped, diff = _paired(options.pairs, python, [script, "run", *python], base, base)
    print(f"once per command ({options.pairs} pairs): python -c pass {plain:.1f} ms, "
          f"distcompat run python -c pass {wrapped:.1f} ms, difference {diff:+.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
