"""Micro-batching of one global batch: ordering, exact DP cutting, baselines, replica balancing.

``plan_micro_batches(lengths, cost_model, method=...)`` is the entry point; it returns a
:class:`BatchPlan` of priced :class:`MicroBatch` objects. Pure Python + numpy.
"""
from dynapipe.batching.lengths import read_lengths, validate_lengths
from dynapipe.batching.planner import METHODS, plan_micro_batches
from dynapipe.batching.types import BatchPlan, MicroBatch

__all__ = ["plan_micro_batches", "METHODS", "BatchPlan", "MicroBatch", "read_lengths", "validate_lengths"]
