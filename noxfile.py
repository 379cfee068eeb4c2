"""Tooling as code: every check this project runs, one nox session each.

    nox                      # the default run: every session on the newest torch (2.15.0), then
                             # tests, endtoend, comparisons, frameworks and the demo on
                             # the oldest supported (2.9.1)
    nox -s "tests(newest)"   # one session on one release ("tests(floor)": on 2.9.1)
    nox -s endtoend          # the end-to-end tests (marked slow): real rank processes, torchrun
    nox -s launchers -- --only mpich   # one launcher (tools/launchers/run.py's options)
    nox -s build             # sdist + wheel, twine check, the README quickstart from the wheel
    nox -s tests_cuda        # CUDA/NCCL tests; skips cleanly without a GPU
    nox -s conformance       # torch's own distributed tests through distcompat's group
    nox -s comparisons       # the programs compared with plain gloo bit for bit, once
    nox -s frameworks        # unchanged torchrun/mp.spawn/FSDP2/Lightning/Accelerate programs
                             # under distcompat run
    nox -s soak              # the comparisons, 20 times over (races)
    nox -s anysize           # runs at world sizes 1-4 and across resizes, bit for bit
    nox -s torch_versions    # the floor's sessions on 2.13.0 and 2.14.1 (by hand)

One virtual environment per torch release (``.nox/torch-<release>``), made by the first session
that needs it and shared by every session that tests that release: torch (a CUDA build of
several GB from 2.14 on) is installed once per release, not once per session, and pip runs
again only for what the environment lacks (``_installed``). Every install
names torch exactly, so pip can never swap it; the project machines' pip configuration caps
torch at the 2.14.1 on their disk, which every install here lifts (``PIP_CONSTRAINT``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nox
import nox.command

#: The newest torch release (a bare ``pip install torch`` gives it): every session runs on it.
NEWEST = "2.15.0"
#: The oldest release distcompat supports, the one nanochat pins: the sessions in ``FLOOR_RUN``.
FLOOR = "2.9.1"
#: Between the two, run by hand (``nox -s torch_versions``).
BY_HAND = ["2.13.0", "2.14.1"]
#: The sessions the default run also gives the floor release.
FLOOR_RUN = ["tests", "endtoend", "comparisons", "frameworks", "demo"]
RELEASES = {"newest": NEWEST, "floor": FLOOR}

nox.options.sessions = [
    "tests(newest)", "endtoend(newest)", "matrix", "comparisons(newest)", "anysize", "hostile",
    "conformance", "lint", "typing", "docs", "launchers", "build", "frameworks(newest)",
    "demo(newest)",
    *(f"{name}(floor)" for name in FLOOR_RUN),
]  # fmt: skip
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"  # the local torch wheels are built for 3.11
#: torch for the sessions that take no release; DISTCOMPAT_TORCH overrides it (a GPU box's build).
TORCH = os.environ.get("DISTCOMPAT_TORCH", f"torch=={NEWEST}")
#: The project machines' /etc/xdg/pip caps torch at 2.14.1; every install here names its torch.
os.environ["PIP_CONSTRAINT"] = os.devnull
#: Checkers pinned to the versions the code was last checked with, so a new release cannot turn
#: a clean tree red; bump them on purpose.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
#: Ray Train for the launchers session; it does not require torch, and the torch pin is passed in
#: the same install so pip can never swap torch.
RAY = "ray[train]==2.60.0"
#: Lightning for the frameworks session, installed with the torch pin (as RAY is).
LIGHTNING = "lightning==2.6.6"
#: Hugging Face Accelerate for the frameworks session, with the torch pin: it pulls in
#: huggingface_hub, safetensors and psutil, not transformers.
ACCELERATE = "accelerate==1.15.0"
BUILD = "build==1.6.1"
TWINE = "twine==7.0.0"
ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class TorchEnv:
    """The shared environment of one torch release, and how to run a command in it."""

    torch: str  # the requirement, "torch==2.15.0"
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    def run(self, session: nox.Session, program: str, *args: str, **env: str) -> None:
        """Run ``program`` from the environment, with it first on ``PATH`` (for subprocesses)."""
        environ = {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                   "VIRTUAL_ENV": str(self.path), **env}  # fmt: skip
        session.run(str(self.bin / program), *args, external=True, env=environ)


def torch_env(session: nox.Session, torch: str, extras: Sequence[str] = ("tests",),
              packages: Sequence[str] = ()) -> TorchEnv:  # fmt: skip
    """Return the shared environment of ``torch`` with distcompat (editable, ``extras``) and
    ``packages`` in it, making it the first time (``.nox/torch-<release>``)."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", torch.removeprefix("torch=="))
    env = TorchEnv(torch=torch, path=ROOT / ".nox" / f"torch-{name}")
    if not (env.bin / "python").exists():
        python = shutil.which(f"python{PYTHON}")
        if python is None:
            session.error(f"no python{PYTHON} on PATH: the torch wheels here are built for it")
        session.run(python, "-m", "venv", str(env.path), external=True)
    target = f".[{','.join(extras)}]" if extras else "."
    wanted = [torch, f"-e {target}", *packages]
    stamp = env.path / "distcompat-installed.json"
    had = _installed(stamp)
    if set(wanted) <= had:
        session.log(f"{env.path.name} has {', '.join(wanted)} (this pyproject): no pip run")
    else:
        _pip_install(session, env, torch, "-e", target, *packages)
        _stamp(stamp, had | set(wanted))
    env.run(session, "python", "-c", "import torch; print('torch', torch.__version__)")
    return env


