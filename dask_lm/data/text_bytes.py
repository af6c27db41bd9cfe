"""How many bytes of text a row may hold before it is tokenized: a text too long for any faithful score is a bad
row found from its length in the Arrow offsets, never copied into Python nor tokenized.

Tokenizing is what makes a huge row expensive: a fast tokenizer holds about 200 bytes per token while it works
(ids, offsets, token strings, then Python ints), so one 600 MB value (55 KB of zstd parquet) took a worker past
11 GiB and its nanny's kill, four times, without naming the row. The bound here is checked on the value's byte
length, which Arrow knows without touching the value.

The bound must never refuse a row that would have fit, so it goes this way: if every token covers at most ``K``
bytes of the original text, a text of ``n`` bytes has at least ``n / K`` tokens, and a text of more than
``(limit + 1) * K`` bytes has more than ``limit`` tokens (the ``+ 1`` absorbs the token a prompt and its response
may share at their seam). The opposite fact, a token covers at least one byte, bounds tokens from above and would
refuse valid rows. A text of at most :data:`ALWAYS_TOKENIZED_BYTES` is tokenized all the same, cheaply, so that
its message gives its token count. ``K`` comes from the tokenizer's own ``tokenizer.json`` (:func:`max_token_bytes`):

- a token's vocabulary string is at most its UTF-8 length in original bytes (a byte-level token: one character
  per byte; ``"<0x41>"`` byte fallback and SentencePiece's ``"▁"`` stand for fewer bytes than they spell);
- a normalizer may shrink the text before it is cut: a Unicode normalization or lowercasing by at most 4x per
  character (``U+107A5`` is 4 bytes and NFKC makes it 1; NFC's worst is 3, Hangul jamo composition 3), a string
  replacement by its pattern's length over its replacement's;
- there is no ``K`` when one token can stand for unbounded text: an unknown token fused over a run of unknown
  characters (BPE ``fuse_unk`` without byte fallback, Unigram), WordPiece's one ``[UNK]`` per over-long word,
  WordLevel; or when text is dropped before the model sees it (a ``Strip`` / ``StripAccents`` / BERT normalizer, a
  regex replacement, a whitespace-splitting pre-tokenizer, an added token that swallows the spaces beside it).
  Such a tokenizer (and a slow one, which has no ``tokenizer.json`` to read) gets only the absolute bound.

With ``--truncate`` every text row is valid (its last tokens are kept), so no token count can refuse it; a row
over :data:`MAX_TEXT_BYTES` (or over the token bound, where that is larger) is refused all the same, as more text
than one worker's task tokenizes: its cost is memory the worker does not have. Those are the only rows refused here
that a tokenizer would have taken, and today they end in ``KilledWorker``.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass
from typing import Any

from dask_lm.interface import opt

__all__ = [
    "ALWAYS_TOKENIZED_BYTES",
    "MAX_TEXT_BYTES",
    "TextBound",
    "max_token_bytes",
    "text_bound",
    "tokenizer_token_bytes",
]

# The most text one row may hand the tokenizer whatever the token bound: at about 200 bytes of tokenizer memory per
# byte where every byte is a token (measured: a 16 MiB row of one repeated letter, 3.6 GiB and 77 s), 16 MiB stays
# within a worker's few GiB; ordinary text (about 4 bytes a token) costs a quarter of that
MAX_TEXT_BYTES = 16 << 20

# A text this short is tokenized whatever the token bound (at most about 200 MiB of tokenizer memory), so that a
# row over the bound by a little is refused with its exact token count
ALWAYS_TOKENIZED_BYTES = 1 << 20

# the most a Unicode normalization or lowercasing shrinks text, per character (see the module docstring)
_UNICODE_SHRINK = 4
_UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
# pre-tokenizers that keep every character of their input (they only cut it, or map bytes to characters)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def _shrink(normalizer: dict[str, Any] | None) -> float | None:
    """How many times fewer bytes ``normalizer`` may leave than it was given; ``None`` where it may drop text."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind in _UNICODE_NORMALIZERS:
        return _UNICODE_SHRINK
    if kind in ("Prepend", "ByteLevel"):
        return 1.0
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if pattern is None or not content:  # a regex can match anything; an empty replacement deletes
            return None
        return max(1.0, len(pattern.encode()) / len(content.encode()))
    if kind == "Sequence":
        factor = 1.0
        for n in normalizer.get("normalizers") or []:
            f = _shrink(n)
            if f is None:
                return None
            factor *= f
        return factor
    return None  # Strip, StripAccents, BertNormalizer, Precompiled (SentencePiece's charsmap), or one unknown here


