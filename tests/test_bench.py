"""``distcompat bench``: the arithmetic on known inputs, and the quick bench on 2 real local ranks.

Timing is never asserted (the machine is shared); the numbers are checked for shape, sign and the
busbw factor, which is arithmetic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distcompat.bench import (
    OPS,
    BenchConfig,
    BenchHeader,
    BenchReport,
    BenchRow,
    bus_factor,
    geometric_sizes,
    measure,
    percentile,
)
from distcompat.bench._cli import add_bench_parser, config_from_options, run_bench_command
from distcompat.bench._report import MissingExtraError, require_matplotlib
from distcompat.bench._stats import parse_bytes
from distcompat.launch._local_ranks import is_launcher_variable
from distcompat.testing import run_on_ranks


@pytest.mark.parametrize(
    ("op", "factors"),
    [
        ("all_reduce", {1: 0.0, 2: 1.0, 4: 1.5, 8: 1.75}),
        ("all_gather_into_tensor", {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875}),
        ("reduce_scatter_tensor", {2: 0.5, 4: 0.75, 8: 0.875}),
        ("all_to_all_single", {2: 0.5, 4: 0.75, 8: 0.875}),
        ("broadcast", {1: 1.0, 2: 1.0, 8: 1.0}),
    ],
)
def test_nccl_tests_bus_factors(op: str, factors: dict[int, float]) -> None:
    for world, factor in factors.items():
        assert bus_factor(op, world) == factor


def test_unknown_op_is_named() -> None:
    with pytest.raises(ValueError, match="op='all_gather' is not one of all_reduce"):
        bus_factor("all_gather", 2)


def test_row_arithmetic_on_known_times() -> None:
    # 8 MB all_reduce on 8 ranks: median 4 ms -> algbw 2 GB/s, busbw 2 * 2*7/8 = 3.5 GB/s
    times = [0.004, 0.003, 0.005, 0.004, 0.010]
    row = BenchRow.from_times("all_reduce", nbytes=8_000_000, count=2_000_000, world_size=8,
                              times_s=times)  # fmt: skip
    assert row.p50_us == pytest.approx(4000.0)
    assert row.p95_us == pytest.approx(10000.0)
    assert row.algbw_gbps == pytest.approx(2.0)
    assert row.busbw_gbps == pytest.approx(3.5)
    assert row.iterations == 5
    gather = BenchRow.from_times("all_gather_into_tensor", nbytes=8_000_000, count=2_000_000,
                                 world_size=8, times_s=times)  # fmt: skip
    assert gather.busbw_gbps == pytest.approx(2.0 * 7 / 8)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.95) == 95.0
    assert percentile([7.0], 0.95) == 7.0
    with pytest.raises(ValueError, match="0 < q <= 1"):
        percentile([], 0.5)


def test_sizes() -> None:
    assert geometric_sizes(1024, 16 << 20, 4) == [1 << k for k in range(10, 25, 2)]
    assert parse_bytes("64K") == 65536
    with pytest.raises(ValueError, match="not a size in bytes"):
        parse_bytes("big")
    with pytest.raises(ValueError, match="factor"):
        geometric_sizes(1, 10, 1)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distcompat")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_flags() -> None:
    quick = config_from_options(_parse("--quick"))
    assert (quick.sizes, quick.iterations, quick.warmup) == ([1024, 32768, 1 << 20], 10, 2)
    assert quick.ops == OPS
    full = config_from_options(_parse("--max-bytes", "64M", "--iters", "7", "--ops", "broadcast"))
    assert full.sizes[-1] == 64 << 20
    assert (full.iterations, full.ops) == (7, ("broadcast",))


def test_usage_errors_exit_2_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench_command(_parse("--ops", "all_gather")) == 2
    assert "choose from all_reduce" in capsys.readouterr().err
    assert run_bench_command(_parse("--nproc", "0")) == 2


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(MissingExtraError, match=r"pip install 'distcompat\[bench\]'"):
        require_matplotlib()


def test_table_lists_every_row_under_its_header() -> None:
    header = BenchHeader(world_size=4, num_nodes=2, launcher="slurm", backend="nccl",
                         device="cuda:0", dtype="bfloat16", iterations=20, warmup=5,
                         torch_version="2.13.0")  # fmt: skip
    rows = [
        BenchRow.from_times(op, nbytes=1 << 20, count=1 << 18, world_size=4, times_s=[1e-3])
        for op in OPS
    ]
    text = BenchReport(header=header, rows=rows).table()
    assert text.startswith("# distcompat bench: 4 ranks on 2 node(s) (slurm), backend nccl")
    assert "# calls: distcompat.collectives" in text
    lines = text.splitlines()
    assert lines[4].split() == ["op", "size", "count", "p50", "us", "p95", "us", "algbw", "busbw"]
    assert lines[5].split() == ["all_reduce", "1", "MiB", "262144", "1000.0", "1000.0", "1.049",
                                "1.573"]  # fmt: skip


def _measure_on_rank() -> list[BenchRow]:
    import torch

    config = BenchConfig(sizes=[64, 4096], iterations=3, warmup=1)
    return measure(config, device=torch.device("cpu"))


def test_measure_on_a_real_group_of_three() -> None:
    """The rows agree on every rank (slowest-rank times); sizes follow nccl-tests."""
    per_rank = run_on_ranks(_measure_on_rank, world_size=3)
    assert per_rank[0] == per_rank[1] == per_rank[2]
    rows = {(r.op, r.nbytes): r for r in per_rank[0]}
    assert len(rows) == len(OPS) * 2
    # 4096 bytes of float32 split 3 ways: 341 elements per rank, a 1023-element buffer
    assert rows[("all_gather_into_tensor", 4092)].count == 1023
    assert rows[("all_reduce", 4096)].count == 1024
    for row in per_rank[0]:
        assert row.p50_us > 0
        assert row.busbw_gbps == pytest.approx(row.algbw_gbps * bus_factor(row.op, 3))


@pytest.mark.slow
def test_quick_bench_on_two_local_ranks(tmp_path: Path) -> None:
    """`distcompat bench --quick --json` starts 2 local gloo ranks and prints the table."""
    environ = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    out = tmp_path / "bench.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "distcompat", "bench", "--quick", "--device", "cpu",
         "--json", str(out)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# distcompat bench: 2 ranks on 1 node(s) (local ranks started by" in done.stdout
    table = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in OPS]
    assert len(table) == len(OPS) * 3
    report = json.loads(out.read_text())
    assert report["header"]["world_size"] == 2
    assert report["header"]["backend"] == "gloo"
    assert len(report["rows"]) == len(OPS) * 3
    for row in report["rows"]:
        assert row["p50_us"] > 0
        assert row["p95_us"] >= row["p50_us"]
        assert math.isfinite(row["algbw_gbps"])
        assert row["algbw_gbps"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(row["op"], 2))
        assert row["nbytes"] in (1024, 32768, 1 << 20)
    print(f"quick bench on 2 local ranks: {elapsed:.1f} s")  # shown with -s / in the report


def _compare_on_rank() -> tuple[list[BenchRow], int, str]:
    import os

    import torch

    from distcompat.collectives.shm import Engine
    from distcompat.collectives.shm import _path as _shm_path

    os.environ.pop("DISTCOMPAT_SHM", None)  # the user's setting: auto
    _shm_path.reset()
    config = BenchConfig(
        ops=("all_reduce", "all_to_all_single"), sizes=[4096], iterations=4, warmup=1,
        compare_shm=True,
    )  # fmt: skip
    rows = measure(config, device=torch.device("cpu"))
    engine = _shm_path._groups.get(torch.distributed.group.WORLD)
    calls = engine.calls if isinstance(engine, Engine) else -1
    return rows, calls, _shm_path.choice().mode


def test_compare_shm_times_each_call_down_both_paths() -> None:
    """``--compare-shm`` on 2 real ranks: a shared-memory row and a gloo row per op and size;
    only the shared-memory calls went through the path (warm-up and timed: 5), besides the four
    MAX all-reduces of the times (one per row, under the user's auto); the setting comes back."""
    rows, calls, mode = run_on_ranks(_compare_on_rank, world_size=2)[0]
    assert [(r.op, r.path) for r in rows] == [
        ("all_reduce", "shared memory"), ("all_reduce", "gloo"),
        ("all_to_all_single", "shared memory"), ("all_to_all_single", "gloo"),
    ]  # fmt: skip
    assert calls == 5 + 4
    assert mode == "auto"
    header = BenchHeader(world_size=2, num_nodes=1, launcher="env", backend="gloo",
                         device="cpu", dtype="float32", iterations=4, warmup=1,
                         torch_version="2.13.0", compared=True)  # fmt: skip
    lines = BenchReport(header=header, rows=rows).table().splitlines()
    assert lines[4].startswith("# paths: each call through shared memory and through gloo")
    assert lines[5].split()[-2:] == ["path", "speedup"]
    assert lines[6].split()[-3:-1] == ["shared", "memory"]
    assert lines[6].split()[-1].endswith("x")
    assert lines[7].split()[-1] == "gloo"


def test_compare_shm_is_for_cpu_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench_command(_parse("--compare-shm", "--device", "cuda")) == 2
    assert "--compare-shm compares CPU collectives" in capsys.readouterr().err
    assert config_from_options(_parse("--compare-shm", "--quick")).compare_shm
