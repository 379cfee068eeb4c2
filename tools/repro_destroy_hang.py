"""Reproduce the intermittent destroy_process_group hang seen with gloo on torch 2.4.1.

    .nox/torch_versions-torch_version-2-4-1/bin/python tools/repro_destroy_hang.py 25

Runs the process-group tests' adopt and re-init bodies in a loop on 2- and 3-rank groups and counts
the calls that hang (killed after 20 s). Measured 2026-11-21: torch 2.4.1, 10 hangs in 50 cycles;
torch 2.13, 0 in 30. Later, under load: 2.5.1 21 in 50, 2.6.0 12 in 16, 2.8.0 0 in 16, 2.13 0 in 20
(table in docs/launching.md). A bounded barrier before destroy_process_group cut 2.4.1 to 2 in 50,
and the rest hung inside destroy_process_group itself, so the barrier was not adopted (it would make
every destroy wait for absent peers).
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from distcompat.testing import RankTimeoutError, run_on_ranks
from test_process_group import _adopt, _cpu_on_cuda_host


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    hangs = 0
    started = time.time()
    for cycle in range(cycles):
        for world_size in (2, 3):
            try:
                run_on_ranks(_adopt, world_size, args=(uuid.uuid4().hex,), timeout=20)
                run_on_ranks(_cpu_on_cuda_host, world_size, timeout=20)
            except RankTimeoutError as exc:
                hangs += 1
                print(f"hang: cycle {cycle}, {world_size} ranks: {str(exc).splitlines()[0]}")
    print(f"{hangs} hangs in {cycles * 2} cycles, {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
