"""Restart cases: a rank is killed mid-run, the launcher restarts the group, the run resumes.

    verdict = torchrun_elastic(context)      # one line, like the launchers'
    print(f"launcher torchrun-elastic: {verdict.line}")

* ``torchrun-elastic``: ``elastic_train.py`` under ``torchrun --standalone --nproc-per-node=2
  --max-restarts=1``; rank 1 SIGKILLs itself at step ``KILL_STEP`` of the first attempt. It
  passes when torchrun exits 0 after exactly one restart, the restart resumed from the newest
  checkpoint committed before the kill, the losses of every step after it equal those of an
  uninterrupted run bit for bit, every sample was trained on exactly once in the committed
  history, and the final parameters hash like the uninterrupted run's.
* ``openmpi-rerun`` and ``slurm-rerun``: the same script under ``mpirun -np 2`` or ``srun -n 2``
  (in the session's Slurm cluster); the kill ends the job (neither restarts it), and running
  the same command again must resume it, with the same checks.
* ``openmpi-exits``: ten short runs of the same script under ``mpirun -np 2`` whose last step
  saves a checkpoint, then the script destroys its group and returns; all ten must exit 0 on
  both ranks. Its optimizer, made after init, once made torch keep the destroyed group and its
  gloo threads alive until teardown, and 1-5 of 10 such runs ended in SIGABRT on one rank
  ("terminate called without an active exception").
* ``torchrun-2node-shrink``: torchrun ``--nnodes=1:2`` on the two namespace nodes, one rank
  each; rank 1 kills its agent and itself (node 1 is lost); node 0's agent restarts alone, and
  the run must finish on 1 rank, resumed from the newest checkpoint, each sample seen once.
* ``torchrun-2node-shrink-exact``: the same shrink in exact mode (a global batch of 4 at every
  world size, gradients summed as integers): the run that went on alone on node 0 ends with the
  parameter bits of an uninterrupted 2-rank run.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import procs
from cases import HERE, RDZV_PORT, Context, Need, node_env
from netns import ADDRESSES
from verdict import Verdict

ELASTIC_TRAIN = HERE / "elastic_train.py"
SAMPLES = 96
BATCH = 2
EVERY = 3
KILL_RANK, KILL_STEP = 1, 14  # 2 ranks x 2 samples a step: 24 steps an epoch; saved after 12
_KILLED = f"rank {KILL_RANK} killed at step {KILL_STEP}"
_RESUME_AFTER_KILL = (KILL_STEP - 1) // EVERY * EVERY


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """One scenario that runs itself into one verdict line: a restart here, a watch case in
    ``watched.py``."""

    name: str
    timeout: float
    run: Callable[[Context], Verdict]
    needs: Need = "host"
    binaries: tuple[str, ...] = ()


def script_argv(out: Path, kill: str, run: str, *extra: str, samples: int = SAMPLES) -> list[str]:
    """``elastic_train.py`` and its arguments (the launcher's command goes before it)."""
    argv = [str(ELASTIC_TRAIN), "--out", str(out), "--tag", run]
    argv += ["--samples", str(samples), "--batch", str(BATCH), "--every", str(EVERY)]
    return argv + (["--kill", kill] if kill else []) + list(extra)


def start_script(
    ctx: Context,
    out: Path,
    head: list[str],
    *extra: str,
    kill: str = "",
    run: str,
    samples: int = SAMPLES,
) -> procs.Job:
    """Start ``head + elastic_train.py ... extra`` into ``out``; the log is ``<run>.log``."""
    out.mkdir(parents=True, exist_ok=True)
    argv = head + script_argv(out, kill, run, *extra, samples=samples)
    env = ctx.env if ctx.cluster is None else {**ctx.env, **ctx.cluster.env}  # SLURM_CONF
    return procs.start(argv, env=env, log=out / f"{run}.log", cwd=out)


def launch(
    ctx: Context,
    out: Path,
    head: list[str],
    *extra: str,
    kill: str = "",
    run: str,
    samples: int = SAMPLES,
    timeout: float | None = None,
) -> procs.Finished:
    """Run ``head + elastic_train.py ... extra`` into ``out`` and wait, bounded by the timeout."""
    job = start_script(ctx, out, head, *extra, kill=kill, run=run, samples=samples)
    return procs.wait(job, ctx.timeout if timeout is None else timeout)


def torchrun_head(ctx: Context, *flags: str) -> list[str]:
    return [str(ctx.bin / "torchrun"), "--standalone", "--nproc-per-node=2", *flags]


def mpirun_head(ctx: Context) -> list[str]:
    mpirun = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    return [*mpirun, ctx.python]


def _losses(out: Path) -> list[dict[str, Any]]:
    path = out / "losses.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def read_result(out: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads((out / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found


def judge_resumed(
    plain: Reference,
    out: Path,
    *,
    run: str,
    resumed_after: int,
    what: str,
    how: str,
    seconds: float,
) -> Verdict:
    """Compare the run tagged ``run`` in ``out``, which must have resumed after step
    ``resumed_after``, with the uninterrupted run ``plain``: the same losses from there on,
    each sample seen once, the same final parameters. ``what`` happened, ``how`` it came back:
    the words of the pass line."""
    plain_out = plain.out
    reference, result = read_result(plain_out), read_result(out)
    if reference is None or result is None:
        which = "uninterrupted" if reference is None else "resumed"
        return Verdict(ok=False, line=f"FAIL no result.json from the {which} run ({seconds:.1f} s)")
    problems = []
    if result["run"] != run:
        problems.append(f"finished in run {result['run']!r}, not {run!r}")
    if result["resumed_step"] != resumed_after:
        problems.append(f"resumed after step {result['resumed_step']}, not {resumed_after}")
    want = {r["step"]: r["loss"] for r in _losses(plain_out)}
    after = [r for r in _losses(out) if r["run"] == run]
    if [r["step"] for r in after] != list(range(resumed_after + 1, max(want) + 1)):
        problems.append(f"the resumed run ran steps {[r['step'] for r in after][:3]}...")
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
            f"pass (2 ranks, {seconds:.1f} s; {what}, {how}, resumed after step {resumed_after} "
            f"in {result['resume_s']:.2f} s, "
            f"losses of steps {resumed_after + 1}-{max(want)} equal to an uninterrupted run "
            f"({plain.made_by}, {plain.seconds:.1f} s), each of {SAMPLES} samples seen once, "
            "final parameters equal)"
        ),
    )


