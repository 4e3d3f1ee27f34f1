"""DynaPipe for Megatron: dynamic micro-batching and variable-shape pipeline plans.

Layers, in the direction data flows: ``dynapipe.cost`` (time and memory of a
micro-batch) -> ``dynapipe.batching`` (micro-batches of a global batch) ->
``dynapipe.schedule`` (pipeline schedules and their simulator) -> ``dynapipe.plan``
(per-rank instruction lists) -> ``dynapipe.runtime`` (executor, point-to-point, data
loader). The first four are pure Python + numpy; only ``runtime`` imports torch.
"""

__version__ = "0.1.0"
