"""``distcompat demo``: its flags, and the choice between starting ranks and being one.

The lines a user types::

    distcompat demo --out demo-out                       # starts 2 local gloo ranks itself
    torchrun --nproc-per-node=2 --no-python distcompat demo --out demo-out   # one rank each

``distcompat.cli`` registers the subcommand with :func:`add_demo_parser` and calls
:func:`run_demo_command`. Under a launcher (torchrun, srun, ...: whatever
:meth:`distcompat.LaunchEnv.from_environ` recognises) this process is one rank; otherwise it
starts ``--nproc`` ranks through :mod:`distcompat.demo._launch` and, with ``--sweep``, also runs
1..N-1 ranks and plots tokens/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import distcompat
from distcompat.checkpoint import atomic_write_json
from distcompat.demo._config import DemoConfig, DemoConfigError
from distcompat.demo._launch import (
    FINISHED,
    STATUS_DIR_VAR,
    LaunchOutcome,
    bind_to_parent,
    launch_ranks,
    write_status,
)
from distcompat.demo._plot import MissingExtraError, plot_scaling, require_matplotlib
from distcompat.demo._restarts import check_launcher_restarts, record_restart
from distcompat.demo._train import EXIT_CHECK_FAILED, run_rank
from distcompat.launch import LaunchEnv, LaunchEnvError

__all__ = [
    "DEFAULT_OUT",
    "EXIT_USAGE",
    "add_demo_parser",
    "config_from_options",
    "run_demo_command",
    "shown_default",
]

#: Exit code for a bad flag or an environment the demo cannot run in.
EXIT_USAGE = 2
#: Where ``distcompat demo`` writes when ``--out`` is left out.
DEFAULT_OUT = Path("distcompat-demo")

_HELP: dict[str, str] = {
    "out": "folder for manifest.json, timings.jsonl, checkpoints, corpus (seen by every rank)",
    "steps": "optimizer steps",
    "nproc": "ranks to start (default 2; under torchrun/srun the launcher's world size)",
    "sweep": "also run 1..N-1 ranks and plot tokens/s to scaling.png (needs distcompat[demo])",
    "seed": "seed of the corpus, the weights and the data order",
    "batch_size": "sequences per rank per step",
    "seq_len": "tokens per sequence",
    "n_layer": "transformer blocks",
    "n_head": "attention heads",
    "n_embd": "model width",
    "lr": "peak learning rate (warm-up, then cosine decay to 10%%)",
    "checkpoint_at": "step after which the mid-run checkpoint is saved (default: half way)",
    "resume_steps": "steps the resume check re-runs from the checkpoint",
    "allreduce_reps": "timed all-reduces for p50/p95",
    "corpus_bytes": "size of the generated corpus in bytes (one token per byte)",
    "device": "run device: cpu (gloo), cuda (nccl), cuda:N or auto",
    "backend": "process-group backend (default: from the device), e.g. gloo for CUDA ranks "
    "sharing one GPU with --device cuda:0",
    "log_every": "steps between loss lines (default: about 10 lines a run)",
    "timeout_s": "process-group timeout in seconds",
    "checkpoint_every": "steps between checkpoints a restart resumes from (default: an eighth "
    "of --steps)",
    "kill": "RANK@STEP: rank RANK SIGKILLs itself at step STEP of the first attempt; the ranks "
    "restart and resume from the newest committed checkpoint",
    "max_restarts": "restarts after a failed attempt when the demo starts the ranks itself "
    "(default: 1 with --kill or --preempt, else 0; under torchrun, its --max-restarts)",
    "preempt": "RANK@STEP: rank RANK gets SIGTERM at step STEP of the first attempt; every rank "
    "saves the step they agree on, exits, and the ranks restart and resume from it",
    "global_batch": "sequences per step, all ranks together (the same run at any world size; "
    "without it --batch-size is per rank)",
    "micro_batch": "sequences per forward pass with --global-batch (default: --batch-size)",
    "exact": "sum gradients as fixed-point integers: the same final bits at any world size "
    "(needs --global-batch)",
    "resize": "OLD:NEW@STEP: start OLD ranks, stop them together after step STEP, finish on NEW "
    "ranks (the demo's own ranks only)",
    "in_place": "a lost rank (--kill) costs a regroup, not a restart: the other ranks go on in "
    "place at the new size, the global batch kept (distcompat.inplace)",
}


def shown_default(name: str) -> str:
    """Return the ``" (default: ...)"`` suffix of a flag's help ("" when the help says it).

    ``out`` has no dataclass default (a config names its folder); the command's is
    :data:`DEFAULT_OUT`. Floats print as a person writes them, byte counts also in MiB.

    Example:
        >>> shown_default("out"), shown_default("lr"), shown_default("corpus_bytes")
        (' (default: distcompat-demo)', ' (default: 0.003)', ' (default: 1048576 = 1 MiB)')
        >>> shown_default("nproc")   # None: the help text explains the default itself
        ''
    """
    if name == "out":
        return f" (default: {DEFAULT_OUT})"
    default = next(item.default for item in fields(DemoConfig) if item.name == name)
    if default is None or isinstance(default, bool):
        return ""
    if isinstance(default, float):
        return f" (default: {default:g})"
    if name.endswith("_bytes") and isinstance(default, int) and default >= 1 << 20:
        return f" (default: {default} = {default / (1 << 20):g} MiB)"
    return f" (default: {default})"


def add_demo_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``commands`` (what ``add_subparsers()`` returned).

    Example:
        >>> parser = argparse.ArgumentParser(prog="distcompat")
        >>> demo = add_demo_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["demo", "--steps", "4"]).steps
        4
    """
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="train a tiny nanochat-style GPT on N local gloo ranks and check the result",
        description=(
            "Train a small GPT (rotary, QK norm, distcompat.attend) with a ZeRO-style AdamW "
            "whose gradient sync overlaps backward through async reduce-scatter / all-gather "
            "futures, on a generated corpus through distcompat.data.TokenLoader. Saves a "
            "checkpoint mid-run, checks that resuming from it reproduces the run, that every "
            "rank holds byte-equal weights, and times all-reduce. Exit code 0 when both checks "
            "pass, 3 when one fails, 1 when a rank fails, 2 for a usage error."
        ),
    )
    for item in fields(DemoConfig):
        flag = "--" + item.name.replace("_", "-")
        shown = shown_default(item.name)
        if item.name in ("sweep", "exact", "in_place"):
            parser.add_argument(flag, action="store_true", help=_HELP[item.name])
        elif item.name == "out":
            parser.add_argument(flag, type=Path, default=DEFAULT_OUT, help=_HELP["out"] + shown)
        else:
            kinds = {
                "lr": float, "timeout_s": float, "device": str, "backend": str, "kill": str,
                "preempt": str, "resize": str,
            }  # fmt: skip
            kind = kinds.get(item.name, int)
            parser.add_argument(flag, type=kind, default=None, help=_HELP[item.name] + shown)
    return parser


