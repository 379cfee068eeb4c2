"""Dispatch on hardware we do not have: faked hosts, capabilities and kernel modules."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from distcompat.attention import (
    AttentionConfigError,
    AttentionInputError,
    AttentionUnavailableError,
    attend,
    explain_attention,
)
from distcompat.attention._contract import canonical_window
from distcompat.attention._dispatch import decide
from distcompat.attention._kernels import KernelProbe, forget_probes, override_kernels, probe_kernel
from distcompat.attention._rules import CallSignature
from distcompat.launch._host import override_host, probe_host


class Recorder:
    """A fake kernel function that records calls and refuses non-CUDA tensors, like the real one."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls.append(kwargs)
        if args[0].device.type != "cuda":
            raise RuntimeError("FlashAttention only supports CUDA tensors")
        raise AssertionError("unreachable in CPU tests")


def installed(*names: str, kvcache: bool = True) -> dict[str, KernelProbe]:
    probes = {}
    for name in names:
        functions: dict[str, Callable[..., Any]] = {"flash_attn_func": Recorder()}
        if kvcache:
            functions["flash_attn_with_kvcache"] = Recorder()
        probes[name] = KernelProbe(name=name, functions=functions, reason=f"{name} (mocked)")
    return probes


MISSING = {
    name: KernelProbe(name=name, reason=f"import of {name} failed: ModuleNotFoundError (mocked)")
    for name in ("fa2", "fa3", "fa4")
}


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A host where torch says CUDA is available (one sm90 GPU): what nanochat looked at."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with override_host(replace(probe_host(), cuda_device_count=1)):
        yield


def cuda_sig(
    capability: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
    *,
    d: int = 64,
    tq: int = 128,
    tk: int = 128,
    window: tuple[int, int] | None = None,
    grad: bool = True,
    kvcache: bool = False,
) -> CallSignature:
    return CallSignature(
        device_type="cuda",
        device_index=0,
        capability=capability,
        rocm=False,
        dtype=dtype,
        hq=8,
        hkv=2,
        tq=tq,
        tk=tk,
        d_qk=d,
        d_v=d,
        window=canonical_window(causal=True, window=window, tq=tq, tk=tk),
        requires_grad=grad,
        kvcache=kvcache,
    )


def test_cpu_tensors_on_a_gpu_host_with_fa3_get_a_cpu_kernel(gpu_host: None) -> None:
    # The nanochat bug (seed 000): host has CUDA and FA3, the run is on CPU.
    probes = installed("fa3", "fa2", "fa4")
    with override_kernels(probes=probes, capabilities={0: (9, 0)}):
        q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
        decision = explain_attention(q, q, q, causal=True)
        out = attend(q, q, q, causal=True)
    assert decision.impl == "sdpa"
    reasons = {r.impl: r.reason for r in decision.rejected}
    assert "tensors are on cpu; FA3 runs on CUDA only" in reasons["fa3"]
    assert "this host has 1 CUDA device(s)" in reasons["fa3"]
    assert out.device.type == "cpu"
    for probe in probes.values():
        assert all(not fn.calls for fn in probe.functions.values())  # type: ignore[attr-defined]


