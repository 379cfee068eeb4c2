"""The torchrun DDP program started by Slurm's ``srun``, as Slurm users write it: the script maps
Slurm's variables to torch's (RANK, WORLD_SIZE, MASTER_ADDR/PORT), then runs the same training.

    srun -n 2 python frameworks/ddp_srun.py PORT
    distcompat run srun -n 2 python frameworks/ddp_srun.py PORT
"""

from __future__ import annotations

import os
import sys

import ddp_torchrun

if __name__ == "__main__":
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    ddp_torchrun.main()
