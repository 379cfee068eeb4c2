"""Plain torch (no distcompat) writing torch's own gloo Flight Recorder dumps, run as real ranks.

``python _fr_native_script.py DIR MODE``: ``init_process_group("gloo")`` from the launcher's
variables, four all_reduces together, then the last rank leaves out the fifth (``late``) or
broadcasts instead (``mismatch``). Each rank then writes what torch recorded
(``torch._C._distributed_c10d._dump_fr_trace``: a pickle) to ``DIR/comm_lib_trace_rank_<R>``,
torch's own file name, as a job's dump on timeout would, and leaves at once (``os._exit``: the
fifth call never completes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    """Run four calls together, then the last rank leaves out or changes the fifth; dump."""
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    for _ in range(4):
        dist.all_reduce(t)
    if rank != world - 1:
        dist.all_reduce(t, async_op=True)  # call 5: never completes
    elif mode == "mismatch":
        dist.broadcast(t, src=0, async_op=True)
    c10d: Any = torch._C._distributed_c10d  # the stubs of some releases lack the name
    dump = c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    (out / f"comm_lib_trace_rank_{rank}").write_bytes(dump)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