def _keeps_text(pre: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer ``pre`` hands every character on (a whitespace split drops the spaces)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return str(pre.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _byte_level(spec: dict[str, Any]) -> bool:
    def has(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(spec.get("pre_tokenizer")) or has(spec.get("normalizer"))


def max_token_bytes(spec: dict[str, Any]) -> int | None:
    """The most bytes of original text one token of the tokenizer ``spec`` (its ``tokenizer.json``, parsed) can
    stand for; ``None`` where nothing bounds it (see the module docstring for the rules)."""
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):  # it takes every space beside it
        return None
    model = spec.get("model") or {}
    kind = model.get("type")
    vocab = model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        if model.get("unk_token") is not None and not model.get("byte_fallback") and model.get("fuse_unk"):
            return None  # a run of unknown characters becomes one unknown token
        pieces: list[str] = list(vocab)
    elif kind == "Unigram" and isinstance(vocab, list) and model.get("byte_fallback"):
        pieces = [p[0] for p in vocab]  # without byte fallback, unknown characters fuse into one token
    else:
        return None  # WordPiece (one [UNK] per over-long word), WordLevel, or a model unknown here
    # a byte-level token spells one character per byte; otherwise its UTF-8 length bounds the bytes it covers
    size = len if _byte_level(spec) else (lambda s: len(s.encode()))
    longest = max((size(p) for p in pieces), default=1)
    longest = max([longest, 4] + [len(str(t.get("content", "")).encode()) for t in added])  # 4: one unknown character
    return math.ceil(longest * shrink)


_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def tokenizer_token_bytes(tokenizer: Any) -> int | None:
    """:func:`max_token_bytes` of a loaded Hugging Face tokenizer (its backend's own ``tokenizer.json``, as
    transformers configured it), once per tokenizer object; ``None`` for a slow tokenizer."""
    try:
        return _BY_TOKENIZER[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    k = max_token_bytes(json.loads(backend.to_str())) if backend is not None else None
    try:
        _BY_TOKENIZER[tokenizer] = k
    except TypeError:  # not weakly referable: computed again next time
        pass
    return k


@dataclass(frozen=True)
class TextBound:
    """The most bytes a text value may hold to be tokenized, and why (for a refused row's message)."""

    max_bytes: int
    token_bytes: int | None
    """The tokenizer's most bytes per token, where it has a bound."""
    limit: int | None
    limit_why: str
    truncate: bool

    def why(self, n: int) -> str:
        """A row of ``n`` bytes (more than :attr:`max_bytes`): what is wrong, and the way on."""
        said = f"{n:,} bytes of text, more than the {self.max_bytes:,} a row may hold"
        if self.limit is not None and self.token_bytes is not None and not self.truncate:
            fix = (
                f"pass {opt('truncate', True)} to cut it to {self.limit} tokens"
                if n <= MAX_TEXT_BYTES
                else "shorten the text: it is too long to tokenize even to truncate it"
            )
            return (
                f"{said}: {self.limit_why} fit at most {self.limit} tokens of at most {self.token_bytes} bytes "
                f"each (this tokenizer's longest); it was not tokenized; {fix}"
            )
        cause = (
            ""
            if self.token_bytes is not None or self.limit is None
            else " (this tokenizer can make few tokens of much text, so its tokens give no tighter bound)"
        )
        return f"{said} to be tokenized{cause}: more than a worker tokenizes for one row; shorten the text"


def text_bound(tokenizer: Any, limit: int | None, limit_why: str, truncate: bool) -> TextBound:
    """The byte bound of a job's text values: rows of at most ``limit`` tokens (the model's positions or
    ``--max-length``, :func:`dask_lm.data.rows.position_limit`, said as ``limit_why``), cut to fit when
    ``truncate``; see the module docstring for why it refuses no row that fits."""
    k = tokenizer_token_bytes(tokenizer)
    if limit is None or k is None:
        return TextBound(MAX_TEXT_BYTES, k, limit, limit_why, truncate)
    by_tokens = max((limit + 1) * k, ALWAYS_TOKENIZED_BYTES)
    return TextBound(max(by_tokens, MAX_TEXT_BYTES) if truncate else by_tokens, k, limit, limit_why, truncate)
