"""What the backend under a process group really does, found out by asking it (`doctor --probe`).

Version tables go stale and DeepSpeed-style "torch >= X" checks guess. :func:`capabilities`
runs tiny collectives through *raw* ``torch.distributed`` on a private copy of the group, checks
each result against a reference computed locally from every rank's input, and caches the answer
per process group (every member asks together, so every member holds the same answer)::

    caps = distcompat.capabilities()        # every rank calls it: it runs collectives
    print(caps.table())                      # markdown: op x dtype -> ok / WRONG / raises
    caps.cell("all_reduce", "bool", "SUM")   # 'WRONG' on gloo: bytes add and wrap at 256

Probes that crash a backend (gloo's 0-dim reduce_scatter segfaults) are never run. A probe that
hangs would only stall the private group until its 20 s timeout, never the caller's group.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat.collectives._entry import entry
from distcompat.collectives._group import backend_for, global_rank
from distcompat.collectives._native import all_gather_flat, reduce_scatter_flat
from distcompat.collectives._probed import ProbedCells, probed_for, remember

__all__ = ["CRASHES", "Capabilities", "ProbeCase", "capabilities", "probe_cases"]

_DTYPES = [
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
    "bool", "complex64", "float8_e4m3fn",
]  # fmt: skip
_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
_REDUCTIONS = ["all_reduce", "reduce"]  # reduce: the root's result
_MOVES = ["broadcast", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"]
_FUTURE_OPS = [
    "all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "isend",
]  # fmt: skip
_PROBE_TIMEOUT = timedelta(seconds=20)
_ELSEWHERE = "failed on another rank"  # right here, wrong or raising on some other rank


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """Probe results: ``cells[(op, dtype, reduce_op)]`` is 'ok', 'WRONG' or 'raises: ...'.

    ``futures[op]`` is 'native' when ``work.get_future()`` works for an async ``op``, else why not;
    ``layouts[(op, layout)]`` says whether a non-contiguous tensor gives the right answer.
    """

    backend: str
    torch_version: str
    world_size: int
    device_type: str = "cpu"
    cells: dict[tuple[str, str, str], str] = field(default_factory=dict)
    futures: dict[str, str] = field(default_factory=dict)
    layouts: dict[tuple[str, str], str] = field(default_factory=dict)

    def cell(self, op: str, dtype: str, reduce_op: str = "-") -> str:
        """Return the probe result for ``op`` on ``dtype`` (with ``reduce_op`` for reductions)."""
        return self.cells.get((op, dtype, reduce_op), "not probed")

    def table(self) -> str:
        """Render the results as markdown tables (reductions, data movement, futures, layouts)."""
        short = {"ok": "ok", "WRONG": "**WRONG**", _ELSEWHERE: "**WRONG**"}
        short.update({c: "**crashes**" for c in self.cells.values() if c.startswith("crashes")})
        lines = [
            f"Backend {self.backend} on {self.device_type} tensors, torch {self.torch_version}, "
            f"{self.world_size} rank{'s' * (self.world_size != 1)} "
            "(raw torch.distributed, before distcompat's shims).",
        ]
        for collective in _REDUCTIONS:
            title = "reduce (root)" if collective == "reduce" else collective
            lines += ["", f"| {title} | " + " | ".join(_OPS) + " |"]
            lines.append("| --- |" + " --- |" * len(_OPS))
            for dtype in _DTYPES:
                cells = (self.cell(collective, dtype, o) for o in _OPS)
                lines.append(
                    f"| {dtype} | " + " | ".join(short.get(c, "raises") for c in cells) + " |"
                )
        lines += ["", "| dtype | " + " | ".join(_MOVES) + " |", "| --- |" + " --- |" * len(_MOVES)]
        for dtype in _DTYPES:
            row = [short.get(self.cell(m, dtype), "raises") for m in _MOVES]
            lines.append(f"| {dtype} | " + " | ".join(row) + " |")
        lines += ["", "| async op | get_future() |", "| --- | --- |"]
        lines += [f"| {op} | {how} |" for op, how in self.futures.items()]
        lines += ["", "| op | non-contiguous layout | result |", "| --- | --- | --- |"]
        lines += [f"| {op} | {lay} | {short.get(r, r)} |" for (op, lay), r in self.layouts.items()]
        return "\n".join(lines)


def _value(rank: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Return a rank's probe input: two small values whose reductions are exact in any dtype."""
    base = torch.tensor([rank + 1, 2])
    if dtype == torch.bool:
        value = torch.tensor([rank % 2 == 0, True])
    elif dtype.is_complex:
        value = torch.complex(base.double(), base.double()).to(dtype)
    else:
        value = base.to(dtype)
    return value if device is None else value.to(device)


