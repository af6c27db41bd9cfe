"""The worker half of offline scoring: a model replica per worker, and one task per input partition.

Scoring needs no collectives, so unlike a Policy it does not shard the model: each worker loads a full replica
once (cached in the worker's dask-lm plugin state, keyed by model and precision) and scores whichever partition
the scheduler hands it. Partitions therefore balance across GPUs by themselves, and a partition whose worker dies
is simply recomputed elsewhere; its part file is written under a temporary name and renamed, so a retry replaces
it and every row appears exactly once.

Inside a partition, rows are sorted longest first and cut into micro-batches of at most ``batch_tokens`` padded
tokens; logprobs and top-k come from the chunked head of :mod:`dask_lm.workers.logprobs`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from dask_lm.workers import device
from dask_lm.workers.forward import final_hidden_states
from dask_lm.workers.logprobs import next_token_logprobs, output_head, topk_logits

__all__ = ["ScoreOptions", "BadRowError", "score_partition", "release_scorers"]


class BadRowError(ValueError):
    """A row that cannot be scored (wrong type, empty, too long); the message names file, row and column."""


@dataclass(frozen=True)
class ScoreOptions:
    model: str
    tokenizer: str
    precision: str
    output: str
    text_column: str | None = None
    ids_column: str | None = None
    prompt_column: str | None = None
    response_column: str | None = None
    id_column: str | None = None
    topk: int = 0
    max_length: int | None = None
    truncate: bool = False
    batch_tokens: int = 16384
    skip_bad_rows: bool = False
    chunk_size: int = 1024


class _Replica:
    def __init__(self, model_dir: str, tokenizer_dir: str, precision: str) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one bar per worker would garble the job's own bar
        self.device = device.local_device()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=device.torch_dtype(precision)).to(self.device).eval()
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError):  # token-id input needs no tokenizer
            self.tokenizer = None
        cfg = self.model.config
        candidates = (getattr(self.tokenizer, "pad_token_id", None), getattr(self.tokenizer, "eos_token_id", None),
                      getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None))
        pad = next((v for v in candidates if isinstance(v, int)), 0)
        self.pad_id = int(pad)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.lock = threading.Lock()  # a worker with several threads runs one forward at a time per replica


_LOCAL: dict[tuple, _Replica] = {}
_LOCAL_LOCK = threading.Lock()


def _replica(opts: ScoreOptions) -> _Replica:
    key = (opts.model, opts.tokenizer, opts.precision)
    with _LOCAL_LOCK:
        rep = _LOCAL.get(key)
        if rep is None:
            rep = _LOCAL[key] = _Replica(opts.model, opts.tokenizer, opts.precision)
        return rep


def release_scorers() -> int:
    """Free this worker's replicas (run with ``client.run`` when a job ends)."""
    import gc

    with _LOCAL_LOCK:
        n = len(_LOCAL)
        _LOCAL.clear()
    gc.collect()
    device.empty_cache()
    return n


def _bad(file: str, row: int, column: str, why: str) -> str:
    return f"{file}: row {row}, column {column!r}: {why}"


