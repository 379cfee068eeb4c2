"""Rank-side checkers for the collective property tests (imported by the rank processes).

Every rank rebuilds every rank's inputs from the case's seed, so each can compute the reference
result locally and compare it with what the collective produced. Values are small non-negative
integers, so sums and products are exact in every dtype (fp8 included) whatever the order;
AVG is compared with a tolerance.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distcompat import collectives as C
from distcompat.collectives import UnsupportedCollectiveError

R = dist.ReduceOp
_DTYPE_NAMES = [
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip
DTYPES = {name: getattr(torch, name) for name in _DTYPE_NAMES}
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
LAYOUTS = ["contiguous", "transposed", "strided", "channels_last", "scalar", "empty"]
#: Which reduction plans a case runs under: the ones correct on every backend (no probe), the
#: ones gloo's own capability probe picks, or those for a backend whose every all_reduce op the
#: probe saw fail (a stand-in for backends we do not have: everything is gathered and reduced
#: locally).
PLANS = ["static", "probed", "failing"]
#: The device of the case being run (set by run_case): every tensor a collective sees lives there;
#: inputs and references are built on the CPU and compared there.
_device = torch.device("cpu")


@dataclass(frozen=True)
class Case:
    """One collective call: the op, dtype, ReduceOp, memory layout and a seed."""

    collective: str
    dtype: str
    op: str
    layout: str
    seed: int
    out_layout: str = ""  # layout of separate output tensors ('' = same as the inputs)
    device: str = "cpu"  # where the tensors handed to the collective live ("cuda": this rank's GPU)
    plans: str = "static"  # one of PLANS

    @property
    def out(self) -> str:
        """Layout of outputs, drawn apart from the inputs' (a shared permutation hides bugs)."""
        if not self.out_layout:
            return self.layout
        same_rank = {"scalar", "empty"}
        if (self.layout in same_rank) != (self.out_layout in same_rank):
            return self.layout  # shapes must agree: 0-dim and empty only pair with themselves
        return self.out_layout


def _shape(layout: str, rows: int) -> tuple[int, ...]:
    return {"channels_last": (rows, 2, 2, 3), "scalar": (), "empty": (0, 3)}.get(layout, (rows, 3))


