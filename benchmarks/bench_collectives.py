"""distcompat collectives vs raw torch.distributed, side by side in one run (2 gloo ranks).

    python benchmarks/bench_collectives.py [--out benchmarks/results] [--quick]
    python benchmarks/bench_collectives.py --large-pairs 400    # the >= 1 MiB ratios only
    python benchmarks/bench_collectives.py --shm                # shared memory vs gloo
    python benchmarks/bench_collectives.py --tiny 4000          # 4 B calls, three ways
    python benchmarks/bench_collectives.py --cuda               # on a GPU machine (see below)

Per op and size (4 B to 64 MiB, float32, contiguous): p50/p95 latency of raw torch and of
distcompat, interleaved call by call (the order alternating) so both see the same noise, with
algbw and busbw from the nccl-tests formulas. Also: 200 small tensors coalesced vs 200 calls,
and a ZeRO-style overlapped pipeline (async reduce_scatter + compute) vs the same calls made
synchronously. Writes results.json, prints a markdown table and a summary against the goals,
and plots latency to latency.png if matplotlib is there.

``--shm``: the shared-memory path (``DISTCOMPAT_SHM=on``: every call through it) against raw
gloo, per op and size, at 2 and 4 ranks, interleaved call by call; and which path
``DISTCOMPAT_SHM=auto`` picks for each (``collectives._shm_path.MIN_BYTES``).

``--cuda``: the per-op table on CUDA tensors, on NCCL (1 rank: one GPU) and through gloo (2 ranks
sharing the GPU); every timed call ends with ``torch.cuda.synchronize()``. Writes
collectives_cuda.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

import distcompat.collectives as dc
from distcompat.collectives.direct import _common
from distcompat.collectives.shm import _path as shm
from distcompat.testing import run_on_ranks

SIZES = [4, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26]  # bytes
# nccl-tests bus-bandwidth factors: busbw = algbw * factor(n)
BUS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


# torch 2.13's names where they exist: the old ones now warn on every call (a slower baseline)
_GATHER = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_SCATTER = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


_plain: list[Any] = []


def _raw_group() -> Any:
    """torch's own gloo group for the raw side, where the default group is distcompat's protected
    one (whose calls go through distcompat); None (the default group) elsewhere. Every rank makes
    it on its first pair, as every rank makes the same pairs in the same order."""
    world = tdist.group.WORLD
    if not hasattr(world, "protects"):
        return None
    if not _plain or _plain[0] is not world:  # none yet, or made under an earlier world
        _plain[:] = [world, tdist.new_group(backend="gloo")]
    return _plain[1]


def _pair(
    op: str, nbytes: int, world: int, device: torch.device | None = None
) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """(raw call, distcompat call, bytes counted for algbw) for one op and size."""
    n = max(1, nbytes // 4)
    ones, empty = (functools.partial(make, device=device) for make in (torch.ones, torch.empty))
    g = _raw_group()
    if op == "all_reduce":
        t = ones(n)
        return (lambda: tdist.all_reduce(t, group=g)), (lambda: dc.all_reduce(t)), n * 4
    if op == "broadcast":
        t = ones(n)
        raw = lambda: tdist.broadcast(t, src=0, group=g)  # noqa: E731
        return raw, (lambda: dc.broadcast(t, src=0)), n * 4
    if op == "all_gather_into_tensor":
        inp, out = ones(n), empty(n * world)
        raw = lambda: _GATHER(out, inp, group=g)  # noqa: E731
        return raw, (lambda: dc.all_gather_into_tensor(out, inp)), n * world * 4
    if op == "reduce_scatter_tensor":
        inp, out = ones(n * world), empty(n)
        raw = lambda: _SCATTER(out, inp, group=g)  # noqa: E731
        return raw, (lambda: dc.reduce_scatter_tensor(out, inp)), n * world * 4
    inp, out = ones(n * world), empty(n * world)
    raw = lambda: tdist.all_to_all_single(out, inp, group=g)  # noqa: E731
    return raw, (lambda: dc.all_to_all_single(out, inp)), n * world * 4


def _reps(nbytes: int, quick: bool) -> int:
    reps = 40 if nbytes <= 1 << 20 else 16 if nbytes <= 1 << 24 else 8
    reps = 2000 if nbytes <= 1 << 10 else 200 if nbytes <= 1 << 16 else reps  # tiny: noisy
    return max(3, reps // 4) if quick else reps


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _paired(base: list[float], other: list[float]) -> float:
    """p50 of ``other - base`` call by call (the two made next to each other), in microseconds."""
    return _pct([b - a for a, b in zip(base, other, strict=True)], 0.5) * 1e6


def _timed(fn: Callable[[], Any], cuda: bool = False) -> float:
    tdist.barrier()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()  # NCCL and gloo's CUDA path return before the GPU is done
    return time.perf_counter() - start


def measure(quick: bool) -> dict[str, Any]:
    """Runs on every rank; rank 0's timings are reported.

    distcompat's own cost over the same backend: the shared-memory path is off (under ``auto``
    it takes every size of these calls, and the table would compare transports; ``--shm`` does).
    """
    with shm.forced("off"):
        wrapper = _wrapper_cost()
        return {
            "rows": _rows(quick),
            "wrapper_us": wrapper["warm"],
            "wrapper_cold_us": wrapper["cold"],
            "coalesced": _coalesced(quick),
            "overlap": _overlap(quick),
        }


def measure_cuda(quick: bool) -> dict[str, Any]:
    """The per-op table on CUDA tensors, on whatever backend the pool's group has."""
    device = torch.device("cuda", torch.cuda.current_device())
    return {
        "backend": tdist.get_backend(),
        "world": tdist.get_world_size(),
        "device": torch.cuda.get_device_name(device),
        "rows": _rows(quick, device),
    }


