"""Tokenizers: the small interface the datasets use, Megatron's shape.

Anything with ``tokenize(text) -> list[int]``, ``vocab_size``, ``eod`` and ``pad`` works,
which is what megatron-core's tokenizers (``megatron.core.tokenizers.MegatronTokenizer``
and the legacy ``build_tokenizer`` ones) provide, so a Megatron job passes its own
tokenizer unchanged. :class:`ByteTokenizer` is the offline default: deterministic, no
files, UTF-8 bytes shifted past the special ids.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import numpy as np

from dynapipe.errors import DynaPipeError


@runtime_checkable
class Tokenizer(Protocol):
    """What the datasets need of a tokenizer (megatron-core's tokenizers qualify)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def pad(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``pad`` 0, ``eod`` 1, ``bos`` 2, byte ``b`` is id ``b + 3``.

    Vocabulary 259 ids; every text maps to the same ids on every machine.
    """

    OFFSET = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.OFFSET

    @property
    def pad(self) -> int:
        return 0

    @property
    def eod(self) -> int:
        return 1

    @property
    def bos(self) -> int:
        return 2

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_array(text).tolist()

    def tokenize_array(self, text: str) -> np.ndarray:
        """Token ids as an int64 array (the fast path the datasets use)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + self.OFFSET

    def detokenize(self, ids) -> str:
        data = bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET)
        return data.decode("utf-8", errors="replace")


def tokenize_to_array(tokenizer, text: str) -> np.ndarray:
    """``tokenizer.tokenize(text)`` as an int64 array."""
    fast = getattr(tokenizer, "tokenize_array", None)
    if fast is not None:
        return fast(text)
    return np.asarray(tokenizer.tokenize(text), dtype=np.int64).reshape(-1)


def load_megatron_tokenizer(path: Optional[str] = None, metadata: Optional[dict | str] = None, **kwargs):
    """A megatron-core tokenizer, ``MegatronTokenizer.from_pretrained(path, metadata)``.

    ``metadata`` is the tokenizer metadata (a dict or the path of its JSON file), for
    example ``{"library": "byte-level"}`` (no files) or ``{"library": "huggingface"}``
    with ``path`` the tokenizer directory.
    """
    from dynapipe.megatron_core import require_megatron_core

    require_megatron_core("a Megatron tokenizer")
    try:
        from megatron.core.tokenizers import MegatronTokenizer
    except ImportError as e:
        raise DynaPipeError(f"megatron-core's tokenizers cannot be imported ({e}); install megatron-core>=0.16.1 "
                            f"with its tokenizer dependencies, or use the byte-level tokenizer.") from None
    try:
        return MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path=metadata, **kwargs)
    except (AssertionError, OSError, ValueError, KeyError) as e:
        raise DynaPipeError(f"could not load the Megatron tokenizer (path={path!r}, metadata={metadata!r}): {e}") from None


def check_tokenizer(tokenizer) -> None:
    """Raise a clear error when ``tokenizer`` lacks what the datasets use."""
    missing = [a for a in ("tokenize", "vocab_size", "eod") if not hasattr(tokenizer, a)]
    if missing:
        raise DynaPipeError(f"tokenizer {type(tokenizer).__name__} lacks {missing}; it needs "
                            f"tokenize(text), vocab_size and eod like megatron-core's tokenizers.")
