"""Rank script for tests/test_hostile.py: training while something the job does not control acts.

    python _hostile_script.py SCENARIO DIR      # 2 ranks, launched by tests/_hostile.py

Every rank writes ``DIR/rank-R.json`` (its pid and link port) once its group is up, then:

* ``train``: all-reduces in a loop until ``DIR/done`` appears (the stranger finished), checking
  every sum, noting its most open files, then saves a checkpoint to ``DIR/ckpt`` (step 1);
* ``save``: saves step 1 to ``DIR/ckpt`` (a small state), then one step per size in
  ``SAVE_MIB`` ("3,8": step 2 with 3 MiB per rank, step 3 with 8), each line saying how it went;
* ``leak``: saves step 1, then rank 1 opens files until it has none left (a leak in the
  training script), all-reduces ten times and saves step 2;
* ``allreduce``: all-reduces 1 MiB ten times (``/dev/shm`` or the segment is what fails).

Prints ``rank R: ok ...`` or ``rank R: raised TYPE: MESSAGE`` (then exits 3); ``save`` prints
``rank R: step S saved`` or ``rank R: step S raised TYPE: MESSAGE`` per step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

import distcompat
import distcompat.distributed as dist


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:  # EMFILE: all of them
        return -1


def _link_port(rank: int) -> int:
    from distcompat import peers

    for _ in range(100):
        found = peers.identities_of({rank})
        if rank in found:
            return found[rank].port
        time.sleep(0.05)
    return 0


def _train(rank: int, world: int, directory: Path) -> str:
    steps, most = 0, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        value = torch.full((1024,), float(rank + 1))
        dist.all_reduce(value)
        expected = world * (world + 1) / 2
        if not torch.all(value == expected):
            raise AssertionError(f"step {steps}: sum {value[0].item()} != {expected}")
        steps += 1
        most = max(most, _open_files())
        done = torch.tensor([float((directory / "done").exists())])
        dist.all_reduce(done)  # every rank stops at the same step
        if done.item() == world:
            break
        time.sleep(0.02)
    distcompat.save_checkpoint(directory / "ckpt", 1, {"w": torch.full((4,), float(rank))})
    return f"steps={steps} most_open_files={most}"


def _save(rank: int, directory: Path) -> str:
    root = directory / "ckpt"
    distcompat.save_checkpoint(root, 1, {"w": torch.full((4,), float(rank))})
    for step, mib in enumerate(os.environ["SAVE_MIB"].split(","), start=2):
        try:
            distcompat.save_checkpoint(root, step, {"w": torch.zeros(int(mib) * 262144)})
        except Exception as exc:  # the outcome under test
            print(f"rank {rank}: step {step} raised {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"rank {rank}: step {step} saved", flush=True)
    return "saved"


def _leak(rank: int, world: int, directory: Path) -> str:
    root = directory / "ckpt"
    distcompat.save_checkpoint(root, 1, {"w": torch.full((4,), float(rank))})
    held = []
    if rank == 1:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
    _allreduce(rank, world)
    distcompat.save_checkpoint(root, 2, {"w": torch.full((4,), float(rank))})
    return f"leaked {len(held)}"


def _allreduce(rank: int, world: int) -> str:
    for _ in range(10):
        value = torch.full((262144,), float(rank + 1))  # 1 MiB
        dist.all_reduce(value)
        if not torch.all(value == world * (world + 1) / 2):
            raise AssertionError(f"sum {value[0].item()}")
    return "all-reduced"


def main() -> None:
    scenario, directory = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(format="%(message)s")  # distcompat's lines, as a script shows them
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.ones(1))  # every rank is up, and the watch has its peers
    facts = {"pid": os.getpid(), "port": _link_port(rank), "open_files": _open_files()}
    (directory / f"rank-{rank}.json").write_text(json.dumps(facts))
    try:
        if scenario == "train":
            said = _train(rank, world, directory)
        elif scenario == "save":
            said = _save(rank, directory)
        elif scenario == "leak":
            said = _leak(rank, world, directory)
        else:
            said = _allreduce(rank, world)
    except Exception as exc:  # the outcome under test
        print(f"rank {rank}: raised {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print(f"rank {rank}: ok {said}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
