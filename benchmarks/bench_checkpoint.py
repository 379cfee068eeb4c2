"""Crash-consistent saving and verified loading, beside raw ``torch.save`` / ``torch.load``.

    python benchmarks/bench_checkpoint.py [--sizes-mb 10 500] [--repeats 5] [--dir PATH]

Saves, on the same disk, one state of SIZE MB of float32 (four tensors) with:

* ``torch.save+fsync``: the fair baseline, ``torch.save(obj, path)`` then ``fsync`` of the file;
* ``torch.save``: no fsync (data may still be in the page cache when it returns);
* ``atomic_save``: temp file in the same directory, fsync, ``os.replace``, directory fsync;
* ``save_checkpoint``: a one-rank commit: temp directory, streamed SHA-256, manifest, rename;
* ``AsyncCheckpointer``: the time ``save`` blocks the caller (staging a CPU copy), and the time
  until the background commit is done;

and loads it with ``torch.load`` and ``load_checkpoint`` (SHA-256 verified, and unverified).
Loads read from a warm page cache: the file was just written. Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from distcompat.checkpoint import AsyncCheckpointer, atomic_save, load_checkpoint, save_checkpoint


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    per_tensor = size_mb * (1 << 20) // 4 // 4  # four float32 tensors
    generator = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(per_tensor, generator=generator) for i in range(4)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench(size_mb: int, repeats: int, root: Path) -> dict[str, float]:
    """Return MB/s per variant: medians over ``repeats`` rounds, variants interleaved per round.

    ``os.sync()`` (untimed) runs before every timed operation, so no variant pays for write-back
    of the data an earlier one left dirty (``torch.save`` without fsync leaves all of it).
    """
    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = root / f"bench-{size_mb}mb"
    work.mkdir()

    def raw(attempt: int, sync: bool) -> None:
        path = work / f"raw-{sync}-{attempt}.pt"
        torch.save(state, path)
        if sync:
            _fsync(path)

    variants: dict[str, Callable[[int], object]] = {
        "torch.save+fsync": lambda a: raw(a, True),
        "torch.save": lambda a: raw(a, False),
        "atomic_save": lambda a: atomic_save(state, work / f"atomic-{a}.pt"),
        "save_checkpoint": lambda a: save_checkpoint(work / "ckpt", a, state),
        "torch.load": lambda a: torch.load(work / f"raw-True-{a}.pt", weights_only=True),
        "load_checkpoint(verify=True)": lambda a: load_checkpoint(work / "ckpt", a),
        "load_checkpoint(verify=False)": lambda a: load_checkpoint(work / "ckpt", a, verify=False),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for attempt in range(repeats):
        for name, fn in variants.items():
            os.sync()
            start = time.perf_counter()
            fn(attempt)
            times[name].append(time.perf_counter() - start)
    with AsyncCheckpointer() as checkpointer:
        for attempt in range(repeats):
            os.sync()
            start = time.perf_counter()
            checkpointer.save(work / "async", attempt, state)
            staged = time.perf_counter()
            checkpointer.wait()
            done = time.perf_counter()
            times.setdefault("AsyncCheckpointer.save (blocks for)", []).append(staged - start)
            times.setdefault("AsyncCheckpointer (until committed)", []).append(done - start)
    shutil.rmtree(work)
    return {name: nbytes / statistics.median(ts) / 1e6 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 500])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: cwd)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="distcompat-bench-", dir=args.dir or Path.cwd()))
    try:
        facts = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "dir": str(root),
        }
        print(json.dumps(facts))
        for size in args.sizes_mb:
            throughput = bench(size, args.repeats, root)
            base_save = throughput["torch.save+fsync"]
            base_load = throughput["torch.load"]
            print(f"\n{size} MB state (MB/s, and ratio to the baseline)")
            for name, rate in throughput.items():
                base = base_load if "load" in name else base_save
                print(f"  {name:32s} {rate:8.0f}  {rate / base:5.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
