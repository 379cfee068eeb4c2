"""A lost rank's survivors go on in place: real rank processes, every default on.

Each job is ``tests/_inplace_script.py`` on 3 gloo ranks started as a launcher does
(``run_ranks``: the store lives in the test process, as in torchrun's agent); one rank is
SIGKILLed at the start of a step. On torch 2.14+ the group's gloo backend is reconfigured in
place, on older releases a new one is made: the test runs on whatever torch is installed (CI:
the newest and the floor).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _rank_processes import Ended, run_ranks

SCRIPT = Path(__file__).parent / "_inplace_script.py"
STEPS = 8
#: The grow jobs: long enough, at PACE_S a step while shrunk, for a replacement to import torch.
GROW_STEPS, PACE_S = 30, 0.4


def _said(rank: Ended, what: str) -> list[str]:
    return re.findall(rf"rank {rank.rank}: {what} (.+)", rank.stdout)


def _digest(ranks: list[Ended], rank: int) -> str:
    (found,) = _said(ranks[rank], "digest")
    return found


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The exact-mode digest of the job with no rank lost (3 ranks)."""
    ranks = run_ranks(SCRIPT, 3, args=("--steps", str(STEPS)), timeout=90)
    assert [r.returncode for r in ranks] == [0, 0, 0], [r.stderr[-2000:] for r in ranks]
    digests = {_digest(ranks, r) for r in range(3)}
    assert len(digests) == 1
    return digests.pop()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kill", "ddp"),
    [("2@5", False), ("2@5", True), ("1@0", False)],
    ids=["hand-written-step5", "ddp-step5", "hand-written-first-collective"],
)
def test_a_killed_rank_costs_a_regroup_and_the_bits_of_an_uninterrupted_run(
    uninterrupted: str, kill: str, ddp: bool
) -> None:
    """Exact mode: the two survivors end with the digest of the uninterrupted 3-rank job."""
    killed = int(kill.split("@")[0])
    args = ("--steps", str(STEPS), "--kill", kill, *(("--ddp",) if ddp else ()))
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=90)
    survivors = [r for r in ranks if r.rank != killed]
    assert ranks[killed].returncode == -9
    assert [r.returncode for r in survivors] == [0, 0], [r.stderr[-3000:] for r in survivors]
    for rank in survivors:
        assert _said(rank, "world") == ["2"]
        assert _said(rank, "digest") == [uninterrupted]
        (recovery,) = _said(rank, "recovery")
        assert recovery.split()[:2] == ["1", str(killed)]  # epoch 1, the launch rank lost
    said = "".join(r.stderr for r in survivors)
    assert re.search(rf"launch rank\(s\) \[{killed}\] lost; 2 rank\(s\) go on in place", said)


@pytest.mark.slow
def test_without_exact_mode_the_survivors_stay_replicas() -> None:
    """A float DDP job: not the uninterrupted bits (the sums' order follows the world size),
    but both survivors hold the same parameters and finish every step."""
    args = ("--steps", str(STEPS), "--kill", "2@4", "--ddp", "--float")
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=90)
    assert [r.returncode for r in ranks[:2]] == [0, 0], [r.stderr[-3000:] for r in ranks[:2]]
    assert _digest(ranks, 0) == _digest(ranks, 1)
    assert _said(ranks[0], "committed")[-1].split()[0] == str(STEPS)


@pytest.mark.slow
def test_a_stopped_rank_is_not_shrunk_away() -> None:
    """Rank 2 SIGSTOPs itself: alive, so never proven ended. The survivors' collective times
    out (a 4 s group timeout) and the job ends as before, with the typed error naming rank 2;
    no rank goes on in place (two halves must never go on alone). Rank 1 may end up to a
    second after rank 0 (the one that writes the hang report, or after torch's gloo exit abort
    of the other): the harness gives it 5 s before it kills what is left."""
    args = ("--steps", str(STEPS), "--stop", "2@3", "--timeout", "4")
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=90, stop_after=0, grace_s=5.0)
    for rank in ranks[:2]:
        assert rank.returncode not in (0, None), rank.stderr[-3000:]
        # the timeout's typed error names the stopped rank (through shared memory, the path's)
        assert re.search(r"timed out.*not taking part \(rank 2\)", rank.stderr), rank.stderr[-3000:]
        assert "go on in place" not in rank.stderr
        assert _said(rank, "digest") == []


