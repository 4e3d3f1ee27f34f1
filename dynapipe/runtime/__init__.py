"""Runtime: the pipeline executor, its point-to-point layer, and process-group helpers.

Names are loaded on first use, so a module of this package that does not need torch
(the planner workers, for instance) can be imported without importing torch.

- :class:`Executor` (:mod:`dynapipe.runtime.executor`); its contract with the model
  integration, :class:`StageHandlers`, :class:`ExecutorConfig`, :class:`IterationResult`
  (:mod:`dynapipe.runtime.contract`)
- :func:`chrome_trace`, :func:`write_chrome_trace`, :func:`gather_traces`
  (:mod:`dynapipe.runtime.exec_trace`)
- :class:`ActivationMeter`, :func:`measure_activations` (:mod:`dynapipe.runtime.activation_meter`)
  and :func:`planned_activation_peak_mib` (:mod:`dynapipe.runtime.activation_plan`): a rank's
  measured activation peak and the one its plan promises
- :func:`spawn`, :func:`spawn_outcomes`, :func:`init_distributed`, :func:`free_port`,
  :func:`select_local_gpu`, :func:`local_cuda_device`, :func:`local_gpu` (:mod:`dynapipe.runtime.distributed`)
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Executor": "executor", "ExecutorConfig": "contract", "IterationResult": "contract",
    "StageHandlers": "contract", "HandlerFailure": "contract",
    "CommFailure": "p2p", "RemoteFailure": "p2p",
    "ExecTrace": "exec_trace", "chrome_trace": "exec_trace", "write_chrome_trace": "exec_trace",
    "gather_traces": "exec_trace",
    "spawn": "distributed", "spawn_outcomes": "distributed", "init_distributed": "distributed",
    "free_port": "distributed", "DistContext": "distributed", "RankOutcome": "distributed",
    "SpawnError": "distributed", "select_local_gpu": "distributed", "local_cuda_device": "distributed",
    "local_gpu": "distributed",
    "ActivationMeter": "activation_meter", "measure_activations": "activation_meter",
    "planned_activation_peak_mib": "activation_plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"dynapipe.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'dynapipe.runtime' has no attribute {name!r}")
