"""T5 span-corruption pairs from Megatron indexed datasets, made by megatron-core's T5 dataset.

``--data-path PREFIX [PREFIX ...]`` (or ``W1 P1 W2 P2 ...``; or ``--train-data-path``) with ``--tokenizer-type
BertWordPieceLowerCase|BertWordPieceCase --vocab-file vocab.txt --vocab-extra-ids N``
names indexed datasets of sentences grouped into documents (Megatron-LM's
``tools/preprocess_data.py --split-sentences``). megatron-core's
:class:`~megatron.core.datasets.t5_dataset.T5MaskedWordPieceDataset`, built through its
``BlendedMegatronDatasetBuilder`` with the configuration Megatron-LM's ``pretrain_t5.py``
gives it (``--seed``, ``--split``, ``--mask-prob``, ``--short-seq-prob``, ``--data-cache-path``,
spans of up to 10 whole words of geometric length), makes every sample: sentences packed up
to ``--encoder-seq-length - 2`` tokens, spans replaced by sentinels in the encoder input,
the decoder target the sentinels and their spans then ``[EOS]``.

Megatron's samples are padded to ``--encoder-seq-length`` / ``--decoder-seq-length``.
:class:`SpanCorruptionDataset` keeps their unpadded pairs, read off Megatron's masks: input =
the encoder tokens up to the last unmasked one, target = Megatron's labels under its loss
mask. The decoder input Megatron makes, ``[BOS]`` then the labels shifted right, is what
:func:`dynapipe.data.collate.collate` makes from a target with ``eod_id = [BOS]``, so the
padding baseline's rows are Megatron's own tensors (pads are 0, as Megatron writes them),
and DynaPipe and packing train on the same pairs.

The run's samples are the first ``--train-iters x --global-batch-size`` of Megatron's train
split, the samples a Megatron-LM run trains on; evaluation reads Megatron's validation and
test splits of ``--split`` (as many samples as Megatron-LM's run draws of each). Every sample's lengths are computed up front
(the planner and sampler need them; one span corruption a sample), each rank a share, then
gathered, and kept next to megatron-core's index cache for the next run of the same data and
flags.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dynapipe.data.samples import SampleDataset
from dynapipe.errors import DynaPipeError
from megatron_integration.wordpiece import WordPieceVocab, wordpiece_vocab

# Megatron-LM pretrain_t5.py's fixed masking settings (SpanBERT-style geometric span lengths).
MAX_NGRAM = 10


SPLIT_NAMES = ("training", "validation", "test")  # megatron-core's split indices 0, 1, 2


@dataclass(frozen=True)
class SpanCorruptionConfig:
    """Where the pairs come from and how they are cut. Lengths in tokens.

    ``paths`` / ``weights``: ``--data-path`` or ``--train-data-path`` (weights empty when not
    given); ``split``: megatron-core's split string of ``--data-path`` (None: the paths are
    ``--train-data-path``, megatron-core's train blend of its per-split blends); ``num_samples``: samples of the run (``--train-iters x
    --global-batch-size``); ``cache_path``: ``--data-cache-path`` (None: megatron-core's
    default, a ``cache`` directory under each dataset prefix).
    """

    paths: tuple[str, ...]
    weights: tuple[float, ...]
    split: Optional[str]
    num_samples: int
    encoder_seq_length: int
    decoder_seq_length: int
    seed: int
    tokenizer_type: str
    vocab_file: str
    vocab_extra_ids: int
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    cache_path: Optional[str] = None
    # Which of megatron-core's splits: 0 train, 1 validation, 2 test (of ``split``, or of the
    # per-split blends: ``paths`` for training and these, from --valid/--test-data-path).
    split_index: int = 0
    valid_paths: tuple[str, ...] = ()
    valid_weights: tuple[float, ...] = ()
    test_paths: tuple[str, ...] = ()
    test_weights: tuple[float, ...] = ()

    def has_split(self, index: int) -> bool:
        """Whether split ``index`` (0 train, 1 validation, 2 test) has data."""
        if self.split is not None:
            from dynapipe.data.splits import parse_split

            return parse_split(self.split)[index] > 0  # any separator, missing shares 0, as megatron-core
        return index == 0 or bool((self.valid_paths, self.test_paths)[index - 1])

    def vocab(self) -> WordPieceVocab:
        return wordpiece_vocab(self.tokenizer_type, self.vocab_file, self.vocab_extra_ids)

    @property
    def worst_decoder_length(self) -> int:
        """Decoder tokens of a sample whose every masked span is one token: ``[BOS]``, then a
        sentinel and a token per span (Megatron masks at most ``mask_prob x (encoder - 2)`` tokens)."""
        return 1 + 2 * math.floor(self.mask_prob * (self.encoder_seq_length - 2))


def megatron_dataset_config(cfg: SpanCorruptionConfig):
    """megatron-core's ``T5MaskedWordPieceDatasetConfig`` as Megatron-LM's ``pretrain_t5.py`` fills it."""
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig

    def blend(paths, weights):
        return (list(paths), list(weights) if weights else None) if paths else None

    train = blend(cfg.paths, cfg.weights)
    per_split = [train, blend(cfg.valid_paths, cfg.valid_weights), blend(cfg.test_paths, cfg.test_weights)]
    return T5MaskedWordPieceDatasetConfig(
        random_seed=cfg.seed, sequence_length=cfg.encoder_seq_length, sequence_length_decoder=cfg.decoder_seq_length,
        blend=train if cfg.split is not None else None, split=cfg.split,
        blend_per_split=None if cfg.split is not None else per_split,
        path_to_cache=cfg.cache_path, tokenizer=cfg.vocab(), masking_probability=cfg.mask_prob,
        short_sequence_probability=cfg.short_seq_prob, masking_max_ngram=MAX_NGRAM, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)


def build_megatron_dataset(cfg: SpanCorruptionConfig):
    """Megatron's split ``cfg.split_index`` of ``cfg.num_samples`` samples (a
    ``T5MaskedWordPieceDataset``, or a ``BlendedDataset`` of them).

    Collective when torch.distributed is initialised (megatron-core builds its index cache on
    rank 0 first); without it (planner worker processes) it reads the cache the job wrote.
    """
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset

    sizes = [0, 0, 0]
    sizes[cfg.split_index] = cfg.num_samples
    builder = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, sizes, lambda: True, megatron_dataset_config(cfg))
    try:
        train = builder.build()[cfg.split_index]
    except Exception as e:
        if str(e).startswith("Failed to write dataset materials"):  # megatron-core's own words
            folder = cfg.cache_path or os.path.join(cfg.paths[0], "cache")
            raise DynaPipeError(f"megatron-core could not write the T5 dataset's index cache under {folder} "
                                f"({e.__cause__ or e.__context__}); give --data-cache-path a writable "
                                f"folder.") from None
        if not isinstance(e, (ValueError, RuntimeError)) or dist.is_initialized():
            raise
        # megatron-core asks torch.distributed for the rank before writing a missing index cache.
        raise DynaPipeError(f"the T5 dataset index cache of {list(cfg.paths)} is missing in this process ({e}); "
                            f"give every node the same --data-cache-path on a shared file system.") from None
    if train is None or len(train) == 0:
        raise DynaPipeError(f"{' '.join(cfg.paths)}: Megatron's T5 dataset made no sample (it skips "
                            f"empty documents, and documents of several sentences one of which is over 512 tokens); "
                            f"check the data was written with preprocess_data.py --split-sentences.")
    return train


def _everyone_hears(fn, *args):
    """``(("ok", fn(*args)), None)`` or ``(("error", message), exception)``: what collective
    callers share before going on, so that a failure on one rank is raised on all and none waits."""
    try:
        return ("ok", fn(*args)), None
    except Exception as e:
        text = str(e) if isinstance(e, DynaPipeError) else f"{type(e).__name__}: {e}"
        return ("error", text), e


def _collective_table(cached, compute_rows, n: int) -> tuple[np.ndarray, bool]:
    """The ``(n, 4)`` sample table: rank 0's ``cached()`` (None on a miss) broadcast, else every
    rank's ``compute_rows(lo, hi)`` share gathered; True when it was computed. Without a
    process group (or alone) a plain call."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        table = cached()
        return (table, False) if table is not None else (compute_rows(0, n), True)
    rank, world = dist.get_rank(), dist.get_world_size()
    box, failure = [None], None
    if rank == 0:
        (box[0], failure) = _everyone_hears(cached)
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise failure or DynaPipeError(box[0][1])
    if box[0][1] is not None:
        return box[0][1], False
    lo, hi = n * rank // world, n * (rank + 1) // world
    mine, failure = _everyone_hears(compute_rows, lo, hi)
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    bad = next((text for kind, text in shares if kind == "error"), None)
    if bad is not None:
        raise failure or DynaPipeError(bad)
    return np.concatenate([rows for _, rows in shares]), True


