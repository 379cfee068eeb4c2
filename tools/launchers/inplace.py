"""In-place cases: a rank is SIGKILLed under a real launcher and the survivors go on in place.

    verdict = torchrun_inplace(context)      # one line, like the launchers'

Every case runs ``tests/_inplace_script.py`` (exact mode, the hand-written loop; the same
script as ``tests/test_inplace.py``) on 3 ranks for ``STEPS`` steps; launch rank 2 SIGKILLs
itself at step ``KILL_STEP``. Each passes when every rank that finished exited 0 and holds the
SHA-256 of the uninterrupted 3-rank run (made once a session, under ``torchrun --standalone``:
exact mode's bits depend neither on the launcher nor on the world size), and gives its figures:

* ``torchrun-inplace``: one torchrun agent per rank, ``--rdzv-backend=static --max-restarts=1``
  (the launcher set-up that restarts only the dead rank, with the same ``RANK``). The two
  survivors keep their process ids, shrink, and the restarted rank joins in place (grow):
  kill to the survivors' next committed step, and the replacement's process start to its first
  committed step.
* ``openmpi-inplace``: ``mpirun --enable-recovery`` (Open MPI keeps the other ranks; it starts
  no replacement): the survivors shrink to 2 and finish; mpirun exits 0, as it does there.
* ``torchrun-2node-inplace``: one torchrun agent on each of the two namespace nodes (static
  rendezvous, no restarts), one rank each; node 1's rank is SIGKILLed and its agent gives up
  (node 1 lost): node 0's rank goes on alone; then node 1 comes back (a new agent, the same
  command) and its rank joins in place. Both end with the uninterrupted run's SHA-256.
* ``torchrun-2node-zero-inplace``: the same with two ranks a node and the demo's sharded
  ZeroAdamW under ``shard_copies`` (float mode): node 1's two ranks are lost together, their
  shares come back from the copies on node 0, and node 1's new ranks take theirs; every state
  digest a rank printed (model and the whole optimizer state) is its step's.
* ``slurm-inplace``: ``srun -K0 -W0`` in the session's Slurm cluster (srun keeps the other
  tasks; it starts no replacement): the survivors shrink to 2 and finish; srun's exit code is
  the killed task's.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import procs
from cases import HERE, Context, node_env
from elastic import Restart
from netns import ADDRESSES
from verdict import Verdict

SCRIPT = HERE.parents[1] / "tests" / "_inplace_script.py"
RANKS, STEPS, KILL_STEP = 3, 30, 2
KILLED = RANKS - 1
#: Seconds each step waits while the group is short (``--pace``): a replacement imports torch.
PACE_S = 0.4
#: One thing a rank said; mpirun may put two ranks' lines on one (no newline between them).
_LINE = re.compile(r"rank (\d+): (\w+) (.*?)(?=rank \d+: |$)")


@dataclass(frozen=True, slots=True)
class Said:
    """What one launch's ranks printed, in order: (launch rank, what, the rest)."""

    lines: list[tuple[int, str, str]]

    @classmethod
    def read(cls, *logs: Path) -> Said:
        found = []
        for log in logs:
            text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
            for line in text.splitlines():
                for match in _LINE.finditer(line):
                    found.append((int(match[1]), match[2], match[3].strip()))
        return cls(found)

    def of(self, rank: int, what: str) -> list[str]:
        return [rest for r, w, rest in self.lines if r == rank and w == what]


def _argv(ctx: Context, *extra: str) -> list[str]:
    return [ctx.python, str(SCRIPT), "--steps", str(STEPS), *extra]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_REFERENCE: list[str] = []


def _uninterrupted(ctx: Context) -> str | Verdict:
    """The SHA-256 of the uninterrupted 3-rank run (made once a session)."""
    if _REFERENCE:
        return _REFERENCE[0]
    out = ctx.work.parent / "inplace-uninterrupted"
    shutil.rmtree(out, ignore_errors=True)
    head = [str(ctx.bin / "torchrun"), "--standalone", f"--nproc-per-node={RANKS}"]
    done = procs.run([*head, *_argv(ctx)[1:]], env=ctx.env, log=out / "run.log", timeout=120)
    digests = set(Said.read(done.log).of(0, "digest"))
    if done.returncode != 0 or len(digests) != 1:
        return Verdict(ok=False, line=f"FAIL uninterrupted run: exit {done.returncode}: "
                       f"{done.tail()}")  # fmt: skip
    _REFERENCE.append(digests.pop())
    return _REFERENCE[0]


