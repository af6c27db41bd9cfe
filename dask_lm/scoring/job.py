"""Offline scoring of parquet datasets: ``score_parquet`` (the driver side of ``dask-lm score``).

The job: the rows are cut into spans of about ``task_tokens`` tokens (:mod:`dask_lm.scoring.spans`: a large row group
split, small ones merged), each row group read in its own Dask task (Arrow-backed pandas, each read naming its file
and row group when a page is damaged); each span is scored on whichever worker is free
(:func:`dask_lm.scoring.scorer.score_partition`, a model replica per worker) and written as ``part-NNNNN.parquet``,
atomically. ``_manifest.json`` (written first) pins the model and input files by content (path, size, SHA-256 of
every file that determines results: :mod:`dask_lm.io.fingerprint`), the options, the span plan and the dask-lm
version; ``_SUCCESS`` (written last) marks a complete output. ``resume=True`` skips the parts already there and
refuses, naming each difference, an output whose pins differ; on a complete output it returns at once, without a
cluster. A job holds a lock on its output directory (:mod:`dask_lm.jobs.folder`), so two jobs never write one output.

Nothing is written before every check has passed. What costs no more than a few small reads comes first, before
anything starts: the output folder, the model's config and weight files (:mod:`dask_lm.io.modelcheck`) and
``--topk`` against the vocabulary they state, the tokenizer's files, the input files' footers, columns and types, a
held lock, a resume's options. Then the cluster starts, and its workers load the model
(:class:`~dask_lm.jobs.start.ClusterStart`), while this process does the costly checks: the config through
transformers (on the first worker, before its load: :class:`~dask_lm.scoring.preload.Preload`), the content hashes
(and a resume's comparison of them), and for jobs up to 8M tokens every row (:mod:`dask_lm.scoring.prescan`: all
bad rows in one refusal); a refused job closes what it started. A bad row found while scoring (a larger job) fails
it with a message naming file, row and column, unless ``skip_bad_rows`` (then it is listed in ``_errors.parquet``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dask_lm.data.continuation import describe
from dask_lm.data.messages import ScoreOptions
from dask_lm.engine import cluster
from dask_lm.engine.progress import JobBar
from dask_lm.errors import BadRowError, SchedulerLostError
from dask_lm.interface import again, current, opt, warn
from dask_lm.io import fingerprint, hub, modelcheck, part_proof
from dask_lm.io import parquet as pio
from dask_lm.io.manifest import read_manifest
from dask_lm.io.results import ScoreRows
from dask_lm.jobs import folder, interrupts, model_files
from dask_lm.jobs.output import JobKind, JobOutput
from dask_lm.jobs.resume import added_skip_bad_rows, spec_for
from dask_lm.jobs.start import ClusterStart, in_thread, running, wait_for_workers, worker_precision
from dask_lm.scoring import prescan, spans
from dask_lm.scoring.checks import check_score_model
from dask_lm.scoring.compile_choice import worth_compiling, worth_compiling_head
from dask_lm.scoring.preload import Preload
from dask_lm.scoring.spec import ScoreSpec
from dask_lm.scoring.start_clock import StartClock
from dask_lm.scoring.tasks import release_scorers, score_partition
from dask_lm.workers.state import PLUGIN_NAME, DaskLMWorkerState

__all__ = ["score_parquet", "ScoreResult", "PlannedJob", "plan_job"]

logger = logging.getLogger("dask_lm")


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
    """The driver's checks before any work: model, tokenizer and input checks, content fingerprints."""
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
    """When each step of the start ended, in seconds from the call's start: ``checks`` (the driver's checks and
    fingerprints), ``cluster`` (the cluster up, or reached, and the checks done), ``config_check_began`` /
    ``config_checked`` (the first worker's config check, see :class:`~dask_lm.scoring.preload.Preload`: most of it
    the worker's imports), ``worker_processes`` / ``preloads_began`` / ``replicas_ready`` (the last worker's process
    began, its preload began, its replica was ready: the workers' own clocks), ``first_row`` (the first part
    written)."""
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
    driver's checks and fingerprints), ``cluster_start`` (the cluster up, or reached, after them),
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


# the fields a part task takes from the spec as they are (ScoreOptions: the rest are the job's own, or resolved)
_SHARED = (
    "text_column",
    "ids_column",
    "prompt_length_column",
    "prompt_column",
    "response_column",
    "id_column",
    "topk",
    "decode_topk",
    "max_length",
    "truncate",
    "batch_tokens",
    "skip_bad_rows",
    "convention",
    "precision",
)


