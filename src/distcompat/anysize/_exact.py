"""Exact mode: gradients summed as fixed-point integers, the same bits at any world size.

The lines a hand-written loop writes (every rank, ``share = plan.share()``)::

    exact = ExactGradients(model, micro_batches=plan.micro_batches)
    for step in ...:
        while True:                          # a step is redone when a gradient outgrew its bound
            for micro in share.micro_batches:
                with counter_rng(plan.seed, plan.step, micro):
                    loss = model(*batch_of(micro))
                exact.add_loss(loss)
                loss.backward()              # a hook moves each gradient into int64 at once
            if exact.reduce().ok:            # one int64 all-reduce; .grad holds the mean
                break
        optimizer.step(); optimizer.zero_grad(); plan.advance()

With DDP nothing else changes but one line: ``ddp.register_comm_hook(None, exact.ddp_comm_hook)``;
run the micro-batches but the last under ``ddp.no_sync()`` as usual, and call
``exact.reduce()`` after the last backward (it does no communication then, it reports).

How: a post-accumulate-grad hook turns each micro-batch's gradient into int64 at a power of two
per tensor (``_fixed``) and adds it to an accumulator, then zeroes ``.grad``; so no float sum of
micro-batches ever happens, on any rank. ``reduce`` all-reduces the integers (SUM: associative,
so the same bits in any order and split) and the per-tensor maxima of ``|grad|`` (MAX: exact),
then divides once by the global constant (``micro_batches`` unless ``divisor`` says otherwise).
The power of two comes from the previous step's global maximum with ``headroom_bits`` to spare:
a value the same at every world size. When a maximum exceeds its bound, every rank sees it (the
MAX is exact), the step reports ``ok=False``, the bound is raised to fit, and the redone step
fits. Nothing is ever summed wrong. A non-finite gradient raises :class:`NonFiniteGradientError`
on every rank. The bounds are state: save :meth:`ExactGradients.state_dict` with the checkpoint.

The bits equal only where every micro-batch's forward and backward give the same bits: the same
device type, torch build, BLAS and thread count (``torch.set_num_threads``). Parameters must be
replicated (plain or DDP); FSDP2's sharded parameters are refused (:class:`ExactModeError`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distcompat.anysize._fixed import LOSS_EXPONENT, MIN_BOUND, dequantize, exponent, quantize
from distcompat.collectives import all_reduce
from distcompat.collectives._group import group_size

__all__ = ["ExactGradients", "ExactModeError", "ExactStep", "NonFiniteGradientError"]

#: The key and version of :meth:`ExactGradients.state_dict`.
EXACT_FORMAT = "distcompat.exact/1"


class ExactModeError(TypeError):
    """Exact mode was asked for parameters it cannot sum exactly (sharded, or complex)."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds inf or NaN on some rank: no exact sum exists; every rank raises it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactStep:
    """What :meth:`ExactGradients.reduce` found.

    ``ok`` False means a gradient outgrew its bound: ``.grad`` holds nothing usable, the bounds
    were raised, and the step's micro-batches must run again. ``loss`` is the mean of the losses
    given to :meth:`~ExactGradients.add_loss` (None when none was), ``overflowed`` the names of the
    tensors that outgrew their bounds.
    """

    ok: bool
    loss: float | None
    overflowed: tuple[str, ...] = ()