def _reference(dtype: torch.dtype, op: str, world: int) -> torch.Tensor:
    """Return the reduction of every rank's probe input, computed locally (bool: logically)."""
    wide = torch.complex128 if dtype.is_complex else torch.float64
    stack = torch.stack([_value(r, dtype).to(wide) for r in range(world)])
    if dtype == torch.bool:
        flags = stack.bool()
        logical = {"SUM": flags.any(0), "MAX": flags.any(0), "BOR": flags.any(0),
                   "PRODUCT": flags.all(0), "MIN": flags.all(0), "BAND": flags.all(0),
                   "BXOR": flags.sum(0) % 2 == 1}  # fmt: skip
        return logical[op]

    def bitwise(fn: Any) -> torch.Tensor:  # only reached for dtypes the backend accepted
        return functools.reduce(fn, stack.long().unbind(0))

    results = {
        "SUM": lambda: stack.sum(0), "AVG": lambda: stack.sum(0) / world,
        "PREMUL_SUM": lambda: (2.0 * stack).sum(0), "PRODUCT": lambda: stack.prod(0),
        "MIN": lambda: stack.real.amin(0), "MAX": lambda: stack.real.amax(0),
        "BAND": lambda: bitwise(torch.bitwise_and),
        "BOR": lambda: bitwise(torch.bitwise_or),
        "BXOR": lambda: bitwise(torch.bitwise_xor),
    }  # fmt: skip
    return results[op]().to(dtype)


def _equal(got: torch.Tensor, expected: torch.Tensor) -> bool:
    got = got.cpu()
    if got.dtype == torch.bool and not bool((got.view(torch.uint8) <= 1).all()):
        return False  # non-canonical bool bytes: the next op on them goes wrong
    wide = torch.complex128 if got.dtype.is_complex else torch.float64
    return bool(torch.allclose(got.to(wide), expected.to(wide), rtol=1e-2, atol=1e-2))


def _run(probe: Any) -> str:
    try:
        return "ok" if probe() else "WRONG"
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"raises: {str(exc).splitlines()[0][:80]}"


def _probe_device(group: Any) -> torch.device:
    """Return the device the probe's tensors live on: CPU unless the group only moves CUDA/XPU."""
    backend = backend_for(group, torch.device("cpu"))
    if backend not in ("nccl", "xccl"):
        return torch.device("cpu")
    kind = "cuda" if backend == "nccl" else "xpu"
    return torch.device(kind, getattr(torch, kind).current_device())


#: Probes that kill the process instead of raising, per (backend, device type): never run, and
#: their cell says so. Found with ``tools/find_probe_crashes.py`` (names from :func:`probe_cases`).
CRASHES: dict[tuple[str, str], dict[str, str]] = {
    # gloo hands a sent tensor's memory to the socket as host memory (H100, torch 2.11).
    ("gloo", "cuda"): {"future/isend": "gloo::IoException: writev: Bad address"},
}


@dataclass(frozen=True, slots=True)
class ProbeCase:
    """One probe: its name (``all_reduce/int8/SUM``, ``future/isend``), where its result goes."""

    name: str
    table: str  # "cells", "futures" or "layouts"
    key: Any
    run: Any  # () -> the result text


