"""flex_attention's pieces: each window's block mask built once, eagerly, and flex per device.

A flex plan (``_adapters``) names its window's block mask; the mask is an attribute of
:data:`block_masks`, built when the plan is made, so a compiled graph reads it instead of
rebuilding it every step::

    name = block_mask_named(sig, device)          # eager, with the plan
    out = flex_callable("cpu")(q, k, v, block_mask=getattr(block_masks, name))
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from distcompat.attention._contract import UNBOUNDED, Window
from distcompat.attention._kernels import probe_kernel
from distcompat.attention._rules import CallSignature

__all__ = ["MAX_BLOCK_MASKS", "block_mask_named", "block_masks", "flex_callable"]


def _block_mask(tq: int, tk: int, window: Window, device: torch.device) -> Any:
    """Build flex's block mask of a canonical window (in the graph when traced)."""
    create_block_mask = probe_kernel("flex").functions["create_block_mask"]
    left, right = window
    offset = tk - tq

    def mask_mod(b: Any, h: Any, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        pos = i + offset  # bottom-right aligned position of query row i
        seen = j >= 0
        if left != UNBOUNDED:
            seen = seen & (j >= pos - left)
        if right != UNBOUNDED:
            seen = seen & (j <= pos + right)
        return seen

    return create_block_mask(mask_mod, None, None, tq, tk, device=device)


#: Each flex plan's block mask, an attribute named by (Tq, Tk, window, device), built with the
#: plan (building one costs more than a small flex call). Attributes, not a dict: dynamo reads a
#: dict once per trace, so an entry that a plan made later in the same trace would be missing;
#: it reads each attribute when it is used, and a compiled graph takes it as an input.
block_masks = types.SimpleNamespace()

#: Block masks kept at most (a few KiB each); when full they are dropped and rebuilt when next
#: planned. A compiled graph that read a dropped one fails its guard and is traced again.
MAX_BLOCK_MASKS = 64


def block_mask_named(sig: CallSignature, device: torch.device) -> str:
    """Build (once) the block mask of ``sig``'s window on ``device``; return its name."""
    # Eager, also for a traced call (plans are made eagerly): the graph reads the mask by name
    # instead of rebuilding it on every step.
    left, right = sig.window
    name = f"q{sig.tq}_k{sig.tk}_l{left}_r{right}_{device.type}{device.index or 0}"
    name = name.replace("-", "m")  # -1: unbounded
    if not hasattr(block_masks, name):
        if len(vars(block_masks)) >= MAX_BLOCK_MASKS:
            vars(block_masks).clear()
        setattr(block_masks, name, _block_mask(sig.tq, sig.tk, sig.window, device))
    return name


@functools.cache
def flex_callable(device_type: str) -> Callable[..., Any]:
    flex = probe_kernel("flex").functions["flex_attention"]
    if device_type in ("cuda", "xpu"):
        # Static shapes: on a second query length torch 2.11 recompiled flex with a symbolic one,
        # and inductor found no kernel for it (NoValidChoicesError; an H100, Tq 256 then 64).
        return torch.compile(flex, dynamic=False)
    return flex  # CPU/MPS: forward only, eager (compiling costs 40-90 s on first call)
