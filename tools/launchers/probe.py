"""One rank of the launchers session: init under whatever launcher started it, check, report.

    mpiexec.mpich -n 3 python tools/launchers/probe.py --truth mpich --expect mpich --out DIR

Every rank writes ``DIR/rank-<R>.json`` (``report.py``) and exits 0 once it has written it; the
verdicts are in the report, so a failed check never kills the other ranks mid-collective. Checks,
in order: ``doctor`` (``distcompat doctor`` as a subprocess in this launch environment, before
init, on each node's local rank 0), ``init``, ``torchrun-env-after-init`` (a *contract* check:
the torchrun variables hold the resolved values after init; expected to fail until the library
exports them), ``launcher``, ``layout``, ``all_reduce``, ``broadcast``, ``reduce_scatter_future``,
``checkpoint``, ``teardown``, then ``bench``: ``distcompat bench --quick`` run in this launch after
teardown, so the command makes (or adopts) its own group: init -> destroy -> init under every
launcher. Ray Train calls :func:`run_probe` from its worker function.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist
from report import Check, Kind, RankReport, write_report
from truth import EXPECT_IFNAME_VAR, KINDS, Truth, launcher_truth

import distcompat
from distcompat import DistInfo, LaunchEnv
from distcompat.bench import OPS
from distcompat.cli import main as distcompat_main

#: The torchrun variables every launch should show after init (issue 16, item 6).
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
DOCTOR_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Expectation:
    """What this launch should look like to distcompat.

    ``launcher`` is the documented ``DistInfo.launcher`` label; ``reason_contains`` must appear in
    ``LaunchEnv.sources["launcher"]`` (e.g. torchrun winning over Slurm); ``adopted`` says whether
    the group already exists before init (Ray Train); ``timeout`` is the group timeout in seconds.
    """

    launcher: str
    world_size: int
    reason_contains: str = ""
    adopted: bool = False
    timeout: float = 60.0


class ProbeFailure(Exception):
    """A check saw something other than what it expected."""


def _expect_equal(what: str, got: object, want: object) -> None:
    if got != want:
        raise ProbeFailure(f"{what}: got {got}, want {want}")


def _guard(name: str, body: Callable[[], str], kind: Kind = "core") -> Check:
    """Run one check; any exception becomes a ``fail`` that names its type and message."""
    try:
        detail = body()
    except Exception as exc:  # a probe reports every failure instead of stopping at the first
        text = str(exc).strip().replace("\n", " | ")
        detail = f"{type(exc).__name__}: {text[:600]}"
        return Check(name=name, status="fail", detail=detail, kind=kind)
    return Check(name=name, status="pass", detail=detail, kind=kind)


def doctor_check(expect: Expectation) -> str:
    """``distcompat doctor`` in this launch's environment: no PROBLEM line, the same launcher."""
    command = [sys.executable, "-m", "distcompat", "doctor", "--device", "cpu"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S, check=False
    )
    lines = done.stdout.splitlines()
    problems = [line for line in lines if "PROBLEM" in line]
    if problems or done.returncode != 0:
        tail = " | ".join(problems or (done.stdout + done.stderr).splitlines()[-3:])
        raise ProbeFailure(f"doctor exit {done.returncode}: {tail}")
    said = next((line for line in lines if "] launcher " in line), "")
    if f"launcher {expect.launcher}:" not in said:
        raise ProbeFailure(f"doctor says {said.split('] ', 1)[-1]!r}, want {expect.launcher}")
    pitfalls = [line.split("PITFALL: ", 1)[1] for line in lines if "PITFALL: " in line]
    return f"no PROBLEM; {len(pitfalls)} pitfall(s)" + "".join(f"; {p}" for p in pitfalls)


def torchrun_env_check(info: DistInfo, launch: LaunchEnv) -> str:
    """After init, each torchrun variable is in ``os.environ``, holding the resolved value."""
    want: dict[str, object] = {
        "RANK": info.rank,
        "LOCAL_RANK": info.local_rank,
        "WORLD_SIZE": info.world_size,
        "LOCAL_WORLD_SIZE": info.local_world_size,
        "GROUP_RANK": info.node_rank,
        "MASTER_ADDR": launch.master_addr,
        "MASTER_PORT": launch.master_port,
    }
    wrong = []
    for name in TORCHRUN_VARIABLES:
        value = os.environ.get(name)
        if value is None:
            wrong.append(f"{name} unset (resolved {want[name]})")
        elif want[name] is not None and value != str(want[name]):
            wrong.append(f"{name}={value} (resolved {want[name]})")
    if wrong:
        raise ProbeFailure(", ".join(wrong))
    return "all set: " + " ".join(f"{n}={os.environ[n]}" for n in TORCHRUN_VARIABLES)


