"""pytest plugin: the ``run_on_ranks`` fixture, and warm rank pools shut down with the session.

Enable it in a ``conftest.py``::

    pytest_plugins = ["distcompat.testing.pytest_plugin"]

    def test_sum(run_on_ranks):
        assert run_on_ranks(my_rank_fn, world_size=2) == [3, 3]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from distcompat.testing import run_on_ranks as runner
from distcompat.testing import shutdown_pools

__all__ = ["pytest_sessionfinish", "run_on_ranks"]


@pytest.fixture
def run_on_ranks() -> Callable[..., list[Any]]:
    """Provide :func:`distcompat.testing.run_on_ranks`, with warm pools shared across tests."""
    return runner


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the warm rank processes when the test session ends."""
    shutdown_pools()