def check_added_ids(sample: dict, n_in: int, n_out: int, vocab: WordPieceVocab, where: str) -> None:
    """Refuse a sample whose data holds one of the ids Megatron-LM adds to the vocabulary file
    (``[BOS]``, ``[EOS]``, the sentinels): megatron-core would read it as that token, so the
    encoder would see sentinels it did not place. Span corruption places sentinels 0..k-1 in the
    encoder input, and sentinels 0..k-1 then ``[EOS]`` in the labels; any other added id came
    from the data (tokenised with a larger vocabulary than ``--vocab-file``)."""
    sentinels = vocab.additional_special_tokens_ids
    added = np.asarray([vocab.bos, vocab.eos, *sentinels])
    enc, labels = np.asarray(sample["text_enc"][:n_in]), np.asarray(sample["labels"][:n_out])
    in_enc, in_labels = enc[np.isin(enc, added)].tolist(), labels[np.isin(labels, added)].tolist()
    k = len(in_enc)
    stray = _first_stray(in_enc, sentinels[:k])
    if stray is None:
        stray = _first_stray(in_labels, sentinels[:k] + [vocab.eos])
    if stray is None:
        return
    raise DynaPipeError(f"{where}: the data holds token id {stray}, which is {vocab.inv_vocab[stray]} here: "
                        f"--vocab-file {vocab.vocab_file!r} has {vocab.file_size:,} entries and Megatron-LM adds "
                        f"[BOS], [EOS] and the {vocab.vocab_extra_ids} sentinels of --vocab-extra-ids after them; "
                        f"the data was tokenised with another vocabulary.")


