"""How much slower a stage's work runs on this host while the other pipeline ranks compute too.

A cost profile times every op on one rank with the rest of the host idle, and the simulator
adds the ops of each stage as if the stages were independent devices. On a GPU cluster they
are. On a CPU host the ranks share caches, memory bandwidth and, on a virtual machine, possibly
the physical cores behind its virtual ones: when the schedule fills a bubble, the overlapped
ops slow each other down, and part of the bubble a schedule removes comes back as compute.

:func:`measure_contention` times the same forward and backward of a transformer-layer-shaped
workload (hidden ``hidden``, FFN ``4 x hidden``, ``tokens`` tokens, one thread) on ``ranks``
spawned processes, alternately one rank at a time with the others idle and all at once, and
returns the ratio; ``python -m megatron_integration.bench_contention`` prints it. A factor
near 1 says the host gives every rank a core of its own, so a stage that computes slower
inside the pipeline than in its profile lost its core to something else (see
``--dynapipe-cpu-affinity``).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Contention:
    """Median ms of one forward + backward, alone and with every rank computing."""

    ranks: int
    tokens: int
    hidden: int
    alone_ms: float
    together_ms: float

    @property
    def factor(self) -> float:
        """How many times its time alone a pass takes while all ranks compute."""
        return self.together_ms / self.alone_ms

    def to_json(self) -> dict:
        """The measurement and its factor, for a bench's JSON."""
        return {**asdict(self), "factor": round(self.factor, 3)}


def _layer_pass(x, w1, w2, wqkv, heads: int) -> None:
    import torch

    t, h = x.shape
    qkv = (x @ wqkv).view(t, 3, heads, h // heads).permute(1, 2, 0, 3)
    attn = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    y = attn.permute(1, 0, 2).reshape(t, h) + x
    out = torch.nn.functional.gelu(y @ w1) @ w2
    out.sum().backward()


def _worker(rank: int, tokens: int, hidden: int, passes: int, barrier, results) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden, requires_grad=True)
    w1, w2, wqkv = ((torch.randn(*shape) * 0.02).requires_grad_()
                    for shape in ((hidden, 4 * hidden), (4 * hidden, hidden), (hidden, 3 * hidden)))
    heads = max(1, hidden // 64)
    _layer_pass(x, w1, w2, wqkv, heads)  # warm-up: allocator and kernels
    n = barrier.parties

    def timed(count: int) -> list[float]:
        out = []
        for _ in range(count):
            start = time.perf_counter()
            _layer_pass(x, w1, w2, wqkv, heads)
            out.append((time.perf_counter() - start) * 1e3)
        return out

    # Alternate the phases, a few passes each, so that a drift of the host's speed (other
    # tenants, frequency) weighs on both alike.
    alone, together = [], []
    for _ in range(passes):
        for turn in range(n):  # one rank at a time; the others wait at the barrier
            barrier.wait()
            if turn == rank:
                alone += timed(2)
        barrier.wait()
        together += timed(2)
    results.put((rank, statistics.median(alone), statistics.median(together)))


def measure_contention(ranks: int = 2, tokens: int = 512, hidden: int = 512, passes: int = 5,
                       timeout_s: float = 300.0) -> Contention:
    """Spawn ``ranks`` one-thread processes; ``passes`` times over, time two forward +
    backward passes of a layer-shaped workload (``tokens`` tokens, ``hidden`` wide) on each
    process alone, then two on all together; return the medians (ms, median over ranks). Raises ``RuntimeError`` if a rank fails
    or the measurement outlasts ``timeout_s`` seconds."""
    if ranks < 2:
        raise ValueError(f"contention needs at least 2 ranks, got {ranks}")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks, timeout=timeout_s), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, tokens, hidden, passes, barrier, results), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout_s
    try:
        while len(got) < ranks:
            try:
                got.append(results.get(timeout=0.5))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"the contention measurement failed or outlasted {timeout_s:.0f} s "
                                       f"(rank exit codes {[p.exitcode for p in procs]})") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return Contention(ranks, tokens, hidden, round(statistics.median(a for _, a, _ in got), 3),
                      round(statistics.median(t for _, _, t in got), 3))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: print the measurement as a line and as JSON."""
    ap = argparse.ArgumentParser(prog="python -m megatron_integration.bench_contention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="processes computing at once (default 2)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per pass (default 512)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size; FFN is 4x (default 512)")
    ap.add_argument("--passes", type=int, default=5, help="alternations of the two phases, 2 passes each (default 5)")
    args = ap.parse_args(argv)
    c = measure_contention(args.ranks, args.tokens, args.hidden, args.passes)
    print(f"{c.ranks} ranks, {c.tokens} tokens x hidden {c.hidden}: one forward + backward takes "
          f"{c.alone_ms:.1f} ms alone, {c.together_ms:.1f} ms with every rank computing ({c.factor:.2f}x)")
    print(json.dumps(c.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
