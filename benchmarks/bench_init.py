"""The drop-in's start-up against torch's: ``import`` + ``init_process_group`` + ``destroy``.

Usage::

    .venv/bin/python benchmarks/bench_init.py [--pairs 15]

Each pair starts two fresh processes of one rank (``RANK=0``, ``WORLD_SIZE=1``, a free
``MASTER_PORT``), one per flavour, in alternating order: ``torch`` runs
``import torch.distributed as dist; dist.init_process_group("gloo"); dist.destroy_process_group()``
and ``distcompat`` the same with ``import distcompat.distributed as dist``. The time is the
process's wall clock from start to exit. Prints the median of each flavour and the median of the
per-pair ratios (distcompat / torch: below 1.05 is the goal of issue 40).

distcompat's modules are compiled to bytecode first (``compileall``), as ``pip install`` does
for an installed package and did for torch's: from an editable checkout where nothing writes
bytecode (``PYTHONDONTWRITEBYTECODE=1``, as on the project's VMs) every start compiles about
60 modules again, some 15-40 ms that no installed distcompat pays. ``--no-compile`` measures
that case instead.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

BODY = "import {module} as dist\ndist.init_process_group('gloo')\ndist.destroy_process_group()\n"
FLAVOURS = {"torch": "torch.distributed", "distcompat": "distcompat.distributed"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _one(flavour: str) -> float:
    """Seconds one fresh process takes to import, init one rank, destroy and exit."""
    environ = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    code = BODY.format(module=FLAVOURS[flavour])
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=environ, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true", help="leave the bytecode as it is")
    args = parser.parse_args()
    if not args.no_compile:
        import compileall

        import distcompat

        compileall.compile_dir(Path(distcompat.__file__).parent, quiet=1)
    _one("torch"), _one("distcompat")  # warm the page cache for both
    times: dict[str, list[float]] = {name: [] for name in FLAVOURS}
    ratios: list[float] = []
    for index in range(args.pairs):
        order = list(FLAVOURS) if index % 2 == 0 else list(reversed(FLAVOURS))
        took = {name: _one(name) for name in order}
        for name, seconds in took.items():
            times[name].append(seconds)
        ratios.append(took["distcompat"] / took["torch"])
    for name, runs in times.items():
        print(f"{name:<11} median {statistics.median(runs):.3f} s over {args.pairs} runs")
    low, high = min(ratios), max(ratios)
    print(
        f"distcompat / torch: median {statistics.median(ratios):.3f}x (pairs {low:.3f}-{high:.3f})"
    )


if __name__ == "__main__":
    main()
