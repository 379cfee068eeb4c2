"""Watch cases: a late rank at init and a killed rank, named under a real launcher.

    verdict = openmpi_late_init(context)      # one line, like the launchers'
    print(f"launcher openmpi-late-init: {verdict.line}")

* ``openmpi-late-init``: ``watch_probe.py late`` under ``mpirun -np 2``, ``DISTCOMPAT_WATCHDOG=2``;
  rank 1 starts its init 4 s late. It passes when rank 0's output names rank 1 as not arrived
  in the rendezvous within the threshold + 8 s, and the job then completes (exit 0).
* ``openmpi-kill-named``: ``watch_probe.py kill`` under ``mpirun -np 2``; rank 1 SIGKILLs
  itself while rank 0 waits in an all_reduce. It passes when rank 0's line naming rank 1 came
  within 100 ms of the kill, before mpirun ended the job.
* ``openmpi-exception-told``: ``watch_probe.py raise``; rank 1 dies of an unhandled
  ``ValueError`` outside any collective. It passes when rank 0's line says which exception and
  where (``exited after ValueError: bad batch 7 at watch_probe.py:N``), within 1 s.

The tests run the same under ``run_ranks`` and ``torchrun`` (tests/test_process_group_init_watch.py,
tests/test_collectives_peer_watch.py); these are the other launcher, for real.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import procs
from cases import HERE, Context, Need
from verdict import Verdict

WATCH_PROBE = HERE / "watch_probe.py"
THRESHOLD_S = 2.0
LATE_REPORT = re.compile(r"rank 0 has waited (\d+)s in init, in the rendezvous: (.*)")
SEEN = re.compile(
    r"distcompat: rank 1 \(pid \d+ on \S+\) (ended|exited after .*) \(seen at ([\d.]+)\)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Watched:
    """One watch scenario."""

    name: str
    timeout: float
    run: Callable[[Context], Verdict]
    needs: Need = "host"
    binaries: tuple[str, ...] = ()


def _mpirun(ctx: Context, mode: str, out: Path) -> procs.Finished:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "-np", "2", ctx.python,
            str(WATCH_PROBE), mode, "--out", str(out)]  # fmt: skip
    env = {**ctx.env, "DISTCOMPAT_WATCHDOG": str(THRESHOLD_S)}
    return procs.run(argv, env=env, log=out / f"{mode}.log", timeout=ctx.timeout, cwd=out)


def openmpi_late_init(ctx: Context) -> Verdict:
    out = ctx.work / "late"
    finished = _mpirun(ctx, "late", out)
    said = finished.log.read_text(encoding="utf-8", errors="replace")
    match = LATE_REPORT.search(said)
    if match is None:
        return Verdict(ok=False, line=f"FAIL no init report from rank 0: {finished.tail()}")
    waited, what = int(match.group(1)), match.group(2)
    if not what.startswith("rank 1 has not arrived"):
        return Verdict(ok=False, line=f"FAIL the report did not name rank 1: {what}")
    if waited > THRESHOLD_S + 8:
        return Verdict(ok=False, line=f"FAIL reported after {waited} s (bound {THRESHOLD_S + 8:g})")
    if finished.returncode != 0 or "rank 0: sum 2" not in said:
        return Verdict(ok=False, line=f"FAIL the job did not complete: {finished.tail()}")
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {finished.seconds:.1f} s; rank 1 named at init after {waited} s: "
        f"{what})",
    )


def openmpi_kill_named(ctx: Context) -> Verdict:
    out = ctx.work / "kill"
    finished = _mpirun(ctx, "kill", out)
    said = finished.log.read_text(encoding="utf-8", errors="replace")
    match = SEEN.search(said)
    killed = out / "killed"
    if match is None or not killed.exists():
        return Verdict(ok=False, line=f"FAIL no line naming rank 1: {finished.tail()}")
    if match.group(1) != "ended":
        return Verdict(ok=False, line=f"FAIL a killed rank said something: {match.group(1)}")
    after_ms = (float(match.group(2)) - float(killed.read_text(encoding="utf-8"))) * 1000
    if after_ms > 100:
        return Verdict(ok=False, line=f"FAIL rank 1 named {after_ms:.0f} ms after its kill")
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {finished.seconds:.1f} s; rank 1 SIGKILLed, named by rank 0 "
        f"{after_ms:.0f} ms later, mpirun exit {finished.returncode})",
    )


def openmpi_exception_told(ctx: Context) -> Verdict:
    out = ctx.work / "raise"
    finished = _mpirun(ctx, "raise", out)
    said = finished.log.read_text(encoding="utf-8", errors="replace")
    match = SEEN.search(said)
    killed = out / "killed"
    if match is None or not killed.exists():
        return Verdict(ok=False, line=f"FAIL no line naming rank 1: {finished.tail()}")
    line = next(i for i, text in enumerate(WATCH_PROBE.read_text().splitlines(), 1)
                if 'raise ValueError("bad batch 7")' in text)  # fmt: skip
    want = f"exited after ValueError: bad batch 7 at watch_probe.py:{line}"
    if match.group(1) != want:
        return Verdict(ok=False, line=f"FAIL rank 0 said {match.group(1)!r}, not {want!r}")
    after_s = float(match.group(2)) - float(killed.read_text(encoding="utf-8"))
    if after_s > 1.0:
        return Verdict(ok=False, line=f"FAIL told {after_s:.2f} s after the exception")
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {finished.seconds:.1f} s; rank 0 said rank 1 {want}, "
        f"{after_s * 1000:.0f} ms after it was raised)",
    )


WATCHED = (
    Watched(name="openmpi-late-init", timeout=120, run=openmpi_late_init,
            binaries=("mpirun.openmpi",)),
    Watched(name="openmpi-kill-named", timeout=120, run=openmpi_kill_named,
            binaries=("mpirun.openmpi",)),
    Watched(name="openmpi-exception-told", timeout=120, run=openmpi_exception_told,
            binaries=("mpirun.openmpi",)),
)  # fmt: skip
