"""Which dataset to read, as one dataclass built from arguments: :class:`DatasetConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dynapipe.data.samples import LengthLimits, SampleDataset
from dynapipe.data.splits import WHOLE, EmptySplitError
from dynapipe.errors import DynaPipeError, arg

DATASET_KINDS = ("synthetic", "jsonl", "indexed")


@dataclass(frozen=True)
class DatasetConfig:
    """A dataset description; :meth:`build` opens it.

    - ``synthetic``: ``num_samples`` samples of the mixture (``mixture`` YAML, default
      ``configs/data/flan-mixture.yaml``) seeded by ``seed``; token ids below ``vocab_size``.
    - ``jsonl``: ``paths`` are JSONL files, tokenised by ``tokenizer`` (an object with
      Megatron's tokenizer interface; byte-level when None) or, when
      ``tokenizer_metadata`` is set, by ``MegatronTokenizer.from_pretrained(tokenizer_path,
      tokenizer_metadata)``.
    - ``indexed``: ``paths`` are Megatron ``.bin``/``.idx`` prefixes (one task each),
      ``target_paths`` the paired target datasets.

    ``weights`` (one per path, any positive scale) blend the paths as Megatron-LM's
    ``--data-path W1 P1 W2 P2`` does, as shares of the tokens
    (:class:`~dynapipe.data.blend.BlendedSampleDataset`), into a blend of ``blend_samples``
    samples or ``blend_tokens`` tokens (the run's; at least the paths' total); without them
    every sample of every path is used once per epoch.

    Lengths above ``seq_length`` (``dec_seq_length`` for encoder-decoder targets) are
    truncated or rejected as ``overlong`` says, except indexed pretraining documents (no
    targets), which are cut into pieces that keep every token while ``split_documents``
    is True (the default; :mod:`dynapipe.data.pieces`).

    ``mmap_bin_files`` False reads indexed ``.bin`` files with plain reads instead of memory
    maps (Megatron's ``--no-mmap-bin-files``, for file systems where maps are slow).

    ``split_range`` keeps one ``--split`` range ``[lo, hi)`` of every path's documents
    (:mod:`dynapipe.data.splits`; the synthetic mixture ignores it: give each split its own
    ``seed``); ``split_name`` names the split in messages. In a blend, a path whose part of a
    validation or test split is empty is left out of that split.
    """

    kind: str
    seq_length: int
    paths: tuple[str, ...] = ()
    target_paths: tuple[str, ...] = ()
    encoder_decoder: bool = False
    dec_seq_length: int = 0
    overlong: str = "truncate"
    num_samples: int = 0
    seed: int = 1234
    vocab_size: int = 0
    mixture: Optional[str] = None
    tokenizer: object = field(default=None, compare=False)
    tokenizer_path: Optional[str] = None
    tokenizer_metadata: Optional[str] = None
    pad_id: int = 0
    eod_id: int = 1
    weights: tuple[float, ...] = ()
    split_range: tuple[float, float] = WHOLE
    split_name: str = "train"
    split_documents: bool = True
    # Megatron's --no-mmap-bin-files clears it: indexed .bin files are read with plain reads.
    mmap_bin_files: bool = True
    # Samples, or tokens, the run draws from a weighted blend (0: as many as its paths hold).
    blend_samples: int = 0
    blend_tokens: int = 0

    @property
    def limits(self) -> LengthLimits:
        return LengthLimits(self.seq_length, self.dec_seq_length, self.overlong).validate()

    def build(self) -> SampleDataset:
        """Open the dataset (tokenising JSONL, reading indexed-dataset indices) and, when
        ``vocab_size`` is set, check every token id is below it (once per dataset)."""
        dataset = self._open()
        if self.vocab_size:
            data_vocab = int(getattr(dataset, "vocab_size", 0) or 0)
            if data_vocab > self.vocab_size:
                raise DynaPipeError(f"the data's tokenizer has {data_vocab} ids but {arg('vocab_size')} is "
                                    f"{self.vocab_size}; raise {arg('vocab_size')} to at least {data_vocab}.")
            dataset.validate_tokens(self.vocab_size)
        return dataset

    def open(self) -> SampleDataset:
        """Open the dataset without checking its token ids (lengths and counts only)."""
        return self._open()

    def _open(self) -> SampleDataset:
        if self.tokenizer_path and not self.tokenizer_metadata and self.tokenizer is None:
            raise DynaPipeError(f"tokenizer_path {self.tokenizer_path!r} without tokenizer_metadata: the JSONL "
                                f"would be tokenised byte by byte; give the metadata (e.g. the tokenizer type) "
                                f"too, or a tokenizer object.")
        if self.weights:
            from dataclasses import replace

            from dynapipe.data.blend import BlendedSampleDataset

            if self.kind == "synthetic" or len(self.weights) != len(self.paths):
                raise DynaPipeError(f"{len(self.weights)} blend weights for {len(self.paths)} {self.kind} paths; "
                                    f"give one weight per data path.")
            targets = self.target_paths or (None,) * len(self.paths)
            parts, weights, empty = [], [], 0
            for p, t, w in zip(self.paths, targets, self.weights):
                try:
                    parts.append(replace(self, paths=(p,), target_paths=(t,) if t else (), weights=())._open())
                except EmptySplitError as e:
                    if self.split_name == "train":
                        raise
                    empty += e.empty_documents
                    continue  # too small to give this split a document: the other paths carry it
                weights.append(w)
            if not parts:
                raise EmptySplitError(f"no path of the blend has a document in the {self.split_name} split.",
                                      empty_documents=empty)
            return BlendedSampleDataset(parts, weights, self.seed, self.blend_samples, self.blend_tokens)
        if self.kind == "synthetic":
            from dynapipe.data.mixture_dataset import MixtureDataset
            from dynapipe.data.synthetic import load_mixture

            if self.num_samples <= 0:
                raise DynaPipeError(f"a synthetic dataset needs num_samples > 0, got {self.num_samples}.")
            return MixtureDataset(self.num_samples, self.seed, self.limits, self.vocab_size or 512,
                                  self.encoder_decoder, load_mixture(self.mixture))
        if self.kind == "jsonl":
            from dynapipe.data.jsonl import JsonlDataset
            from dynapipe.data.tokenizer import load_megatron_tokenizer

            tok = self.tokenizer
            if tok is None and self.tokenizer_metadata:
                tok = load_megatron_tokenizer(self.tokenizer_path, self.tokenizer_metadata)
            return JsonlDataset(self.paths, self.limits, tok, self.encoder_decoder,
                                split_range=self.split_range, split_documents=self.split_documents)
        if self.kind == "indexed":
            from dynapipe.data.indexed import MegatronIndexedDataset

            return MegatronIndexedDataset(self.paths, self.limits, self.target_paths or None,
                                          self.encoder_decoder, self.pad_id, self.eod_id, self.vocab_size,
                                          self.split_range, self.split_documents, self.mmap_bin_files)
        raise DynaPipeError(f"dataset kind {self.kind!r} is not known; use one of {list(DATASET_KINDS)}.")
