"""A stranger on the host: idle, junk and forged connections to the ranks' link ports, measured.

    python _stranger.py OUT.json SECONDS IDLE JUNK FORGED HOST:PORT:RANK:PID ...

For each target port it opens ``IDLE`` connections that send nothing, ``JUNK`` that send random
bytes, and ``FORGED`` that send the greeting a rank of the job would send, naming the real rank
and pid it dials (the stranger sees every pid on the host), the rank and pid of a peer and a
challenge, then answers the rank's challenge with a made-up proof. It holds them ``SECONDS``,
noting when the rank closes each, then closes what is left (a forged link that a rank took for a
peer would read as that peer's loss then). It raises its own open-file limit to the hard limit.

Writes ``OUT.json``: per kind, how many were made, how many were still open at the end (held by
the rank, or queued unaccepted by its kernel), how many never connected, and the median and
worst time from connect to the rank's close (seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import socket
import statistics
import sys
import time


def _limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    out, seconds = sys.argv[1], float(sys.argv[2])
    counts = {"idle": int(sys.argv[3]), "junk": int(sys.argv[4]), "forged": int(sys.argv[5])}
    targets = [spec.split(":") for spec in sys.argv[6:]]
    _limit()
    sel = selectors.DefaultSelector()
    opened: dict[int, tuple[str, float]] = {}  # fd -> (kind, connect time)
    closed: dict[str, list[float]] = {kind: [] for kind in counts}
    made = dict.fromkeys(counts, 0)
    socks: dict[int, socket.socket] = {}
    peer_of = {int(rank): int(pid) for _, _, rank, pid in targets}
    payload: dict[int, bytes] = {}
    connected: set[int] = set()  # fds whose connect completed
    for host, port, rank, pid in targets:
        other = 0 if int(rank) != 0 else 1  # a rank below it, when it has one
        other_pid = peer_of.get(other, int(pid))  # its pid when it is a target too
        for kind, number in counts.items():
            for _ in range(number):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.connect_ex((host, int(port)))  # in progress: done when writable
                made[kind] += 1
                opened[sock.fileno()] = (kind, time.monotonic())
                socks[sock.fileno()] = sock
                if kind == "junk":
                    payload[sock.fileno()] = os.urandom(256)
                elif kind == "forged":  # the lower rank dials: claim to be it
                    nonce = os.urandom(16).hex()
                    payload[sock.fileno()] = (
                        f"distcompat-link2 {other} {other_pid} {rank} {pid} {nonce}\n"
                    ).encode()
                sel.register(sock, selectors.EVENT_WRITE)
    end = time.monotonic() + seconds
    while opened and time.monotonic() < end:
        for key, events in sel.select(max(0.0, end - time.monotonic())):
            sock = socks[key.fd]
            if events & selectors.EVENT_WRITE:  # connected (or refused)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    data = b""
                else:
                    with contextlib.suppress(OSError):
                        sock.send(payload.get(key.fd, b""))
                    sel.modify(sock, selectors.EVENT_READ)
                    connected.add(key.fd)
                    continue
            else:
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
            if data:  # a challenge: a forged link answers it with a made-up proof
                if opened[key.fd][0] == "forged":
                    with contextlib.suppress(OSError):
                        sock.send(os.urandom(32).hex().encode() + b"\n")
                continue
            kind, started = opened.pop(key.fd)
            closed[kind].append(time.monotonic() - started)
            sel.unregister(sock)
            sock.close()
    held = dict.fromkeys(counts, 0)
    pending = dict.fromkeys(counts, 0)
    for fd, (kind, _) in opened.items():
        if fd in connected:
            held[kind] += 1
        else:
            pending[kind] += 1
    for sock in list(socks.values()):
        sock.close()
    report = {
        kind: {
            "made": made[kind],
            "held_at_end": held[kind],
            "never_connected": pending[kind],
            "closed": len(closed[kind]),
            "close_median_s": statistics.median(closed[kind]) if closed[kind] else None,
            "close_max_s": max(closed[kind]) if closed[kind] else None,
        }
        for kind in counts
    }
    with open(out, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