def _convention(opts: ScoreOptions) -> str:
    """``ScoreResult.convention``: what the job's rows were scored as, in words."""
    return describe(opts.convention, "ids" if opts.ids_column else "text" if opts.text_column else "pair")


_KIND = JobKind(
    name="scoring job",
    did="scored",
    owned=r"part-\d{5}\.parquet|_errors\.parquet|_errors",
    debris=pio.remove_debris,
    resume_hint=lambda: f" (add {opt('skip_bad_rows', True)} to leave out the bad rows that stopped it)",
)


@dataclass(frozen=True)
class PlannedJob:
    """A scoring job once its cheap checks passed, before anything starts: its spec, output folder, model, inputs
    and the spans its parts cover (:func:`plan_job`)."""

    spec: ScoreSpec
    out: JobOutput
    source: hub.ModelSource
    info: modelcheck.ModelInfo
    inputs: pio.ScoreInputs
    plan: list[spans.Span]
    opts: ScoreOptions
    """What every part task is sent; the model's pins, the job's identity, an automatic precision and compilation
    are filled in once known."""
    finished: bool
    """A resume of a complete output: nothing will be loaded or tokenized, its files are compared."""

    def manifest(self) -> tuple[dict[str, Any], list[fingerprint.Pin]]:
        """The job's manifest, its files hashed (the costly step), and the pins behind it."""
        # the parts are numbered by span: a resume must cut the rows the same way (dask_lm.scoring.spans)
        return model_files.manifest(
            self.source,
            self.info,
            self.inputs,
            self.spec.manifest_options(),
            tokenizer=self.opts.tokenizer,
            partitions=len(self.plan),
            partition_plan=spans.plan_digest(self.plan, self.inputs.files),
        )


def plan_job(
    spec: ScoreSpec, output: str | os.PathLike[str], *, resume: bool, overwrite: bool, revision: str | None
) -> PlannedJob:
    """The checks that cost no more than a few small reads: the output folder, the model's files (config JSON,
    weight headers, ``topk`` against the vocabulary it states), the tokenizer's, the inputs' footers and columns,
    and a resume's options and plan against the manifest it resumes. ``ValueError`` naming what is wrong."""
    out = JobOutput.open(_KIND, list(spec.input), output, resume=resume, overwrite=overwrite)
    out.settings = spec.manifest_settings()
    finished = resume and out.state.kind == "finished"
    source = hub.resolve_model(spec.model, revision=revision)
    info, tokenizer = check_score_model(
        source.path,
        topk=spec.topk,
        tokenizer=spec.tokenizer,
        ids_column=spec.ids_column,
        decode_topk=spec.decode_topk,
        check_tokenizer=not finished,
    )
    inputs = pio.inspect_inputs(
        out.files,
        text_column=spec.text_column,
        ids_column=spec.ids_column,
        prompt_column=spec.prompt_column,
        response_column=spec.response_column,
        id_column=spec.id_column,
        prompt_length_column=spec.prompt_length_column,
    )
    plan = spans.plan_spans(inputs.partitions, inputs.group_tokens, spec.task_tokens)
    opts = ScoreOptions(
        **{f.name: getattr(spec, f.name) for f in fields(ScoreOptions) if f.name in _SHARED},
        model=source.path,
        tokenizer=tokenizer,
        output=out.path,
        allow_nonfinite=spec.allow_nonfinite,
        compile=bool(spec.compile),
        compile_head=bool(spec.compile),
        interface=current(),
    )
    if out.state.kind != "new" and resume:
        out.precheck(
            {
                "options": spec.manifest_options(),
                "partitions": len(plan),
                "partition_plan": spans.plan_digest(plan, inputs.files),
            },
            skip_bad_rows=spec.skip_bad_rows,
        )
    return PlannedJob(
        spec=spec, out=out, source=source, info=info, inputs=inputs, plan=plan, opts=opts, finished=finished
    )


def _finished(output: str, manifest: dict[str, Any]) -> ScoreResult:
    """``--resume`` of a complete output: nothing to score and no cluster to start; the summary is ``_SUCCESS``'s."""
    parts = int(manifest["partitions"])
    summary = folder.read_summary(output)
    totals = _output_totals(output, parts)  # from the parts themselves: they are what the output holds
    return ScoreResult(
        output=output,
        parts=parts,
        parts_skipped=parts,
        bad_rows=int(summary.get("bad_rows") or 0),
        seconds=0.0,
        already_complete=True,
        **totals,
    )


