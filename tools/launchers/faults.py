"""Network faults on the two namespace "nodes", each judged into one line like the launchers'.

    verdict = drop_5s(context)            # context.nodes: the TwoNodes run.py created
    print(f"fault drop-5s: {verdict.line}")

* ``drop-5s``: all traffic on node 1's veth is dropped for 5 s while ``fault_train.py`` runs on
  both nodes; training must go on afterwards with every step's all-reduce right.
* ``partition``: the drop stays; both ranks must raise a typed distcompat error
  (``CollectiveTimeoutError`` or ``PeerLostError``) naming the other rank within the group
  timeout + 10 s of the cut.
* ``store-partition``: with every distcompat default on, only the rendezvous stores' TCP ports
  are cut between the nodes, for good; training goes on, and the first call that needs the
  store ends in a typed error on both ranks within the group timeout + 10 s.
* ``doctor-ifname``: ``distcompat doctor`` on both nodes warns (a ``PITFALL`` line) about gloo
  when ``GLOO_SOCKET_IFNAME`` is unset, and does not when it is set.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import procs
from cases import HERE, RDZV_PORT, Context, start_two_nodes
from verdict import Verdict

FAULT_TRAIN = HERE / "fault_train.py"
GROUP_TIMEOUT_S = 20.0
DETECTION_SLACK_S = 10.0  # the bound: a partition is reported within timeout + 10 s
#: What a timeout error says when it could not read who is missing (collectives._wait).
STORE_SILENT = "the rendezvous store did not answer"
DROP_S = 5.0
WARM_STEPS = 20  # steps both ranks finish before the fault, so it hits a running job
START_TIMEOUT_S = 90.0


class FaultAborted(Exception):
    """The run could not reach the point where the fault is applied or judged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One fault scenario on the two nodes."""

    name: str
    run: Callable[[Context], Verdict]


def _progress(work: Path, rank: int) -> int:
    try:
        return int((work / f"progress-{rank}").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return -1


def _wait_for_steps(work: Path, jobs: list[procs.Job], steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while min(_progress(work, r) for r in (0, 1)) < steps:
        ended = [j for j in jobs if j.process.poll() is not None]
        if ended:
            raise FaultAborted(f"node exited early ({ended[0].process.returncode})")
        if time.monotonic() > deadline:
            seen = [_progress(work, r) for r in (0, 1)]
            raise FaultAborted(f"no step {steps} within {timeout:.0f} s (progress {seen})")
        time.sleep(0.1)


def _results(work: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in (0, 1):
        path = work / f"rank-{rank}.json"
        if path.exists():
            found[rank] = json.loads(path.read_text(encoding="utf-8"))
    return found


def _train(ctx: Context, tag: str, *, shm: bool = False) -> list[procs.Job]:
    payload = [str(FAULT_TRAIN), "--out", str(ctx.work), "--timeout", str(GROUP_TIMEOUT_S)]
    return start_two_nodes(ctx, payload, per_node=1, shm=shm, tag=tag)


def _worker(job: procs.Job) -> int:
    """The pid of the rank torchrun ``job`` started (the process below it with ``RANK`` set)."""
    todo = [job.process.pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(pid) for pid in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if "RANK" in _environ(child):
                    return child
            todo += children
    raise FaultAborted(f"no rank found under torchrun ({job.log.name})")


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    items = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in items}


def _maps_shared_memory(pid: int) -> bool:
    """Whether process ``pid`` has distcompat's shared-memory segment mapped (its path engaged)."""
    try:
        return "/dev/shm/distcompat-shm-" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _tails(jobs: list[procs.Job]) -> str:
    ends = [procs.Finished(returncode=j.process.poll(), log=j.log, seconds=0.0) for j in jobs]
    return "; ".join(f"node {k}: {f.tail(2)}" for k, f in enumerate(ends))


def _end_cut(ctx: Context, jobs: list[procs.Job]) -> str:
    """End a cut-network fault: read the jobs' log tails, stop them, unblock node 1.

    The jobs are stopped, not waited for: torchrun's agents would linger for their rendezvous
    keep-alive, and with the store cut node 1's agent sits in a request to it.
    """
    assert ctx.nodes is not None, "a network fault runs inside the namespaces run.py created"
    tails = _tails(jobs)
    for job in jobs:
        procs.stop(job)
    ctx.nodes.unblock(1)
    return tails


def _wait_for_results(work: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_results(work)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)


