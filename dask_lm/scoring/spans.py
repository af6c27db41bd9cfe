"""Scoring tasks sized by tokens: the rows of a parquet dataset cut into spans, one task (and one part file) each.

A row group is the unit parquet reads, but not a good unit of work: pandas and pyarrow write a file as a single
row group (1Mi rows) unless told otherwise, so such a dataset was scored by one worker however many there were
(6000 rows on two CPU workers: 70.0 s in one row group, 39.9 s in six), and a dataset of many tiny row groups paid
the scheduler's per-task cost for each. The plan here cuts by estimated tokens instead:

- the job's tokens come from the footers, no row read: an ids column's value count (exact), or about 4 bytes of a
  text column's encoded data per token (dictionary-encoded repeats make that low);
- the target is about :data:`TASKS_PER_JOB` tasks, clamped to [:data:`MIN_TASK_TOKENS`, :data:`MAX_TASK_TOKENS`]:
  enough tasks to balance a few dozen workers and to write a first part early, few enough that the per-task cost
  (scheduling, opening the file, fsync'ing the part: about 0.05 s on the H200 host) stays a few percent;
- a row group over the target is split into equal row ranges, read once and sliced where it was read (only the
  slices travel); consecutive row groups of one file under it are merged into one task.

The plan depends only on the footers and these constants, never on the cluster, so a ``--resume`` on another
cluster cuts the same spans; the manifest pins it (:func:`plan_digest`), and a resume from an output planned
otherwise is refused instead of mixing two cuts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "Span",
    "SpanRows",
    "plan_spans",
    "plan_digest",
    "task_tokens",
    "TASKS_PER_JOB",
    "MIN_TASK_TOKENS",
    "MAX_TASK_TOKENS",
]

TASKS_PER_JOB = 32
MIN_TASK_TOKENS = 16_384
MAX_TASK_TOKENS = 1 << 20


@dataclass(frozen=True)
class Span:
    """One task's rows: ``num_rows`` rows of ``file`` from row ``first_row`` (counted in the file), in its row
    groups ``groups`` (indices into ``ScoreInputs.partitions``, consecutive). A span either holds every row of its
    groups (``offset`` 0, ``whole``) or is a slice of one split row group, from row ``offset`` of that group."""

    file: str
    groups: tuple[int, ...]
    first_row: int
    num_rows: int
    offset: int = 0
    whole: bool = True


class SpanRows(NamedTuple):
    """One span's rows as its scoring task gets them (:func:`dask_lm.scoring.scorer.score_partition`), for part
    file number ``part``: ``pieces``, consecutive row groups of ``file`` (or one group's slice) as read, each starting
    at file row ``firsts[k]`` with ``counts[k]`` rows."""

    part: int
    file: str
    pieces: list[Any]
    firsts: list[int]
    counts: list[int]


def task_tokens(total_tokens: float) -> int:
    """The target tokens per task for a job of ``total_tokens`` (estimated)."""
    return int(min(MAX_TASK_TOKENS, max(MIN_TASK_TOKENS, total_tokens / TASKS_PER_JOB)))


def plan_spans(
    groups: list[tuple[str, int, int, int]], group_tokens: list[float], target: int | None = None
) -> list[Span]:
    """The spans of a dataset whose row groups are ``groups`` (file, group in the file, first row, rows: the
    ``ScoreInputs.partitions``) holding about ``group_tokens`` tokens each, for tasks of about ``target`` tokens
    (default: :func:`task_tokens` of the whole; 0: one span per row group, as written)."""
    assert len(groups) == len(group_tokens)
    if target == 0:  # the row groups as written: one task each
        return [Span(file, (i,), first, rows) for i, (file, _g, first, rows) in enumerate(groups)]
    target = target or task_tokens(sum(group_tokens))
    spans: list[Span] = []
    run: list[int] = []  # consecutive small groups of one file, merged into one span
    run_tokens = 0.0

    def flush() -> None:
        nonlocal run, run_tokens
        if run:
            file, _g, first, _n = groups[run[0]]
            rows = sum(groups[i][3] for i in run)
            spans.append(Span(file, tuple(run), first, rows))
        run, run_tokens = [], 0.0

    for i, ((file, _g, first, rows), tokens) in enumerate(zip(groups, group_tokens)):
        if run and (groups[run[0]][0] != file or run_tokens + tokens > target):
            flush()
        if tokens > target and rows > 1:
            flush()
            pieces = min(rows, math.ceil(tokens / target))
            bounds = [j * rows // pieces for j in range(pieces + 1)]  # pieces <= rows: no empty slice
            spans += [Span(file, (i,), first + a, b - a, a, whole=False) for a, b in itertools.pairwise(bounds)]
            continue
        run.append(i)
        run_tokens += tokens
    flush()
    return spans


def plan_digest(spans: list[Span], files: list[str]) -> str:
    """A short digest of the plan, for the manifest: the spans by file position, first row and rows."""
    where = {f: k for k, f in enumerate(files)}
    rows: list[Any] = [[where[s.file], s.first_row, s.num_rows] for s in spans]
    text = json.dumps({"tasks_per_job": TASKS_PER_JOB, "spans": rows}, separators=(",", ":"))
    return "spans-v1:" + hashlib.sha256(text.encode()).hexdigest()[:16]
