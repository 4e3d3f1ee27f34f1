"""DynaPipe inside Megatron: arguments, megatron-core model stages, training steps, baselines.

This package is the only one that imports megatron-core. Import submodules directly
(``megatron_integration.arguments``, ``.model``, ...); importing the package itself
pulls in nothing heavy.
"""
