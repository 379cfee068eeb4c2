"""``distcompat bench``: its flags, and the choice between starting ranks and being one.

The lines a user types::

    distcompat bench --quick                                    # 2 local ranks, started here
    torchrun --nproc-per-node=8 --no-python distcompat bench    # one rank each, any launcher
    srun -n 16 distcompat bench --json bench.json --plot busbw.png

``distcompat.cli`` registers the subcommand with :func:`add_bench_parser` and calls
:func:`run_bench_command`. Under a launcher (whatever :meth:`distcompat.LaunchEnv.from_environ`
recognises) this process is one rank: it calls :func:`distcompat.init_distributed` and measures
that group. Otherwise it starts ``--nproc`` local ranks (:mod:`distcompat.bench._spawn`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from distcompat.bench._measure import BenchConfig, measure
from distcompat.bench._report import (
    BenchHeader,
    BenchReport,
    MissingExtraError,
    plot_busbw,
    require_matplotlib,
)
from distcompat.bench._spawn import SPAWNED_VAR, run_local_ranks
from distcompat.bench._stats import OPS, geometric_sizes, parse_bytes
from distcompat.launch import LaunchEnv, LaunchEnvError
from distcompat.process_group import destroy_distributed, init_distributed

__all__ = ["EXIT_USAGE", "add_bench_parser", "config_from_options", "run_bench_command"]

#: Exit code for a bad flag, a missing extra or an environment the bench cannot run in.
EXIT_USAGE = 2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: (flag, default) for the full run and the --quick run; an explicit flag wins over both.
_FULL = {"min_bytes": "1K", "max_bytes": "16M", "factor": 4, "iters": 20, "warmup": 5}
_QUICK = {"min_bytes": "1K", "max_bytes": "1M", "factor": 32, "iters": 10, "warmup": 2}


def add_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``commands`` (what ``add_subparsers()`` returned).

    Example:
        >>> parser = argparse.ArgumentParser(prog="distcompat")
        >>> bench = add_bench_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["bench", "--quick"]).quick
        True
    """
    parser: argparse.ArgumentParser = commands.add_parser(
        "bench",
        help="measure your group's collectives like nccl-tests: latency, algbw, busbw",
        description=(
            "Time all_reduce, all_gather_into_tensor, all_gather_uneven, reduce_scatter_tensor, "
            "broadcast and all_to_all_single over a geometric range of sizes on the group "
            "init_distributed() makes under your launcher (torchrun, srun, mpirun, ...), or on "
            "--nproc local ranks started here when no launcher started it. The calls go through "
            "distcompat's collectives, the path your code takes. Rank 0 prints p50/p95 latency, "
            "algbw and busbw (nccl-tests' factors). Exit code 0, 1 when a rank fails, 2 for a "
            "usage error."
        ),
    )
    add = parser.add_argument
    add("--nproc", type=int, default=2, help="local ranks to start without a launcher (default 2)")
    add("--quick", action="store_true", help="3 sizes (1K, 32K, 1M), 10 calls each: seconds")
    add("--ops", default=",".join(OPS), help=f"comma-separated ops (default: {','.join(OPS)})")
    for name, text in (
        ("min_bytes", "smallest buffer, e.g. 1K"),
        ("max_bytes", "largest buffer, e.g. 64M"),
        ("factor", "size multiplier between steps"),
        ("iters", "timed calls per op and size"),
        ("warmup", "untimed calls before them"),
    ):
        shown = f"{text} (default {_FULL[name]}; --quick {_QUICK[name]})"
        kind = str if name.endswith("bytes") else int
        add("--" + name.replace("_", "-"), type=kind, default=None, help=shown)
    add("--dtype", choices=sorted(_DTYPES), default="float32", help="element type (float32)")
    add("--device", default="auto", help="run device: auto, cpu, cuda (default: auto)")
    add("--backend", default=None, help="collective backend (default: from the device)")
    add(
        "--compare-shm",
        action="store_true",
        help="CPU: time each call through shared memory and through gloo in turn (speedup column)",
    )
    add("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")
    add("--plot", type=Path, default=None, metavar="PATH", help="also plot busbw (matplotlib)")
    return parser


