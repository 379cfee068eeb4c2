"""The window/causal contract: converters, canonical windows, masks, dead rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from distcompat.attention import (
    AttentionInputError,
    from_hf_sliding_window,
    from_nanochat_window,
    to_fa4_window,
)
from distcompat.attention._contract import (
    canonical_window,
    has_dead_rows,
    to_bhtd,
    visible_mask,
)
from strategies_attention import loop_mask

CPU = torch.device("cpu")
windows = st.one_of(st.none(), st.tuples(st.integers(-1, 30), st.integers(-1, 30)))


@settings(max_examples=150, deadline=None)
@given(tq=st.integers(1, 20), tk=st.integers(1, 20), causal=st.booleans(), window=windows)
def test_canonical_mask_equals_literal_definition(
    tq: int, tk: int, causal: bool, window: tuple[int, int] | None
) -> None:
    left, right = canonical_window(causal=causal, window=window, tq=tq, tk=tk)
    expected = loop_mask(tq, tk, causal, window)
    assert torch.equal(visible_mask(tq, tk, left, right, CPU), expected)
    assert has_dead_rows(tq, tk, left, right) == bool((~expected.any(dim=1)).any())


def test_hf_sliding_window_counts_keys_including_current() -> None:
    left, right = from_hf_sliding_window(3)
    mask = visible_mask(5, 5, left, right, CPU)
    assert mask.sum(dim=1).tolist() == [1, 2, 3, 3, 3]
    with pytest.raises(AttentionInputError, match="sliding_window=0"):
        from_hf_sliding_window(0)


def test_nanochat_window_is_fa_convention() -> None:
    # nanochat's (N, 0) sees N + 1 keys: the current one and N before it.
    left, right = canonical_window(causal=True, window=from_nanochat_window((2, 0)), tq=6, tk=6)
    assert visible_mask(6, 6, left, right, CPU).sum(dim=1).tolist() == [1, 2, 3, 3, 3, 3]
    with pytest.raises(AttentionInputError, match=r"window_size\[0\]=-2"):
        from_nanochat_window((-2, 0))


def test_fa4_spells_unbounded_as_none() -> None:
    assert to_fa4_window((-1, -1)) == (None, None)
    assert to_fa4_window((64, 0)) == (64, 0)


def test_causal_is_bottom_right_not_sdpa_top_left() -> None:
    # Tq=2 queries against Tk=4 keys: FA/KV-cache semantics put them at positions 2 and 3.
    left, right = canonical_window(causal=True, window=None, tq=2, tk=4)
    ours = visible_mask(2, 4, left, right, CPU)
    assert ours.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    q, k = torch.eye(2, 4).view(1, 1, 2, 4), torch.eye(4).view(1, 1, 4, 4)
    v = torch.arange(4.0).view(1, 1, 4, 1)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bottom_right = F.scaled_dot_product_attention(q, k, v, attn_mask=ours)
    assert not torch.allclose(top_left, bottom_right)


def test_bad_window_and_layout_raise() -> None:
    with pytest.raises(AttentionInputError, match="window"):
        canonical_window(causal=False, window=(-3, 0), tq=2, tk=2)
    with pytest.raises(AttentionInputError, match="layout"):
        to_bhtd(torch.zeros(1, 1, 1, 1), "bhdt")  # type: ignore[arg-type]
