"""How soon a peer killed on another machine is named: kill-to-line across two "machines".

Usage (root, ``ip`` and ``unshare``)::

    .venv/bin/python benchmarks/bench_peer_links.py [--runs 10]

Each run starts 2 gloo ranks, each in its own network namespace and pid namespace
(``tests/_two_hosts.py``: a veth pair between them, nothing else), every default on; both
all_reduce in a loop and rank 1, 1 s in, SIGKILLs itself after writing the time
(``tests/_peer_watch_script.py loop``). Rank 0's peer watch sees its link to rank 1 close and
writes its line, stamped ``seen at``; the figure is that stamp minus the kill's (one clock: one
kernel). Prints each run's figure in ms, the median and the worst, and what rank 0's call raised.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from distcompat.peers import read_clock

ROOT = Path(__file__).resolve().parents[1]
SEEN = re.compile(r"distcompat: rank 1 \(pid \d+ on \S+\) ended \(seen at ([\d:.]+ UTC)\)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from _two_hosts import run_pair, two_nodes

    script = ROOT / "tests" / "_peer_watch_script.py"
    took: list[float] = []
    with two_nodes() as nodes:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory() as directory:
                ranks = run_pair(nodes, script, ("loop", directory), 29520 + run)
                match = SEEN.search(ranks[0].stderr)
                if match is None:
                    sys.exit(f"run {run}: no line naming rank 1\n{ranks[0].stderr[-3000:]}")
                killed = float((Path(directory) / "killed").read_text())
            took.append((read_clock(match.group(1), near=killed) - killed) * 1000)
            raised = ranks[0].stdout.strip().splitlines()[-1][:100] if ranks[0].stdout else "-"
            print(f"run {run}: {took[-1]:.1f} ms; {raised}", flush=True)
    print(f"kill to line across machines, {len(took)} runs: median "
          f"{statistics.median(took):.1f} ms, worst {max(took):.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
