"""The rows of one scoring partition, made ready for the model: every value read with its location, tokenized,
checked against the vocabulary and the model's position limit, and truncated on the context side when asked.

Nothing here runs the model. A row that cannot be scored faithfully gets an error naming file, row (its index in
the file), column, what is wrong and the fix; the caller either fails the job with the first one
(:class:`BadRowError`, exit 2 from the CLI) or, with ``--skip-bad-rows``, lists them in ``_errors.parquet``.

Values are taken from the partition's Arrow arrays rather than through pandas: a string column holding bytes that
are not UTF-8 (parquet does not check) would otherwise raise ``UnicodeDecodeError`` for the whole partition, and a
null inside a list would come back as ``pd.NA`` / NaN rather than something a row check can name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dask_lm.data.continuation import Convention, encode_pairs, encode_texts
from dask_lm.data.messages import ScoreOptions
from dask_lm.data.text_bytes import TextBound, text_bound
from dask_lm.errors import BadRowError
from dask_lm.interface import opt

__all__ = ["BadRowError", "PreparedRows", "RowModel", "position_limit", "prepare_rows", "tokenize_rows"]


@dataclass(frozen=True)
class RowModel:
    """What a model asks of the rows given to it: ``tokenizer`` makes text rows token ids (``None``: it has none
    that loads, so only token-id rows), every id is below ``vocab_size``, and no row is longer than
    ``max_positions`` (``None``: the model states no limit)."""

    tokenizer: Any
    vocab_size: int
    max_positions: int | None


@dataclass
class PreparedRows:
    """Per input row: the token ids given to the model (``None`` for a bad row), the first scored position, whether
    tokens were cut off the front, and the error that makes it a bad row (``None`` for a good one)."""

    ids: list[list[int] | None]
    start: list[int]
    truncated: list[bool]
    errors: list[str | None]


def position_limit(max_positions: int | None, max_length: int | None) -> tuple[int | None, str]:
    """The longest row given to the model, and what sets it (for messages): ``--max-length`` when it is the
    smaller, else the model's ``max_position_embeddings``. Rotary models run past that number without an error but
    were never trained there, and learned-position models fail with an index error that names no row: either way a
    longer row is a bad row, not a silently wrong score."""
    if max_length is not None and (max_positions is None or max_length <= max_positions):
        return max_length, opt("max_length", max_length)
    if max_positions is not None:
        return max_positions, f"the model's {max_positions} positions (max_position_embeddings in its config.json)"
    return None, ""


def _bad(file: str, row: int, column: str | tuple[str, str], why: str) -> str:
    where = f"column {column!r}" if isinstance(column, str) else f"columns {column[0]!r} + {column[1]!r}"
    return f"{file}: row {row}, {where}: {why}"


def _arrow_values(
    series: Any,
    bound: TextBound | None = None,
    file: str = "",
    first_row: int = 0,
    column: str = "",
    errors: list[str | None] | None = None,
) -> tuple[Any, list[Any]] | None:
    """(Arrow type, Python values) of an Arrow-backed column, strings as ``bytes`` so that decoding is per row;
    ``None`` for a column pandas holds as Python objects. With ``bound``, a string value over its bytes is a bad
    row (its error in ``errors``) and comes back as ``None``: its length is read from the Arrow offsets, and the
    value is never copied into Python."""
    import pyarrow as pa

    if not hasattr(series.array, "__arrow_array__"):
        return None
    arr = series.array.__arrow_array__()
    t = arr.type
    if pa.types.is_string(t):
        arr = arr.cast(pa.binary())  # a view of the same buffers: no UTF-8 check, so a bad row cannot fail them all
    elif pa.types.is_large_string(t):
        arr = arr.cast(pa.large_binary())
    elif pa.types.is_string_view(t):
        arr = arr.cast(pa.binary_view())
    if (
        bound is not None
        and errors is not None
        and (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type) or pa.types.is_binary_view(arr.type))
    ):
        arr = _without_long(arr, bound, file, first_row, column, errors)
    return t, arr.to_pylist()


def _without_long(arr: Any, bound: TextBound, file: str, first_row: int, column: str, errors: list[str | None]) -> Any:
    """``arr`` (binary) with its values over ``bound`` replaced by nulls, each a bad row in ``errors``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pc.binary_length(arr)  # from the offsets alone; chunk by chunk (combining chunks would copy them)
    long = pc.fill_null(pc.greater(lengths, bound.max_bytes), False)
    if not pc.any(long).as_py():
        return arr
    flags = long.combine_chunks() if isinstance(long, pa.ChunkedArray) else long  # booleans: a bit per row
    for i in pc.indices_nonzero(flags).to_pylist():
        if errors[i] is None:
            errors[i] = _bad(file, first_row + i, column, bound.why(lengths[i].as_py()))
    return pc.if_else(long, pa.scalar(None, arr.type), arr)  # copies the other values only