def _rows(quick: bool, device: torch.device | None = None) -> list[dict[str, Any]]:
    world = tdist.get_world_size()
    cuda = device is not None and device.type == "cuda"
    rows = []
    for op in BUS:
        for nbytes in SIZES[:4] if quick else SIZES:
            raw, ours, counted = _pair(op, nbytes, world, device)
            ours()  # warm up both paths
            try:
                raw()
            except RuntimeError as exc:  # raw torch lacks it here (gloo on CUDA tensors, say)
                t_ours = [_timed(ours, cuda) for _ in range(_reps(nbytes, quick))]
                p50_ours = _pct(t_ours, 0.5)
                rows.append(
                    {
                        "op": op, "bytes": nbytes, "raw_raises": str(exc).splitlines()[0][:120],
                        "ours_p50_us": p50_ours * 1e6, "ours_p95_us": _pct(t_ours, 0.95) * 1e6,
                        "busbw_GBps": counted / p50_ours / 1e9 * BUS[op](world),
                    }
                )  # fmt: skip
                continue
            t_raw, t_ours = [], []
            for index in range(_reps(nbytes, quick)):  # the order alternates
                if index % 2:
                    t_ours.append(_timed(ours, cuda))
                    t_raw.append(_timed(raw, cuda))
                else:
                    t_raw.append(_timed(raw, cuda))
                    t_ours.append(_timed(ours, cuda))
            p50_raw, p50_ours = _pct(t_raw, 0.5), _pct(t_ours, 0.5)
            algbw = counted / p50_ours / 1e9
            rows.append(
                {
                    "op": op, "bytes": nbytes,
                    "raw_p50_us": p50_raw * 1e6, "raw_p95_us": _pct(t_raw, 0.95) * 1e6,
                    "ours_p50_us": p50_ours * 1e6, "ours_p95_us": _pct(t_ours, 0.95) * 1e6,
                    "ratio": p50_ours / p50_raw, "extra_us": (p50_ours - p50_raw) * 1e6,
                    "paired_extra_us": _paired(t_raw, t_ours),
                    "algbw_GBps": algbw, "busbw_GBps": algbw * BUS[op](world),
                }
            )  # fmt: skip
    return rows