#: pip's tries at one install. A torch release not on this disk comes from PyPI (the floor's
#: CUDA build and its libraries: 6.7 GB), and pip 23 does not resume a broken download.
PIP_TRIES = 3


def _pip_install(session: nox.Session, env: TorchEnv, *args: str) -> None:
    """``pip install -q *args`` in ``env``, tried again (up to :data:`PIP_TRIES`) if it fails."""
    for attempt in range(1, PIP_TRIES + 1):
        try:
            session.run(str(env.bin / "python"), "-m", "pip", "install", "-q", *args,
                        external=True)  # fmt: skip
            return
        except nox.command.CommandFailed:
            if attempt == PIP_TRIES:
                raise
            session.warn(f"pip install failed (try {attempt} of {PIP_TRIES}): trying again")


#: What an editable install takes from the tree (metadata, dependencies, the version): a change
#: to any of them re-runs pip in a shared environment.
INSTALL_INPUTS = ("pyproject.toml", "src/distcompat/_version.py")


def _inputs_digest() -> str:
    digest = hashlib.sha256()
    for name in INSTALL_INPUTS:
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def _installed(stamp: Path) -> set[str]:
    """The requirements installed in a shared environment from this tree's install inputs.

    A shared environment's later sessions re-ran ``pip install`` for what the first one had
    installed: about 13 s each (pip rebuilds the editable wheel), 3 minutes over a default
    run. The stamp holds what was installed and the digest of :data:`INSTALL_INPUTS`; a changed
    input, or a requirement not in it, runs pip.
    """
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(recorded, dict) or recorded.get("inputs") != _inputs_digest():
        return set()
    return {str(name) for name in recorded.get("installed", [])}


def _stamp(stamp: Path, installed: set[str]) -> None:
    record = {"inputs": _inputs_digest(), "installed": sorted(installed)}
    stamp.write_text(json.dumps(record, indent=1) + "\n")


def release_of(name: str) -> str:
    return f"torch=={RELEASES[name]}"


#: Where real jobs hang, on real rank processes with every default on: the defaults matrix (36
#: scenarios, about 2 minutes on 2 cores); what a default init does about a late rank, a failed
#: collective and two jobs that hang; a hang's incidents read by torch's Flight Recorder
#: analyzer; a job with a stopped rank dumped on demand (about 1.5 minutes together). Their own
#: session keeps ``tests`` under 8 minutes.
MATRIX = [
    "tests/test_diagnostics_matrix.py",
    "tests/test_diagnostics_defaults.py",
    "tests/test_diagnostics_flight_dump.py",
    "tests/test_diagnostics_on_demand.py",
]
#: The tests marked ``plain_gloo``: a program run on the protected group and on plain gloo,
#: compared bit for bit, where a race in the group shows as a hang or other bits (FSDP2 with its
#: state dicts and DCP on another world size, HSDP, the functional mix that hung in issue 40,
#: the differential random programs). Their own session keeps ``tests`` under 8 minutes.
COMPARED = [
    "tests/test_collectives_protected.py",
    "tests/test_collectives_protected_differential.py",
]


#: What the suite's own sessions take out of ``tests`` and ``endtoend`` (``-m`` replaces
#: pyproject's): the plain-gloo comparisons, the runs at several world sizes, the hostile
#: conditions, and CUDA.
ELSEWHERE = "not cuda and not plain_gloo and not anysize and not hostile"
#: ``MATRIX`` left out of ``tests`` and ``endtoend`` (it has its own session).
NOT_MATRIX = [arg for path in MATRIX for arg in ("--ignore", path)]


