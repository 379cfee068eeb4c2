"""Fixed-point numbers for sums whose bits do not depend on order, split or world size.

The three steps of an exact sum of ``terms`` float tensors, each at most ``bound`` in magnitude::

    e = exponent(bound, terms)          # one power of two per tensor, the same on every rank
    total = sum(quantize(t, e) for t in tensors)        # int64: associative, any order
    mean = dequantize(total, e, divisor=terms, dtype=torch.float32)

``quantize`` scales by ``2**-e`` in float64 (exact: a power of two) and rounds half to even, so
each term becomes an integer of at most ``2**bits(terms)`` in magnitude and any ``terms`` of them
add up without overflow. Integer addition is associative, so the total has the same bits in any
order and any split, on any backend's reduction algorithm. ``dequantize`` converts the integer
once (correctly rounded), scales it back and divides by the global constant.

Accuracy: each term is off by at most ``2**(e - 1)``, so the mean is within
``terms * 2**(e - 1) / divisor`` (plus the final rounding to ``dtype``), where ``2**e`` is about
``bound * 2**-bits(terms)``: for 16 terms a term keeps 57 bits below ``bound``, more than the 24
of float32. Values far below ``bound`` keep fewer of their own bits; the error bound holds.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LOSS_EXPONENT", "MIN_BOUND", "dequantize", "exponent", "quantize", "term_bits"]

#: Bits of an int64 a sum may use (one spare below the sign bit).
_SUM_BITS = 62
#: The smallest bound a tensor gets (float32's smallest normal): keeps ``2**-e`` finite.
MIN_BOUND = 2.0**-126
#: The largest power of two float32 holds (a larger scale would read as inf).
_FLOAT32_MAX_EXPONENT = 127
#: The exponent of a logged loss: 32 fractional bits, losses summed up to 2**30 / terms.
LOSS_EXPONENT = -32


def term_bits(terms: int) -> int:
    """Bits each of ``terms`` integers may use so that their sum fits in :data:`_SUM_BITS`.

    Example:
        >>> term_bits(1), term_bits(16), term_bits(17)
        (62, 58, 57)
    """
    if terms < 1:
        raise ValueError(f"terms={terms} must be at least 1")
    return _SUM_BITS - math.ceil(math.log2(terms))


def exponent(bound: float, terms: int) -> int:
    """Return the power of two ``e`` at which ``terms`` values <= ``bound`` sum exactly.

    Example:
        >>> exponent(1.0, 16)     # 1.0 * 2**57 <= 2**58
        -57
    """
    if not math.isfinite(bound):
        raise ValueError(f"bound={bound} must be finite")
    _, top = math.frexp(max(bound, MIN_BOUND))  # bound < 2**top
    return top - term_bits(terms)


def quantize(values: torch.Tensor, e: int) -> torch.Tensor:
    """``round(values * 2**-e)`` as int64 (half to even), computed without rounding error.

    Scaling by a power of two is exact in float32 as in float64 (the result stays below
    ``2**63``, far inside float32's range), and so is rounding to an integer and converting it:
    float32, float16 and bfloat16 values are scaled in float32 while ``2**-e`` is a float32
    number (tiny bounds, below ``2**-65``, need a larger one), else in float64.

    Example:
        >>> quantize(torch.tensor([0.75, -1.5]), -2)
        tensor([ 3, -6])
    """
    narrow = values.dtype != torch.float64 and -e <= _FLOAT32_MAX_EXPONENT
    wide = torch.float32 if narrow else torch.float64
    scaled = values.detach().to(wide) * math.ldexp(1.0, -e)
    return scaled.round_().to(torch.int64)


def dequantize(
    total: torch.Tensor, e: int, *, divisor: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``total * 2**e / divisor``, computed in float64 and rounded once to ``dtype``.

    Example:
        >>> dequantize(torch.tensor([12]), -2, divisor=2.0)
        tensor([1.5000])
    """
    scaled = total.to(torch.float64) * math.ldexp(1.0, e)
    if divisor != 1.0:
        scaled = scaled / divisor
    return scaled.to(dtype)
