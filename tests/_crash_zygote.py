"""Fork server for the SIGKILL fault-injection tests, run as a script by test_checkpoint_crash.py.

It imports torch and distcompat once, then for every ``go`` line on stdin forks a child that
saves in a loop until it is killed, writes the child's pid, waits for it, and writes how it ended.
Forking from a warm process makes a kill point cost milliseconds instead of an ``import torch``.

Protocol (one line each): parent -> ``go``; zygote -> ``pid <N>``, then ``end <status>`` where
``status`` is the ``os.waitpid`` status. ``quit`` or end of input stops the zygote.

Modes:

* ``dir ROOT``: ``save_checkpoint(ROOT, step, ...)`` for step = latest + 1, latest + 2, ...
* ``file PATH``: ``atomic_save({"v": v, ...}, PATH)`` for v = the saved v + 1, + 2, ...
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

from distcompat.checkpoint import atomic_save, latest_checkpoint, save_checkpoint

#: Elements of the tensor saved each time: small, so a save is dominated by its fsyncs and renames.
NUMEL = 2048
KEEP_LAST = 3


def state_for(step: int) -> dict[str, object]:
    """Return the state saved at ``step`` (the checker rebuilds it to compare)."""
    return {"step": step, "w": torch.full((NUMEL,), float(step))}


def _save_forever(mode: str, target: Path) -> None:
    if mode == "dir":
        step = (latest_checkpoint(target) or 0) + 1
        while True:
            save_checkpoint(
                target, step, state_for(step), keep_last=KEEP_LAST, metadata={"s": step}
            )
            step += 1
    else:
        version = torch.load(target, weights_only=True)["step"] + 1 if target.exists() else 1
        while True:
            atomic_save(state_for(version), target)
            version += 1


def main() -> None:
    """Serve ``go`` requests until ``quit``."""
    mode, target = sys.argv[1], Path(sys.argv[2])
    for line in sys.stdin:
        if line.strip() != "go":
            break
        pid = os.fork()
        if pid == 0:
            try:
                _save_forever(mode, target)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"end {status}", flush=True)


if __name__ == "__main__":
    main()
