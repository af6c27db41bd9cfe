"""The scaffold of a batch job over parquet: ``score`` (:mod:`dask_lm.scoring.job`), ``sft``
(:mod:`dask_lm.engine.sft`) and the jobs to come.

Every job's driver goes through the same steps, and this module owns each of them; a job's own module keeps its
options, the work itself and its summary:

1. :meth:`JobOutput.open`: the input files resolved, an output nested with them refused, and a first look at the
   output folder (:mod:`dask_lm.io.jobdir`): an occupied one without ``--resume`` / ``--overwrite`` is refused
   before the model is even resolved.
2. :func:`resolve_model`, :func:`resolve_tokenizer` and :func:`manifest`: the model files resolved and checked,
   and the manifest that pins them, the inputs (by content: :mod:`dask_lm.io.fingerprint`) and the options.
3. :meth:`JobOutput.locked`: the output's lock for the job's whole life. Under it the folder is looked at again,
   ``--overwrite`` clears the earlier job, a killed job's temporaries are deleted, :meth:`JobOutput.pin` writes
   the manifest or checks a resumed job against it, and :meth:`JobOutput.pin_precision` records an automatic
   precision once the workers are known.
4. :func:`running`: the Dask client (the caller's, or one connected here and closed at the end, with the local
   cluster it started) and the job's progress bar, with the dashboard's address above it.
5. :func:`located_partitions`: one read task per row group, whose failure names file and row group; the rows are
   tokenized on the workers by :func:`dask_lm.data.rows.tokenize_rows`, the one tokenization of every job.
6. :func:`publishing` for a directory that must appear whole (:func:`dask_lm.io.checkpoint.publish`: fsync'd,
   then renamed), and :meth:`JobOutput.finish`, which writes ``_SUCCESS`` last, once every pinned file is
   confirmed unchanged since the job hashed it (a file changed mid-job fails it instead, exit 1).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dask_lm.engine.progress import JobBar
from dask_lm.errors import InputChangedError
from dask_lm.interface import current, opt
from dask_lm.io import fingerprint, hub, jobdir, modelcheck
from dask_lm.io import parquet as pio

__all__ = ["JobKind", "JobOutput", "check_columns", "precision_name", "wait_for_workers", "worker_precision",
           "resolve_model", "resolve_tokenizer", "manifest", "ClusterStart", "in_thread", "running",
           "located_partitions", "publishing"]

_PRECISIONS = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_SHORT = {name: short for short, name in _PRECISIONS.items()}  # what --precision takes, for messages
# what AutoTokenizer needs at least one of; the other tokenizer files only complete these
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_columns(*, text_column: str | None, prompt_column: str | None, response_column: str | None,
                  ids_column: str | None = None, takes_ids: bool = True) -> None:
    """Exactly one way to read the rows: a text column, token ids (jobs that ``takes_ids``), or prompt + response."""
    modes = [(opt("text_column"), text_column), (f"{opt('prompt_column')} with {opt('response_column')}",
                                                 prompt_column or response_column)]
    if takes_ids:
        modes.insert(1, (opt("ids_column"), ids_column))
    given = [flag for flag, on in modes if on]
    if len(given) != 1:
        flags = [flag for flag, _ in modes]
        raise ValueError(f"give exactly one of {', '.join(flags[:-1])} or {flags[-1]} (got {given or 'none'})")
    if (prompt_column is None) != (response_column is None):
        raise ValueError(f"{opt('prompt_column')} and {opt('response_column')} go together")


def check_score_options(*, text_column: str | None, ids_column: str | None, prompt_column: str | None,
                        response_column: str | None, prompt_length_column: str | None, convention: str, topk: int,
                        decode_topk: bool, max_length: int | None, batch_tokens: int | None,
                        task_tokens: int | None = None) -> Any:
    """The scoring options' own checks, shared by ``score_parquet`` and ``dask_lm.score``: one way to read the
    rows, the convention, the numbers' ranges. Returns the convention."""
    from dask_lm.data.continuation import check_convention

    check_columns(text_column=text_column, ids_column=ids_column, prompt_column=prompt_column,
                  response_column=response_column)
    conv = check_convention(convention, opt("convention"))
    if prompt_length_column is not None and ids_column is None:
        raise ValueError(f"{opt('prompt_length_column')} goes with {opt('ids_column')} (prompt + response text has "
                         f"its prompt length from {opt('prompt_column')})")
    if topk < 0 or (task_tokens or 0) < 0 or any(v is not None and v < 1 for v in (max_length, batch_tokens)):
        counts = f"{opt('topk')} and {opt('task_tokens')} must be" if task_tokens is not None else \
            f"{opt('topk')} must be"
        raise ValueError(f"{counts} >= 0, {opt('max_length')} and {opt('batch_tokens')} >= 1")
    if decode_topk and not topk:
        raise ValueError(f"{opt('decode_topk', True)} decodes the top-k ids: it needs {opt('topk', meta='K')} (e.g. "
                         f"{opt('topk', 5)})")
    return conv


