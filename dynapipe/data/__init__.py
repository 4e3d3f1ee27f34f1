"""Data: datasets, the global-batch sampler and micro-batch tensors (numpy; no torch needed).

- :mod:`dynapipe.data.samples`: the dataset interface, length limits, over-long samples.
- :mod:`dynapipe.data.jsonl`, :mod:`dynapipe.data.indexed`, :mod:`dynapipe.data.mixture_dataset`:
  JSONL files, Megatron ``.bin``/``.idx`` datasets, the synthetic mixture
  (:mod:`dynapipe.data.synthetic`); :mod:`dynapipe.data.config` builds one from arguments.
- :mod:`dynapipe.data.pieces`: long pretraining documents cut into pieces that keep every token;
  :mod:`dynapipe.data.splits`: Megatron's ``--split``; :mod:`dynapipe.data.summary`: counts for the log.
- :mod:`dynapipe.data.tokenizer`: Megatron's tokenizer interface and a byte-level default.
- :mod:`dynapipe.data.sampler`: global batches by samples or tokens, resumable.
- :mod:`dynapipe.data.collate`: the tensors a plan's ``LoadInput`` asks for.

The data loader that plans ahead and delivers plans is :mod:`dynapipe.runtime.loader`.
"""
