"""Tooling as code: every check this project runs, one nox session each.

    nox                      # the default sessions: tests, matrix, comparisons, anysize,
                             # hostile, conformance, lint, typing, docs, launchers, build,
                             # frameworks
    nox -s launchers -- --only mpich   # one launcher (tools/launchers/run.py's options)
    nox -s build             # sdist + wheel, twine check, the README quickstart from the wheel
    nox -s tests_cuda        # CUDA/NCCL tests; skips cleanly without a GPU
    nox -s conformance       # torch's own distributed tests through distcompat's group
    nox -s comparisons       # the programs compared with plain gloo bit for bit, once
    nox -s frameworks        # unchanged torchrun/mp.spawn/FSDP2/Lightning/Accelerate programs
                             # under distcompat run
    nox -s soak              # the same, 20 times over (races)
    nox -s anysize           # runs at world sizes 1-4 and across resizes, bit for bit
    nox -s torch_versions    # the suite on every supported torch (by hand: pulls CUDA builds)

Every session installs torch first and explicitly: a bare ``torch`` requirement would pull the
newest CUDA build from PyPI with several GB of CUDA libraries.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import nox

nox.options.sessions = [
    "tests", "matrix", "comparisons", "anysize", "hostile", "conformance", "lint", "typing",
    "docs", "launchers", "build", "frameworks",
]  # fmt: skip
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"  # the local CPU torch wheel is built for 3.11
#: torch for the default sessions; DISTCOMPAT_TORCH overrides it (e.g. a CUDA build on a GPU box).
TORCH = os.environ.get("DISTCOMPAT_TORCH", "torch==2.13.0")
#: The newest release (the local wheel) and the oldest we support (pyproject: torch>=2.8; below
#: 2.8 gloo's destroy_process_group hangs intermittently, see docs/launching.md).
TORCH_MATRIX = ["2.13.0", "2.8.0"]
#: Checkers pinned to the versions the code was last checked with, so a new release cannot turn
#: a clean tree red; bump them on purpose.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
#: Ray Train for the launchers session; it does not require torch, and the torch pin is passed in
#: the same install so pip can never swap the local CPU build for a CUDA one.
RAY = "ray[train]==2.60.0"
#: Lightning for the frameworks session, installed with the torch pin (as RAY is).
LIGHTNING = "lightning==2.6.6"
#: Hugging Face Accelerate for the frameworks session, with the torch pin: it pulls in
#: huggingface_hub, safetensors and psutil, not transformers.
ACCELERATE = "accelerate==1.15.0"
BUILD = "build==1.6.1"
TWINE = "twine==7.0.0"


def install(session: nox.Session, *extras: str, torch: str = TORCH) -> None:
    """Install torch explicitly, then distcompat (editable) with ``extras``."""
    session.install(torch)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on gloo multi-process groups (no GPU needed)."""
    install(session, "tests")
    # -m replaces pyproject's: the plain-gloo comparisons, the runs at several world sizes and
    # the hostile conditions run in their own sessions; --durations: the slowest items, to keep
    # the session under its 10-minute goal
    ignored = [arg for path in MATRIX for arg in ("--ignore", path)]
    session.run("pytest", "-m", "not cuda and not plain_gloo and not anysize and not hostile",
                *ignored, "--durations=15", *session.posargs)  # fmt: skip


#: Where real jobs hang, on real rank processes with every default on: the defaults matrix (36
#: scenarios, about 2 minutes on 2 cores); what a default init does about a late rank, a failed
#: collective and two jobs that hang; a hang's incidents read by torch's Flight Recorder
#: analyzer; a job with a stopped rank dumped on demand (about 1.5 minutes together). Their own
#: session keeps ``tests`` under 10 minutes.
MATRIX = [
    "tests/test_diagnostics_matrix.py",
    "tests/test_diagnostics_defaults.py",
    "tests/test_diagnostics_flight_dump.py",
    "tests/test_diagnostics_on_demand.py",
]


