"""What the demo writes: ``timings.jsonl`` per step, ``manifest.json`` and the closing summary.

The lines the demo writes (rank 0 writes the files; other ranks' writers are silent)::

    with TimingsWriter(out / "timings.jsonl") as timings:
        timings.write(record, phase="train")
    write_manifest(out / "manifest.json", report)
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

import distcompat
from distcompat._ranks import DistInfo
from distcompat.checkpoint import atomic_write_json
from distcompat.demo._checks import AllReduceTiming, ReplicaCheck
from distcompat.demo._config import DemoConfig
from distcompat.demo._validate import Validation
from distcompat.runtime import DtypeChoice

__all__ = ["RunReport", "StepRecord", "TimingsWriter", "throughput", "write_manifest"]

#: Why a 2-rank run on one small machine may not reach 2x (the seed lab asks for this paragraph).
SCALING_NOTE = (
    "Ranks here are processes on one machine: N ranks on N cores scale tokens/s by about N only "
    "while each step's compute dominates its communication (a reduce-scatter and an all-gather of "
    "the parameters through loopback TCP) and the cores are otherwise idle. A tiny model, a small "
    "batch, more ranks than free cores, or shared memory bandwidth push the ratio below N."
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One optimizer step: global mean loss, learning rate and where the time went (rank 0's).

    ``sync_wait_ms`` is the time ``step()`` blocked on collectives not yet overlapped by backward.

    Example:
        >>> r = StepRecord(step=3, loss=2.5, lr=1e-3, step_ms=10.0, data_ms=0.1,
        ...     sync_wait_ms=1.0, tokens=2048, tokens_per_sec=204800.0)
        >>> r.line(10)
        'step 3/10  loss 2.5000  lr 1.00e-03  204,800 tok/s  sync wait 1.0 ms'
    """

    step: int
    loss: float
    lr: float
    step_ms: float
    data_ms: float
    sync_wait_ms: float
    tokens: int
    tokens_per_sec: float

    def line(self, steps: int) -> str:
        """Return a one-line progress report."""
        return (
            f"step {self.step}/{steps}  loss {self.loss:.4f}  lr {self.lr:.2e}  "
            f"{self.tokens_per_sec:,.0f} tok/s  sync wait {self.sync_wait_ms:.1f} ms"
        )