def launcher_check(info: DistInfo, launch: LaunchEnv, expect: Expectation) -> str:
    """``DistInfo.launcher`` is the documented label; the detection reason says what it must."""
    reason = launch.sources.get("launcher", "")
    _expect_equal("DistInfo.launcher", info.launcher, expect.launcher)
    _expect_equal("DistInfo.adopted", info.adopted, expect.adopted)
    if expect.reason_contains not in reason:
        raise ProbeFailure(f"detection reason {reason!r} lacks {expect.reason_contains!r}")
    return f"{info.launcher} ({reason}); master {launch.master_addr}:{launch.master_port}"


def layout_check(info: DistInfo, truth: Truth, expect: Expectation) -> str:
    """Rank, local rank, world size, local world size and node rank agree with the launcher."""
    pairs = (
        ("rank", info.rank, truth.rank),
        ("local_rank", info.local_rank, truth.local_rank),
        ("world_size", info.world_size, truth.world_size),
        ("local_world_size", info.local_world_size, truth.local_world_size),
        ("node_rank", info.node_rank, truth.node_rank),
    )
    wrong = [f"{name} {got} (launcher says {want})" for name, got, want in pairs if got != want]
    if wrong:
        raise ProbeFailure(", ".join(wrong) + f" [launcher: {truth.source}]")
    _expect_equal("world size", truth.world_size, expect.world_size)
    return (
        f"rank {info.rank}/{info.world_size}, local {info.local_rank}/{info.local_world_size}, "
        f"node {info.node_rank} [{truth.source}]"
    )


def all_reduce_check(rank: int, world: int) -> str:
    total = torch.tensor([float(rank + 1)])
    distcompat.all_reduce(total)
    _expect_equal("sum of rank+1", total.item(), world * (world + 1) / 2)
    return f"sum {total.item():g}"


def broadcast_check(rank: int, world: int) -> str:
    src = world - 1  # not rank 0, so a broadcast that ignores src shows
    value = torch.tensor([10.0 * rank + 7.0, 3.0])
    distcompat.broadcast(value, src=src)
    _expect_equal("broadcast value", value.tolist(), [10.0 * src + 7.0, 3.0])
    return f"from rank {src}: {value.tolist()}"


def reduce_scatter_check(rank: int, world: int) -> str:
    chunk = 2
    source = torch.arange(world * chunk, dtype=torch.float32) + rank  # [world * chunk]
    out = torch.empty(chunk)
    work = distcompat.reduce_scatter_tensor(out, source, async_op=True)
    work.get_future().wait()
    mine = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.float32)
    want = world * mine + world * (world - 1) / 2
    _expect_equal("reduce_scatter chunk", out.tolist(), want.tolist())
    return f"future resolved, chunk {out.tolist()}"


def _digest(state: dict[str, torch.Tensor]) -> str:
    hashed = hashlib.sha256()
    for key in sorted(state):
        hashed.update(f"{key}:{state[key].dtype}:{state[key].tolist()};".encode())
    return hashed.hexdigest()[:16]


def checkpoint_check(rank: int, world: int, root: Path) -> str:
    """Every rank saves step 1; each reloads its own file and rank 0's, equal on every rank."""
    state = {"rank": torch.tensor([rank]), "w": torch.arange(4.0) * world}
    path = distcompat.save_checkpoint(root, 1, state)
    own = distcompat.load_checkpoint(root, 1)
    _expect_equal("own file", _digest(own), _digest(state))
    first = distcompat.load_checkpoint(root, 1, rank=0)
    _expect_equal("rank 0's rank entry", first["rank"].tolist(), [0])
    seen: list[object] = [None] * world
    distcompat.all_gather_object(seen, _digest(first))
    if len(set(seen)) != 1:
        raise ProbeFailure(f"ranks reloaded different contents of rank 0's file: {seen}")
    return f"{path.name} committed, reloaded equal on {world} ranks ({seen[0]})"


def teardown_check(expect: Expectation) -> str:
    distcompat.destroy_distributed()
    alive = torch_dist.is_initialized()
    _expect_equal("group alive after destroy_distributed", alive, expect.adopted)
    return "adopted group left to its owner" if expect.adopted else "group destroyed"


