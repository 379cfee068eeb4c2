"""write_tokens and TokenLoader: exact windows, disjoint complete shards, exact (elastic) resume.

Token files here hold their own global positions (file f's i-th token is ``start_f + i``), so every
row of a batch names the window it came from by its first token and can be checked against the
files without trusting the loader.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcompat.data import (
    EmptyShardError,
    EpochRepeatWarning,
    LoaderStateError,
    ShardedSampler,
    TokenFileError,
    TokenLoader,
    TokenRangeError,
    write_tokens,
)
from distcompat.testing import run_on_ranks

DTYPES = [torch.uint16, torch.uint32]
tmp_settings = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _files(root: Path, lengths: list[int], dtype: torch.dtype) -> tuple[list[Path], list[int]]:
    """Write files of the given lengths whose tokens are their global positions; return windows."""
    paths, start = [], 0
    for i, length in enumerate(lengths):
        paths.append(write_tokens(root / f"f{i}.bin", torch.arange(start, start + length), dtype))
        start += length
    return paths, [0, *_cumsum(lengths)]


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _valid_starts(bounds: list[int], seq_len: int) -> set[int]:
    """First tokens of all windows: ``start_f + w*T`` while the T+1 tokens fit in the file."""
    starts: set[int] = set()
    for lo, hi in itertools.pairwise(bounds):
        starts.update(range(lo, hi - seq_len, seq_len))
    return starts


def _firsts(inputs: torch.Tensor, targets: torch.Tensor, seq_len: int) -> list[int]:
    """Check each row is T+1 consecutive tokens (targets shifted by one); return first tokens."""
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape
    assert inputs.shape[1] == seq_len
    assert inputs.is_contiguous()
    assert targets.is_contiguous()
    ramp = torch.arange(seq_len)
    for row_in, row_tg in zip(inputs, targets, strict=True):
        assert torch.equal(row_in, row_in[0] + ramp)
        assert torch.equal(row_tg, row_in + 1)
    return inputs[:, 0].tolist()


# --- write_tokens ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_tokens_is_flat_little_endian(tmp_path: Path, dtype: torch.dtype) -> None:
    top = 65535 if dtype == torch.uint16 else 2**32 - 1
    tokens = [0, 1, 258, top]
    path = write_tokens(tmp_path / "t.bin", tokens, dtype)
    raw = path.read_bytes()
    width = 2 if dtype == torch.uint16 else 4
    decoded = [int.from_bytes(raw[i : i + width], "little") for i in range(0, len(raw), width)]
    assert decoded == tokens
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]  # no temp file left behind


@pytest.mark.parametrize(
    ("tokens", "dtype", "match"),
    [
        ([1, 65536], torch.uint16, "token 65536 at position 1 does not fit"),
        ([-1], torch.uint32, "token -1 at position 0"),
        ([2**32], "uint32", "does not fit torch.uint32"),
    ],
)
def test_write_tokens_refuses_tokens_that_do_not_fit(
    tmp_path: Path, tokens: list[int], dtype: torch.dtype | str, match: str
) -> None:
    with pytest.raises(TokenRangeError, match=match):
        write_tokens(tmp_path / "t.bin", tokens, dtype)
    assert list(tmp_path.iterdir()) == []


def test_write_tokens_refuses_other_shapes_and_dtypes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1-D integer"):
        write_tokens(tmp_path / "t.bin", torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D integer"):
        write_tokens(tmp_path / "t.bin", torch.zeros(3))
    with pytest.raises(ValueError, match=r"torch\.uint16 or torch\.uint32"):
        write_tokens(tmp_path / "t.bin", [1], torch.int32)


def test_write_tokens_empty_file(tmp_path: Path) -> None:
    assert write_tokens(tmp_path / "e.bin", []).stat().st_size == 0


# --- TokenLoader: windows, shards ------------------------------------------------------------


@tmp_settings
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    seq_len=st.integers(1, 16),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    reader=st.sampled_from(["pread", "mmap"]),
)
def test_epoch_is_disjoint_complete_and_exact(
    tmp_path_factory: pytest.TempPathFactory,
    lengths: list[int],
    seq_len: int,
    batch_size: int,
    world: int,
    dtype: torch.dtype,
    shuffle: bool,
    seed: int,
    reader: str,
) -> None:
    paths, bounds = _files(tmp_path_factory.mktemp("tok"), lengths, dtype)
    valid = _valid_starts(bounds, seq_len)
    if len(valid) < world * batch_size:
        with pytest.raises(EmptyShardError, match="would get no batch"):
            TokenLoader(
                paths, batch_size=batch_size, seq_len=seq_len, dtype=dtype, world_size=world, rank=0
            )
        return
    seen: list[int] = []
    for rank in range(world):
        loader = TokenLoader(
            paths, batch_size=batch_size, seq_len=seq_len, dtype=dtype, rank=rank,
            world_size=world, seed=seed, shuffle=shuffle, reader=reader,
        )  # fmt: skip
        batches = [_firsts(x, y, seq_len) for x, y in loader]
        assert len(batches) == len(loader) == len(valid) // (world * batch_size)
        seen += [first for batch in batches for first in batch]
    assert len(seen) == len(set(seen))  # disjoint across ranks and batches
    assert set(seen) <= valid
    assert (
        len(seen) == len(valid) // (world * batch_size) * world * batch_size
    )  # only the tail lost
    if not shuffle:  # file order: the dropped tail is the last windows
        assert sorted(seen) == sorted(valid)[: len(seen)]


def test_windows_do_not_cross_files_and_empty_files_are_fine(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, [10, 0, 1, 7], torch.uint16)
    loader = TokenLoader(paths, batch_size=1, seq_len=3, shuffle=False)
    firsts = [_firsts(x, y, 3)[0] for x, y in loader]
    assert firsts == [0, 3, 6, 11, 14]  # file 0: 0,3,6 (9 would need token 12); file 3: 11,14


def test_big_uint32_tokens(tmp_path: Path) -> None:
    tokens = torch.tensor([70_000, 2**32 - 1, 5, 2**31, 123_456_789])
    path = write_tokens(tmp_path / "big.bin", tokens, "uint32")
    x, y = next(iter(TokenLoader(path, batch_size=1, seq_len=4, dtype="uint32", shuffle=False)))
    assert x[0].tolist() == tokens[:4].tolist()
    assert y[0].tolist() == tokens[1:].tolist()


def test_epochs_advance_without_set_epoch(tmp_path: Path) -> None:
    paths, _ = _files(tmp_path, [1601], torch.uint16)  # 200 windows: no tail to drop
    loader = TokenLoader(paths, batch_size=4, seq_len=8, seed=1)
    first = [_firsts(x, y, 8) for x, y in loader]
    assert loader.epoch == 1
    second = [_firsts(x, y, 8) for x, y in loader]
    assert first != second
    assert sorted(itertools.chain(*first)) == sorted(itertools.chain(*second))
    with pytest.warns(EpochRepeatWarning, match="epoch 1 was already completed"):
        loader.set_epoch(1)  # the epoch just completed: its order repeats, loudly
    assert [_firsts(x, y, 8) for x, y in loader] == second
    loader.set_epoch(0)  # a jump to another epoch: no warning
    assert [_firsts(x, y, 8) for x, y in loader] == first


def test_bad_inputs_raise_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reader must be 'auto', 'pread' or 'mmap', got 'disk'"):
        TokenLoader(tmp_path / "x.bin", batch_size=1, seq_len=1, reader="disk")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(TokenFileError, match=r"3 bytes is not a whole number of torch\.uint16"):
        TokenLoader(odd, batch_size=1, seq_len=1)
    with pytest.raises(ValueError, match="at least one token file"):
        TokenLoader([], batch_size=1, seq_len=1)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        TokenLoader(odd, batch_size=0, seq_len=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        TokenLoader(odd, batch_size=1, seq_len=1, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError):
        TokenLoader(tmp_path / "missing.bin", batch_size=1, seq_len=1)


def test_too_little_data_for_every_rank_raises(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", torch.arange(33))  # 4 windows of 8+1
    for rank in range(3):
        with pytest.raises(EmptyShardError, match="4 window"):
            TokenLoader(path, batch_size=2, seq_len=8, world_size=3, rank=rank)


# --- resume ----------------------------------------------------------------------------------


def _run(loaders: list[TokenLoader], steps: int | None, seq_len: int) -> list[int]:
    """Step all ranks together (like a training loop) ``steps`` times or to the epoch's end."""
    iters = [iter(loader) for loader in loaders]
    seen: list[int] = []
    step = 0
    while steps is None or step < steps:
        try:
            batches = [next(it) for it in iters]
        except StopIteration:  # every rank must stop at the same step
            assert all(next(it, None) is None for it in iters)
            break
        for x, y in batches:
            seen += _firsts(x, y, seq_len)
        step += 1
    return seen


