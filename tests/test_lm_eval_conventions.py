"""Prompt + response scores against lm-evaluation-harness's own ``HFLM`` (lm_eval 0.4.13, a single-process
Hugging Face forward) on the same (context, continuation) requests, over four kinds of tokenizer
(``tests/tokenizer_kinds.py``): the token ids, the sums and ``is_greedy`` of ``dask-lm score`` in its default
convention are lm-eval's wherever lm-eval's own split of the whole text is coherent; where it is not (a token
spans the join, or the context has no token of its own) dask-lm's split keeps every token once, and its sums are
a plain HF forward's of those ids.

The cases are the issue's: a prompt ending in whitespace, a response that a Metaspace tokenizer would mark as a
new word, a token spanning the join, an empty prompt (a one-token response is scored, given BOS / EOS), a prompt
that already starts with the BOS text, the scored-token and prompt-length columns, ids mode's prompt lengths, and
truncation of the context (never the response) from the left."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizer_kinds
import torch
import transformers
from helpers import extra

import dask_lm
from dask_lm.data.continuation import encode_pairs

# the test extra: a missing lm_eval fails these tests, it does not skip them (and the module still collects)
lm_eval_hf = extra("lm_eval.models.huggingface")
lm_eval_api = extra("lm_eval.api.instance")

pytestmark = pytest.mark.cluster

# (context, continuation); "{bos}" becomes the text of the tokenizer's prefix token (BOS, else EOS)
CASES = [
    ("Answer:", " 42"),
    ("Answer: ", "42"),  # 1. trailing whitespace moves to the continuation
    ("Q: what is it? A:", " yes!"),
    ("hello", "!"),  # 2. Metaspace: "!" encoded alone would be a new word
    ("hello wor", "ld"),  # 3. a token spanning the join
    ("The quick brown", " fox jumps over the lazy dog."),
    ("", "hello world"),  # 4. empty prompt: every token scored, given BOS / EOS
    ("", "The"),  # ... a one-token response is scored too
    ("{bos}hello", " world"),  # 5. a prompt that already starts with the BOS text: one BOS
    ("line\n", "break"),
    ("  ", "spaced"),  # a prompt of whitespace only: an empty prompt once moved
    ("x=1;", " y=2"),
    ("The", "quick"),
    ("Dask schedules tasks across the", " workers of a cluster."),
]


@pytest.fixture(scope="module", params=tokenizer_kinds.KINDS)
def kind(request, tmp_path_factory):
    path = tokenizer_kinds.build(request.param, str(tmp_path_factory.mktemp(request.param)))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    # logits_cache off: lm-eval 0.4.13's cache of one-token continuations (models/utils.py, Collator.get_cache, keyed
    # by context + continuation[:-1]) hands ("{eos}hello", " world") the logits of ("", "hello world") when both
    # have the same ids, and scores it at the wrong position (-4.90 instead of the -3.84 of a plain forward, with
    # the word tokenizer); with the cache off every request gets its own forward, as dask-lm's do
    hflm = lm_eval_hf.HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=8, logits_cache=False)
    prefix_text = tok.decode(hflm.prefix_token_id)
    cases = [(c.replace("{bos}", prefix_text), r) for c, r in CASES]
    return request.param, path, tok, hflm, cases


def _lm_eval_encoding(hflm, context, continuation):
    """lm-eval's (context ids, continuation ids) of one request, as ``TemplateLM.loglikelihood`` builds them, and
    whether that split is coherent (both sides non-empty, the context's encoding a prefix of the whole text's):
    ``_loglikelihood_tokens`` refuses an empty side, and an incoherent split scores other tokens than the text."""
    if context == "":
        cont = hflm.tok_encode(continuation, add_special_tokens=False)
        pair = ([hflm.prefix_token_id], cont) if cont[0] != hflm.prefix_token_id else (cont[:1], cont[1:])
        return pair, bool(pair[1])
    ctx, cont = hflm._encode_pair(context, continuation)
    stripped = context.rstrip()
    whole = hflm.tok_encode(stripped + context[len(stripped) :] + continuation)
    return (ctx, cont), bool(ctx) and bool(cont) and whole[: len(ctx)] == ctx


def _score(client, path, out, data, **kw):
    dask_lm.score_parquet(data, out, model=path, client=client, id_column="id", progress=False, precision="fp32", **kw)
    return sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])


def _hf_sum(model, ids, start):
    """Sum and is_greedy of ``ids[start:]`` from one plain HF forward of ``ids``."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    targets = torch.tensor(ids[start:])
    picked = logp[start - 1 : -1].gather(1, targets[:, None])[:, 0]
    return float(picked.sum()), bool((logp[start - 1 : -1].argmax(-1) == targets).all())