def interface_check(info: DistInfo, expected: str) -> str:
    """Started without GLOO_SOCKET_IFNAME: init picked the interface that reaches the master."""
    _expect_equal("GLOO_SOCKET_IFNAME after init", os.environ.get("GLOO_SOCKET_IFNAME"), expected)
    if expected not in info.reason:
        raise ProbeFailure(f"the init reason does not name {expected}: {info.reason!r}")
    return f"init picked {expected} and says so"


def bench_check(rank: int) -> str:
    """``distcompat bench --quick`` in this launch's environment: exit 0, a row per op on rank 0."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = distcompat_main(["bench", "--quick", "--device", "cpu"])
    _expect_equal("distcompat bench --quick exit code", code, 0)
    if rank != 0:
        return "ran (rank 0 prints the table)"
    lines = printed.getvalue().splitlines()
    missing = [op for op in OPS if not any(line.startswith(op + " ") for line in lines)]
    if missing:
        raise ProbeFailure(f"bench table lacks rows for {missing}: {lines[-8:]}")
    rows = sum(1 for line in lines if line.split(" ", 1)[0] in OPS)
    return f"{rows} rows for {len(OPS)} ops"


def run_probe(expect: Expectation, truth: Truth, out: Path) -> RankReport:
    """Run every check on this rank, write its report into ``out``, and return it."""
    started = time.monotonic()
    checks: list[Check] = []
    if truth.local_rank == 0:
        checks.append(_guard("doctor", lambda: doctor_check(expect)))
    else:
        checks.append(Check(name="doctor", status="skip", detail="run by local rank 0"))
    try:
        launch = LaunchEnv.from_environ()
        info = distcompat.init_distributed(device="cpu", timeout=expect.timeout)
    except Exception as exc:  # nothing else can run without a group: report and stop
        checks.append(Check(name="init", status="fail", detail=f"{type(exc).__name__}: {exc}"))
        return _finish(out, truth, "?", checks, started)
    checks.append(Check(name="init", status="pass", detail=info.reason.replace("\n", "; ")))
    contract = _guard(
        "torchrun-env-after-init", lambda: torchrun_env_check(info, launch), kind="contract"
    )
    checks.append(contract)
    expected_ifname = os.environ.get(EXPECT_IFNAME_VAR)
    if expected_ifname:
        checks.append(_guard("gloo-interface", lambda: interface_check(info, expected_ifname)))
    checks.append(_guard("launcher", lambda: launcher_check(info, launch, expect)))
    checks.append(_guard("layout", lambda: layout_check(info, truth, expect)))
    rank, world = info.rank, info.world_size
    checks.append(_guard("all_reduce", lambda: all_reduce_check(rank, world)))
    checks.append(_guard("broadcast", lambda: broadcast_check(rank, world)))
    checks.append(_guard("reduce_scatter_future", lambda: reduce_scatter_check(rank, world)))
    checks.append(_guard("checkpoint", lambda: checkpoint_check(rank, world, out / "checkpoint")))
    checks.append(_guard("teardown", lambda: teardown_check(expect)))
    checks.append(_guard("bench", lambda: bench_check(rank)))
    return _finish(out, truth, info.launcher, checks, started)


def _finish(
    out: Path, truth: Truth, launcher: str, checks: list[Check], started: float
) -> RankReport:
    report = RankReport(
        rank=truth.rank,
        launcher=launcher,
        checks=tuple(checks),
        seconds=round(time.monotonic() - started, 2),
    )
    write_report(out, report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--truth", choices=KINDS, required=True, help="whose variables to trust")
    parser.add_argument("--expect", required=True, help="the DistInfo.launcher label to expect")
    parser.add_argument("--reason-contains", default="", help="text the detection reason needs")
    parser.add_argument("--world", type=int, required=True, help="the number of ranks launched")
    parser.add_argument("--timeout", type=float, default=60.0, help="group timeout, seconds")
    parser.add_argument("--out", type=Path, required=True, help="directory for rank-<R>.json")
    args = parser.parse_args(argv)
    expect = Expectation(
        launcher=args.expect,
        world_size=args.world,
        reason_contains=args.reason_contains,
        timeout=args.timeout,
    )
    report = run_probe(expect, launcher_truth(args.truth, os.environ), args.out)
    failed = [c.name for c in report.checks if c.status == "fail"]
    print(f"[probe rank {report.rank}] {len(report.checks)} checks, failed: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
