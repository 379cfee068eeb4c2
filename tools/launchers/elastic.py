"""Restart cases: a rank is killed mid-run, the launcher restarts the group, the run resumes.

    verdict = torchrun_elastic(context)      # one line, like the launchers'
    print(f"launcher torchrun-elastic: {verdict.line}")

* ``torchrun-elastic``: ``elastic_train.py`` under ``torchrun --standalone --nproc-per-node=2
  --max-restarts=1``; rank 1 SIGKILLs itself at step ``KILL_STEP`` of the first attempt. It
  passes when torchrun exits 0 after exactly one restart, the restart resumed from the newest
  checkpoint committed before the kill, the losses of every step after it equal those of an
  uninterrupted run bit for bit, every sample was trained on exactly once in the committed
  history, and the final parameters hash like the uninterrupted run's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import procs
from cases import HERE, Context
from verdict import Verdict

ELASTIC_TRAIN = HERE / "elastic_train.py"
SAMPLES = 96
BATCH = 2
EVERY = 3
KILL_RANK, KILL_STEP = 1, 14  # 2 ranks x 2 samples a step: 24 steps an epoch; saved after 12


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """One restart scenario."""

    name: str
    timeout: float
    run: Callable[[Context], Verdict]


def _torchrun(
    ctx: Context, out: Path, torchrun_flags: tuple[str, ...] = (), kill: str = ""
) -> procs.Finished:
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        str(ctx.bin / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        *torchrun_flags,
        str(ELASTIC_TRAIN),
        "--out", str(out),
        "--samples", str(SAMPLES),
        "--batch", str(BATCH),
        "--every", str(EVERY),
    ]  # fmt: skip
    if kill:
        argv += ["--kill", kill]
    return procs.run(argv, env=ctx.env, log=out / "launch.log", timeout=ctx.timeout, cwd=out)


def _losses(out: Path) -> list[dict[str, Any]]:
    path = out / "losses.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _result(out: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads((out / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found


def torchrun_elastic(ctx: Context) -> Verdict:
    """A rank killed under torchrun --max-restarts=1: restarted, resumed, same result."""
    started = time.monotonic()
    plain_out, killed_out = ctx.work / "uninterrupted", ctx.work / "killed"
    plain = _torchrun(ctx, plain_out)
    plain_s = time.monotonic() - started
    if plain.returncode != 0:
        line = f"FAIL uninterrupted run: exit {plain.returncode}: {plain.tail()} ({plain_s:.1f} s)"
        return Verdict(ok=False, line=line)
    restart = ("--max-restarts=1", "--monitor-interval=0.1")
    killed = _torchrun(ctx, killed_out, restart, kill=f"{KILL_RANK}@{KILL_STEP}")
    seconds = time.monotonic() - started
    problems = []
    if killed.returncode != 0:
        problems.append(f"killed run: exit {killed.returncode}: {killed.tail()}")
    reference, result = _result(plain_out), _result(killed_out)
    if reference is None or result is None:
        which = "uninterrupted" if reference is None else "killed"
        problems.append(f"no result.json from the {which} run")
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    expected_resume = (KILL_STEP - 1) // EVERY * EVERY
    if result["attempt"] != 1:
        problems.append(f"finished on attempt {result['attempt']}, not after one restart")
    if result["resumed_step"] != expected_resume:
        problems.append(f"resumed after step {result['resumed_step']}, not {expected_resume}")
    want = {r["step"]: r["loss"] for r in _losses(plain_out)}
    after = [r for r in _losses(killed_out) if r["attempt"] == result["attempt"]]
    if [r["step"] for r in after] != list(range(expected_resume + 1, max(want) + 1)):
        problems.append(f"attempt 1 ran steps {[r['step'] for r in after][:3]}...")
    differ = [r["step"] for r in after if want.get(r["step"]) != r["loss"]]
    if differ:
        problems.append(f"losses differ from the uninterrupted run at steps {differ[:5]}")
    if result["seen"] != [1] * SAMPLES:
        wrong = [i for i, c in enumerate(result["seen"]) if c != 1]
        problems.append(f"samples not seen exactly once: {wrong[:8]}")
    if result["sha256"] != reference["sha256"]:
        problems.append("final parameters differ from the uninterrupted run's")
    if problems:
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    return Verdict(
        ok=True,
        line=(
            f"pass (2 ranks, {seconds:.1f} s; rank {KILL_RANK} killed at step {KILL_STEP}, "
            f"torchrun restarted the group, resumed after step {expected_resume} in "
            f"{result['resume_s']:.2f} s, losses of steps {expected_resume + 1}-{max(want)} "
            f"equal to an uninterrupted run ({plain_s:.1f} s), each of {SAMPLES} samples seen "
            "once, final parameters equal)"
        ),
    )


RESTARTS = (Restart(name="torchrun-elastic", timeout=240, run=torchrun_elastic),)
