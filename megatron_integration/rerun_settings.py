"""``--rerun-mode`` and its error injection, as a run's configuration holds them (free of torch:
the command line is checked before torch is imported). What they do: :mod:`megatron_integration.rerun`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dynapipe.errors import DynaPipeError, given, is_whole

MODES = ("disabled", "validate_results", "report_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


@dataclass(frozen=True)
class RerunSettings:
    """Megatron-LM's ``--rerun-mode``, ``--error-injection-rate`` (each validation of a rank
    injects an error with probability 1/rate; 0: never), ``--error-injection-type``,
    ``--check-for-spiky-loss``, ``--check-for-large-grads`` and
    ``--result-rejected-tracker-filename``, with Megatron-LM's defaults."""

    rerun_mode: str = "validate_results"
    error_injection_rate: int = 0
    error_injection_type: str = "transient_error"
    # Megatron-LM's --check-for-spiky-loss and --check-for-large-grads (off by default): a loss or
    # gradient norm of ten times the largest of its first 100 is computed again, and training goes on.
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    # Megatron-LM's --result-rejected-tracker-filename: each rejected result is appended to it
    # (megatron_integration.rerun_tracker); None: not recorded.
    result_rejected_tracker_filename: Optional[str] = None

    def __post_init__(self):
        if self.rerun_mode not in MODES:
            raise DynaPipeError(f"{given('rerun_mode', self.rerun_mode)}: choose one of {', '.join(MODES)}.")
        if self.error_injection_type not in INJECTION_TYPES:
            raise DynaPipeError(f"{given('error_injection_type', self.error_injection_type)}: choose one of "
                                f"{', '.join(INJECTION_TYPES)}.")
        if not is_whole(self.error_injection_rate, at_least=0):
            raise DynaPipeError(f"{given('error_injection_rate', self.error_injection_rate)}: give a whole number, "
                                f"at least 0 (0: inject nothing; N: about once in N validations of a rank).")
        path = self.result_rejected_tracker_filename
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise DynaPipeError(f"{given('result_rejected_tracker_filename', path)}: name a file (or leave it out).")
        for name in ("check_for_spiky_loss", "check_for_large_grads"):
            if not isinstance(getattr(self, name), bool):
                raise DynaPipeError(f"{given(name, getattr(self, name))}: give True or False.")
        if self.error_injection_rate and self.rerun_mode != "validate_results":
            raise DynaPipeError(f"{given('error_injection_rate', self.error_injection_rate)} with "
                                f"{given('rerun_mode', self.rerun_mode)}: injected errors are diagnosed by "
                                f"{given('rerun_mode', 'validate_results')} only; drop one of them.")