def score_parquet(
    input: Any,
    output: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | None = None,
    client: Any = None,
    text_column: str | None = None,
    ids_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    id_column: str | None = None,
    prompt_length_column: str | None = None,
    convention: str | None = None,
    topk: int | None = None,
    decode_topk: bool | None = None,
    max_length: int | None = None,
    truncate: bool | None = None,
    batch_tokens: int | None = None,
    precision: str | None = None,
    resume: bool = False,
    progress: bool = True,
    skip_bad_rows: bool | None = None,
    allow_nonfinite: bool | None = None,
    compile: bool | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    overwrite: bool = False,
    performance_report: str | None = None,
    n_workers: int | None = None,
    scheduler_address: str | None = None,
    task_tokens: int | None = None,
) -> ScoreResult:
    """Score every row of a parquet dataset with ``model``; see the module docstring for the output.

    ``input`` is a parquet file, a directory of them, a glob, or a list. Exactly one of ``text_column``,
    ``ids_column`` or ``prompt_column`` + ``response_column`` says what to score. Text is tokenized in
    ``convention`` (:mod:`dask_lm.data.continuation`): ``"lm-eval"``, lm-evaluation-harness's (the response
    encoded in context, trailing prompt whitespace moved to it, one BOS at most, an empty prompt conditioned on
    BOS / EOS), or ``"separate"`` (prompt and response encoded apart, as ``dask-lm logprobs`` does). With
    ``ids_column``, ``prompt_length_column`` (integers) says how many leading ids of each row are context: only
    the rest is scored. ``topk``: the k likeliest tokens at each position, ``decode_topk``: their strings too.
    ``client`` is a Dask client (default: ``connect(scheduler_address,
    n_workers=n_workers)``, started at once, beside the checks, and closed here); its workers load the model while
    the checks run. The rows are cut into tasks (and part files) of about ``task_tokens`` tokens, estimated from
    the footers (default: about 1/32 of the job, within 16k-1M: :mod:`dask_lm.scoring.spans`): a large row group is
    split across workers, small ones are merged; ``task_tokens=0`` keeps one task per row group, as written.
    ``precision`` defaults to bfloat16 on GPU workers and float32 on CPU ones. On GPU workers rows are packed and,
    with ``compile`` the forward is compiled once per worker process (5-10 s, reported as
    ``ScoreResult.compile_seconds``); by default (``None``) only where the job is long enough for that to pay
    (:func:`~dask_lm.scoring.compile_choice.worth_compiling`).
    An output that already holds a job is refused unless ``resume`` (finish it with the same pins; a finished one
    returns its summary at once, without a cluster) or ``overwrite`` (delete that job's files and score again);
    files dask-lm did not write are never deleted.
    With ``resume``, what is not given (``None``) is the manifest's, ``input`` and ``model`` too
    (:mod:`dask_lm.jobs.resume`: ``score_parquet(None, output, resume=True)``); a given option that differs is
    refused, naming it. Else ``model`` is required, and the defaults are ``convention="lm-eval"``, ``topk=0``, and
    ``False`` for ``decode_topk``, ``truncate``, ``skip_bad_rows`` and ``allow_nonfinite``.
    Raises ``ValueError`` for bad usage or input (damaged model files, a changed input on ``resume``, an output
    another job holds), before anything is written (a cluster this call started is closed again).
    """
    started, started_at = time.perf_counter(), time.time()
    # what the call gave, completed on a resume from the manifest, then from the spec's defaults; checked
    spec = spec_for(ScoreSpec, output, resume=resume, given=ScoreSpec.given(locals()))
    # 1. the checks that cost no more than a few small reads, before anything starts
    job = plan_job(spec, output, resume=resume, overwrite=overwrite, revision=revision)
    out, plan = job.out, job.plan
    # 2. the cluster starts, and each worker loads its replica, while this process does the costly checks: the
    #    config through transformers (on a worker) and the content hashes. Nothing reaches the output before
    #    they pass; a refused job closes what it started. A replica loaded from other bytes than the ones hashed is
    #    not used (scoring/scorer.py: adopt). A finished output's resume starts nothing.
    warm = (
        None
        if job.finished
        else Preload(
            job.source.path, job.opts.tokenizer, spec.fixed_precision, spec.compile, sum(job.inputs.group_tokens)
        )
    )
    start = ClusterStart(
        client, scheduler_address=scheduler_address, n_workers=n_workers, eager=not job.finished, warm=warm
    )
    try:
        return _pinned_run(
            start, warm, job, started, started_at, progress=progress, performance_report=performance_report
        )
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the workers stopped at once, one line says what is kept
        start.close(interrupted=True)
        raise _interrupted(out, len(plan), e) from None
    except Exception as e:  # a lost scheduler: one line too, what is kept and how to go on
        # no remembered address here: by the time an error reaches this point the job may have closed its own
        # client, and a closed client must not read as a lost scheduler; the scoring loop names a loss it saw
        address = cluster.lost_scheduler(start.client, e)
        if address is None:
            raise
        raise _scheduler_lost(out, len(plan), address) from None
    finally:
        start.close()