#: Goals for distcompat's own cost (benchmarks/README.md): per call, and per tiny (4 B) call.
WRAPPER_GOAL_US = 5.0
TINY_GOAL_US = 5.0


class _DoneWork:
    """What a no-op backend call returns: a Work that is already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> Any:
        future: Any = torch.futures.Future()
        future.set_result(None)
        return future


def _wrapper_cost(
    calls: int = 20000, rounds: int = 20, cold_calls: int = 2000
) -> dict[str, dict[str, float]]:
    """distcompat's own per-call cost: the backend call is replaced by a no-op on both sides.

    Returns ``{"warm": ..., "cold": ...}``, microseconds per op. Warm: calls back to back, as
    below. Cold: one call right after a barrier, as in the end-to-end rows (the p50 difference
    of ``cold_calls`` calls per side, interleaved): Python that runs after a wait runs with cold
    caches, and there each microsecond of warm cost showed as several.

    The no-op replaces the ProcessGroup methods that torch's functions call (``allreduce``,
    ``broadcast``, ``all_to_all_single``, ``all_gather_single``; the older names too), so the
    raw side pays torch's Python wrapper and the distcompat side pays distcompat's (which calls
    some of these methods directly). Earlier versions replaced the ``torch.distributed``
    functions instead; distcompat's ``all_gather_into_tensor`` calls torch 2.13's newer
    ``all_gather_single``, which that missed, so a real all-gather was timed (377 us).

    End-to-end timings of tiny collectives vary by tens of microseconds between round trips on
    a shared 2-core box, which hides a few microseconds of Python; this isolates them. Blocks of
    ``calls / rounds`` calls alternate between the two sides; the median difference is reported.

    The shared-memory path is off here (:func:`measure` runs everything with it off): a no-op
    backend would not stand in for its ops. distcompat's reduce_scatter_tensor is an all-to-all
    (a no-op here) plus a local reduction of the rows, which stays in its cost: gloo's own
    reduction is inside the no-op. The fast paths keep the ProcessGroup class's all-to-all
    function once looked up (``_common._exchanges``): emptied here, so they find the no-op (and
    later the real one).
    """
    t, out, inp = torch.ones(1), torch.empty(2), torch.ones(2)
    pg_type = type(tdist.group.WORLD)
    methods = ("allreduce", "broadcast", "all_to_all_single", "alltoall_base",
               "all_gather_single", "_allgather_base", "reduce_scatter_single",
               "_reduce_scatter_base", "reduce_scatter_tensor")  # fmt: skip
    # the class's own entries (pybind's method descriptors): getattr() would hand back
    # functions that no longer bind ``self`` once set back on the class
    real = {name: vars(pg_type)[name] for name in methods if name in vars(pg_type)}
    done = _DoneWork()
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "all_reduce": (lambda: dc.all_reduce(t), lambda: tdist.all_reduce(t)),
        "broadcast": (lambda: dc.broadcast(t, src=0), lambda: tdist.broadcast(t, src=0)),
        "all_to_all_single": (
            lambda: dc.all_to_all_single(out, inp),
            lambda: tdist.all_to_all_single(out, inp),
        ),
        "all_gather_into_tensor": (
            lambda: dc.all_gather_into_tensor(out, t),
            lambda: tdist.all_gather_single(out, t),  # torch 2.13's name: no FutureWarning
        ),
        "reduce_scatter_tensor": (
            lambda: dc.reduce_scatter_tensor(t, inp),
            lambda: _SCATTER(t, inp),
        ),
    }
    cost: dict[str, float] = {}
    cold: dict[str, float] = {}
    try:
        for name in real:
            setattr(pg_type, name, lambda *args, **kwargs: done)
        _common._exchanges.clear()
        for name, (ours, raw) in pairs.items():
            ours(), raw()
            block = calls // rounds
            differences = []
            for index in range(rounds):  # interleaved blocks, the order alternating
                elapsed = {}
                for fn in (ours, raw) if index % 2 == 0 else (raw, ours):
                    start = time.perf_counter()
                    for _ in range(block):
                        fn()
                    elapsed[fn] = time.perf_counter() - start
                differences.append((elapsed[ours] - elapsed[raw]) / block * 1e6)
            cost[name] = _pct(differences, 0.5)
            t_ours: list[float] = []
            t_raw: list[float] = []
            for index in range(cold_calls):  # one call after each barrier, the order alternating
                first, second = ((ours, t_ours), (raw, t_raw))[:: -1 if index % 2 else 1]
                first[1].append(_timed(first[0]))
                second[1].append(_timed(second[0]))
            cold[name] = (_pct(t_ours, 0.5) - _pct(t_raw, 0.5)) * 1e6
    finally:
        for name, fn in real.items():
            setattr(pg_type, name, fn)
        _common._exchanges.clear()
    return {"warm": cost, "cold": cold}


def summary(result: dict[str, Any]) -> list[str]:
    """The lines that say whether distcompat's own cost meets its goals."""
    lines = [f"wrapper cost per call (backend call a no-op), goal <= {WRAPPER_GOAL_US:g} us:"]
    for op, us in result["wrapper_us"].items():
        verdict = "met" if us <= WRAPPER_GOAL_US else "NOT met"
        if op == "reduce_scatter_tensor":  # see _wrapper_cost: the row reduction still runs
            verdict += "; includes the row reduction, which gloo does inside the no-op call"
        lines.append(f"  {op}: {us:+.1f} us ({verdict})")
    lines.append("the same right after a barrier, p50 (cold caches, as in the 4 B rows below):")
    for op, us in result["wrapper_cold_us"].items():
        lines.append(f"  {op}: {us:+.1f} us")
    lines.append(
        f"tiny-call overhead over raw torch (4 B), goal <= +{TINY_GOAL_US:g} us: the p50 of the "
        "paired differences (each call less the raw call next to it), then the difference of "
        "the two p50s"
    )
    for r in result["rows"]:
        if r["bytes"] == SIZES[0]:
            paired = r["paired_extra_us"]
            verdict = "met" if paired <= TINY_GOAL_US else "NOT met"
            lines.append(f"  {r['op']}: {paired:+.1f} us ({verdict}); p50s {r['extra_us']:+.1f} us")
    return lines