def _named(params: nn.Module | Iterable[nn.Parameter]) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.Module):
        return [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    return [(f"param{i}", p) for i, p in enumerate(params) if p.requires_grad]


def _refuse(name: str, param: nn.Parameter) -> None:
    if any(cls.__name__ == "DTensor" for cls in type(param).__mro__):
        raise ExactModeError(
            f"{name} is a DTensor (FSDP2 or tensor parallel): exact mode sums replicated "
            "gradients (plain or DDP models); FSDP2's reduce-scatter runs in float"
        )
    if param.is_complex():
        raise ExactModeError(f"{name} is complex ({param.dtype}): exact mode sums real gradients")


class ExactGradients:
    """Sum every rank's micro-batch gradients as integers; the mean has the same bits at any size.

    Args:
        params: a module (names in messages) or its parameters; replicated on every rank.
        micro_batches: global micro-batches per step (``TrainPlan.micro_batches``): the number
            of terms, the same at every world size.
        divisor: what the summed gradient is divided by (default ``micro_batches``: the mean of
            per-micro-batch mean losses).
        group: the process group (None: the default group; no group: a world of one).
        headroom_bits: how far (in powers of two) a gradient may grow over the previous step's
            largest before a step is redone.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> exact = ExactGradients(model, micro_batches=2)
        >>> for x in (torch.ones(1, 3), 2 * torch.ones(1, 3)):
        ...     loss = model(x).sum(); exact.add_loss(loss); loss.backward()
        >>> step = exact.reduce()
        >>> step.ok, model.weight.grad.tolist()
        (True, [[1.5, 1.5, 1.5]])
        >>> exact.close()
    """

    def __init__(
        self,
        params: nn.Module | Iterable[nn.Parameter],
        *,
        micro_batches: int,
        divisor: float | None = None,
        group: Any = None,
        headroom_bits: int = 16,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} must be at least 1")
        if not 0 <= headroom_bits <= 40:
            raise ValueError(f"headroom_bits={headroom_bits} must be in [0, 40]")
        named = _named(params)
        if not named:
            raise ValueError("ExactGradients got no parameter that requires grad")
        for name, param in named:
            _refuse(name, param)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.micro_batches = micro_batches
        self.divisor = float(micro_batches if divisor is None else divisor)
        self._group = group
        self._headroom = headroom_bits
        device = self._params[0].device
        self._accs = [
            torch.zeros(p.numel(), dtype=torch.int64, device=p.device) for p in self._params
        ]
        self._maxes = torch.zeros(len(self._params), dtype=torch.float64, device=device)
        self._loss = torch.zeros(1, dtype=torch.int64, device=device)
        self._losses = 0
        self._bounds = [math.ldexp(1.0, headroom_bits)] * len(self._params)
        self._exponents = [exponent(b, micro_batches) for b in self._bounds]
        self._reduced: torch.Tensor | None = None  # global maxima, when the DDP hook reduced
        self._ddp_loss: float | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._drain)  # type: ignore[no-untyped-call]
            for p in self._params
        ]

    def _drain(self, param: torch.Tensor) -> None:
        """Move one micro-batch's gradient of ``param`` into its integer accumulator."""
        grad = param.grad
        if grad is None:
            return
        i = self._index[id(param)]
        with torch.no_grad():
            self._accs[i].add_(quantize(grad.reshape(-1), self._exponents[i]))
            low, high = torch.aminmax(grad.detach())  # no |grad| temporary; NaN propagates
            largest = torch.maximum(high, -low).to(torch.float64)
            self._maxes[i] = torch.maximum(self._maxes[i], largest)
            grad.zero_()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Count one micro-batch's loss into the step's exact mean (call it once per micro-batch).

        Example:
            >>> exact = ExactGradients(torch.nn.Linear(1, 1), micro_batches=1)
            >>> exact.add_loss(torch.tensor(2.5)); exact.reduce().loss
            2.5
        """
        self._loss.add_(quantize(loss.detach().reshape(1), LOSS_EXPONENT))
        self._losses += 1

    def reduce(self) -> ExactStep:
        """All-reduce the step's integers; write the mean into each ``.grad``; every rank calls it.

        After a DDP backward whose comm hook was :meth:`ddp_comm_hook`, the gradients are
        already reduced and this only reports. Raises :class:`NonFiniteGradientError` (on every
        rank) when a gradient held inf or NaN.
        """
        if self._reduced is not None:
            maxes, loss = self._reduced, self._ddp_loss
        else:
            maxes = self._maxes.clone()
            flat = torch.cat([*self._accs, self._loss])
            if group_size(self._group) > 1:
                pending = all_reduce(maxes, dist.ReduceOp.MAX, self._group, async_op=True)
                all_reduce(flat, dist.ReduceOp.SUM, self._group)
                pending.wait()
            loss = self._loss_mean(flat[-1:])
            everything = range(len(self._params))
            if self._fits(everything, maxes):
                for i, mean in self._means(everything, flat):
                    param = self._params[i]
                    param.grad = mean.to(param.dtype).view_as(param)
        return self._conclude(maxes, loss)

    def ddp_comm_hook(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """Reduce a DDP bucket as integers: the bucket's parameters' exact mean gradient.

        Register it with ``ddp.register_comm_hook(None, exact.ddp_comm_hook)``; run the
        micro-batches but the last under ``ddp.no_sync()``; call :meth:`reduce` after the last
        backward. The bucket's own float contents (zeros: the hook drained them) are not used.
        """
        del state  # the group is the one given to ExactGradients
        params = bucket.parameters()
        # The sums go in parameter order, not the bucket's: ranks whose DDP rebuilt its buckets
        # at different times (a newcomer that joined in place) may hold the same parameters in
        # another order, and one all-reduce must pair the same integers everywhere.
        laid = [self._index[id(p)] for p in params]  # the bucket buffer's order
        idx = sorted(laid)
        last = bool(bucket.is_last())
        flat = torch.cat([self._accs[i] for i in idx] + ([self._loss] if last else []))
        maxes = self._maxes[idx]
        if group_size(self._group) > 1:
            all_reduce(maxes, dist.ReduceOp.MAX, self._group)
            work = all_reduce(flat, dist.ReduceOp.SUM, self._group, async_op=True)
            future: torch.futures.Future[Any] = work.get_future()
        else:
            future = torch.futures.Future()
            future.set_result([flat])
        buffer: torch.Tensor = bucket.buffer()

        def settle(_done: torch.futures.Future[Any]) -> torch.Tensor:
            if self._reduced is None:
                self._reduced = torch.zeros_like(self._maxes)
            self._reduced[idx] = maxes
            if last:
                self._ddp_loss = self._loss_mean(flat[-1:])
            if not self._fits(idx, maxes):
                return buffer.zero_()  # the step is redone; reduce() says so
            starts, offset = {}, 0
            for i in laid:
                starts[i] = offset
                offset += self._accs[i].numel()
            for i, mean in self._means(idx, flat):
                buffer[starts[i] : starts[i] + mean.numel()].copy_(mean)
            return buffer

        return future.then(settle)

    def _loss_mean(self, total: torch.Tensor) -> float | None:
        if not self._losses:
            return None
        return float(
            dequantize(total, LOSS_EXPONENT, divisor=self.micro_batches, dtype=torch.float64)
        )

    def _fits(self, idx: Sequence[int], maxes: torch.Tensor) -> bool:
        """Whether every tensor ``idx[k]`` stayed within its bound (``maxes[k]``, all-reduced)."""
        return all(m <= self._bounds[i] for i, m in zip(idx, maxes.tolist(), strict=True))

    def _means(self, idx: Sequence[int], flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Each tensor's mean (float64, flat) from its summed integers, laid out in ``flat``."""
        offset = 0
        for i in idx:
            size = self._accs[i].numel()
            total = flat[offset : offset + size]
            offset += size
            yield (
                i,
                dequantize(total, self._exponents[i], divisor=self.divisor, dtype=torch.float64),
            )

    def _conclude(self, maxes: torch.Tensor, loss: float | None) -> ExactStep:
        """Check the global maxima, set the next step's bounds, clear the accumulators."""
        largest = maxes.tolist()
        bad = [n for n, m in zip(self._names, largest, strict=True) if not math.isfinite(m)]
        self._reset()
        if bad:
            raise NonFiniteGradientError(
                f"non-finite gradient (inf or NaN) in {', '.join(bad[:5])}"
                f"{f' and {len(bad) - 5} more' if len(bad) > 5 else ''}: no exact sum exists "
                "(every rank raises this; the step's gradients were dropped)"
            )
        over = tuple(n for n, m, b in zip(self._names, largest, self._bounds, strict=True) if m > b)
        # A tensor with no gradient this step (max 0, e.g. behind a zero-initialised layer)
        # keeps its bound: shrinking it to the floor would make its first real step a redo.
        self._bounds = [
            max(m, MIN_BOUND) * math.ldexp(1.0, self._headroom) if m > 0 else b
            for m, b in zip(largest, self._bounds, strict=True)
        ]
        self._exponents = [exponent(b, self.micro_batches) for b in self._bounds]
        return ExactStep(ok=not over, loss=loss, overflowed=over)

    def abandon(self) -> None:
        """Drop the step in progress (its partial sums): the step is redone from its start.

        ``distcompat.inplace`` calls it when a lost rank ends a step midway.

        Example:
            >>> exact = ExactGradients(torch.nn.Linear(1, 1), micro_batches=1)
            >>> exact.add_loss(torch.tensor(2.0)); exact.abandon(); exact.reduce().loss is None
            True
        """
        self._reset()

    def _reset(self) -> None:
        for acc in self._accs:
            acc.zero_()
        self._maxes.zero_()
        self._loss.zero_()
        self._losses = 0
        self._reduced, self._ddp_loss = None, None

    def state_dict(self) -> dict[str, Any]:
        """Return the next step's bounds (the same on every rank): save them with the checkpoint.

        Example:
            >>> exact = ExactGradients(torch.nn.Linear(1, 1), micro_batches=4)
            >>> sorted(exact.state_dict())
            ['bounds', 'format', 'micro_batches', 'names']
        """
        return {
            "format": EXACT_FORMAT,
            "micro_batches": self.micro_batches,
            "names": list(self._names),
            "bounds": list(self._bounds),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue with saved bounds (from any world size); the tensors must match by name.

        Example:
            >>> exact = ExactGradients(torch.nn.Linear(1, 1), micro_batches=4)
            >>> exact.load_state_dict(exact.state_dict())
        """
        if state.get("format") != EXACT_FORMAT:
            raise ValueError(f"not a saved ExactGradients state (format {state.get('format')!r})")
        if list(state["names"]) != self._names or state["micro_batches"] != self.micro_batches:
            raise ValueError(
                "saved exact-mode state is for other tensors or another number of micro-batches "
                f"({len(state['names'])} tensors, {state['micro_batches']} micro-batches; now "
                f"{len(self._names)}, {self.micro_batches})"
            )
        self._bounds = [float(b) for b in state["bounds"]]
        self._exponents = [exponent(b, self.micro_batches) for b in self._bounds]

    def close(self) -> None:
        """Remove the gradient hooks (the model trains without exact mode again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


# DDP checks a hook's annotations against the classes themselves; this module's annotations are
# strings (``from __future__ import annotations``), so the hook carries the real ones.
ExactGradients.ddp_comm_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "state": object, "return": torch.futures.Future[torch.Tensor]}
)
