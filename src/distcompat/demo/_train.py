"""One rank of the demo: resume, train, checkpoint, check a resume, check the replicas, report.

The two lines the CLI writes on every rank (inside torchrun, srun, or ranks the demo started)::

    config = DemoConfig(out=Path("demo-out"), steps=160)
    exit_code = run_rank(config)         # 0, or 3 when replicas differ or the resume diverged

Every distcompat piece a real loop needs is used once, in the order a reader meets it:
``init_distributed`` (gloo on CPU), the corpus written once with ``write_tokens``, a sharded
``TokenLoader``, a GPT whose attention goes through ``attend``, the ZeRO optimizer of
:mod:`distcompat.demo._optim` (async reduce-scatter / all-gather futures), ``progress`` and
``print0`` on rank 0, ``resume`` / ``save_checkpoint`` of ``training_state`` (every
``save_every`` steps, so a restarted attempt continues from the newest committed one), and at the
end the collectives of :mod:`distcompat.demo._checks`. ``--kill RANK@STEP`` makes one rank
SIGKILL itself on the first attempt (:mod:`distcompat.demo._restarts`); ``--preempt RANK@STEP``
sends it SIGTERM, and the :class:`~distcompat.preemption.Preemption` asked after every step
makes every rank save the agreed step and exit 143, which the supervisor restarts.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import distcompat
import distcompat.distributed as dist
from distcompat.checkpoint import load_checkpoint, resume, save_checkpoint
from distcompat.data import write_tokens
from distcompat.demo._checks import check_replicas, flat_parameters, params_sha256, time_allreduce
from distcompat.demo._config import DemoConfig
from distcompat.demo._corpus import encode, generate_text
from distcompat.demo._report import RunReport, StepRecord, TimingsWriter, write_manifest
from distcompat.demo._restarts import (
    KILL_FILE,
    PREEMPTIONS_FILE,
    RESTARTS_FILE,
    attempt_number,
    in_place_timings,
    kill_if_planned,
    preempt_if_planned,
    preemptions,
    record_preemption,
    restart_timings,
)
from distcompat.demo._trainer import Trainer
from distcompat.demo._validate import validate
from distcompat.inplace import InPlace, Recovery
from distcompat.preemption import Preemption, StopReport
from distcompat.rank_logging import progress_backend
from distcompat.runtime import compute_dtype

__all__ = ["EXIT_CHECK_FAILED", "run_rank"]

#: Exit code of a run that finished but whose replica or resume check failed.
EXIT_CHECK_FAILED = 3
_log = distcompat.get_logger("distcompat.demo")


def _above_bar() -> str:
    """Prefix that erases a tqdm bar drawn on the same terminal, so a log line replaces it.

    tqdm redraws the bar on the next line at its next update; without a terminal (a log file, a
    pipe) there is no bar line to erase and the prefix is empty.
    """
    both_tty = sys.stdout.isatty() and sys.stderr.isatty()
    return "\r\x1b[K" if both_tty and progress_backend().name == "tqdm" else ""


def _prepare_corpus(config: DemoConfig, *, first_attempt: bool) -> Path:
    """Rank 0 writes the token file (and, on a first attempt, clears old checkpoints)."""
    path = config.out / "data" / "corpus.u16"
    if distcompat.is_main_process() and (first_attempt or not path.exists()):
        (config.out / "data").mkdir(parents=True, exist_ok=True)
        if first_attempt:  # ours, from an older run; a restart resumes from them instead
            shutil.rmtree(config.out / "checkpoints", ignore_errors=True)
            for name in (KILL_FILE, RESTARTS_FILE, PREEMPTIONS_FILE):
                (config.out / name).unlink(missing_ok=True)
        tokens = encode(generate_text(seed=config.seed, num_bytes=config.corpus_bytes))
        write_tokens(path, tokens, dtype=torch.uint16)
    distcompat.barrier()
    return path


@dataclass(slots=True, kw_only=True)
class _Progress:
    """What a run carries across restarts (in each checkpoint's extra) and what it times."""

    records: list[StepRecord]
    resume_check: dict[str, Any] | None
    attempt: int
    caught_up: float | None = None
    recoveries: list[Recovery] = field(default_factory=list)  # --in-place: each regroup

    @classmethod
    def from_extra(cls, extra: dict[str, Any], attempt: int) -> _Progress:
        records = [StepRecord(**r) for r in extra.get("records", [])]
        return cls(records=records, resume_check=extra.get("resume_check"), attempt=attempt)

    def extra(self) -> dict[str, Any]:
        return {"records": [asdict(r) for r in self.records], "resume_check": self.resume_check}


def _train(
    config: DemoConfig,
    trainer: Trainer,
    timings: TimingsWriter,
    progress: _Progress,
    corpus: Path,
    device: torch.device,
    preemption: Preemption,
) -> StopReport | None:
    """Run the main loop from ``trainer.step``; save every ``save_every`` steps; check a resume.

    The resume check runs as soon as the steps it compares exist, while the checkpoint it loads
    is still kept; its result travels in the following checkpoints, so a restart keeps it.
    Returns the stop's report when the ranks stopped on a signal (None: the run ended).
    """
    snapshot_step = config.checkpoint_step + config.resume_compare_steps
    kill = config.kill_target
    rank = distcompat.get_rank()
    inplace = _in_place(config, trainer, progress)
    attempts = (
        _once_each(trainer.step, config.steps) if inplace is None else inplace.steps(config.steps)
    )
    # disable=None: tqdm draws the bar on a terminal only; logs get the loss lines alone.
    desc = f"train x{distcompat.get_world_size()}"
    bar: Iterator[Any] = distcompat.progress(
        attempts, desc=desc, total=config.steps - trainer.step, disable=None
    )
    for attempt in bar:
        step = attempt.step + 1
        kill_if_planned(config, rank, step, progress.attempt)
        preempt_if_planned(config, rank, step, progress.attempt)
        if kill is not None and progress.attempt > 0 and step == kill[1]:
            progress.caught_up = time.time()
        with attempt:  # in place: a peer lost inside, the others regroup and give the step again
            record = trainer.train_step()
        if inplace is not None and inplace.step != step:
            trainer.regrouped(inplace.step)  # the state a survivor sent, at the new size
            progress.recoveries = inplace.recoveries
            continue
        if inplace is not None and kill is not None and step == kill[1]:
            progress.caught_up = time.time()  # the step the lost rank left, committed
        progress.records.append(record)
        timings.write(record, phase="train")
        if record.step % config.log_interval == 0 or record.step == config.steps:
            distcompat.print0(_above_bar() + record.line(config.steps), flush=True)
        if record.step == snapshot_step:
            snapshot = flat_parameters(trainer.model)
            progress.resume_check = _resume_check(
                config, corpus, device, progress.records, snapshot, timings
            )

        def save(step: int = record.step) -> None:
            path = save_checkpoint(
                config.out / "checkpoints",
                step,
                trainer.state(**progress.extra()),
                keep_last=config.keep_last,
                metadata={"seed": config.seed, "world_size": distcompat.get_world_size()},
            )
            _log.debug("checkpoint after step %d: %s", step, path)

        saved = config.saves_at(record.step)
        if saved:
            save()
        if preemption.should_stop(record.step):  # every rank, the same answer
            report = preemption.stop(save=None if saved else save, exit=False)
            if rank == 0:
                record_preemption(config.out, {"attempt": progress.attempt, **asdict(report)})
            return report
    return None


class _Once(contextlib.nullcontext[None]):
    """One step of a run not in place: the attempt's shape, no protection (``step`` applied)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step


def _once_each(done: int, total: int) -> Iterator[_Once]:
    yield from (_Once(step) for step in range(done, total))


class _Records:
    """The run's step records as a Stateful: a survivor's go to the others with the state."""

    def __init__(self, progress: _Progress) -> None:
        self._progress = progress

    def state_dict(self) -> dict[str, Any]:
        return {"records": list(self._progress.records)}  # InPlace asks each step: no copies

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._progress.records = list(state["records"])


class _Loader:
    """The trainer's loader as a Stateful (:meth:`Trainer.regrouped` replaces the loader)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return dict(self._trainer.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.loader.load_state_dict(state)


def _in_place(config: DemoConfig, trainer: Trainer, progress: _Progress) -> InPlace | None:
    """With ``--in-place``: the loop's :class:`~distcompat.inplace.InPlace` over its state."""
    if not config.in_place:
        return None
    state: dict[str, Any] = {"plan": trainer.plan, "loader": _Loader(trainer)}
    state["records"] = _Records(progress)
    if trainer.exact is not None:
        state["exact"] = trainer.exact
    return InPlace(trainer.model, trainer.optimizer, state=state, shard_copies=True)


def _resume_check(
    config: DemoConfig,
    corpus: Path,
    device: torch.device,
    records: list[StepRecord],
    snapshot: torch.Tensor,
    timings: TimingsWriter,
) -> dict[str, Any]:
    """Load the mid-run checkpoint into fresh objects, re-run steps, compare with the run."""
    # A different init seed: if loading did nothing, the comparison fails loudly.
    fresh = Trainer.build(config, corpus, device, init_seed=config.seed + 1)
    try:
        first = config.checkpoint_step
        fresh.load(load_checkpoint(config.out / "checkpoints", first), first)
        rerun = []
        for _ in range(config.resume_compare_steps):
            record = fresh.train_step()
            timings.write(record, phase="resume")
            rerun.append(record.loss)
        params = flat_parameters(fresh.model)
    finally:
        fresh.close()
    original = [r.loss for r in records[first : first + len(rerun)]]
    loss_diff = max(abs(a - b) for a, b in zip(rerun, original, strict=True))
    param_diff = float((params - snapshot).abs().max().item())
    bitwise = torch.equal(params.view(torch.uint8), snapshot.view(torch.uint8))
    same = torch.tensor([float(rerun == original and bitwise)], device=device)
    distcompat.all_reduce(same, op=dist.ReduceOp.MIN)
    return {
        "matched": bool(same.item() == 1.0),
        "checkpoint_step": first,
        "steps_compared": len(rerun),
        "losses_original": original,
        "losses_resumed": rerun,
        "max_loss_diff": loss_diff,
        "max_param_diff": param_diff,
        "rule": "exact: losses equal as floats and parameters equal bit for bit on every rank",
    }


def _sizes(config: DemoConfig, trainer: Trainer, saved_by: int | None) -> dict[str, Any]:
    """Return the manifest's account of the batch sizes, the mode and a resize."""
    share = trainer.share
    return {
        "global_batch_fixed": config.plan is not None,
        "global_batch": share.samples * share.world_size,
        "micro_batch": share.micro_batch,
        "accum_steps": share.accum_steps,
        "world_size": share.world_size,
        "mode": "exact" if config.exact else "float",
        "resize": config.resize,
        "resumed_from_world_size": saved_by,
        "samples_consumed": share.samples * share.world_size * trainer.step,
        "steps_redone_this_attempt": trainer.redone,
    }


def run_rank(config: DemoConfig) -> int:
    """Run the demo on this rank and return its exit code; the caller destroys the group.

    The group comes from the launcher environment (``init_distributed``); the caller tears it
    down with ``destroy_distributed`` after reporting, since a teardown can hang (torch 2.4).

    Example:
        >>> from pathlib import Path
        >>> run_rank(DemoConfig(out=Path("demo-out")))  # doctest: +SKIP
        0
    """
    torch.set_num_threads(1)  # one thread per rank: ranks share the machine's cores
    started = time.perf_counter()
    attempt = attempt_number()
    info = distcompat.init_distributed(
        device=config.device, backend=config.backend, timeout=config.timeout_s
    )
    group_ready = time.time()
    corpus = _prepare_corpus(config, first_attempt=attempt == 0)
    trainer = Trainer.build(config, corpus, info.device, init_seed=config.seed)
    resumed = resume(
        config.out / "checkpoints",
        model=trainer.model,
        optimizer=trainer.optimizer,
        loader=trainer.loader,
        plan=trainer.plan,
        world_change="follow",  # ZeroAdamW's shards are re-cut for another world size
    )
    resumed_at = time.time()
    trainer.resumed(resumed.step, resumed.extra)
    progress = _Progress.from_extra(resumed.extra, attempt)
    dtype = compute_dtype(info.device)
    params = sum(p.numel() for p in trainer.model.parameters())
    share = trainer.share
    batch = (
        f"{config.batch_size}x{config.seq_len} tokens per rank"
        if config.plan is None
        else f"{config.plan.global_batch}x{config.seq_len} tokens ({share.accum_steps} "
        f"micro-batch(es) of {share.micro_batch} per rank{', exact mode' if config.exact else ''}"
        f"{', in place' if config.in_place else ''})"
    )
    distcompat.print0(
        f"distcompat demo: {info.world_size} rank(s), {info.backend or 'no group'} on "
        f"{info.device}, {params / 1e6:.2f}M parameters, {config.steps} steps of {batch}\n"
        f"  {info.reason.replace(chr(10), chr(10) + '  ')}\n  dtype: {dtype.reason}"
        + (f"\n  attempt {attempt}: resumed after step {resumed.step}" if attempt else ""),
        flush=True,
    )
    preemption = Preemption()  # SIGTERM or SIGUSR1: every rank stops at one step, saved
    with TimingsWriter(config.out / "timings.jsonl", attempt=attempt) as timings:
        stopped = _train(config, trainer, timings, progress, corpus, info.device, preemption)
        trainer.close()
        preemption.close()
        if stopped is not None:  # the supervisor (or torchrun) restarts the ranks
            return stopped.plan.exit_code
        distcompat.print0("checks: validation, replicas, all-reduce latency ...", flush=True)
        validation = validate(trainer.model, config, info.device)  # gather_for_metrics
        replicas = check_replicas(trainer.model)
        latency = time_allreduce(numel=params, reps=config.allreduce_reps, device=info.device)
    assert progress.resume_check is not None  # DemoConfig keeps the check within 1..steps
    # in place, the group may have fewer ranks now: the report is of the ranks that finished
    info = replace(info, rank=distcompat.get_rank(), world_size=distcompat.get_world_size())
    report = RunReport(
        config=config,
        info=info,
        dtype=dtype,
        parameter_count=params,
        records=progress.records,
        replicas=replicas,
        allreduce=latency,
        resume=progress.resume_check,
        validation=validation,
        wall_s=time.perf_counter() - started,
        restarts=attempt,
        preemptions=preemptions(config.out),
        final_params_sha256=params_sha256(trainer.model),
        sizes=_sizes(config, trainer, resumed.world_size),
        restart_timings=restart_timings(
            config.out,
            attempt=attempt,
            group_ready=group_ready,
            resumed_step=resumed.step,
            resume_s=resumed.seconds,
            resumed_at=resumed_at,
            caught_up=progress.caught_up,
        )
        or in_place_timings(config.out, progress.recoveries, progress.caught_up),
    )
    if distcompat.is_main_process():
        write_manifest(config.out / "manifest.json", report)
        distcompat.print0(report.summary(), flush=True)
    return 0 if report.passed else EXIT_CHECK_FAILED