def _first_stray(got: list, expected: list) -> Optional[int]:
    """The first id of ``got`` where it departs from ``expected`` (None where they agree)."""
    for i, t in enumerate(got):
        if i >= len(expected) or t != expected[i]:
            return t
    return None if len(got) == len(expected) else expected[len(got)]


def pair_lengths(sample: dict, bos: int, eos: int) -> tuple[int, int]:
    """(input, target) tokens of one of Megatron's padded samples, from its masks; checks that
    its decoder input is ``[BOS]`` + the labels shifted right (what collate rebuilds)."""
    enc = np.flatnonzero(sample["enc_mask"])
    n_in = int(enc[-1]) + 1 if len(enc) else 0
    n_out = int(sample["loss_mask"].sum())
    if n_in == 0 or len(enc) != n_in:
        raise DynaPipeError("a T5 sample's encoder input holds the [PAD] id inside its text (Megatron's mask hides "
                            "it from attention, unpadded pairs cannot); tokenise the data without [PAD] tokens.")
    dec, labels = sample["text_dec"], sample["labels"]
    if (n_out < 1 or not sample["loss_mask"][:n_out].all() or dec[0] != bos or labels[n_out - 1] != eos
            or not np.array_equal(dec[1:n_out], labels[:n_out - 1])):
        raise DynaPipeError("a T5 sample's decoder input is not [BOS] + its labels shifted right; this "
                            "megatron-core's T5 dataset is not the one this reader was written for.")
    return n_in, n_out