def _tokenize(pdf: Any, rep: _Replica, opts: ScoreOptions, file: str, first_row: int
              ) -> tuple[list[list[int] | None], list[int], list[str | None]]:
    """Token ids, the first scored position, and an error (or None) for every row."""
    n = len(pdf)
    ids: list[list[int] | None] = [None] * n
    start: list[int] = [1] * n
    errors: list[str | None] = [None] * n
    if opts.ids_column is not None:
        col = opts.ids_column
        for i, value in enumerate(pdf[col].tolist()):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                errors[i] = _bad(file, first_row + i, col, "null token list")
            else:
                ids[i] = [int(t) for t in value]
    else:
        cols = [opts.text_column] if opts.text_column else [opts.prompt_column, opts.response_column]
        values = {c: pdf[c].tolist() for c in cols}
        ok_rows = []
        for i in range(n):
            bad = next((c for c in cols if not isinstance(values[c][i], str)), None)
            if bad is not None:
                errors[i] = _bad(file, first_row + i, bad, f"expected a string, got {values[bad][i]!r}")
            else:
                ok_rows.append(i)
        if opts.text_column:
            enc = rep.tokenizer([values[opts.text_column][i] for i in ok_rows])["input_ids"] if ok_rows else []
            for i, toks in zip(ok_rows, enc):
                ids[i] = list(toks)
        else:
            prompts = rep.tokenizer([values[opts.prompt_column][i] for i in ok_rows])["input_ids"] if ok_rows else []
            responses = (rep.tokenizer([values[opts.response_column][i] for i in ok_rows],
                                       add_special_tokens=False)["input_ids"] if ok_rows else [])
            for i, p, r in zip(ok_rows, prompts, responses):
                ids[i] = list(p) + list(r)
                start[i] = max(len(p), 1)  # only response tokens count, each given everything before it
    col = opts.ids_column or opts.text_column or opts.response_column
    for i, toks in enumerate(ids):
        if toks is None:
            continue
        if not toks:
            errors[i] = _bad(file, first_row + i, col, "no tokens (empty text or token list)")
        elif opts.max_length is not None and len(toks) > opts.max_length:
            if opts.truncate:
                ids[i] = toks[: opts.max_length]
            else:
                errors[i] = _bad(file, first_row + i, col, f"{len(toks)} tokens, more than --max-length "
                                 f"{opts.max_length}; pass --truncate or raise --max-length")
        elif min(toks) < 0 or max(toks) >= rep.vocab_size:
            errors[i] = _bad(file, first_row + i, col, f"token id outside the model's vocabulary [0, "
                             f"{rep.vocab_size})")
    return ids, start, errors


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices, longest first, in batches of at most ``budget`` padded tokens (a longer row goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.no_grad()
def _score_rows(rep: _Replica, ids: list[list[int]], opts: ScoreOptions) -> tuple[list, list | None]:
    """Per-row logprobs (position 0 = 0) and, with topk, per-position (ids, logprobs) lists."""
    head = output_head(rep.model)
    lps: list[Any] = [None] * len(ids)
    tops: list[Any] | None = [None] * len(ids) if opts.topk else None
    for batch in _micro_batches([len(t) for t in ids], opts.batch_tokens):
        width = len(ids[batch[0]])
        x = torch.full((len(batch), width), rep.pad_id, dtype=torch.int64)
        for r, i in enumerate(batch):
            x[r, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.int64)
        lens = torch.tensor([len(ids[i]) for i in batch])
        x = x.to(rep.device, non_blocking=True)
        valid = torch.arange(width, device=rep.device)[None, :] < lens.to(rep.device)[:, None]
        hidden = final_hidden_states(rep.model, x)
        lp = next_token_logprobs(hidden, x, valid, head, chunk_size=opts.chunk_size).cpu()
        if tops is not None:
            values, indices = topk_logits(hidden, valid, head, opts.topk, chunk_size=opts.chunk_size, normalize=True)
            values, indices = values.cpu(), indices.cpu().to(torch.int32)
        for r, i in enumerate(batch):
            n = int(lens[r])
            lps[i] = lp[r, :n]
            if tops is not None:
                tops[i] = (indices[r, :n], values[r, :n])
    return lps, tops


def score_partition(pdf: Any, index: int, file: str, first_row: int, expected_rows: int | None,
                    opts: ScoreOptions) -> dict[str, Any]:
    """Score one input partition and write ``part-<index>.parquet`` (and its bad rows) atomically."""
    import pyarrow as pa

    from dask_lm.io import parquet as pio

    t0 = time.perf_counter()
    if expected_rows is not None and len(pdf) != expected_rows:
        raise RuntimeError(f"partition {index} of {file} has {len(pdf)} rows, its row group {expected_rows}: the "
                           "reader split the dataset differently than planned")
    rep = _replica(opts)
    with rep.lock:
        ids, start, errors = _tokenize(pdf, rep, opts, file, first_row)
        bad = [i for i, e in enumerate(errors) if e is not None]
        if bad and not opts.skip_bad_rows:
            more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
            raise BadRowError(f"{errors[bad[0]]}{more}; fix the data or pass --skip-bad-rows")
        keep = [i for i in range(len(pdf)) if errors[i] is None]
        lps, tops = _score_rows(rep, [ids[i] for i in keep], opts)  # type: ignore[misc]
    source = pdf.iloc[keep]
    if opts.id_column is not None:
        source = source[[opts.id_column]]
    table = pa.Table.from_pandas(source.reset_index(drop=True), preserve_index=False)
    sums, means, ppls, counts, tokens = [], [], [], [], 0
    for j, i in enumerate(keep):
        lp = lps[j]
        scored = lp[start[i]:]
        total = float(scored.double().sum())
        n_scored = int(scored.numel())
        mean = total / n_scored if n_scored else float("nan")
        sums.append(total)
        means.append(mean)
        ppls.append(math.exp(-mean) if n_scored else float("nan"))
        counts.append(len(ids[i]))  # type: ignore[arg-type]
        tokens += len(ids[i])  # type: ignore[arg-type]
    table = table.append_column("num_tokens", pa.array(counts, pa.int32()))
    table = table.append_column("logprobs", pa.array([lp.tolist() for lp in lps], pa.list_(pa.float32())))
    table = table.append_column("sum_logprob", pa.array(sums, pa.float64()))
    table = table.append_column("mean_logprob", pa.array(means, pa.float64()))
    table = table.append_column("perplexity", pa.array(ppls, pa.float64()))
    if tops is not None:
        table = table.append_column("topk_ids", pa.array([t[0].tolist() for t in tops],
                                                         pa.list_(pa.list_(pa.int32()))))
        table = table.append_column("topk_logprobs", pa.array([t[1].tolist() for t in tops],
                                                              pa.list_(pa.list_(pa.float32()))))
    pio.write_part(table, opts.output, pio.part_name(index))
    if bad:
        err = pa.table({"part": pa.array([index] * len(bad), pa.int32()), "file": [file] * len(bad),
                        "row": pa.array([first_row + i for i in bad], pa.int64()),
                        "error": [errors[i] for i in bad]})
        pio.write_part(err, pio.errors_dir(opts.output), pio.part_name(index))
    seconds = time.perf_counter() - t0
    from distributed.metrics import context_meter

    context_meter.digest_metric("tokens", tokens, "count")  # summed per span on the dashboard
    return {"part": index, "rows": len(keep), "tokens": tokens, "bad_rows": len(bad), "seconds": seconds}
