"""User-facing errors.

A :class:`DynaPipeError` carries a message meant for the person running the job: it names
the offending value and says what would fix it. The command line prints it without a
traceback and exits with status 2; library callers can catch it like any exception.
"""


class DynaPipeError(Exception):
    """Bad input or an impossible request, explained for the user (no traceback needed)."""


class PlanError(DynaPipeError):
    """An execution plan that is malformed, corrupted or would deadlock."""


class ExecutorError(DynaPipeError):
    """A pipeline rank could not run its plan: a failed or timed-out transfer, a tensor that
    does not match the plan, a handler exception, or another rank's failure. The message
    names the rank, the instruction index and the peer."""