@nox.session(python=PYTHON)
def matrix(session: nox.Session) -> None:
    """Where real jobs hang, every default on, on real rank processes: the defaults matrix and
    the hang diagnostics' end-to-end jobs (``MATRIX``)."""
    install(session, "tests")
    session.run("pytest", *MATRIX, "-q", "-p", "no:cacheprovider", *session.posargs)


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
def conformance(session: nox.Session) -> None:
    """torch's DistributedTest._DistTestBase (in the wheel) on gloo, 2 ranks, with distcompat's
    init_process_group and every default on: every test that passes on plain gloo must pass
    (about 15 minutes on 2 cores). DISTCOMPAT_CONFORMANCE=torch runs torch's own init for the
    side-by-side count; ``-- -k NAME`` picks tests."""
    install(session, "tests")
    session.install("expecttest")  # torch.testing._internal imports it
    # torch's test code warns (deprecated torch.jit.script...): not this project's warnings
    settings = ["-o", "addopts=", "-W", "ignore", "-p", "no:cacheprovider"]
    session.run("pytest", "conformance/test_torch_distributed.py", "-q", *settings,
                *session.posargs)  # fmt: skip


#: The tests marked ``plain_gloo``: a program run on the protected group and on plain gloo,
#: compared bit for bit, where a race in the group shows as a hang or other bits (FSDP2 with its
#: state dicts and DCP on another world size, HSDP, the functional mix that hung in issue 40,
#: the differential random programs). Their own session keeps ``tests`` under 10 minutes.
COMPARED = [
    "tests/test_collectives_protected.py",
    "tests/test_collectives_protected_differential.py",
]


@nox.session(python=PYTHON)
def comparisons(session: nox.Session) -> None:
    """The programs compared with plain gloo bit for bit, once (about 1.5 minutes on 2 cores)."""
    install(session, "tests")
    session.run("pytest", *COMPARED, "-m", "plain_gloo", "-q", "-p", "no:cacheprovider",
                *session.posargs)  # fmt: skip


@nox.session(python=PYTHON)
def anysize(session: nox.Session) -> None:
    """The tests marked ``anysize``: runs at world sizes 1-4 and across resizes, compared bit for
    bit (exact mode, FSDP2 resharding through DCP); their own session keeps ``tests`` under 10
    minutes."""
    install(session, "tests")
    session.run("pytest", "tests", "-m", "anysize", "-q", "-p", "no:cacheprovider",
                *session.posargs)  # fmt: skip