def _states(ranks: list[Ended]) -> dict[int, set[str]]:
    """Every ``state S HEX`` the ranks printed (``--zero``), by step: one digest a step."""
    found: dict[int, set[str]] = {}
    for rank in ranks:
        for line in _said(rank, "state"):
            step, digest = line.split()
            found.setdefault(int(step), set()).add(digest)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("where", ["start", "update"])
def test_a_zero_optimizer_goes_on_from_the_copies_of_its_shards(where: str) -> None:
    """The demo's ZeroAdamW (each rank holds a third of its state): rank 1 is SIGKILLed at the
    start of step 5, or after its backward (the survivors have updated their shards and wait
    in the step's gather: torn). The survivors take its share from rank 2's copy, go back to
    step 5, re-cut for 2 ranks: the model's and the whole optimizer state's digest at step 5
    is the one every rank printed before the kill, and they end as replicas."""
    args = ("--zero", "--steps", str(STEPS), "--kill", "1@5", "--kill-in", where)
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=90)
    survivors = [ranks[0], ranks[2]]
    assert ranks[1].returncode == -9
    assert [r.returncode for r in survivors] == [0, 0], [r.stderr[-3000:] for r in survivors]
    states = _states(ranks)
    assert sorted(states) == list(range(STEPS))
    assert all(len(digests) == 1 for digests in states.values()), states
    for rank in survivors:
        assert [line.split()[0] for line in _said(rank, "state")].count("5") == 2  # again
        assert _said(rank, "world") == ["2"]
        (recovery,) = _said(rank, "recovery")
        assert recovery.split()[:2] == ["1", "1"]
    assert _digest(ranks, 0) == _digest(ranks, 2)


@pytest.mark.slow
def test_a_zero_optimizer_whose_share_is_gone_twice_raises_state_lost() -> None:
    """4 ranks, ZeroAdamW: ranks 1 and 2 (2 holds 1's copy) SIGKILLed together. Rank 1's share
    is nowhere: both survivors raise StateLostError (a restart resumes the job) and end."""
    args = ("--zero", "--steps", str(STEPS), "--kill", "1@5,2@5")
    ranks = run_ranks(SCRIPT, 4, args=args, timeout=90)
    for rank in (ranks[0], ranks[3]):
        assert rank.returncode == 1, rank.stderr[-3000:]
        assert "StateLostError: a share of the sharded state is gone" in rank.stderr
        assert _said(rank, "digest") == []


@pytest.mark.slow
def test_a_replacement_takes_its_share_of_a_zero_optimizer() -> None:
    """ZeroAdamW: launch rank 2 SIGKILLed at step 2 and started again (the harness's
    ``--max-restarts``). The survivors shrink to halves; the replacement is admitted, every
    rank cuts its third from the copies, and every state digest any rank printed (the
    replacement's included) is the one of its step."""
    args = ("--zero", "--steps", str(GROW_STEPS), "--kill", "2@2", "--pace", str(PACE_S))
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=120, restart=(2,))
    finished = [ranks[0], ranks[1], ranks[3]]
    assert [r.returncode for r in finished] == [0, 0, 0], [r.stderr[-3000:] for r in finished]
    assert all(len(digests) == 1 for digests in _states(ranks).values())
    assert len(_said(ranks[3], "state")) > 0  # the replacement trained
    assert {_digest(ranks, r) for r in (0, 1, 3)} == {_digest(ranks, 0)}
    for rank in finished:
        assert _said(rank, "world") == ["3"]


@pytest.fixture(scope="module")
def uninterrupted_grow() -> str:
    """The exact-mode digest of the grow jobs' length with no rank lost (3 ranks)."""
    ranks = run_ranks(SCRIPT, 3, args=("--steps", str(GROW_STEPS)), timeout=90)
    assert [r.returncode for r in ranks] == [0, 0, 0], [r.stderr[-2000:] for r in ranks]
    return _digest(ranks, 0)


