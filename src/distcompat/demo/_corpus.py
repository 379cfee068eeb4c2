"""The demo's corpus: English-like sentences from a small seeded grammar, as byte-level tokens.

Nothing is downloaded: the text is generated, and the same seed always gives the same bytes::

    text = generate_text(seed=0, num_bytes=1 << 16)
    tokens = encode(text)                  # one token per byte, vocabulary 256

The grammar has subject-verb agreement ("the cat sees", "the cats see"), optional adjectives,
prepositional phrases and relative clauses, so a small model has structure to learn beyond
spelling: the loss falls from ln(256) ~ 5.5 nats well below 2 within a couple of hundred steps.
"""

from __future__ import annotations

import random

import torch

__all__ = ["VOCAB_SIZE", "encode", "generate_text"]

#: Byte-level tokens: every byte value is a token.
VOCAB_SIZE = 256

_DETERMINERS = {"sg": ("the", "a", "this", "one", "every"), "pl": ("the", "some", "these", "two")}
_ADJECTIVES = (
    "small", "red", "quiet", "old", "bright", "lazy", "clever", "green", "heavy", "tiny", "warm",
)  # fmt: skip
_NOUNS = (
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("child", "children"),
    ("teacher", "teachers"), ("robot", "robots"), ("river", "rivers"), ("box", "boxes"),
    ("garden", "gardens"), ("idea", "ideas"), ("engineer", "engineers"), ("train", "trains"),
)  # fmt: skip
_VERBS = (
    ("sees", "see"), ("likes", "like"), ("finds", "find"), ("follows", "follow"),
    ("builds", "build"), ("watches", "watch"), ("carries", "carry"), ("helps", "help"),
    ("knows", "know"), ("moves", "move"),
)  # fmt: skip
_INTRANSITIVE = (
    ("sleeps", "sleep"), ("runs", "run"), ("waits", "wait"), ("sings", "sing"),
    ("arrives", "arrive"), ("laughs", "laugh"),
)  # fmt: skip
_ADVERBS = ("slowly", "today", "again", "quietly", "at night", "every day", "together")
_PREPOSITIONS = ("near", "behind", "under", "with", "beside")


def _noun_phrase(rng: random.Random, depth: int) -> tuple[str, str]:
    """Return ``(phrase, number)`` with number ``"sg"`` or ``"pl"``."""
    number = "sg" if rng.random() < 0.6 else "pl"
    words = [rng.choice(_DETERMINERS[number])]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    singular, plural = rng.choice(_NOUNS)
    words.append(singular if number == "sg" else plural)
    if depth < 2 and rng.random() < 0.2:
        inner, _ = _noun_phrase(rng, depth + 1)
        words += [rng.choice(_PREPOSITIONS), inner]
    elif depth < 2 and rng.random() < 0.15:
        verb = rng.choice(_INTRANSITIVE)[0 if number == "sg" else 1]
        words += ["that", verb]
    return " ".join(words), number


def _sentence(rng: random.Random) -> str:
    subject, number = _noun_phrase(rng, 0)
    pick = 0 if number == "sg" else 1
    if rng.random() < 0.7:
        obj, _ = _noun_phrase(rng, 1)
        predicate = f"{rng.choice(_VERBS)[pick]} {obj}"
    else:
        predicate = rng.choice(_INTRANSITIVE)[pick]
    if rng.random() < 0.3:
        predicate += " " + rng.choice(_ADVERBS)
    return f"{subject} {predicate}.".capitalize()


def generate_text(*, seed: int, num_bytes: int) -> str:
    """Generate at least ``num_bytes`` bytes of sentences, one per line, deterministically.

    Example:
        >>> generate_text(seed=0, num_bytes=60) == generate_text(seed=0, num_bytes=60)
        True
        >>> len(generate_text(seed=1, num_bytes=100).encode()) >= 100
        True
    """
    if num_bytes < 1:
        raise ValueError(f"num_bytes={num_bytes} must be at least 1")
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < num_bytes:
        line = _sentence(rng)
        lines.append(line)
        size += len(line) + 1  # ASCII only: one byte per character, plus the newline
    return "\n".join(lines) + "\n"


def encode(text: str) -> torch.Tensor:
    """Return the UTF-8 bytes of ``text`` as a 1-D int64 tensor of tokens in ``[0, 256)``.

    Example:
        >>> encode("Hi.").tolist()
        [72, 105, 46]
    """
    data = bytearray(text.encode("utf-8"))
    return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)
