"""The worker half of the lm-evaluation-harness model class (:mod:`dask_lm.harness`): one task scores, or
generates after, a batch of token-id rows on this worker's model replica.

The replica is the one offline scoring caches in the worker's dask-lm plugin state (:func:`dask_lm.workers.
replicas.replica_for`, keyed by model, tokenizer, precision and compilation), so an evaluation loads each model once
per worker however many tasks it sends, and frees it with the scoring jobs' ``release_scorers``. Scoring goes
through the scorer's own micro-batched forward and chunked head (:func:`dask_lm.scoring.scorer.score_ids`);
generation through Hugging Face's ``generate`` on the same weights (the compiled decoder layers are active only
inside :func:`dask_lm.model.fused.use_compiled`, so generation runs eagerly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dask_lm.data.messages import GENERATE_BATCH_FACTOR, ScoreOptions
from dask_lm.data.packing import longest_first
from dask_lm.errors import NonFiniteError
from dask_lm.model import device
from dask_lm.model.forward import final_hidden_states
from dask_lm.model.logprobs import next_token_logprobs_greedy, output_head
from dask_lm.scoring import replicas, scorer

__all__ = ["generate_rows", "loglikelihood_rows"]


def _check_rows(rows: Sequence[Sequence[int]], vocab_size: int, names: Sequence[int]) -> None:
    # an id past the embedding table is an index error on the CPU but a device-side assert on a GPU, which poisons
    # the worker's CUDA context for every later task: refused here, naming the request
    for j, row in enumerate(rows):
        if row and (min(row) < 0 or max(row) >= vocab_size):
            bad = next(t for t in row if t < 0 or t >= vocab_size)
            raise ValueError(
                f"request {names[j]} holds token id {bad}, outside the model's vocabulary (0 to "
                f"{vocab_size - 1}): it was tokenized with a different tokenizer; pass the model's own"
            )


def loglikelihood_rows(
    ids: list[list[int]], starts: list[int], opts: ScoreOptions, names: Sequence[int] | None = None
) -> list[tuple[float, bool]]:
    """Per row ``(sum of the logprobs of ids[start:] given what precedes them, whether each of those tokens is
    the argmax of the model's distribution)``: lm-eval's ``(loglikelihood, is_greedy)``. The sum is taken in
    float64. ``names`` (the rows' request indices) only label errors."""
    if len(ids) != len(starts):
        raise ValueError(f"{len(ids)} rows but {len(starts)} starts: one start (context length) per row")
    names = list(range(len(ids))) if names is None else list(names)
    for j, (row, start) in enumerate(zip(ids, starts)):
        if not 1 <= start < len(row):
            raise ValueError(
                f"request {names[j]}: start {start} with {len(row)} tokens; a request needs at least "
                "one context token and one token to score"
            )
    rep = replicas.replica_for(opts)
    out: list[tuple[float, bool]] = []
    with rep.lock:
        _check_rows(ids, rep.vocab_size, names)
        # lm-eval keeps the last max_length + 1 tokens of a long request and feeds the model all but the last: a
        # row one token longer than the model's positions must not reach a model whose positions are a hard limit
        # (learned position embeddings) or change with the length (dynamic RoPE scaling)
        limit = rep.max_positions
        fits = [i for i, row in enumerate(ids) if limit is None or len(row) <= limit]
        lps, _, finite, greedy = scorer.score_ids(rep, [ids[i] for i in fits], opts)
        per_row: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {
            i: (lps[k], greedy[k], finite[k]) for k, i in enumerate(fits)
        }
        for i in sorted(set(range(len(ids))) - set(fits)):
            lp, is_max = _score_without_last_input(rep, ids[i], starts[i], opts)
            per_row[i] = (lp, is_max, bool(torch.isfinite(lp).all()))
    for i, start in enumerate(starts):
        lp, is_max, ok = per_row[i]
        if not ok:
            raise NonFiniteError(
                f"the model produced non-finite logprobs (NaN/inf) on request {names[i]}: its "
                "weights may hold NaN/inf, or the precision overflows (try dtype=float32)"
            )
        out.append((float(lp[start:].double().sum()), bool(is_max[start:].all())))
    return out


@torch.no_grad()
def _score_without_last_input(
    rep: Any, row: list[int], start: int, opts: ScoreOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and argmax flags of ``row`` (position 0 = 0) from a forward over ``row[:-1]`` only, as lm-eval's
    ``HFLM._loglikelihood_tokens`` feeds it: the last token is a target, never an input."""
    x = device.upload(torch.tensor([row[:-1]], dtype=torch.int64), rep.device)
    hidden = final_hidden_states(rep.model, x)
    targets = device.upload(torch.tensor([row], dtype=torch.int64), rep.device)
    cols = torch.arange(start - 1, len(row) - 1, device=hidden.device)  # the positions that predict row[start:]
    lp, is_max = next_token_logprobs_greedy(
        hidden,
        targets,
        torch.ones_like(targets, dtype=torch.bool),
        output_head(rep.model),
        chunk_size=opts.chunk_size,
        index=(torch.zeros_like(cols), cols),
    )
    return lp[0].cpu(), is_max[0].cpu()


def _stop_on_text(tokenizer: Any, stops: Sequence[str], prompt_width: int) -> Any:
    """A stopping criterion that ends each row once its *generated* text holds one of ``stops``.

    HF's own ``stop_strings`` would also match a stop string that begins in the prompt (its ``StopStringCriteria``
    matches over the whole sequence), ending a row before its new text holds it; lm-eval cuts the decoded new
    tokens at the stop strings, so such a row would come back short. As lm-eval's ``MultiTokenEOSCriteria``, each
    stop string is looked for in the decoded last ``len(its tokens) + 2`` new tokens (special tokens kept, so the
    EOS text matches the EOS token); unlike it, every row stops on its own, so a row's output does not depend on
    which rows share its batch."""
    import transformers

    windows: dict[int, list[str]] = {}
    for s in stops:
        if s:
            windows.setdefault(len(tokenizer.encode(s, add_special_tokens=False)) + 2, []).append(s)

    class StopOnText(transformers.StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            new = input_ids[:, prompt_width:]
            done = [False] * new.shape[0]
            for width, strings in windows.items():
                for r, text in enumerate(tokenizer.batch_decode(new[:, -width:])):
                    done[r] = done[r] or any(s in text for s in strings)
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StopOnText()


@torch.no_grad()
def generate_rows(
    contexts: list[list[int]], gen: dict[str, Any], opts: ScoreOptions, names: Sequence[int] | None = None
) -> list[list[int]]:
    """The new tokens after each context (rows of up to ``gen["max_new_tokens"]`` ids; a row that stopped early
    is padded with the pad id up to its micro-batch's longest). ``gen["stop"]`` (strings) ends a row once its new
    text holds one of them; every other key goes to Hugging Face's ``generate`` as it is (``do_sample``,
    ``temperature``, ``top_p``, ...); decoding is greedy unless ``do_sample`` says otherwise, whatever the model's
    generation config holds. ``names`` (the rows' request indices) only label errors."""
    import transformers

    gen = dict(gen)
    max_new = int(gen.pop("max_new_tokens"))
    stops = [s for s in (gen.pop("stop", None) or []) if s]
    gen.setdefault("do_sample", False)
    names = list(range(len(contexts))) if names is None else list(names)
    empty = [names[j] for j, c in enumerate(contexts) if not c]
    if empty:
        raise ValueError(
            f"request {empty[0]} has no context tokens to generate after: give it at least the BOS / EOS token"
        )
    rep = replicas.replica_for(opts)
    out: list[list[int]] = [[] for _ in contexts]
    with rep.lock:
        if stops and rep.tokenizer is None:
            raise ValueError(rep.tokenizer_error)
        _check_rows(contexts, rep.vocab_size, names)
        # the rows of a micro-batch are left-padded to its longest; its KV cache grows to that width + max_new
        # wider than scoring's micro-batches: decode steps are sequential and launch-bound, so rows per batch is
        # what makes generation fast
        budget = GENERATE_BATCH_FACTOR * opts.micro_batch_tokens(packed=False)
        for part in longest_first([len(c) + max_new for c in contexts], budget, padded=True):
            width = max(len(contexts[i]) for i in part)
            x = torch.full((len(part), width), rep.pad_id, dtype=torch.int64)
            mask = torch.zeros((len(part), width), dtype=torch.int64)
            for r, i in enumerate(part):
                n = len(contexts[i])
                x[r, width - n :] = torch.tensor(contexts[i], dtype=torch.int64)
                mask[r, width - n :] = 1
            criteria = transformers.StoppingCriteriaList([_stop_on_text(rep.tokenizer, stops, width)] if stops else [])
            seq = rep.model.generate(
                input_ids=device.upload(x, rep.device),
                attention_mask=device.upload(mask, rep.device),
                max_new_tokens=max_new,
                pad_token_id=rep.pad_id,
                stopping_criteria=criteria,
                use_cache=True,
                **gen,
            )
            for r, row in enumerate(seq[:, width:].cpu().tolist()):
                out[part[r]] = row
    return out