def test_cpu_tensors_never_import_cuda_kernel_packages(
    gpu_host: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    forget_probes()
    imported: list[str] = []
    real_import = __import__("importlib").import_module

    def spy(name: str, *args: Any) -> Any:
        imported.append(name)
        return real_import(name, *args)

    monkeypatch.setattr("distcompat.attention._kernels.importlib.import_module", spy)
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    explain_attention(q, q, q, causal=True, window=(1, 0))
    assert not [name for name in imported if "flash_attn" in name]
    forget_probes()


@pytest.mark.parametrize(
    ("capability", "dtype", "expected"),
    [
        ((9, 0), torch.bfloat16, "fa3"),  # H100: FA3 first
        ((10, 0), torch.bfloat16, "fa4"),  # B200: FA3 refuses the arch, FA4 next
        ((8, 0), torch.bfloat16, "fa2"),  # A100: FA3 arch, FA4 no backward on sm80
        ((8, 6), torch.float16, "fa2"),
        ((9, 0), torch.float32, "sdpa"),  # no silent downcast to reach FA
        ((7, 5), torch.float16, "sdpa"),  # T4: no FA
    ],
)
def test_cuda_capability_table(
    capability: tuple[int, int], dtype: torch.dtype, expected: str
) -> None:
    with override_kernels(probes=installed("fa2", "fa3", "fa4")):
        decision = decide(cuda_sig(capability, dtype))
    assert decision.impl == expected, decision.why()
    assert decision.device == f"cuda:0 sm{capability[0]}{capability[1]}"


def test_rejection_reasons_name_the_rule() -> None:
    with override_kernels(probes=installed("fa2", "fa3", "fa4")):
        sm80 = {r.impl: r.reason for r in decide(cuda_sig((8, 0))).rejected}
        fp32 = {r.impl: r.reason for r in decide(cuda_sig((9, 0), torch.float32)).rejected}
        d192 = decide(cuda_sig((10, 0), d=192))
    assert "compute capability 9.x" in sm80["fa3"]
    assert "no backward on sm8x" in sm80["fa4"]
    assert "never downcast" in fp32["fa3"]
    assert d192.impl == "fa2"
    assert "head dim 8..128 or 256" in {r.impl: r.reason for r in d192.rejected}["fa4"]


def test_fa4_forward_only_on_sm80_without_grad() -> None:
    with override_kernels(probes=installed("fa4")):
        assert decide(cuda_sig((8, 0), grad=False)).impl == "fa4"


#: flex_attention as a torch that has it (it is absent from older torch) shows it to dispatch.
FLEX = KernelProbe(
    name="flex",
    functions={"flex_attention": Recorder(), "create_block_mask": Recorder()},
    reason="torch.nn.attention.flex_attention imported (mocked)",
)


def test_missing_packages_are_reasons_and_window_goes_to_flex() -> None:
    with override_kernels(probes={**MISSING, "flex": FLEX}):
        windowed = decide(cuda_sig((9, 0), d=128, window=(511, 0), tq=2048, tk=2048))
        wide = decide(cuda_sig((9, 0), d=128, window=(1099, 0), tq=2048, tk=2048))
        causal = decide(cuda_sig((9, 0)))
    assert windowed.impl == "flex"
    assert "ModuleNotFoundError (mocked)" in {r.impl: r.reason for r in windowed.rejected}["fa3"]
    assert causal.impl == "sdpa"
    assert "no sliding window" in {r.impl: r.reason for r in causal.rejected}["flex"]
    assert wide.impl == "sdpa"  # a window over 1/2 of the keys: not measured faster in flex
    assert (
        "1100-key window of 2048 keys at head dim 128: flex beat SDPA with a mask only for "
        "windows up to 1/2 of them" in {r.impl: r.reason for r in wide.rejected}["flex"]
    )


def test_torch_without_flex_is_a_reason_and_window_goes_to_sdpa() -> None:
    absent = KernelProbe(
        name="flex",
        reason="import torch.nn.attention.flex_attention failed: ModuleNotFoundError (mocked)",
    )
    with override_kernels(probes={**MISSING, "flex": absent}):
        windowed = decide(cuda_sig((9, 0), window=(31, 0), tq=1024, tk=1024))
    assert windowed.impl == "sdpa"
    assert (
        "not installed: import torch.nn.attention.flex_attention failed"
        in ({r.impl: r.reason for r in windowed.rejected}["flex"])
    )


def test_kvcache_skips_fa4_and_builds_without_kvcache() -> None:
    with override_kernels(probes={**installed("fa4"), **installed("fa3", kvcache=False)}):
        decision = decide(cuda_sig((9, 0), kvcache=True, grad=False))
    reasons = {r.impl: r.reason for r in decision.rejected}
    assert decision.impl == "sdpa"
    assert "no flash_attn_with_kvcache" in reasons["fa3"]
    assert "no flash_attn_with_kvcache" in reasons["fa4"]


def test_real_import_failures_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_probes()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # import raises ImportError
    fake = types.ModuleType("flash_attn.cute")
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    try:
        fa3, fa4 = probe_kernel("fa3"), probe_kernel("fa4")
        fake.flash_attn_func = Recorder()  # type: ignore[attr-defined]
        forget_probes()
        fa4_ok = probe_kernel("fa4")
    finally:
        forget_probes()
    assert not fa3.available
    assert fa3.reason.startswith("import flash_attn_interface failed: ModuleNotFoundError")
    assert not fa4.available
    assert fa4.reason == "flash_attn.cute lacks flash_attn_func"
    assert fa4_ok.available


def test_decisions_are_cached_per_signature() -> None:
    q = torch.randn(1, 2, 8, 16)
    first = explain_attention(q, q, q, causal=True)
    assert explain_attention(q, q, q, causal=True) is first
    assert explain_attention(q, q, q, causal=True, window=(2, 0)) is not first


def test_env_override_selects_and_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 8, 16)
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "math")
    decision = explain_attention(q, q, q, causal=True)
    assert decision.impl == "math"
    assert decision.source == "DISTCOMPAT_ATTENTION=math"
    assert "not named in DISTCOMPAT_ATTENTION=math" in decision.why()
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "fa3,sdpa")
    decision = explain_attention(q, q, q, causal=True)
    assert decision.impl == "sdpa"
    assert decision.rejected[0].impl == "fa3"