def values(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The logical input of ``rank``: small integers (exact in every dtype)."""
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    ints = torch.randint(0, 4, shape, generator=gen)
    if dtype == torch.bool:
        return ints > 1
    if dtype.is_complex:
        return torch.complex(ints.double(), torch.randint(0, 4, shape, generator=gen).double()).to(
            dtype
        )
    return ints.to(dtype)


@dataclass
class Placed:
    """A tensor with the requested layout, and a way to check the memory around it."""

    tensor: torch.Tensor
    base: torch.Tensor
    snapshot: torch.Tensor

    def outside_untouched(self) -> bool:
        if self.base.data_ptr() == self.tensor.data_ptr() and self.base.shape == self.tensor.shape:
            return True
        now = self.base[:, 1::2].contiguous().view(torch.uint8)
        return bool((now == self.snapshot[:, 1::2].contiguous().view(torch.uint8)).all())


def place(logical: torch.Tensor, layout: str) -> Placed:
    """Put ``logical`` into memory laid out as ``layout`` (same values), on the case's device."""
    logical = logical.to(_device)
    if layout == "transposed" and logical.dim() == 2:
        tensor = logical.t().contiguous().t()
    elif layout == "strided" and logical.dim() == 2:
        base = torch.empty(
            logical.shape[0], 2 * logical.shape[1], dtype=logical.dtype, device=_device
        )
        base.view(torch.uint8).fill_(0x5A)  # a sentinel pattern outside the view
        tensor = base[:, ::2]
        tensor.copy_(logical)
        return Placed(tensor, base, base.clone())
    elif layout == "channels_last" and logical.dim() == 4:
        tensor = logical.contiguous(memory_format=torch.channels_last)
    else:
        tensor = logical.clone()
    return Placed(tensor, tensor, tensor.clone())


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of any dtype (torch 2.4 cannot fill fp8 directly)."""
    return torch.zeros(shape).to(dtype)


def _premul(factor: float) -> Any:
    try:
        return R.PREMUL_SUM(factor)  # callable from torch 2.13
    except TypeError:
        return dist._make_nccl_premul_sum(factor)


#: Whether this torch's PREMUL_SUM op exposes its factor (it does from 2.13); off NCCL,
#: distcompat can only emulate PREMUL_SUM when it can read the factor.
PREMUL_READABLE = getattr(_premul(2.0), "factor", None) is not None


def reduce_op(name: str) -> Any:
    return _premul(2.0) if name == "PREMUL_SUM" else getattr(R, name)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction computed locally in a wide dtype (bool ops by their logical meaning)."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs).to(torch.int64)
        table = {
            "SUM": stack.amax(0), "MAX": stack.amax(0), "BOR": stack.amax(0),
            "PRODUCT": stack.amin(0), "MIN": stack.amin(0), "BAND": stack.amin(0),
            "BXOR": stack.sum(0) % 2,
        }  # fmt: skip
        return table[op].bool()
    wide = (
        torch.complex128
        if dtype.is_complex
        else (torch.float64 if dtype.is_floating_point else torch.int64)
    )
    stack = torch.stack([x.to(wide) for x in inputs])
    if op in ("BAND", "BOR", "BXOR"):
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        return functools.reduce(fn, stack.unbind(0))
    results = {
        "SUM": lambda: stack.sum(0),
        "AVG": lambda: stack.sum(0) / len(inputs),
        "PREMUL_SUM": lambda: (stack * 2.0).sum(0),
        "PRODUCT": lambda: stack.prod(0),
        "MIN": lambda: stack.amin(0),
        "MAX": lambda: stack.amax(0),
    }
    return results[op]()


def same(actual: torch.Tensor, expected_wide: torch.Tensor, op: str) -> bool:
    """Compare in a wide dtype; exact except for AVG (rounding of a division)."""
    dtype = actual.dtype
    expected = expected_wide.to(dtype)  # the dtype's own rounding / wrap-around
    if actual.shape != expected.shape:
        return False
    if dtype == torch.bool:
        return bool((actual == expected).all())
    wide = torch.complex128 if dtype.is_complex else torch.float64
    a, e = actual.to(wide), expected.to(wide)
    if op != "AVG":
        return bool((a == e).all())
    eps = torch.finfo(_fdtype(dtype)).eps
    return bool(torch.allclose(a, e, rtol=4 * eps, atol=4 * eps))


def reduction_is_defined(dtype: torch.dtype, op: str) -> bool:
    """Whether distcompat promises a correct result (else UnsupportedCollectiveError)."""
    if op == "PREMUL_SUM" and not PREMUL_READABLE:
        return False
    if dtype == torch.bool:
        return op not in ("AVG", "PREMUL_SUM")
    if dtype.is_complex:
        return op in ("SUM", "AVG", "PREMUL_SUM")
    if dtype.is_floating_point:
        return op not in ("BAND", "BOR", "BXOR")
    return op not in ("AVG", "PREMUL_SUM")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytewise equality (torch 2.4 has no torch.equal for fp8)."""
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and torch.equal(*as_bytes)


def _fdtype(dtype: torch.dtype) -> torch.dtype:
    return torch.empty(0, dtype=dtype).real.dtype if dtype.is_complex else dtype


def run_case(case: Case) -> str:
    """Run ``case`` on this rank; return 'ok', 'unsupported', 'n/a' or what went wrong."""
    global _device
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[case.dtype]
    _device = (
        torch.device("cuda", torch.cuda.current_device())
        if case.device == "cuda"
        else torch.device(case.device)
    )
    _use_plans(case.plans, _device)
    runner = globals()[f"_case_{case.collective}"]
    try:
        problem: str | None = runner(case, rank, world, dtype)
    except UnsupportedCollectiveError:
        return "unsupported"
    return problem or "ok"


def _use_plans(plans: str, device: torch.device) -> None:
    """Make the default group's reductions follow ``plans`` (every rank calls this together)."""
    from distcompat import capabilities
    from distcompat.collectives._probed import ProbedCells, forget, remember

    if plans == "probed":
        capabilities()  # probes once per group, then cached
    elif plans == "failing":
        everything = {
            (c, n, o): "raises: simulated"
            for c in ("all_reduce", "reduce")
            for n in _DTYPE_NAMES
            for o in OPS
        }
        remember(None, ProbedCells("simulated", device.type, everything))
    else:
        forget(None)


def _inputs(
    case: Case, world: int, shape: tuple[int, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    return [values(case.seed, r, shape, dtype) for r in range(world)]


def _check(placed: Placed, expected: torch.Tensor, op: str, what: str) -> str | None:
    actual = placed.tensor.cpu()
    if not same(actual, expected, op):
        return f"{what}: got {actual.tolist()} expected {expected.tolist()}"
    if not placed.outside_untouched():
        return f"{what}: memory outside the strided view was overwritten"
    return None


def _case_all_reduce(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    xs = _inputs(case, world, _shape(case.layout, 2), dtype)
    placed = place(xs[rank], case.layout)
    C.all_reduce(placed.tensor, op=reduce_op(case.op))
    return _check(placed, reference(xs, case.op), case.op, "all_reduce")


def _case_reduce(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    xs = _inputs(case, world, _shape(case.layout, 2), dtype)
    placed = place(xs[rank], case.layout)
    C.reduce(placed.tensor, dst=0, op=reduce_op(case.op))
    expected = reference(xs, case.op) if rank == 0 else xs[rank]
    return _check(placed, expected, case.op if rank == 0 else "SUM", "reduce")


def _case_broadcast(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    xs = _inputs(case, world, _shape(case.layout, 2), dtype)
    placed = place(xs[rank], case.layout)
    C.broadcast(placed.tensor, src=world - 1)
    return _check(placed, xs[world - 1], "SUM", "broadcast")


def _scatter_shapes(layout: str, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    out = _shape(layout, 2)
    return out, ((world,) if out == () else (world * out[0], *out[1:]))


def _case_reduce_scatter_tensor(
    case: Case, rank: int, world: int, dtype: torch.dtype
) -> str | None:
    out_shape, in_shape = _scatter_shapes(case.layout, world)
    xs = _inputs(case, world, in_shape, dtype)
    source = place(xs[rank], case.layout)
    out = place(zeros(out_shape, dtype), case.out)
    C.reduce_scatter_tensor(out.tensor, source.tensor, op=reduce_op(case.op))
    expected = reference(xs, case.op).reshape(world, -1)[rank].reshape(out_shape)
    if not _same_bytes(source.tensor.cpu(), xs[rank]):
        return "reduce_scatter_tensor modified its input"
    return _check(out, expected, case.op, "reduce_scatter_tensor")


def _case_reduce_scatter(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    out_shape, in_shape = _scatter_shapes(case.layout, world)
    xs = _inputs(case, world, in_shape, dtype)
    pieces = [place(p.reshape(out_shape), case.layout) for p in xs[rank].reshape(world, -1)]
    out = place(zeros(out_shape, dtype), case.out)
    C.reduce_scatter(out.tensor, [p.tensor for p in pieces], op=reduce_op(case.op))
    expected = reference(xs, case.op).reshape(world, -1)[rank].reshape(out_shape)
    return _check(out, expected, case.op, "reduce_scatter")


def _case_all_gather(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    shape = _shape(case.layout, 2)
    xs = _inputs(case, world, shape, dtype)
    outs = [place(zeros(shape, dtype), case.out) for _ in range(world)]
    C.all_gather([o.tensor for o in outs], place(xs[rank], case.layout).tensor)
    problems = [_check(o, xs[r], "SUM", f"all_gather[{r}]") for r, o in enumerate(outs)]
    return next((p for p in problems if p), None)


def _case_all_gather_into_tensor(
    case: Case, rank: int, world: int, dtype: torch.dtype
) -> str | None:
    in_shape, out_shape = _scatter_shapes(case.layout, world)
    xs = _inputs(case, world, in_shape, dtype)
    out = place(zeros(out_shape, dtype), case.out)
    C.all_gather_into_tensor(out.tensor, place(xs[rank], case.layout).tensor)
    return _check(out, torch.cat([x.reshape(-1) for x in xs]).reshape(out_shape), "SUM", "agit")


def _case_gather(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    shape = _shape(case.layout, 2)
    xs = _inputs(case, world, shape, dtype)
    outs = [place(zeros(shape, dtype), case.out) for _ in range(world)]
    C.gather(
        place(xs[rank], case.layout).tensor, [o.tensor for o in outs] if rank == 0 else None, dst=0
    )
    if rank != 0:
        return None
    problems = [_check(o, xs[r], "SUM", f"gather[{r}]") for r, o in enumerate(outs)]
    return next((p for p in problems if p), None)


def _case_scatter(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    shape = _shape(case.layout, 2)
    xs = _inputs(case, world, shape, dtype)
    out = place(zeros(shape, dtype), case.out)
    sources = [place(x, case.layout).tensor for x in xs] if rank == 0 else None
    C.scatter(out.tensor, sources, src=0)
    return _check(out, xs[rank], "SUM", "scatter")


def _rows_between(src: int, dst: int) -> int:
    return src + dst + 1  # uneven on purpose: rank src sends this many rows to rank dst


def _case_all_to_all_single(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    if case.layout in ("scalar", "channels_last"):
        return None  # dim-0 splits of a 0-dim tensor do not exist; 4-D splits covered by 2-D
    sent = [_rows_between(rank, j) for j in range(world)]
    got = [_rows_between(j, rank) for j in range(world)]
    width = 0 if case.layout == "empty" else 3
    xs = [
        values(case.seed, r, (sum(_rows_between(r, j) for j in range(world)), width), dtype)
        for r in range(world)
    ]
    out = place(zeros((sum(got), width), dtype), case.out)
    C.all_to_all_single(out.tensor, place(xs[rank], case.layout).tensor, got, sent)
    pieces = []
    for j in range(world):
        start = sum(_rows_between(j, k) for k in range(rank))
        pieces.append(xs[j][start : start + _rows_between(j, rank)])
    return _check(out, torch.cat(pieces), "SUM", "all_to_all_single")


def _case_all_to_all(case: Case, rank: int, world: int, dtype: torch.dtype) -> str | None:
    width = 0 if case.layout == "empty" else 3

    def piece(src: int, dst: int) -> torch.Tensor:
        return values(case.seed * 7 + dst, src, (_rows_between(src, dst), width), dtype)

    outs = [place(zeros((_rows_between(j, rank), width), dtype), case.out) for j in range(world)]
    ins = [place(piece(rank, j), case.layout).tensor for j in range(world)]
    C.all_to_all([o.tensor for o in outs], ins)
    problems = [_check(o, piece(j, rank), "SUM", f"all_to_all[{j}]") for j, o in enumerate(outs)]
    return next((p for p in problems if p), None)


REDUCTIONS = ["all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter"]
MOVEMENTS = [
    "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "all_to_all_single", "all_to_all",
]  # fmt: skip
