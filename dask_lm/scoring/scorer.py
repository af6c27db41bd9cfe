"""The worker half of scoring: a partition's rows in, their score columns out, for both ways of asking.

:func:`score_rows` is the one scoring code path. It takes the rows of one partition (pandas frames of
Arrow-backed columns), reads and checks them (:mod:`dask_lm.data.rows`), scores them with this worker's model
replica (:mod:`dask_lm.scoring.replicas`) and returns the score columns as an Arrow table, with the rows it kept,
the bad ones and the partition's numbers. ``score_parquet``'s file job (:func:`score_partition`) writes that table
as ``part-<index>.parquet`` beside the input's columns, atomically; ``dask_lm.score``
(:mod:`dask_lm.scoring.partitions`) returns it as a pandas frame with the input's index. The row rules (bad rows,
lengths, empty rows, non-finite values) are therefore the same for both.

Inside a partition, rows are sorted longest first and cut into micro-batches of at most ``batch_tokens`` tokens:
on a GPU they are packed (real tokens only, varlen attention, compiled decoder layers, as in a Policy's inference
pass), elsewhere padded to the longest row; logprobs and top-k come from the chunked head of
:mod:`dask_lm.model.logprobs`. A partition whose logprobs are not all finite is refused (NaN weights or an fp16
overflow would otherwise pass as scores) unless ``allow_nonfinite``. A part file is written under a temporary name
and renamed, so a retried partition replaces it and every row appears exactly once.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dask_lm.data.messages import ScoreOptions
from dask_lm.data.packing import longest_first
from dask_lm.data.rows import BadRowError, PreparedRows, prepare_rows
from dask_lm.data.tokens import TokenRows
from dask_lm.errors import NonFiniteError
from dask_lm.interface import again, opt
from dask_lm.model import device, fused
from dask_lm.model.inference import forward_rows
from dask_lm.model.logprobs import next_token_logprobs_greedy, output_head, topk_logits
from dask_lm.moved import moved_names
from dask_lm.scoring import replicas
from dask_lm.scoring.spans import SpanRows

__all__ = ["ScoreOptions", "BadRowError", "NonFiniteError", "ScoredRows", "score_rows", "score_partition"]

# the replica cache is dask_lm.scoring.replicas; its names' old path here warns
__getattr__ = moved_names(
    __name__,
    dict.fromkeys(
        ["Replica", "preload_replica", "release_idle", "release_scorers", "replica_for"], "dask_lm.scoring.replicas"
    ),
)

# one row's top-k: per position, the k token ids (int32) and their logprobs, each [n, k]
TopK = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def score_ids(
    rep: replicas.Replica, ids: list[list[int]], opts: ScoreOptions, on_rows: Callable[[int], None] | None = None
) -> tuple[list[torch.Tensor], list[TopK] | None, list[bool], list[torch.Tensor]]:
    """Per row: logprobs (position 0 = 0), topk per position (ids, logprobs) when ``opts.topk``, whether every value
    is finite, and per position whether the token is the argmax of the model's distribution before it (bool, true
    at position 0). A row without tokens gets empty results without a forward. ``on_rows(k)``, if given, is told
    after each micro-batch how many rows have their results.

    The GPU never waits for the host between micro-batches: a micro-batch's results are copied to the host
    asynchronously and cut into rows only after the next micro-batch has been launched (one micro-batch of lag, as
    in a Policy's inference pass, :func:`dask_lm.model.inference.run_pass`). A blocking copy at the end of each
    micro-batch would leave the GPU idle during the next one's host work (its tensor, its packed layout): 20% of a
    0.5B scoring phase on an H200 (``benchmarks/profile_score.py --profile``)."""
    head = output_head(rep.model)
    out = _RowResults(len(ids), opts.topk)
    rows = [i for i in range(len(ids)) if ids[i]]
    pending: _Pending | None = None
    collected = 0
    for part in longest_first([len(ids[i]) for i in rows], opts.micro_batch_tokens(rep.packed), padded=not rep.packed):
        batch = [rows[j] for j in part]
        # the lists straight to the packed values and offsets (or padded once, for a padded replica)
        tokens = TokenRows.from_lists([ids[i] for i in batch])
        lens = tokens.lengths
        (hidden, layout), rep.compiled = fused.call(
            rep.compiled,
            functools.partial(
                forward_rows, rep.model, tokens, packed=rep.packed, varlen_ok=rep.varlen, where=rep.device
            ),
            "the scoring forward",
        )
        # the head's fused reductions may be compiled where the decoder is not: the eager chain of max / sub / exp
        # / sum passes over [n, V] float32 logits was a third of a 0.5B scoring forward's GPU time, and their one
        # small graph compiles in seconds where the layers take ten (a job long enough chooses it, compile_head)
        with fused.use_compiled(rep.head_compiled):
            lp, is_max = next_token_logprobs_greedy(
                hidden, layout.ids, layout.targets_valid, head, chunk_size=opts.chunk_size, index=layout.scored
            )
            values: tuple[torch.Tensor, ...] = (lp, is_max)
            if out.tops is not None:
                top_v, top_i = topk_logits(
                    hidden,
                    layout.valid,
                    head,
                    opts.topk,
                    chunk_size=opts.chunk_size,
                    normalize=True,
                    index=layout.valid_index,
                )
                values += (top_v, top_i.to(torch.int32))
        del hidden
        host = tuple(v.to("cpu", non_blocking=True) for v in values)
        done = device.record_event()
        if pending is not None:
            out.collect(pending, rep.packed)
            collected += len(pending.batch)
            if on_rows is not None:
                on_rows(collected)
        pending = _Pending(batch, lens, layout.host.cu, host, done)
    if pending is not None:
        out.collect(pending, rep.packed)
    return out.lps, out.tops, out.finite, out.greedy


class _Event(Protocol):
    """What :func:`dask_lm.model.device.record_event` gives: a CUDA event, or a stand-in on the CPU."""

    def synchronize(self) -> None: ...


@dataclass
class _Pending:
    """A launched micro-batch whose results are on their way to the host."""

    batch: list[int]  # its rows (indices into score_ids' ids)
    lens: torch.Tensor
    cu: torch.Tensor | None  # packed: the rows' offsets in the [1, T] results
    host: tuple[torch.Tensor, ...]  # logprobs, is_max (and top-k values, ids), host tensors being filled
    done: _Event  # after the copies


class _RowResults:
    """score_ids' results per row, cut out of each micro-batch's host tensors once their copies are done."""

    def __init__(self, n: int, topk: int) -> None:
        self.lps: list[torch.Tensor] = [torch.zeros(0)] * n
        self.greedy: list[torch.Tensor] = [torch.zeros(0, dtype=torch.bool)] * n
        empty_top = (torch.zeros(0, topk, dtype=torch.int32), torch.zeros(0, topk))
        self.tops: list[TopK] | None = [empty_top] * n if topk else None
        self.finite = [True] * n

    def collect(self, p: _Pending, packed: bool) -> None:
        p.done.synchronize()  # this micro-batch's copies only: the next one keeps the GPU busy meanwhile
        lp, is_max = p.host[0], p.host[1]
        # each row's slice of the result: [1, T] packed (rows back to back) or [b, L] padded
        starts = p.cu.tolist() if packed and p.cu is not None else [0] * len(p.batch)
        for r, i in enumerate(p.batch):
            n = int(p.lens[r])
            row, col = (0, starts[r]) if packed else (r, 0)
            self.lps[i] = lp[row, col : col + n]
            self.greedy[i] = is_max[row, col : col + n]
            ok = bool(torch.isfinite(self.lps[i]).all())
            if self.tops is not None:
                self.tops[i] = (p.host[3][row, col : col + n], p.host[2][row, col : col + n])
                ok = ok and bool(torch.isfinite(self.tops[i][1]).all())
            self.finite[i] = ok


def _row_sums(
    lp: torch.Tensor, greedy: torch.Tensor, start: int
) -> tuple[int, float | None, float | None, float | None, bool | None]:
    """(num_scored, sum, mean, perplexity, is_greedy) over positions ``start:``; nulls when no token is scored.

    A row with nothing to score (an empty response, a one-token text, an empty id list) is kept and flagged rather
    than made a bad row: it is well-formed data, and dropping it would leave a hole in the output that an id join
    cannot explain. A sum over no tokens would be 0.0, i.e. probability 1; a null sum with ``num_scored`` 0 says
    instead that there was nothing to score, and keeps the row apart from a real 0.0 in every aggregate (pandas
    and Arrow skip nulls)."""
    scored = lp[start:]
    n = int(scored.numel())
    if n == 0:
        return 0, None, None, None, None
    total = float(scored.double().sum())
    mean = total / n
    try:
        ppl = math.exp(-mean)
    except OverflowError:  # a mean logprob below about -709: the perplexity is beyond float64
        ppl = math.inf
    return n, total, mean, ppl, bool(greedy[start:].all())


def _refuse_if_cancelled(index: int) -> None:
    """Raise instead of writing part ``index`` when its job was cancelled while the task ran (the driver was
    interrupted, or its client closed): on an attached cluster the task runs on after the command has gone, and a
    part written then would appear in an output its user believes stopped. Dask marks a running task whose
    result nobody wants any more ``cancelled`` on its worker; outside a worker there is nothing to ask."""
    try:
        from distributed import get_worker
        from distributed.worker import thread_state

        task = get_worker().state.tasks.get(thread_state.key)
    except (ValueError, AttributeError):  # not in a worker's task thread (a test calling this directly)
        return
    if task is not None and task.state == "cancelled":
        raise RuntimeError(f"part {index}: its job was cancelled while it ran; not written")


def _rows_reporter(progress_id: str | None, index: int, every_s: float = 0.5) -> Callable[[int], None]:
    """``report(rows)``: part ``index``'s rows scored so far, as an event for the job's bar
    (:func:`dask_lm.comm.progress.report_progress`), the first at once and then at most every ``every_s`` (an
    event per micro-batch would be hundreds a second on a GPU, each a message through the scheduler)."""
    from dask_lm.comm.progress import report_progress

    last = -math.inf

    def report(rows: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            report_progress(progress_id, rows, part=index)

    return report


@dataclass
class ScoredRows:
    """What :func:`score_rows` made of one partition's rows."""

    keep: list[int]
    """The rows scored, as positions in the partition's rows (its frames one after another), in order."""
    table: Any
    """A ``pyarrow.Table`` of the score columns (:func:`dask_lm.io.parquet.output_schema_columns`), one row per
    kept row, in the order of ``keep``."""
    bad: list[int]
    """The positions of the bad rows left out (``skip_bad_rows``; without it the first one raised)."""
    errors: list[str]
    """The bad rows' errors, in the order of ``bad``."""
    stats: dict[str, Any]
    """``rows`` (kept), ``tokens``, ``empty_rows``, ``truncated_rows``, ``nonfinite_rows``, ``phases`` (``rows``,
    ``model``, ``output``: seconds); and, in the first partition of a replica, its ``load_seconds``,
    ``compile_seconds``, ``load_phases`` and ``ready_at``."""


def _row_name(row: int, label: Any = None, labelled: bool = False) -> str:
    return f"row {row} (index {label!r})" if labelled else f"row {row}"


def _labelled(error: str, where: str, row: int, label: Any) -> str:
    """A bad row's error with its index label beside its position: ``partition 3: row 5 (index 'a'), ...``."""
    prefix = f"{where}: row {row}, "
    assert error.startswith(prefix), (error, prefix)  # every row error is made by dask_lm.data.rows._bad
    return f"{where}: {_row_name(row, label, True)}, {error[len(prefix) :]}"


def score_rows(
    frames: Sequence[tuple[Any, int]],
    opts: ScoreOptions,
    *,
    where: str,
    bad_fix: str,
    labels: Sequence[Any] | None = None,
    report: Callable[[int], None] | None = None,
) -> ScoredRows:
    """Read, check, tokenize and score one partition's rows with this worker's replica for ``opts``; write nothing.

    ``frames`` are the partition's rows: pandas frames (Arrow-backed columns, or Python objects), each with the
    number its first row has in ``where`` (a file for ``score_parquet``, ``"partition N"`` for ``dask_lm.score``),
    which every message names. A bad row raises :class:`BadRowError` naming ``where``, the row (with ``labels``,
    the rows' index labels, its label too) and the column, ending in ``bad_fix``; with ``skip_bad_rows`` the bad
    rows are left out and returned with their errors. Rows whose logprobs are not all finite raise
    :class:`NonFiniteError` unless ``allow_nonfinite``. ``report(k)`` hears when the replica is ready (``k`` = 0)
    and how many rows have been scored."""
    import pyarrow as pa

    from dask_lm.io import parquet as pio
    from dask_lm.io.results import decode_topk_column

    rep = replicas.replica_for(opts)
    with rep.lock:
        startup = (
            {
                "load_seconds": rep.load_seconds,
                "compile_seconds": rep.compile_seconds,
                "load_phases": rep.load_phases,
                "ready_at": rep.ready_at,
            }
            if rep.fresh
            else {}
        )
        rep.fresh = False
        if report is not None:
            report(0)  # the replica is ready: the job's bar stops saying that the model loads
        if rep.tokenizer is None and (not opts.ids_column or opts.decode_topk):
            raise ValueError(f"{rep.tokenizer_error}, or pass {opt('tokenizer')}")
        t_rows = time.perf_counter()
        rows = PreparedRows([], [], [], [])
        row_no: list[int] = []  # each row's number in `where`, for messages and _errors.parquet
        for frame, first in frames:
            got = prepare_rows(frame, opts, rep.row_model, file=where, first_row=first)
            rows.ids += got.ids
            rows.start += got.start
            rows.truncated += got.truncated
            rows.errors += got.errors
            row_no += range(first, first + len(frame))
        if labels is not None:
            rows.errors = [
                e if e is None else _labelled(e, where, row_no[i], labels[i]) for i, e in enumerate(rows.errors)
            ]
        t_model = time.perf_counter()
        bad = [i for i, e in enumerate(rows.errors) if e is not None]
        if bad and not opts.skip_bad_rows:
            more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
            raise BadRowError(f"{rows.errors[bad[0]]}{more}; {bad_fix}")
        keep = [i for i in range(len(row_no)) if rows.errors[i] is None]
        good = [ids for ids in (rows.ids[i] for i in keep) if ids is not None]
        assert len(good) == len(keep)  # only a bad row is without ids (PreparedRows)
        lps, tops, finite, greedy = score_ids(rep, good, opts, report)
    t_output = time.perf_counter()
    nonfinite = [keep[j] for j, ok in enumerate(finite) if not ok]
    if nonfinite and not opts.allow_nonfinite:
        first_bad = _row_name(
            row_no[nonfinite[0]], labels[nonfinite[0]] if labels is not None else None, labels is not None
        )
        # raised before anything is written: no part under its final name, so the job ends without _SUCCESS
        raise NonFiniteError(
            f"the model produced non-finite logprobs (NaN/inf) on {len(nonfinite)} of {len(keep)} "
            f"rows of {where} (first: {first_bad}): its weights may hold NaN/inf, or the "
            f"precision overflows (try {opt('precision', 'fp32')}); pass "
            f"{opt('allow_nonfinite', True)} to keep them"
        )
    sums = [_row_sums(lps[j], greedy[j], rows.start[i]) for j, i in enumerate(keep)]
    counts = [len(ids) for ids in good]
    values: dict[str, Any] = {
        "num_tokens": counts,
        "prompt_tokens": [min(rows.start[i], n) for i, n in zip(keep, counts)],
        "num_scored": [s[0] for s in sums],
        "truncated": [rows.truncated[i] for i in keep],
        "logprobs": _list_column(lps, pa.list_(pa.float32())),
        "sum_logprob": [s[1] for s in sums],
        "mean_logprob": [s[2] for s in sums],
        "perplexity": [s[3] for s in sums],
        "is_greedy": [s[4] for s in sums],
    }
    if tops is not None:
        values["topk_ids"] = _list_column([t[0] for t in tops], pa.list_(pa.list_(pa.int32())))
        values["topk_logprobs"] = _list_column([t[1] for t in tops], pa.list_(pa.list_(pa.float32())))
        if opts.decode_topk:  # here, where the tokenizer is loaded: the strings travel no further than the output
            with rep.lock:  # a fast tokenizer used by two threads at once may raise "Already borrowed"
                values["topk_tokens"] = decode_topk_column(rep.tokenizer, values["topk_ids"])
    columns = pio.output_schema_columns(opts.topk, opts.decode_topk)
    table = pa.table(
        {
            name: values[name] if isinstance(values[name], pa.Array) else pa.array(values[name], type_)
            for name, type_ in columns
        }
    )
    tokens = sum(counts)
    from distributed.metrics import context_meter

    context_meter.digest_metric("tokens", tokens, "count")  # summed per span on the dashboard
    stats = {
        "rows": len(keep),
        "tokens": tokens,
        "empty_rows": sum(1 for s in sums if s[0] == 0),
        "truncated_rows": sum(values["truncated"]),
        "nonfinite_rows": len(nonfinite),
        **startup,
        # where a partition's time goes (ScoreResult.phase_seconds sums them over the job): reading and
        # checking the rows, the model (forwards, heads, results to the host), building (and writing) the output
        "phases": {"rows": t_model - t_rows, "model": t_output - t_model, "output": time.perf_counter() - t_output},
    }
    errors = [e for e in (rows.errors[i] for i in bad) if e is not None]  # all of them: bad rows have errors
    return ScoredRows(keep=keep, table=table, bad=bad, errors=errors, stats=stats)


def score_partition(span: SpanRows, opts: ScoreOptions, progress_id: str | None = None) -> dict[str, Any]:
    """Score one span of rows (:mod:`dask_lm.scoring.spans`) and write ``part-<index>.parquet`` (and its bad rows)
    atomically: ``score_parquet``'s file job over :func:`score_rows`.

    ``span.pieces`` are the span's rows as read, each a pandas frame of Arrow-backed columns, or an
    :class:`~dask_lm.io.parquet.UnreadableRowGroup` where the group could not be decoded: then every row of it is a
    bad row. With ``progress_id``, the job's bar hears when the replica is ready and the rows begin, and how many
    are scored, about twice a second (:func:`_rows_reporter`)."""
    import pyarrow as pa

    from dask_lm.io import parquet as pio

    t0 = time.perf_counter()
    index, file, pieces, firsts, counts = span
    for piece, first, n in zip(pieces, firsts, counts):
        if not isinstance(piece, pio.UnreadableRowGroup) and len(piece) != n:
            raise RuntimeError(
                f"partition {index}: rows {first}.. of {file} came back as {len(piece)} rows, the "
                f"footer says {n}: the reader split the dataset differently than planned"
            )
    unreadable = [p for p in pieces if isinstance(p, pio.UnreadableRowGroup)]
    if unreadable and not opts.skip_bad_rows:
        raise BadRowError(f"{unreadable[0].message()}, or pass {opt('skip_bad_rows', True)} to leave its rows out")
    lost_rows = [r for g in unreadable for r in range(g.first_row, g.first_row + g.num_rows)]
    lost_errors = [g.message() for g in unreadable for _ in range(g.num_rows)]
    readable = [(p, first) for p, first in zip(pieces, firsts) if not isinstance(p, pio.UnreadableRowGroup)]
    if not readable:
        return _unreadable(unreadable[0].schema, lost_rows, lost_errors, index, file, opts, t0)
    scored = score_rows(
        readable,
        opts,
        where=file,
        report=_rows_reporter(progress_id, index),
        bad_fix=f"fix the data, or {again(resume=True, skip_bad_rows=True)} to leave bad rows out "
        "(the parts already written are kept)",
    )
    t_write = time.perf_counter()
    import pandas as pd

    pdf = readable[0][0] if len(readable) == 1 else pd.concat([f for f, _ in readable], ignore_index=True)
    source = pdf.iloc[scored.keep]
    if opts.id_column is not None:
        source = source[[opts.id_column]]
    table = pa.Table.from_pandas(source.reset_index(drop=True), preserve_index=False)
    for name in scored.table.column_names:
        table = table.append_column(name, scored.table.column(name))
    _refuse_if_cancelled(index)
    # the bad rows first: a part file under its final name is what --resume skips, so it must come last
    if scored.bad or lost_rows:
        row_no = [r for frame, first in readable for r in range(first, first + len(frame))]
        listed = sorted(zip(lost_rows + [row_no[i] for i in scored.bad], lost_errors + scored.errors))
        err = pio.errors_table(index, file, [r for r, _ in listed], [e for _, e in listed])
        pio.write_part(err, pio.errors_dir(opts.output), pio.part_name(index))
    bad_rows = len(scored.bad) + len(lost_rows)
    written = _write_proved(table, index, file, firsts[0], sum(counts), bad_rows, opts)
    stats = scored.stats
    stats["phases"]["output"] += time.perf_counter() - t_write
    return {
        "part": index,
        **stats,
        "bad_rows": bad_rows,
        "seconds": time.perf_counter() - t0,
        "worker": _worker_address(),
        "stamp": written,
    }


def _write_proved(
    table: Any, index: int, file: str, first_row: int, num_rows: int, bad_rows: int, opts: ScoreOptions
) -> tuple[int, int, int]:
    """Write part ``index`` with its proof (:mod:`dask_lm.io.part_proof`: the job, the span, the counts); returns
    its stamp as written, with which the job's last check knows it unchanged without reading it again."""
    from dask_lm.io import parquet as pio
    from dask_lm.io import part_proof
    from dask_lm.io.fingerprint import stamp

    proof = (
        part_proof.PartProof(
            identity=opts.identity,
            part=index,
            file=file,
            first_row=first_row,
            num_rows=num_rows,
            rows=table.num_rows,
            bad_rows=bad_rows,
        )
        if opts.identity
        else None
    )
    written = stamp(pio.write_part(table, opts.output, pio.part_name(index), proof))
    return written.size, written.mtime_ns, written.ctime_ns


def _worker_address() -> str | None:
    """The address of the Dask worker running this task (``ScoreResult.parts_by_worker``); ``None`` outside one."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except ValueError:  # not in a worker's task (a test calling score_partition directly)
        return None


def _list_column(rows: list[torch.Tensor], type_: Any) -> Any:
    """Per row a ``[n]`` (or ``[n, k]``) tensor, as the Arrow column of type ``type_`` (``list<...>`` or
    ``list<list<...>>``) built from one flat buffer and its offsets: no Python float per value (4M of them took
    about a second per job)."""
    import numpy as np
    import pyarrow as pa

    if not rows:
        return pa.array([], type_)
    lengths = np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=len(rows))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = torch.cat([r if r.dim() == 2 else r.reshape(-1, 1) for r in rows])
    values = pa.array(flat.reshape(-1).numpy())
    if pa.types.is_list(type_.value_type):  # [n, k]: a list of k per position
        k = flat.shape[1]
        values = pa.ListArray.from_arrays(pa.array(np.arange(0, len(values) + 1, k, dtype=np.int32)), values)
    column = pa.ListArray.from_arrays(offsets, values)
    assert column.type == type_, (column.type, type_)
    return column


def _unreadable(
    schema: Any, rows: list[int], errors: list[str], index: int, file: str, opts: ScoreOptions, t0: float
) -> dict[str, Any]:
    """A span none of whose row groups can be decoded, with ``skip_bad_rows``: an empty part (the output schema,
    no rows) and one ``_errors.parquet`` entry per row, so that rows written plus rows listed still add up to the
    input."""
    import pyarrow as pa

    from dask_lm.io import parquet as pio

    if opts.id_column is not None:
        schema = pa.schema([schema.field(opts.id_column)])
    table = schema.empty_table()
    for name, type_ in pio.output_schema_columns(opts.topk, opts.decode_topk):
        table = table.append_column(name, pa.array([], type_))
    _refuse_if_cancelled(index)
    pio.write_part(pio.errors_table(index, file, rows, errors), pio.errors_dir(opts.output), pio.part_name(index))
    written = _write_proved(table, index, file, rows[0], len(rows), len(rows), opts)  # last: it marks the part done
    return {
        "part": index,
        "rows": 0,
        "tokens": 0,
        "bad_rows": len(rows),
        "empty_rows": 0,
        "truncated_rows": 0,
        "nonfinite_rows": 0,
        "seconds": time.perf_counter() - t0,
        "worker": _worker_address(),
        "stamp": written,
    }
