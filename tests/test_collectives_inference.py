"""Collectives on inference tensors: what runs on plain gloo runs on the protected group, same bits.

Frameworks make tensors under ``torch.inference_mode()`` (Lightning's validation loop, whose
``self.log(..., sync_dist=True)`` all-reduces them) and may reduce them after leaving it. torch
refuses an in-place update to an inference tensor outside inference mode, and inference mode is
per thread; gloo writes its results from C++, past that check, so on plain torch a SUM into one
works in any thread. distcompat's post-processing (AVG's divide, copies back) and the
shared-memory folds write with torch ops, in the caller's thread or another: each must enter
inference mode itself.

Every case runs on two ranks, with every default on, on both routes (the shared-memory path, and
``DISTCOMPAT_SHM=off``: gloo with distcompat's shims), with tensors of 6 and 700 elements (the
second goes through several of the test's 1 KiB slots): all tensors are made under inference
mode, and the op is called inside it or after leaving it. The same call through
``torch.distributed`` on a plain gloo group of the same ranks is the reference: wherever it
succeeds, the protected default group must succeed with the same bytes, and its outputs stay
inference tensors. Where plain torch fails (torch 2.13 finishes AVG, ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` on gloo with in-place updates in Python, so those called outside
inference mode raise), distcompat may do better; the test names those cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as tdist

import distcompat.distributed as dc
from distcompat.testing import run_on_ranks
from shm_cases import configured

R = tdist.ReduceOp
SIZES = (6, 700)
WHERE = ("inside", "outside")
ROUTES = ("on", "off")


def _made(rank: int, n: int) -> torch.Tensor:
    """Rank's values: small integers as floats, so every sum is exact in any order."""
    return (torch.arange(n, dtype=torch.float32) % 17) * (rank + 1) - rank


def _all_reduce(op: Any) -> Callable[..., Any]:
    def run(rank: int, world: int, n: int, group: Any) -> Any:
        t = yield _made(rank, n)
        tdist.all_reduce(t, op=op, group=group)
        return [t]

    return run


def _bool_sum(rank: int, world: int, n: int, group: Any) -> Any:
    t = yield (_made(rank, n) > 3)
    tdist.all_reduce(t, group=group)
    return [t]


def _async(rank: int, world: int, n: int, group: Any) -> Any:
    t = yield _made(rank, n)
    tdist.all_reduce(t, group=group, async_op=True).wait()
    return [t]


def _reduce_scatter(op: Any) -> Callable[..., Any]:
    def run(rank: int, world: int, n: int, group: Any) -> Any:
        inp, out = yield _made(rank, n * world), torch.zeros(n)
        tdist.reduce_scatter_tensor(out, inp, op=op, group=group)
        return [out]

    return run


def _broadcast(rank: int, world: int, n: int, group: Any) -> Any:
    t = yield _made(rank, n)
    tdist.broadcast(t, src=0, group=group)
    return [t]


def _all_gather(rank: int, world: int, n: int, group: Any) -> Any:
    t, *outs = yield _made(rank, n), *[torch.zeros(n) for _ in range(world)]
    tdist.all_gather(outs, t, group=group)
    return outs


def _all_gather_into(rank: int, world: int, n: int, group: Any) -> Any:
    t, out = yield _made(rank, n), torch.zeros(n * world)
    tdist.all_gather_into_tensor(out, t, group=group)
    return [out]


def _all_to_all(rank: int, world: int, n: int, group: Any) -> Any:
    t, out = yield _made(rank, n * world), torch.zeros(n * world)
    tdist.all_to_all_single(out, t, group=group)
    return [out]


def _reduce(rank: int, world: int, n: int, group: Any) -> Any:
    t = yield _made(rank, n)
    tdist.reduce(t, dst=0, group=group)
    return [t] if rank == 0 else []  # gloo leaves partial sums elsewhere; distcompat does not


def _gather(rank: int, world: int, n: int, group: Any) -> Any:
    t, *outs = yield _made(rank, n), *[torch.zeros(n) for _ in range(world)]
    tdist.gather(t, outs if rank == 0 else None, dst=0, group=group)
    return outs if rank == 0 else []


def _scatter(rank: int, world: int, n: int, group: Any) -> Any:
    out, *ins = yield torch.zeros(n), *[_made(r, n) for r in range(world)]
    tdist.scatter(out, ins if rank == 0 else None, src=0, group=group)
    return [out]