def config_from_options(options: argparse.Namespace) -> DemoConfig:
    """Build the :class:`DemoConfig` from parsed flags (flags left out keep their defaults).

    Example:
        >>> ns = argparse.Namespace(out=Path("o"), steps=6, sweep=False)
        >>> config_from_options(ns).steps
        6
    """
    values = {
        item.name: getattr(options, item.name)
        for item in fields(DemoConfig)
        if getattr(options, item.name, None) is not None
    }
    return DemoConfig(**values)


def _configure_logging() -> None:
    """Give the demo's own logger a handler (the CLI is the application; never the root's)."""
    logger = logging.getLogger("distcompat.demo")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _run_as_rank(config: DemoConfig, env: LaunchEnv) -> int:
    bind_to_parent()
    _configure_logging()
    try:
        code = run_rank(config)
    except KeyboardInterrupt:
        write_status(env.rank, 130, None, "")
        return 130
    except BaseException as exc:
        if not write_status(env.rank, 1, exc, traceback.format_exc()):
            raise  # under torchrun/srun: the usual traceback, the launcher reports it
        return 1  # the launcher prints the first failing rank's traceback
    else:
        write_status(env.rank, code, None, "")
        return code
    finally:
        distcompat.destroy_distributed()


def _sweep(config: DemoConfig) -> int:
    """Run 1..N-1 ranks into out/sweep/, then plot them beside the main N-rank run."""
    points: list[tuple[int, float]] = []
    for nproc in range(1, config.world_size):
        run = replace(config, out=config.out / "sweep" / f"nproc-{nproc}", nproc=nproc, sweep=False)
        print(f"sweep: {nproc} rank(s) -> {run.out}", flush=True)
        outcome = launch_ranks(run, nproc)
        if outcome.failed_rank is not None or outcome.exit_code not in (0, 3):
            sys.stderr.write(f"distcompat demo --sweep: {outcome.message}\n")
            return outcome.exit_code or 1
        points.append((nproc, _tokens_per_sec(run.out)))
    points.append((config.world_size, _tokens_per_sec(config.out)))
    base = points[0][1]
    atomic_write_json(
        config.out / "scaling.json",
        {
            "ranks": [n for n, _ in points],
            "tokens_per_sec": [rate for _, rate in points],
            "speedup_vs_1": [rate / base for _, rate in points],
        },
    )
    path = plot_scaling(points, config.out / "scaling.png")
    text = ", ".join(f"{n}: {rate:,.0f} tok/s ({rate / base:.2f}x)" for n, rate in points)
    print(f"sweep: {text}\nsweep: wrote {path}", flush=True)
    return 0


