"""Shared test set-up: the distcompat pytest plugin gives every test the ``run_on_ranks`` fixture."""

pytest_plugins = ["distcompat.testing.pytest_plugin"]
