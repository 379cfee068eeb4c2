"""Shared test set-up: the distcompat pytest plugin gives tests the ``run_on_ranks`` fixture."""

from __future__ import annotations

import pytest

pytest_plugins = ["distcompat.testing.pytest_plugin"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``cuda`` where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `nox -s tests_cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