def run_tests(session: nox.Session, env: TorchEnv) -> None:
    # the end-to-end tests (marked slow) have their own session. -n 2: these tests leave about
    # half of 2 cores idle (they wait on timers and on rank processes), and two pytest workers
    # took 3.8 minutes where one took 4.6 (torch 2.15, 2 cores). --durations: the slowest
    # items, to keep the session under its 8-minute goal
    env.run(session, "pytest", "-n", "2", "-m", f"{ELSEWHERE} and not slow", *NOT_MATRIX,
            "--durations=15", *session.posargs)  # fmt: skip


def run_endtoend(session: nox.Session, env: TorchEnv) -> None:
    # -n 2 as well: alone they keep 2 cores 70 % busy, and two workers took 5.2 minutes where
    # one took 6.3 (torch 2.15, 71 passed). Not the matrix: its fixture runs six cases at a time
    # already, and two workers each running it timed out every case
    env.run(session, "pytest", "-n", "2", "-m", f"{ELSEWHERE} and slow", *NOT_MATRIX, "-q",
            "--durations=10", "-p", "no:cacheprovider", *session.posargs)  # fmt: skip


def run_comparisons(session: nox.Session, env: TorchEnv) -> None:
    env.run(session, "pytest", *COMPARED, "-m", "plain_gloo", "-q", "-p", "no:cacheprovider",
            *session.posargs)  # fmt: skip


def run_frameworks(session: nox.Session, env: TorchEnv) -> None:
    # addopts= : not the suite's doctest collection of src/ nor its marker filter
    env.run(session, "pytest", "frameworks/test_frameworks.py", "-o", "addopts=", "-q", "-p",
            "no:cacheprovider", *session.posargs)  # fmt: skip


def run_demo(session: nox.Session, env: TorchEnv) -> None:
    out = Path(session.create_tmp()).resolve() / f"demo-{env.path.name}"
    shutil.rmtree(out, ignore_errors=True)
    env.run(session, "distcompat", "demo", "--out", str(out))


@nox.session(python=False)
@nox.parametrize("release", list(RELEASES), ids=list(RELEASES))
def tests(session: nox.Session, release: str) -> None:
    """The test suite on gloo multi-process groups (no GPU needed), but for the end-to-end tests
    (``endtoend``) and the sessions of their own below."""
    run_tests(session, torch_env(session, release_of(release)))