class SpanCorruptionDataset(SampleDataset):
    """Megatron's span-corrupted T5 pairs, unpadded (see the module docstring); ``task`` is the
    blend's dataset index. Pickles without megatron-core objects: a planner worker reopens
    Megatron's dataset (from its index cache) on first read."""

    encoder_decoder = True
    # megatron-core's T5 dataset shuffles its samples, and Megatron-LM's sampler reads them in
    # order: so does the sampler here (data.reshuffles), for Megatron-LM's global batches.
    ordered_by_megatron = True

    def __init__(self, cfg: SpanCorruptionConfig):
        self.cfg = cfg
        vocab = cfg.vocab()
        self.pad_id, self.eod_id, self.vocab_size = 0, vocab.bos, vocab.vocab_size
        self._vocab = vocab
        self._megatron = build_megatron_dataset(cfg)
        n = min(cfg.num_samples, len(self._megatron))
        table, computed = _collective_table(lambda: self._cached_table(n), self._table_rows, n)
        if computed:
            self._save_table(table)
        self.input_lengths, self.target_lengths = table[:, 0].copy(), table[:, 1].copy()
        self.truncated, self.tasks = table[:, 2].astype(bool), table[:, 3].copy()

    def _table_rows(self, lo: int, hi: int) -> np.ndarray:
        """Samples ``[lo, hi)``: input tokens, target tokens, Megatron's truncated flag, dataset index."""
        rows = np.zeros((hi - lo, 4), dtype=np.int64)
        for i in range(lo, hi):
            s = self._sample(i)
            rows[i - lo, :2] = pair_lengths(s, self.eod_id, self._vocab.eos)
            check_added_ids(s, *rows[i - lo, :2], self._vocab, self._where(i))
            rows[i - lo, 2], rows[i - lo, 3] = int(s["truncated"]), int(s.get("dataset_id", 0))
        return rows

    def _cached_table(self, n: int) -> Optional[np.ndarray]:
        cache = self._table_cache_path(n)
        if cache is None or not os.path.isfile(cache):
            return None
        try:
            table = np.load(cache)
        except (OSError, ValueError):
            return None  # half-written or foreign: computed again
        return table if table.shape == (n, 4) else None

    def _save_table(self, table: np.ndarray) -> None:
        """Keep the table next to megatron-core's index cache (rank 0; best effort)."""
        import torch.distributed as dist

        cache = self._table_cache_path(len(table))
        if cache is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            np.save(cache + ".tmp.npy", table)
            os.replace(cache + ".tmp.npy", cache)
        except OSError:
            pass  # a read-only data directory: computed again next time

    def _table_cache_path(self, n: int) -> Optional[str]:
        key = getattr(self._megatron, "unique_description_hash", None)
        if key is None:
            return None
        folder = self.cfg.cache_path or os.path.join(self.cfg.paths[0], "cache", "T5MaskedWordPieceDataset_indices")
        return os.path.join(folder, f"{key}-SpanCorruptionDataset-{n}-lengths.npy")

    def build(self) -> "SpanCorruptionDataset":
        """Already open: itself (what :meth:`dynapipe.data.config.DatasetConfig.build` gives)."""
        return self

    open = build  # what DatasetConfig.open gives, for the start-up data lines

    def summary_line(self, name: str) -> str:
        """The start-up line of this split, e.g. `` > train data: 640 span-corrupted samples of
        megatron-core's T5 dataset (--split 969,30,1) -> 81,920 input + 19,840 target tokens, 3
        truncated (...)``: samples, not documents (megatron-core packs sentences of a document
        into each sample). Truncated: megatron-core cut the sample's sentences at its length,
        ``--encoder-seq-length - 2`` or, for the share ``--short-seq-prob`` draws, shorter."""
        cfg = self.cfg
        source = f"--split {cfg.split}" if cfg.split is not None else "per-split data paths"
        return (f" > {name} data: {len(self):,} span-corrupted samples of megatron-core's T5 dataset ({source}) "
                f"-> {int(self.input_lengths.sum()):,} input + {int(self.target_lengths.sum()):,} target tokens, "
                f"{self.num_truncated:,} truncated (sentences cut at --encoder-seq-length {cfg.encoder_seq_length} "
                f"- 2 tokens, or shorter for the samples --short-seq-prob {cfg.short_seq_prob:g} makes short)")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_megatron"] = None
        return state

    def _sample(self, idx: int) -> dict:
        if self._megatron is None:
            self._megatron = build_megatron_dataset(self.cfg)
        cfg = self.cfg
        where = self._where(idx)
        try:
            return self._megatron[idx]
        except KeyError as e:
            vocab = self._vocab
            raise DynaPipeError(f"{where}: token id {e.args[0]} is not in --vocab-file {cfg.vocab_file!r} "
                                f"({vocab.file_size:,} entries, {vocab.vocab_size:,} ids with the tokens Megatron-LM "
                                f"adds); the data was tokenised with another vocabulary.") from None
        except IndexError:
            raise DynaPipeError(f"{where} masks more spans than the {cfg.vocab_extra_ids} sentinels of "
                                f"--vocab-extra-ids; raise it (up to {cfg.worst_decoder_length // 2} spans a sample "
                                f"at these lengths; Megatron-LM's T5 uses 100).") from None
        except AssertionError:
            raise DynaPipeError(f"{where}: its span-corrupted target is longer than --decoder-seq-length "
                                f"{cfg.decoder_seq_length}; raise --decoder-seq-length (at most "
                                f"{cfg.worst_decoder_length} tokens at --encoder-seq-length {cfg.encoder_seq_length} "
                                f"and --mask-prob {cfg.mask_prob}).") from None

    def _where(self, idx: int) -> str:
        return f"T5 {SPLIT_NAMES[self.cfg.split_index]} sample {idx}"

    def _read(self, idx: int, input_len: int, target_len: int) -> tuple[np.ndarray, np.ndarray, int]:
        s = self._sample(idx)
        if pair_lengths(s, self.eod_id, self._vocab.eos) != (input_len, target_len):
            raise DynaPipeError(f"T5 sample {idx}: the lengths cached in {self._table_cache_path(len(self))} "
                                f"disagree with the data (rewritten since?); delete that file.")
        check_added_ids(s, input_len, target_len, self._vocab, self._where(idx))
        return s["text_enc"][:input_len], s["labels"][:target_len], int(self.tasks[idx])
