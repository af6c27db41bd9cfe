"""A scoring job's driver once :func:`~dask_lm.scoring.job.score_parquet` has shown its bar (:func:`run`): the
output's lock and the cheap checks (:func:`plan_job`), the cluster's start beside the costly checks, the parts
scored and written, the summary. :mod:`dask_lm.scoring.job` says what the job does; this module imports what it
needs for that (pyarrow: tenths of a second), which is why the entry point imports it only once called; distributed
(a second or more) only once the output's lock is held, so that a second job on the same output is refused first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from dask_lm.data.continuation import describe
from dask_lm.engine.progress import JobBar
from dask_lm.errors import SchedulerLostError
from dask_lm.interface import again, current, opt, warn
from dask_lm.io import fingerprint, hub, modelcheck, part_proof
from dask_lm.io import parquet as pio
from dask_lm.io.manifest import read_manifest
from dask_lm.jobs import folder, interrupts, model_files
from dask_lm.jobs.output import JobKind, JobOutput
from dask_lm.jobs.resume import added_skip_bad_rows, spec_for
from dask_lm.jobs.start import (
    ClusterStart,
    in_thread,
    running,
    wait_for_checks,
    wait_for_workers,
    worker_precision,
)
from dask_lm.scoring import spans
from dask_lm.scoring.checks import check_score_model
from dask_lm.scoring.compile_choice import worth_compiling, worth_compiling_head
from dask_lm.scoring.preload import Preload
from dask_lm.scoring.result import ScoreResult, output_totals
from dask_lm.scoring.spec import ScoreSpec, row_columns
from dask_lm.scoring.start_clock import StartClock
from dask_lm.scoring.tasks import release_scorers, score_partition

if TYPE_CHECKING:
    from dask_lm.data.messages import ScoreOptions

__all__ = ["run", "PlannedJob", "plan_job"]

logger = logging.getLogger("dask_lm")


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
    and a resume's options and plan against the manifest it resumes. ``ValueError`` naming what is wrong. The
    output's lock is taken first (a second job on it is refused before anything else) and held by the returned job's
    ``out`` until ``out.close()``."""
    out = JobOutput.open(_KIND, list(spec.input), output, resume=resume, overwrite=overwrite)  # the lock, first
    try:
        return _plan(spec, out, resume=resume, revision=revision)
    except BaseException:
        out.close()  # refused: the lock released, and the folder it created removed
        raise


def _plan(spec: ScoreSpec, out: JobOutput, *, resume: bool, revision: str | None) -> PlannedJob:
    # distributed (the messages' serializers) loads once the lock is held: a second job is refused before it
    from dask_lm.data.messages import ScoreOptions  # lazy: a second second's import, after the lock

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
    inputs = pio.inspect_inputs(out.files, **spec.columns())
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
    totals = output_totals(output, parts)  # from the parts themselves: they are what the output holds
    return ScoreResult(
        output=output,
        parts=parts,
        parts_skipped=parts,
        bad_rows=int(summary.get("bad_rows") or 0),
        seconds=0.0,
        already_complete=True,
        **totals,
    )


