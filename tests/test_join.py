"""join_uneven and all_have_data on real gloo groups of 2-4 ranks with uneven batch counts.

Each rank function trains a tiny model on its own number of batches and returns a digest of its
parameter (and buffer) bytes; equal digests on every rank mean the replicas are identical. The
per-call ``timeout`` turns a hang into a failure naming the stuck ranks.
"""

from __future__ import annotations

import ctypes
import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

import distcompat.distributed as dist
from distcompat.join import all_have_data, join_uneven
from distcompat.testing import run_on_ranks

TIMEOUT_S = 60.0
SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=[2, 3, 4])
def world_size(request: pytest.FixtureRequest) -> int:
    """World sizes 2-4; module scope makes pytest run all tests of one size together (warm pool)."""
    size: int = request.param
    return size


def _counts(world_size: int) -> st.SearchStrategy[list[int]]:
    """Per-rank batch counts, some ranks possibly with none."""
    return st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size)


def _digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of the tensors' bytes (no NumPy needed)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial replica on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )


def _batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    return [torch.randn(3, 4, generator=gen) for _ in range(count)]


class GradNormSGD(torch.optim.SGD):
    """SGD with an extra collective in step(): the global gradient norm (probe 8 in the issue)."""

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        norm = torch.zeros(1)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    norm += p.grad.pow(2).sum()
        dist.all_reduce(norm)
        super().step()


def _ddp_rank(counts: list[int], optimizer_kind: str) -> tuple[str, str]:
    ddp = DistributedDataParallel(_model())
    opt: torch.optim.Optimizer
    if optimizer_kind == "adam":
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    else:
        opt = GradNormSGD(ddp.parameters(), lr=0.01, momentum=0.9)
    with join_uneven(ddp, opt):
        for x in _batches(counts[dist.get_rank()]):
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return _digest(*ddp.module.state_dict().values()), _digest(*state)


@pytest.mark.parametrize("optimizer_kind", ["adam", "gradnorm_sgd"])
@SETTINGS
@given(data=st.data())
def test_ddp_uneven_inputs_finish_with_equal_replicas(
    world_size: int, optimizer_kind: str, data: st.DataObject
) -> None:
    counts = data.draw(_counts(world_size))
    out = run_on_ranks(_ddp_rank, world_size, args=(counts, optimizer_kind), timeout=TIMEOUT_S)
    assert len(set(out)) == 1, f"replicas differ after counts={counts}: {out}"


def _accumulating_rank(counts: list[int]) -> str:
    ddp = DistributedDataParallel(_model())
    opt = GradNormSGD(ddp.parameters(), lr=0.01, momentum=0.9)
    with join_uneven(ddp, opt):
        batches = _batches(2 * counts[dist.get_rank()])
        for first, second in zip(batches[::2], batches[1::2], strict=True):
            with ddp.no_sync():  # accumulate: a forward with no step, then one that syncs
                ddp(first).square().mean().backward()
            ddp(second).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return _digest(*ddp.module.state_dict().values())


def test_ddp_gradient_accumulation_with_an_optimizer_collective(world_size: int) -> None:
    """A joined rank shadows the step only after forwards that sync (no_sync ones take none)."""
    counts = [1, 3, 2, 0][:world_size]
    out = run_on_ranks(_accumulating_rank, world_size, args=(counts,), timeout=TIMEOUT_S)
    assert len(set(out)) == 1


def _torch_zero_rank(counts: list[int]) -> str:
    import warnings

    with warnings.catch_warnings():  # torch 2.13: importing it warns that torch.jit is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = DistributedDataParallel(_model())
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    with join_uneven(ddp, opt):
        for x in _batches(counts[dist.get_rank()]):
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return _digest(*ddp.module.state_dict().values())


def test_a_joinable_optimizer_is_used_as_it_is(world_size: int) -> None:
    """torch's ZeroRedundancyOptimizer brings its own Join hook; it works inside join_uneven."""
    counts = [1, 3, 2, 0][:world_size]
    out = run_on_ranks(_torch_zero_rank, world_size, args=(counts,), timeout=TIMEOUT_S)
    assert len(set(out)) == 1


