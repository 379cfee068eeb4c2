"""KV-cache attention: in-place updates, ragged per-row lengths, the nanochat namespace."""

from __future__ import annotations

import pytest
import torch

from distcompat.attention import AttentionInputError, attend, attend_with_kvcache
from distcompat.attention import flash_attn as nc
from strategies_attention import loop_mask, plain_attention


def row_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    causal: bool,
    window: tuple[int, int] | None,
) -> torch.Tensor:
    """Float64 attention of one row's (1, T, H, D) tensors over its whole visible prefix."""
    qb, kb, vb = (t.transpose(1, 2).double() for t in (q, keys, values))
    mask = loop_mask(qb.shape[2], kb.shape[2], causal, window)
    return plain_attention(qb, kb, vb, mask).transpose(1, 2)


@pytest.mark.parametrize("impl", ["auto", "math"])
@pytest.mark.parametrize(
    ("causal", "window", "t_new"),
    [(True, None, 1), (True, (2, 0), 1), (True, (3, 0), 3), (False, None, 2), (False, (1, 1), 2)],
)
def test_ragged_rows_equal_full_attention(
    impl: str,
    causal: bool,
    window: tuple[int, int] | None,
    t_new: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISTCOMPAT_ATTENTION", impl)
    gen = torch.Generator().manual_seed(0)
    batch, t_max, hkv, hq, d = 3, 12, 2, 4, 8
    lengths = torch.tensor([0, 5, 8])  # ragged: each row has its own history
    k_cache = torch.randn(batch, t_max, hkv, d, generator=gen)
    v_cache = torch.randn(batch, t_max, hkv, d, generator=gen)
    k_new = torch.randn(batch, t_new, hkv, d, generator=gen)
    v_new = torch.randn(batch, t_new, hkv, d, generator=gen)
    q = torch.randn(batch, t_new, hq, d, generator=gen)
    before = k_cache.clone()
    out = attend_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=causal, window=window
    )
    for b, n in enumerate(lengths.tolist()):
        # in place: new keys at each row's own position, nothing else touched
        assert torch.equal(k_cache[b, n : n + t_new], k_new[b])
        assert torch.equal(k_cache[b, :n], before[b, :n])
        assert torch.equal(k_cache[b, n + t_new :], before[b, n + t_new :])
        end = n + t_new
        ref = row_reference(
            q[b : b + 1], k_cache[b : b + 1, :end], v_cache[b : b + 1, :end], causal, window
        )
        assert (out[b : b + 1].double() - ref).abs().max() < 1e-5


def test_prefill_then_decode_equals_one_causal_pass() -> None:
    gen = torch.Generator().manual_seed(1)
    batch, total, hq, hkv, d = 2, 10, 4, 1, 16
    q, k, v = (torch.randn(batch, total, h, d, generator=gen) for h in (hq, hkv, hkv))
    full = attend(q, k, v, causal=True, window=(4, 0), layout="bthd")
    k_cache = torch.zeros(batch, 16, hkv, d)
    v_cache = torch.zeros(batch, 16, hkv, d)
    lengths = torch.zeros(batch, dtype=torch.long)
    steps = [
        nc.flash_attn_with_kvcache(
            q[:, :6], k_cache, v_cache, k[:, :6], v[:, :6], lengths, True, (4, 0)
        )
    ]
    lengths += 6
    for t in range(6, total):
        sl = slice(t, t + 1)
        steps.append(
            nc.flash_attn_with_kvcache(
                q[:, sl], k_cache, v_cache, k[:, sl], v[:, sl], lengths, True, (4, 0)
            )
        )
        lengths += 1
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_nanochat_func_honours_causal_false() -> None:
    # nanochat's SDPA fallback applied causal masking even for causal=False (its PR #805).
    q = torch.randn(1, 6, 2, 8)
    non_causal = nc.flash_attn_func(q, q, q, causal=False)
    causal = nc.flash_attn_func(q, q, q, causal=True)
    assert not torch.allclose(non_causal, causal)
    ref = row_reference(q, q, q, False, None)
    assert (non_causal.double() - ref).abs().max() < 1e-5


def test_without_new_keys_reads_full_cache() -> None:
    q = torch.randn(1, 2, 2, 8)
    k_cache, v_cache = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    out = attend_with_kvcache(q, k_cache, v_cache, causal=True)
    assert torch.allclose(out, attend(q, k_cache, v_cache, causal=True, layout="bthd"), atol=1e-6)


def test_empty_row_gives_zeros_and_bad_calls_raise() -> None:
    q = torch.randn(2, 1, 2, 8)
    cache = torch.randn(2, 4, 2, 8)
    out = attend_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([0, 3]), causal=True)
    assert torch.equal(out[0], torch.zeros(1, 2, 8))
    with pytest.raises(AttentionInputError, match="cache_seqlens is required"):
        attend_with_kvcache(q, cache, cache, cache[:, :1], cache[:, :1])
    with pytest.raises(AttentionInputError, match="both k and v"):
        attend_with_kvcache(q, cache, cache, cache[:, :1], cache_seqlens=1)
    with pytest.raises(AttentionInputError, match="dtype of the caches"):
        attend_with_kvcache(
            q, cache, cache, cache[:, :1].double(), cache[:, :1].double(), cache_seqlens=1
        )
