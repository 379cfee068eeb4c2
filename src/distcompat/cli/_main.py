"""The ``distcompat`` parser: ``doctor``, ``diagnose``, ``dump``, ``demo``, ``bench``, ``run``.

``_entry`` runs ``distcompat run`` without importing this module (it imports torch).

Example::

    distcompat doctor --device cpu
    torchrun --standalone --nproc-per-node=2 --no-python distcompat doctor
    distcompat diagnose /tmp/distcompat-hangs      # after a watchdog declared a hang
    distcompat dump 4121                           # a live job: every rank dumps, goes on
    distcompat demo --out demo-out                 # train on 2 local gloo ranks, check, report
    distcompat bench --quick                       # nccl-tests-style table of your group
    distcompat run torchrun --nproc-per-node=2 train.py   # train.py unchanged, protected
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from distcompat import __version__
from distcompat.bench._cli import add_bench_parser, run_bench_command
from distcompat.cli._diagnose import diagnose
from distcompat.cli._doctor import collect_report
from distcompat.cli._run import run_command
from distcompat.collectives._capabilities import capabilities
from distcompat.diagnostics._config import default_dump_dir
from distcompat.launch._settings import RUN_VARIABLE
from distcompat.process_group import distributed_session

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distcompat",
        description="PyTorch distributed that behaves the same on every backend and launcher.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor",
        help="show what the launcher env says and which device/backend init would pick, and why",
        description=(
            "Print the launcher environment, the run device and collective backend that "
            "init_distributed() would choose with reasons, the torch version and the backends "
            "built in. Creates no process group; exits 1 when init would fail."
        ),
    )
    doctor.add_argument("--device", default="auto", help="run device to plan for (default: auto)")
    doctor.add_argument(
        "--backend", default=None, help="backend to plan for (default: from device)"
    )
    doctor.add_argument("--json", action="store_true", help="one JSON object per rank")
    doctor.add_argument(
        "--probe",
        action="store_true",
        help=(
            "also create the process group and probe what its backend really does "
            "(every rank must run it; rank 0 prints the table)"
        ),
    )
    diagnose = commands.add_parser(
        "diagnose",
        help="read hang dumps (distcompat's, torch Flight Recorder's): which rank diverged",
        description=(
            "Read the hang dumps a distcompat watchdog wrote under DIR "
            "(DIR/<job>/incident-<N>/rank<R>.json) and print, for one incident of one job, "
            "which rank is behind, gone or in a different collective, the calls side by side, "
            "and each rank's stacks. The newest incident is read unless --job / --incident pick "
            "another; the others found are listed, never merged. PyTorch Flight Recorder dumps "
            "under DIR (<prefix><rank> files: NCCL's on timeout or through the debug pipe, "
            "gloo's) are read too, alone or beside distcompat's: the newest set, which rank did "
            "not join which call, what each rank was doing. Exits 0 when a report was read, 2 "
            "when DIR has none (or none matches)."
        ),
    )
    diagnose.add_argument(
        "directory",
        metavar="DIR",
        nargs="?",
        default=str(default_dump_dir()),
        help=f"where the dumps are (default: {default_dump_dir()})",
    )
    diagnose.add_argument("--job", default=None, help="the job to read (its name or a prefix)")
    diagnose.add_argument("--incident", type=int, default=None, help="the incident number")
    dump = commands.add_parser(
        "dump",
        help="have every rank of a running job dump its stacks and collective history",
        description=(
            "Send SIGUSR2 to PID, any rank of a job distcompat initialized: every rank writes "
            "its Python stacks and collective history (distcompat's JSON and torch's Flight "
            "Recorder format) into the job's dump folder, and the job goes on. The rank asked "
            "logs where, and names a rank that did not answer. Exits 1 when PID is not there."
        ),
    )
    dump.add_argument("pids", metavar="PID", type=int, nargs="+", help="a rank's process id")
    run = commands.add_parser(
        "run",
        help="run a command so that every Python process beneath gets distcompat's init",
        description=(
            "Run CMD (torchrun ..., python ..., srun ..., mpirun ...) with distcompat's "
            "bootstrap first on PYTHONPATH: in every Python process beneath, torch's "
            "init_process_group (and init_device_mesh's, and destroy_process_group) is "
            "distcompat's drop-in for gloo and nccl, so DDP, FSDP2 and every library's "
            "collectives are checked and watched with no line of the program changed. "
            f"{RUN_VARIABLE}=off runs the same command on torch's own init."
        ),
    )
    run.add_argument("argv", metavar="CMD [ARGS...]", nargs=argparse.REMAINDER)
    # Imported here, not at the top: the demo imports distcompat.attention, which pulls in
    # torch._dynamo (heavy), and `distcompat doctor` should not pay for it.
    from distcompat.demo._cli import add_demo_parser

    add_demo_parser(commands)
    add_bench_parser(commands)
    return parser


def _print_probe(device: str, backend: str | None) -> None:
    """Create the group, probe its backend, print the table on rank 0, tear the group down."""
    with distributed_session(device=device, backend=backend) as info:
        caps = capabilities()
        if info.is_main_process:
            text = caps.table() if info.has_group else "no process group: nothing to probe"
            sys.stdout.write(text + "\n")
            sys.stdout.flush()


def _ask_for_dump(pids: Sequence[int]) -> int:
    """Send the dump signal to each of ``pids``; 1 when one of them could not be signalled."""
    from distcompat.diagnostics._on_demand import SIGNAL  # light: signal and the hooks' state

    code = 0
    for pid in pids:
        try:
            os.kill(pid, SIGNAL)
        except OSError as exc:
            sys.stderr.write(f"distcompat dump: cannot signal pid {pid}: {exc.strerror}\n")
            code = 1
            continue
        sys.stdout.write(
            f"asked pid {pid} ({SIGNAL.name}): every rank of its job writes a dump under the "
            f"job's folder in {default_dump_dir()} (its temporary folder); its log says where\n"
        )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distcompat`` console script; returns the exit code.

    Example:
        >>> main(["doctor", "--device", "cpu", "--json"])  # doctest: +SKIP
        0
    """
    parser = _build_parser()
    options = parser.parse_args(argv)
    if options.version:
        print(f"distcompat {__version__}")
        return 0
    if options.command == "doctor":
        report = collect_report(device=options.device, backend=options.backend)
        # One write per rank, so ranks launched together do not interleave mid-line.
        sys.stdout.write((report.to_json() if options.json else report.to_text()) + "\n")
        sys.stdout.flush()
        if options.probe and report.ok:
            _print_probe(options.device, options.backend)
        return 0 if report.ok else 1
    if options.command == "diagnose":
        found = diagnose(options.directory, job=options.job, incident=options.incident)
        if found.error:
            sys.stderr.write(f"distcompat diagnose: {found.error}\n")
        else:
            sys.stdout.write(found.text + "\n")
        return found.exit_code
    if options.command == "dump":
        return _ask_for_dump(options.pids)
    if options.command == "demo":
        from distcompat.demo._cli import run_demo_command  # heavy: see _build_parser

        return run_demo_command(options)
    if options.command == "bench":
        return run_bench_command(options)
    if options.command == "run":
        return run_command(options.argv)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