def _digests_match(said: Said, ranks: list[int], want: str) -> str:
    """'' when each of ``ranks`` printed ``want`` last; else what is wrong."""
    wrong = [r for r in ranks if said.of(r, "digest")[-1:] != [want]]
    return f"rank(s) {wrong} did not end with the uninterrupted run's SHA-256" if wrong else ""


def _failed(problems: list[str], tail: str, seconds: float) -> Verdict | None:
    """The FAIL verdict of a case's ``problems`` ('' entries: none there); None when none."""
    found = [p for p in problems if p]
    if not found:
        return None
    return Verdict(ok=False, line=f"FAIL {'; '.join(found)}: {tail} ({seconds:.1f} s)")


def _join_s(said: Said, rank: int) -> float:
    """Seconds from the last process of ``rank`` starting to its first committed step."""
    began = float(said.of(rank, "started")[-1].split()[0])  # imports included
    commits = [float(c.split()[1]) for c in said.of(rank, "committed")]
    return min(t for t in commits if t > began) - began


def _kill_to_commit(said: Said, killed: int = KILLED) -> float | None:
    """Seconds from the kill to rank 0's commit of the step it interrupted (one clock: one
    machine); the loop also prints its step after the attempt a recovery ended."""
    kills = said.of(killed, "killed")  # "at T"
    commits = [rest.split() for rest in said.of(0, "committed")]
    if not kills:
        return None
    kill = float(kills[0].split()[-1])
    after = [float(t) for step, t in commits if int(step) == KILL_STEP + 1]
    return after[0] - kill if after else None


def torchrun_inplace(ctx: Context) -> Verdict:
    """One torchrun agent per rank, static rendezvous: shrink, then the restarted rank joins."""
    started = time.monotonic()
    want = _uninterrupted(ctx)
    if isinstance(want, Verdict):
        return want
    port = _free_port()
    jobs = []
    for node in range(RANKS):
        head = [
            str(ctx.bin / "torchrun"), f"--nnodes={RANKS}", f"--node-rank={node}",
            "--nproc-per-node=1", "--rdzv-backend=static", "--master-addr=127.0.0.1",
            f"--master-port={port}", "--max-restarts=1", "--monitor-interval=0.1",
        ]  # fmt: skip
        argv = [*head, *_argv(ctx, "--kill", f"{KILLED}@{KILL_STEP}", "--pace", str(PACE_S))[1:]]
        jobs.append(procs.start(argv, env=ctx.env, log=ctx.work / f"agent{node}.log"))
    finished = procs.wait_all(jobs, ctx.timeout)
    seconds = time.monotonic() - started
    said = Said.read(*(f.log for f in finished))
    codes = [f.returncode for f in finished]
    problems = [] if codes == [0] * RANKS else [f"agents exited {codes}"]
    problems.append(_digests_match(said, list(range(RANKS)), want))
    survivors_pids = [len({s.split()[-1] for s in said.of(r, "started")}) for r in range(KILLED)]
    if survivors_pids != [1] * KILLED:
        problems.append("a survivor was restarted")
    starts = said.of(KILLED, "started")
    joined = [r for r in said.of(0, "recovery") if r.split()[2] != "-"]
    if len(starts) != 2 or not joined:
        problems.append(f"no replacement joined (rank {KILLED} started {len(starts)} time(s))")
    failed = _failed(problems, finished[0].tail(), seconds)
    if failed is not None:
        return failed
    join_s = _join_s(said, KILLED)  # the replacement: the second process of that rank
    shrink = _kill_to_commit(said) or float("nan")
    return Verdict(
        ok=True,
        line=(
            f"pass ({RANKS} ranks, {seconds:.1f} s; rank {KILLED} SIGKILLed at step {KILL_STEP}, "
            f"torchrun restarted it alone; the survivors kept their processes and committed the "
            f"next step {(shrink - PACE_S) * 1e3:.0f} ms after the kill (not counting the "
            f"script's {PACE_S} s wait per step while short); the replacement committed its "
            f"first step {join_s:.2f} s after its process started (imports included); all "
            f"{RANKS} end with the uninterrupted run's SHA-256 {want[:12]})"
        ),
    )