def check_score_model(model: str, *, topk: int, tokenizer: Any, ids_column: str | None, decode_topk: bool,
                      check_tokenizer: bool = True) -> tuple[modelcheck.ModelInfo, str]:
    """The model's files and ``topk`` against the vocabulary they state; the tokenizer scoring needs (none for token
    ids without ``decode_topk``), resolved. Returns what the files say of the model, and the tokenizer."""
    info = modelcheck.check_model(model, load_config=False)
    stated = modelcheck.stated_vocab(model)
    if stated is not None and topk > stated:
        raise ValueError(f"{opt('topk', topk)} is larger than the model's vocabulary ({stated} tokens, vocab_size "
                         f"in {os.path.join(model, modelcheck.CONFIG)}); pass {opt('topk', stated)} or less")
    return info, resolve_tokenizer(tokenizer, model, check=check_tokenizer,
                                   fix=None if ids_column and not decode_topk
                                   else f"pass {opt('tokenizer')}, or score token ids with {opt('ids_column')}"
                                   if not ids_column else f"{opt('decode_topk', True)} decodes with it: pass "
                                   f"{opt('tokenizer')}")


def precision_name(precision: str | None, allowed: tuple[str, ...] = ("bf16", "fp32", "fp16")) -> str | None:
    """The torch dtype name of ``--precision`` (``bf16`` or ``bfloat16``); ``None`` for auto, which the workers'
    devices decide once the cluster is up (:func:`worker_precision`)."""
    if precision in (None, "auto"):
        return None
    name = _PRECISIONS.get(precision, precision)
    if name not in [_PRECISIONS[a] for a in allowed]:
        raise ValueError(f"{opt('precision')} must be auto, {', '.join(allowed[:-1])} or {allowed[-1]}, got "
                         f"{precision!r}")
    return name


def wait_for_workers(client: Any, bar: JobBar | None = None) -> None:
    """Return once the scheduler has a worker: a job may be started against a scheduler whose workers come later
    (``dask worker`` processes still starting, an adaptive cluster scaled to zero). ``bar`` says so meanwhile. No
    timeout: the job cannot run without a worker, and the caller stops it (Ctrl-C) if none will come."""
    from dask_lm.engine.worker_group import scheduler_info

    if scheduler_info(client)["workers"]:
        return
    if bar is not None:
        address = getattr(getattr(client, "scheduler", None), "address", None)
        bar.wait(f"waiting for workers to join the scheduler{f' at {address}' if address else ''}")
    client.wait_for_workers(1)


def worker_precision(client: Any, bar: JobBar | None = None) -> str:
    """An automatic precision: bfloat16 when a worker has a GPU, else float32 (asked of the workers there are,
    once there is one: :func:`wait_for_workers`)."""
    from dask_lm.workers.tasks import rank_info

    while True:
        wait_for_workers(client, bar)
        # a worker that leaves while asked (retired, scaled down) answers with its connection's error: not counted
        infos = {w: i for w, i in client.run(rank_info, on_error="return").items() if not isinstance(i, OSError)}
        for i in infos.values():
            if isinstance(i, BaseException):
                raise i
        if infos:
            break
    return "bfloat16" if any(i.get("device") == "cuda" for i in infos.values()) else "float32"


