"""The one numerics contract every attention implementation in distcompat follows.

A window is FlashAttention's ``(left, right)``: inclusive, ``-1`` = unbounded. Query row ``i`` of
``Tq`` sits at key position ``i' = i + Tk - Tq`` (**bottom-right** alignment, as in FA and in a KV
cache), and sees key ``j`` iff ``i' - left <= j <= i' + right``. ``causal=True`` is the same as
``right = 0``. A row that sees no key returns zeros (and zero gradients), never NaN::

    left, right = canonical_window(causal=True, window=from_hf_sliding_window(4), tq=8, tk=8)
    mask = visible_mask(8, 8, left, right, torch.device("cpu"))   # (8, 8) bool, True = attend

Converters take other libraries' conventions to this one: HF ``sliding_window=W`` (W keys,
current one included), nanochat ``(N, 0)`` (already FA's), FA4 ``None`` for unbounded.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

__all__ = [
    "UNBOUNDED",
    "AttentionInputError",
    "Layout",
    "Window",
    "bhtd_shape",
    "canonical_window",
    "from_hf_sliding_window",
    "from_nanochat_window",
    "has_dead_rows",
    "to_bhtd",
    "to_fa4_window",
    "visible_mask",
]

#: The FlashAttention spelling of "no bound on this side".
UNBOUNDED = -1

Window = tuple[int, int]
Layout = Literal["bhtd", "bthd"]


class AttentionInputError(ValueError):
    """Query, key and value do not describe an attention call distcompat can run."""


def from_hf_sliding_window(sliding_window: int) -> Window:
    """Convert transformers' ``sliding_window=W`` (W keys, the current one included) to a window.

    Example:
        >>> from_hf_sliding_window(4)
        (3, 0)
    """
    if sliding_window < 1:
        raise AttentionInputError(
            f"sliding_window={sliding_window}: transformers counts keys, so it must be >= 1"
        )
    return (sliding_window - 1, 0)


def from_nanochat_window(window_size: tuple[int, int]) -> Window:
    """Check nanochat's ``window_size=(N, 0)`` (N + 1 keys); it already is FA's convention.

    Example:
        >>> from_nanochat_window((2048, 0))
        (2048, 0)
    """
    left, right = window_size
    _check_side("window_size[0]", left)
    _check_side("window_size[1]", right)
    return (left, right)


def to_fa4_window(window: Window) -> tuple[int | None, int | None]:
    """Spell a window the way FlashAttention-4 wants it: ``None`` where FA2/FA3 use ``-1``.

    Example:
        >>> to_fa4_window((128, -1))
        (128, None)
    """
    return tuple(None if side == UNBOUNDED else side for side in window)  # type: ignore[return-value]


def _check_side(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < UNBOUNDED:
        raise AttentionInputError(f"{name}={value!r}: must be an int >= 0, or -1 for unbounded")


def canonical_window(*, causal: bool, window: Window | None, tq: int, tk: int) -> Window:
    """Fold ``causal`` into the window and drop bounds that exclude no key for this ``tq, tk``.

    The result is the cache key for masks and decisions: equal results mean equal masks.

    Example:
        >>> canonical_window(causal=True, window=None, tq=4, tk=4)
        (-1, 0)
        >>> canonical_window(causal=False, window=(10, 10), tq=4, tk=4)
        (-1, -1)
    """
    left, right = (UNBOUNDED, UNBOUNDED) if window is None else window
    _check_side("window[0]", left)
    _check_side("window[1]", right)
    if causal:
        right = 0 if right == UNBOUNDED else min(right, 0)
    # The lowest key bound over all rows is (tk - 1) - left; the highest upper is (tk - tq) + right.
    if left != UNBOUNDED and left >= tk - 1:
        left = UNBOUNDED
    if right != UNBOUNDED and right >= tq - 1:
        right = UNBOUNDED
    return (left, right)


@functools.lru_cache(maxsize=32)  # a (Tq, Tk) bool mask per entry: keep few
def visible_mask(tq: int, tk: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """Return the ``(tq, tk)`` bool mask of a canonical window (True = attend), cached per shape.

    Example:
        >>> visible_mask(2, 3, -1, 0, torch.device("cpu")).int().tolist()
        [[1, 1, 0], [1, 1, 1]]
    """
    rows = torch.arange(tq, device=device).unsqueeze(1) + (tk - tq)  # i' per query, (tq, 1)
    cols = torch.arange(tk, device=device).unsqueeze(0)  # j per key, (1, tk)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if left != UNBOUNDED:
        mask &= cols >= rows - left
    if right != UNBOUNDED:
        mask &= cols <= rows + right
    return mask


def has_dead_rows(tq: int, tk: int, left: int, right: int) -> bool:
    """Whether some query row of this canonical window sees no key at all (it must return 0).

    Example:
        >>> has_dead_rows(4, 2, -1, 0)   # causal, bottom-right: rows 0 and 1 precede every key
        True
    """
    for i in (0, tq - 1):  # the visible span only shifts with i, so the end rows decide
        pos = i + tk - tq
        low = 0 if left == UNBOUNDED else max(0, pos - left)
        high = tk - 1 if right == UNBOUNDED else min(tk - 1, pos + right)
        if low > high:
            return True
    return False


def to_bhtd(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return a (B, H, T, D) view of a tensor given in ``layout`` (a transpose, never a copy).

    Example:
        >>> to_bhtd(torch.zeros(2, 5, 3, 8), "bthd").shape
        torch.Size([2, 3, 5, 8])
    """
    if layout == "bhtd":
        return tensor
    if layout == "bthd":
        return tensor.transpose(1, 2)
    raise _bad_layout(layout)


def bhtd_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    """Return a shape given in ``layout`` as (B, H, T, D), as :func:`to_bhtd` would view it.

    Example:
        >>> bhtd_shape((2, 5, 3, 8), "bthd")
        (2, 3, 5, 8)
    """
    if layout == "bhtd":
        return tuple(shape)
    if layout == "bthd":
        dims = list(shape)
        if len(dims) >= 3:
            dims[1], dims[2] = dims[2], dims[1]
        return tuple(dims)
    raise _bad_layout(layout)


def _bad_layout(layout: object) -> AttentionInputError:
    return AttentionInputError(
        f"layout={layout!r}: expected 'bhtd' (like SDPA) or 'bthd' (like FA)"
    )
