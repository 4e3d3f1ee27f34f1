"""``--exit-signal-handler`` and ``--exit-signal`` in one process: the names taken and refused, and
a real signal marking the run. The run that a SIGTERM ends with a checkpoint (megatron-core's
schedule and DynaPipe's executor with its planner workers) is in ``test_failsafe_faults.py``."""
import os
import signal

import pytest
import torch

from dynapipe.errors import DynaPipeError
from megatron_integration.exit_signal import ExitSignal, exit_signal_from_args, exit_signal_line, signal_number


def test_signal_names_are_megatron_lms_and_uncatchable_ones_are_refused():
    assert signal_number("SIGTERM") == signal.SIGTERM and signal_number("SIGUSR1") == signal.SIGUSR1
    assert signal_number("SIGQUIT") == signal.SIGQUIT  # torchrun forwards it by default
    with pytest.raises(DynaPipeError, match="--exit-signal SIGKILL: a process cannot catch SIGKILL"):
        signal_number("SIGKILL")
    # Only the signals that end a job, which DynaPipe's planner workers ignore: any other would
    # end the workers under a rank that is saving.
    for name in ("TERM", "SIGSEGV", "SIGALRM"):
        with pytest.raises(DynaPipeError, match=rf"--exit-signal {name}: give one of SIGTERM, SIGINT, SIGHUP, "
                                                rf"SIGQUIT, SIGUSR1, SIGUSR2"):
            signal_number(name)


def test_the_handler_flags_resolve_as_megatron_lms_and_a_lone_signal_is_refused():
    assert exit_signal_from_args(False, None) is None
    assert exit_signal_from_args(True, None) == "SIGTERM"
    assert exit_signal_from_args(True, "SIGUSR2") == "SIGUSR2"
    with pytest.raises(DynaPipeError, match="--exit-signal SIGUSR1 names the signal --exit-signal-handler catches, "
                                            "which is off"):
        exit_signal_from_args(False, "SIGUSR1")


def test_a_signal_marks_the_run_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: seen.append("previous"))
    try:
        handler = ExitSignal("SIGUSR1", torch.device("cpu")).install()
        assert not handler.received()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received() and seen == []  # marked, the process not ended
        handler.release()
        handler.release()  # once only
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == ["previous"]
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert exit_signal_line("SIGTERM", 3) == "exiting program after receiving SIGTERM, after iteration 3"


def test_a_handler_python_did_not_set_is_given_back_as_the_default(monkeypatch):
    # signal.getsignal is None for a handler a C library installed: released, the signal must not
    # stay caught by this run's handler.
    installed = []
    monkeypatch.setattr(signal, "getsignal", lambda number: None)
    monkeypatch.setattr(signal, "signal", lambda number, handler: installed.append((number, handler)))
    handler = ExitSignal("SIGUSR2", torch.device("cpu")).install()
    handler.release()
    assert installed[-1] == (signal.SIGUSR2, signal.SIG_DFL) and len(installed) == 2