def _send_recv(rank: int, world: int, n: int, group: Any) -> Any:
    t = yield _made(rank, n)
    if rank == 0:
        tdist.send(t, dst=1, group=group)
    elif rank == 1:
        tdist.recv(t, src=0, group=group)
    return [t]


def _coalesced(rank: int, world: int, n: int, group: Any) -> Any:
    """distcompat's own API (torch has no public all_reduce_coalesced): its joined copy back."""
    a, b = yield _made(rank, n), _made(rank, 3).to(torch.int64)
    if group is None:
        dc.all_reduce_coalesced([a, b], op=R.SUM)
    else:  # the reference: the same sums one by one on the plain group
        tdist.all_reduce(a, group=group)
        tdist.all_reduce(b, group=group)
    return [a, b]


CASES: dict[str, Callable[..., Any]] = {
    "all_reduce-SUM": _all_reduce(R.SUM),
    "all_reduce-AVG": _all_reduce(R.AVG),
    "all_reduce-MAX": _all_reduce(R.MAX),
    "all_reduce-bool": _bool_sum,
    "all_reduce-async": _async,
    "reduce_scatter-SUM": _reduce_scatter(R.SUM),
    "reduce_scatter-AVG": _reduce_scatter(R.AVG),
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into,
    "all_to_all_single": _all_to_all,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "send_recv": _send_recv,
    "all_reduce_coalesced": _coalesced,
}


def _call(case: str, where: str, n: int, group: Any) -> tuple[str, list[bool]]:
    """Run one case; return its outputs' bytes (hex) or the error's name, and which outputs are
    still inference tensors."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    body = CASES[case](rank, world, n, group)
    with torch.inference_mode():
        made = next(body)  # every tensor of the call is made here
    try:
        if where == "inside":
            with torch.inference_mode():
                body.send(made)
        else:
            body.send(made)
    except StopIteration as done:
        outs: list[torch.Tensor] = done.value
    except RuntimeError as exc:
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", []
    data = b"".join(out.clone().contiguous().numpy().tobytes() for out in outs)
    return data.hex(), [out.is_inference() for out in outs]


def _compare_on_ranks() -> list[tuple[str, str, int, str, str, list[bool]]]:
    """Rank side: every case on both routes; (case, where, n, route, verdict, inference flags).

    The verdict is "same" (the protected group's bytes equal plain gloo's), "better" (plain
    raised, the protected group did not), or what differed.
    """
    plain = tdist.new_group(list(range(tdist.get_world_size())), backend="gloo")
    rows = []
    for route in ROUTES:
        with configured(route):
            for case in CASES:
                for n in SIZES:
                    for where in WHERE:
                        ours, flags = _call(case, where, n, None)
                        theirs, _ = _call(case, where, n, plain)
                        if ours == theirs:
                            verdict = "same"
                        elif theirs.startswith("error") and not ours.startswith("error"):
                            verdict = "better: plain " + theirs
                        else:
                            verdict = f"differs: protected {ours[:120]} plain {theirs[:120]}"
                        rows.append((case, where, n, route, verdict, flags))
    tdist.destroy_process_group(plain)
    return rows


@pytest.mark.timeout(300)
def test_inference_tensors_as_on_plain_gloo() -> None:
    """Every case gives plain gloo's bytes where plain gloo runs, and keeps inference outputs.

    The only cases where plain gloo fails are AVG, ``reduce_scatter_tensor`` and
    ``all_gather_into_tensor`` called outside inference mode (torch updates their outputs in
    place in Python, in the caller's thread), which distcompat runs: the test pins that list, so
    a change on either side shows.
    """
    results = run_on_ranks(_compare_on_ranks, world_size=2, timeout=240)
    better = set()
    for rank, rows in enumerate(results):
        for case, where, n, route, verdict, flags in rows:
            label = f"rank {rank}: {case} {where} n={n} shm={route}"
            assert verdict == "same" or verdict.startswith("better"), f"{label}: {verdict}"
            assert all(flags), f"{label}: an output is no longer an inference tensor"
            if verdict.startswith("better"):
                better.add((case, where))
    assert better == {
        ("all_reduce-AVG", "outside"),
        ("reduce_scatter-SUM", "outside"),
        ("reduce_scatter-AVG", "outside"),
        ("all_gather_into_tensor", "outside"),
    }