@pytest.mark.slow
@pytest.mark.parametrize("ddp", [False, True], ids=["hand-written", "ddp"])
def test_a_replacement_joins_in_place_and_the_job_ends_with_the_uninterrupted_bits(
    uninterrupted_grow: str, ddp: bool
) -> None:
    """Launch rank 2 is SIGKILLed at step 2 and started again as torchrun's agent does with
    ``--max-restarts`` (same environment, ``TORCHELASTIC_RESTART_COUNT=1``; simulated by the
    harness, in this process's store). The two survivors shrink and go on; the replacement's
    init finds the running group, its InPlace is admitted at a step boundary, takes the state
    from a survivor's memory, and all three end with the uninterrupted 3-rank job's digest."""
    args = ("--steps", str(GROW_STEPS), "--kill", "2@2", "--pace", str(PACE_S))
    ranks = run_ranks(
        SCRIPT, 3, args=(*args, *(("--ddp",) if ddp else ())), timeout=120, restart=(2,)
    )
    first, replacement = ranks[2], ranks[3]
    assert first.returncode == -9
    finished = [ranks[0], ranks[1], replacement]
    assert [r.returncode for r in finished] == [0, 0, 0], [r.stderr[-3000:] for r in finished]
    for rank in finished:
        assert _said(rank, "world") == ["3"]
        assert _said(rank, "digest") == [uninterrupted_grow]
    for rank in ranks[:2]:
        shrink, grow = (line.split() for line in _said(rank, "recovery"))
        assert shrink[:3] == ["1", "2", "-"]  # epoch 1: launch rank 2 lost
        assert grow[:3] == ["2", "-", "3"]  # epoch 2: newcomer 3 (after the first 3 ids) joined
    (admitted,) = _said(replacement, "recovery")
    assert admitted.split()[0] == "2"
    assert re.search(r"newcomer\(s\) \[3\] joined; 3 rank\(s\) go on in place", ranks[0].stderr)


@pytest.mark.slow
def test_a_subgroup_made_before_a_regroup_refuses_with_a_typed_error() -> None:
    """A subgroup and a device mesh of all 3 ranks, made before rank 2 is lost: afterwards a
    collective on the subgroup, distcompat's or torch's, its size, and the mesh's size and group
    (the default group itself) raise StaleGroupError on both survivors, never wait for the lost
    rank nor answer the old numbers."""
    args = ("--steps", "4", "--kill", "2@1", "--subgroup")
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=90)
    for rank in ranks[:2]:
        assert rank.returncode == 0, rank.stderr[-3000:]
        for name in ("distcompat", "torch", "size", "mesh size", "mesh group"):
            assert _said(rank, f"subgroup {name}") == ["StaleGroupError"], rank.stdout[-2000:]