class ZeroAdam(torch.optim.Optimizer):
    """A ZeRO-style optimizer: each rank owns one shard of the flat parameters and its Adam state.

    step(): async reduce_scatter_tensor AVG of the flat gradients, Adam on the local shard, async
    all_gather_into_tensor of the updated shards back into every rank's parameters.
    """

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.flat = [p for g in self.param_groups for p in g["params"]]
        world = dist.get_world_size()
        total = sum(p.numel() for p in self.flat)
        self.shard = -(-total // world)  # ceil
        self.padded = self.shard * world
        self.m = torch.zeros(self.shard)
        self.v = torch.zeros(self.shard)
        self.t = 0

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded)
        flat[: sum(t.numel() for t in tensors)] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.flat]
        grad_shard = torch.empty(self.shard)
        work = dist.reduce_scatter_tensor(
            grad_shard, self._flatten(grads), op=dist.ReduceOp.AVG, async_op=True
        )
        work.get_future().wait()
        rank = dist.get_rank()
        mine = self._flatten(list(self.flat))[rank * self.shard : (rank + 1) * self.shard]
        self.t += 1
        self.m.mul_(0.9).add_(grad_shard, alpha=0.1)
        self.v.mul_(0.999).addcmul_(grad_shard, grad_shard, value=0.001)
        m_hat, v_hat = self.m / (1 - 0.9**self.t), self.v / (1 - 0.999**self.t)
        mine -= self.param_groups[0]["lr"] * m_hat / (v_hat.sqrt() + 1e-8)
        gathered = torch.empty(self.padded)
        dist.all_gather_into_tensor(gathered, mine, async_op=True).wait()
        offset = 0
        for p in self.flat:
            p.copy_(gathered[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _zero_rank(counts: list[int]) -> str:
    model = _model()
    opt = ZeroAdam(list(model.parameters()), lr=0.01)
    with join_uneven(model, opt):
        for x in _batches(counts[dist.get_rank()]):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return _digest(*model.state_dict().values())


@SETTINGS
@given(data=st.data())
def test_zero_style_optimizer_uneven_inputs_finish_with_equal_replicas(
    world_size: int, data: st.DataObject
) -> None:
    counts = data.draw(_counts(world_size))
    out = run_on_ranks(_zero_rank, world_size, args=(counts,), timeout=TIMEOUT_S)
    assert len(set(out)) == 1, f"replicas differ after counts={counts}: {out}"


class LinearModel(torch.nn.Module):
    """loss = <w, c>: the gradient is ``c`` whatever ``w`` is, so the final w can be predicted."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


class AvgSGD(torch.optim.Optimizer):
    """Plain SGD on gradients averaged (AVG all_reduce) over the group."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                grad = p.grad.clone()
                dist.all_reduce(grad, op=dist.ReduceOp.AVG)
                p.add_(grad, alpha=-g["lr"])


def _averaging_rank(counts: list[int], divide_by_initial: bool, reducer: str) -> list[float]:
    local = LinearModel()
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    if reducer == "ddp":
        model = DistributedDataParallel(local)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
    else:
        model = local
        opt = AvgSGD(list(model.parameters()), lr=1.0)
    c = torch.full((4,), float(dist.get_rank() + 1))
    with join_uneven(model, opt, divide_by_initial_world_size=divide_by_initial):
        for _ in range(counts[dist.get_rank()]):
            torch.autograd.backward(model(c))
            opt.step()
            opt.zero_grad()
    return local.w.tolist()


@pytest.mark.parametrize("divide_by_initial", [True, False])
@pytest.mark.parametrize("reducer", ["ddp", "optimizer"])
def test_averaging_while_ranks_are_joined(
    world_size: int, divide_by_initial: bool, reducer: str
) -> None:
    """A step that only A of W ranks take averages over W (the default) or over A."""
    counts = [1, 3, 2, 0][:world_size]
    expected = 0.0
    for step in range(max(counts)):
        active = [r for r in range(world_size) if counts[r] > step]
        total = sum(r + 1 for r in active)
        expected -= total / (world_size if divide_by_initial else len(active))
    out = run_on_ranks(
        _averaging_rank, world_size, args=(counts, divide_by_initial, reducer), timeout=TIMEOUT_S
    )
    for w in out:
        assert w == pytest.approx([expected] * 4)


def _agree_rank(counts: list[int]) -> tuple[int, list[bool]]:
    batches = iter(range(counts[dist.get_rank()]))
    answers: list[bool] = []
    steps = 0
    while True:
        answer = all_have_data(next(batches, None) is not None)
        answers.append(answer)
        if not answer:
            break
        steps += 1
    return steps, answers


@SETTINGS
@given(data=st.data())
def test_all_have_data_stops_every_rank_at_the_shortest(
    world_size: int, data: st.DataObject
) -> None:
    counts = data.draw(_counts(world_size))
    out = run_on_ranks(_agree_rank, world_size, args=(counts,), timeout=TIMEOUT_S)
    assert all(steps == min(counts) for steps, _ in out)
    assert len({tuple(answers) for _, answers in out}) == 1


def test_single_process_is_a_plain_block() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with join_uneven(model, opt):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert all_have_data(True) is True
    assert all_have_data(False) is False


def test_nothing_to_shadow_is_refused() -> None:
    with (
        pytest.raises(ValueError, match="nothing issues collectives"),
        join_uneven(torch.nn.Linear(2, 1)),
    ):
        pass


def test_optimizer_without_step_hooks_is_refused() -> None:
    class Handmade:
        def step(self) -> None:
            pass

    with (
        pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"),
        join_uneven(
            torch.nn.Linear(2, 1),
            Handmade(),  # type: ignore[arg-type]
        ),
    ):
        pass