def _texts(
    pdf: Any, column: str, file: str, first_row: int, errors: list[str | None], bound: TextBound | None = None
) -> list[str | None]:
    """The column's strings; a null, a non-string, bytes that are not UTF-8 or more bytes than ``bound`` mark the
    row bad (first error wins)."""
    got = _arrow_values(pdf[column], bound, file, first_row, column, errors)
    values = got[1] if got is not None else pdf[column].tolist()
    out: list[str | None] = [None] * len(values)
    for i, v in enumerate(values):
        why = None
        if errors[i] is not None and got is not None:  # over the bound: its value was never read
            continue
        if isinstance(v, str) and bound is not None and _utf8_over(v, bound.max_bytes):
            why = bound.why(len(v.encode()))
        elif isinstance(v, str):
            out[i] = v
        elif isinstance(v, bytes) and got is not None:
            try:
                out[i] = v.decode("utf-8")
            except UnicodeDecodeError as e:
                why = (
                    f"expected a string, got bytes that are not valid UTF-8 (byte {e.start}, "
                    f"{v[e.start : e.start + 4]!r}: {e.reason}); re-encode the text as UTF-8"
                )
        elif v is None or _is_na(v):
            why = "expected a string, got null"
        else:
            why = f"expected a string, got {type(v).__name__} {_short(v)}"
        if why is not None and errors[i] is None:
            errors[i] = _bad(file, first_row + i, column, why)
    return out


def _utf8_over(text: str, max_bytes: int) -> bool:
    """Whether ``text`` (a Python string the caller already holds) encodes to more than ``max_bytes`` UTF-8 bytes,
    without encoding it where its length in characters decides (1 to 4 bytes each)."""
    if len(text) > max_bytes:
        return True
    return 4 * len(text) > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes


def _token_lists(pdf: Any, column: str, file: str, first_row: int, errors: list[str | None]) -> list[list[int] | None]:
    """The column's token-id lists; a null list, a null or non-integer id, or a non-list marks the row bad."""
    import pyarrow as pa

    got = _arrow_values(pdf[column])
    # an Arrow list<int> holds Python ints or None: one C-level scan per row finds a null; anything else (a
    # pandas object column) is checked value by value
    ints = got is not None and pa.types.is_integer(getattr(got[0], "value_type", pa.null()))
    values = got[1] if got is not None else pdf[column].tolist()
    out: list[list[int] | None] = [None] * len(values)
    for i, v in enumerate(values):
        why = None
        if v is None or _is_na(v):
            why = "expected a list of token ids, got null"
        elif isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
            why = f"expected a list of token ids, got {type(v).__name__} {_short(v)}"
        elif ints:
            if None in v:
                why = f"null token id at position {v.index(None)} (of {len(v)})"
            else:
                out[i] = v
        else:
            toks = list(v)
            k = next((k for k, t in enumerate(toks) if t is None or _is_na(t) or not _is_int(t)), None)
            if k is None:
                out[i] = [int(t) for t in toks]
            elif toks[k] is None or _is_na(toks[k]):
                why = f"null token id at position {k} (of {len(toks)})"
            else:
                why = f"token id {_short(toks[k])} at position {k} is not an integer"
        if why is not None:
            errors[i] = _bad(file, first_row + i, column, why)
    return out