@pytest.mark.slow
def test_a_member_lost_after_a_grow_leaves_the_newcomer_going_on(uninterrupted_grow: str) -> None:
    """Shrink, grow, shrink: launch rank 2 is killed at step 2 and replaced (it joins as
    newcomer 3), then launch rank 1 is killed at step 26 (not replaced). Rank 0 and the
    newcomer finish at 2 ranks with the uninterrupted run's digest: a newcomer is a member like
    any other, for the state it holds and for the next regroup."""
    args = ("--steps", str(GROW_STEPS), "--kill", "2@2,1@26", "--pace", str(PACE_S))
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=120, restart=(2,))
    finished = [ranks[0], ranks[3]]
    assert [r.returncode for r in finished] == [0, 0], [r.stderr[-3000:] for r in finished]
    assert ranks[1].returncode == -9
    for rank in finished:
        assert _said(rank, "world") == ["2"]
        assert _said(rank, "digest") == [uninterrupted_grow]
    epochs = [line.split()[:3] for line in _said(ranks[0], "recovery")]
    assert epochs == [["1", "2", "-"], ["2", "-", "3"], ["3", "1", "-"]]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_newcomer_that_vanishes_before_it_comes_is_left_out(
    uninterrupted_grow: str, how: str
) -> None:
    """Launch rank 2 is killed at step 2 and replaced; the replacement SIGKILLs (or SIGSTOPs)
    itself once the members propose to admit it. They admit it and, at the regroup, leave it
    out: at once when its process ended, after JOIN_S when it is stopped (it holds no state
    yet, so time alone may leave it out). They agree again without it, never wait for the group
    timeout (120 s here), and end with the uninterrupted run's digest at 2 ranks; the stopped
    one, resumed later, is fenced (FencedError), never joins silently."""
    args = ("--steps", str(GROW_STEPS), "--kill", "2@2", "--pace", str(PACE_S),
            "--vanish", how, "--timeout", "120")  # fmt: skip
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=120, restart=(2,))
    finished, replacement = ranks[:2], ranks[3]
    assert [r.returncode for r in finished] == [0, 0], [r.stderr[-3000:] for r in finished]
    assert _said(replacement, "vanished") == [how]
    for rank in finished:
        assert _said(rank, "world") == ["2"]
        assert _said(rank, "digest") == [uninterrupted_grow]
    epochs = [line.split()[:3] for line in _said(ranks[0], "recovery")]
    assert epochs == [["1", "2", "-"], ["3", "3", "-"]]  # epoch 2 (the grow) never completed
    if how == "kill":
        assert replacement.returncode == -9
    else:
        assert replacement.returncode not in (0, None), replacement.stderr[-3000:]
        assert "FencedError" in replacement.stderr
        assert "left it out" in replacement.stderr


@pytest.mark.slow
@pytest.mark.parametrize("when", ["said", "admitted"])
def test_a_member_lost_while_a_newcomer_joins_leaves_the_newcomer_going_on(
    uninterrupted_grow: str, when: str
) -> None:
    """Launch rank 2 is killed at step 2 and replaced; launch rank 1 SIGKILLs itself once it
    said yes to admitting the newcomer (its peers' next collective fails: they shrink, then
    admit the newcomer at the next epoch), or once the leader admitted it (at the regroup,
    rank 0 sees rank 1's end, and the newcomer, which watches no member yet, sees rank 0 go on
    to the next agreement and agrees with it; under load the kill, which a thread polling the
    store makes, may come only after the grow came together: a shrink follows). Neither waits
    for the group timeout (120 s here); both end with the uninterrupted run's digest at 2
    ranks."""
    args = ("--steps", str(GROW_STEPS), "--kill", "2@2", "--pace", str(PACE_S),
            "--die-at-grow", f"1@{when}", "--timeout", "120")  # fmt: skip
    ranks = run_ranks(SCRIPT, 3, args=args, timeout=120, restart=(2,))
    finished = [ranks[0], ranks[3]]
    assert [r.returncode for r in finished] == [0, 0], [r.stderr[-3000:] for r in finished]
    assert ranks[1].returncode == -9
    assert _said(ranks[1], "vanished") == ["kill"]
    for rank in finished:
        assert _said(rank, "world") == ["2"]
        assert _said(rank, "digest") == [uninterrupted_grow]
    epochs = [line.split()[:3] for line in _said(ranks[0], "recovery")]
    if when == "said":  # epoch 2: the shrink; epoch 3: the grow
        assert epochs == [["1", "2", "-"], ["2", "1", "-"], ["3", "-", "3"]]
    elif len(epochs) == 2:  # epoch 2 (the grow) never came together; epoch 3: rank 1 lost,
        # the newcomer in
        assert epochs == [["1", "2", "-"], ["3", "1", "3"]]
        assert [line.split()[:3] for line in _said(ranks[3], "recovery")] == [["3", "1", "-"]]
    else:  # rank 1's kill thread (it polls the store) came after epoch 2 came together, as
        # under load it may: the grow, then a shrink without rank 1
        assert epochs == [["1", "2", "-"], ["2", "-", "3"], ["3", "1", "-"]]
