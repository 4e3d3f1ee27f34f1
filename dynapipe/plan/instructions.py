"""The instruction set of an execution plan: what one rank does in one iteration.

A plan is an ordered list of instructions per pipeline rank. Communication is split
into ``*Start`` (post the non-blocking send/receive) and ``*Finish`` (wait for it), so a
plan decides exactly when transfers overlap compute. Every communication instruction
carries the shapes and dtypes of the tensors it moves, so receivers allocate exact
buffers and nothing is negotiated at run time.

Ranks in instructions (``peer``) are pipeline ranks, i.e. stage indices inside one
pipeline-parallel group; the executor maps them to global ranks. This keeps a plan
valid whatever the data/tensor-parallel layout (every tensor-parallel rank of a stage
runs the same plan).

``chunk`` names the virtual-pipeline chunk (interleaved stages; 0 otherwise);
``BackwardPass.part`` is ``"full"``, or for zero-bubble schedules that split the backward
``"input"`` (the input gradients: it receives the gradient and sends the input gradient
on, as a full backward does) and later ``"weight"`` (the deferred weight gradients of the
same micro-batch on the same rank: no transfer, no plan buffer); an activation message
may hold several tensors (an encoder-decoder decoder stage receives the hidden states
and the encoder output).

Buffers are named by :func:`buffer_name`: ``"<kind>:<mb>:<chunk>"`` where kind is one of
``act_in`` (received activation), ``act_out`` (produced activation), ``grad_in``
(received gradient), ``grad_out`` (produced input gradient), ``input`` (loaded data).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

# Torch dtype names an execution plan may use.
DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "bool", "uint8")

BUFFER_KINDS = ("input", "act_in", "act_out", "grad_in", "grad_out")


def buffer_name(kind: str, mb: int, chunk: int = 0) -> str:
    """Name of the buffer of ``kind`` (one of :data:`BUFFER_KINDS`) for micro-batch ``mb``."""
    return f"{kind}:{mb}:{chunk}"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a plan moves or loads: name, exact shape, torch dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Instruction:
    """Base of every instruction. ``mb`` is the micro-batch index within the replica."""

    OPCODE: ClassVar[str] = ""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class LoadInput(Instruction):
    """Load this micro-batch's data (first stage: tokens and positions; last stage:
    labels and loss mask; every stage of a packed micro-batch: ``segment_ids``, the sample
    number of each token, from which the stage builds its attention mask) into buffer
    ``input:<mb>:<chunk>``."""

    OPCODE: ClassVar[str] = "load"
    tensors: tuple[TensorSpec, ...] = ()


@dataclass(frozen=True)
class ForwardPass(Instruction):
    """Run this stage's forward on micro-batch ``mb`` of ``mbs`` samples padded to
    ``seqlen`` tokens (``dec_seqlen`` decoder tokens for encoder-decoder models)."""

    OPCODE: ClassVar[str] = "fw"
    mbs: int = 0
    seqlen: int = 0
    dec_seqlen: int = 0
    recompute: str = "none"


@dataclass(frozen=True)
class BackwardPass(Instruction):
    """Backward of micro-batch ``mb``; ``part`` is ``"full"``, or one of the two parts of a
    split backward: ``"input"`` (input gradients, any recomputation; reads ``grad_in`` and
    writes ``grad_out`` as a full backward does) and then ``"weight"`` (the weight gradients
    the input part deferred; reads and writes no plan buffer)."""

    OPCODE: ClassVar[str] = "bw"
    mbs: int = 0
    seqlen: int = 0
    dec_seqlen: int = 0
    recompute: str = "none"
    part: str = "full"


@dataclass(frozen=True)
class CommInstruction(Instruction):
    """A point-to-point transfer with pipeline rank ``peer``.

    ``tensors`` lists every tensor of the message, in order. Start instructions that
    share a ``group`` id >= 0 and stand next to each other are posted together
    (``batch_isend_irecv``); ``group = -1`` posts alone.
    """

    peer: int = -1
    buffer: str = ""
    tensors: tuple[TensorSpec, ...] = ()
    group: int = -1


@dataclass(frozen=True)
class SendActivationStart(CommInstruction):
    """Post the send of a forward output to ``peer``."""

    OPCODE: ClassVar[str] = "send_act_start"


@dataclass(frozen=True)
class SendActivationFinish(CommInstruction):
    """Wait until the matching activation send has completed (its buffer may be freed)."""

    OPCODE: ClassVar[str] = "send_act_finish"


@dataclass(frozen=True)
class RecvActivationStart(CommInstruction):
    """Post the receive of a forward input from ``peer``."""

    OPCODE: ClassVar[str] = "recv_act_start"


@dataclass(frozen=True)
class RecvActivationFinish(CommInstruction):
    """Wait until the matching activation receive has landed in ``buffer``."""

    OPCODE: ClassVar[str] = "recv_act_finish"


@dataclass(frozen=True)
class SendGradStart(CommInstruction):
    """Post the send of an input gradient to ``peer``."""

    OPCODE: ClassVar[str] = "send_grad_start"


@dataclass(frozen=True)
class SendGradFinish(CommInstruction):
    """Wait until the matching gradient send has completed."""

    OPCODE: ClassVar[str] = "send_grad_finish"


@dataclass(frozen=True)
class RecvGradStart(CommInstruction):
    """Post the receive of an output gradient from ``peer``."""

    OPCODE: ClassVar[str] = "recv_grad_start"


@dataclass(frozen=True)
class RecvGradFinish(CommInstruction):
    """Wait until the matching gradient receive has landed in ``buffer``."""

    OPCODE: ClassVar[str] = "recv_grad_finish"


@dataclass(frozen=True)
class FreeBuffer(Instruction):
    """Release buffer ``buffer`` (its memory; the executor drops its reference)."""

    OPCODE: ClassVar[str] = "free"
    buffer: str = ""


INSTRUCTION_TYPES: dict[str, type] = {
    cls.OPCODE: cls
    for cls in (LoadInput, ForwardPass, BackwardPass, SendActivationStart, SendActivationFinish,
                RecvActivationStart, RecvActivationFinish, SendGradStart, SendGradFinish,
                RecvGradStart, RecvGradFinish, FreeBuffer)
}

SEND_STARTS = (SendActivationStart, SendGradStart)
RECV_STARTS = (RecvActivationStart, RecvGradStart)
STARTS = SEND_STARTS + RECV_STARTS
FINISHES = (SendActivationFinish, SendGradFinish, RecvActivationFinish, RecvGradFinish)


@dataclass(frozen=True)
class MicroBatchInfo:
    """What a plan records of each micro-batch: its samples, padded shape and loss tokens.

    ``loss_tokens``: the tokens of its samples the loss counts, as the planner counts them
    (:attr:`MicroBatch.planned_loss_tokens`): target tokens for encoder-decoder models,
    every non-pad token for decoder-only ones.
    """

    mb: int
    samples: tuple[int, ...]
    mbs: int
    seqlen: int
    dec_seqlen: int = 0
    loss_tokens: int = 0
    # Packing: samples of each row (empty otherwise).
    rows: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class ExecutionPlan:
    """One pipeline rank's instructions for one iteration, and what it needs to know.

    ``loss_tokens``: the loss tokens of this replica's micro-batches (the sum of their
    :attr:`MicroBatchInfo.loss_tokens`); ``global_loss_tokens`` those of the whole global
    batch over every replica: what :meth:`Executor.run` divides the summed loss by when it
    is given no ``loss_tokens``, so any micro-batching gives the same gradient. Both are
    the planner's counts: target tokens for encoder-decoder models; for decoder-only
    models every non-pad token, since the planner's lengths do not separate input from
    target. Megatron training passes the data loader's exact count instead (the sum of
    every ``loss_mask``, ``IterationMeta.global_loss_tokens``), which for decoder-only
    data counts target tokens only. Non-pad tokens (input + target) are not in the plan:
    they are ``MicroBatch.real_tokens`` and ``IterationMeta.real_tokens``.
    """

    iteration: int
    stage: int
    num_stages: int
    replica: int
    num_replicas: int
    schedule: str
    recompute: str
    micro_batches: tuple[MicroBatchInfo, ...]
    instructions: tuple[Instruction, ...]
    loss_tokens: int = 0
    global_loss_tokens: int = 0
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def plan_chunks(plan: ExecutionPlan) -> int:
    """Virtual-pipeline chunks each rank of ``plan`` runs (``meta["chunks"]``, 1 unless the
    placement is interleaved); 0 when the recorded value is not a positive integer."""
    chunks = (plan.meta or {}).get("chunks", 1)
    return chunks if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1 else 0


def virtual_stage(plan: ExecutionPlan, chunk: int) -> int:
    """The virtual stage chunk ``chunk`` of ``plan``'s rank runs: ``chunk * num_stages + stage``
    (Megatron's interleaved order; the rank's stage itself without chunks)."""
    return chunk * plan.num_stages + plan.stage


def is_first_virtual(plan: ExecutionPlan, chunk: int) -> bool:
    """Chunk ``chunk`` of this rank starts the model (it receives no activation)."""
    return virtual_stage(plan, chunk) == 0


def is_last_virtual(plan: ExecutionPlan, chunk: int) -> bool:
    """Chunk ``chunk`` of this rank ends the model (it computes the loss, receives no gradient)."""
    return virtual_stage(plan, chunk) == plan_chunks(plan) * plan.num_stages - 1


def sequence_shards(plan: ExecutionPlan) -> int:
    """Tensor-parallel ranks each sequence is split over between stages: the plan's TP size
    under Megatron's sequence parallelism (``meta["tp"]`` with ``meta["sequence_parallel"]``),
    else 1. Activation and gradient messages are then ``[seqlen / shards, mbs, hidden]``."""
    meta = plan.meta or {}
    if not meta.get("sequence_parallel"):
        return 1
    tp = meta.get("tp", 1)
    return tp if isinstance(tp, int) and not isinstance(tp, bool) else 0
