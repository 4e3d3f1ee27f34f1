"""A rank body for the DDP tests: GPT and T5 runs in one job, recording when megatron-core's DDP
starts each gradient bucket's reduction (inside the backward or after it).

Kept out of the test module so the ranks (forked from the launcher's server) import only this.
"""
import os

import torch


def _probe_grad_syncs(record: list) -> None:
    """Make every bucket group's launch of its reduction append whether autograd's backward is
    running at the call (the overlapped reduction starts from DDP's backward hooks) and the
    group's gradient elements (replicas must launch the same sizes in the same order)."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    cls = buffers._ParamAndGradBucketGroup
    original = cls.start_grad_sync

    def start_grad_sync(self, *args, **kwargs):
        if self.grad_reduce_handle is None:  # a launch (megatron-core ignores a repeated call)
            record[-1].append((torch._C._current_graph_task_id() != -1,
                               sum(b.grad_data.numel() for b in self.buckets)))
        return original(self, *args, **kwargs)

    cls.start_grad_sync = start_grad_sync


def probed_runs(gpt_runs, t5_runs) -> list[dict]:
    """Train each GPT, then each T5 command line in this job; per run its losses, the DDP
    bucket groups of this rank's stage, and per launch of a reduction whether it came from
    inside the backward (``syncs``, in launch order) and its size (``sync_sizes``)."""
    from megatron_integration.initialize import destroy, end_run
    from megatron_integration.t5_arguments import parse_t5_args
    from megatron_integration.arguments import parse_training_args
    from megatron_integration.t5_training import pretrain_t5
    from megatron_integration.training import pretrain

    world = int(os.environ["WORLD_SIZE"])
    record: list = []
    _probe_grad_syncs(record)
    out = []
    try:
        for kind, argv in [("gpt", a) for a in gpt_runs] + [("t5", a) for a in t5_runs]:
            record.append([])
            if kind == "gpt":
                run = pretrain(parse_training_args(list(argv), world), stream=open(os.devnull, "w"))
            else:
                run = pretrain_t5(parse_t5_args(list(argv), world), stream=open(os.devnull, "w"))
            from megatron.core import parallel_state

            out.append({"losses": run.losses, "syncs": [inside for inside, _ in record[-1]],
                        "sync_sizes": [size for _, size in record[-1]],
                        "padded_tokens": [r.padded_tokens for r in run.results],
                        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                        "iterations": len(run.results)})
            end_run()
    finally:
        destroy()
    return out