def _interrupted(out: JobOutput, parts: int, e: BaseException) -> interrupts.JobInterrupted:
    kept = sum(1 for n in out.kept() if n.startswith("part-"))
    if not os.path.exists(os.path.join(out.path, pio.MANIFEST)):  # a new job that kept nothing was removed
        message = f"interrupted: nothing was written to {out.path}; {again()} to start over"
    else:
        message = f"interrupted: {kept} of {parts} parts kept in {out.path}; {again(resume=True)} to score the rest"
    return interrupts.JobInterrupted(message, interrupts.signum_of(e))


def _scheduler_lost(out: JobOutput, parts: int, address: str) -> SchedulerLostError:
    lost = f"lost the Dask scheduler at {address} (stopped, or the network to it failed)"
    if not os.path.exists(os.path.join(out.path, pio.MANIFEST)):
        return SchedulerLostError(f"{lost}; nothing was written to {out.path}: once a scheduler is up, {again()}")
    kept = sum(1 for n in out.kept() if n.startswith("part-"))
    return SchedulerLostError(
        f"{lost}: {kept} of {parts} parts kept in {out.path}; once a scheduler is up, "
        f"{again(resume=True)} to score the rest"
    )


def _pinned_run(
    start: ClusterStart,
    warm: Preload | None,
    job: PlannedJob,
    started: float,
    started_at: float,
    *,
    progress: bool,
    performance_report: str | None,
) -> ScoreResult:
    """``score_parquet`` from the costly checks on, while ``start`` brings the cluster up: the config through
    transformers (asked of a worker, waited for in a thread) beside the row scan and the content hashes, then the
    manifest under the output's lock, then the run."""
    from dask_lm.engine.worker_group import scheduler_info

    spec, out, source, inputs, plan, opts = job.spec, job.out, job.source, job.inputs, job.plan, job.opts

    scan = not job.finished and not opts.skip_bad_rows and sum(inputs.group_tokens) <= prescan.PRESCAN_MAX_TOKENS
    loads = in_thread(warm.check_config, start) if warm is not None else None
    # every bad row of the job, found while the workers load (dask_lm.scoring.prescan)
    rows = in_thread(prescan.bad_rows, inputs, plan, opts, modelcheck.stated_vocab(source.path)) if scan else None
    manifest, pins = job.manifest()
    checked = loads.result() if loads is not None else {}  # transformers' ValueError naming config.json
    bad = rows.result() if rows is not None else None
    if bad:
        raise BadRowError(prescan.message(bad))
    opts = replace(opts, model_pins=tuple(pins[: len(pins) - len(inputs.files)]))
    prepare_seconds = time.perf_counter() - started
    with out.locked() as old:
        added_skip = added_skip_bad_rows(old, spec.skip_bad_rows)
        pinned = out.pin(manifest, old, pins, ignore=("skip_bad_rows",) if added_skip else ())
        if old is not None and out.finished:
            return replace(_finished(out.path, old), convention=_convention(opts))
        if added_skip:  # from now on the output may leave rows out: its manifest says so
            out.write_manifest({**pinned, "options": {**pinned["options"], "skip_bad_rows": True}})
        pio.make_errors_dir(out.path)  # a real directory: a link there is refused, naming it
        # a part is kept only where it proves to be this job's part for its span (dask_lm.io.part_proof)
        stamps = part_proof.kept_parts(
            out.path, part_proof.expected_parts(part_proof.job_identity(pinned), plan), _part_columns(inputs, opts)
        )
        clock = StartClock(started, started_at, {"checks": prepare_seconds})
        clock.config_check(checked)
        with running(start, total=inputs.num_rows, desc="scoring", unit="row", progress=progress) as (dask_client, bar):
            wait_for_workers(dask_client, bar)  # a scheduler whose workers are still to come
            clock.mark("cluster")
            if spec.fixed_precision is None:
                opts = replace(opts, precision=worker_precision(dask_client))
            out.pin_precision(opts.precision)
            pinned = read_manifest(out.path) or pinned
            opts = replace(opts, identity=part_proof.job_identity(pinned))
            if spec.compile is None:
                workers = len(scheduler_info(dask_client)["workers"])
                opts = replace(
                    opts,
                    compile=worth_compiling(inputs, spec.ids_column, workers),
                    compile_head=worth_compiling_head(sum(inputs.group_tokens), workers),
                )
            result = _run(
                dask_client, out, inputs, plan, opts, stamps, start.warm_futures, bar, performance_report, clock
            )
            closed = bool(getattr(start.opened, "_dask_lm_owns_cluster", False))
        # the cluster this call started is closed by now: that counts in the wall time, and its dashboard is gone
        wall, steps = clock.closed(result.wall_phases)
        result = replace(
            result,
            wall_seconds=wall,
            wall_phases=steps,
            dashboard=None if closed else result.dashboard,
            convention=_convention(opts),
        )
        out.finish(asdict(result))  # the counts cover every part, like bad_rows (resumed parts included)
        return result


