#!/usr/bin/env python
"""Planning at cluster scale: one global batch planned end to end, stage by stage.

Default case (issue targets): gpt-7b on a100-40gb as PP8 x DP64, a 100,000-sample
global batch of the synthetic mixture clipped at 2048 tokens. Reports, as the minimum
over ``--repeats`` runs on one pinned core: batching, schedule search, compilation of
every rank's plan, serialization of every plan, their sum ("whole planning"), then
reading the bytes back and validating the complete plan set. ``--replicas K`` also
times compiling and serializing only K replicas' plans (the share of one planner node
when the replicas are split across nodes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynapipe.config import load_device_config, load_model_config  # noqa: E402
from dynapipe.cost import build_cost_model  # noqa: E402
from dynapipe.data.synthetic import sample_lengths  # noqa: E402
from dynapipe.errors import DynaPipeError  # noqa: E402
from dynapipe.pipeline_planner import plan_iteration  # noqa: E402
from dynapipe.plan import deserialize_plan, serialize_plan, validate_plans  # noqa: E402

TARGETS_MS = {"whole planning": 2000.0, "validate": 1000.0}


def once(lengths, cost_model, args) -> dict:
    """Timings (ms) of one end-to-end planning of ``lengths``."""
    out = {}
    it = plan_iteration(lengths, cost_model, stages=args.stages, dp=args.dp, seq_length=args.seq_length)
    out.update(it.timings_ms)
    plans = it.all_plans()
    t0 = time.perf_counter()
    blobs = [serialize_plan(p) for p in plans]
    out["serialize"] = (time.perf_counter() - t0) * 1e3
    out["whole planning"] = out["batching"] + out["schedule"] + out["compile"] + out["serialize"]
    t0 = time.perf_counter()
    back = [deserialize_plan(b) for b in blobs]
    out["deserialize"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    summary = validate_plans(back)
    out["validate"] = (time.perf_counter() - t0) * 1e3
    if args.replicas:
        t0 = time.perf_counter()
        it2 = plan_iteration(lengths, cost_model, stages=args.stages, dp=args.dp, seq_length=args.seq_length,
                             replicas=range(args.replicas))
        part = [serialize_plan(p) for p in it2.all_plans()]
        out[f"compile+serialize of {args.replicas} replica(s)"] = (
            it2.timings_ms["compile"] + (time.perf_counter() - t0) * 1e3 - sum(it2.timings_ms.values()))
        assert part == blobs[:len(part)]
    out["_plans"] = len(plans)
    out["_bytes"] = sum(map(len, blobs))
    out["_summary"] = summary.line()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-7b")
    p.add_argument("--device", default="a100-40gb")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--dp", type=int, default=64)
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replicas", type=int, default=0, help="also time compiling only this many replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true")
    args = p.parse_args(argv)
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    try:
        cost_model = build_cost_model(load_model_config(args.model), load_device_config(args.device), args.stages)
        lengths = sample_lengths(args.samples, args.seed, args.seq_length)
        runs = [once(lengths, cost_model, args) for _ in range(args.repeats)]
    except DynaPipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model} PP{args.stages} x DP{args.dp}, {args.samples} samples (seq-length {args.seq_length}), "
          f"one core, min of {args.repeats} runs")
    print(f"  {runs[0]['_summary']}; {runs[0]['_bytes'] / 2**20:.1f} MiB of plan bytes")
    for key in runs[0]:
        if key.startswith("_"):
            continue
        best = min(r[key] for r in runs)
        target = TARGETS_MS.get(key)
        note = f"  (target <= {target:.0f} ms: {'ok' if best <= target else 'MISSED'})" if target else ""
        print(f"  {key:<36} {best:9.1f} ms{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
