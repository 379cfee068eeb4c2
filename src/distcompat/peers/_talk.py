"""What a peer link says: one line at a time, a greeting, and proofs under the job's secret.

The dialler greets (:func:`greeting`), the listener answers with its challenge and its proof,
the dialler proves itself in turn, and the listener says it took the link (``_links``). A
proof is an HMAC-SHA256 of both challenges and who is talking to whom, under the secret the
ranks agreed through the store (:func:`job_secret`). Neither side sends the secret, and a
recorded exchange proves nothing to a later challenge::

    secret = job_secret(store)                              # the same on every rank
    proof(secret, "dial", (0, 4121, 1, 4177, mine, theirs)) # 64 hex digits
"""

from __future__ import annotations

import hmac
import secrets
import socket
from typing import Any

__all__ = ["BYE", "HELLO", "LINE_BYTES", "could_greet", "greeting", "job_secret", "line", "nonce",
           "proof", "read_line"]  # fmt: skip

HELLO = "distcompat-link2"
BYE = "bye "
LINE_BYTES = 512  # a greeting is ~80 bytes; a farewell is cut at 300 characters (``_registry``)
_SECRET_KEY = "distcompat/peer/secret"
_NONCE_BYTES = 16


def job_secret(store: Any) -> bytes | None:
    """Return the job's link secret, agreed through the rendezvous ``store`` (None: no store).

    Each rank proposes 32 random bytes; the store keeps the first (``compare_set``): one request.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> job_secret(store) == job_secret(store)
        True
    """
    try:
        agreed = store.compare_set(_SECRET_KEY, "", secrets.token_hex(32))
    except (RuntimeError, ValueError, AttributeError):
        return None
    return bytes(agreed) or None


def _proof(secret: bytes, role: str, words: tuple[object, ...]) -> str:
    """Return the HMAC of ``role`` and ``words`` under ``secret`` (hex)."""
    message = " ".join(map(str, (role, *words))).encode()
    return hmac.new(secret, message, "sha256").hexdigest()


def nonce() -> str:
    """Return a fresh random challenge (32 hex digits).

    Example:
        >>> len(nonce()), nonce() != nonce()
        (32, True)
    """
    return secrets.token_hex(_NONCE_BYTES)


def proof(secret: bytes, role: str, words: tuple[object, ...]) -> str:
    """Return the HMAC-SHA256 of ``role`` and ``words`` under ``secret`` (64 hex digits).

    Example:
        >>> len(proof(b"secret", "dial", (0, 1))), proof(b"a", "x", ()) != proof(b"b", "x", ())
        (64, True)
    """
    message = " ".join(map(str, (role, *words))).encode()
    return hmac.new(secret, message, "sha256").hexdigest()


def greeting(words: tuple[object, ...]) -> bytes:
    """Return the dialler's first line: :data:`HELLO` and ``words``."""
    return line(" ".join(map(str, (HELLO, *words))))


def line(text: str) -> bytes:
    """One line of the link's talk: ``text`` on one line, cut to fit :data:`LINE_BYTES`."""
    return " ".join(text.split()).encode()[: LINE_BYTES - 1] + b"\n"


def could_greet(pending: bytearray) -> bool:
    """Return whether ``pending`` can still be the start of a greeting."""
    prefix = (HELLO + " ").encode()
    head = bytes(pending[: len(prefix)])
    return prefix.startswith(head)


def read_line(sock: socket.socket) -> bytes:
    """Read up to a newline (the socket's timeout bounds each receive)."""
    got = b""
    while not got.endswith(b"\n") and len(got) < LINE_BYTES:
        chunk = sock.recv(LINE_BYTES - len(got))
        if not chunk:
            break
        got += chunk
    return got
