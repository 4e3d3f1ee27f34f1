"""Imported last by the rank server (:mod:`dynapipe.runtime.process_start`): moves every object
the server's imports created into the collector's permanent generation before any rank forks.

Why: the imports of torch and megatron-core leave about 450,000 objects the cyclic garbage
collector would otherwise walk on every full collection in every rank, though none of them is
ever garbage (a full collection of a forked rank took about 0.3 s; frozen, under a millisecond).
Walking them also writes to each object's header, copying the pages a forked rank shares with
the server. CPython's ``gc.freeze`` documentation recommends freezing before ``fork`` for both.
"""
import gc

gc.freeze()
