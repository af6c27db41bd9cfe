"""What a scoring job did: :class:`ScoreResult`, the summary ``score_parquet`` returns, prints and writes into
``_SUCCESS``, and the totals of an output read back from its part files (:func:`output_totals`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dask_lm.interface import opt
from dask_lm.io import parquet as pio
from dask_lm.io.results import ScoreRows

__all__ = ["ScoreResult", "output_totals"]


@dataclass
class ScoreResult(ScoreRows):
    """What a scoring job did. ``rows``, ``tokens``, the perplexities and the row counts cover the whole output,
    summed from its part files (a resumed job's earlier parts included: what ``_SUCCESS`` says is what the folder
    holds); ``run_rows`` / ``run_tokens`` / ``seconds`` are this run's alone (``parts_skipped`` of the parts were
    already there; an ``already_complete`` resume ran nothing). ``tokens_per_s`` is this run's tokens over
    ``scoring_seconds`` (the bar ends on it too): the loads and compilations are reported apart, not averaged into
    the rate. ``wall_phases`` cut ``wall_seconds`` into the steps the caller waited for."""

    output: str
    rows: int
    """Rows in the output's part files (bad rows skipped with ``skip_bad_rows`` are in ``bad_rows`` instead)."""
    tokens: int
    """Tokens of those rows (``num_tokens``, prompt tokens included)."""
    parts: int
    parts_skipped: int
    bad_rows: int
    seconds: float
    """Wall time of this run on the cluster once the checks passed: what is left of the model loads and
    compilations (they begin beside the checks), scoring and writing."""
    perplexity: float
    """The mean of the rows' perplexities (rows with nothing scored left out)."""
    dashboard: str | None = None
    """The Dask dashboard's address, while its cluster is up: ``None`` once this call has closed the local
    cluster it started (the address was shown while the job ran)."""
    empty_rows: int = 0
    """Rows with no token to score (null sums, ``num_scored`` 0), over every part."""
    truncated_rows: int = 0
    """Rows cut to the position limit by ``truncate``, over every part."""
    prepare_seconds: float = 0.0
    """The driver's checks before any work: model, tokenizer and input checks, the rows, content fingerprints (the
    driver's own: the cluster's start and the worker's config check, which run beside them, are not in it)."""
    model_load_seconds: float = 0.0
    """The longest model load of a worker in this run (imports, CUDA initialisation, weights to the device)."""
    compile_seconds: float = 0.0
    """The longest compilation of a worker's inference forward in this run (GPU workers; 0 elsewhere)."""
    corpus_perplexity: float = float("nan")
    """``exp(-sum of every scored logprob / number of scored tokens)`` over the whole output: the dataset's
    perplexity as evaluation reports it (long rows weigh more than in ``perplexity``)."""
    scored_tokens: int = 0
    """Tokens in the sums (``num_scored``) over the whole output."""
    scoring_seconds: float = 0.0
    """The time rows were being scored and written: from when the last worker's replica was ready (loaded and
    compiled, in its first partition or while the driver checked) to when the last part was written. A replica
    ready only after the first part came back (a worker that joined mid-job) does not move its start: the job was
    scoring already (:meth:`~dask_lm.scoring.start_clock.StartClock.waited_for`)."""
    already_complete: bool = False
    """A ``resume`` of a finished output: nothing ran; the totals are the finished job's."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Worker time per phase, summed over the partitions of this run: ``rows`` (checking and tokenizing),
    ``model`` (forwards, heads, results to the host), ``output`` (building and writing the part files). The rest of
    ``seconds`` is reading, scheduling and startup."""
    started_at: float = 0.0
    """``time.time()`` when the call began."""
    wall_seconds: float = 0.0
    """From the call's start to its end: what the caller waited, checks and the cluster's closing included."""
    first_row_at: float | None = None
    """``time.time()`` when the first part file of this run was written (its rows scored): with ``started_at``,
    what a user waits for the first results."""
    start_phases: dict[str, float] = field(default_factory=dict)
    """When each step of the start ended, in seconds from the call's start: ``checks`` (the driver's own checks,
    rows and fingerprints: ``prepare_seconds``), ``cluster_began`` / ``cluster_up`` (the cluster's start itself
    began, and the cluster was up or reached: an interval that may overlap the checks, as the start runs beside
    them), ``config_check_began`` / ``config_checked`` (the first worker's config check, see
    :class:`~dask_lm.scoring.preload.Preload`: most of it the worker's imports), ``checks_passed`` (every check
    passed, the worker's config check included), ``cluster`` (the cluster up with its workers, the checks
    passed, the output pinned), ``worker_processes`` / ``preloads_began`` / ``replicas_ready`` (the last worker's
    process began, its preload began, its replica was ready: the workers' own clocks), ``first_row`` (the first
    part written)."""
    parts_by_worker: dict[str, int] = field(default_factory=dict)
    """How many of this run's parts each worker (by address) scored: workers that joined mid-job included; one
    retired mid-job counts for the parts whose results reached the job before it left (the others were scored
    again elsewhere, and count there)."""
    model_load_phases: dict[str, float] = field(default_factory=dict)
    """The slowest worker's model load (``model_load_seconds``) by step, and the config check's imports."""
    run_rows: int = 0
    """Rows scored by this run (``rows`` less those of the ``parts_skipped`` parts)."""
    run_tokens: int = 0
    """Tokens scored by this run."""
    wall_phases: dict[str, float] = field(default_factory=dict)
    """``wall_seconds`` cut into the steps the caller waited for, in order, adding up to it: ``checks`` (the
    driver's own checks and fingerprints: ``prepare_seconds``), ``cluster_start`` (what was left, once they had
    ended, of the cluster's start and its first worker's config check: the start runs beside the checks, and
    ``start_phases`` gives its own interval, ``cluster_began`` to ``cluster_up``),
    ``model_load`` and ``compile`` (what was left of the last worker's load and compilation: they run beside the
    checks, and ``model_load_seconds`` / ``compile_seconds`` give their whole length; a worker whose replica was
    ready only after the first part came back, one that joined mid-job, is scoring time), ``scoring`` (scoring and
    writing: ``scoring_seconds``), ``closing`` (the replicas freed, the totals read back, the cluster this call
    started closed)."""
    convention: str = ""
    """The tokenization convention and what it scores, in words (``lm-eval: every token of each text scored, the
    first one conditioned on BOS ...``): where ``dask-lm logprobs`` (which leaves a text's first token unscored)
    and this job differ, the summary says so."""

    @property
    def tokens_per_s(self) -> float:
        """Tokens scored in this run per second of scoring (``scoring_seconds``)."""
        seconds = self.scoring_seconds or self.seconds
        return self.run_tokens / seconds if seconds else 0.0

    def _repr_html_(self) -> str:
        from dask_lm.engine.reprs import table

        return table("dask-lm scoring job", None, self.summary())

    def summary(self) -> list[tuple[str, str]]:
        if self.already_complete:
            speed = [("status", f"already complete: nothing was run (pass {opt('overwrite', True)} to score again)")]
        else:
            first = self.start_phases.get("first_row")
            steps = " + ".join(f"{_PHASE_LABELS.get(k, k)} {v:.1f}" for k, v in self.wall_phases.items())
            speed = [
                (
                    "tokens/s",
                    f"{self.tokens_per_s:,.0f} (this run's {self.run_tokens:,} tokens over "
                    f"{self.scoring_seconds:.1f} s of scoring and writing)",
                ),
                ("seconds", f"{self.wall_seconds:.1f} from the call's start" + (f" = {steps}" if steps else "")),
                (
                    "workers",
                    f"model load {self.model_load_seconds:.1f} s, compile {self.compile_seconds:.1f} s "
                    "(the slowest worker's, mostly beside the checks)"
                    + (f"; first rows written at {first:.1f} s" if first is not None else ""),
                ),
            ]
        resumed = self.parts_skipped and not self.already_complete
        return [
            ("rows", f"{self.rows:,}" + (f" ({self.run_rows:,} scored by this run)" if resumed else "")),
            ("tokens", f"{self.tokens:,}" + (f" ({self.run_tokens:,} by this run)" if resumed else "")),
            *speed,
            (
                "perplexity",
                f"{self.corpus_perplexity:.3f} (corpus: exp of minus the mean scored logprob; "
                f"mean of rows {self.perplexity:.3f})",
            ),
            ("scored tokens", f"{self.scored_tokens:,}"),
            *([("convention", self.convention)] if self.convention else []),
            ("parts", f"{self.parts} ({self.parts_skipped} already done)"),
            (
                "bad rows",
                f"{self.bad_rows} (left out, listed in {os.path.join(self.output, pio.ERRORS)})"
                if self.bad_rows
                else "0",
            ),
            ("empty rows", str(self.empty_rows)),
            ("truncated rows", str(self.truncated_rows)),
            ("output", self.output),
            *([("dashboard", self.dashboard)] if self.dashboard else []),
        ]


