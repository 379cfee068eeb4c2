"""Two "nodes" on one machine: two network namespaces joined by a veth pair, and a way to cut it.

    with TwoNodes.create() as nodes:                 # removed again on exit, also after errors
        argv = nodes.exec_in(1, ["torchrun", ...])   # run a command on node 1
        nodes.block(1)                               # nftables: drop all traffic on node 1's veth
        nodes.block(1, ports=(29400,))              # or only these TCP ports, both ways
        nodes.unblock(1)

Traffic only ever flows between the two namespaces this creates (10.77.0.1 and 10.77.0.2, a
/24 that exists nowhere else: the namespaces have no other interface than ``lo``). The fault
rules live in an nftables table inside node 1's namespace, so the host's own rules are untouched
and deleting the namespace deletes them. Names carry this process's id, so two sessions on one
machine do not collide.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

ADDRESSES = ("10.77.0.1", "10.77.0.2")
_TABLE = "distcompat_fault"
_COMMAND_TIMEOUT_S = 30.0


def _ip(*args: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        list(args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoNodes:
    """Two namespaces ``namespaces[k]`` with veth ``interfaces[k]`` at ``ADDRESSES[k]``."""

    namespaces: tuple[str, str]
    interfaces: tuple[str, str]

    @classmethod
    def create(cls) -> TwoNodes:
        """Create both namespaces, the veth pair and addresses; undo it all if a step fails."""
        tag = f"dc{os.getpid() % 100000}"
        nodes = cls(namespaces=(f"{tag}-n0", f"{tag}-n1"), interfaces=(f"{tag}v0", f"{tag}v1"))
        try:
            nodes._build()
        except BaseException:
            nodes.remove()
            raise
        return nodes

    def _build(self) -> None:
        for namespace in self.namespaces:
            _ip("ip", "netns", "add", namespace)
        first, second = self.interfaces
        _ip("ip", "link", "add", first, "type", "veth", "peer", "name", second)
        for namespace, interface, address in zip(
            self.namespaces, self.interfaces, ADDRESSES, strict=True
        ):
            _ip("ip", "link", "set", interface, "netns", namespace)
            inside = ("ip", "netns", "exec", namespace)
            _ip(*inside, "ip", "addr", "add", f"{address}/24", "dev", interface)
            _ip(*inside, "ip", "link", "set", interface, "up")
            _ip(*inside, "ip", "link", "set", "lo", "up")

    def exec_in(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def block(self, node: int, *, ports: Sequence[int] = ()) -> None:
        """Drop every packet in and out of node ``node``'s veth (its link to the other node).

        With ``ports``, only TCP packets to or from those ports (services on either node, say
        the rendezvous stores); every other connection over the veth keeps working.
        """
        interface = self.interfaces[node]
        listed = ", ".join(str(port) for port in ports)
        matches = [f"tcp dport {{ {listed} }} ", f"tcp sport {{ {listed} }} "] if ports else [""]
        inbound = " ".join(f"iifname {interface} {match}drop;" for match in matches)
        outbound = " ".join(f"oifname {interface} {match}drop;" for match in matches)
        rules = (
            f"table inet {_TABLE} {{\n"
            f"  chain input {{ type filter hook input priority 0; {inbound} }}\n"
            f"  chain output {{ type filter hook output priority 0; {outbound} }}\n"
            "}\n"
        )
        _ip(*self.exec_in(node, ["nft", "-f", "-"]), stdin=rules)

    def unblock(self, node: int) -> None:
        """Remove what :meth:`block` added (a no-op when nothing is blocked)."""
        subprocess.run(
            self.exec_in(node, ["nft", "delete", "table", "inet", _TABLE]),
            capture_output=True,
            timeout=_COMMAND_TIMEOUT_S,
            check=False,
        )

    def remove(self) -> None:
        """Delete both namespaces (their veth ends and nftables tables go with them).

        The veth is also deleted from the host's namespace, where it is after a failed build.
        """
        commands = [["ip", "netns", "delete", namespace] for namespace in self.namespaces]
        commands.append(["ip", "link", "delete", self.interfaces[0]])
        for command in commands:
            subprocess.run(command, capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)

    def __enter__(self) -> TwoNodes:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.remove()
