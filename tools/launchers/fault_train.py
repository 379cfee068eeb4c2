"""A small data-parallel training loop for the fault runs: every step's result is checked.

    torchrun ... fault_train.py --out DIR --timeout 20

Each rank makes its gradient from a seed of (rank, step), so every rank can also compute the
exact all-reduced gradient of the whole world and check the collective's answer. Rank 0 reads
``DIR/stop`` and sends the stop flag inside the step's all_reduce, so all ranks stop at the same
step. Each rank writes ``DIR/progress-<R>`` (its last finished step) after every step, and at
the end ``DIR/rank-<R>.json``: ``{"ok": ..., "steps": ..., "longest_step_s": ...}`` or, when a
collective failed, the typed error (class, peer, message), the wall time it was raised at and
the count of wrong all-reduces until then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import distcompat

SIZE = 8
LEARNING_RATE = 0.05
STEP_PAUSE_S = 0.05
MAX_STEPS = 5000


def local_gradient(rank: int, step: int, weights: torch.Tensor) -> torch.Tensor:
    """Gradient of a least-squares loss on this rank's seeded batch of step ``step``."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(4, SIZE, generator=generator, dtype=torch.float64)  # [batch, SIZE]
    targets = inputs.sum(dim=1)  # [batch]
    residual = inputs @ weights - targets  # [batch]
    return inputs.T @ residual / len(residual)  # [SIZE]


def _write(path: Path, text: str) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def train(out: Path, timeout: float) -> dict[str, Any]:
    """Train until rank 0 sees the stop file; return this rank's result."""
    info = distcompat.init_distributed(device="cpu", timeout=timeout)
    rank, world = info.rank, info.world_size
    weights = torch.zeros(SIZE, dtype=torch.float64)
    longest, wrong, step = 0.0, 0, 0
    try:
        for step in range(MAX_STEPS):
            began = time.monotonic()
            stop = 1.0 if rank == 0 and (out / "stop").exists() else 0.0
            grad = local_gradient(rank, step, weights)
            payload = torch.cat([grad, torch.tensor([stop], dtype=torch.float64)])
            distcompat.all_reduce(payload)
            want = torch.stack([local_gradient(r, step, weights) for r in range(world)]).sum(dim=0)
            wrong += int(not torch.allclose(payload[:SIZE], want))
            weights -= LEARNING_RATE * payload[:SIZE] / world
            longest = max(longest, time.monotonic() - began)
            _write(out / f"progress-{rank}", str(step))
            if payload[SIZE] > 0:
                break
            time.sleep(STEP_PAUSE_S)
        finals: list[object] = [None] * world
        distcompat.all_gather_object(finals, weights.tolist())
    except distcompat.CollectiveError as exc:
        return {
            "ok": False,
            "rank": rank,
            "error": type(exc).__name__,
            "peer": exc.peer,
            "message": str(exc)[:400],
            "raised_at": time.time(),
            "steps": step,
            "wrong_steps": wrong,
        }
    distcompat.destroy_distributed()
    agree = all(f == finals[0] for f in finals)
    return {
        "ok": wrong == 0 and agree,
        "rank": rank,
        "steps": step + 1,
        "wrong_steps": wrong,
        "replicas_agree": agree,
        "longest_step_s": round(longest, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for progress/results")
    parser.add_argument("--timeout", type=float, default=20.0, help="group timeout, seconds")
    args = parser.parse_args(argv)
    result = train(args.out, args.timeout)
    _write(args.out / f"rank-{result['rank']}.json", json.dumps(result))
    print(f"[fault_train rank {result['rank']}] {result}", flush=True)
    return 0 if result["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
