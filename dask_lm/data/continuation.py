"""How a (context, continuation) pair becomes token ids: the convention every dask-lm job tokenizes prompt +
response rows with (scoring, SFT, and the lm-evaluation-harness model class).

``"lm-eval"`` (the default) is the convention of EleutherAI's lm-evaluation-harness 0.4.13 (``TemplateLM.
loglikelihood`` / ``_encode_pair`` with ``HFLM.tok_encode``), whose numbers evaluation engineers compare with:

1. Trailing whitespace of the context moves to the front of the continuation (``"Answer: "`` + ``"42"`` is scored
   as ``"Answer:"`` + ``" 42"``), so a word keeps the leading space its tokenizer merges it with.
2. The continuation is tokenized *in context*: the whole text ``context + continuation`` is encoded once (a
   Metaspace tokenizer would otherwise mark a separately encoded continuation as a new word, ``'▁', '!'`` for
   ``'!'``). The split is where the whole encoding stops agreeing with the context's own encoding (their longest
   common prefix): a token that spans the join belongs to the continuation, so no text is lost or scored twice.
   lm-eval splits at ``len(encode(context))`` instead; the two agree whenever the context's encoding is a prefix
   of the whole one. Where it is not, lm-eval's split can leave the continuation empty (``_loglikelihood_tokens``
   then fails ``assert len(continuation_enc) > 0``: lm-eval issues #1053, #1297, #3336) or score tokens that
   are not the continuation's.
3. At most one BOS: the tokenizer's special tokens are added unless the text already starts with the prefix
   token's text (a chat-templated prompt that begins with ``<s>``).
4. An empty context conditions on the prefix token (BOS, else EOS) and every continuation token is scored;
   when the continuation itself starts with that token, it is the context. A context that is nothing but
   whitespace, or whose only token spans the join, gets the prefix token the same way.

A text row (``--text-column``) is an empty context with the text as continuation: its first token is conditioned
on BOS / EOS rather than left unscored.

``"separate"`` is there for outputs that must match ones scored that way: the context is
``tokenizer(context)`` with its special tokens, the continuation ``tokenizer(continuation,
add_special_tokens=False)``, concatenated as they are; a text row is ``tokenizer(text)``, its first token unscored.
``dask-lm logprobs`` scores its texts that way too (:data:`LOGPROBS_CONVENTION`): with a tokenizer that adds no
BOS, its sum leaves out the first token that ``dask-lm score``'s default scores. :func:`describe` says which
convention a command used, in its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from dask_lm.interface import opt

__all__ = [
    "CONVENTIONS",
    "Convention",
    "check_convention",
    "describe",
    "encode_pairs",
    "encode_texts",
    "prefix_token_id",
    "LOGPROBS_CONVENTION",
]

Convention = Literal["lm-eval", "separate"]
CONVENTIONS: tuple[Convention, ...] = ("lm-eval", "separate")
LOGPROBS_CONVENTION: Convention = "separate"
"""How ``dask-lm logprobs`` encodes a text: ``tokenizer(text)``, its first token unscored."""

_DESCRIBED = {
    ("lm-eval", "text"): "every token of each text scored, the first one conditioned on BOS (EOS when the tokenizer "
    "has no BOS), as lm-evaluation-harness scores a text",
    ("separate", "text"): "each text as tokenizer(text) encodes it, its first token unscored (sums over tokens 2..n, "
    "as dask-lm logprobs)",
    ("lm-eval", "pair"): "the response tokens scored, encoded in context as lm-evaluation-harness does",
    ("separate", "pair"): "tokenizer(prompt) then tokenizer(response) without special tokens, the response tokens "
    "scored",
}


def describe(convention: Convention, rows: Literal["text", "pair", "ids"] = "text") -> str:
    """One line for a command's output: the convention's name and what it scores, for ``rows`` of text, prompt +
    response pairs, or token ids (which no convention touches)."""
    if rows == "ids":
        return "none (token ids as given: the prompt-length column's ids, at least the first, unscored)"
    return f"{convention}: {_DESCRIBED[convention, rows]}"


def check_convention(convention: str, key: str = "convention") -> Convention:
    if convention not in CONVENTIONS:
        raise ValueError(
            f"{key} must be one of {', '.join(map(repr, CONVENTIONS))}, got {convention!r}: 'lm-eval' "
            "tokenizes prompt + response as lm-evaluation-harness does, 'separate' encodes them apart"
        )
    return convention


def prefix_token_id(tokenizer: Any) -> int:
    """The token an empty context is conditioned on: BOS, else EOS (lm-eval's ``HFLM.prefix_token_id``)."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"the tokenizer {type(tokenizer).__name__} has neither a BOS nor an EOS token, so an empty prompt "
        "(or a text row) has nothing to condition its first token on; give the tokenizer a bos_token or "
        f"eos_token, or use the 'separate' convention ({opt('convention', 'separate')}), which leaves "
        "that token "
        "unscored"
    )