@tmp_settings
@given(
    lengths=st.lists(st.integers(50, 400), min_size=1, max_size=3),
    seq_len=st.integers(1, 8),
    old=st.tuples(st.integers(1, 4), st.integers(1, 3)),  # world, batch size
    new=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stop=st.floats(0, 1, allow_subnormal=False),  # torch 2.4 inductor kernels set FTZ
    shuffle=st.booleans(),
    epoch=st.integers(0, 2),
)
def test_resume_on_any_world_size_sees_the_epoch_once(
    tmp_path_factory: pytest.TempPathFactory,
    lengths: list[int],
    seq_len: int,
    old: tuple[int, int],
    new: tuple[int, int],
    stop: float,
    shuffle: bool,
    epoch: int,
) -> None:
    paths, bounds = _files(tmp_path_factory.mktemp("tok"), lengths, torch.uint16)
    n = len(_valid_starts(bounds, seq_len))

    def make(world: int, batch: int) -> list[TokenLoader]:
        return [
            TokenLoader(paths, batch_size=batch, seq_len=seq_len, rank=r, world_size=world,
                        seed=7, shuffle=shuffle)
            for r in range(world)
        ]  # fmt: skip

    def fresh_epoch(world: int, batch: int, number: int) -> list[int]:
        loaders = make(world, batch)
        for loader in loaders:
            loader.set_epoch(number)
        return _run(loaders, None, seq_len)

    if n < max(old[0] * old[1], new[0] * new[1]):
        with pytest.raises(EmptyShardError):
            make(*old) if n < old[0] * old[1] else make(*new)
        return
    before = make(*old)
    for loader in before:
        loader.set_epoch(epoch)
    steps = int(stop * len(before[0]))
    seen = _run(before, steps, seq_len)
    states = [loader.state_dict() for loader in before]
    assert all(state == states[0] for state in states)  # any rank's state will do
    done = steps * old[0] * old[1]
    assert states[0]["consumed"] == done
    after = make(*new)
    for loader in after:
        loader.load_state_dict(states[-1])
        loader.set_epoch(epoch)  # the usual loop after a resume: keeps the position
    rest = _run(after, None, seq_len)
    if n - done < new[0] * new[1]:  # nothing left for a whole round: the next epoch begins
        assert rest == fresh_epoch(*new, epoch + 1)
        return
    seen += rest
    assert len(seen) == len(set(seen))  # nothing twice
    assert len(seen) == done + (n - done) // (new[0] * new[1]) * new[0] * new[1]
    if old == new:  # same layout: the very batches an uninterrupted run yields
        assert seen == fresh_epoch(*old, epoch)
    assert all(loader.epoch == epoch + 1 for loader in after)