def probe_cases(group: Any, device: torch.device) -> list[ProbeCase]:
    """Every probe in the order :func:`capabilities` runs them (every rank runs the same list)."""
    cases = []
    for name in _DTYPES:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        for op in _OPS:
            reduce_op = _premul(2.0) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
            for collective in _REDUCTIONS:
                probe = functools.partial(
                    _reduction, collective, dtype, op, reduce_op, group, device
                )
                cases.append(
                    ProbeCase(
                        f"{collective}/{name}/{op}", "cells", (collective, name, op),
                        functools.partial(_run, probe),
                    )
                )  # fmt: skip
        for move in _MOVES:
            probe = functools.partial(_move, move, dtype, group, device)
            cases.append(
                ProbeCase(
                    f"{move}/{name}", "cells", (move, name, "-"), functools.partial(_run, probe)
                )
            )
    for op in _FUTURE_OPS:
        cases.append(
            ProbeCase(f"future/{op}", "futures", op, functools.partial(_future, op, group, device))
        )
    strided = functools.partial(_run, functools.partial(_strided, group, device))
    cases.append(ProbeCase("strided", "layouts", ("all_reduce", "strided view"), strided))
    return cases


@entry  # the backend's own behaviour: on a protected group its calls go straight to it
def _probe(group: Any, device: torch.device) -> Capabilities:
    world = dist.get_world_size(group)
    caps = Capabilities(
        backend=backend_for(group, device),
        torch_version=torch.__version__,
        world_size=world,
        device_type=device.type,
    )
    crashes = CRASHES.get((caps.backend, device.type), {})
    for case in probe_cases(group, device):
        why = crashes.get(case.name)
        getattr(caps, case.table)[case.key] = f"crashes: {why}" if why else case.run()
    _agree(caps, group, device)
    return caps