def resolve_model(model: str | os.PathLike[str], *, revision: str | None = None, load_config: bool = True
                  ) -> tuple[hub.ModelSource, modelcheck.ModelInfo]:
    """Where ``model``'s files are (a Hub id becomes its cache snapshot, here, once) and what checking them found:
    damaged config or weight files are a ``ValueError`` naming the file."""
    source = hub.resolve_model(model, revision=revision)
    return source, modelcheck.check_model(source.path, load_config=load_config)


def resolve_tokenizer(tokenizer: str | os.PathLike[str] | None, model: str, *, fix: str | None, check: bool = True
                      ) -> str:
    """The tokenizer directory: ``tokenizer`` (a path or Hub id) or the model's own. ``fix`` ends the
    ``ValueError`` for a directory without tokenizer files; ``None`` when the job needs no tokenizer (token-id
    input), and nothing is checked. With ``check`` its JSON files must parse (a garbled one would fail on every
    worker instead)."""
    path = hub.resolve_model(tokenizer, what=opt("tokenizer")).path if tokenizer else model
    if fix is None:
        return path
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_MARKERS):
        raise ValueError(f"{path!r} has no tokenizer files; {fix}")
    if check:
        modelcheck.check_tokenizer(path)
    return path


def manifest(source: hub.ModelSource, info: modelcheck.ModelInfo, inputs: pio.ScoreInputs, options: dict[str, Any],
             *, tokenizer: str | None = None, **extra: Any) -> tuple[dict[str, Any], list[fingerprint.Pin]]:
    """``_manifest.json`` of a job: the format, the options and, by content, the model files, the files of a
    ``tokenizer`` directory apart from the model's, and the input files; ``extra`` entries are the job's own.
    Also the pins behind it (model and tokenizer files first, then the inputs), which the job checks its reads
    and its ``_SUCCESS`` against (:meth:`JobOutput.pin`)."""
    from dask_lm import __version__

    separate = tokenizer if tokenizer and tokenizer != source.path else None  # else its files are the model's
    entries, pins = fingerprint.job_pins(source.path, info.files, inputs.files, tokenizer=separate,
                                         tokenizer_files=modelcheck.tokenizer_files(separate) if separate else ())
    for pin in pins[len(pins) - len(inputs.files):]:
        if inputs.stamps.get(pin.path, pin.stamp) != pin.stamp:  # the footers planned are not the bytes hashed
            raise InputChangedError(f"{pin.path} changed between reading its footer and hashing it "
                                                "(something is writing it); run the job again once it is complete")
    named = {"tokenizer": tokenizer} if tokenizer else {}
    return ({"format": jobdir.FORMAT, "dask_lm_version": __version__, "model": source.path, **named,
             "options": options, **extra, **entries,
             "model_source": source.record()},  # how the model was named: recorded, not compared
            pins)


@dataclass(frozen=True)
class JobKind:
    """What the scaffold needs to know of one kind of job."""

    name: str
    """What an output holds, in messages: "scoring job", "sft run"."""
    did: str
    """Completes "--resume refused: OUTPUT was ... with different ...": "scored", "trained"."""
    owned: str
    """A regular expression for the job's own entries besides ``_manifest.json`` and ``_SUCCESS`` (what
    ``--overwrite`` may delete)."""
    debris: Callable[[str], Any]
    """Deletes, from the output, the temporaries a killed job left (called under the lock: nothing writes them)."""
    resume_hint: Callable[[], str] = str
    """Added to the advice for an unfinished output (rendered when refused: it may name an option)."""
    flags: dict[str, str] = field(default_factory=dict)
    """Option keys to the names users know them by, where not ``--key-with-dashes``."""