def test_prompt_response_scores_are_lm_evals(client, kind, tmp_path):
    name, path, tok, hflm, cases = kind
    ours = encode_pairs(tok, [c for c, _ in cases], [r for _, r in cases])
    theirs = [_lm_eval_encoding(hflm, c, r) for c, r in cases]
    coherent = [i for i, (_, ok) in enumerate(theirs) if ok]
    # the identical token ids wherever lm-eval's split is coherent (most cases, for every kind)
    for i in coherent:
        assert ours[i] == tuple(theirs[i][0]), (name, cases[i])
    assert len(coherent) >= len(cases) - 4, (name, len(coherent))
    # elsewhere: every token of the whole text once, the spanning one scored (none dropped, none repeated)
    for i in set(range(len(cases))) - set(coherent):
        context, continuation = cases[i]
        ctx, cont = ours[i]
        assert ctx and cont, (name, cases[i])
        whole = tok(context + continuation, add_special_tokens=True)["input_ids"]
        assert ctx + cont in (
            whole,
            [hflm.prefix_token_id] + whole,
            [hflm.prefix_token_id] + tok(context + continuation, add_special_tokens=False)["input_ids"],
        ), (name, cases[i])

    data = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.table({"id": list(range(len(cases))), "prompt": [c for c, _ in cases], "response": [r for _, r in cases]}),
        data,
    )
    rows = _score(client, path, tmp_path / "out", data, prompt_column="prompt", response_column="response")
    requests = [lm_eval_api.Instance(request_type="loglikelihood", doc={}, arguments=cases[i], idx=i) for i in coherent]
    results = dict(zip(coherent, hflm.loglikelihood(requests)))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, row in enumerate(rows):
        ctx, cont = ours[i]
        # the columns: prompt length, scored tokens, and the sums over exactly the continuation
        assert (row["prompt_tokens"], row["num_scored"], row["num_tokens"]) == (
            len(ctx),
            len(cont),
            len(ctx) + len(cont),
        )
        want = results[i] if i in results else _hf_sum(model, ctx + cont, len(ctx))
        assert row["sum_logprob"] == pytest.approx(want[0], abs=1e-4), (name, cases[i])
        assert row["is_greedy"] == want[1], (name, cases[i])


def test_ids_mode_prompt_lengths_give_lm_evals_continuation_scores(client, kind, tmp_path):
    """Pre-tokenized data: lm-eval's own ids with ``--prompt-length-column`` score what lm-eval scores."""
    name, path, _, hflm, cases = kind
    theirs = [_lm_eval_encoding(hflm, c, r) for c, r in cases]
    keep = [i for i, (_, ok) in enumerate(theirs) if ok]
    data = tmp_path / "ids.parquet"
    pq.write_table(
        pa.table(
            {
                "id": keep,
                "ids": [theirs[i][0][0] + theirs[i][0][1] for i in keep],
                "plen": [len(theirs[i][0][0]) for i in keep],
            }
        ),
        data,
    )
    rows = _score(client, path, tmp_path / "out", data, ids_column="ids", prompt_length_column="plen")
    results = hflm.loglikelihood(
        [
            lm_eval_api.Instance(request_type="loglikelihood", doc={}, arguments=cases[i], idx=j)
            for j, i in enumerate(keep)
        ]
    )
    for row, (total, greedy), i in zip(rows, results, keep):
        assert row["num_scored"] == len(theirs[i][0][1]) and row["prompt_tokens"] == len(theirs[i][0][0])
        assert row["sum_logprob"] == pytest.approx(total, abs=1e-4) and row["is_greedy"] == greedy, (name, i)


def test_truncation_cuts_the_context_from_the_left_as_lm_eval_does(client, kind, tmp_path):
    """A row past ``--max-length L`` keeps its response whole and the last context tokens: lm-eval's
    ``_loglikelihood_tokens`` with ``max_length=L-1`` (its max_length counts the model's input positions, one fewer
    than the row's tokens: it never feeds the last token)."""
    name, path, tok, _, _ = kind
    limit = 8
    cases = [
        ("Dask schedules tasks across the workers of a cluster. The quick brown fox jumps over the", " lazy dog."),
        ("Log probabilities are summed to score a whole sequence, and", " packing"),
    ]
    short = lm_eval_hf.HFLM(
        pretrained=path, device="cpu", dtype="float32", batch_size=4, max_length=limit - 1, logits_cache=False
    )
    data = tmp_path / "long.parquet"
    pq.write_table(pa.table({"id": [0, 1], "prompt": [c for c, _ in cases], "response": [r for _, r in cases]}), data)
    rows = _score(
        client,
        path,
        tmp_path / "out",
        data,
        prompt_column="prompt",
        response_column="response",
        max_length=limit,
        truncate=True,
    )
    results = short.loglikelihood(
        [lm_eval_api.Instance(request_type="loglikelihood", doc={}, arguments=c, idx=i) for i, c in enumerate(cases)]
    )
    for row, (total, greedy), (c, r) in zip(rows, results, cases):
        ctx, cont = encode_pairs(tok, [c], [r])[0]
        assert len(ctx) + len(cont) > limit and row["truncated"] and row["num_tokens"] == limit
        assert row["num_scored"] == len(cont)  # the response whole, the context cut from the left
        assert row["sum_logprob"] == pytest.approx(total, abs=1e-4) and row["is_greedy"] == greedy, name


def test_the_separate_convention_encodes_prompt_and_response_apart(client, tiny, tmp_path):
    """``convention="separate"`` (dask-lm before 0.5): ``tokenizer(prompt)`` then ``tokenizer(response)`` without
    special tokens, scored by a plain HF forward of exactly those ids."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    pairs = [("Answer: ", "42"), ("hello wor", "ld"), ("The quick", " brown fox")]
    data = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"id": [0, 1, 2], "prompt": [p for p, _ in pairs], "response": [r for _, r in pairs]}), data
    )
    rows = _score(
        client,
        tiny["llama"],
        tmp_path / "out",
        data,
        prompt_column="prompt",
        response_column="response",
        convention="separate",
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    for row, (p, r) in zip(rows, pairs):
        ctx, cont = tok(p)["input_ids"], tok(r, add_special_tokens=False)["input_ids"]
        assert (row["prompt_tokens"], row["num_scored"]) == (len(ctx), len(cont))
        total, greedy = _hf_sum(model, ctx + cont, len(ctx))
        assert row["sum_logprob"] == pytest.approx(total, abs=1e-4) and row["is_greedy"] == greedy
    with pytest.raises(ValueError, match="convention must be one of 'lm-eval', 'separate'"):
        dask_lm.score_parquet(
            data,
            tmp_path / "x",
            model=tiny["llama"],
            prompt_column="prompt",
            response_column="response",
            convention="lm_eval",
        )