def test_state_of_other_data_is_refused(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", torch.arange(200))
    state = TokenLoader(path, batch_size=1, seq_len=8).state_dict()
    with pytest.raises(LoaderStateError, match="seq_len=8 but this TokenLoader has seq_len=4"):
        TokenLoader(path, batch_size=1, seq_len=4).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="shuffle"):
        TokenLoader(path, batch_size=1, seq_len=8, shuffle=False).load_state_dict(state)
    other = ShardedSampler(range(24), num_replicas=1, rank=0).state_dict()
    with pytest.raises(LoaderStateError, match="state dict of a 'ShardedSampler'"):
        TokenLoader(path, batch_size=1, seq_len=8).load_state_dict(other)
    with pytest.raises(LoaderStateError, match=r"not a distcompat\.data state dict"):
        TokenLoader(path, batch_size=1, seq_len=8).load_state_dict({"epoch": 1})


def test_state_adopts_the_saved_seed(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", torch.arange(500))
    a = TokenLoader(path, batch_size=2, seq_len=4, seed=11)
    b = TokenLoader(path, batch_size=2, seq_len=4, seed=99)
    b.load_state_dict(a.state_dict())
    assert [x.tolist() for x, _ in a] == [x.tolist() for x, _ in b]


# --- memory ----------------------------------------------------------------------------------


def _rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile line")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("reader", ["pread", "mmap"])
def test_resident_memory_stays_flat_over_a_full_epoch(tmp_path: Path, reader: str) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(64 << 20))  # 64 MiB of uint16 tokens
    base = _rss_file_kib()
    loader = TokenLoader(path, batch_size=8, seq_len=1024, reader=reader)
    assert loader.reader.reader == reader
    assert _rss_file_kib() - base < 1 << 10  # opening (or mapping) reads nothing
    peak = 0
    for _ in loader:
        peak = max(peak, _rss_file_kib() - base)
    assert len(loader) * 8 * 1024 * 2 > 60 << 20  # the epoch did read (nearly) the whole file
    # pread maps nothing; mmap keeps at most one batch's faults (up to ~1 MiB each on kernels
    # with large page-cache folios) before it hands the pages back
    assert peak < (1 << 10 if reader == "pread" else 24 << 10), f"peak {peak} KiB of 64 MiB"


# --- a real group ----------------------------------------------------------------------------


def _rank_reads(path: str) -> tuple[list[int], dict[str, int | bool | str]]:
    loader = TokenLoader(path, batch_size=2, seq_len=8)  # rank and world from the group
    it = iter(loader)
    firsts = [first for _ in range(3) for first in next(it)[0][:, 0].tolist()]
    return firsts, loader.state_dict()


def test_on_real_gloo_ranks_defaults_come_from_the_group(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", torch.arange(1000))
    results = run_on_ranks(_rank_reads, 2, args=(str(path),))
    (a, state_a), (b, state_b) = results
    assert state_a == state_b
    assert state_a["world_size"] == 2
    assert state_a["consumed"] == 3 * 2 * 2
    assert not set(a) & set(b)
    assert len(a) == len(b) == 6
