"""Tooling as code: every check this project runs, one nox session each.

    nox                      # the default sessions: tests, lint, typing, docs, launchers
    nox -s launchers -- --only mpich   # one launcher (tools/launchers/run.py's options)
    nox -s tests_cuda        # CUDA/NCCL tests; skips cleanly without a GPU
    nox -s torch_versions    # the suite on every supported torch (by hand: pulls CUDA builds)

Every session installs torch first and explicitly: a bare ``torch`` requirement would pull the
newest CUDA build from PyPI with several GB of CUDA libraries.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "lint", "typing", "docs", "launchers"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"  # the local CPU torch wheel is built for 3.11
#: torch for the default sessions; DISTCOMPAT_TORCH overrides it (e.g. a CUDA build on a GPU box).
TORCH = os.environ.get("DISTCOMPAT_TORCH", "torch==2.13.0")
#: The newest release (the local wheel) and the oldest we support (pyproject: torch>=2.4).
TORCH_MATRIX = ["2.13.0", "2.4.1"]
#: Checkers pinned to the versions the code was last checked with, so a new release cannot turn
#: a clean tree red; bump them on purpose.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
#: Ray Train for the launchers session; it does not require torch, and the torch pin is passed in
#: the same install so pip can never swap the local CPU build for a CUDA one.
RAY = "ray[train]==2.60.0"


def install(session: nox.Session, *extras: str, torch: str = TORCH) -> None:
    """Install torch explicitly, then distcompat (editable) with ``extras``."""
    session.install(torch)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on gloo multi-process groups (no GPU needed)."""
    install(session, "tests")
    session.run("pytest", "-m", "not cuda", *session.posargs)


@nox.session(python=PYTHON)
def tests_cuda(session: nox.Session) -> None:
    """Tests marked ``cuda`` (CUDA tensors, NCCL at world size 1); skips when there is no GPU."""
    install(session, "tests")
    probe = "import torch; print(int(torch.cuda.is_available()))"
    has_cuda = session.run("python", "-c", probe, silent=True) or ""
    if has_cuda.strip().splitlines()[-1:] != ["1"]:
        session.skip("no CUDA device visible to torch here: the cuda-marked tests need one")
    session.run("pytest", "-m", "cuda", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typing(session: nox.Session) -> None:
    """mypy --strict over the library, the tests, the benchmarks and this file."""
    install(session, "tests")
    session.install(MYPY, "nox>=2024.4")
    session.run("mypy")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the docs with warnings as errors."""
    install(session, "docs")
    site = str(session.cache_dir / "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON)
def launchers(session: nox.Session) -> None:
    """A probe under every launcher (torchrun, two netns nodes, Open MPI, MPICH, Slurm, Ray Train)
    and network faults on the two nodes; installs the launchers it lacks (apt-get, as root)."""
    session.run("python", "tools/launchers/install.py")
    install(session)
    session.install(RAY, TORCH)
    session.run("python", "tools/launchers/run.py", *session.posargs)


@nox.session(python=PYTHON)
@nox.parametrize("torch_version", TORCH_MATRIX)
def torch_versions(session: nox.Session, torch_version: str) -> None:
    """The test suite on each supported torch (older ones come from PyPI with CUDA libraries)."""
    install(session, "tests", torch=f"torch=={torch_version}")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", "-m", "not cuda", *session.posargs)
