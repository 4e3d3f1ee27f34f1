"""Restoring the learning-rate schedule from a checkpoint, with Megatron-LM's rule.

megatron-core's ``OptimizerParamScheduler`` compares each value the run's arguments give
(peak and minimum learning rate, warm-up and decay steps, decay style, weight decay) with
the checkpoint's. Megatron-LM refuses a difference unless ``--override-opt_param-scheduler``
(this run's values win) or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's win)
is given: a resumed run with another ``--train-iters`` would otherwise follow a schedule
its user did not ask for. megatron-core signals the difference with a bare assertion; this
module turns it into one line that names the value and the fix.
"""
from __future__ import annotations

from dynapipe.errors import DynaPipeError


def load_scheduler_state(scheduler, state: dict, where: str) -> None:
    """Load ``state`` (a checkpoint's scheduler state) into ``scheduler``; ``where``: the
    checkpoint, for the message. Raises :class:`DynaPipeError` when a value differs and
    neither flag says which one to keep."""
    try:
        scheduler.load_state_dict(state)
    except AssertionError as e:
        detail = " ".join(str(e).replace("checkpointvalue", "checkpoint value").split())
        raise DynaPipeError(f"{where}: the checkpoint's learning-rate schedule differs from this run's arguments "
                            f"({detail}); resume with the arguments it was saved with, or add "
                            f"--override-opt_param-scheduler (use this run's) or "
                            f"--use-checkpoint-opt_param-scheduler (keep the checkpoint's).") from None
