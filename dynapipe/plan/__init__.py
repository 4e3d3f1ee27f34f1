"""Execution plans: per-rank instruction lists, their compiler, validator and bytes.

The four calls everything else uses:

- :func:`compile_plans` turns a schedule and one replica's micro-batches into one
  :class:`ExecutionPlan` per pipeline stage (:func:`compile_chunked_plans`: per rank, for a
  placement of several model chunks a rank).
- :func:`validate_plans` checks a set of plans before anything runs (matching
  sends/receives with identical shapes, per-pair FIFO order, a deadlock-free symbolic
  run under NCCL's in-order semantics, buffer lifetimes) and raises :class:`PlanError`
  naming the rank, the instruction index and the reason.
- :func:`serialize_plan` / :func:`deserialize_plan`: compact, versioned, checksummed,
  deterministic bytes (never pickle) with a bounded inflation; a truncated, corrupted or
  oversized payload raises :class:`PlanError`.

Compiled and decoded plans hold their instructions as an :class:`InstructionTable`
(integer columns, a read-only sequence of instruction objects built on first use).
Buffer and instruction semantics are in :mod:`dynapipe.plan.instructions` and
:mod:`dynapipe.plan.validate`.
"""
from dynapipe.errors import PlanError
from dynapipe.plan.compile import compile_plans
from dynapipe.plan.compile_chunked import compile_chunked_plans
from dynapipe.plan.specs import input_specs, message_specs
from dynapipe.plan.files import plan_file_name, read_plan_dir, write_plan_dir
from dynapipe.plan.instructions import ExecutionPlan, Instruction, MicroBatchInfo, TensorSpec
from dynapipe.plan.serialize import FORMAT_VERSION, deserialize_plan, serialize_plan
from dynapipe.plan.table import InstructionTable
from dynapipe.plan.validate import validate_plans

__all__ = ["compile_plans", "compile_chunked_plans", "validate_plans", "serialize_plan", "deserialize_plan", "PlanError",
           "ExecutionPlan", "Instruction", "MicroBatchInfo", "TensorSpec", "FORMAT_VERSION",
           "input_specs", "message_specs", "write_plan_dir", "read_plan_dir", "plan_file_name", "InstructionTable"]