def _agree(caps: Capabilities, group: Any, device: torch.device) -> None:
    """Make every rank's results the same: a cell is 'ok' only where it was ok on every rank.

    The collectives choose their path from these cells, and every rank must choose the same
    (a rank that saw a right answer where another saw a wrong one takes the shim with it).
    """
    tables: list[dict[Any, str]] = [caps.cells, caps.futures, caps.layouts]
    good = ("ok", "native")
    flags = [float(value in good) for table in tables for value in table.values()]
    agreed = torch.tensor(flags, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    everywhere = iter(agreed.tolist())
    for table in tables:
        for key, value in table.items():
            if value in good and not next(everywhere):
                table[key] = _ELSEWHERE
            elif value not in good:
                next(everywhere)


def _reduction(
    collective: str, dtype: torch.dtype, op: str, reduce_op: Any, group: Any, device: torch.device
) -> bool:
    """Run one raw reduction; only ``reduce``'s root has a result to check (others say yes)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    value = _value(rank, dtype, device)
    if collective == "reduce":
        dist.reduce(value, dst=global_rank(group, 0), op=reduce_op, group=group)
        if rank != 0:
            return True  # the agreement step makes the root's verdict everyone's
    else:
        dist.all_reduce(value, op=reduce_op, group=group)
    return _equal(value, _reference(dtype, op, world))


def _premul(factor: float) -> Any:
    """ReduceOp.PREMUL_SUM with a factor (the seam knows each release's way)."""
    return _torch.premul_sum(factor)


def _move(op: str, dtype: torch.dtype, group: Any, device: torch.device) -> bool:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = _value(rank, dtype, device)
    if op == "broadcast":
        dist.broadcast(mine, src=global_rank(group, 0), group=group)
        return _equal(mine, _value(0, dtype))
    if op == "all_gather_into_tensor":
        out = torch.empty(world * 2, dtype=dtype, device=device)
        all_gather_flat(out, mine, group=group)
        return _equal(out, torch.cat([_value(r, dtype) for r in range(world)]))
    if op == "reduce_scatter_tensor":
        out = torch.empty(2, dtype=dtype, device=device)
        reduce_scatter_flat(out, torch.cat([mine] * world), group=group)
        return _equal(out, _reference(dtype, "SUM", world))
    out = torch.empty(world * 2, dtype=dtype, device=device)
    dist.all_to_all_single(out, torch.cat([mine] * world), group=group)
    return _equal(out, torch.cat([_value(r, dtype) for r in range(world)]))


def _future(op: str, group: Any, device: torch.device) -> str:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    value = torch.ones(world * 2, device=device)
    try:
        if op == "isend":  # a ring: send to the next rank, receive from the previous one
            sink = torch.empty(world * 2, device=device)
            work = dist.isend(value, dst=global_rank(group, (rank + 1) % world), group=group)
            receive = dist.irecv(sink, src=global_rank(group, (rank - 1) % world), group=group)
            assert work is not None
            assert receive is not None
            try:
                work.get_future()
                return "native"
            finally:
                work.wait()
                receive.wait()
        calls: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: dist.all_reduce(value, group=group, async_op=True),
            "broadcast": lambda: dist.broadcast(
                value, src=global_rank(group, 0), group=group, async_op=True),
            "all_gather_into_tensor": lambda: all_gather_flat(
                torch.empty(world * world * 2, device=device), value, group=group, async_op=True),
            "reduce_scatter_tensor": lambda: reduce_scatter_flat(
                torch.empty(2, device=device), value, group=group, async_op=True),
            "all_to_all_single": lambda: dist.all_to_all_single(
                torch.empty_like(value), value, group=group, async_op=True),
        }  # fmt: skip
        work = calls[op]()
        assert work is not None
        try:
            work.get_future()
            return "native"
        finally:
            work.wait()
    except RuntimeError as exc:
        return f"missing: {str(exc).splitlines()[0][:60]}"


def _strided(group: Any, device: torch.device) -> bool:
    base = torch.zeros(2, 4, device=device)
    view = base[:, ::2]
    view.fill_(1.0)
    dist.all_reduce(view, group=group)
    world = dist.get_world_size(group)
    return bool((view == world).all()) and bool((base[:, 1::2] == 0).all())


#: Per group, the results per device type the probe ran on.
_cache: weakref.WeakKeyDictionary[Any, dict[str, Capabilities]] = weakref.WeakKeyDictionary()


def capabilities(
    group: Any = None, *, device: torch.device | str | None = None, refresh: bool = False
) -> Capabilities:
    """Probe (once per process group and device type) what ``group``'s backend does.

    Every rank of ``group`` must call it together: it creates a private group and runs about
    270 tiny collectives on it (about 0.2 s on 2 gloo ranks). The results are the same on every
    rank, and from then on distcompat's reductions on ``group`` follow them: the native op where
    it proved correct, a named shim where it did not (see ``explain_collective``). Without a
    process group there is nothing to probe and the result is empty, for the backend ``"none"``.

    ``device`` is where the probe's tensors live: by default what the group's backend moves
    (CPU for gloo, the current CUDA device for NCCL). Another device, such as CUDA tensors through
    gloo, is probed and returned but does not change the plans of distcompat's reductions, which
    follow the default device's results.

    Example:
        >>> capabilities().backend   # no process group here
        'none'
    """
    if not (dist.is_available() and dist.is_initialized()):
        return Capabilities(backend="none", torch_version=torch.__version__, world_size=1)
    key = group if group is not None else dist.group.WORLD
    usual = _probe_device(group)
    where = usual if device is None else torch.device(device)
    if where.type != "cpu" and ":" not in str(where):  # a bare "cuda": the current device
        where = torch.device(where.type, getattr(torch, where.type).current_device())
    known = _cache.setdefault(key, {})
    fresh = refresh or where.type not in known
    if fresh:
        ranks = dist.get_process_group_ranks(key)
        private = dist.new_group(ranks=ranks, timeout=_PROBE_TIMEOUT)
        try:
            known[where.type] = _probe(private, where)
            # A rank that finishes first must not tear the private group down while a peer is
            # still receiving its last probe message (seen on torch 2.4: the next new_group
            # hangs). A barrier on the caller's group proves every rank is done with it.
            dist.barrier(group=group)
        finally:
            dist.destroy_process_group(private)
    caps = known[where.type]
    if where.type != usual.type:
        return caps  # another device's results: the reductions keep following the usual one
    if fresh or probed_for(group) is None:  # re-remembered only after a forget()
        remember(group, ProbedCells(caps.backend, caps.device_type, dict(caps.cells)))
    return caps