# the summary's names of ScoreResult.wall_phases
_PHASE_LABELS = {"cluster_start": "cluster start", "model_load": "model load", "scoring": "scoring and writing"}


def output_totals(output: str, parts: int) -> dict[str, Any]:
    """Totals over every part of the output (resumed parts included), read from the part files:

    - ``rows`` and ``tokens`` (the sum of ``num_tokens``);
    - ``perplexity``: the mean of the rows' perplexities; rows with nothing scored (null perplexity) are left out,
      a NaN / inf one (kept with ``allow_nonfinite``) is not, so the mean says so too;
    - ``corpus_perplexity`` and ``scored_tokens``: ``exp(-sum(sum_logprob) / sum(num_scored))``;
    - ``empty_rows`` (nothing scored) and ``truncated_rows``."""
    import math

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total, count, empty, truncated, logprob, scored, rows, tokens = 0.0, 0, 0, 0, 0.0, 0, 0, 0
    for i in range(parts):
        t = pq.read_table(
            os.path.join(output, pio.part_name(i)),
            columns=["num_tokens", "perplexity", "truncated", "sum_logprob", "num_scored"],
        )
        rows += t.num_rows
        tokens += int(pc.sum(t["num_tokens"]).as_py() or 0)
        ppl = t["perplexity"]
        total += float(pc.sum(ppl).as_py() or 0.0)  # sum and count skip nulls
        count += len(ppl) - ppl.null_count
        empty += ppl.null_count
        truncated += int(pc.sum(t["truncated"]).as_py() or 0)
        logprob += float(pc.sum(t["sum_logprob"]).as_py() or 0.0)
        scored += int(pc.sum(t["num_scored"]).as_py() or 0)
    mean = total / count if count else float("nan")
    nll = -logprob / scored if scored else float("nan")
    corpus = math.exp(nll) if nll < 709 else float("inf") if nll >= 709 else float("nan")  # exp overflows past 709
    return {
        "rows": rows,
        "tokens": tokens,
        "perplexity": mean,
        "corpus_perplexity": corpus,
        "scored_tokens": scored,
        "empty_rows": empty,
        "truncated_rows": truncated,
    }