@dataclass
class JobOutput:
    """A job's output folder, from the first look at it to ``_SUCCESS``."""

    kind: JobKind
    path: str
    files: list[str]
    """The input files, resolved."""
    resume: bool
    overwrite: bool
    state: jobdir.OutputState
    pins: list[fingerprint.Pin] = field(default_factory=list)
    """What :meth:`pin` pinned: :meth:`finish` confirms every file still holds it."""
    created: bool = False
    """The output folder did not exist before this job: an interrupted job that kept nothing removes it."""
    settings: dict[str, Any] | None = None
    """How the job runs without changing what it writes (``--task-tokens``, ``--max-steps``, ...): recorded in the
    manifest by :meth:`pin`, not compared; what a later resume that is not given them takes
    (:mod:`dask_lm.engine.resumed`)."""

    @classmethod
    def open(cls, kind: JobKind, input: Any, output: str | os.PathLike[str], *, resume: bool, overwrite: bool
             ) -> JobOutput:
        """Resolve the inputs and look at the output without its lock: what the folder allows needs only its
        listing, so a refusal comes before the model is looked at (and again under the lock)."""
        path = os.path.abspath(os.fspath(output))
        files = pio.resolve_input_files(input)
        jobdir.check_output_location(path, input, files)
        out = cls(kind, path, files, resume, overwrite, jobdir.output_state(path, kind.owned),
                  created=not os.path.exists(path))
        out._refuse_occupied()
        jobdir.refuse_if_locked(path)  # another job writing there: said first, before the model is looked at
        return out

    def _refuse_occupied(self) -> None:
        jobdir.refuse_occupied(self.path, self.state, job=self.kind.name, resume=self.resume,
                               overwrite=self.overwrite, resume_hint=self.kind.resume_hint())

    @property
    def finished(self) -> bool:
        return os.path.exists(os.path.join(self.path, pio.SUCCESS))

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any] | None]:
        """Hold the output's lock for the block; yields the manifest of the job to resume, or ``None`` for a new
        output (an ``--overwrite`` one is emptied of the earlier job's files first)."""
        with jobdir.locked_output(self.path):
            self.state = jobdir.output_state(self.path, self.kind.owned)
            self._refuse_occupied()
            old = None
            if self.state.kind != "new" and self.overwrite:
                jobdir.clear_output(self.path, self.kind.owned)
            elif self.state.kind != "new":
                old = jobdir.read_manifest(self.path)
                assert old is not None  # output_state calls an output without one foreign
            self.kind.debris(self.path)
            try:
                yield old
            except KeyboardInterrupt:
                if old is None and not self.kept():  # a new job stopped before it kept anything: as if never run
                    jobdir.clear_output(self.path, self.kind.owned)
                    with contextlib.suppress(OSError):  # still ours: unlinked under the lock, which closes after
                        os.remove(os.path.join(self.path, jobdir.LOCK))
                    if self.created:
                        with contextlib.suppress(OSError):
                            os.rmdir(self.path)
                raise

    def kept(self) -> list[str]:
        """The job's own results in the output: its entries that are not empty folders (parts, checkpoints)."""
        regex = re.compile(self.kind.owned)
        names = [n for n in os.listdir(self.path) if regex.fullmatch(n)] if os.path.isdir(self.path) else []
        return sorted(n for n in names if not (os.path.isdir(os.path.join(self.path, n))
                                               and not os.listdir(os.path.join(self.path, n))))

    def pin(self, new: dict[str, Any], old: dict[str, Any] | None, pins: list[fingerprint.Pin], *,
            ignore: tuple[str, ...] = ()) -> dict[str, Any]:
        """Under the lock: write the manifest of a new output, or refuse (``ValueError``) to resume one whose
        pins differ from ``new`` (options in ``ignore`` aside). Returns the manifest in force. A precision that
        one side leaves automatic (``None``) is compared by :meth:`pin_precision` once the workers are known.
        ``pins`` are the files behind ``new`` as this run hashed them (equal to ``old``'s when it resumes).
        :attr:`settings` are recorded, a resume's replacing the old ones (another ``--max-steps``, for the next)."""
        self.pins = pins
        if self.settings is not None:
            new = {**new, "settings": self.settings}
        if old is None:
            self.write_manifest(new)
            return new
        if None in ((old.get("options") or {}).get("precision"), new["options"].get("precision")):
            ignore += ("precision",)
        jobdir.check_resume(old, new, output=self.path, what=self.kind.did, ignore=ignore, flags=self.kind.flags)
        if "settings" in new and new["settings"] != old.get("settings"):
            old = {**old, "settings": new["settings"]}
            self.write_manifest(old)
        return old

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Write ``manifest``, sealed (:func:`~dask_lm.io.jobdir.sealed`: a later hand edit is refused)."""
        pio.write_json_atomic(jobdir.sealed(manifest), os.path.join(self.path, pio.MANIFEST))

    def pin_precision(self, precision: str) -> None:
        """Record the precision the job runs in (an automatic one is known only once the cluster is up), or refuse
        a resume that would continue the job in another one (bf16 on GPUs resumed on CPUs in fp32, say)."""
        pinned = jobdir.read_manifest(self.path)
        assert pinned is not None, "pin_precision comes after pin"
        was = pinned["options"].get("precision")
        if was is None:
            pinned["options"]["precision"] = precision
            self.write_manifest(pinned)
        elif was != precision:
            raise ValueError(f"{opt('resume', True)} refused: {self.path} was {self.kind.did} in {was}, and these "
                             f"workers would run in {precision} ({opt('precision')} was {was}, now {precision}); "
                             f"resume on workers like the first run's or pass {opt('precision', _SHORT.get(was, was))}, "
                             f"or write into a new {opt('output')}")

    def reopen(self) -> None:
        """The job goes on (a resumed run given more steps): its output is no longer finished."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, pio.SUCCESS))

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``_SUCCESS`` (the job's summary): last, as it marks the output complete, and only once every
        pinned file (inputs, model, tokenizer) is confirmed to hold what the job pinned
        (:func:`~dask_lm.io.fingerprint.confirm_unchanged`: :class:`~dask_lm.errors.InputChangedError` else)."""
        fingerprint.confirm_unchanged(self.pins)
        pio.write_json_atomic(summary, os.path.join(self.path, pio.SUCCESS))


class ClusterStart:
    """The job's cluster, started (or reached) in a background thread as soon as the job knows it will run, so
    that starting worker processes, their imports and whatever ``warm`` submits to them (a model load) overlap
    the driver's checks and fingerprints. Nothing here writes to the output: a job refused by a later check
    calls :meth:`close`, which closes what was opened and cancels the warm-up.

    ``client`` is used as given (a Client, a Dask cluster or a scheduler address:
    :func:`~dask_lm.engine.cluster.as_client`); without one, ``connect(scheduler_address, n_workers=n_workers)``
    attaches to a scheduler or starts a local cluster. ``warm(client)`` returns the futures it submitted. With
    ``eager=False`` nothing starts until :meth:`result` is called."""

    def __init__(self, client: Any, *, scheduler_address: str | None, n_workers: int | None,
                 warm: Callable[[Any], list[Any]] | None = None, eager: bool = True) -> None:
        import threading

        remote = scheduler_address or os.environ.get("DASK_SCHEDULER_ADDRESS")
        self.waiting = ("asking the workers about their devices" if client is not None else
                        "connecting to the cluster" if remote else "starting a local cluster")
        self._given, self._address, self._n_workers, self._warm = client, scheduler_address, n_workers, warm
        self.client: Any = None
        self.opened: Any = None  # what this start opened, and so closes
        self.warm_futures: list[Any] = []
        self.seconds = 0.0  # the start itself: processes spawned and registered, or the scheduler reached
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="dask-lm-cluster-start", daemon=True)
        if eager:  # else only when result() asks (a job that may turn out to need no cluster)
            self._thread.start()

    def _start(self) -> None:
        import time

        from dask_lm.engine import cluster

        t0 = time.perf_counter()
        try:
            if self._given is None:
                self.opened = self.client = cluster.connect(self._address, n_workers=self._n_workers)
            else:
                self.client = cluster.as_client(self._given)
                self.opened = self.client if self.client is not self._given else None
            self.seconds = time.perf_counter() - t0
            if self._warm is not None:
                self.warm_futures = self._warm(self.client)
        except BaseException as e:  # re-raised in the driver's thread by result()
            self._error = e

    def result(self) -> Any:
        """The client, once started (re-raising what the start raised)."""
        if self._thread.ident is None:
            self._thread.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.client

    def close(self, *, interrupted: bool = False) -> None:
        """The job will not run: cancel the warm-up and close what this start opened (a given client stays).
        ``interrupted`` (Ctrl-C, SIGTERM): a local cluster's worker processes are killed first rather than
        drained (a graceful close takes 3-4 s), as what they hold is written already or lost anyway: every part
        is written under a temporary name and renamed, so a killed task leaves only debris that resume removes."""
        from dask_lm.engine import cluster

        if self._thread.ident is None:  # never started
            return
        self._thread.join()
        with contextlib.suppress(Exception):
            if self.warm_futures:
                self.client.cancel(self.warm_futures)
            if self.opened is not None:
                if interrupted:
                    cluster.kill_local_workers(self.opened)
                cluster.close(self.opened)
                self.opened = None


def in_thread(fn: Any, *args: Any) -> Future[Any]:
    """``fn(*args)`` in a daemon thread, as a future: a check the job no longer waits for (a Ctrl-C, a refusal
    by the other check) does not hold the process's exit, as a pool's threads would (an import of transformers
    cannot be interrupted, and the interpreter joins a ThreadPoolExecutor's threads at exit)."""
    fut: Future[Any] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # re-raised in the driver's thread by result()
            fut.set_exception(e)

    threading.Thread(target=run, name="dask-lm-check", daemon=True).start()
    return fut


@contextlib.contextmanager
def running(start: ClusterStart, *, total: int, desc: str, unit: str, progress: bool
            ) -> Iterator[tuple[Any, JobBar]]:
    """The job's Dask client (from ``start``) and progress bar (:class:`~dask_lm.engine.progress.JobBar`) for
    the block. What ``start`` opened is closed when the block ends, the local cluster included; a client the
    caller gave stays open."""
    bar = JobBar(total, desc, unit, start.waiting, enabled=progress)
    try:
        client = start.result()
        if getattr(client, "dashboard_link", None):
            bar.write(f"dask-lm: watch the job on the Dask dashboard at {client.dashboard_link}")
        yield client, bar
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: a local cluster's workers are stopped at once, not drained
        bar.close()
        start.close(interrupted=True)
        raise
    finally:
        bar.close()
        start.close()


def located_partitions(inputs: pio.ScoreInputs, columns: list[str] | None, pins: list[fingerprint.Pin]
                       ) -> list[Any]:
    """One delayed read per planned row group whose failure names file and row group
    (:func:`dask_lm.io.parquet.read_partition`): ``dd.read_parquet``'s reader raises a corrupt page's error with
    neither, and inside its task nothing downstream can turn the error into bad rows for ``--skip-bad-rows``.
    Each read checks its file against the file's pin in ``pins`` first."""
    import dask

    by_path = {p.path: p for p in pins}
    caller = current()  # a file changed mid-job is reported in the caller's terms (--resume, resume=True)
    return [dask.delayed(pio.read_partition, pure=False)(f, g, start, n, columns, by_path[f], caller)
            for f, g, start, n in inputs.partitions]


@contextlib.contextmanager
def publishing(final: str) -> Iterator[str]:
    """A fresh temporary directory beside ``final`` to write into; when the block ends it becomes ``final``
    (fsync'd, then renamed: :func:`dask_lm.io.checkpoint.publish`, which replaces an earlier ``final`` only
    afterwards), or is deleted when the block raises. ``final`` never holds a partial directory."""
    from dask_lm.io import checkpoint  # imports torch: only the jobs that publish directories need it

    tmp = checkpoint.temporary_sibling(final)
    os.makedirs(tmp)
    try:
        yield tmp
        checkpoint.publish(tmp, final)
    except BaseException:
        checkpoint.discard(tmp)
        raise
