"""``distcompat run``'s bootstrap and patching (``distcompat.run``), in real interpreters.

Each check starts Python with the bootstrap folder first on ``PYTHONPATH``, as ``distcompat run``
does, and reads what ``tests/_run_script.py`` says about that interpreter. The routing of a call
and the idempotence of a patch are checked in this process, on a module made for the test
(torch's own stays unpatched here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from distcompat.launch import _settings
from distcompat.run import BOOTSTRAP_DIR, RUN_VARIABLE, patch_module, route_init
from distcompat.run.bootstrap import sitecustomize as bootstrap

SCRIPT = Path(__file__).with_name("_run_script.py")


def _python(
    scenario: str, *flags: str, path: list[str] | None = None, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Run the script under the bootstrap (``path`` after it); return its JSON and stderr."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", RUN_VARIABLE)}
    environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *(path or [])])
    environ.update(env or {})
    done = subprocess.run(
        [sys.executable, *flags, str(SCRIPT), scenario],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_process_without_torch_gets_the_finder_and_imports_nothing() -> None:
    said, stderr = _python("no-torch")
    assert said["finder"] is True
    assert said["loaded"] == []  # neither torch nor distcompat
    assert said["sitecustomize"] == os.path.join(BOOTSTRAP_DIR, "sitecustomize.py")
    assert stderr == ""


def test_the_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    """A user's sitecustomize later on the path runs, as ``sitecustomize``, after the finder."""
    (tmp_path / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.CHAINED_SITECUSTOMIZE = 1\n"
    )
    said, _ = _python("no-torch", path=[str(tmp_path)])
    assert said["chained"] == 1
    assert said["finder"] is True
    assert said["sitecustomize"] == str(tmp_path / "sitecustomize.py")


def test_a_failing_shadowed_sitecustomize_is_reported_as_python_does(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("raise OSError('broken on purpose')\n")
    said, stderr = _python("no-torch", path=[str(tmp_path)])
    assert "Error in sitecustomize" in stderr
    assert "broken on purpose" in stderr
    assert said["finder"] is True  # installed before the user's ran


def test_the_switch_turns_it_off_and_still_chains(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.CHAINED_SITECUSTOMIZE = 1\n"
    )
    said, _ = _python("no-torch", path=[str(tmp_path)], env={RUN_VARIABLE: "off"})
    assert said["finder"] is False
    assert said["chained"] == 1


@pytest.mark.parametrize("flag", ["-I", "-E", "-S"])
def test_isolated_ignore_env_and_no_site_skip_the_bootstrap(flag: str) -> None:
    """The documented limit: these flags keep the bootstrap out (docs/no-line-changed.md)."""
    said, _ = _python("no-torch", flag)
    assert said["finder"] is False


@pytest.mark.slow
def test_torchs_init_is_the_drop_in_for_gloo_and_torchs_for_other_backends() -> None:
    """Every holder of the names (device_mesh's by-name import too) is patched; gloo makes the
    protected group, a second init is quiet, Lightning's side group and monitored_barrier and
    AVG work, destroy goes through distcompat; ``fake`` and ``mpi`` are torch's own; torch's init
    called as DeepSpeed and Accelerate call it (a launcher environment of one rank) is protected;
    the group ``init_distributed`` makes torch's way (protection off) is not routed again."""
    said, stderr = _python("torch")
    assert all(said["marks"].values())
    assert said["marks"]["device_mesh.init_process_group"]
    assert "backend" in said["signature"]  # torch's signature, for frameworks that inspect it
    assert said["protected"] is True
    assert said["backend"] == "gloo"
    assert said["recorded"] is True
    assert said["avg"] == [1.0, 1.0, 1.0]
    assert said["after_destroy"] == [False, False]
    assert said["fake"] == ["fake", False]
    assert said["fake_recorded"] is False
    assert said["mpi"].startswith("RuntimeError: Distributed package doesn't have MPI")
    assert said["framework_calls"] == {"deepspeed": True, "accelerate": True}
    assert said["own_init"] == "gloo: the default for run device cpu"  # init_distributed's own
    lines = [line for line in stderr.splitlines() if line.startswith("distcompat run:")]
    assert len(lines) == 3, stderr  # once per group made through torch's init, on rank 0
    assert "protected group" in lines[0]
    assert f"{RUN_VARIABLE}=off" in lines[0]


@pytest.mark.slow
def test_a_late_install_patches_the_names_torch_already_handed_out() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "late"], env=environ, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    said = json.loads(done.stdout.splitlines()[-1])
    assert not any(said["before"].values())
    assert said["installed"] is True
    assert all(said["after"].values())


