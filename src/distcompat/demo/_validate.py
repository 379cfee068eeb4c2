"""The demo's validation: each rank scores its shard of held-out windows; every rank gets all.

Held-out text (another seed of the corpus generator) is cut into ``VALIDATION_WINDOWS`` windows,
an odd count, so that ``ShardedSampler``'s mode ``"strided"`` gives the ranks unequal shares
and repeats nothing. Each rank scores its windows (one mean cross-entropy per window) and
:func:`distcompat.gather_for_metrics` brings every window's loss to every rank, once each, in
window order::

    result = validate(trainer.model, config, device)    # the same on every rank
    result.loss, result.each_once
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import distcompat
from distcompat.data import ShardedSampler
from distcompat.demo._config import DemoConfig
from distcompat.demo._corpus import encode, generate_text

__all__ = ["VALIDATION_WINDOWS", "Validation", "validate"]

#: Held-out windows: odd, so the ranks' shares differ on 2 and 4 ranks (and 3: 37 = 3 * 12 + 1).
VALIDATION_WINDOWS = 37


@dataclass(frozen=True, slots=True, kw_only=True)
class Validation:
    """The held-out loss, over every window once, and whether each came back exactly once."""

    windows: int
    loss: float
    each_once: bool


def validate(model: torch.nn.Module, config: DemoConfig, device: torch.device) -> Validation:
    """Score this rank's share of the held-out windows; return the loss over all of them.

    Every rank must call it. Example:
        >>> from pathlib import Path
        >>> from distcompat.demo._model import GPT
        >>> config = DemoConfig(out=Path("demo-out"), seq_len=8, n_layer=1, n_head=2, n_embd=16)
        >>> result = validate(GPT(config.model_config(), seed=0), config, torch.device("cpu"))
        >>> result.windows, result.each_once
        (37, True)
    """
    span = config.seq_len + 1
    text = generate_text(seed=config.seed + 1, num_bytes=VALIDATION_WINDOWS * span + 64)
    tokens = encode(text)[: VALIDATION_WINDOWS * span].view(VALIDATION_WINDOWS, span)
    sampler = ShardedSampler(range(VALIDATION_WINDOWS), shuffle=False, mode="strided")
    mine = torch.tensor(list(sampler), dtype=torch.int64)
    losses = []
    with torch.no_grad():
        for batch in torch.split(mine, config.batch_size):
            window = tokens[batch].to(device=device, dtype=torch.int64)  # (B, seq_len + 1)
            logits = model(window[:, :-1]).float()  # (B, T, vocab)
            each = F.cross_entropy(logits.transpose(1, 2), window[:, 1:], reduction="none")
            losses.append(each.mean(1))  # (B,): one loss per window
    scored = {"window": mine.to(device), "loss": torch.cat(losses)}
    every = distcompat.gather_for_metrics(scored, sampler)
    in_order = torch.arange(VALIDATION_WINDOWS, device=device)
    return Validation(
        windows=int(every["window"].numel()),
        loss=float(every["loss"].mean().item()),
        each_once=bool(torch.equal(every["window"], in_order)),
    )
