"""Where a loader's ranks meet: the run id they agree on through the job's torch.distributed
store (the namespace of every key the loader writes), and a store served by one process for
running the loader without torch.distributed.
"""
from __future__ import annotations

import itertools
import secrets

from dynapipe.errors import DynaPipeError
from dynapipe.runtime.kv_store import job_tcp_store
from dynapipe.runtime.loader_config import RankLayout

_loaders_created = itertools.count()


def agreed_run_id(layout: RankLayout, namespace: str) -> str:
    """A run id every rank agrees on, via the job's torch.distributed store.

    Every rank numbers the loaders it creates; ranks create them in the same order, so
    the n-th loader of every rank meets at the same key, even while a slower rank still
    reads the key of the loader before.
    """
    import torch.distributed as dist

    generation = next(_loaders_created)
    if layout.world_size == 1:
        return secrets.token_hex(6)
    if not dist.is_initialized():
        raise DynaPipeError(f"a loader for {layout.world_size} ranks needs torch.distributed initialised first.")
    store = job_tcp_store()
    key = f"{namespace}/run-id/{generation}"
    if layout.rank == 0:
        store.set(key, secrets.token_hex(6))
    store.wait([key])
    rid = bytes(store.get(key)).decode()
    if store.add(key + "/acks", 1) == layout.world_size:
        store.delete_key(key)
        store.delete_key(key + "/acks")
    return rid


def default_store_for_single_process(port: int = 0):
    """A TCPStore served by this process, for running the loader without torch.distributed."""
    import datetime

    from torch.distributed import TCPStore

    # Port 0: the store binds a port the kernel picks and keeps it (``store.port``), no window
    # in which another process could take it.
    return TCPStore("127.0.0.1", port, world_size=1, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=60))

