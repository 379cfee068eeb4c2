"""One NCCL rank whose Flight Recorder dump is asked for through torch's debug pipe.

``python _fr_cuda_script.py DIR``, run as a world of 1 by test_diagnostics_flight_cuda.py: the
user's own ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` (``DIR/pipe_``), a default
``init_distributed(device="cuda")`` (which sets the Flight Recorder variables), one raw NCCL
all_reduce (distcompat's own is the identity at world size 1), then one write to the pipe
``DIR/pipe_0.pipe`` makes torch dump to ``TORCH_FR_DUMP_TEMP_FILE`` + ``0``. Prints ``REASON``
(``info.reason`` on one line) and ``DUMP <path>`` once the file is there.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import distcompat

WAIT_S = 60.0


def _wait_for(path: Path) -> bool:
    end = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.1)
    return path.exists()


def main() -> None:
    """Init on CUDA, one NCCL all_reduce, a dump through the pipe."""
    out = Path(sys.argv[1])
    for name in ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE"):
        os.environ[name] = f"{out}/pipe_"  # the user's own setting, before init
    info = distcompat.init_distributed(device="cuda")
    print("REASON", info.reason.replace("\n", " | "), flush=True)
    t = torch.ones(4, device=info.device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    pipe = out / "pipe_0.pipe"
    if not _wait_for(pipe):
        print("NO PIPE", pipe, flush=True)
        return
    with open(pipe, "w") as handle:  # any write asks torch for a dump
        handle.write("1\n")
    dump = Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0")
    print("DUMP" if _wait_for(dump) else "NO DUMP", dump, flush=True)
    distcompat.destroy_distributed()


if __name__ == "__main__":
    main()
