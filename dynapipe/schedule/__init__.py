"""Pipeline schedules for variable-shape micro-batches, their simulator and search.

- :mod:`~dynapipe.schedule.types`: :class:`Op` and :class:`Schedule` (per-stage op order).
- :mod:`~dynapipe.schedule.simulator`: :func:`simulate` -> :class:`Timeline` (ms, MiB).
- :func:`one_f_one_b` (Megatron's 1F1B) and :func:`adaptive_schedule` (wait-free,
  memory-bounded), :func:`search_schedules` (``auto``: fastest candidate that fits).
- :func:`zb_h1` (zero-bubble, splitting each backward into ``BI`` and ``BW``) and, on
  virtual-pipeline placements, :func:`interleaved_zb`; ``auto`` tries them where the stages
  can split their backward.
"""
from dynapipe.schedule.adaptive import adaptive_schedule
from dynapipe.schedule.costs import StageTimes, stage_times
from dynapipe.schedule.interleaved_zb import interleaved_zb
from dynapipe.schedule.one_f_one_b import one_f_one_b
from dynapipe.schedule.orders import ORDERS
from dynapipe.schedule.search import SCHEDULE_CHOICES, Candidate, SearchResult, search_schedules
from dynapipe.schedule.simulator import Event, Timeline, simulate
from dynapipe.schedule.types import OP_KINDS, SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULE_NAMES, Op, Schedule
from dynapipe.schedule.zero_bubble import zb_h1

__all__ = ["Op", "Schedule", "OP_KINDS", "SCHEDULE_NAMES", "SPLIT_BACKWARD_SCHEDULE_NAMES", "SCHEDULE_CHOICES",
           "StageTimes", "stage_times", "simulate", "Timeline", "Event", "one_f_one_b", "zb_h1", "interleaved_zb", "adaptive_schedule",
           "search_schedules", "Candidate", "SearchResult", "ORDERS"]
