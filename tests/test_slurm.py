"""Slurm host-list and tasks-per-node expansion: forms Slurm writes, and what it never does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distcompat.launch._slurm import (
    MAX_ENTRIES,
    SlurmFormatError,
    expand_hostlist,
    expand_tasks_per_node,
)
from strategies import compress_counts, host_lists


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu5", ["gpu5"]),
        ("host-1", ["host-1"]),
        ("node01.cluster.org", ["node01.cluster.org"]),
        ("n[1-2]", ["n1", "n2"]),
        ("n[7]", ["n7"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("node[001-004]", ["node001", "node002", "node003", "node004"]),
        ("gnode[10,20,25,37]", ["gnode10", "gnode20", "gnode25", "gnode37"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a,b,c", ["a", "b", "c"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a-[1-2]b[3,4]", ["a-1b3", "a-1b4", "a-2b3", "a-2b4"]),
        ("cn[1-2].ib,login", ["cn1.ib", "cn2.ib", "login"]),
        ("x_y[0-1]", ["x_y0", "x_y1"]),
        ("[1-3]", ["1", "2", "3"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "position", "problem"),
    [
        ("", 0, "empty host list"),
        ("node[01-03", 4, "'[' is never closed"),
        ("node01-03]", 9, "']' without a matching '['"),
        ("n[1-[2]]", 4, "nested '['"),
        ("n[5-3]", 2, "reversed range '5-3'"),
        ("n[1,,2]", 4, "empty range in brackets"),
        ("n[]", 2, "empty range in brackets"),
        ("a,,b", 2, "empty host name"),
        ("a,", 2, "empty host name"),
        (",a", 0, "empty host name"),
        ("n[a-b]", 2, "range 'a-b' is not N or N-M"),
        ("n[1-2-3]", 2, "range '1-2-3' is not N or N-M"),
        ("n[1-2],m[3-1]", 9, "reversed range '3-1'"),
        ("node 1", 4, "character ' ' is not allowed"),
        ("node(1)", 4, "character '(' is not allowed"),
        ("n[0-9999999]", 2, f"expands to more than {MAX_ENTRIES} hosts"),
    ],
)
def test_expand_hostlist_rejects(text: str, position: int, problem: str) -> None:
    with pytest.raises(SlurmFormatError) as info:
        expand_hostlist(text)
    assert info.value.position == position
    assert problem in info.value.problem
    assert isinstance(info.value, ValueError)
    assert repr(text) in str(info.value)
    assert f"position {position}" in str(info.value)


def test_cartesian_product_is_bounded_before_expanding() -> None:
    with pytest.raises(SlurmFormatError, match="more than"):
        expand_hostlist("a[0-999][0-999][0-9]")


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("4", [4]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("1,2(x2)", [1, 2, 2]),
        ("8(x1)", [8]),
        ("1,1,1", [1, 1, 1]),
        ("16(x128)", [16] * 128),
        ("0(x2),3", [0, 0, 3]),
    ],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(
    ("text", "position", "problem"),
    [
        ("", 0, "empty entry"),
        ("2,,1", 2, "empty entry"),
        ("2,", 2, "empty entry"),
        ("2(x0)", 0, "repeats fewer than once"),
        ("1,2(3)", 2, "entry '2(3)' is not COUNT or COUNT(xREPEAT)"),
        ("2(x3", 0, "is not COUNT"),
        ("-1", 0, "is not COUNT"),
        ("two", 0, "is not COUNT"),
        ("2 (x3)", 0, "is not COUNT"),
        ("1,2(x9999999)", 2, f"expands to more than {MAX_ENTRIES} nodes"),
    ],
)
def test_expand_tasks_per_node_rejects(text: str, position: int, problem: str) -> None:
    with pytest.raises(SlurmFormatError) as info:
        expand_tasks_per_node(text)
    assert info.value.position == position
    assert problem in info.value.problem


@given(host_lists())
def test_compressed_host_lists_round_trip(case: tuple[str, list[str]]) -> None:
    text, hosts = case
    assert expand_hostlist(text) == hosts


@given(st.lists(st.integers(0, 64), min_size=1, max_size=40))
def test_compressed_task_counts_round_trip(counts: list[int]) -> None:
    assert expand_tasks_per_node(compress_counts(counts)) == counts
