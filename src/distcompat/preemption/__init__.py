"""Told to stop, the job stops together: every rank saves the same step, exits, and resumes.

Clusters warn a job before they stop it (Slurm's SIGTERM or ``--signal=USR1@SECONDS``,
Kubernetes' SIGTERM and grace period, torchrun forwarding SIGTERM, a spot VM's notice). The
signal reaches the ranks at different moments, and a save is a collective, so a handler that
saves on its own rank deadlocks or saves different steps. Here the handler only notes the
signal (``_signals``), the ranks agree between steps on one step to stop at (``_agree``), and
the stop saves it within a grace period and exits the way the launcher expects (``_stop``;
:func:`distcompat.launch.comeback_plan`)::

    preemption = Preemption(grace_s=30)
    for step in range(resumed.step + 1, total + 1):
        train_step()
        if preemption.should_stop(step):
            preemption.stop(save=lambda: save_checkpoint("ckpt", step, training_state(...)))

docs/resilience.md ("Preemption") has the recipe per launcher.
"""

from distcompat.preemption._signals import Caught, PreemptionError
from distcompat.preemption._stop import EXIT_MARGIN_S, Preemption, StopReport

__all__ = ["EXIT_MARGIN_S", "Caught", "Preemption", "PreemptionError", "StopReport"]