@pytest.mark.parametrize(
    ("backend", "takes"),
    [
        (None, True), ("gloo", True), ("GLOO", True), ("nccl", True), ("cpu:gloo", True),
        ("cpu:gloo,cuda:nccl", True), ("undefined", True), ("mpi", False), ("ccl", False),
        ("fake", False), ("cpu:gloo,cuda:xccl", False), ("my_backend", False),
    ],
)  # fmt: skip
def test_route_init(backend: str | None, takes: bool) -> None:
    route = route_init({"backend": backend})
    assert route.takes is takes
    if not takes:
        assert "torch's own init" in route.reason


def test_a_group_of_some_ranks_is_torchs() -> None:
    assert route_init({"backend": "gloo", "_ranks": [0, 1]}).takes is False


def test_a_parameter_the_drop_in_does_not_know_goes_to_torch_unless_at_its_default() -> None:
    """torch's next release's new parameter: given, torch's init takes the call (and says so);
    left at torch's default, it is dropped and the drop-in takes the call."""
    route = route_init({"backend": "gloo", "new_knob": 3}, {"new_knob": 0})
    assert route.takes is False
    assert "new_knob=3" in route.reason
    assert route_init({"backend": "gloo", "new_knob": 0}, {"new_knob": 0}).takes is True
    assert route_init({"backend": "gloo", "new_knob": None}).takes is False  # no default known


def test_the_drop_in_takes_every_parameter_torchs_init_has_here() -> None:
    """The routing table names the drop-in's own parameters, and they hold every parameter of
    the installed torch's ``init_process_group`` (a new one fails here, not in a user's job)."""
    import inspect

    import torch.distributed as dist

    from distcompat.process_group import init_process_group
    from distcompat.run._patch import DROP_IN_TAKES

    drop_in = inspect.signature(init_process_group).parameters
    assert set(drop_in) == DROP_IN_TAKES
    torchs = inspect.signature(dist.init_process_group).parameters
    assert set(torchs) <= set(drop_in), set(torchs) - set(drop_in)
    for name, parameter in torchs.items():
        assert drop_in[name].default == parameter.default, name


@pytest.mark.slow
def test_torchs_init_with_the_newest_parameters_runs_under_distcompat_run() -> None:
    """torch's init spelled out with every parameter at its default is the drop-in's (the
    protected group); ``enable_reconfigure=True`` (torch 2.14+) is torch's reconfigurable gloo
    group, watched by distcompat (plain torch's then needs ``reconfigure()`` before a
    collective). On an older torch the parameter is absent from torch's signature (the patched
    one shows torch's). Each group's backend name is plain torch's."""
    said, stderr = _python("newer")
    plain, _ = _python("newer", env={RUN_VARIABLE: "off"})
    assert said["patched"] is True
    assert plain["patched"] is False
    assert said["all_defaults"] == [True, plain["all_defaults"][1]]
    if "enable_reconfigure" in said["signature"]:
        reconfigure = said["reconfigure"]
        assert reconfigure["protected"] is False
        assert reconfigure["supports"] is True
        assert "enable_reconfigure=True" in reconfigure["backend_reason"]
        assert plain["reconfigure"]["supports"] is True
    assert "setSequenceNumberForGroup" not in stderr


def test_patching_is_idempotent_keeps_the_signature_and_passes_bad_calls_to_torch() -> None:
    """On a module made for the test: a call torch rejects (bad arguments) reaches torch as is."""
    calls: list[tuple[Any, ...]] = []

    def destroy_process_group(group: object = None) -> None:
        calls.append(("torch's", group))

    module = types.ModuleType("c10d_for_the_test")
    module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    assert patch_module(module) == ["destroy_process_group"]
    assert patch_module(module) == []
    patched = module.destroy_process_group
    assert patched is not destroy_process_group
    assert patched.__wrapped__ is destroy_process_group
    with pytest.raises(TypeError):
        patched(1, 2, 3)  # torch's own TypeError
    marker = object()
    patched(marker)  # not the default group: torch's
    assert calls == [("torch's", marker)]


def test_the_switch_is_spelled_as_the_settings_list_it() -> None:
    """The bootstrap reads the variable itself (it imports nothing of distcompat)."""
    assert bootstrap.RUN_VARIABLE == _settings.RUN_VARIABLE
    assert bootstrap.RUN_OFF == _settings._OFF
    assert set(bootstrap.RUN_ON) - {""} == set(_settings._ON)
