"""Run the probe under every launcher and the network faults: one line each, exit 1 if any fails.

    python tools/launchers/run.py                   # everything (what `nox -s launchers` runs)
    python tools/launchers/run.py --only mpich      # one launcher, for debugging
    python tools/launchers/run.py --only slurm      # a prefix: every slurm-* launch
    python tools/launchers/run.py --only torchrun-elastic   # a rank killed, torchrun restarts
    python tools/launchers/run.py --only openmpi-rerun      # killed under mpirun, then re-run
    python tools/launchers/run.py --only openmpi-kill-named # a lost peer named under mpirun
    python tools/launchers/run.py --only slurm-preempt-term # told to stop, saved, re-run
    python tools/launchers/run.py --list            # the names

Prints ``launcher NAME: pass (N ranks, X s)`` or ``launcher NAME: FAIL <reason>`` per launcher and
``fault NAME: ...`` per fault. Needs root (munged as its own user, network namespaces) and the
binaries ``install.py`` installs. The Slurm cluster and the two namespace nodes are set up once
for the items that need them and removed afterwards, also when a step fails or the run is
interrupted (SIGTERM and SIGINT unwind through the same ``finally`` blocks); so is the work dir
(``--keep`` keeps it, with every launch's log and every rank's report).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from pathlib import Path
from types import FrameType

from cases import CASES, Case, Context, Need
from elastic import RESTARTS, Restart
from faults import FAULTS
from inplace import INPLACE
from netns import TwoNodes
from preempted import PREEMPTED
from report import read_reports
from slurm_cluster import SlurmCluster
from verdict import Verdict, judge
from watched import WATCHED

#: Launcher variables of the caller (say, a run inside a Slurm job) that must not leak into the
#: launches: each launch gets only what its own launcher sets.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "RAY_")
_LAUNCHER_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "SLURM_CONF",
)  # fmt: skip
_NEED_BINARIES: dict[Need, tuple[str, ...]] = {
    "host": (),
    "slurm": ("munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol", "sinfo"),
    "netns": ("ip", "nft"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    """A launcher or a fault: what it needs, and how to run it into a verdict."""

    kind: str  # "launcher" or "fault"
    name: str
    needs: Need
    timeout: float
    run: Callable[[Context], Verdict]
    binaries: tuple[str, ...] = ()
    module: str = ""  # a Python module the session venv must have (ray)


def _launch_item(case: Case) -> Item:
    def run(ctx: Context) -> Verdict:
        started = time.monotonic()
        finished = case.launch(ctx)
        return judge(
            ranks=case.ranks,
            finished=finished,
            reports=read_reports(ctx.work),
            seconds=time.monotonic() - started,
        )

    return Item(
        kind="launcher",
        name=case.name,
        needs=case.needs,
        timeout=case.timeout,
        run=run,
        binaries=_NEED_BINARIES[case.needs] + case.binaries,
        module=case.module,
    )


def _restart_item(restart: Restart) -> Item:
    return Item(
        kind="launcher",
        name=restart.name,
        needs=restart.needs,
        timeout=restart.timeout,
        run=restart.run,
        binaries=_NEED_BINARIES[restart.needs] + restart.binaries,
    )


# grouped by what they need (run.py sets up the Slurm cluster and the namespaces once per group)
ITEMS = (
    *(_launch_item(case) for case in CASES if case.needs == "host"),
    *(_restart_item(r) for r in RESTARTS if r.needs == "host"),
    *(_restart_item(r) for r in INPLACE if r.needs == "host"),
    *(_restart_item(w) for w in WATCHED if w.needs == "host"),
    *(_restart_item(p) for p in PREEMPTED if p.needs == "host"),
    *(_launch_item(case) for case in CASES if case.needs == "slurm"),
    *(_restart_item(r) for r in RESTARTS if r.needs == "slurm"),
    *(_restart_item(r) for r in INPLACE if r.needs == "slurm"),
    *(_restart_item(p) for p in PREEMPTED if p.needs == "slurm"),
    *(_launch_item(case) for case in CASES if case.needs == "netns"),
    *(_restart_item(r) for r in RESTARTS if r.needs == "netns"),
    *(_restart_item(r) for r in INPLACE if r.needs == "netns"),
    *(Item(kind="fault", name=f.name, needs="netns", timeout=0, run=f.run) for f in FAULTS),
)


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables, unbuffered, one thread."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_LAUNCHER_PREFIXES) and key not in _LAUNCHER_NAMES
    }
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _missing(item: Item) -> list[str]:
    missing = [name for name in item.binaries if shutil.which(name) is None]
    if item.module and importlib.util.find_spec(item.module) is None:
        missing.append(f"python module {item.module}")
    if item.needs != "host" and os.geteuid() != 0:
        missing.append("root (munged's user, network namespaces)")
    return missing


Shared = tuple[SlurmCluster | None, TwoNodes | None]


@contextlib.contextmanager
def _shared_setup(need: Need, work: Path) -> Iterator[Shared]:
    """Start what a group of items needs: nothing, the Slurm cluster, or the two nodes."""
    if need == "slurm":
        with SlurmCluster.start(work / "slurm") as cluster:
            yield cluster, None
    elif need == "netns":
        with TwoNodes.create() as nodes:
            yield None, nodes
    else:
        yield None, None


def _run_one(item: Item, ctx: Context) -> Verdict:
    try:
        return item.run(ctx)
    except Exception as exc:  # one broken item must not hide the others' results
        return Verdict(ok=False, line=f"FAIL the harness crashed: {type(exc).__name__}: {exc}")


def _run_group(need: Need, items: list[Item], base: Context, work: Path) -> list[bool]:
    """Run ``items`` (all needing ``need``) inside one set-up; one bool per item, True = pass."""
    results, pending = [], []
    for item in items:
        missing = _missing(item)
        if missing:
            line = f"FAIL needs {', '.join(missing)} (`nox -s launchers` installs them)"
            results.append(_say(item, Verdict(ok=False, line=line)))
        else:
            pending.append(item)
    if not pending:
        return results
    try:
        with _shared_setup(need, work) as (cluster, nodes):
            while pending:
                item = pending.pop(0)
                (work / item.name).mkdir(parents=True)
                ctx = replace(
                    base,
                    work=work / item.name,
                    timeout=item.timeout or base.timeout,
                    cluster=cluster,
                    nodes=nodes,
                )
                results.append(_say(item, _run_one(item, ctx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        reason = f"FAIL {need} set-up or teardown: {type(exc).__name__}: {exc}"
        for item in pending:
            results.append(_say(item, Verdict(ok=False, line=reason)))
        if not pending:  # every item ran; the teardown failed and must not pass unseen
            print(f"{need} teardown: {reason}", flush=True)
            results.append(False)
    return results


def _say(item: Item, verdict: Verdict) -> bool:
    print(f"{item.kind} {item.name}: {verdict.line}", flush=True)
    return verdict.ok


def _select(only: Sequence[str]) -> list[Item]:
    if not only:
        return list(ITEMS)
    names = {i.name for i in ITEMS}
    exact = [o for o in only if o in names]  # an exact name wins over a prefix of longer ones

    def wanted(name: str) -> bool:
        return name in exact or any(o not in names and name.startswith(o) for o in only)

    chosen = [i for i in ITEMS if wanted(i.name)]
    if not chosen:
        known = ", ".join(i.name for i in ITEMS)
        raise SystemExit(f"--only {' '.join(only)} matches nothing; the names are: {known}")
    return chosen


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: daemons, namespaces, temp dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="a name or prefix; repeatable")
    parser.add_argument("--list", action="store_true", help="print the names and exit")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, reports)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{i.kind} {i.name}" for i in ITEMS))
        return 0
    items = _select(args.only)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    work = Path(tempfile.mkdtemp(prefix="dc-launchers-"))
    base = Context(work=work, env=clean_env(), python=sys.executable, timeout=120.0)
    started = time.monotonic()
    results: list[bool] = []
    try:
        for need, group in groupby(items, key=lambda i: i.needs):
            results += _run_group(need, list(group), base, work)
    finally:
        if args.keep:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    failed = results.count(False)
    print(f"launchers session: {time.monotonic() - started:.0f} s")
    print(f"launchers: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
