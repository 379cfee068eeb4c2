"""Install the system packages the launchers session needs, only where a binary is missing.

    python tools/launchers/install.py   # as root; says what it installed, or that nothing was

Debian packages, through ``apt-get`` (an ``apt-get update`` first); a machine that already has
every binary is left alone, without touching the network. Ray goes into the session's venv
(``noxfile.py``), not here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

#: binary -> the Debian package that provides it.
PACKAGES = {
    "mpirun.openmpi": "openmpi-bin",
    "mpiexec.mpich": "mpich",
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "srun": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "nft": "nftables",
    "ip": "iproute2",
}
APT_TIMEOUT_S = 1200


def missing_packages() -> list[str]:
    """The packages whose binaries are not on PATH, each once, in a stable order."""
    return sorted({package for binary, package in PACKAGES.items() if shutil.which(binary) is None})


def main() -> int:
    packages = missing_packages()
    if not packages:
        print("launchers install: every binary present, nothing installed")
        return 0
    if os.geteuid() != 0:
        print(f"launchers install: missing {' '.join(packages)}, and apt-get needs root")
        return 1
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", *packages],
    ):
        done = subprocess.run(command, env=env, timeout=APT_TIMEOUT_S, check=False)
        if done.returncode != 0:
            print(f"launchers install: `{' '.join(command)}` failed ({done.returncode})")
            return 1
    still = missing_packages()
    seconds = time.monotonic() - started
    print(f"launchers install: apt-get installed {' '.join(packages)} in {seconds:.0f} s")
    if still:
        print(f"launchers install: binaries still missing afterwards: {' '.join(still)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
