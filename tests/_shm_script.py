"""A training-script stand-in for test_collectives_shm.py: ranks that use the shared-memory path
and end normally (``python _shm_script.py``, started as real rank processes by run_ranks).

Each rank prints ``PID <pid>``, whether the path was taken, and the result of an all_reduce.
"""

from __future__ import annotations

import os

import torch

import distcompat
from distcompat.collectives import all_reduce
from distcompat.collectives.shm import _path as shm

if __name__ == "__main__":
    distcompat.init_distributed(device="cpu")
    t = torch.ones(1 << 16)
    all_reduce(t)
    print("PID", os.getpid(), flush=True)
    print("ENGAGED", shm.status(None).engaged, flush=True)
    print("SUM", int(t[0]), flush=True)
    distcompat.destroy_distributed()
