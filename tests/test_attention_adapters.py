"""The FlashAttention adapters, driven by fake FA modules that record what they receive."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from distcompat.attention import attend, explain_attention
from distcompat.attention._adapters import fa_window, plan_call, run_plan
from distcompat.attention._contract import canonical_window, visible_mask
from distcompat.attention._kernels import (
    KernelProbe,
    override_kernels,
    sdpa_cpu_rough_backward,
    sdpa_supports_gqa,
    sdpa_zeroes_dead_rows,
)
from distcompat.attention._kvcache import attend_with_kvcache
from distcompat.attention._rules import CallSignature
from distcompat.attention._rules import infeasible as real_infeasible
from strategies_attention import loop_mask, plain_attention


class FakeFlash:
    """Behaves like FA's flash_attn_func on (B, T, H, D) tensors, using SDPA underneath."""

    def __init__(self, returns_tuple: bool) -> None:
        self.returns_tuple = returns_tuple
        self.kwargs: dict[str, Any] = {}
        self.layout: tuple[int, ...] = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        self.kwargs, self.layout = kwargs, tuple(q.shape)
        left, right = (-1 if side is None else side for side in kwargs["window_size"])
        if kwargs["causal"]:
            right = 0
        tq, tk = q.shape[1], k.shape[1]
        mask = visible_mask(
            tq, tk, *canonical_window(causal=False, window=(left, right), tq=tq, tk=tk), q.device
        )
        groups = q.shape[2] // k.shape[2]  # FA takes GQA as is; older SDPA has no enable_gqa
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        ).transpose(1, 2)
        return (out, None) if self.returns_tuple else out


def sig_for(q: torch.Tensor, k: torch.Tensor, window: tuple[int, int]) -> CallSignature:
    return CallSignature(
        device_type="cuda",
        device_index=0,
        capability=(9, 0),
        rocm=False,
        dtype=q.dtype,
        hq=q.shape[1],
        hkv=k.shape[1],
        tq=q.shape[2],
        tk=k.shape[2],
        d_qk=q.shape[3],
        d_v=q.shape[3],
        window=canonical_window(causal=True, window=window, tq=q.shape[2], tk=k.shape[2]),
        requires_grad=False,
    )


@pytest.mark.parametrize(("name", "returns_tuple"), [("fa2", False), ("fa3", True), ("fa4", True)])
@pytest.mark.parametrize("window", [(-1, -1), (3, 0)])
def test_flash_adapter_layout_window_and_result(
    name: str, returns_tuple: bool, window: tuple[int, int]
) -> None:
    fake = FakeFlash(returns_tuple)
    probe = KernelProbe(name=name, functions={"flash_attn_func": fake}, reason="fake")
    q = torch.randn(2, 4, 9, 8)  # (B, H, T, D)
    k = v = torch.randn(2, 2, 9, 8)
    sig = sig_for(q, k, window)
    with override_kernels(probes={name: probe}):
        out = run_plan(plan_call(name, sig, 0.5, bthd=False), q, k, v)
    assert fake.layout == (2, 9, 4, 8)  # FA got (B, T, H, D)
    assert fake.kwargs["causal"] is True
    assert fake.kwargs["softmax_scale"] == 0.5
    unbounded = None if name == "fa4" else -1
    expected = (unbounded, unbounded) if window[0] == -1 else (3, 0)
    assert fake.kwargs["window_size"] == expected
    mask = visible_mask(9, 9, *sig.window, q.device)
    kx, vx = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA: 4 q heads, 2 kv
    ref = F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask)
    assert out.shape == (2, 4, 9, 8)
    assert torch.allclose(out, ref, atol=1e-6)


def test_fa_window_non_causal() -> None:
    q = torch.zeros(1, 1, 8, 8)
    sig = dataclasses.replace(sig_for(q, q, (-1, -1)), window=(2, 3))
    assert fa_window("fa2", sig) == (False, (2, 3))


def test_kvcache_uses_fa_kvcache_when_dispatched(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def fake_kvcache(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, **kw: Any
    ) -> Any:
        calls.append(kw)
        return torch.zeros_like(q)

    probe = KernelProbe(
        name="fa2",
        functions={"flash_attn_func": fake_kvcache, "flash_attn_with_kvcache": fake_kvcache},
        reason="fake",
    )
    # Pretend CPU tensors sit on an sm80 GPU: route the device rule through a fake signature.

    def cpu_as_cuda(name: str, sig: CallSignature, host: Any) -> str | None:
        if name == "fa2":
            return None
        return real_infeasible(name, sig, host)

    monkeypatch.setattr("distcompat.attention._dispatch.infeasible", cpu_as_cuda)
    q = torch.randn(2, 1, 4, 8, dtype=torch.bfloat16)
    cache = torch.zeros(2, 6, 2, 8, dtype=torch.bfloat16)
    with override_kernels(probes={"fa2": probe}):
        out = attend_with_kvcache(
            q, cache, cache.clone(), cache_seqlens=torch.tensor([2, 5]), causal=True, window=(3, 0)
        )
    assert out.shape == q.shape
    assert calls[0]["cache_seqlens"].dtype == torch.int32
    assert calls[0]["window_size"] == (3, 0)
    assert calls[0]["causal"] is True


def test_sdpa_fallbacks_match_this_torch_and_are_explained() -> None:
    # Causal, Tq > Tk (two fully masked rows), GQA, float16 with grad on CPU: every fallback.
    q = torch.randn(1, 4, 5, 8, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 2, 3, 8, dtype=torch.float16)
    rough = torch.float16 in sdpa_cpu_rough_backward()
    reason = explain_attention(q, k, k, causal=True).reason
    assert ("rounds 16-bit gradients" in reason) == rough
    with torch.no_grad():  # without grad SDPA itself runs, whatever its backward
        reason = explain_attention(q, k, k, causal=True).reason
    assert ("repeat_interleave" in reason) == (not sdpa_supports_gqa())
    assert ("fully masked rows" in reason) == (not sdpa_zeroes_dead_rows())


@pytest.mark.parametrize("rough", [False, True])
def test_sdpa_fallbacks_are_exact(rough: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The paths a torch without enable_gqa, zeroed dead rows or a fine 16-bit CPU backward
    # takes, run on any torch (float32 stands in for the 16-bit dtype of the rough backward).
    monkeypatch.setattr("distcompat.attention._adapters.sdpa_supports_gqa", lambda: False)
    monkeypatch.setattr("distcompat.attention._adapters.sdpa_zeroes_dead_rows", lambda: False)
    monkeypatch.setattr(
        "distcompat.attention._adapters.sdpa_cpu_rough_backward",
        lambda: (torch.float32,) if rough else (),
    )
    q = torch.randn(1, 4, 5, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 3, 8).requires_grad_() for _ in range(2))
    with override_kernels():  # a new state token: decisions made before are not reused
        reason = explain_attention(q, k, v, causal=True).reason
        out = attend(q, k, v, causal=True)
    if rough:
        assert "rounds 16-bit gradients" in reason
    else:
        assert "repeat_interleave" in reason
        assert "fully masked rows see every key" in reason
    ref = plain_attention(q, k, v, loop_mask(5, 3, True, None))
    assert torch.allclose(out, ref, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    refs = torch.autograd.grad(ref.sum(), (q, k, v))
    for grad, expected in zip(grads, refs, strict=True):
        assert torch.isfinite(grad).all()
        assert torch.allclose(grad, expected, atol=1e-5)
    assert torch.equal(grads[0][:, :, :2], torch.zeros(1, 4, 2, 8))