@dataclass(frozen=True, slots=True)
class Reference:
    """The uninterrupted run the restart cases compare with: where it wrote, how long it took."""

    out: Path
    seconds: float
    made_by: str  # the launcher command it ran under ("torchrun", "mpirun.openmpi", "srun")


#: The reference of this session, made by the first case that asks (see :func:`uninterrupted`).
_REFERENCE: list[Reference] = []


def uninterrupted(ctx: Context, head: list[str]) -> Reference | Verdict:
    """The uninterrupted 2-rank run of ``elastic_train.py``, made once a session.

    Every restart and preemption case trains the same 24 steps on 2 ranks, and gloo's bits do
    not depend on the launcher that started the ranks, nor on ``--preempt`` (a question asked
    each step) when no signal comes: one run under the first case's launcher is the reference of
    them all (it was one run per case, 7 runs of about 5.7 s each). Each case still compares its
    own resumed run with it bit for bit, so the launchers are compared with each other too.
    A failed run is not kept: the next case tries again, under its own launcher.
    """
    if _REFERENCE and read_result(_REFERENCE[0].out) is not None:
        return _REFERENCE[0]
    started = time.monotonic()
    out = ctx.work.parent / "uninterrupted"
    shutil.rmtree(out, ignore_errors=True)
    plain = launch(ctx, out, head, run="plain")
    seconds = time.monotonic() - started
    if plain.returncode != 0 or read_result(out) is None:
        line = f"FAIL uninterrupted run: exit {plain.returncode}: {plain.tail()} ({seconds:.1f} s)"
        return Verdict(ok=False, line=line)
    _REFERENCE[:] = [Reference(out, seconds, Path(head[0]).name)]
    return _REFERENCE[0]


