"""A lost rank in place: kill to the next committed step, and the cost per step of InPlace.

Usage::

    .venv/bin/python benchmarks/bench_inplace.py [--runs 5] [--worlds 2 3 4] [--steps 40]

* **recovery**: ``tests/_inplace_script.py`` (exact mode, the hand-written loop) on W gloo ranks
  started as a launcher does (the store in this process, as in torchrun's agent); the last rank
  SIGKILLs itself at the start of step 5 after writing the time. The figure is rank 0's commit
  of that step, redone at W - 1 ranks, minus the kill (one clock: one machine), and rank 0's
  own account of the regroup (agree, group, state). Median and worst of ``--runs``.
* **grow**: the same job at W ranks with the last rank SIGKILLed at step 2 and started again
  by the harness as torchrun's agent does (``--max-restarts``); the figure is the time from the
  replacement's process start (imports included) to its first committed step, and rank 0's
  account of the grow. The steps wait 0.4 s while the group is short (``--pace``).
* **per step**: the same job with no rank lost, with ``InPlace`` and without it (``--plain``,
  the same loop bare), alternated in one run: rank 0's loop time over ``--steps`` steps, and the
  ratio of the medians.
* **recovery, sharded state**: the recovery job with ``--zero`` (the demo's ZeroAdamW under
  ``shard_copies``, float mode): the survivors re-cut the shares from the copies.
* **per step, sharded state**: the demo (its GPT, the sharded ZeroAdamW, 2 ranks) with
  ``--in-place`` (``shard_copies``: each rank's share sent to the next after every step) and
  without, alternated: the median step time, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_inplace_script.py"
KILL_STEP = 5


def _value(text: str, rank: int, what: str) -> list[str]:
    return re.findall(rf"rank {rank}: {what} (\S+)", text)


def recovery(world: int, runs: int, extra: tuple[str, ...] = ()) -> None:
    from _rank_processes import run_ranks

    killed = world - 1
    took, parts = [], []
    for _ in range(runs):
        args = ("--steps", "8", "--kill", f"{killed}@{KILL_STEP}", *extra)
        ranks = run_ranks(SCRIPT, world, args=args, timeout=120)
        (kill,) = _value(ranks[killed].stdout, killed, "killed at")
        commits = re.findall(r"rank 0: committed (\d+) (\S+)", ranks[0].stdout)
        redone = [float(t) for step, t in commits if int(step) == KILL_STEP + 1]
        if ranks[0].returncode != 0 or not redone:
            print(f"  world {world}: FAILED\n{ranks[0].stderr[-2000:]}")
            return
        took.append(redone[0] - float(kill))
        said = re.search(r"(\d+) ms: agree (\d+), regroup (\d+), state (\d+)\)", ranks[0].stderr)
        parts.append(said.groups() if said else ("?", "?", "?", "?"))
    ms = sorted(t * 1e3 for t in took)
    print(
        f"  {world} -> {world - 1} ranks{' '.join(('', *extra))}: kill to the next committed "
        f"step median "
        f"{statistics.median(ms):.0f} ms, worst {ms[-1]:.0f} ms (runs: "
        f"{', '.join(f'{t:.0f}' for t in ms)}); rank 0's regroup (total/agree/group/state ms): "
        f"{'; '.join('/'.join(p) for p in parts)}"
    )


def grow(world: int, runs: int) -> None:
    from _rank_processes import run_ranks

    killed = world - 1
    took, parts = [], []
    for _ in range(runs):
        args = ("--steps", "40", "--kill", f"{killed}@2", "--pace", "0.4")
        ranks = run_ranks(SCRIPT, world, args=args, timeout=120, restart=(killed,))
        replacement = ranks[world]
        (started,) = _value(replacement.stdout, killed, "started")
        commits = re.findall(rf"rank {killed}: committed \d+ (\S+)", replacement.stdout)
        if replacement.returncode != 0 or not commits:
            print(f"  world {world}: FAILED\n{replacement.stderr[-2000:]}")
            return
        took.append(float(commits[0]) - float(started))
        said = re.findall(r"(\d+) ms: agree (\d+), regroup (\d+), state (\d+)\)", ranks[0].stderr)
        parts.append(said[-1] if said else ("?", "?", "?", "?"))
    seconds = sorted(took)
    print(
        f"  {world - 1} -> {world} ranks: replacement start to its first committed step median "
        f"{statistics.median(seconds):.2f} s, worst {seconds[-1]:.2f} s (runs: "
        f"{', '.join(f'{t:.2f}' for t in seconds)}); rank 0's grow (total/agree/group/state ms): "
        f"{'; '.join('/'.join(p) for p in parts)}"
    )


def per_step(world: int, runs: int, steps: int) -> None:
    from _rank_processes import run_ranks

    times: dict[str, list[float]] = {"InPlace": [], "bare loop": []}
    for run in range(runs):
        pairs = (("InPlace", ()), ("bare loop", ("--plain",)))
        for name, extra in pairs if run % 2 else pairs[::-1]:  # each first in half the runs
            ranks = run_ranks(SCRIPT, world, args=("--steps", str(steps), *extra), timeout=300)
            (loop,) = _value(ranks[0].stdout, 0, "loop_s")
            times[name].append(float(loop))
    medians = {name: statistics.median(found) for name, found in times.items()}
    print(
        f"  {world} ranks, {steps} steps, no rank lost: InPlace "
        f"{medians['InPlace'] / steps * 1e3:.2f} ms/step, bare loop "
        f"{medians['bare loop'] / steps * 1e3:.2f} ms/step, ratio "
        f"{medians['InPlace'] / medians['bare loop']:.3f}"
    )


def sharded_per_step(runs: int, steps: int) -> None:
    """The demo (2 ranks, its GPT, ZeroAdamW) with ``--in-place`` (InPlace keeps each rank's
    share on the next rank after every step: ``shard_copies``) and without, alternated: the
    median step time of each run past its first 10 steps, and the ratio of the medians."""
    times: dict[str, list[float]] = {"copies": [], "bare": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            pairs = (("copies", ("--in-place",)), ("bare", ()))
            for name, extra in pairs if run % 2 else pairs[::-1]:
                out = Path(tmp) / f"{name}{run}"
                command = [sys.executable, "-m", "distcompat", "demo", "--out", str(out)]
                subprocess.run([*command, "--steps", str(steps), *extra], check=True,
                               capture_output=True, cwd=tmp)  # fmt: skip
                rows = [json.loads(line) for line in (out / "timings.jsonl").open()]
                step_ms = [row["step_ms"] for row in rows if "step_ms" in row][10:]
                times[name].append(statistics.median(step_ms))
    medians = {name: statistics.median(found) for name, found in times.items()}
    print(
        f"  demo GPT, ZeroAdamW, 2 ranks, {steps} steps: shard copies "
        f"{medians['copies']:.1f} ms/step, without {medians['bare']:.1f} ms/step, ratio "
        f"{medians['copies'] / medians['bare']:.3f} (runs: copies "
        f"{', '.join(f'{t:.1f}' for t in times['copies'])}; without "
        f"{', '.join(f'{t:.1f}' for t in times['bare'])})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    print(f"torch {torch.__version__}")
    print("recovery:")
    for world in args.worlds:
        recovery(world, args.runs)
    print("grow:")
    for world in args.worlds:
        grow(world, args.runs)
    print("per step:")
    per_step(2, args.runs, args.steps)  # 3 ranks on 2 cores: +-10 % between runs of one mode
    print("per step, sharded state:")
    sharded_per_step(args.runs, 100)
    print("recovery, sharded state (ZeroAdamW, shard_copies):")
    for world in args.worlds:
        recovery(world, args.runs, ("--zero",))


if __name__ == "__main__":
    main()