@nox.session(python=PYTHON)
def hostile(session: nox.Session) -> None:
    """Jobs under conditions they do not control (tests/test_hostile.py: a stranger on the link
    ports, 1,024 open files, full file systems, a tiny /dev/shm; about a minute on 2 cores).
    The file systems need root (a mount namespace); without it those cases skip."""
    install(session, "tests")
    session.run("pytest", "tests/test_hostile.py", "-m", "hostile", "-q", "-p", "no:cacheprovider",
                *session.posargs)  # fmt: skip


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The comparisons ``SOAK_RUNS`` times (default 20) to catch races, stopping at the first
    failure; about 30 minutes on 2 cores, so on demand (``-- -k fsdp`` picks)."""
    install(session, "tests")
    runs = int(os.environ.get("SOAK_RUNS", "20"))
    for run in range(1, runs + 1):
        session.log(f"soak run {run} of {runs}")
        session.run("pytest", *COMPARED, "-m", "plain_gloo", "-q", "-x", "-p", "no:cacheprovider",
                    *session.posargs)  # fmt: skip


@nox.session(python=PYTHON)
def frameworks(session: nox.Session) -> None:
    """Unchanged programs under ``distcompat run`` (issue 48): torchrun DDP, ``mp.spawn`` with
    ``tcp://``, ``init_device_mesh`` + FSDP2, Lightning ``Trainer`` and Fabric, Hugging Face
    Accelerate (``accelerate launch`` through torchrun's agent) on 2 CPU ranks; Open MPI's
    ``mpirun`` (plain, and Accelerate's multi-CPU ``--mpirun_hostfile``) and Slurm's ``srun``
    where installed (the launchers session, before it in the default run, installs them;
    elsewhere those cases skip);
    the same bits as without it, a stall, a killed rank and mismatched shapes named (about 10
    minutes on 2 cores; the table of what each showed ends the output)."""
    install(session, "tests")
    session.install(TORCH, LIGHTNING, ACCELERATE)
    # addopts= : not the suite's doctest collection of src/ nor its marker filter
    session.run("pytest", "frameworks/test_frameworks.py", "-o", "addopts=", "-q", "-p",
                "no:cacheprovider", *session.posargs)  # fmt: skip


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


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build the sdist and wheel, check them, and run the README quickstart from the wheel.

    The wheel goes into a fresh venv (torch first), and everything runs from a scratch folder,
    so the installed wheel is imported, never the source tree.
    """
    session.install(BUILD, TWINE)
    scratch = Path(session.create_tmp()).resolve() / "build"
    shutil.rmtree(scratch, ignore_errors=True)
    dist = scratch / "dist"
    session.run("python", "-m", "build", "--outdir", str(dist), ".")
    session.run("twine", "check", "--strict", *(str(path) for path in sorted(dist.iterdir())))
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    _check_wheel(wheel)
    tests_dir = _check_sdist(sdist, scratch)

    bin_dir = scratch / "venv" / "bin"
    session.run("python", "-m", "venv", str(bin_dir.parent))
    python, distcompat = str(bin_dir / "python"), str(bin_dir / "distcompat")
    session.run(python, "-m", "pip", "install", "-q", TORCH, external=True)
    session.run(python, "-m", "pip", "install", "-q", f"{wheel}[tests]", external=True)

    with session.chdir(scratch):
        agree = (
            "import distcompat, sys; from importlib.metadata import version; "
            "assert distcompat.__file__.startswith(sys.prefix), distcompat.__file__; "
            "assert distcompat.__version__ == version('distcompat'), distcompat.__version__; "
            "print(distcompat.__version__)"
        )
        installed = _output(session, python, "-c", agree)
        shown = _output(session, distcompat, "--version")
        if shown != f"distcompat {installed}":
            session.error(f"distcompat --version says {shown!r}, the metadata {installed!r}")

        quickstart = scratch / "quickstart.py"
        quickstart.write_text(readme_quickstart(Path(__file__).parent / "README.md"))
        torchrun = str(bin_dir / "torchrun")
        said = _output(session, torchrun, "--standalone", "--nproc-per-node=2", str(quickstart))
        if "group of 2 ranks" not in said or "sum of ranks = 1.0" not in said:
            session.error("the README quickstart did not report 2 ranks summing to 1.0")
        session.run(distcompat, "doctor", external=True)

    # The sdist's tests run against the installed wheel: every module collects, and one runs.
    with session.chdir(tests_dir.parent):
        session.run(python, "-m", "pytest", "-qq", "--collect-only", "tests", external=True)
        session.run(python, "-m", "pytest", "-q", "tests/test_version.py", external=True)


def _output(session: nox.Session, *command: str) -> str:
    """Run ``command`` (outside the session's venv), show its output, return the last line."""
    said = str(session.run(*command, external=True, silent=True)).strip()
    session.log(said)
    return said.splitlines()[-1] if said else ""


def readme_quickstart(readme: Path) -> str:
    """The python code block right under README.md's ``## Quickstart`` heading."""
    section = readme.read_text(encoding="utf-8").partition("\n## Quickstart\n")[2]
    match = re.match(r"\s*```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    if match is None:
        raise ValueError(f"{readme}: no ```python block right under '## Quickstart'")
    return match.group(1)


def _check_wheel(wheel: Path) -> None:
    """The wheel holds the package, its py.typed and LICENSE, and no tests or benchmarks."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    stray = {name.split("/", 1)[0] for name in names} - {"distcompat", dist_info}
    if stray:
        raise ValueError(f"{wheel.name}: unexpected top-level entries {sorted(stray)}")
    needed = {"distcompat/py.typed", "distcompat/_version.py", f"{dist_info}/licenses/LICENSE"}
    if needed - set(names):
        raise ValueError(f"{wheel.name}: missing {sorted(needed - set(names))}")
    print(f"{wheel.name}: {len(names)} files, only distcompat/ and {dist_info}/, LICENSE in")


def _check_sdist(sdist: Path, scratch: Path) -> Path:
    """The sdist holds what running the tests needs; unpack it and return its ``tests`` folder."""
    root = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(scratch, filter="data")
        names = {name.removeprefix(f"{root}/") for name in archive.getnames()}
    repo = Path(__file__).parent
    required = {"pyproject.toml", "LICENSE", "README.md", "CHANGELOG.md", "src/distcompat/py.typed"}
    required |= {
        path.relative_to(repo).as_posix()
        for path in (repo / "tests").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    if required - names:
        raise ValueError(f"{sdist.name}: missing {sorted(required - names)}")
    unwanted = sorted(name for name in names if name.startswith(("benchmarks/", "tools/", "docs/")))
    if unwanted:
        raise ValueError(f"{sdist.name}: should not hold {unwanted}")
    print(f"{sdist.name}: {len(names)} entries, all of tests/, LICENSE and CHANGELOG.md")
    return scratch / root / "tests"
