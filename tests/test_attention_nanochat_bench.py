"""A smoke run of benchmarks/bench_nanochat_attention.py (the GPU check's script) on CPU, tiny."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_nanochat_attention.py"


@pytest.mark.slow
def test_tiny_run_trains_every_variant_alike() -> None:
    args = "--device cpu --depth 2 --width 32 --head-dim 16 --seq 256 --batch 1 --vocab 64"
    args += " --steps 3 --warmup 1 --block 1 --backend aot_eager"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args.split()],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "windows [128, 256]" in out  # nanochat's S window: ceil(256 / 4 / 128) * 128
    assert "window 128: sdpa: SDPA with a cached bottom-right bool mask" in out
    rows = [
        line.split("|")
        for line in out.splitlines()
        if line.startswith(("| distcompat", "| direct"))
    ]
    assert len(rows) == 3  # distcompat, distcompat without flex, direct SDPA
    losses = {row[1].strip(): float(row[6]) for row in rows}
    ratios = {row[1].strip(): row[3].strip() for row in rows}
    # Same weights, same batches, the same kernel with the same mask (flex is for GPUs): the same
    # training.
    assert losses["distcompat"] == pytest.approx(losses["direct SDPA"], abs=1e-3)
    assert losses["distcompat, no flex"] == pytest.approx(losses["direct SDPA"], abs=1e-3)
    assert ratios["direct SDPA"] == "1.000x"
