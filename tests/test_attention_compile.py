"""Dispatch inside torch.compile(fullgraph=True): no graph break, no host sync (CPU, SDPA path)."""

from __future__ import annotations

import pytest
import torch

from distcompat.attention import attend, attend_with_kvcache

pytestmark = [
    pytest.mark.slow,
    # Dynamo notes that it traces through functools caches; the decision is pure, so that is safe.
    pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`"),
    # torch's own compile stack imports deprecated torch.jit helpers.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def test_attend_compiles_fullgraph_with_grad() -> None:
    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, causal=True, window=(3, 0))

    q = torch.randn(1, 4, 16, 8)
    k = torch.randn(1, 2, 16, 8, requires_grad=True)
    out = torch.compile(step, fullgraph=True)(q, k, k)
    assert torch.allclose(out, step(q, k, k), atol=1e-5)
    (grad,) = torch.autograd.grad(out.sum(), (k,))
    assert torch.isfinite(grad).all()


def test_kvcache_decode_compiles_fullgraph_without_recompiling_per_step() -> None:
    def step(
        q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        return attend_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens, causal=True)

    compiled = torch.compile(step, fullgraph=True)
    k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    lens = torch.tensor([3, 7])
    for _ in range(3):  # ragged lengths change every step; the graph does not
        q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8)
        out = compiled(q, k_cache, v_cache, k, lens)
        assert torch.allclose(out, step(q, ref_k, ref_v, k, lens), atol=1e-6)
        lens = lens + 1
    assert torch.equal(k_cache, ref_k)
