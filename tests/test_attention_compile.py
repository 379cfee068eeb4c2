"""Dispatch inside torch.compile: the graph holds the chosen kernel's call and nothing else (CPU).

Each call is compiled through a counting backend (``aot_autograd``, so forward and backward are
counted as aten graphs) next to the same call written with ``F.scaled_dot_product_attention``
directly, with the same mask built outside the compiled region. distcompat must give one graph,
no graph break, no warning, and no more aten ops in either pass than the direct call.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func  # type: ignore[import-untyped]
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from distcompat.attention import attend, attend_with_kvcache
from distcompat.attention._contract import visible_mask
from distcompat.attention._kvcache import cache_mask
from distcompat.attention.flash_attn import flash_attn_func

pytestmark = [
    pytest.mark.slow,
    # torch's own compile stack imports deprecated torch.jit helpers.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@dataclass
class Compiled:
    """What one torch.compile of a function produced: graphs, breaks, aten ops, warnings."""

    graphs: int = 0
    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)
    breaks: int = 0
    warnings: list[str] = field(default_factory=list)


def compile_and_count(fn: Callable[..., torch.Tensor], *args: Any) -> tuple[Compiled, Any]:
    """Compile ``fn`` with a counting backend, run it (and its backward where it has one)."""
    seen = Compiled()

    def counter(ops: list[str]) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return make_boxed_func(gm.forward)

        return compiler

    inner = aot_autograd(fw_compiler=counter(seen.forward), bw_compiler=counter(seen.backward))

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.graphs += 1
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend=backend)(*args)
        if out.requires_grad:
            out.sum().backward()  # type: ignore[no-untyped-call]
    seen.breaks = sum(counters["graph_break"].values())
    seen.warnings = [str(w.message) for w in caught if "jit.script_method" not in str(w.message)]
    return seen, out


def assert_no_more_than_direct(ours: Compiled, direct: Compiled) -> None:
    assert ours.graphs == 1, ours
    assert ours.breaks == 0, ours
    assert ours.warnings == [], ours.warnings
    assert len(ours.forward) <= len(direct.forward), (ours.forward, direct.forward)
    assert len(ours.backward) <= len(direct.backward), (ours.backward, direct.backward)


def bthd(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def sdpa_bthd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw
    )
    return out.transpose(1, 2)


WINDOW = visible_mask(32, 32, 7, 0, torch.device("cpu")).clone()  # built outside the graph

CASES: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], list[Any]]] = {
    "causal": (
        lambda q, k, v: attend(q, k, v, causal=True, layout="bthd"),
        lambda q, k, v: sdpa_bthd(q, k, v, is_causal=True),
        [(2, 32, 4, 16)] * 3,
    ),
    "sliding window": (
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(7, 0)),
        lambda q, k, v: sdpa_bthd(q, k, v, attn_mask=WINDOW),
        [(2, 32, 4, 16)] * 3,
    ),
    "GQA 4:1": (
        lambda q, k, v: attend(q, k, v, causal=True, layout="bthd"),
        lambda q, k, v: sdpa_bthd(q, k, v, is_causal=True, enable_gqa=True),
        [(2, 32, 4, 16), (2, 32, 1, 16), (2, 32, 1, 16)],
    ),
    "decode, window": (
        lambda q, k, v: attend(q, k, v, causal=True, window=(7, 0), layout="bthd"),
        lambda q, k, v: sdpa_bthd(q, k[:, -8:], v[:, -8:]),
        [(2, 1, 4, 16), (2, 32, 4, 16), (2, 32, 4, 16)],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_call_is_the_kernel_call_only(case: str) -> None:
    ours_fn, direct_fn, shapes = CASES[case]
    args = bthd(*shapes)
    ours, out = compile_and_count(ours_fn, *args)
    direct, ref = compile_and_count(direct_fn, *args)
    assert torch.allclose(out, ref, atol=1e-6)
    assert_no_more_than_direct(ours, direct)
    assert any("scaled_dot_product" in op for op in ours.forward), ours.forward
    assert ours.backward, "the backward was compiled too"


def test_compiled_kvcache_decode_is_the_kernel_call_only() -> None:
    t_max = 16

    def ours_fn(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return attend_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)

    def direct_fn(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        pos = lens.view(-1, 1) + torch.arange(1)
        rows = torch.arange(q.shape[0]).view(-1, 1).expand_as(pos)
        kc[rows, pos] = k
        vc[rows, pos] = v
        mask = cache_mask(lens + 1, 1, t_max, (-1, -1))  # one row: causal excludes nothing
        return sdpa_bthd(q, kc, vc, attn_mask=mask, enable_gqa=True)

    def args() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 1, h, 8, generator=gen) for h in (4, 2, 2))
        caches = [torch.zeros(2, t_max, 2, 8) for _ in range(2)]
        return [q, *caches, k, v, torch.tensor([3, 7])]

    ours, out = compile_and_count(ours_fn, *args())
    direct, ref = compile_and_count(direct_fn, *args())
    assert torch.allclose(out, ref, atol=1e-6)
    assert_no_more_than_direct(ours, direct)


class Block(torch.nn.Module):
    """Attention of a nanochat-shaped block: qkv projection, one attention call, projection."""

    def __init__(self, dim: int, heads: int, window: int, mask: torch.Tensor | None) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.heads, self.window, self.mask = heads, window, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        if self.mask is None:  # distcompat, as nanochat calls FA3
            y = flash_attn_func(q, k, v, causal=True, window_size=(self.window, 0))
        elif self.window >= t - 1:
            y = sdpa_bthd(q, k, v, is_causal=True)
        else:
            y = sdpa_bthd(q, k, v, attn_mask=self.mask)
        return self.proj(y.reshape(b, t, c))  # type: ignore[no-any-return]


def nanochat_model(direct: bool, seq: int = 64, layers: int = 4) -> torch.nn.Module:
    short = math.ceil(seq / 4 / 16) * 16  # nanochat's S window, rounded to 16 here (128 there)
    windows = [short if "SSSL"[i % 4] == "S" else seq for i in range(layers)]
    windows[-1] = seq  # nanochat: the last layer is always L
    mask = visible_mask(seq, seq, short, 0, torch.device("cpu")).clone() if direct else None
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block(64, 4, w, mask) for w in windows))


def test_nanochat_pattern_model_compiles_like_direct_sdpa() -> None:
    x = torch.randn(2, 64, 64)
    ours, out = compile_and_count(nanochat_model(direct=False), x)
    direct, ref = compile_and_count(nanochat_model(direct=True), x)
    assert torch.allclose(out, ref, atol=1e-5)
    assert_no_more_than_direct(ours, direct)


def test_dynamic_batch_keeps_one_graph() -> None:
    compiled = torch.compile(lambda q: attend(q, q, q, causal=True, window=(3, 0)), dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    for batch in (3, 5, 6):  # not 2: duck sizing would tie the batch to the 2 heads
        q = torch.randn(batch, 2, 16, 8)
        assert torch.allclose(compiled(q), attend(q, q, q, causal=True, window=(3, 0)), atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


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


def test_bad_input_inside_compile_still_names_the_problem() -> None:
    compiled = torch.compile(lambda q, k: attend(q, k, k), backend="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not a multiple"):
        compiled(torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8))


def test_forced_flex_compiles_fullgraph_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex has no backward on CPU; forward-only calls compile in one graph, no warning."""
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "flex")
    q, k = torch.randn(1, 4, 128, 16), torch.randn(1, 2, 128, 16)

    def call(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return attend(q, k, k, causal=True, window=(15, 0))

    with torch.no_grad():
        ref = call(q, k)
        seen, out = compile_and_count(call, q, k)
    assert seen.graphs == 1
    assert seen.breaks == 0
    assert seen.warnings == []
    assert torch.allclose(out, ref, atol=1e-6)


def test_compiled_flex_reads_prebuilt_block_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward only (flex has no backward on CPU): block masks are built with the plan, eagerly.

    The graph holds no more ops than direct flex calls given block masks built beforehand (on a
    GPU, rebuilding them in the graph cost every step), and a window first seen after the
    compile (a new block mask) does not recompile the graph.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setenv("DISTCOMPAT_ATTENTION", "flex")
    q, k = torch.randn(1, 4, 256, 16), torch.randn(1, 4, 256, 16)

    def ours(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        out = attend(q, k, k, causal=True, window=(15, 0))
        return attend(out, k, k, causal=True, window=(63, 0))

    def window_of(left: int) -> Callable[..., torch.Tensor]:
        return lambda b, h, i, j: (j <= i) & (j >= i - left)

    masks = [create_block_mask(window_of(left), None, None, 256, 256, "cpu") for left in (15, 63)]

    def direct(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        out = flex_attention(q, k, k, block_mask=masks[0])
        return flex_attention(out, k, k, block_mask=masks[1])

    with torch.no_grad():
        seen, out = compile_and_count(ours, q, k)
        theirs, ref = compile_and_count(direct, q, k)
        assert torch.allclose(out, ref, atol=1e-5)
        assert_no_more_than_direct(seen, theirs)
        compiles = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(ours, backend=compiles)
        compiled(q, k)
        attend(q, k, k, causal=True, window=(31, 0))  # a third block mask, made eagerly
        assert torch.allclose(compiled(q, k), ref, atol=1e-5)
    assert compiles.frame_count == 1
