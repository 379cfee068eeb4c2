"""The torchrun DDP program started by Open MPI, as MPI users write it: the script maps Open MPI's
variables to torch's (RANK, WORLD_SIZE, MASTER_ADDR/PORT), then runs the same training.

    mpirun -np 2 python frameworks/ddp_mpirun.py PORT
    distcompat run mpirun -np 2 python frameworks/ddp_mpirun.py PORT
"""

from __future__ import annotations

import os
import sys

import ddp_torchrun

if __name__ == "__main__":
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    ddp_torchrun.main()
