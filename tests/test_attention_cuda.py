"""GPU parity: whatever dispatch picks on this GPU, and each installed FA kernel, vs float64.

Run by the nox CUDA session; skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from distcompat.attention import attend, explain_attention
from distcompat.attention._kernels import device_capability, probe_kernel
from strategies_attention import loop_mask, plain_attention

pytestmark = pytest.mark.cuda

CASES = [
    (True, None, 256, 256),
    (True, (63, 0), 256, 256),
    (True, None, 64, 256),
    (True, None, 1, 256),
]


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max())


@pytest.mark.parametrize("impl", ["auto", "sdpa", "math", "fa2", "fa3", "fa4", "flex"])
@pytest.mark.parametrize(("causal", "window", "tq", "tk"), CASES)
def test_gpu_parity(
    impl: str,
    causal: bool,
    window: tuple[int, int] | None,
    tq: int,
    tk: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if impl.startswith("fa") and not probe_kernel(impl).available:
        pytest.skip(probe_kernel(impl).reason)
    if impl != "auto":
        monkeypatch.setenv("DISTCOMPAT_ATTENTION", impl)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q64, k64, v64 = (
        torch.randn(2, h, t, 64, device="cuda", dtype=torch.float64, generator=gen)
        for h, t in ((8, tq), (2, tk), (2, tk))
    )
    mask = loop_mask(tq, tk, causal, window).cuda()
    ref = plain_attention(q64, k64, v64, mask)
    low = [t.bfloat16() for t in (q64, k64, v64)]
    try:
        decision = explain_attention(*low, causal=causal, window=window)
    except RuntimeError as exc:  # the override cannot run here: that is a skip, with the reason
        pytest.skip(str(exc))
    out = attend(*low, causal=causal, window=window)
    plain = plain_attention(low[0], low[1], low[2], mask)
    bound = 2 * _error(plain, ref) + torch.finfo(torch.bfloat16).eps * float(ref.abs().max())
    assert _error(out, ref) <= bound, decision.why()


def test_capability_is_read_from_the_tensor_device() -> None:
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        assert device_capability(device) == torch.cuda.get_device_capability(index)