def torchrun_2node_inplace(ctx: Context) -> Verdict:
    """Node 1 lost (its rank and agent end), node 0 goes on; node 1 back: its rank joins."""
    want = _uninterrupted(ctx)
    if isinstance(want, Verdict):
        return want
    return _two_nodes(ctx, per_node=1, extra=(), want=want)


def torchrun_2node_zero_inplace(ctx: Context) -> Verdict:
    """The same with two ranks a node and the demo's sharded ZeroAdamW (``shard_copies``):
    node 1's two ranks lost together, their shares come from node 0's copies; node 1 back."""
    return _two_nodes(ctx, per_node=2, extra=("--zero",), want=None)


def _two_nodes(ctx: Context, *, per_node: int, extra: tuple[str, ...], want: str | None) -> Verdict:
    """Node 1's ranks SIGKILL themselves at step KILL_STEP and its agent gives up; node 0's go
    on; a new agent on node 1 (the same command) and its ranks join. ``want``: the SHA-256
    every rank ends with (exact mode); None (``--zero``, float): every state digest a rank
    printed is its step's, and every rank ends with the same parameters."""
    assert ctx.nodes is not None, "a two-node case runs inside the namespaces run.py created"
    started = time.monotonic()
    port = _free_port()
    lost_ranks = list(range(per_node, 2 * per_node))
    kills = ",".join(f"{rank}@{KILL_STEP}" for rank in lost_ranks)

    def agent(node: int, log: str) -> procs.Job:
        assert ctx.nodes is not None
        head = [
            str(ctx.bin / "torchrun"), "--nnodes=2", f"--node-rank={node}",
            f"--nproc-per-node={per_node}", "--rdzv-backend=static",
            f"--master-addr={ADDRESSES[0]}", f"--master-port={port}", "--max-restarts=0",
            "--monitor-interval=0.1",
        ]  # fmt: skip
        argv = [*head, *_argv(ctx, "--kill", kills, "--pace", str(PACE_S), *extra)[1:]]
        return procs.start(
            ctx.nodes.exec_in(node, argv), env=node_env(ctx, node), log=ctx.work / log
        )

    node0, lost = agent(0, "node0.log"), agent(1, "node1-lost.log")
    gone = procs.wait(lost, ctx.timeout)  # its ranks kill themselves; the agent gives up
    back = agent(1, "node1-back.log")
    finished = procs.wait_all([node0, back], ctx.timeout)
    seconds = time.monotonic() - started
    said = Said.read(finished[0].log, gone.log, finished[1].log)
    problems = []
    if gone.returncode in (0, None):
        problems.append(f"node 1's first agent exited {gone.returncode}, not as a lost node")
    codes = [f.returncode for f in finished]
    if codes != [0, 0]:
        problems.append(f"node 0 and node 1's new agent exited {codes}")
    ranks = list(range(2 * per_node))
    if want is not None:
        problems.append(_digests_match(said, ranks, want))
        ends = f"both end with the uninterrupted run's SHA-256 {want[:12]}"
    else:
        problems.append(_states_agree(said, ranks))
        ends = "every rank's model and whole optimizer state agree at every step"
    recoveries = [r.split() for r in said.of(0, "recovery")]
    shrink_to = ["1", ",".join(map(str, lost_ranks)), "-"]
    joined = {j for r in recoveries[1:] if r[1] == "-" for j in r[2].split(",")}
    new_ids = {str(2 * per_node + i) for i in range(per_node)}  # the newcomers may join apart
    if not recoveries or recoveries[0][:3] != shrink_to or joined != new_ids:
        problems.append(f"node 0's regroups were {recoveries}, not a shrink then a grow")
    failed = _failed(problems, finished[0].tail(), seconds)
    if failed is not None:
        return failed
    join_s = _join_s(said, per_node)  # node 1's first new rank
    shrink = _kill_to_commit(said, killed=per_node) or float("nan")
    return Verdict(
        ok=True,
        line=(
            f"pass (2 nodes x {per_node} rank(s), {seconds:.1f} s; node 1 lost at step "
            f"{KILL_STEP}: node 0 committed the next step alone {(shrink - PACE_S) * 1e3:.0f} ms "
            f"after the kill (not counting the script's {PACE_S} s wait per step while short); "
            f"node 1 back: its new rank committed its first step {join_s:.2f} s after its "
            f"process started; {ends})"
        ),
    )