def torchrun_elastic(ctx: Context) -> Verdict:
    """A rank killed under torchrun --max-restarts=1: restarted, resumed, same result."""
    started = time.monotonic()
    plain = uninterrupted(ctx, torchrun_head(ctx))
    if isinstance(plain, Verdict):
        return plain
    killed_out = ctx.work / "killed"
    head = torchrun_head(ctx, "--max-restarts=1", "--monitor-interval=0.1")
    # the script tags each attempt with torchrun's restart count: "attempt-0", "attempt-1"
    killed = launch(ctx, killed_out, head, kill=f"{KILL_RANK}@{KILL_STEP}", run="attempt")
    seconds = time.monotonic() - started
    if killed.returncode != 0:
        return Verdict(ok=False, line=f"FAIL killed run: exit {killed.returncode}: "
                       f"{killed.tail()} ({seconds:.1f} s)")  # fmt: skip
    return judge_resumed(
        plain,
        killed_out,
        run="attempt-1",
        resumed_after=_RESUME_AFTER_KILL,
        what=_KILLED,
        how="torchrun restarted the group",
        seconds=seconds,
    )


def srun_head(ctx: Context) -> list[str]:
    return ["srun", "-n", "2", ctx.python]


def openmpi_rerun(ctx: Context) -> Verdict:
    """A rank killed under mpirun ends the job; the same command again resumes it."""
    return _rerun(ctx, mpirun_head(ctx), "mpirun")


def slurm_rerun(ctx: Context) -> Verdict:
    """A rank killed under srun ends the step; the same srun again resumes it."""
    return _rerun(ctx, srun_head(ctx), "srun")


def _rerun(ctx: Context, head: list[str], launcher: str) -> Verdict:
    """Uninterrupted, killed, then the same command again: the last one must resume."""
    started = time.monotonic()
    plain = uninterrupted(ctx, head)
    if isinstance(plain, Verdict):
        return plain
    killed_out = ctx.work / "killed"
    first = launch(ctx, killed_out, head, kill=f"{KILL_RANK}@{KILL_STEP}", run="first")
    if first.returncode in (0, None):
        what = "hung" if first.returncode is None else "exited 0"
        return Verdict(ok=False, line=f"FAIL the run with a killed rank {what}: {first.tail()}")
    rerun = launch(ctx, killed_out, head, run="rerun")
    seconds = time.monotonic() - started
    if rerun.returncode != 0:
        return Verdict(ok=False, line=f"FAIL re-run: exit {rerun.returncode}: "
                       f"{rerun.tail()} ({seconds:.1f} s)")  # fmt: skip
    how = f"{launcher} ended the job (exit {first.returncode}), the same command again"
    return judge_resumed(
        plain,
        killed_out,
        run="rerun",
        resumed_after=_RESUME_AFTER_KILL,
        what=_KILLED,
        how=how,
        seconds=seconds,
    )


#: Runs of ``openmpi-exits``, and the samples of each (2 ranks x 2 a step: 3 steps, one save).
EXIT_RUNS, EXIT_SAMPLES = 10, 12


def openmpi_exits(ctx: Context) -> Verdict:
    """Ten short runs under mpirun that end in a save, destroy and return: all exit 0."""
    started = time.monotonic()
    failed = []
    for run in range(EXIT_RUNS):
        out = ctx.work / f"exit{run}"
        head = mpirun_head(ctx)
        done = launch(ctx, out, head, run=f"exit{run}", samples=EXIT_SAMPLES, timeout=60)
        result = read_result(out)
        if done.returncode != 0 or result is None or result["last_step"] % EVERY:
            failed.append(f"run {run}: exit {done.returncode}: {done.tail()}")
    seconds = time.monotonic() - started
    if failed:
        return Verdict(
            ok=False, line=f"FAIL {len(failed)} of {EXIT_RUNS}: {failed[0]} ({seconds:.1f} s)"
        )
    return Verdict(
        ok=True,
        line=f"pass ({EXIT_RUNS} of {EXIT_RUNS} runs ending in a save exited 0, {seconds:.1f} s)",
    )


def _elastic_node(ctx: Context, node: int, out: Path, run_id: str, *extra: str) -> procs.Job:
    """torchrun on namespace node ``node``: ``--nnodes=1:2``, 1 rank, c10d hosted on node 0."""
    assert ctx.nodes is not None, "a two-node case runs inside the namespaces run.py created"
    torchrun = [
        str(ctx.bin / "torchrun"),
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={ADDRESSES[0]}:{RDZV_PORT}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={1 if node == 0 else 0},last_call_timeout=5",
        f"--local-addr={ADDRESSES[node]}",
    ]
    script = script_argv(out, f"{KILL_RANK}@{KILL_STEP}", "attempt", "--kill-node", *extra)
    return procs.start(
        ctx.nodes.exec_in(node, [*torchrun, *script]),
        env=node_env(ctx, node),
        log=ctx.work / f"node{node}.log",
        cwd=ctx.work,
    )


