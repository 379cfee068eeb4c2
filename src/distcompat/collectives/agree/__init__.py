"""The default mismatch check: ranks agree on each new collective signature before sending it.

How it works is in ``_check``'s module docstring; ``_state`` keeps each group's record (call
numbers, agreed steps) and the flags the fast paths read in place; ``_posts`` writes and reads
what ranks post::

    with unchecked():          # every rank: no call in the block is numbered or checked
        special_calls()
"""

from distcompat.collectives.agree._check import agree, answer, answerer, check, wait_answering
from distcompat.collectives.agree._state import ENV_VAR, HISTORY, answering, state_for, unchecked

__all__ = [
    "ENV_VAR",
    "HISTORY",
    "agree",
    "answer",
    "answerer",
    "answering",
    "check",
    "state_for",
    "unchecked",
    "wait_answering",
]
