"""What a dataset holds, for the start-up log: documents, samples (pieces), tokens, truncations."""
from __future__ import annotations

from dataclasses import dataclass

from dynapipe.data.samples import SampleDataset


@dataclass(frozen=True)
class DataSummary:
    """Counts of one dataset (one split).

    ``documents``: documents (records, sequences) read; ``split_documents``: of those, how
    many were longer than ``--seq-length`` and cut into pieces; ``samples``: what the sampler
    draws from (pieces, or blended samples); ``document_tokens``: tokens of the documents as
    stored, each counted once (before truncation); ``truncated``: samples cut short (tokens lost);
    ``sample_tokens``: tokens the samples hold after truncation (a blend's repeats counted); ``blended``: whether
    the samples are a weighted blend of the documents (repeats or subsamples); ``empty``:
    documents of no token, skipped (not in ``documents``).
    """

    documents: int
    split_documents: int
    samples: int
    document_tokens: int
    truncated: int
    blended: bool = False
    empty: int = 0
    # Tokens the samples hold after truncation (what a token budget counts); None: not counted.
    sample_tokens: int | None = None

    def line(self, name: str, seq_length: int) -> str:
        """One log line, e.g. `` > train data: 1,200 documents (31 longer than --seq-length 1024,
        split into pieces) -> 1,262 samples, 812,345 tokens, 0 truncated``."""
        split = (f" ({self.split_documents:,} longer than --seq-length {seq_length}, split into pieces)"
                 if self.split_documents else "")
        blend = " (blended)" if self.blended else ""
        empty = f" ({self.empty:,} empty skipped)" if self.empty else ""
        # A truncated sample loses tokens the stored count still holds: say what is left to train on.
        left = (f" ({self.sample_tokens:,} tokens after truncation)"
                if self.truncated and self.sample_tokens is not None else "")
        return (f" > {name} data: {self.documents:,} documents{empty}{split} -> {self.samples:,} samples{blend}, "
                f"{self.document_tokens:,} tokens, {self.truncated:,} truncated{left}")


def summarize(dataset: SampleDataset) -> DataSummary:
    """The :class:`DataSummary` of a dataset (its parts' counts for a blend)."""
    parts = getattr(dataset, "parts", None)
    if parts is not None:
        sums = [summarize(p) for p in parts]
        return DataSummary(sum(s.documents for s in sums), sum(s.split_documents for s in sums), len(dataset),
                           sum(s.document_tokens for s in sums), sum(s.truncated for s in sums), blended=True,
                           empty=sum(s.empty for s in sums), sample_tokens=int(dataset.sample_tokens().sum()))
    kept = int(dataset.sample_tokens().sum())
    return DataSummary(int(getattr(dataset, "num_documents", len(dataset))),
                       int(getattr(dataset, "num_split_documents", 0)), len(dataset),
                       int(getattr(dataset, "document_tokens", kept)),
                       dataset.num_truncated, empty=int(getattr(dataset, "num_empty_documents", 0)), sample_tokens=kept)


__all__ = ["DataSummary", "summarize"]