def _is_na(v: Any) -> bool:
    """A missing scalar as pandas spells it (NaN, ``pd.NA``, ``NaT``); never true for a list or an array."""
    import pandas as pd

    if v is pd.NA or v is pd.NaT:
        return True
    try:
        return bool(v != v)  # NaN; a list compares unequal only to a different list, an array raises
    except (TypeError, ValueError):
        return False


def _is_int(v: Any) -> bool:
    import numbers

    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def tokenize_rows(
    pdf: Any,
    tokenizer: Any,
    *,
    text_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    file: str,
    first_row: int,
    errors: list[str | None],
    convention: Convention = "lm-eval",
    bound: TextBound | None = None,
) -> tuple[list[list[int] | None], list[int]]:
    """Token ids of every row of ``pdf`` (rows ``first_row ...`` of ``file``), and how many of them are context
    (the tokens before the first scored one): every job tokenizes here, so a row scored and the same row trained
    on are the same ids.

    A prompt + response row is tokenized in ``convention`` (:mod:`dask_lm.data.continuation`: by default as
    lm-evaluation-harness does, the response in context); a text row is scored whole, its first token conditioned
    on BOS / EOS (``"separate"``: ``tokenizer(text)``, its first token unscored). A row whose value is not a string
    gets its error in ``errors`` (the first one wins) and ``None`` ids; so does one of more bytes than ``bound``
    (:func:`dask_lm.data.text_bytes.text_bound`), which is never tokenized nor copied out of Arrow."""
    n = len(pdf)
    named = [text_column] if text_column is not None else [prompt_column, response_column]
    columns = [c for c in named if c]
    assert len(columns) == len(named), "tokenize_rows needs text_column, or prompt_column with response_column"
    values = [_texts(pdf, c, file, first_row, errors, bound) for c in columns]
    ok = [i for i in range(n) if errors[i] is None]
    ids: list[list[int] | None] = [None] * n
    lens = [0] * n
    if not ok:  # a tokenizer called with no text fails on some versions; nothing to tokenize either way
        return ids, lens
    if text_column is not None:
        pairs = encode_texts(tokenizer, [values[0][i] for i in ok], convention=convention)  # type: ignore[misc]
    else:
        pairs = encode_pairs(
            tokenizer,
            [values[0][i] for i in ok],  # type: ignore[misc]
            [values[1][i] for i in ok],  # type: ignore[misc]
            convention=convention,
        )
    for i, (context, scored) in zip(ok, pairs):
        ids[i] = context + scored
        lens[i] = len(context)
    return ids, lens


def prepare_rows(
    pdf: Any,
    opts: ScoreOptions,
    model: RowModel,
    *,
    file: str,
    first_row: int,
) -> PreparedRows:
    """Read, tokenize and check every row of ``pdf`` (rows ``first_row ...`` of ``file``) for ``opts``
    (a :class:`~dask_lm.data.messages.ScoreOptions`) and the ``model`` that will score them."""
    tokenizer, vocab_size = model.tokenizer, model.vocab_size
    n = len(pdf)
    errors: list[str | None] = [None] * n
    start = [1] * n
    ids: list[list[int] | None]
    prompt_len: list[int] | None = None
    limit, limit_why = position_limit(model.max_positions, opts.max_length)
    if opts.ids_column is not None:
        ids = _token_lists(pdf, opts.ids_column, file, first_row, errors)
        if opts.prompt_length_column is not None:
            prompt_len = _prompt_lengths(pdf, opts.prompt_length_column, ids, file, first_row, errors)
            start = [max(k, 1) for k in prompt_len]
    else:
        ids, lens = tokenize_rows(
            pdf,
            tokenizer,
            text_column=opts.text_column,
            prompt_column=opts.prompt_column,
            response_column=opts.response_column,
            file=file,
            first_row=first_row,
            errors=errors,
            convention=opts.convention,
            bound=text_bound(tokenizer, limit, limit_why, opts.truncate),
        )
        if opts.text_column is None:
            prompt_len = lens
        start = [max(k, 1) for k in lens]  # only response tokens count, each given everything before it
    column = opts.ids_column or opts.text_column or opts.response_column
    assert column is not None, "ScoreOptions names no column to score"
    pair = (
        (opts.ids_column, opts.prompt_length_column or "")
        if opts.ids_column
        else (opts.prompt_column or "", opts.response_column or "")
    )
    truncated = [False] * n
    for i, toks in enumerate(ids):
        if toks is None or errors[i] is not None:
            ids[i] = None
            continue
        if toks and (min(toks) < 0 or max(toks) >= vocab_size):
            k, t = next((k, t) for k, t in enumerate(toks) if t < 0 or t >= vocab_size)
            errors[i] = _bad(
                file,
                first_row + i,
                column,
                f"token id {t} at position {k} is outside the model's "
                f"vocabulary [0, {vocab_size}); were the ids made with another tokenizer?",
            )
        elif limit is not None and len(toks) > limit:
            why = _cut(toks, limit, limit_why, opts.truncate, prompt_len[i] if prompt_len is not None else None)
            if isinstance(why, str):
                where = column if prompt_len is None else pair
                errors[i] = _bad(file, first_row + i, where, why)
            else:
                ids[i], start[i] = why
                truncated[i] = True
        if errors[i] is not None:
            ids[i] = None
    return PreparedRows(ids=ids, start=start, truncated=truncated, errors=errors)


