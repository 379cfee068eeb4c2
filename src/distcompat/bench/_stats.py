"""The arithmetic of a collective benchmark as nccl-tests defines it: sizes, percentiles, bandwidth.

``algbw`` is the bytes a collective moves for the caller (its buffer size) over the time it took;
``busbw`` scales it by nccl-tests' factor for the op, which makes it comparable with the link's
hardware bandwidth whatever the number of ranks::

    row = BenchRow.from_times("all_reduce", nbytes=1 << 20, count=262144, world_size=4,
                              times_s=[...])   # row.busbw_gbps == row.algbw_gbps * 1.5

The size of an op is nccl-tests' too: the whole buffer (``all_gather``'s output,
``reduce_scatter``'s input, the tensor of ``all_reduce`` and ``broadcast``, ``all_to_all``'s input).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "OPS",
    "BenchRow",
    "bus_factor",
    "format_bytes",
    "geometric_sizes",
    "parse_bytes",
    "percentile",
]

#: The collectives measured, in the order of the table.
OPS = (
    "all_reduce", "all_gather_into_tensor", "all_gather_uneven", "reduce_scatter_tensor",
    "broadcast", "all_to_all_single",
)  # fmt: skip

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor.

    all_reduce moves ``2(n-1)/n`` of its buffer over each rank's link, the gathers, scatters and
    all-to-all ``(n-1)/n``, broadcast the buffer once (factor 1).

    Example:
        >>> bus_factor("all_reduce", 4), bus_factor("all_gather_into_tensor", 4)
        (1.5, 0.75)
    """
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "all_gather_uneven", "reduce_scatter_tensor",
              "all_to_all_single"):  # fmt: skip
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")


def percentile(values: list[float], q: float) -> float:
    """Return the nearest-rank ``q``-quantile (0 < q <= 1): the smallest value with q at or below.

    Example:
        >>> percentile([4.0, 1.0, 3.0, 2.0], 0.5), percentile([4.0, 1.0, 3.0, 2.0], 0.95)
        (2.0, 4.0)
    """
    if not values or not 0 < q <= 1:
        raise ValueError(
            f"percentile needs values and 0 < q <= 1 (got {len(values)} values, q={q})"
        )
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def parse_bytes(text: str) -> int:
    """Parse ``4096``, ``4K``, ``16M``, ``1G`` (binary units, also ``KiB``/``MB`` spellings).

    Example:
        >>> parse_bytes("1K"), parse_bytes("16MiB"), parse_bytes("512")
        (1024, 16777216, 512)
    """
    found = re.fullmatch(r"\s*([0-9]+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if found is None:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 4096, 64K, 16M, 1G)")
    value = int(found.group(1)) * _UNITS[found.group(2).lower()]
    if value < 1:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return value


def format_bytes(nbytes: int) -> str:
    """``1024`` -> ``'1 KiB'``; sizes that are not whole units keep their bytes.

    Example:
        >>> format_bytes(1 << 20), format_bytes(1000)
        ('1 MiB', '1000 B')
    """
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def geometric_sizes(smallest: int, largest: int, factor: int) -> list[int]:
    """``smallest, smallest*factor, ...`` up to ``largest`` (nccl-tests' ``-b -e -f``).

    Example:
        >>> geometric_sizes(1024, 65536, 8)
        [1024, 8192, 65536]
    """
    if smallest < 1 or largest < smallest or factor < 2:
        raise ValueError(
            f"sizes need 1 <= min ({smallest}) <= max ({largest}) and factor ({factor}) >= 2"
        )
    sizes = [smallest]
    while sizes[-1] * factor <= largest:
        sizes.append(sizes[-1] * factor)
    return sizes


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRow:
    """One op at one size: latency percentiles and bandwidths (GB/s = 1e9 bytes per second).

    ``nbytes`` is the op's buffer (see the module docstring), ``count`` its elements; the
    bandwidths are computed from the median latency.
    """

    op: str
    nbytes: int
    count: int
    iterations: int
    p50_us: float
    p95_us: float
    algbw_gbps: float
    busbw_gbps: float
    bus_factor: float
    path: str = ""  # with --compare-shm: "shared memory" or "gloo"

    @classmethod
    def from_times(
        cls,
        op: str,
        *,
        nbytes: int,
        count: int,
        world_size: int,
        times_s: list[float],
        path: str = "",
    ) -> BenchRow:
        """Summarise per-iteration times (seconds) of ``op`` moving ``nbytes`` on ``world_size``.

        Example:
            >>> row = BenchRow.from_times("all_reduce", nbytes=1_000_000, count=250_000,
            ...     world_size=4, times_s=[0.002, 0.001, 0.003])
            >>> row.p50_us, row.algbw_gbps, row.busbw_gbps
            (2000.0, 0.5, 0.75)
        """
        p50, p95 = percentile(times_s, 0.5), percentile(times_s, 0.95)
        factor = bus_factor(op, world_size)
        algbw = nbytes / p50 / 1e9 if p50 > 0 else math.inf
        return cls(
            op=op,
            nbytes=nbytes,
            count=count,
            iterations=len(times_s),
            p50_us=p50 * 1e6,
            p95_us=p95 * 1e6,
            algbw_gbps=algbw,
            busbw_gbps=algbw * factor,
            bus_factor=factor,
            path=path,
        )