def _judge_errors(
    results: dict[int, dict[str, Any]],
    *,
    since: float,
    limit: float,
    tails: str,
    may_name_none: tuple[int, ...] = (),
) -> tuple[list[str], list[str]]:
    """Check that each rank raised a typed error within ``limit`` s of ``since`` (wall time),
    naming the other rank (or no rank, for ranks in ``may_name_none``); return (seen, problems).
    """
    seen, problems = [], []
    for rank in (0, 1):
        result = results.get(rank)
        if result is None:
            problems.append(f"rank {rank} reported nothing within {limit + 20:.0f} s: {tails}")
            continue
        error, peer = result.get("error"), result.get("peer")
        after = float(result.get("raised_at", since)) - since
        where = re.search(r"\bin the ([\w -]+? of \w+)", str(result.get("message", "")))
        named = "naming no rank" if peer is None else f"naming rank {peer}"
        seen.append(
            f"rank {rank} {error} {named} after {after:.1f} s"
            + (f" (in the {where.group(1)})" if where else "")
        )
        if error not in ("CollectiveTimeoutError", "PeerLostError"):
            problems.append(f"rank {rank} ended without a typed error: {result}")
        elif peer != 1 - rank and not (peer is None and rank in may_name_none):
            problems.append(f"rank {rank} named peer {peer}, not {1 - rank}")
        elif after > limit:
            problems.append(f"rank {rank} raised after {after:.1f} s > timeout + 10 = {limit:.0f}")
    return seen, problems


def drop_5s(ctx: Context) -> Verdict:
    """A 5 s drop of all traffic mid-training is survived, every step's result right."""
    assert ctx.nodes is not None
    started = time.monotonic()
    jobs = _train(ctx, "drop")
    try:
        _wait_for_steps(ctx.work, jobs, WARM_STEPS, START_TIMEOUT_S)
        ctx.nodes.block(1)
        time.sleep(DROP_S)
        ctx.nodes.unblock(1)
        resumed_from = max(_progress(ctx.work, r) for r in (0, 1))
        _wait_for_steps(ctx.work, jobs, resumed_from + WARM_STEPS, 3 * GROUP_TIMEOUT_S)
        (ctx.work / "stop").touch()
        finished = procs.wait_all(jobs, 60)
    except FaultAborted as exc:
        return Verdict(ok=False, line=f"FAIL {exc}: {_tails(jobs)}")
    finally:
        ctx.nodes.unblock(1)
        for job in jobs:
            procs.stop(job)
    seconds = time.monotonic() - started
    results = _results(ctx.work)
    problems = [f"rank {r} wrote no result" for r in (0, 1) if r not in results]
    for rank, result in sorted(results.items()):
        if not result.get("ok"):
            problems.append(f"rank {rank}: {result}")
        elif result["longest_step_s"] < DROP_S / 2:
            longest = result["longest_step_s"]
            problems.append(f"rank {rank} never stalled (longest step {longest} s)")
    problems += [f"exit {f.returncode}: {f.tail(2)}" for f in finished if f.returncode != 0]
    if problems:
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    stall = max(r["longest_step_s"] for r in results.values())
    steps = results[0]["steps"]
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {seconds:.1f} s; one step stalled {stall} s under the {DROP_S:.0f} s "
        f"drop, then {steps} steps in all, every all-reduce right, replicas equal)",
    )


def partition(ctx: Context) -> Verdict:
    """A permanent cut ends in a typed error naming the peer, on both nodes, in time."""
    assert ctx.nodes is not None
    started = time.monotonic()
    limit = GROUP_TIMEOUT_S + DETECTION_SLACK_S
    jobs = _train(ctx, "partition")
    try:
        _wait_for_steps(ctx.work, jobs, WARM_STEPS, START_TIMEOUT_S)
        cut_at = time.time()
        ctx.nodes.block(1)
        _wait_for_results(ctx.work, limit + 20)  # past the bound, to measure a late report
    except FaultAborted as exc:
        return Verdict(ok=False, line=f"FAIL {exc}: {_tails(jobs)}")
    finally:
        tails = _end_cut(ctx, jobs)
    seconds = time.monotonic() - started
    seen, problems = _judge_errors(_results(ctx.work), since=cut_at, limit=limit, tails=tails)
    if problems:
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {seconds:.1f} s; {'; '.join(seen)}; limit {limit:.0f} s)",
    )