def _tokens_per_sec(out: Path) -> float:
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    return float(manifest["tokens_per_sec"])


def _failed(outcome: LaunchOutcome) -> bool:
    return outcome.failed_rank is not None or outcome.exit_code not in (0, EXIT_CHECK_FAILED)


def _supervise(config: DemoConfig) -> LaunchOutcome:
    """Launch the ranks; after a failed attempt, start them again, up to ``restarts_allowed``.

    Like torchrun's agent: the whole group is stopped and started anew (the ranks resume from
    the newest committed checkpoint). Each restart's times go to ``restarts.json`` for the report.
    """
    started = time.monotonic()
    attempt = 0
    outcome = launch_ranks(config, config.world_size_at(attempt), attempt=attempt)
    while _failed(outcome) and outcome.exit_code != 130 and attempt < config.restarts_allowed:
        reason = outcome.message.splitlines()[0]
        record_restart(
            config.out,
            {
                "attempt": attempt,
                "failed_rank": outcome.failed_rank,
                "reason": reason,
                "failure_seen_at": outcome.failure_seen_at,
                "stopped_at": outcome.stopped_at,
                "relaunched_at": time.time(),
            },
        )
        attempt += 1
        sys.stderr.write(
            f"distcompat demo: {reason}; restart {attempt} of {config.restarts_allowed}: "
            "the ranks resume from the newest committed checkpoint\n"
        )
        outcome = launch_ranks(config, config.world_size_at(attempt), attempt=attempt)
    if attempt:
        print(
            f"distcompat demo: {attempt} restart(s), {time.monotonic() - started:.1f} s in all",
            flush=True,
        )
    return outcome


def _check_kill(config: DemoConfig, world_size: int) -> None:
    for name, target in (("kill", config.kill_target), ("preempt", config.preempt_target)):
        if target is not None and target[0] >= world_size:
            raise DemoConfigError(
                f"--{name}={getattr(config, name)}: rank {target[0]} is not among {world_size}"
            )


def run_demo_command(options: argparse.Namespace) -> int:
    """Run ``distcompat demo`` with parsed flags; return the exit code.

    Example:
        >>> run_demo_command(argparse.Namespace(out=Path("demo-out")))  # doctest: +SKIP
        0
    """
    try:
        config = config_from_options(options)
        env = LaunchEnv.from_environ()
        if env.is_distributed:
            if config.sweep:
                raise DemoConfigError(
                    f"--sweep starts its own ranks; run it without a launcher "
                    f"(this process was started by {env.launcher})"
                )
            if config.nproc is not None and config.nproc != env.world_size:
                raise DemoConfigError(
                    f"--nproc={config.nproc} but {env.launcher} started {env.world_size} "
                    "rank(s); leave --nproc out under a launcher"
                )
            if config.resize is not None and STATUS_DIR_VAR not in os.environ:
                raise DemoConfigError(
                    f"--resize starts its own ranks on each world size; run it without a "
                    f"launcher (this process was started by {env.launcher})"
                )
            _check_kill(config, env.world_size)
            check_launcher_restarts(config)
            return _run_as_rank(config, env)
        if config.resize is not None and (config.nproc is not None or config.sweep):
            raise DemoConfigError("--resize names the world sizes: leave out --nproc and --sweep")
        _check_kill(config, config.world_size)
        if config.sweep:
            require_matplotlib()  # before any rank starts
    except (DemoConfigError, LaunchEnvError, MissingExtraError) as exc:
        sys.stderr.write(f"distcompat demo: error: {exc}\n")
        write_status(int(os.environ.get("RANK", "0")), EXIT_USAGE, exc, "")  # if a demo child
        return EXIT_USAGE
    outcome = _supervise(config)
    if outcome.exit_code not in (0, 3) or outcome.failed_rank is not None:
        sys.stderr.write(f"distcompat demo: {outcome.message}\n")
        return outcome.exit_code or 1
    if outcome.message != FINISHED:  # e.g. a rank hung on teardown and was killed
        sys.stderr.write(f"distcompat demo: note: {outcome.message}\n")
    if outcome.exit_code == 0 and config.sweep:
        return _sweep(config)
    if outcome.exit_code != 0:
        manifest = config.out / "manifest.json"
        sys.stderr.write(f"distcompat demo: a check failed (replicas or resume): see {manifest}\n")
    return outcome.exit_code