def _prompt_lengths(
    pdf: Any, column: str, ids: list[list[int] | None], file: str, first_row: int, errors: list[str | None]
) -> list[int]:
    """Ids mode's prompt lengths (``--prompt-length-column``): how many leading ids of each row are context, an
    integer in ``[0, len(ids)]``; anything else marks the row bad (the first error wins)."""
    got = _arrow_values(pdf[column])
    values = got[1] if got is not None else pdf[column].tolist()
    out = [0] * len(values)
    for i, v in enumerate(values):
        if errors[i] is not None:
            continue
        n = len(ids[i] or ())
        why = None
        if v is None or _is_na(v):
            why = "expected a prompt length (an integer), got null"
        elif not _is_int(v):
            why = f"expected a prompt length (an integer), got {type(v).__name__} {_short(v)}"
        elif not 0 <= int(v) <= n:
            why = (
                f"prompt length {int(v)} is outside [0, {n}] (the row has {n} token ids); it counts the leading "
                "ids that are context, not scored"
            )
        else:
            out[i] = int(v)
        if why is not None:
            errors[i] = _bad(file, first_row + i, column, why)
    return out


def _cut(
    toks: list[int], limit: int, limit_why: str, truncate: bool, prompt_len: int | None
) -> str | tuple[list[int], int]:
    """A row longer than ``limit``: with ``truncate`` its last ``limit`` tokens and first scored position, else
    (or when truncation cannot keep it faithful) the reason it is a bad row.

    Cutting keeps the end, as lm-evaluation-harness does for a context that does not fit: the tokens that are
    scored stay, and only the context they are conditioned on gets shorter. A response that does not fit with at
    least one context token before it cannot be scored whole, so it is a bad row rather than a shorter answer."""
    n = len(toks)
    if prompt_len is None:
        if not truncate:
            return (
                f"{n} tokens, more than {limit_why}; pass {opt('truncate', True)} to keep the last {limit} "
                f"tokens (or {opt('max_length', meta='N')} to choose where to cut)"
            )
        return toks[n - limit :], 1
    response = n - prompt_len
    if response >= limit:
        return (
            f"the response alone is {response} tokens, and scoring it needs it plus at least one context token "
            f"within {limit_why}; {opt('truncate', True)} cannot keep it whole: shorten the response or use a "
            "model with "
            "more positions"
        )
    if not truncate:
        return (
            f"prompt + response are {n} tokens, more than {limit_why}; pass {opt('truncate', True)} to drop the "
            "first "
            f"{n - limit} prompt tokens (the response is kept whole)"
        )
    drop = n - limit
    return toks[drop:], prompt_len - drop