def _coalesced(quick: bool) -> dict[str, float]:
    tensors = [torch.ones(64) for _ in range(200)]

    def one_by_one() -> None:
        for t in tensors:
            dc.all_reduce(t)

    def bucket() -> None:
        dc.all_reduce_coalesced(tensors)

    one_by_one()
    bucket()
    reps = 5 if quick else 20
    calls = [_timed(one_by_one) for _ in range(reps)]
    coalesced = [_timed(bucket) for _ in range(reps)]
    return {
        "calls_200_ms": _pct(calls, 0.5) * 1e3,
        "coalesced_ms": _pct(coalesced, 0.5) * 1e3,
        "speedup": _pct(calls, 0.5) / _pct(coalesced, 0.5),
    }


def _overlap(quick: bool) -> dict[str, float]:
    """4 buckets of 1 MiB grads; a 'backward' matmul per bucket overlaps the previous bucket."""
    world = tdist.get_world_size()
    grads = [torch.ones(world * (1 << 18)) for _ in range(4)]
    shards = [torch.empty(1 << 18) for _ in range(4)]
    weight = torch.randn(384, 384)

    def compute() -> None:
        weight @ weight

    def synchronous() -> None:
        for g, s in zip(grads, shards, strict=True):
            compute()
            tdist.reduce_scatter_tensor(s, g)

    def overlapped() -> None:
        pending = []
        for g, s in zip(grads, shards, strict=True):
            compute()
            work = dc.reduce_scatter_tensor(s, g, async_op=True)
            assert work is not None
            pending.append(work.get_future())
        torch.futures.wait_all(pending)

    synchronous()
    overlapped()
    reps = 5 if quick else 20
    sync_t = [_timed(synchronous) for _ in range(reps)]
    over_t = [_timed(overlapped) for _ in range(reps)]
    return {
        "sync_raw_ms": _pct(sync_t, 0.5) * 1e3,
        "overlapped_ms": _pct(over_t, 0.5) * 1e3,
        "ratio": _pct(over_t, 0.5) / _pct(sync_t, 0.5),
    }


