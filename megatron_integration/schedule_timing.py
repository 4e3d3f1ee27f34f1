"""Where the time of one megatron-core 1F1B iteration goes, measured as it runs.

:func:`timed_schedule` wraps, for the duration of one ``forward_backward`` call,
megatron-core's per-micro-batch ``forward_step`` and ``backward_step`` (module functions
its schedules look up by name) and the config's gradient finaliser, adding their wall
time to a :class:`ScheduleTiming`. What is left of the schedule call is point-to-point
transfers, waiting for the neighbouring stage (the pipeline bubble) and bookkeeping.
Each point-to-point exchange (``P2PCommunicator._communicate``: its sends, its receives and
the wait for all of them) is recorded with its wall-clock start and end and its
directions, so that :mod:`megatron_integration.bench_breakdown` can tell waiting for the
neighbouring stage from the transfer itself by matching it with the peer's exchange.
The wrappers only read a clock around the original call, so the maths is untouched. On GPUs
the steps' times are the device's: CUDA events recorded on the current stream around each
step and read once the schedule has ended, as the executor's traces time its ops. A host
clock after a synchronisation would stop the host at every step, undoing the overlap of
megatron-core's overlapped point-to-point exchanges, and ``torch.cuda.synchronize`` would also
wait for the NCCL streams' pre-posted receives, tying each rank to its neighbours' progress.
A megatron-core version without those names is left alone and reports zeros.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field


@dataclass
class ScheduleTiming:
    """Wall time of one iteration's parts on one rank (ms)."""

    forward_ms: float = 0.0
    backward_ms: float = 0.0
    finalize_ms: float = 0.0
    schedule_ms: float = 0.0
    micro_batches: int = 0
    # Wall clock (us) at which the gradient finaliser started: the end of this rank's pipeline part.
    pipeline_end_us: float = 0.0
    # One [start_us, end_us, send_next, send_prev, recv_prev, recv_next] per p2p exchange (wall clock).
    p2p_calls: list = field(default_factory=list)

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def p2p_and_wait_ms(self) -> float:
        """Schedule time outside compute and the gradient finaliser: transfers, waits, bookkeeping."""
        return max(self.schedule_ms - self.compute_ms - self.finalize_ms, 0.0)

    def to_json(self) -> dict:
        out = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["p2p_and_wait_ms"] = round(self.p2p_and_wait_ms, 3)
        return out


def _timed(fn, timing: ScheduleTiming, attr: str):
    """``fn`` adding its wall time (ms) to ``timing.<attr>`` (CPU ranks: the work is done when
    the call returns)."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(timing, attr, getattr(timing, attr) + (time.perf_counter() - t0) * 1e3)

    return wrapper


class DeviceSpans:
    """Device time of wrapped calls: an event recorded before and after each on the current
    stream (``new_event()`` makes one: ``record``, ``synchronize``, ``elapsed_time`` in ms, as
    ``torch.cuda.Event(enable_timing=True)``), added to the timing only by :meth:`settle`, so
    the host never waits for the device inside the schedule."""

    def __init__(self, new_event):
        self.new_event = new_event
        self.pending: list = []

    def timed(self, fn, timing: ScheduleTiming, attr: str):
        """``fn`` whose device time (ms) :meth:`settle` adds to ``timing.<attr>``."""
        def wrapper(*args, **kwargs):
            start = self.new_event()
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end = self.new_event()
                end.record()
                self.pending.append((timing, attr, start, end))

        return wrapper

    def settle(self) -> None:
        """Wait for every recorded span to end and add its time; the spans are then forgotten."""
        for timing, attr, start, end in self.pending:
            end.synchronize()
            setattr(timing, attr, getattr(timing, attr) + float(start.elapsed_time(end)))
        self.pending = []


def _device_spans() -> "DeviceSpans | None":
    """:class:`DeviceSpans` on CUDA events where CUDA is in use, else None (wall time)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return DeviceSpans(lambda: torch.cuda.Event(enable_timing=True))


def _stream_sync():
    """Wait for the current CUDA stream only: not the NCCL streams' transfers still posted."""
    import torch

    torch.cuda.current_stream().synchronize()


def _counted(fn, timing: ScheduleTiming):
    def wrapper(*args, **kwargs):
        timing.micro_batches += 1
        return fn(*args, **kwargs)

    return wrapper


def _recorded(fn, timing: ScheduleTiming, sync=None):
    """``P2PCommunicator._communicate`` recording each exchange's wall-clock window and
    directions. ``sync`` (steps timed by events: the current stream's synchronise): where
    megatron-core synchronises the device after the exchange anyway (batched exchanges with
    ``batch_p2p_sync``), it runs first, so the window holds the exchange and not the kernels of
    the step before it, which the events count already."""
    def wrapper(self, *args, **kwargs):
        config = getattr(self, "config", None)
        if sync is not None and getattr(config, "batch_p2p_comm", False) and getattr(config, "batch_p2p_sync", False):
            sync()
        t0 = time.time_ns() / 1e3
        try:
            return fn(self, *args, **kwargs)
        finally:
            timing.p2p_calls.append([round(t0, 1), round(time.time_ns() / 1e3, 1),
                                     kwargs.get("tensor_send_next") is not None,
                                     kwargs.get("tensor_send_prev") is not None,
                                     bool(kwargs.get("recv_prev")), bool(kwargs.get("recv_next"))])

    return wrapper


@contextlib.contextmanager
def timed_schedule(config, timing: ScheduleTiming):
    """Time megatron-core's forward/backward steps and ``config.finalize_model_grads_func``
    into ``timing`` while the block runs (the block's own wall time goes to ``schedule_ms``)."""
    from megatron.core.pipeline_parallel import schedules

    saved = {name: getattr(schedules, name) for name in ("forward_step", "backward_step")
             if callable(getattr(schedules, name, None))}
    finalize = getattr(config, "finalize_model_grads_func", None)
    spans = _device_spans()

    def clocked(fn, attr):
        return spans.timed(fn, timing, attr) if spans is not None else _timed(fn, timing, attr)

    for name, fn in saved.items():
        wrapped = clocked(fn, "forward_ms" if name == "forward_step" else "backward_ms")
        setattr(schedules, name, _counted(wrapped, timing) if name == "forward_step" else wrapped)
    communicator = _communicator_class()
    communicate = getattr(communicator, "_communicate", None) if communicator is not None else None
    if communicate is not None:
        communicator._communicate = _recorded(communicate, timing, sync=_stream_sync if spans is not None else None)
    if finalize is not None:
        timed = clocked(finalize, "finalize_ms")

        def stamped(*args, **kwargs):
            if spans is not None:  # the pipeline part ends when its kernels do (once an iteration)
                _stream_sync()
            timing.pipeline_end_us = time.time_ns() / 1e3
            return timed(*args, **kwargs)

        config.finalize_model_grads_func = stamped
    t0 = time.perf_counter()
    try:
        yield timing
        if spans is not None:
            spans.settle()  # the schedule ends when its kernels do
    finally:
        timing.schedule_ms += (time.perf_counter() - t0) * 1e3
        for name, fn in saved.items():
            setattr(schedules, name, fn)
        if communicate is not None:
            communicator._communicate = communicate
        if finalize is not None:
            config.finalize_model_grads_func = finalize


def _communicator_class():
    """megatron-core's P2PCommunicator (None in a version without it)."""
    try:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    except ImportError:
        return None
    return P2PCommunicator