def test_env_override_that_cannot_run_raises_before_any_kernel(
    gpu_host: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "fa3")
    probes = installed("fa3")
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with (
        override_kernels(probes=probes),
        pytest.raises(AttentionUnavailableError, match="fa3: tensors are on cpu"),
    ):
        attend(q, q, q, causal=True)
    assert not probes["fa3"].functions["flash_attn_func"].calls  # type: ignore[attr-defined]


def test_env_override_flex_with_grad_on_cpu_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "flex")
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(AttentionUnavailableError, match="no backward on cpu"):
        attend(q, q, q, causal=True)


def test_env_override_unknown_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "fa5")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(AttentionConfigError, match=r"DISTCOMPAT_ATTENTION='fa5'.*'fa5'"):
        attend(q, q, q)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "not a multiple"),
        (((1, 2, 4, 8), (1, 2, 4, 16), (1, 2, 4, 16)), "shapes do not fit"),
        (((2, 4, 8), (2, 4, 8), (2, 4, 8)), "4-D"),
    ],
)
def test_bad_inputs_raise(shapes: tuple[tuple[int, ...], ...], match: str) -> None:
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(AttentionInputError, match=match):
        attend(q, k, v)


def test_mixed_dtypes_are_not_cast() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(AttentionInputError, match="never casts"):
        attend(q, q.bfloat16(), q)


@pytest.mark.parametrize(
    ("dtype", "tq", "expected"),
    [
        (torch.bfloat16, 1, "math"),
        (torch.float16, 1, "math"),
        (torch.float32, 1, "sdpa"),
        (torch.bfloat16, 4, "sdpa"),
    ],
)
def test_cpu_16bit_decode_goes_to_exact_math(dtype: torch.dtype, tq: int, expected: str) -> None:
    q = torch.randn(1, 4, tq, 16, dtype=dtype)
    k = torch.randn(1, 2, 32, 16, dtype=dtype)
    decision = explain_attention(q, k, k, causal=True)
    assert decision.impl == expected, decision.why()
    if expected == "math":
        assert "SDPA's CPU flash kernel" in {r.impl: r.reason for r in decision.rejected}["sdpa"]


@pytest.mark.parametrize(("tq", "feasible"), [(1, True), (64, False), (127, False), (128, True)])
def test_flex_on_cuda_refuses_the_query_lengths_it_failed_on(tq: int, feasible: bool) -> None:
    """Mocked CUDA signature: compiled flex raised for 64 query rows on an H100 (torch 2.11)."""
    from distcompat.attention._rules import infeasible

    with override_kernels(probes=installed("flex")):
        why = infeasible("flex", cuda_sig((9, 0), tq=tq, tk=256), None)
    assert (why is None) == feasible, why


@pytest.mark.parametrize(
    ("d", "tk", "left", "expected"),
    [
        (128, 2048, 512, "flex"),  # nanochat's S layer: 513 of 2048 keys (its model: 1.27x)
        (128, 2048, 1023, "flex"),  # 1/2: 1.38x
        (128, 2048, 1024, "sdpa"),  # over 1/2: not measured
        (128, 1024, 127, "flex"),  # 1/8: 1.32x
        (128, 1024, 255, "sdpa"),  # 1/4: forward 0.97x
        (64, 2048, 255, "flex"),  # 1/8: 1.05x, forward 1.75x
        (64, 2048, 511, "sdpa"),  # 1/4: 0.82x
        (64, 1024, 31, "sdpa"),  # head dim 64, 1024 keys: flex lost at every window
        (128, 512, 31, "sdpa"),  # too few keys
    ],
)
def test_flex_window_rule_follows_the_measured_table(
    d: int, tk: int, left: int, expected: str
) -> None:
    """Mocked CUDA signatures against FLEX_WINDOW_RULES (H200 figures in the rule's comment)."""
    sig = cuda_sig((9, 0), d=d, tq=tk, tk=tk, window=(left, 0))
    with override_kernels(probes={**MISSING, **installed("flex")}):
        decision = decide(sig)
    assert decision.impl == expected, decision.why()