def config_from_options(options: argparse.Namespace) -> BenchConfig:
    """Build the :class:`BenchConfig` from the flags; ``ValueError`` names a bad one.

    Example:
        >>> ns = argparse.Namespace(quick=True, ops="broadcast", min_bytes=None, max_bytes=None,
        ...     factor=None, iters=None, warmup=None, dtype="float32")
        >>> config = config_from_options(ns)
        >>> config.sizes, config.ops, config.iterations
        ([1024, 32768, 1048576], ('broadcast',), 10)
    """
    base = _QUICK if options.quick else _FULL

    def pick(name: str) -> Any:
        value = getattr(options, name)
        return base[name] if value is None else value

    ops = tuple(op.strip() for op in options.ops.split(",") if op.strip())
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"--ops={options.ops!r}: choose from {', '.join(OPS)}")
    sizes = geometric_sizes(
        parse_bytes(str(pick("min_bytes"))), parse_bytes(str(pick("max_bytes"))), pick("factor")
    )
    iterations, warmup = int(pick("iters")), int(pick("warmup"))
    if iterations < 1 or warmup < 0:
        raise ValueError(f"--iters={iterations} must be >= 1 and --warmup={warmup} >= 0")
    compare = bool(getattr(options, "compare_shm", False))
    if compare and getattr(options, "device", "cpu") not in ("auto", "cpu"):
        raise ValueError(f"--compare-shm compares CPU collectives, not --device={options.device}")
    return BenchConfig(
        ops=ops,
        sizes=sizes,
        iterations=iterations,
        warmup=warmup,
        dtype=_DTYPES[options.dtype],
        compare_shm=compare,
    )


def _child_argv(options: argparse.Namespace) -> list[str]:
    """Return the flags each local rank gets: the same measurement, no --nproc."""
    argv = ["--ops", options.ops, "--dtype", options.dtype, "--device", options.device]
    for name in ("min_bytes", "max_bytes", "factor", "iters", "warmup", "backend"):
        value = getattr(options, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    for name in ("json", "plot"):
        value = getattr(options, name)
        if value is not None:
            argv += ["--" + name, str(value.resolve())]
    argv += ["--compare-shm"] if options.compare_shm else []
    return argv + (["--quick"] if options.quick else [])


def _run_rank(config: BenchConfig, options: argparse.Namespace, launch: LaunchEnv) -> int:
    info = init_distributed(device=options.device, backend=options.backend)
    try:
        rows = measure(config, device=info.device)
    finally:
        destroy_distributed()
    if not info.is_main_process:
        return 0
    spawned = launch.launcher == "env" and SPAWNED_VAR in os.environ
    header = BenchHeader(
        world_size=info.world_size,
        num_nodes=launch.num_nodes,
        launcher="local ranks started by distcompat bench" if spawned else info.launcher,
        backend=info.backend,
        device=str(info.device),
        dtype=str(config.dtype).removeprefix("torch."),
        iterations=config.iterations,
        warmup=config.warmup,
        torch_version=torch.__version__,
        compared=config.compare_shm,
    )
    report = BenchReport(header=header, rows=rows)
    sys.stdout.write(report.table() + "\n")
    if options.json is not None:
        sys.stdout.write(f"# wrote {report.write_json(options.json)}\n")
    if options.plot is not None:
        sys.stdout.write(f"# wrote {plot_busbw(report, options.plot)}\n")
    sys.stdout.flush()
    return 0


def run_bench_command(options: argparse.Namespace) -> int:
    """Run ``distcompat bench`` with parsed flags; return the exit code.

    Flags and the matplotlib extra are checked before any rank starts (exit code 2).

    Example:
        >>> parser = argparse.ArgumentParser(prog="distcompat")
        >>> _ = add_bench_parser(parser.add_subparsers(dest="command"))
        >>> run_bench_command(parser.parse_args(["bench", "--quick"]))  # doctest: +SKIP
        0
    """
    try:
        if options.nproc < 1:
            raise ValueError(f"--nproc={options.nproc} must be at least 1")
        config = config_from_options(options)
        if options.plot is not None:
            require_matplotlib()
        launch = LaunchEnv.from_environ()
    except (ValueError, MissingExtraError, LaunchEnvError) as exc:
        sys.stderr.write(f"distcompat bench: {exc}\n")
        return EXIT_USAGE
    if launch.is_distributed:
        return _run_rank(config, options, launch)
    return run_local_ranks(_child_argv(options), options.nproc)
