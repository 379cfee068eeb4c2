"""Find the capability probes that kill the process instead of raising, on a backend and device.

    python tools/find_probe_crashes.py --backend gloo --device cuda     # 2 ranks, one GPU

Runs :func:`distcompat.collectives._capabilities.probe_cases` in a fresh group of 2 rank
processes, each writing the name of the case it starts to its own progress file. When a rank
dies, the case it had started is recorded, and a fresh pair goes on from the case after it.
Prints a JSON object (case name -> the dead rank's last stderr line) for
``_capabilities.CRASHES``, and writes it to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, start: int, backend: str, device: str, progress: Path) -> None:
    import torch
    import torch.distributed as dist

    from distcompat.collectives._capabilities import probe_cases

    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    where = torch.device(device)
    cases = probe_cases(None, where)
    with progress.open("a") as log:
        for index in range(start, len(cases)):
            log.write(f"{index} {cases[index].name}\n")
            log.flush()
            cases[index].run()
        log.write("done\n")
    dist.barrier()
    dist.destroy_process_group()


def find(backend: str, device: str, timeout_s: float) -> dict[str, str]:
    crashes: dict[str, str] = {}
    start = 0
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(40):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            logs = [Path(tmp, f"{attempt}-{rank}.log") for rank in range(WORLD)]
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", str(rank), "--start", str(start),
                     "--backend", backend, "--device", device, "--progress", str(logs[rank])],
                    env=env, stderr=subprocess.PIPE, text=True,
                )
                for rank in range(WORLD)
            ]  # fmt: skip
            errors = []
            for proc in procs:
                try:
                    errors.append(proc.communicate(timeout=timeout_s)[1])
                except subprocess.TimeoutExpired:
                    proc.kill()
                    errors.append(proc.communicate()[1] + "\n(killed: timeout)")
            if all(proc.returncode == 0 for proc in procs):
                return crashes
            # The first rank that died by a signal (or the first failure) names the case.
            dead = min(range(WORLD), key=lambda r: (procs[r].returncode >= 0, r))
            lines = logs[dead].read_text().split("\n") if logs[dead].exists() else []
            started = [line for line in lines if line and line != "done"]
            if not started:
                raise SystemExit(f"rank {dead} died before any probe:\n{errors[dead][-2000:]}")
            index, name = started[-1].split(" ", 1)
            tail = [line.strip() for line in errors[dead].splitlines() if line.strip()]
            said = [line for line in tail if "what()" in line or "Error" in line] or tail
            crashes[name] = said[-1][:160] if said else f"exit code {procs[dead].returncode}"
            print(f"crash: {name}: {crashes[name]}", file=sys.stderr, flush=True)
            start = int(index) + 1
    raise SystemExit(f"gave up after 40 crashes: {json.dumps(crashes, indent=2)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker is not None:
        worker(options.worker, options.start, options.backend, options.device, options.progress)
        return
    crashes = find(options.backend, options.device, options.timeout_s)
    text = json.dumps(crashes, indent=2)
    print(text)
    if options.out:
        options.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