@nox.session(python=False)
@nox.parametrize("release", list(RELEASES), ids=list(RELEASES))
def endtoend(session: nox.Session, release: str) -> None:
    """The tests marked ``slow``: fresh rank processes, torchrun and the demo, started for real
    and waited on to the end (exits, kills, late ranks, stalls, restarts)."""
    run_endtoend(session, torch_env(session, release_of(release)))


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Where real jobs hang, every default on, on real rank processes: the defaults matrix and
    the hang diagnostics' end-to-end jobs (``MATRIX``)."""
    env = torch_env(session, TORCH)
    env.run(session, "pytest", *MATRIX, "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=False)
def tests_cuda(session: nox.Session) -> None:
    """Tests marked ``cuda`` (CUDA tensors, NCCL at world size 1); skips when there is no GPU."""
    env = torch_env(session, TORCH)
    probe = "import torch; print(int(torch.cuda.is_available()))"
    has_cuda = session.run(str(env.bin / "python"), "-c", probe, silent=True, external=True)
    if str(has_cuda or "").strip().splitlines()[-1:] != ["1"]:
        session.skip("no CUDA device visible to torch here: the cuda-marked tests need one")
    env.run(session, "pytest", "-m", "cuda", *session.posargs)


@nox.session(python=False)
def conformance(session: nox.Session) -> None:
    """torch's DistributedTest._DistTestBase (in the wheel) on gloo, 2 ranks, with distcompat's
    init_process_group and every default on: every test that passes on plain gloo must pass.
    DISTCOMPAT_CONFORMANCE=torch runs torch's own init for the side-by-side count; ``-- -k
    NAME`` picks tests."""
    env = torch_env(session, TORCH, packages=["expecttest"])  # torch's test code imports it
    # torch's test code warns (deprecated torch.jit.script...): not this project's warnings
    settings = ["-o", "addopts=", "-W", "ignore", "-p", "no:cacheprovider"]
    env.run(session, "pytest", "conformance/test_torch_distributed.py", "-q", *settings,
            *session.posargs)  # fmt: skip


@nox.session(python=False)
@nox.parametrize("release", list(RELEASES), ids=list(RELEASES))
def comparisons(session: nox.Session, release: str) -> None:
    """The programs compared with plain gloo bit for bit, once (about 1.5 minutes on 2 cores)."""
    run_comparisons(session, torch_env(session, release_of(release)))


@nox.session(python=False)
def anysize(session: nox.Session) -> None:
    """The tests marked ``anysize``: runs at world sizes 1-4 and across resizes, compared bit for
    bit (exact mode, FSDP2 resharding through DCP); their own session keeps ``tests`` under 8
    minutes."""
    env = torch_env(session, TORCH)
    env.run(session, "pytest", "tests", "-m", "anysize", "-q", "-p", "no:cacheprovider",
            *session.posargs)  # fmt: skip


@nox.session(python=False)
def hostile(session: nox.Session) -> None:
    """Jobs under conditions they do not control (tests/test_hostile.py: a stranger on the link
    ports, 1,024 open files, full file systems, a tiny /dev/shm; about a minute on 2 cores).
    The file systems need root (a mount namespace); without it those cases skip."""
    env = torch_env(session, TORCH)
    env.run(session, "pytest", "tests/test_hostile.py", "-m", "hostile", "-q", "-p",
            "no:cacheprovider", *session.posargs)  # fmt: skip


@nox.session(python=False)
def soak(session: nox.Session) -> None:
    """The comparisons ``SOAK_RUNS`` times (default 20) to catch races, stopping at the first
    failure; about 30 minutes on 2 cores, so on demand (``-- -k fsdp`` picks)."""
    env = torch_env(session, TORCH)
    runs = int(os.environ.get("SOAK_RUNS", "20"))
    for run in range(1, runs + 1):
        session.log(f"soak run {run} of {runs}")
        env.run(session, "pytest", *COMPARED, "-m", "plain_gloo", "-q", "-x", "-p",
                "no:cacheprovider", *session.posargs)  # fmt: skip


@nox.session(python=False)
@nox.parametrize("release", list(RELEASES), ids=list(RELEASES))
def frameworks(session: nox.Session, release: str) -> None:
    """Unchanged programs under ``distcompat run`` (issue 48): torchrun DDP, ``mp.spawn`` with
    ``tcp://``, ``init_device_mesh`` + FSDP2, Lightning ``Trainer`` and Fabric, Hugging Face
    Accelerate (``accelerate launch`` through torchrun's agent) on 2 CPU ranks; Open MPI's
    ``mpirun`` (plain, and Accelerate's multi-CPU ``--mpirun_hostfile``) and Slurm's ``srun``
    where installed (the launchers session, before it in the default run, installs them;
    elsewhere those cases skip);
    the same bits as without it, a stall, a killed rank and mismatched shapes named (about 6
    minutes on 2 cores; the table of what each showed ends the output)."""
    env = torch_env(session, release_of(release), packages=[LIGHTNING, ACCELERATE])
    run_frameworks(session, env)


@nox.session(python=False)
@nox.parametrize("release", list(RELEASES), ids=list(RELEASES))
def demo(session: nox.Session, release: str) -> None:
    """``distcompat demo`` on 2 gloo ranks: trains, checks, and exits non-zero on a failed check."""
    run_demo(session, torch_env(session, release_of(release), extras=()))


@nox.session(python=False)
@nox.parametrize("version", BY_HAND)
def torch_versions(session: nox.Session, version: str) -> None:
    """tests, endtoend, comparisons, frameworks and the demo on a release between the floor and
    the newest (by hand: each is a CUDA build of several GB)."""
    env = torch_env(session, f"torch=={version}", packages=[LIGHTNING, ACCELERATE])
    run_tests(session, env)
    run_endtoend(session, env)
    run_comparisons(session, env)
    run_frameworks(session, env)
    run_demo(session, env)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=False)
def typing(session: nox.Session) -> None:
    """mypy --strict over the library, the tests, the benchmarks and this file (torch's stubs of
    the newest release)."""
    env = torch_env(session, TORCH, packages=[MYPY, "nox>=2024.4"])
    env.run(session, "mypy")


@nox.session(python=False)
def docs(session: nox.Session) -> None:
    """Build the docs with warnings as errors."""
    env = torch_env(session, TORCH, extras=("tests", "docs"))
    site = str(Path(session.create_tmp()).resolve() / "site")
    env.run(session, "mkdocs", "build", "--strict", "--site-dir", site, NO_MKDOCS_2_WARNING="1")


@nox.session(python=False)
def launchers(session: nox.Session) -> None:
    """A probe under every launcher (torchrun, two netns nodes, Open MPI, MPICH, Slurm, Ray Train)
    and network faults on the two nodes; installs the launchers it lacks (apt-get, as root)."""
    env = torch_env(session, TORCH, packages=[RAY])
    env.run(session, "python", "tools/launchers/install.py")
    env.run(session, "python", "tools/launchers/run.py", *session.posargs)


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