def _median_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Median of per-pair ratios and its distribution-free 95% interval (binomial order stats)."""
    ordered = sorted(ratios)
    n = len(ordered)
    half = 1.96 * (n**0.5) / 2
    low = max(0, int(n / 2 - half))
    high = min(n - 1, int(n / 2 + half + 0.999))
    return _pct(ordered, 0.5), ordered[low], ordered[high]


def _pair_ratios(
    first: Callable[[], Any], second: Callable[[], Any], count: int
) -> tuple[float, float, float]:
    """Median (and 95% interval) of ``second``'s time over ``first``'s, order alternated."""
    ratios = []
    for index in range(count):
        if index % 2:
            t_second, t_first = _timed(second), _timed(first)
        else:
            t_first, t_second = _timed(first), _timed(second)
        ratios.append(t_second / t_first)
    return _median_ci(ratios)


def measure_large(pairs: int) -> dict[str, Any]:
    """The >= 1 MiB ratio with an interval: many raw/distcompat pairs, order alternated (ABBA).

    Runs on every rank; each pair's ratio is distcompat's time over raw's, so slow drift of the
    machine (the other jobs on two shared cores) cancels within a pair rather than between
    blocks of calls. The median of the ratios comes with its 95% confidence interval, next to a
    control: raw over raw, the same call in both slots, which shows what the method itself reads
    when there is no difference.
    """
    world = tdist.get_world_size()
    out: dict[str, Any] = {}
    for op in BUS:
        for nbytes in (1 << 20, 1 << 24):
            raw, ours, _ = _pair(op, nbytes, world)
            raw_again, _, _ = _pair(op, nbytes, world)  # the control: its own tensors
            raw(), ours(), raw_again()
            count = pairs if nbytes == 1 << 20 else max(10, pairs // 8)
            row: dict[str, Any] = {"pairs": count}
            for name, fn in (("control", raw_again), ("distcompat", ours)):
                median, low, high = _pair_ratios(raw, fn, count)
                row[name] = {"median": median, "low": low, "high": high}
            out[f"{op} {nbytes}"] = row
    return out


TINY_OPS = ["all_reduce", "broadcast", "all_to_all_single"]


def measure_tiny(rounds: int) -> dict[str, Any]:
    """4 B calls: raw torch, distcompat with its defaults, and distcompat without a watchdog.

    Runs on every rank. Each round makes the three calls (after a barrier each) in the next of
    the six orders, so all three see the same noise and each follows each of the others equally
    often (a call right after one that ran the same code finds it warm). Returns every rank's
    p50 of each, and the p50 of distcompat less raw taken pair by pair within a round (less
    sensitive to the machine's drift than a difference of two p50s). The third column switches
    the watchdog off for one call (``_checked.watch`` is what the fast paths read), which shows
    what the watchdog's record costs end to end. The shared-memory path is off (see
    :func:`measure`).
    """
    with shm.forced("off"):
        return _tiny(rounds)


def _tiny(rounds: int) -> dict[str, Any]:
    from distcompat.collectives import _checked

    watcher = _checked.watch
    assert watcher is not None, "the default watchdog is expected on"
    out: dict[str, Any] = {"rank": tdist.get_rank(), "rounds": rounds}
    for op in TINY_OPS:
        raw, ours, _ = _pair(op, 4, tdist.get_world_size())

        def unwatched(call: Callable[[], Any] = ours) -> None:
            _checked.watch = None
            try:
                call()
            finally:
                _checked.watch = watcher

        calls = [raw, ours, unwatched]
        for call in calls:
            call()
        times: list[list[float]] = [[], [], []]
        orders = list(itertools.permutations(range(3)))
        for index in range(rounds):
            for k in orders[index % len(orders)]:
                times[k].append(_timed(calls[k]))
        out[op] = {
            "raw_p50_us": _pct(times[0], 0.5) * 1e6,
            "defaults_p50_us": _pct(times[1], 0.5) * 1e6,
            "no_watchdog_p50_us": _pct(times[2], 0.5) * 1e6,
            "defaults_minus_raw_paired_us": _paired(times[0], times[1]),
            "no_watchdog_minus_raw_paired_us": _paired(times[0], times[2]),
        }
    return out


SHM_OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"]


def measure_shm(quick: bool) -> list[dict[str, Any]]:
    """Shared memory (every call through it) vs raw gloo; runs on every rank, rank 0 reports."""
    with shm.forced("on"):
        return _shm_rows(quick)


def _shm_rows(quick: bool) -> list[dict[str, Any]]:
    world = tdist.get_world_size()
    rows = []
    for op in SHM_OPS:
        for nbytes in SIZES[:4] if quick else SIZES:
            raw, ours, counted = _pair(op, nbytes, world)
            raw(), ours()
            engine = shm.engine_for(None, op, torch.empty(1))
            assert engine is not None, shm.status(None).reason
            calls = engine.calls
            t_raw: list[float] = []
            t_shm: list[float] = []
            for index in range(_reps(nbytes, quick)):  # the order alternates
                first, second = ((raw, t_raw), (ours, t_shm))[:: -1 if index % 2 else 1]
                first[1].append(_timed(first[0]))
                second[1].append(_timed(second[0]))
            assert engine.calls > calls  # the shared-memory side did take the path
            p50_raw, p50_shm = _pct(t_raw, 0.5), _pct(t_shm, 0.5)
            rows.append(
                {
                    "op": op, "bytes": nbytes, "world": world,
                    "gloo_p50_us": p50_raw * 1e6, "shm_p50_us": p50_shm * 1e6,
                    "gloo_p95_us": _pct(t_raw, 0.95) * 1e6, "shm_p95_us": _pct(t_shm, 0.95) * 1e6,
                    "speedup": p50_raw / p50_shm,
                    "shm_busbw_GBps": counted / p50_shm / 1e9 * BUS[op](world),
                    "auto_takes": "shm" if nbytes >= shm.MIN_BYTES[op][world > 2] else "gloo",
                }
            )  # fmt: skip
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print("| op | bytes | raw p50 us | distcompat p50 us | ratio | +us | busbw GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "raw_raises" in r:
            print(
                f"| {r['op']} | {r['bytes']} | raises: {r['raw_raises']} | "
                f"{r['ours_p50_us']:.1f} | - | - | {r['busbw_GBps']:.3f} |"
            )
            continue
        print(
            f"| {r['op']} | {r['bytes']} | {r['raw_p50_us']:.1f} | {r['ours_p50_us']:.1f} | "
            f"{r['ratio']:.3f} | {r['extra_us']:+.1f} | {r['busbw_GBps']:.3f} |"
        )


def _print_shm(rows: list[dict[str, Any]]) -> None:
    print("| ranks | op | bytes | gloo p50 us | shm p50 us | speedup | shm busbw GB/s | auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['world']} | {r['op']} | {r['bytes']} | {r['gloo_p50_us']:.1f} | "
            f"{r['shm_p50_us']:.1f} | {r['speedup']:.2f}x | {r['shm_busbw_GBps']:.2f} | "
            f"{r['auto_takes']} |"
        )


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for op in BUS:
        mine = [r for r in rows if r["op"] == op]
        sizes = [r["bytes"] for r in mine]
        ax.plot(sizes, [r["ours_p50_us"] for r in mine], marker="o", label=f"{op} distcompat")
        ax.plot(sizes, [r["raw_p50_us"] for r in mine], ls="--", alpha=0.6, label=f"{op} raw")
    ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="p50 latency (us)")
    ax.set_title("gloo, 2 ranks: distcompat vs raw torch.distributed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument(
        "--large-pairs",
        type=int,
        default=0,
        help="only measure the >= 1 MiB ratios, from this many alternating pairs at 1 MiB "
        "(an eighth as many at 16 MiB), with 95%% intervals",
    )
    parser.add_argument(
        "--shm", action="store_true", help="shared memory vs gloo per op and size, 2 and 4 ranks"
    )
    parser.add_argument(
        "--tiny",
        type=int,
        default=0,
        help="only the 4 B calls: raw, defaults and no watchdog, interleaved, this many rounds",
    )
    parser.add_argument(
        "--cuda", action="store_true", help="CUDA tensors: NCCL (1 rank) and gloo (2 ranks)"
    )
    options = parser.parse_args()
    if options.cuda:
        runs = [
            run_on_ranks(measure_cuda, 1, backend="nccl", args=(options.quick,), timeout=900)[0],
            run_on_ranks(measure_cuda, 2, args=(options.quick,), timeout=900)[0],
        ]
        options.out.mkdir(parents=True, exist_ok=True)
        found = {"torch": torch.__version__, "runs": runs}
        (options.out / "collectives_cuda.json").write_text(json.dumps(found, indent=2))
        for run in runs:
            print(f"\n{run['backend']}, {run['world']} rank(s), CUDA tensors on {run['device']}")
            _print_rows(run["rows"])
        return
    if options.tiny:
        ranks = run_on_ranks(measure_tiny, 2, args=(options.tiny,), timeout=1800)
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "collectives_tiny.json").write_text(json.dumps(ranks, indent=2))
        print("| rank | op | raw p50 us | defaults - raw: p50s / paired | no watchdog - raw |")
        print("| --- | --- | --- | --- | --- |")
        for r in ranks:
            for op in TINY_OPS:
                m = r[op]
                print(
                    f"| {r['rank']} | {op} | {m['raw_p50_us']:.1f} | "
                    f"{m['defaults_p50_us'] - m['raw_p50_us']:+.1f} / "
                    f"{m['defaults_minus_raw_paired_us']:+.1f} | "
                    f"{m['no_watchdog_p50_us'] - m['raw_p50_us']:+.1f} / "
                    f"{m['no_watchdog_minus_raw_paired_us']:+.1f} |"
                )
        return
    if options.shm:
        rows = []
        for world in (2, 4):
            rows += run_on_ranks(measure_shm, world, args=(options.quick,), timeout=1800)[0]
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "collectives_shm.json").write_text(
            json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "rows": rows}, indent=2)
        )
        _print_shm(rows)
        return
    if options.large_pairs:
        large = run_on_ranks(measure_large, 2, args=(options.large_pairs,), timeout=1800)[0]
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "collectives_large.json").write_text(json.dumps(large, indent=2))
        print("| op, bytes | pairs | raw/raw (control) | distcompat/raw |")
        print("| --- | --- | --- | --- |")
        for name, r in large.items():
            cells = [
                f"{c['median']:.3f} ({c['low']:.3f}-{c['high']:.3f})"
                for c in (r["control"], r["distcompat"])
            ]
            print(f"| {name} | {r['pairs']} | {cells[0]} | {cells[1]} |")
        return
    result = run_on_ranks(measure, 2, args=(options.quick,), timeout=1800)[0]
    result["torch"] = torch.__version__
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "collectives.json").write_text(json.dumps(result, indent=2))
    _print_rows(result["rows"])
    print("\n".join(summary(result)))
    print("coalesced:", json.dumps(result["coalesced"]))
    print("overlap:", json.dumps(result["overlap"]))
    if _plot(result["rows"], options.out / "collectives_latency.png"):
        print("plot:", options.out / "collectives_latency.png")


if __name__ == "__main__":
    main()