def throughput(records: list[StepRecord]) -> tuple[float, int]:
    """Return (tokens/s over the steps after warm-up, warm-up steps skipped).

    The first 10% of steps (1 to 5) are skipped: they pay for first-touch allocations.

    Example:
        >>> rec = [StepRecord(step=i, loss=1.0, lr=0.1, step_ms=100.0, data_ms=0.0,
        ...     sync_wait_ms=0.0, tokens=10, tokens_per_sec=100.0) for i in range(10)]
        >>> throughput(rec)
        (100.0, 1)
    """
    skip = min(5, max(1, len(records) // 10)) if len(records) > 1 else 0
    kept = records[skip:]
    seconds = sum(r.step_ms for r in kept) / 1e3
    return (sum(r.tokens for r in kept) / seconds if seconds > 0 else 0.0), skip


class TimingsWriter:
    """Append one JSON line per step to ``path`` on rank 0; a no-op elsewhere.

    The first attempt truncates the file on open; a restarted one (``attempt`` > 0) appends.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp(), "timings.jsonl")
        >>> rec = StepRecord(step=1, loss=1.0, lr=0.1, step_ms=1.0, data_ms=0.0,
        ...     sync_wait_ms=0.0, tokens=8, tokens_per_sec=8000.0)
        >>> with TimingsWriter(path) as timings:
        ...     timings.write(rec, phase="train")
        >>> json.loads(path.read_text())["phase"]
        'train'
    """

    def __init__(self, path: Path, *, attempt: int = 0) -> None:
        self._path = path
        self._attempt = attempt
        self._file: IO[str] | None = None

    def __enter__(self) -> TimingsWriter:
        if distcompat.is_main_process():
            self._path.parent.mkdir(parents=True, exist_ok=True)
            # a restarted attempt appends: the steps it re-runs show up twice, with its number
            self._file = open(self._path, "a" if self._attempt else "w", encoding="utf-8")
        return self

    def write(self, record: StepRecord, *, phase: str) -> None:
        """Write ``record`` as one line, tagged with ``phase`` ("train" or "resume") and attempt."""
        if self._file is not None:
            line = {"phase": phase, "attempt": self._attempt, **asdict(record)}
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunReport:
    """Everything the manifest and the summary say about one run (rank 0's view)."""

    config: DemoConfig
    info: DistInfo
    dtype: DtypeChoice
    parameter_count: int
    records: list[StepRecord]
    replicas: ReplicaCheck
    allreduce: AllReduceTiming
    resume: dict[str, Any]
    wall_s: float
    restarts: int = 0
    final_params_sha256: str = ""
    restart_timings: dict[str, Any] | None = None
    validation: Validation | None = None
    preemptions: list[dict[str, Any]] = field(default_factory=list)
    sizes: dict[str, Any] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        """Global mean loss of each training step."""
        return [r.loss for r in self.records]

    @property
    def loss_decreased(self) -> bool:
        """Whether the mean of the last 10% of losses is below the mean of the first 10%."""
        n = max(1, len(self.losses) // 10)
        return sum(self.losses[-n:]) / n < sum(self.losses[:n]) / n

    @property
    def passed(self) -> bool:
        """True when the replicas are equal, the resume matched and validation saw each window."""
        seen = self.validation is None or self.validation.each_once
        return self.replicas.equal and bool(self.resume["matched"]) and seen

    def manifest(self) -> dict[str, Any]:
        """Return the JSON object written to ``manifest.json``."""
        tokens_per_sec, skipped = throughput(self.records)
        config = self.config
        return {
            "lab": "distcompat demo (seed lab 01: data-parallel training on CPU with gloo)",
            "seed": config.seed,
            "world_size": self.info.world_size,
            "parameter_count": self.parameter_count,
            "steps": config.steps,
            "losses": self.losses,
            "loss_first": self.losses[0],
            "loss_last": self.losses[-1],
            "loss_decreased": self.loss_decreased,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_note": (
                f"global tokens per second over steps {skipped + 1}..{config.steps} "
                f"({skipped} warm-up step(s) skipped; checkpoint saving not included)"
            ),
            "tokens_per_step": (
                config.batch_size * self.info.world_size
                if config.plan is None
                else config.plan.global_batch
            )
            * config.seq_len,
            "sizes": self.sizes,
            "allreduce_p50_ms": self.allreduce.p50_ms,
            "allreduce_p95_ms": self.allreduce.p95_ms,
            "allreduce_numel": self.allreduce.numel,
            "allreduce_what": self.allreduce.what,
            "replicas_equal": self.replicas.equal,
            "replicas_differing_elements": self.replicas.differing_elements,
            "replicas_max_abs_diff": self.replicas.max_abs_diff,
            "replicas_tolerance": self.replicas.tolerance,
            "resume_matched": bool(self.resume["matched"]),
            "resume": self.resume,
            "validation": None if self.validation is None else asdict(self.validation),
            "checkpoint_step": config.checkpoint_step,
            "checkpoint_every": config.save_every,
            "restarts": self.restarts,
            "restart_timings": self.restart_timings,
            "preemptions": len(self.preemptions),
            "preemption": _preemption_entry(self.preemptions),
            "final_params_sha256": self.final_params_sha256,
            "sync_wait_ms_median": _median([r.sync_wait_ms for r in self.records]),
            "step_ms_median": _median([r.step_ms for r in self.records]),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
            "model": asdict(config.model_config()),
            "torch": torch.__version__,
            "distcompat": distcompat.__version__,
            "python": platform.python_version(),
            "backend": self.info.backend,
            "device": str(self.info.device),
            "dtype": str(self.dtype.dtype).removeprefix("torch."),
            "launcher": self.info.launcher,
            "threads_per_rank": torch.get_num_threads(),
            "reasons": {
                "device": self.info.device_reason,
                "backend": self.info.backend_reason,
                "timeout": self.info.timeout_reason,
                "dtype": self.dtype.reason,
            },
            "scaling_note": SCALING_NOTE,
            "wall_s": self.wall_s,
            "wall_s_note": "this attempt's ranks, from start to report (a restart starts anew)",
        }

    def summary(self) -> str:
        """Return the closing lines printed on rank 0."""
        tokens_per_sec, _ = throughput(self.records)
        ok = "PASS" if self.passed else "FAIL"
        resume = self.resume
        return "\n".join(
            (
                f"done in {self.wall_s:.1f}s: {ok}",
                f"  loss            {self.losses[0]:.3f} -> {self.losses[-1]:.3f}"
                f" ({'decreased' if self.loss_decreased else 'did NOT decrease'})",
                f"  throughput      {tokens_per_sec:,.0f} tokens/s on {self.info.world_size} "
                "rank(s)",
                f"  all-reduce      p50 {self.allreduce.p50_ms:.2f} ms, p95 "
                f"{self.allreduce.p95_ms:.2f} ms ({self.allreduce.numel * 4 / 1e6:.1f} MB float32)",
                f"  replicas        {'byte-equal' if self.replicas.equal else 'DIFFER'} "
                f"({self.replicas.differing_elements} differing elements)",
                f"  resume          {'matched' if resume['matched'] else 'DID NOT MATCH'} "
                f"({resume['steps_compared']} steps after the step-{resume['checkpoint_step']} "
                f"checkpoint; max loss diff {resume['max_loss_diff']:.3g})",
                *_validation_line(self.validation),
                f"  restarts        {self.restarts}{_restart_line(self.restart_timings)}",
                *_preemption_line(self.preemptions),
                *_sizes_line(self.sizes),
                f"  params sha256   {self.final_params_sha256}",
                f"  wrote           {self.config.out / 'manifest.json'}, "
                f"{self.config.out / 'timings.jsonl'}",
            )
        )


def _sizes_line(sizes: dict[str, Any]) -> list[str]:
    """Return the summary's line on the global batch, the mode and a resize (none without)."""
    if not sizes.get("global_batch_fixed"):
        return []
    resized = sizes["resumed_from_world_size"] not in (None, sizes["world_size"])
    moved = f"; resumed from {sizes['resumed_from_world_size']} rank(s)" if resized else ""
    return [
        f"  batch           {sizes['global_batch']} sequences a step in micro-batches of "
        f"{sizes['micro_batch']} ({sizes['mode']} mode, {sizes['samples_consumed']} consumed"
        f"{moved})"
    ]


def _validation_line(validation: Validation | None) -> list[str]:
    """Return the summary's validation line (none when validation did not run)."""
    if validation is None:
        return []
    seen = "each once" if validation.each_once else "NOT each exactly once"
    return [
        f"  validation      loss {validation.loss:.3f} over {validation.windows} held-out "
        f"windows ({seen}, gathered from every rank by gather_for_metrics)"
    ]


def _restart_line(timings: dict[str, Any] | None) -> str:
    """Where the last restart's time went, for the summary (empty without a restart)."""
    if not timings:
        return ""

    def seconds(key: str) -> str:
        value = timings.get(key)
        return "?" if value is None else f"{value:.1f} s"

    if timings.get("in_place"):
        lost = timings.get("lost_s")
        return (
            f" (rank {timings.get('killed_rank')} killed at step {timings.get('killed_at_step')}; "
            f"{timings.get('world_size_after')} rank(s) went on in place from step "
            f"{timings.get('went_on_from_step')}: regroup {timings['regroup_s'] * 1e3:.0f} ms, "
            f"{timings.get('how')}; the killed step committed "
            f"{'?' if lost is None else f'{lost:.2f}'} s after the kill)"
        )
    if timings.get("killed_rank") is None:  # not a kill: a stop on purpose (see preemptions)
        return (
            f" (resumed after step {timings.get('resumed_after_step')}, "
            f"resume {seconds('resume_s')})"
        )
    detected = (
        f"detected {seconds('detect_s')}, peers stopped {seconds('peers_stopped_s')}, restart "
        if timings.get("detect_s") is not None
        else "detection and restart (by the launcher) "
    )
    return (
        f" (rank {timings.get('killed_rank')} killed at step {timings.get('killed_at_step')}; "
        f"resumed after step {timings.get('resumed_after_step')}: {detected}"
        f"{seconds('restart_s')}, resume {seconds('resume_s')}, "
        f"{timings.get('steps_redone')} step(s) redone {seconds('redo_s')}; "
        f"lost {seconds('lost_s')} in all)"
    )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def write_manifest(path: Path, report: RunReport) -> None:
    """Write ``report.manifest()`` to ``path`` atomically (call on rank 0).

    Example:
        >>> write_manifest(Path("demo-out/manifest.json"), report)  # doctest: +SKIP
    """
    atomic_write_json(path, report.manifest())


def _preemption_entry(stops: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Return the manifest's account of the last stop: its step, signal, phase times."""
    if not stops:
        return None
    last = stops[-1]
    return {
        "attempt": last["attempt"],
        "step": last["step"],
        "signal": last["signal"],
        "first_rank": last["first_rank"],
        "agreed_s": last["agreed_s"],
        "save_s": last["save_s"],
        "signal_to_exit_s": last["total_s"],
        "grace_s": last["grace_s"],
        "exit_code": last["plan"]["exit_code"],
    }


def _preemption_line(stops: list[dict[str, Any]]) -> list[str]:
    """Return the summary's line on the last stop (none without one)."""
    entry = _preemption_entry(stops)
    if entry is None:
        return []
    saved = "no save needed" if entry["save_s"] is None else f"saved in {entry['save_s']:.2f} s"
    return [
        f"  preemptions     {len(stops)} ({entry['signal']} to rank {entry['first_rank']}; every "
        f"rank stopped after step {entry['step']}, {saved}, "
        f"{entry['signal_to_exit_s']:.2f} s from the signal to the exit)"
    ]