def _states_agree(said: Said, ranks: list[int]) -> str:
    """'' when every ``state S HEX`` any rank printed is one digest per step, and every rank of
    ``ranks`` ended with the same parameters; else what is wrong."""
    states: dict[str, set[str]] = {}
    for rank in ranks:
        for line in said.of(rank, "state"):
            step, digest = line.split()
            states.setdefault(step, set()).add(digest)
    split = sorted((int(step) for step, found in states.items() if len(found) > 1))
    ends = {tuple(said.of(rank, "digest")[-1:]) for rank in ranks}
    if split or len(ends) != 1 or ends == {()}:
        return f"state digests differ at step(s) {split}, final digests {sorted(ends)}"
    return ""


def _shrink_only(ctx: Context, head: list[str], launcher: str, env: dict[str, str]) -> Verdict:
    started = time.monotonic()
    want = _uninterrupted(ctx)
    if isinstance(want, Verdict):
        return want
    argv = [*head, *_argv(ctx, "--kill", f"{KILLED}@{KILL_STEP}")]
    done = procs.run(argv, env=env, log=ctx.work / "run.log", timeout=ctx.timeout)
    seconds = time.monotonic() - started
    said = Said.read(done.log)
    problems = [_digests_match(said, list(range(KILLED)), want)]
    worlds = [said.of(r, "world")[-1:] for r in range(KILLED)]
    if worlds != [["2"]] * KILLED:
        problems.append(f"the survivors' world sizes were {worlds}")
    if done.returncode is None:
        problems.append("the launcher hung")
    failed = _failed(problems, done.tail(), seconds)
    if failed is not None:
        return failed
    shrink = _kill_to_commit(said) or float("nan")
    return Verdict(
        ok=True,
        line=(
            f"pass ({RANKS} ranks, {seconds:.1f} s; rank {KILLED} SIGKILLed at step {KILL_STEP}; "
            f"{launcher} kept the others (it exited {done.returncode}), which committed the "
            f"next step {shrink * 1e3:.0f} ms after the kill at 2 ranks and end with the "
            f"uninterrupted run's SHA-256 {want[:12]})"
        ),
    )


def openmpi_inplace(ctx: Context) -> Verdict:
    """mpirun --enable-recovery: the survivors shrink and finish."""
    head = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--enable-recovery",
            "-np", str(RANKS)]  # fmt: skip
    return _shrink_only(ctx, head, "mpirun --enable-recovery", ctx.env)


def slurm_inplace(ctx: Context) -> Verdict:
    """srun -K0 -W0: the survivors shrink and finish."""
    assert ctx.cluster is not None
    return _shrink_only(
        ctx, ["srun", "-K0", "-W0", "-n", str(RANKS)], "srun -K0", {**ctx.env, **ctx.cluster.env}
    )


INPLACE = (
    Restart(name="torchrun-inplace", timeout=180, run=torchrun_inplace),
    Restart(
        name="openmpi-inplace",
        timeout=120,
        run=openmpi_inplace,
        binaries=("mpirun.openmpi",),
    ),
    Restart(name="slurm-inplace", timeout=120, run=slurm_inplace, needs="slurm"),
    Restart(name="torchrun-2node-inplace", timeout=180, run=torchrun_2node_inplace, needs="netns"),
    Restart(
        name="torchrun-2node-zero-inplace",
        timeout=180,
        run=torchrun_2node_zero_inplace,
        needs="netns",
    ),
)
