"""A tiny WordPiece vocabulary and sentence-split indexed datasets for the T5 span-corruption tests,
written offline as Megatron-LM's ``preprocess_data.py --split-sentences`` lays them out: one
sequence per sentence, sentences grouped into documents (megatron-core's ``IndexedDatasetBuilder``)."""
import numpy as np

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS, PIECES = 40, 20


def write_vocab(path) -> list[str]:
    """Specials, whole-word tokens ``w*`` and continuation pieces ``##p*``, one a line; the tokens in id order."""
    tokens = SPECIALS + [f"w{i}" for i in range(WORDS)] + [f"##p{i}" for i in range(PIECES)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens) + "\n")
    return tokens


def write_sentences(prefix, docs: int, seed: int, max_sentence: int = 20) -> list[list[np.ndarray]]:
    """``docs`` documents of 2-5 sentences of 3-``max_sentence`` tokens (words, some continued by
    pieces); returns the documents' sentences as written."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    first_word, first_piece = len(SPECIALS), len(SPECIALS) + WORDS
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    written = []
    for _ in range(docs):
        sentences = []
        for _ in range(int(rng.integers(2, 6))):
            n = int(rng.integers(3, max_sentence + 1))
            piece = rng.random(n) < 0.3
            piece[0] = False  # a sentence starts a word
            ids = np.where(piece, rng.integers(first_piece, first_piece + PIECES, n),
                           rng.integers(first_word, first_word + WORDS, n))
            sentences.append(ids.astype(np.int32))
        builder.add_document(np.concatenate(sentences), [len(s) for s in sentences])
        written.append(sentences)
    builder.finalize(f"{prefix}.idx")
    return written
