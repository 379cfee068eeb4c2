"""What the framework programs share, none of it distcompat: the fault a run asks for, the digest.

The programs under ``frameworks/`` are plain PyTorch (and Lightning) programs that never import
distcompat; ``frameworks/test_frameworks.py`` runs each with and without ``distcompat run``.
``FAULT`` picks what goes wrong at step 3 (the last of the shortest program), one or more of
(comma-separated): ``stall`` (rank 1 sleeps ``STALL_S``, 20 by default, as the step begins),
``kill`` (rank 1 SIGKILLs itself 1 s into the step, while rank 0 waits in a collective),
``mismatch`` (every rank all-reduces the step's metric with a length that differs between
ranks; after the stall, where both are asked for).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import torch

FAULTS = frozenset(name for name in os.environ.get("FAULT", "").split(",") if name)
STALL_S = float(os.environ.get("STALL_S", "20"))
#: The step whose metric has another length on each rank under ``mismatch`` (the stall's).
MISMATCH_STEP = 3


def fault(rank: int, step: int, all_reduce: object = None) -> None:
    """At step 3 on rank 1, stall or die as ``FAULT`` says (see the module docstring)."""
    if rank != 1 or step != 3:
        return
    if "stall" in FAULTS:
        print(f"rank {rank}: stall starts at {time.time():.3f}", flush=True)
        time.sleep(STALL_S)  # the stalled line a report must name
    if "kill" in FAULTS:
        time.sleep(1)  # rank 0 is in the step's first collective by now
        print(f"rank {rank}: killing itself at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def shapes_for(rank: int, step: int) -> int:
    """The length of the metric this rank all-reduces: 4; at ``MISMATCH_STEP`` of ``mismatch``,
    6 + rank."""
    return 6 + rank if "mismatch" in FAULTS and step == MISMATCH_STEP else 4


def digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order: equal digests are equal bits."""
    sha = hashlib.sha256()
    for tensor in tensors:
        raw = tensor.detach().cpu().contiguous().view(torch.uint8).flatten()  # no NumPy here
        sha.update(bytes(raw.tolist()))
    return sha.hexdigest()