def _encode(tokenizer: Any, texts: Sequence[str], prefix_text: str | None) -> list[list[int]]:
    """lm-eval's ``tok_encode`` over many texts: the tokenizer's special tokens, except for a text that already
    starts with the prefix token's text (one BOS at most). Batched: one tokenizer call per group."""
    out: list[list[int]] = [[] for _ in texts]
    for special in (True, False):
        index = [i for i, t in enumerate(texts) if (not prefix_text or not t.startswith(prefix_text)) == special]
        if index:
            enc = tokenizer([texts[i] for i in index], add_special_tokens=special)["input_ids"]
            for i, ids in zip(index, enc):
                out[i] = list(ids)
    return out


def _prefix_text(tokenizer: Any) -> str | None:
    try:
        return str(tokenizer.decode(prefix_token_id(tokenizer))) or None
    except ValueError:  # no BOS / EOS: nothing to look for (and an empty context will say why)
        return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def encode_pairs(
    tokenizer: Any, contexts: Sequence[str], continuations: Sequence[str], *, convention: Convention = "lm-eval"
) -> list[tuple[list[int], list[int]]]:
    """``(context ids, continuation ids)`` per pair, in ``convention`` (see the module docstring): the ids given to
    the model are their concatenation, and the continuation's are the ones scored."""
    assert len(contexts) == len(continuations)
    if convention == "separate":
        first = tokenizer(list(contexts))["input_ids"] if contexts else []
        second = tokenizer(list(continuations), add_special_tokens=False)["input_ids"] if contexts else []
        return [(list(p), list(r)) for p, r in zip(first, second)]
    check_convention(convention)
    prefix_text = _prefix_text(tokenizer)
    moved: list[tuple[str, str]] = []
    for context, continuation in zip(contexts, continuations):
        stripped = context.rstrip()
        moved.append((stripped, context[len(stripped) :] + continuation))
    full = [i for i, (c, _) in enumerate(moved) if c]
    wholes = _encode(tokenizer, [moved[i][0] + moved[i][1] for i in full], prefix_text)
    heads = _encode(tokenizer, [moved[i][0] for i in full], prefix_text)
    out: list[tuple[list[int], list[int]]] = [([], [])] * len(moved)
    spanned = []
    for i, whole, head in zip(full, wholes, heads):
        k = _common_prefix(whole, head)
        out[i] = (whole[:k], whole[k:])
        if k == 0:  # no BOS and the first token spans the join: all of it is scored, given the prefix token
            spanned.append(i)
    empty = [i for i, (c, _) in enumerate(moved) if not c]
    if empty or spanned:
        prefix = prefix_token_id(tokenizer)
        for i in spanned:
            out[i] = ([prefix], out[i][1])
    if empty:
        bare = tokenizer([moved[i][1] for i in empty], add_special_tokens=False)["input_ids"]
        for i, cont in zip(empty, bare):
            cont = list(cont)
            out[i] = (cont[:1], cont[1:]) if cont and cont[0] == prefix else ([prefix], cont)
    return out


def encode_texts(
    tokenizer: Any, texts: Sequence[str], *, convention: Convention = "lm-eval"
) -> list[tuple[list[int], list[int]]]:
    """A text row as ``(context ids, scored ids)``: in ``"lm-eval"`` an empty context with the text as continuation
    (the first token conditioned on BOS / EOS); in ``"separate"`` ``tokenizer(text)`` whose first token is the
    context (left unscored)."""
    if convention == "separate":
        enc = tokenizer(list(texts))["input_ids"] if texts else []
        return [(list(t[:1]), list(t[1:])) for t in enc]
    return encode_pairs(tokenizer, [""] * len(texts), texts, convention=convention)
