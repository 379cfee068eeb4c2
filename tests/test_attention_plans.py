"""The plan cache: keyed by everything a decision depends on, reused otherwise, never stale."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distcompat.attention import AttentionInputError, attend
from distcompat.attention._kernels import override_kernels
from distcompat.attention._plans import _plans, clear_plans, plan_of


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
    args: dict[str, Any] = {"causal": True, "window": None, "scale": None, "layout": "bhtd"}
    return plan_of(q, k, v, **{**args, **kw})


def test_same_signature_reuses_the_plan() -> None:
    clear_plans()
    q = torch.randn(2, 4, 8, 16)
    first = plan(q, q, q)
    other = torch.randn(2, 4, 8, 16)  # new tensors, same signature
    assert plan(other, other, other) is first
    assert len(_plans) == 1


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"causal": False}, "causal"),
        ({"window": (2, 0)}, "mask"),
        ({"scale": 0.5}, "scale"),
        ({"layout": "bthd"}, "bthd"),
    ],
)
def test_each_argument_is_part_of_the_key(change: dict[str, Any], expect: str) -> None:
    q = torch.randn(1, 2, 8, 16)
    base, changed = plan(q, q, q), plan(q, q, q, **change)
    assert changed is not base
    assert {
        "causal": not changed.causal,
        "mask": changed.mask is not None,
        "scale": changed.scale == 0.5,
        "bthd": changed.bthd,
    }[expect]


def test_tensor_properties_are_part_of_the_key() -> None:
    q = torch.randn(1, 4, 8, 16)
    base = plan(q, q, q)
    kv = torch.randn(1, 2, 8, 16)
    assert plan(q, kv, kv).gqa
    assert not base.gqa
    decode = plan(q[:, :, :1], q, q, window=(2, 0))
    assert decode.start == 5
    assert base.start == 0
    half = q.bfloat16()
    assert plan(half[:, :, :1], half, half).impl == "math"  # dtype (16-bit CPU decode)
    assert plan(q[:, :, :1], q, q).impl == "sdpa"
    rough = q.half().requires_grad_()
    with torch.no_grad():  # grad enabled or not decides between SDPA and exact math here
        no_grad = plan(rough, rough, rough)
    assert plan(rough, rough, rough) is not no_grad


def test_batch_size_needs_no_new_decision() -> None:
    q1, q2 = torch.randn(1, 2, 8, 16), torch.randn(3, 2, 8, 16)
    first, second = plan(q1, q1, q1, window=(2, 0)), plan(q2, q2, q2, window=(2, 0))
    assert first == second  # equal plans, and the mask is one tensor shared by both
    assert first.mask is second.mask


def test_env_override_invalidates(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 8, 16)
    assert plan(q, q, q).impl == "sdpa"
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "math")
    assert plan(q, q, q).impl == "math"
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "")
    assert plan(q, q, q).impl == "sdpa"


def test_kernel_overrides_invalidate(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 3, 8)
    assert plan(q, k, k).gqa  # this torch's SDPA takes enable_gqa
    monkeypatch.setattr("distcompat.attention._adapters.sdpa_supports_gqa", lambda: False)
    assert plan(q, k, k).gqa  # the cached plan stands until the probes change ...
    with override_kernels():  # ... which override_kernels announces
        fallback = plan(q, k, k)
    assert not fallback.gqa
    assert fallback.repeat == 2


def test_bad_input_raises_every_time_and_is_not_cached() -> None:
    clear_plans()
    q, k = torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8)
    for _ in range(2):
        with pytest.raises(AttentionInputError, match="not a multiple"):
            attend(q, k, k)
    assert len(_plans) == 0


def test_unhashable_window_still_works() -> None:
    q = torch.randn(1, 2, 6, 8)
    ref = attend(q, q, q, causal=True, window=(2, 0))
    assert torch.equal(attend(q, q, q, causal=True, window=[2, 0]), ref)  # type: ignore[arg-type]


def test_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("distcompat.attention._plans.MAX_PLANS", 4)
    clear_plans()
    for length in range(1, 10):
        q = torch.randn(1, 2, length, 8)
        attend(q, q, q, causal=True)
    assert 0 < len(_plans) <= 4
