"""TokenLoader against the usual DataLoader + DistributedSampler over the same tokens.

    python benchmarks/bench_data.py [--sizes-mib 8 64 256] [--batches 2000] [--out DIR]

For each dataset size, one flat uint16 token file of random tokens is written, then each loader
runs in a FRESH subprocess (so ``ru_maxrss`` is that loader's own peak) for one shuffled epoch, or
``--batches`` batches if fewer, of (B, T) int64 ``(inputs, targets)``:

* ``baseline``: what training scripts usually do: read the file into an in-memory uint16 tensor, a
  map-style Dataset whose ``__getitem__`` slices a window of T+1 tokens and returns int64
  ``(x, y)``, and ``DataLoader(batch_size=B, sampler=DistributedSampler(shuffle=True))``
  (``num_workers=0``, default collate).
* ``TokenLoader``: ``distcompat.data.TokenLoader(path, batch_size=B, seq_len=T)`` (default reader),
  and ``TokenLoader[mmap]`` with ``reader="mmap"``.

Reported per (size, loader): tokens/s over the timed batches (after 5 warm-up batches), setup
time (construction; for the baseline it includes reading the file), peak RSS of the process, and
that peak minus the RSS of the same interpreter right after imports. Both use one torch thread
(``--threads``), as DataLoader workers do. Results go to ``<out>/data.json`` (default
benchmarks/results); a table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

KINDS = ["baseline", "TokenLoader", "TokenLoader[mmap]"]


class InMemoryWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The common map-style dataset: all tokens in memory, item i = window i of T+1 tokens."""

    def __init__(self, path: Path, seq_len: int) -> None:
        buffer = bytearray(path.stat().st_size)  # one copy of the data, read straight into it
        with path.open("rb") as handle:
            handle.readinto(buffer)
        self.tokens = torch.frombuffer(buffer, dtype=torch.uint16)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.seq_len : (index + 1) * self.seq_len + 1].to(torch.int64)
        return window[:-1], window[1:]


def _rss_mib() -> float:
    """Current resident set (Linux /proc; falls back to the peak where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _peak_mib()


def _peak_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB else


def worker(kind: str, path: Path, batch: int, seq_len: int, batches: int) -> dict[str, Any]:
    """Run one loader in this process; return its numbers."""
    from distcompat.data import TokenLoader

    start_rss = _rss_mib()
    t0 = time.perf_counter()
    loader: Any
    if kind == "baseline":
        dataset = InMemoryWindows(path, seq_len)
        sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
            dataset, num_replicas=1, rank=0, seed=0
        )
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler)
    else:
        reader = "mmap" if kind == "TokenLoader[mmap]" else "auto"
        loader = TokenLoader(path, batch_size=batch, seq_len=seq_len, rank=0, world_size=1,
                             reader=reader)  # fmt: skip
    setup = time.perf_counter() - t0
    count, warmup, checksum = 0, 5, 0
    t_start = time.perf_counter()
    for inputs, targets in loader:
        if count == warmup:
            t_start = time.perf_counter()
        checksum += int(inputs[0, 0]) + int(targets[-1, -1])  # touch the data
        count += 1
        if count >= batches + warmup:
            break
    elapsed = time.perf_counter() - t_start
    timed = max(count - warmup, 0)
    return {
        "kind": kind,
        "batches": timed,
        "tokens_per_s": timed * batch * seq_len / elapsed if timed else 0.0,
        "setup_s": setup,
        "peak_rss_mib": _peak_mib(),
        "peak_minus_start_mib": _peak_mib() - start_rss,
        "checksum": checksum,
    }


def run_fresh(kind: str, path: Path, options: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--worker", kind, "--file", str(path),
        "--batch", str(options.batch), "--seq-len", str(options.seq_len),
        "--batches", str(options.batches), "--threads", str(options.threads),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=2000, help="cap on timed batches per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--dir", type=Path, default=None, help="where token files go (tmp)")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    if options.worker:
        print(json.dumps(worker(options.worker, options.file, options.batch, options.seq_len,
                                options.batches)))  # fmt: skip
        return

    rows = []
    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        for size in options.sizes_mib:
            path = Path(folder) / f"tokens_{size}mib.bin"
            with path.open("wb") as handle:  # random uint16 tokens, written in 8 MiB pieces
                for _ in range(size // 8 if size >= 8 else 1):
                    handle.write(os.urandom(min(size, 8) << 20))
            for kind in KINDS:
                row = {"size_mib": size, **run_fresh(kind, path, options)}
                rows.append(row)
                print(
                    f"{size:>5} MiB  {kind:<18} {row['tokens_per_s'] / 1e6:8.1f} Mtok/s  "
                    f"setup {row['setup_s']:6.2f} s  peak RSS {row['peak_rss_mib']:7.1f} MiB "
                    f"(+{row['peak_minus_start_mib']:.1f})",
                    flush=True,
                )
            path.unlink()
    by = {(r["size_mib"], r["kind"]): r for r in rows}
    print(
        "\n| tokens (MiB) | loader | Mtok/s | vs baseline | setup s | peak RSS MiB | +over start |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = by[(r["size_mib"], "baseline")]["tokens_per_s"]
        speedup = r["tokens_per_s"] / base if base else float("nan")
        print(
            f"| {r['size_mib']} | {r['kind']} | {r['tokens_per_s'] / 1e6:.1f} | {speedup:.2f}x | "
            f"{r['setup_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['peak_minus_start_mib']:.0f} |"
        )
    result = {
        "config": {
            "batch": options.batch,
            "seq_len": options.seq_len,
            "batches_cap": options.batches,
            "threads": options.threads,
            "dtype": "uint16",
            "shuffle": True,
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "rows": rows,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "data.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {options.out / 'data.json'}")


if __name__ == "__main__":
    main()
