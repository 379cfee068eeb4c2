"""Every CPU implementation against a float64 reference, outputs and gradients.

Criterion (FlashAttention's, calibrated in research/attention.md section 9):
``err(impl) <= rtol * err(plain low precision) + atol`` with rtol 2 for outputs and 4 for
gradients, and an atol at the dtype's granularity; errors are max-abs against float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distcompat.attention import attend, explain_attention
from distcompat.attention._kernels import probe_kernel
from strategies_attention import Case, cases, loop_mask, make_inputs, plain_attention

LOW = (torch.float32, torch.bfloat16, torch.float16)
#: Smallest atol per dtype (outputs, gradients); 16-bit ones scale with the values' magnitude.
FLOOR = {
    torch.float32: (1e-6, 5e-6),
    torch.bfloat16: (0.0, 0.0),
    torch.float16: (0.0, 0.0),
}


def granularity(dtype: torch.dtype, ref: torch.Tensor, floor: float) -> float:
    """About an ulp at the reference's largest magnitude (FA3's atol idea), at least ``floor``."""
    peak = float(ref.abs().max()) if ref.numel() else 0.0
    return max(torch.finfo(dtype).eps * max(peak, 1.0), floor)


def run_case(impl: str, case: Case, seed: int, *, grad: bool, layout: str = "bhtd") -> None:
    q64, k64, v64 = make_inputs(case, seed, grad=grad)
    mask = loop_mask(case.tq, case.tk, case.causal, case.window)
    ref = plain_attention(q64, k64, v64, mask)
    low = [t.detach().to(case.dtype).requires_grad_(grad) for t in (q64, k64, v64)]
    plain = plain_attention(low[0], low[1], low[2], mask)
    ours_in = [t.detach().to(case.dtype).requires_grad_(grad) for t in (q64, k64, v64)]
    if layout == "bthd":
        args = [t.transpose(1, 2) for t in ours_in]
        out = attend(*args, causal=case.causal, window=case.window, layout="bthd").transpose(1, 2)
    else:
        out = attend(*ours_in, causal=case.causal, window=case.window)
    assert out.dtype == case.dtype  # no silent cast
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    out_floor, grad_floor = FLOOR[case.dtype]

    def check(
        ours: torch.Tensor, naive: torch.Tensor, exact: torch.Tensor, rtol: float, floor: float
    ) -> None:
        err = (ours.double() - exact).abs().max().item()
        base = (naive.double() - exact).abs().max().item()
        bound = rtol * base + granularity(case.dtype, exact, floor)
        assert err <= bound, f"{impl} {case}: err {err:.3g} > {rtol} x {base:.3g} + atol"

    check(out, plain, ref.detach(), 2.0, out_floor)
    if not grad:
        return
    dout = torch.randn(
        ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    exact = torch.autograd.grad(ref, (q64, k64, v64), dout)
    naive = torch.autograd.grad(plain, low, dout.to(case.dtype))
    ours = torch.autograd.grad(out, ours_in, dout.to(case.dtype))
    for o, n, e in zip(ours, naive, exact, strict=True):
        assert torch.isfinite(o).all()
        check(o, n, e, 4.0, grad_floor)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@settings(max_examples=40, deadline=None)
@given(case=cases(dtypes=LOW), seed=st.integers(0, 2**16))
def test_parity_with_gradients(impl: str, case: Case, seed: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTCOMPAT_ATTENTION", impl)
        run_case(impl, case, seed, grad=True)


@settings(max_examples=40, deadline=None)
@given(case=cases(dtypes=LOW), seed=st.integers(0, 2**16))
def test_auto_dispatch_parity_bthd(case: Case, seed: int) -> None:
    run_case("auto", case, seed, grad=True, layout="bthd")


FLEX_CASES = [
    Case(
        batch=1,
        hkv=2,
        groups=2,
        tq=20,
        tk=20,
        d=16,
        causal=True,
        window=(5, 0),
        dtype=torch.float32,
    ),
    Case(
        batch=2, hkv=1, groups=4, tq=6, tk=17, d=8, causal=True, window=None, dtype=torch.bfloat16
    ),
    Case(
        batch=1, hkv=2, groups=1, tq=1, tk=9, d=32, causal=False, window=(3, 2), dtype=torch.float16
    ),
    Case(batch=1, hkv=1, groups=1, tq=8, tk=3, d=8, causal=True, window=None, dtype=torch.float32),
]


@pytest.mark.skipif(
    not probe_kernel("flex").available,
    reason="this torch has no torch.nn.attention.flex_attention",
)
@pytest.mark.parametrize("case", FLEX_CASES, ids=lambda c: f"{c.tq}x{c.tk}-{c.dtype}")
def test_flex_forward_parity(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    # flex has no backward on CPU, so it is only ever chosen for grad-free calls there.
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "flex")
    with torch.no_grad():
        run_case("flex", case, seed=7, grad=False)


def test_fully_masked_rows_give_zero_output_and_gradients() -> None:
    # Causal with Tq > Tk: the first Tq - Tk queries precede every key.
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k = torch.randn(1, 2, 2, 8, requires_grad=True)
    v = torch.randn(1, 2, 2, 8, requires_grad=True)
    out = attend(q, k, v, causal=True)
    assert torch.equal(out[:, :, :3], torch.zeros(1, 2, 3, 8))
    (grad,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:, :, :3], torch.zeros(1, 2, 3, 8))


def test_float64_runs_and_matches_reference() -> None:
    q, k, v = (torch.randn(2, 4, 7, 16, dtype=torch.float64) for _ in range(3))
    out = attend(q, k, v, causal=True, window=(2, 0))
    ref = plain_attention(q, k, v, loop_mask(7, 7, True, (2, 0)))
    assert out.dtype == torch.float64
    assert (out - ref).abs().max() < 1e-12


def test_scale_is_honoured() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    mask = loop_mask(4, 4, False, None)
    out = attend(q, k, v, scale=0.3)
    assert (out - plain_attention(q, k, v, mask, scale=0.3)).abs().max() < 1e-12


def test_causal_prefers_is_causal_and_windows_use_the_mask() -> None:
    q = torch.randn(1, 2, 6, 8)
    assert "is_causal=True" in explain_attention(q, q, q, causal=True).reason
    assert "bool mask" in explain_attention(q, q, q, causal=True, window=(2, 0)).reason
    decode = explain_attention(q[:, :, :1], q, q, causal=True, window=(2, 0))
    assert "last left+1 keys" in decode.reason
