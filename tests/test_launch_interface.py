"""Picking gloo's interface for a multi-node launch (``distcompat.launch._interface``).

The decision is tested with fabricated environments and fake route/address lookups (no second
node here); the two real lookups are tested on this host's loopback. The real two-node run, in
network namespaces, is ``test_two_netns_nodes_need_no_gloo_socket_ifname`` in
``test_process_group_environ.py``.
"""

from __future__ import annotations

import socket

import pytest

from distcompat.launch import LaunchEnv, launch_pitfalls, pick_gloo_interface
from distcompat.launch._interface import (
    AddressLookup,
    InterfacePick,
    RouteLookup,
    _ipv4_of,
    interface_with_address,
    route_source_address,
)

# torchrun --nnodes=2 --nproc-per-node=1, the second node (as seen in a netns run)
NODE1 = {
    "RANK": "1",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.77.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job",
}


def _routes(table: dict[str, str]) -> tuple[RouteLookup, AddressLookup]:
    holders = {"10.77.0.2": "veth1", "192.168.1.5": "eth0", "127.0.0.1": "lo"}
    return table.get, holders.get


def test_picks_the_interface_holding_the_route_source() -> None:
    route, holder = _routes({"10.77.0.1": "10.77.0.2"})
    env = LaunchEnv.from_environ(NODE1)
    pick = pick_gloo_interface(env, "gloo", route=route, holder=holder)
    assert pick == InterfacePick(
        name="veth1",
        reason=(
            "veth1: the interface whose route reaches MASTER_ADDR=10.77.0.1 "
            "(source address 10.77.0.2)"
        ),
    )


@pytest.mark.parametrize(
    ("change", "backend"),
    [
        ({"GLOO_SOCKET_IFNAME": "eth9"}, "gloo"),  # the user's setting wins
        ({}, "nccl"),  # gloo is not used
        ({"WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "RANK": "0", "GROUP_RANK": "0"}, "gloo"),
    ],
)
def test_nothing_to_pick(change: dict[str, str], backend: str) -> None:
    def fail(_: str) -> str:
        raise AssertionError("no lookup expected")

    env = LaunchEnv.from_environ(NODE1 | change)
    assert pick_gloo_interface(env, backend, route=fail, holder=fail) is None


@pytest.mark.parametrize(
    ("routes", "words"),
    [
        ({}, "no route from this host to MASTER_ADDR=10.77.0.1"),
        ({"10.77.0.1": "127.0.0.1"}, "reached through loopback"),
        ({"10.77.0.1": "10.9.9.9"}, "no interface holds 10.9.9.9"),
    ],
)
def test_no_fit_says_why(routes: dict[str, str], words: str) -> None:
    route, holder = _routes(routes)
    env = LaunchEnv.from_environ(NODE1)
    pick = pick_gloo_interface(env, None, route=route, holder=holder)
    assert pick is not None
    assert pick.name is None
    assert words in pick.reason


def test_multi_node_mpi_without_master_has_nothing_to_route_to() -> None:
    environ = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    env = LaunchEnv.from_environ(environ)
    pick = pick_gloo_interface(env, "gloo")
    assert pick == InterfacePick(name=None, reason="no rendezvous host (MASTER_ADDR) to route to")


def test_doctor_pitfall_says_what_init_will_pick() -> None:
    env = LaunchEnv.from_environ(NODE1)
    chosen = InterfacePick(name="veth1", reason="veth1: the interface whose route ...")
    (found,) = launch_pitfalls(env, backend="gloo", argv=[], pick=lambda e, b: chosen)
    assert found.name == "gloo-interface"
    assert "without GLOO_SOCKET_IFNAME" in found.problem
    assert "init_distributed sets GLOO_SOCKET_IFNAME=veth1 for its own process" in found.problem
    assert found.fix.startswith("none needed")
    none = InterfacePick(name=None, reason="no route from this host to MASTER_ADDR=10.77.0.1")
    (kept,) = launch_pitfalls(env, backend="gloo", argv=[], pick=lambda e, b: none)
    assert "found no interface to pick: no route" in kept.problem
    assert kept.fix.startswith("export GLOO_SOCKET_IFNAME=")


def test_real_lookups_on_loopback() -> None:
    """The two host lookups, on the one network every host has."""
    assert route_source_address("127.0.0.1") == "127.0.0.1"
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("not an address") is None
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: held by no interface here


def test_real_lookup_finds_an_interface_of_this_host() -> None:
    """Every non-loopback IPv4 interface of this host maps back to itself."""
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and not address.startswith("127."):
            assert interface_with_address(address) == name