def _part_columns(inputs: pio.ScoreInputs, opts: ScoreOptions) -> list[tuple[str, Any]]:
    """The columns of every part, in order: the input's (or the id column alone; their types are the input's) and
    the scoring columns with their types."""
    assert inputs.schema is not None
    kept = [opts.id_column] if opts.id_column is not None else inputs.schema.names
    return [(name, None) for name in kept] + list(pio.output_schema_columns(opts.topk, opts.decode_topk))


def _run(
    client: Any,
    out: JobOutput,
    inputs: pio.ScoreInputs,
    plan: list[spans.Span],
    opts: ScoreOptions,
    stamps: dict[int, fingerprint.Stamp],
    preloads: list[Any],
    bar: JobBar,
    performance_report: str | None,
    clock: StartClock,
) -> ScoreResult:
    import dask
    from distributed import as_completed, span

    from dask_lm.engine.worker_group import scheduler_info

    columns = None
    if opts.id_column is not None:
        columns = sorted(
            {
                c
                for c in (
                    opts.id_column,
                    opts.text_column,
                    opts.ids_column,
                    opts.prompt_column,
                    opts.response_column,
                    opts.prompt_length_column,
                )
                if c
            }
        )
    done = sorted(stamps)
    stamps = dict(stamps)  # and this run's parts, as their workers wrote them
    todo = [i for i in range(len(plan)) if i not in stamps]
    # one per row group, computed where a span needs it
    reads = model_files.located_partitions(inputs, columns, out.pins)
    report = cluster.performance_report(client, performance_report) if performance_report else contextlib.nullcontext()
    t0, t0_wall = time.perf_counter(), time.time()
    ready_at = t0_wall  # when the last worker's replica became ready (loaded, compiled): scoring starts there
    ready_compile = 0.0  # that replica's compilation, the end of its readiness
    scored_at = t0_wall  # when the last part came back: scoring ends there, for the bar and the summary alike
    rows = tokens = bad = returned = 0
    load = compile_s = 0.0
    phases: dict[str, float] = {}
    by_worker: dict[str, int] = {}
    total_rows = sum(plan[i].num_rows for i in todo)
    workers = len(scheduler_info(client)["workers"])
    preloaded = any(f.done() and f.status == "finished" and "error" not in (f.result() or {}) for f in preloads)
    # until a worker reports that it began a part (its replica ready), the bar says what the job waits for
    bar.wait(
        "starting the first parts" if preloaded else f"loading the model on {workers} worker{'s' * (workers != 1)}",
        total=total_rows,
    )
    progress_id = bar.listen(client)
    with report, span("dask-lm/score"):
        tasks = [
            dask.delayed(score_partition, pure=False)(
                *_pieces(plan[i], inputs, reads), i, plan[i].file, opts, progress_id
            )
            for i in todo
        ]
        # the workers' dask-lm plugin holds their model replicas and frees those left idle (a dead driver's job)
        client.register_plugin(DaskLMWorkerState(), name=PLUGIN_NAME)
        futures = client.compute(tasks)
        scheduler = cluster.scheduler_address_of(client)  # a client that gave up reconnecting forgets it
        try:
            with cluster.quiet_while_reconnecting(client):
                for fut in as_completed(futures):
                    stats = fut.result()  # a bad row or a runtime failure raises here
                    clock.first_row()
                    rows += stats["rows"]
                    tokens += stats["tokens"]
                    bad += stats["bad_rows"]
                    if stats.get("load_seconds", 0.0) > load:
                        load = stats["load_seconds"]
                        clock.load_phases = stats.get("load_phases") or {}
                    compile_s = max(compile_s, stats.get("compile_seconds", 0.0))
                    if clock.waited_for(stats) and stats["ready_at"] > ready_at:  # not a late joiner's
                        ready_at, ready_compile = stats["ready_at"], stats.get("compile_seconds", 0.0)
                    by_worker[stats.get("worker")] = by_worker.get(stats.get("worker"), 0) + 1
                    stamps[stats["part"]] = fingerprint.Stamp(*stats["stamp"])
                    for k, v in stats.get("phases", {}).items():
                        phases[k] = phases.get(k, 0.0) + v
                    scored_at = time.time()
                    scoring = scored_at - ready_at
                    returned += 1
                    last = returned == len(futures)  # the rate the summary gives, shown as the bar closes
                    bar.update(
                        stats["rows"] + stats["bad_rows"],
                        f"{tokens / scoring:,.0f} tok/s" if scoring > 0.5 or (last and scoring > 0) else None,
                        part=stats["part"],
                    )
        except BaseException as e:
            lost = cluster.lost_scheduler(client, e, scheduler)
            if lost is not None:  # said here, while the client still knows its scheduler: nothing left to cancel
                raise _scheduler_lost(out, len(plan), lost) from None
            client.cancel(futures)
            raise
        finally:
            bar.close()
        # a worker retired as the job ends (adapt scales down the idle ones) freed its replica by leaving
        client.run(release_scorers, on_error="ignore")
    seconds = time.perf_counter() - t0
    for started in clock.workers(preloads):  # the loads that ran beside the checks count as loads too
        load = max(load, started["load_seconds"])
        compile_s = max(compile_s, started["compile_seconds"])
    pio.remove_debris(opts.output)
    bad_total = pio.merge_errors(opts.output)
    # the last word on every part, before _SUCCESS vouches for them: the pages are read again only where a part's
    # stamp moved since it was checked (a resume's) or written (this run's)
    part_proof.confirm_parts(
        opts.output, part_proof.expected_parts(opts.identity, plan), _part_columns(inputs, opts), stamps
    )
    totals = _output_totals(opts.output, len(plan))
    result = ScoreResult(
        output=opts.output,
        run_rows=rows,
        run_tokens=tokens,
        parts=len(plan),
        parts_skipped=len(done),
        bad_rows=bad_total,
        seconds=seconds,
        scoring_seconds=max(scored_at - ready_at, 0.0),
        wall_phases=clock.steps(ready_at, ready_compile, scored_at),
        dashboard=getattr(client, "dashboard_link", None),
        prepare_seconds=clock.phases["checks"],
        started_at=clock.started_at,
        first_row_at=clock.first_row_at,
        wall_seconds=time.time() - clock.started_at,
        start_phases=dict(clock.phases),
        model_load_phases={**clock.config_imports, **clock.load_phases},
        model_load_seconds=load,
        compile_seconds=compile_s,
        phase_seconds=phases,
        parts_by_worker=by_worker,
        **totals,
    )
    if result.empty_rows:
        warn(
            f"{result.empty_rows} rows had nothing to score (an empty text, response or id list, or a single "
            "token): their num_scored is 0 and sum_logprob / mean_logprob / perplexity are null"
        )
    return result


def _pieces(span: spans.Span, inputs: pio.ScoreInputs, reads: list[Any]) -> tuple[list[Any], list[int], list[int]]:
    """A span's rows as the delayed reads of its row groups (a split group's slice cut where it is read, so that
    only the slice travels), with each piece's first row in the file and its row count."""
    import dask

    if not span.whole:
        (g,) = span.groups
        return (
            [dask.delayed(pio.slice_rows, pure=True)(reads[g], span.offset, span.num_rows)],
            [span.first_row],
            [span.num_rows],
        )
    groups = [inputs.partitions[g] for g in span.groups]
    return [reads[g] for g in span.groups], [first for _f, _g, first, _n in groups], [n for *_r, n in groups]


def _output_totals(output: str, parts: int) -> dict[str, Any]:
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
