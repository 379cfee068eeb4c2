"""What ran out, said with its numbers (``distcompat._scarcity``)."""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

from _no_fds import no_fds
from distcompat._scarcity import exhausted, free_bytes, open_file_limit, open_files, ran_out, size


def test_errors_that_are_not_exhaustion_say_nothing() -> None:
    assert ran_out(errno.ENOENT) == ""
    assert ran_out(None) == ""
    assert not exhausted(errno.EACCES)
    assert all(exhausted(code) for code in (errno.EMFILE, errno.ENFILE, errno.ENOSPC))


def test_too_many_open_files_names_the_limit_where_it_ran_out() -> None:
    with no_fds():
        try:
            os.open(os.devnull, os.O_RDONLY)
        except OSError as exc:
            said, limit = ran_out(exc.errno), open_file_limit()
        else:
            raise AssertionError("an open succeeded with no descriptor left")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert limit < soft  # read inside the block: the lowered limit
    assert said.startswith(f"too many open files: this process holds all {limit} its limit")
    assert f"/proc/{os.getpid()}/fd" in said
    assert (open_files() or 0) > 0


def test_a_full_disk_says_where_what_was_needed_and_what_was_free(tmp_path: Path) -> None:
    free, total = free_bytes(tmp_path / "not" / "made" / "yet") or (-1, -1)
    assert 0 <= free <= total
    said = ran_out(errno.ENOSPC, path=tmp_path / "rank-00001.pt", needed=3 << 20)
    assert said.startswith(f"no space left on device at {tmp_path / 'rank-00001.pt'}: ")
    assert "needed 3.0 MiB, " in said
    assert f" free of {size(total)}" in said
    assert ran_out(errno.EDQUOT).startswith("disk quota exceeded")


def test_sizes_read_as_people_write_them() -> None:
    assert [size(n) for n in (0, 1023, 1024, 5 << 20, 3 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "3.0 TiB",
    ]  # fmt: skip