def run(
    given: dict[str, Any],
    output: str | os.PathLike[str],
    *,
    client: Any,
    resume: bool,
    overwrite: bool,
    revision: str | None,
    progress: bool,
    performance_report: str | None,
    n_workers: int | None,
    scheduler_address: str | None,
    started: float,
    started_at: float,
    bar: JobBar,
) -> ScoreResult:
    """:func:`~dask_lm.scoring.job.score_parquet` once its bar is up: ``given`` is what the call gave (its spec's
    fields), ``started`` / ``started_at`` when it began (``perf_counter``, ``time.time``); ``bar`` is closed here."""
    try:
        # what the call gave, completed on a resume from the manifest, then from the spec's defaults; checked
        spec = spec_for(ScoreSpec, output, resume=resume, given=given)
        # 1. the output's lock, then the checks that cost no more than a few small reads, before anything starts
        job = plan_job(spec, output, resume=resume, overwrite=overwrite, revision=revision)
    except BaseException:
        bar.close()
        raise
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
    rows_checked = threading.Event()  # the workers' imports wait for the row check (ClusterStart: warm_after)
    start = ClusterStart(
        client,
        scheduler_address=scheduler_address,
        n_workers=n_workers,
        eager=not job.finished,
        warm=warm,
        warm_after=rows_checked,
    )
    try:
        return _pinned_run(
            start,
            warm,
            job,
            started,
            started_at,
            bar=bar,
            rows_checked=rows_checked,
            progress=progress,
            performance_report=performance_report,
        )
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the workers stopped at once, one line says what is kept
        start.close(interrupted=True)
        raise _interrupted(out, len(plan), e) from None
    except Exception as e:  # a lost scheduler: one line too, what is kept and how to go on
        # no remembered address here: by the time an error reaches this point the job may have closed its own
        # client, and a closed client must not read as a lost scheduler; the scoring loop names a loss it saw
        from dask_lm.engine import cluster  # lazy: distributed, loaded by now where a cluster was reached

        address = cluster.lost_scheduler(start.client, e)
        if address is None:
            raise
        raise _scheduler_lost(out, len(plan), address) from None
    finally:
        bar.close()
        start.close()
        out.close()


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
    bar: JobBar,
    rows_checked: threading.Event,
    progress: bool,
    performance_report: str | None,
) -> ScoreResult:
    """``score_parquet`` from the costly checks on, while ``start`` brings the cluster up: the config through
    transformers (asked of a worker, waited for in a thread) beside the row scan and the content hashes, then the
    manifest under the output's lock, then the run."""
    from dask_lm.engine.worker_group import scheduler_info
    from dask_lm.scoring import prescan  # lazy: its rows' messages load distributed, after the lock

    spec, out, source, inputs, plan, opts = job.spec, job.out, job.source, job.inputs, job.plan, job.opts

    scan = not job.finished and not opts.skip_bad_rows and sum(inputs.group_tokens) <= prescan.PRESCAN_MAX_TOKENS
    loads = in_thread(warm.check_config, start) if warm is not None else None
    # when each of the driver's own checks ended (perf_counter): the cheap ones (done by now), the rows, the hashes
    ended = {"cheap checks": time.perf_counter()}
    # every bad row of the job, found while the workers start (dask_lm.scoring.prescan), with the tokenizer alone
    vocab = modelcheck.stated_vocab(source.path)
    rows = in_thread(_timed(ended, "rows", prescan.refuse_bad_rows), inputs, plan, opts, vocab) if scan else None
    if rows is not None:  # passed: the cluster starts (refused: the job closes its start, which ends the wait)
        rows.add_done_callback(lambda f: None if f.exception() is not None else rows_checked.set())
    else:
        rows_checked.set()
    pinning = in_thread(_timed(ended, "hashes", job.manifest))
    # the first refusal is said as soon as it is known: a bad row does not wait for the workers' imports
    config = "checking the model's config on a worker (its imports of torch and transformers first)"
    checks = {"checking the rows": rows, "hashing the model and input files": pinning, config: loads}
    wait_for_checks(checks, start, bar, on_workers=(config,))
    manifest, pins = pinning.result()
    checked = loads.result() if loads is not None else {}  # transformers' ValueError naming config.json
    opts = replace(opts, model_pins=tuple(pins[: len(pins) - len(inputs.files)]))
    # the checks' time is the driver's own: the cluster's start and the worker's config check ran beside them, and
    # are the start's (StartClock: cluster_began / cluster_up / config_checked, and wall_phases' cluster_start)
    prepare_seconds = max(ended.values()) - started
    checks_passed = time.perf_counter() - started
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
        clock = StartClock(started, started_at, {"checks": prepare_seconds, "checks_passed": checks_passed})
        clock.config_check(checked)
        with running(start, total=inputs.num_rows, desc="scoring", unit="row", progress=progress, bar=bar) as (
            dask_client,
            bar,
        ):
            wait_for_workers(dask_client, bar)  # a scheduler whose workers are still to come
            clock.cluster_start(start.began_at, start.up_at)
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
            closed = bool(getattr(start.opened, "_dask_lm_owns_cluster", False))
            result = _run(
                dask_client, out, inputs, plan, opts, stamps, start.warm_futures, bar, performance_report, clock, closed
            )
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


def _timed(ended: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, noting in ``ended[name]`` when it ended (``perf_counter``; passed or refused)."""

    def timed(*args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            ended[name] = time.perf_counter()

    return timed


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
    own_cluster: bool = False,
) -> ScoreResult:
    """The parts scored and written; ``own_cluster``: the cluster closes as the job ends (its replicas go with it)."""
    import dask
    from distributed import as_completed, span

    from dask_lm.engine import cluster  # lazy: distributed loads after the output's lock (run's docstring)
    from dask_lm.engine.worker_group import scheduler_info
    from dask_lm.workers.state import PLUGIN_NAME, DaskLMWorkerState  # lazy: as the cluster module

    # with an id column, the output keeps only that one: read it and the scored ones, else every column
    columns = None if opts.id_column is None else sorted({opts.id_column, *row_columns(opts)})
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
            dask.delayed(score_partition, pure=False)(_span_rows(i, plan[i], inputs, reads), opts, progress_id)
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
        # a worker retired as the job ends (adapt scales down the idle ones) freed its replica by leaving; the
        # workers of the job's own cluster leave with theirs
        if not own_cluster:
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
    totals = output_totals(opts.output, len(plan))
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


def _span_rows(index: int, span: spans.Span, inputs: pio.ScoreInputs, reads: list[Any]) -> spans.SpanRows:
    """Part ``index``'s rows as the delayed reads of its row groups (a split group's slice cut where it is read, so
    that only the slice travels), with each piece's first row in the file and its row count."""
    import dask

    if not span.whole:
        (g,) = span.groups
        piece = dask.delayed(pio.slice_rows, pure=True)(reads[g], span.offset, span.num_rows)
        return spans.SpanRows(index, span.file, [piece], [span.first_row], [span.num_rows])
    groups = [inputs.partitions[g] for g in span.groups]
    firsts, counts = [first for _f, _g, first, _n in groups], [n for *_r, n in groups]
    return spans.SpanRows(index, span.file, [reads[g] for g in span.groups], firsts, counts)