def store_partition(ctx: Context) -> Verdict:
    """A store-only partition: the steps that need no store go on; the first that does fails
    typed on both ranks within the group timeout + 10 s.

    Both ranks train with every distcompat default (shared memory ``auto``, the mismatch check
    on, the watchdog's default); at step ``WARM_STEPS`` node 1 drops every TCP packet to or from
    the workers' store (``MASTER_PORT``, read from rank 1's environment) and torchrun's own
    rendezvous store (``RDZV_PORT``). Both are served on node 0 by its torchrun agent, so node 0
    still reaches them; every other connection, gloo's pairs included, keeps working. Cutting
    ``MASTER_PORT`` alone is not enough to judge rank 1: when rank 0 ends, node 0's agent exits,
    its rendezvous store closes, and node 1's agent SIGTERMs rank 1 within a second (seen).

    What a user should see, and what is asserted:

    * The cut goes unnoticed while no call needs the store: a training step repeats an agreed
      collective, which the mismatch check lets through without a store request. Both ranks
      must finish ``WARM_STEPS`` more steps after the cut, every all-reduce right.
    * The job cannot end normally while the cut lasts: its final ``all_gather_object`` is a new
      signature, which the mismatch check posts through the store. That call must end on both
      ranks with a typed error (``CollectiveTimeoutError`` or ``PeerLostError``) within the
      group timeout + 10 s of the stop, not hang: rank 0 (which reaches the store) names rank
      1, whose post never came; rank 1 cannot read the store that says who is missing, so it
      may name no rank, but never a wrong one, and then its message says the store did not
      answer.

    With ``auto``, the nodes' steps go through shared memory (they share this machine's
    ``/dev/shm``), which the verdict reports; gloo carries the final call.
    """
    assert ctx.nodes is not None
    started = time.monotonic()
    limit = GROUP_TIMEOUT_S + DETECTION_SLACK_S
    jobs = _train(ctx, "store-partition", shm=True)
    try:
        _wait_for_steps(ctx.work, jobs, WARM_STEPS, START_TIMEOUT_S)
        worker = _worker(jobs[1])
        port = int(_environ(worker).get("MASTER_PORT", "0"))
        if not port:
            raise FaultAborted(f"rank 1 (pid {worker}) has no MASTER_PORT")
        shared = _maps_shared_memory(worker)
        ctx.nodes.block(1, ports=(port, RDZV_PORT))
        cut_step = max(_progress(ctx.work, r) for r in (0, 1))
        _wait_for_steps(ctx.work, jobs, cut_step + WARM_STEPS, GROUP_TIMEOUT_S)
        stop_at = time.time()
        (ctx.work / "stop").touch()
        _wait_for_results(ctx.work, limit + 20)  # past the bound, to measure a late report
    except FaultAborted as exc:
        return Verdict(ok=False, line=f"FAIL {exc}: {_tails(jobs)}")
    finally:
        tails = _end_cut(ctx, jobs)
    seconds = time.monotonic() - started
    results = _results(ctx.work)
    seen, problems = _judge_errors(
        results, since=stop_at, limit=limit, tails=tails, may_name_none=(1,)
    )
    for rank, result in sorted(results.items()):
        if result.get("wrong_steps", 0):
            problems.append(f"rank {rank}: {result['wrong_steps']} all-reduces wrong")
        unnamed = result.get("peer") is None and result.get("error") == "CollectiveTimeoutError"
        if unnamed and STORE_SILENT not in str(result.get("message", "")):
            problems.append(f"rank {rank} named no rank without saying why: {result['message']}")
    if problems:
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    path = "shared memory" if shared else "gloo"
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {seconds:.1f} s; ports {port} and {RDZV_PORT} cut at step "
        f"{cut_step}, {WARM_STEPS}+ steps on through {path}, every all-reduce right; after the "
        f"stop: {'; '.join(seen)}; limit {limit:.0f} s)",
    )


def _doctor_lines(ctx: Context, *, ifname: bool) -> tuple[list[str], list[str]]:
    """Run ``distcompat doctor`` under two-node torchrun; return its PITFALL and PROBLEM lines."""
    tag = "doctor-ifname" if ifname else "doctor-no-ifname"
    payload = ["--no-python", str(ctx.bin / "distcompat"), "doctor", "--device", "cpu"]
    finished = procs.wait_all(
        start_two_nodes(ctx, payload, per_node=1, ifname=ifname, tag=tag), START_TIMEOUT_S
    )
    lines: list[str] = []
    for end in finished:
        if end.returncode is None:
            raise FaultAborted(f"doctor timed out ({tag}): {end.tail(2)}")
        lines += end.log.read_text(encoding="utf-8", errors="replace").splitlines()
    pitfalls = [line for line in lines if "PITFALL" in line and "GLOO_SOCKET_IFNAME" in line]
    return pitfalls, [line for line in lines if "PROBLEM" in line]


def doctor_ifname(ctx: Context) -> Verdict:
    """doctor warns about a multi-node gloo launch without GLOO_SOCKET_IFNAME, on both nodes."""
    started = time.monotonic()
    try:
        unset, unset_problems = _doctor_lines(ctx, ifname=False)
        set_, set_problems = _doctor_lines(ctx, ifname=True)
    except FaultAborted as exc:
        return Verdict(ok=False, line=f"FAIL {exc}")
    seconds = time.monotonic() - started
    problems = []
    for rank in (0, 1):
        if not any(line.startswith(f"[rank {rank}]") for line in unset):
            problems.append(f"rank {rank}: no GLOO_SOCKET_IFNAME pitfall when it is unset")
    if set_:
        problems.append(f"a pitfall although GLOO_SOCKET_IFNAME is set: {set_[0]}")
    if unset_problems or set_problems:
        problems.append(f"PROBLEM line: {(unset_problems + set_problems)[0]}")
    if problems:
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    warning = unset[0].split("PITFALL: ", 1)[-1]
    return Verdict(
        ok=True,
        line=f"pass (2 ranks, {seconds:.1f} s; unset: {warning[:90]}...; set: no pitfall)",
    )


FAULTS = (
    Fault(name="drop-5s", run=drop_5s),
    Fault(name="partition", run=partition),
    Fault(name="store-partition", run=store_partition),
    Fault(name="doctor-ifname", run=doctor_ifname),
)
