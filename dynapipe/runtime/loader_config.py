"""What a :class:`~dynapipe.runtime.loader.DynaPipeDataLoader` is told: its settings
(:class:`LoaderConfig`, built from Megatron-style arguments by the integration) and where
its rank sits in the job (:class:`RankLayout`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dynapipe.errors import DynaPipeError, check_fields, given, positive_number
from dynapipe.runtime.kv_store import KV_BACKENDS

__all__ = ["LoaderConfig", "RankLayout"]


@dataclass(frozen=True)
class LoaderConfig:
    """Data loader settings (built from Megatron-style arguments by the integration).

    Batches: ``global_batch_size`` samples or ``tokens_per_global_batch`` tokens (one of
    them), ``seed``, ``shuffle``; resume with ``consumed_samples`` and
    ``start_iteration`` from the checkpoint; ``train_iters`` iterations end the stream (None:
    it never ends; 0: it yields nothing and plans nothing, a run resumed at its end).
    Workers: ``num_workers`` planner processes per planner node, ``prefetch`` iterations
    planned ahead, ``planner_nodes`` nodes that plan (0: every node). ``split_replicas``:
    every planner node plans every iteration but compiles and publishes only the plans of
    its share of the data-parallel replicas (replica ``r`` on planner node
    ``r % planner_nodes``); batching and the schedule search are deterministic, so the
    nodes agree, and each node's compile and serialize work shrinks with their number.
    Store: ``kv_backend`` ``store`` (the job's TCPStore) or ``redis`` at
    ``redis_host:redis_port``; ``connect_timeout_s`` to reach it, ``plan_timeout_s`` the
    longest the training loop waits for one iteration. ``fetch_ahead``: decoded
    iterations each rank holds ready ahead of the training loop. ``store_retry_s``: how
    long a lost Redis connection is retried (a restarted server costs a pause, and the
    iterations it lost are planned again).
    """

    global_batch_size: int = 0
    tokens_per_global_batch: int = 0
    seed: int = 1234
    shuffle: bool = True
    consumed_samples: int = 0
    start_iteration: int = 0
    train_iters: Optional[int] = None
    num_workers: int = 1
    prefetch: int = 4
    planner_nodes: int = 0
    split_replicas: bool = False
    kv_backend: str = "store"
    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    redis_db: int = 0
    namespace: str = "dynapipe"
    connect_timeout_s: float = 30.0
    plan_timeout_s: float = 300.0
    fetch_ahead: int = 2
    store_retry_s: float = 30.0

    def validate(self) -> "LoaderConfig":
        """``self`` if every setting is usable, else ``DynaPipeError`` naming the field (or the
        flag that sets it, as the running program spells it)."""
        check_fields(self, "LoaderConfig")
        if self.kv_backend not in KV_BACKENDS:
            raise DynaPipeError(f"{given('kv_backend', self.kv_backend)}: use one of {list(KV_BACKENDS)}.")
        if self.num_workers < 1:
            raise DynaPipeError(f"{given('num_workers', self.num_workers)}: must be at least 1.")
        if self.fetch_ahead < 1:
            raise DynaPipeError(f"{given('fetch_ahead', self.fetch_ahead)}: must be at least 1 iteration.")
        if self.prefetch < 1:
            raise DynaPipeError(f"{given('prefetch', self.prefetch)}: must be at least 1 iteration.")
        if self.planner_nodes < 0:  # no rank would plan, and every rank would wait out the plan timeout
            raise DynaPipeError(f"{given('planner_nodes', self.planner_nodes)}: must be non-negative (0: every "
                                f"node plans).")
        for name, value in (("seed", self.seed), ("consumed_samples", self.consumed_samples),
                            ("start_iteration", self.start_iteration),
                            ("train_iters", 0 if self.train_iters is None else self.train_iters)):
            if value < 0:
                raise DynaPipeError(f"{given(name, value)}: must be >= 0.")
        positive_number("plan_timeout_s", self.plan_timeout_s, "s")
        positive_number("connect_timeout_s", self.connect_timeout_s, "s")
        if not 1 <= self.redis_port <= 65535:
            raise DynaPipeError(f"{given('redis_port', self.redis_port)}: must be a TCP port, 1 to 65535.")
        if self.redis_db < 0:
            raise DynaPipeError(f"{given('redis_db', self.redis_db)}: a Redis database number is 0 or more.")
        if not self.store_retry_s >= 0:
            raise DynaPipeError(f"{given('store_retry_s', self.store_retry_s)}: must be >= 0 seconds.")
        return self


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits: global rank, data-parallel replica, pipeline stage, node.

    Ranks of one node are consecutive (as torchrun assigns them); node ``n`` is ranks
    ``[n * local_world_size, (n + 1) * local_world_size)``.
    """

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @staticmethod
    def from_env(dp_size: int, pp_size: int) -> "RankLayout":
        """This rank's layout from torchrun's environment (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; one process without them), in Megatron's rank
        order: tensor-parallel ranks innermost (``WORLD_SIZE / (dp_size x pp_size)`` of them), then
        data-parallel replicas, pipeline stages outermost."""
        import os

        env = {k: int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))}
        world = env["WORLD_SIZE"]
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        for name, size in (("dp_size", dp_size), ("pp_size", pp_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise DynaPipeError(f"{given(name, size)}: must be a whole number of at least 1.")
        if world % (dp_size * pp_size):
            raise DynaPipeError(f"WORLD_SIZE {world} is not a multiple of dp_size {dp_size} x pp_size {pp_size}; "
                                f"launch dp x pp x (tensor-parallel size) processes.")
        tp = world // (dp_size * pp_size)
        rank = env["RANK"]
        return RankLayout(rank, world, (rank // tp) % dp_size, dp_size, rank // (tp * dp_size), pp_size,
                          env["LOCAL_RANK"], local_world).validate()

    def validate(self) -> "RankLayout":
        """``self`` if the indices fit the sizes, else ``DynaPipeError``."""
        sizes = {"world_size": self.world_size, "dp_size": self.dp_size, "pp_size": self.pp_size,
                 "local_world_size": self.local_world_size}
        for name, size in sizes.items():
            if size < 1:
                raise DynaPipeError(f"rank layout: {name} {size} must be at least 1.")
        if self.world_size % (self.dp_size * self.pp_size):
            raise DynaPipeError(f"world size {self.world_size} is not a multiple of dp {self.dp_size} x "
                                f"pp {self.pp_size}.")
        if self.world_size % self.local_world_size:
            raise DynaPipeError(f"world size {self.world_size} is not a multiple of the "
                                f"{self.local_world_size} ranks per node.")
        if not (0 <= self.dp_rank < self.dp_size and 0 <= self.pp_rank < self.pp_size
                and 0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size):
            raise DynaPipeError(f"rank layout {self} has an index out of range.")
        if self.local_rank != self.rank % self.local_world_size:
            # Each node's local rank 0 plans for its node: a local rank that is not the rank's
            # place on its node would start a second planner for the same node.
            raise DynaPipeError(f"rank layout: global rank {self.rank} is local rank "
                                f"{self.rank % self.local_world_size} of nodes of {self.local_world_size} ranks "
                                f"(consecutive ranks a node, as torchrun assigns them), not {self.local_rank}; "
                                f"give LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them.")
        return self

    @property
    def node(self) -> int:
        """This rank's node (ranks of a node are consecutive)."""
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        """Nodes in the job."""
        return self.world_size // self.local_world_size

    @property
    def readers_per_payload(self) -> int:
        """Ranks that read the same (replica, stage) payload: tensor/context-parallel peers."""
        return self.world_size // (self.dp_size * self.pp_size)


def planner_node_count(planner_nodes: Optional[int], split_replicas: bool, layout: RankLayout) -> int:
    """How many nodes plan (``planner_nodes``, 0 or None: every node; with ``split_replicas``
    no more than there are replicas, as a node without a replica to plan stays out)."""
    count = min(planner_nodes or layout.num_nodes, layout.num_nodes)
    return min(count, layout.dp_size) if split_replicas else count


def plans_here(planner_nodes: Optional[int], split_replicas: bool, layout: RankLayout) -> bool:
    """Whether the rank of ``layout`` starts its node's planner workers: local rank 0 of a
    planner node (see :func:`planner_node_count`)."""
    return layout.local_rank == 0 and layout.node < planner_node_count(planner_nodes, split_replicas, layout)