def torchrun_2node_shrink(ctx: Context, *extra: str) -> Verdict:
    """Node 1 is lost mid-run (agent and rank killed); node 0 goes on alone, each sample once."""
    started = time.monotonic()
    out = ctx.work / "shrink"
    out.mkdir(parents=True)
    run_id = f"shrink{time.monotonic_ns() % 10**9}"
    jobs = [_elastic_node(ctx, node, out, run_id, *extra) for node in (0, 1)]
    node0, node1 = procs.wait_all(jobs, ctx.timeout)
    seconds = time.monotonic() - started
    result = read_result(out)
    problems = []
    if node0.returncode != 0:
        problems.append(f"node 0: exit {node0.returncode}: {node0.tail()}")
    if node1.returncode in (0, None):
        problems.append(f"node 1 was not killed (exit {node1.returncode}): {node1.tail()}")
    if result is None:
        problems.append("no result.json")
    else:
        if (result["world_size"], result["attempt"]) != (1, 1):
            problems.append(
                f"finished with world size {result['world_size']} on attempt {result['attempt']}, "
                "not 1 rank after one restart"
            )
        if result["resumed_step"] != _RESUME_AFTER_KILL:
            problems.append(
                f"resumed after step {result['resumed_step']}, not {_RESUME_AFTER_KILL}"
            )
        if result["seen"] != [1] * SAMPLES:
            wrong = [i for i, c in enumerate(result["seen"]) if c != 1]
            problems.append(f"samples not seen exactly once: {wrong[:8]}")
    if problems:
        return Verdict(ok=False, line=f"FAIL {'; '.join(problems)} ({seconds:.1f} s)")
    assert result is not None
    return Verdict(
        ok=True,
        line=(
            f"pass (2 ranks then 1, {seconds:.1f} s; node 1 lost at step {KILL_STEP}, node 0 "
            f"went on alone from step {result['resumed_step']}, steps to {result['last_step']} "
            f"on 1 rank, each of {SAMPLES} samples seen once)"
        ),
    )


def torchrun_2node_shrink_exact(ctx: Context) -> Verdict:
    """The shrink in exact mode: node 0 alone ends with an uninterrupted 2-rank run's bits."""
    exact = ("--exact", str(2 * BATCH))  # the global batch of the 2-rank start
    shrunk = torchrun_2node_shrink(ctx, *exact)
    if not shrunk.ok:
        return shrunk
    plain_out = ctx.work / "uninterrupted-exact"
    plain = launch(ctx, plain_out, torchrun_head(ctx), *exact, run="plain")
    reference, result = read_result(plain_out), read_result(ctx.work / "shrink")
    if plain.returncode != 0 or reference is None or result is None:
        return Verdict(ok=False, line=f"FAIL uninterrupted run: exit {plain.returncode}: "
                       f"{plain.tail()}")  # fmt: skip
    if reference["sha256"] != result["sha256"]:
        return Verdict(
            ok=False,
            line=f"FAIL parameters {result['sha256'][:12]} after the shrink, "
            f"{reference['sha256'][:12]} uninterrupted on 2 ranks",
        )
    return Verdict(
        ok=True,
        line=f"{shrunk.line.removesuffix(')')}; exact mode: the bits of an uninterrupted "
        f"2-rank run, sha256 {result['sha256'][:12]})",
    )


RESTARTS = (
    Restart(name="torchrun-elastic", timeout=240, run=torchrun_elastic),
    Restart(
        name="openmpi-rerun",
        timeout=240,
        run=openmpi_rerun,
        binaries=("mpirun.openmpi",),
    ),
    Restart(
        name="openmpi-exits",
        timeout=120,
        run=openmpi_exits,
        binaries=("mpirun.openmpi",),
    ),
    Restart(name="slurm-rerun", timeout=240, run=slurm_rerun, needs="slurm"),
    Restart(name="torchrun-2node-shrink", timeout=240, run=torchrun_2node_shrink, needs="netns"),
    Restart(
        name="torchrun-2node-shrink-exact",
        timeout=300,
        run=torchrun_2node_shrink_exact,
        needs="netns",
    ),
)
