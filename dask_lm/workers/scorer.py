"""The worker half of offline scoring: a model replica per worker, and one task per input partition.

Scoring needs no collectives, so unlike a Policy it does not shard the model: each worker loads a full replica
once (cached in the worker's dask-lm plugin state, ``DaskLMWorkerState.scorers``, keyed by model and
precision) and scores whichever partition the scheduler hands it. Partitions therefore balance across GPUs by
themselves, and a partition whose worker dies is simply recomputed elsewhere; its part file is written under a
temporary name and renamed, so a retry replaces it and every row appears exactly once.

Inside a partition, rows are read and checked by :mod:`dask_lm.data.rows`, sorted longest first and cut into
micro-batches of at most ``batch_tokens`` tokens: on a GPU they are packed (real tokens only, varlen attention,
compiled decoder layers, as in a Policy's inference pass), elsewhere padded to the longest row; logprobs and top-k
come from the chunked head of :mod:`dask_lm.workers.logprobs`. A part whose logprobs are not all finite is not
written (NaN weights or an fp16 overflow would otherwise pass as scores) unless ``allow_nonfinite``.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from dask_lm.data.messages import ScoreOptions
from dask_lm.data.packing import longest_first
from dask_lm.data.rows import BadRowError, PreparedRows, prepare_rows
from dask_lm.errors import NonFiniteError
from dask_lm.interface import again, opt
from dask_lm.io.fingerprint import _RACY_NS, Stamp, verify
from dask_lm.workers import device, fused, liger_layers, varlen
from dask_lm.workers.inference import forward_rows
from dask_lm.workers.logprobs import next_token_logprobs_greedy, output_head, topk_logits
from dask_lm.workers.model_load import load_causal_lm

__all__ = ["ScoreOptions", "BadRowError", "NonFiniteError", "score_partition", "release_scorers", "preload_replica"]


class _Replica:
    last_used: float  # time.monotonic() of the last partition that picked it (set by _replica)
    stamps: dict[str, Stamp]  # a preloaded replica's files, settled and unchanged over its load (preload_replica)

    def __init__(self, model_dir: str, tokenizer_dir: str, precision: str, *, compile: bool = True,
                 compile_head: bool = False) -> None:
        t0 = time.perf_counter()
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one bar per worker would garble the job's own bar
        self.device = device.local_device()
        device.synchronize()  # CUDA initialised here, so that the load's own timing is the weights'
        t_weights = time.perf_counter()
        dtype = device.torch_dtype(precision)
        self.model = load_causal_lm(model_dir, dtype, self.device)
        device.synchronize()
        self.load_phases = {"imports_and_device": t_weights - t0, "weights": time.perf_counter() - t_weights}
        # the fast path of a Policy's inference pass: packed rows through varlen attention, compiled layers
        self.varlen = varlen.available(dtype) and self.model.config._attn_implementation == "sdpa"
        self.packed = self.varlen  # packing pays only with the varlen kernel (a dense [T, T] mask costs more)
        self.compiled = False
        self.tokenizer: transformers.PreTrainedTokenizerBase | None
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
            self.tokenizer_error: str | None = None
        except (OSError, ValueError, ImportError) as e:  # token-id input needs no tokenizer; text input says why
            self.tokenizer = None
            self.tokenizer_error = (f"the tokenizer in {tokenizer_dir} cannot be loaded on this worker: "
                                    f"{' '.join(str(e).split())}; install what it needs (e.g. sentencepiece) on the "
                                    "workers")  # the way on, naming an option, is added when raised
        cfg = self.model.config
        candidates = (getattr(self.tokenizer, "pad_token_id", None), getattr(self.tokenizer, "eos_token_id", None),
                      getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None))
        pad = next((v for v in candidates if isinstance(v, int)), 0)
        self.pad_id = int(pad)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        positions = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
        self.max_positions = int(positions) if positions else None  # None: the model has no position limit
        self.lock = threading.Lock()  # a worker with several threads runs one forward at a time per replica
        # what a job's cold start is made of (ScoreResult reports the longest over the workers): imports, CUDA
        # initialisation and the weights' load; then the compilation, paid here on two short rows so that no
        # partition's timing carries it
        self.load_seconds = time.perf_counter() - t0
        self.compile_seconds = 0.0
        self.fresh = True  # the first partition of this replica reports the two timings
        self.compile_requested = False
        self.head_compiled = False  # the head's fused reductions run compiled (_score_rows says why)
        # uncompiled layers' RMSNorms and SwiGLU products as liger's one-pass kernels (liger_layers.py says why);
        # compile() puts the class forwards back for Inductor to fuse
        t_liger = time.perf_counter()
        self.liger_layers = 0 if compile else liger_layers.patch(self.model)
        if self.liger_layers:
            self.load_phases["liger_layers"] = time.perf_counter() - t_liger
        if compile_head or compile:
            self.compile_head()
        if compile:
            self.compile()
        self.ready_at = time.time()  # wall clock: the driver compares it with its own (one host, or NTP-close)

    def compile_head(self) -> None:
        """Compile the head's fused reductions (on a GPU; a no-op elsewhere), paid here on two short rows."""
        if fused.enabled() and not self.head_compiled:
            t0 = time.perf_counter()
            self.head_compiled = True
            self._warm_up()
            self.compile_seconds += time.perf_counter() - t0
            self.ready_at = time.time()  # only when it compiled: an adopted replica's readiness is its load's

    def compile(self) -> None:
        """Compile the decoder layers, paid here on two short rows so that no partition's timing carries it."""
        self.compile_requested = True
        liger_layers.unpatch(self.model)
        if fused.compile_decoder_layers(self.model) > 0:
            t0 = time.perf_counter()
            _, self.compiled = fused.call(True, self._warm_up, "the scoring forward")
            self.compile_seconds += time.perf_counter() - t0
        # compiling is off here, or failed: the layers run eagerly, so with liger's kernels where they can
        self.liger_layers = 0 if self.compiled else liger_layers.patch(self.model)
        self.ready_at = time.time()

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Two short rows through the forward and head (no longer than the model's positions allow)."""
        n1, n2 = (min(n, self.max_positions or n) for n in (61, 37))
        x = (torch.arange(2 * n1).reshape(2, n1) % max(self.vocab_size - 3, 1) + 3).clamp(max=self.vocab_size - 1)
        x[1, n2:] = self.pad_id
        hidden, layout = forward_rows(self.model, x, torch.tensor([n1, n2]), packed=self.packed,
                                    varlen_ok=self.varlen, where=self.device)
        with fused.use_compiled(self.head_compiled):
            next_token_logprobs_greedy(hidden, layout.ids, layout.targets_valid, output_head(self.model),
                                       index=layout.scored)[0].cpu()


# one lock for the replica caches of this process: a worker with several threads loads a model once, and the
# lease check never frees a replica while a partition picks it
_CACHE_LOCK = threading.Lock()


def _replica(opts: ScoreOptions) -> _Replica:
    """This worker's replica for ``opts``, loaded on first use into the worker's dask-lm plugin state (or the one
    :func:`preload_replica` loaded while the driver checked, where it was loaded from the pinned bytes)."""
    from dask_lm.workers.state import get_state

    cache = get_state().scorers
    # the pins in the key: a replica of the same path loaded from other bytes (an earlier job's) is another model
    key = (opts.model, opts.tokenizer, opts.precision, opts.compile, opts.model_pins)
    with _CACHE_LOCK:
        rep = cache.get(key)
        if rep is None:
            preloaded = cache.pop(_preload_key(opts.model, opts.tokenizer, opts.precision), None)
            rep = _adopt(preloaded, opts)
            if preloaded is not None and rep is None:  # loaded from other bytes: its memory goes before the reload
                del preloaded
                _free()
        if rep is None:
            before = [verify(pin) for pin in opts.model_pins]
            rep = _Replica(opts.model, opts.tokenizer, opts.precision, compile=opts.compile,
                           compile_head=opts.compile_head)
            for pin, was in zip(opts.model_pins, before):  # written during the load: the weights may mix versions
                verify(pin, since=was)
        cache[key] = rep
        rep.last_used = time.monotonic()
        return rep


# ------------------------------------------------------------------------------------------- preloading
def _preload_key(model: str, tokenizer: str, precision: str) -> tuple:
    return ("preloaded", model, tokenizer, precision)


def _settled_stamps(directories: set[str], now_ns: int) -> dict[str, Stamp]:
    """The stamp of every file directly in ``directories`` whose last change is at least ``_RACY_NS`` old: a file
    changed within the filesystem clock's tick of ``now_ns`` could change again under the same stamp."""
    stamps: dict[str, Stamp] = {}
    for d in directories:
        with contextlib.suppress(OSError):
            for e in os.scandir(d):
                with contextlib.suppress(OSError):
                    if e.is_file():
                        st = e.stat()
                        s = Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                        if now_ns - max(s.mtime_ns, s.ctime_ns) >= _RACY_NS:
                            stamps[os.path.abspath(e.path)] = s
    return stamps


def preload_replica(model: str, tokenizer: str, precision: str | None, compile: bool, compile_head: bool = False
                    ) -> dict[str, Any]:
    """Load this worker's replica before the job's pins exist: ``score_parquet`` submits this to every worker
    as soon as the cluster is up, so that imports, CUDA initialisation, the weights' load and the compilation
    happen while the driver checks the inputs and hashes the files.

    The replica is adopted by the job's first partition only if every pinned file kept one settled stamp from
    before this load began, through its end, to the driver's hash (:func:`_adopt`): then the bytes loaded are the
    bytes pinned. Otherwise that partition loads the model again, as without a preload. ``precision`` ``None``
    is the worker's automatic one (as :func:`dask_lm.engine.jobs.worker_precision` decides it)."""
    from dask_lm.workers.state import get_state

    began = time.time()
    precision = precision or ("bfloat16" if device.is_cuda() else "float32")
    dirs = {os.path.abspath(model), os.path.abspath(tokenizer)}
    # under the cache lock, as _replica loads: a partition that starts meanwhile on another thread of this worker
    # waits for this replica instead of loading a second one beside it
    with _CACHE_LOCK:
        before = _settled_stamps(dirs, time.time_ns())
        try:
            rep = _Replica(model, tokenizer, precision, compile=compile, compile_head=compile_head)
        except Exception as e:  # a model the driver's checks will refuse, or one the job's first partition loads
            return {"error": f"{type(e).__name__}: {e}"}  # again and reports: not a failed task in the logs
        after = _settled_stamps(dirs, time.time_ns())
        rep.stamps = {p: s for p, s in before.items() if after.get(p) == s}
        rep.last_used = time.monotonic()  # an unadopted preload is freed by the lease check like any idle replica
        get_state().scorers[_preload_key(model, tokenizer, precision)] = rep
    # when this worker's start went where (wall clock, for ScoreResult.start_phases): its process began, this task
    # began (the worker up and registered, this module and torch imported), the replica was ready
    return {"load_seconds": rep.load_seconds, "compile_seconds": rep.compile_seconds, "precision": precision,
            "process_started_at": _process_started_at(), "began_at": began, "ready_at": rep.ready_at,
            "load_phases": rep.load_phases}


def _process_started_at() -> float | None:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil (it comes with distributed), or a platform without process times
        return None


def _adopt(rep: _Replica | None, opts: ScoreOptions) -> _Replica | None:
    """``rep`` (a preloaded replica) if it was loaded from the pinned bytes: each pinned file's settled stamp
    before and after its load is the stamp the driver hashed it under. ``None`` (load again) otherwise."""
    if rep is None or not opts.model_pins:
        return None
    for pin in opts.model_pins:
        if pin.racy or rep.stamps.get(pin.path) != pin.stamp:
            return None
    if opts.compile_head:  # before the layers: their warm-up then runs the compiled head too
        rep.compile_head()
    if opts.compile and not rep.compile_requested:  # the job chose to compile once it knew its size
        rep.compile()
    return rep


def _caches(dask_worker: Any = None) -> list[dict[tuple, Any]]:
    """The replica caches to look at: ``dask_worker``'s (``client.run`` and the lease check pass it), else the
    current task's worker's, else none (no worker: no replica)."""
    from distributed import get_worker

    from dask_lm.workers.state import PLUGIN_NAME

    if dask_worker is None:
        try:
            dask_worker = get_worker()
        except ValueError:
            return []
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return [plugin.scorers] if plugin is not None else []


def _free() -> None:
    """Give the freed replicas' memory back: their tensors go with the last reference, the allocator's cache with
    ``empty_cache``."""
    import gc

    gc.collect()
    device.empty_cache()


def release_idle(max_idle_s: float, dask_worker: Any = None) -> int:
    """Free replicas no partition has used for ``max_idle_s`` (the worker's lease check calls this). A job frees
    its replicas when it ends; a job whose driver died cannot, and its model must not hold the device for good."""
    now = time.monotonic()
    idle = 0
    with _CACHE_LOCK:
        for cache in _caches(dask_worker):
            keys = [k for k, rep in cache.items()
                    if now - getattr(rep, "last_used", now) > max_idle_s and not rep.lock.locked()]
            for k in keys:
                del cache[k]
            idle += len(keys)
    if idle:
        _free()
    return idle


def release_scorers(dask_worker: Any = None) -> int:
    """Free this worker's replicas (run with ``client.run`` when a job ends)."""
    with _CACHE_LOCK:
        caches = _caches(dask_worker)
        n = sum(len(c) for c in caches)
        for cache in caches:
            cache.clear()
    _free()
    return n


@torch.no_grad()
def _score_rows(rep: _Replica, ids: list[list[int]], opts: ScoreOptions, on_rows: Any = None
                ) -> tuple[list[torch.Tensor], list | None, list[bool], list[torch.Tensor]]:
    """Per row: logprobs (position 0 = 0), topk per position (ids, logprobs) when ``opts.topk``, whether every value
    is finite, and per position whether the token is the argmax of the model's distribution before it (bool, true
    at position 0). A row without tokens gets empty results without a forward. ``on_rows(k)``, if given, is told
    after each micro-batch how many rows have their results.

    The GPU never waits for the host between micro-batches: a micro-batch's results are copied to the host
    asynchronously and cut into rows only after the next micro-batch has been launched (one micro-batch of lag, as
    in a Policy's inference pass, :func:`dask_lm.workers.inference.run_pass`). Before, every micro-batch ended in a
    blocking copy, and the next one's host work (its tensor, its packed layout) left the GPU idle: 20% of a 0.5B
    scoring phase on an H200 (``benchmarks/profile_score.py --profile``)."""
    head = output_head(rep.model)
    out = _RowResults(len(ids), opts.topk)
    rows = [i for i in range(len(ids)) if ids[i]]
    pending: _Pending | None = None
    collected = 0
    for part in longest_first([len(ids[i]) for i in rows], opts.micro_batch_tokens(rep.packed),
                              padded=not rep.packed):
        batch = [rows[j] for j in part]
        width = len(ids[batch[0]])
        x = torch.full((len(batch), width), rep.pad_id, dtype=torch.int64)
        for r, i in enumerate(batch):
            x[r, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.int64)
        lens = torch.tensor([len(ids[i]) for i in batch])
        (hidden, layout), rep.compiled = fused.call(
            rep.compiled, lambda: forward_rows(rep.model, x, lens, packed=rep.packed, varlen_ok=rep.varlen,
                                               where=rep.device), "the scoring forward")
        # the head's fused reductions may be compiled where the decoder is not: the eager chain of max / sub / exp
        # / sum passes over [n, V] float32 logits was a third of a 0.5B scoring forward's GPU time, and their one
        # small graph compiles in seconds where the layers take ten (a job long enough chooses it, compile_head)
        with fused.use_compiled(rep.head_compiled):
            lp, is_max = next_token_logprobs_greedy(hidden, layout.ids, layout.targets_valid, head,
                                                    chunk_size=opts.chunk_size, index=layout.scored)
            values: tuple[torch.Tensor, ...] = (lp, is_max)
            if out.tops is not None:
                top_v, top_i = topk_logits(hidden, layout.valid, head, opts.topk, chunk_size=opts.chunk_size,
                                           normalize=True, index=layout.valid_index)
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


@dataclass
class _Pending:
    """A launched micro-batch whose results are on their way to the host."""

    batch: list[int]  # its rows (indices into _score_rows' ids)
    lens: torch.Tensor
    cu: torch.Tensor | None  # packed: the rows' offsets in the [1, T] results
    host: tuple[torch.Tensor, ...]  # logprobs, is_max (and top-k values, ids), host tensors being filled
    done: Any  # an event after the copies


class _RowResults:
    """_score_rows' results per row, cut out of each micro-batch's host tensors once their copies are done."""

    def __init__(self, n: int, topk: int) -> None:
        self.lps: list[Any] = [torch.zeros(0)] * n
        self.greedy: list[Any] = [torch.zeros(0, dtype=torch.bool)] * n
        empty_top = (torch.zeros(0, topk, dtype=torch.int32), torch.zeros(0, topk))
        self.tops: list[Any] | None = [empty_top] * n if topk else None
        self.finite = [True] * n

    def collect(self, p: _Pending, packed: bool) -> None:
        p.done.synchronize()  # this micro-batch's copies only: the next one keeps the GPU busy meanwhile
        lp, is_max = p.host[0], p.host[1]
        # each row's slice of the result: [1, T] packed (rows back to back) or [b, L] padded
        starts = p.cu.tolist() if packed and p.cu is not None else [0] * len(p.batch)
        for r, i in enumerate(p.batch):
            n = int(p.lens[r])
            row, col = (0, starts[r]) if packed else (r, 0)
            self.lps[i] = lp[row, col:col + n]
            self.greedy[i] = is_max[row, col:col + n]
            ok = bool(torch.isfinite(self.lps[i]).all())
            if self.tops is not None:
                self.tops[i] = (p.host[3][row, col:col + n], p.host[2][row, col:col + n])
                ok = ok and bool(torch.isfinite(self.tops[i][1]).all())
            self.finite[i] = ok


def _row_sums(lp: torch.Tensor, greedy: torch.Tensor, start: int
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


def _rows_reporter(progress_id: str | None, index: int, every_s: float = 0.5) -> Any:
    """``report(rows)``: part ``index``'s rows scored so far, as an event for the job's bar
    (:func:`dask_lm.workers.tasks.report_progress`), the first at once and then at most every ``every_s`` (an
    event per micro-batch would be hundreds a second on a GPU, each a message through the scheduler)."""
    from dask_lm.workers.tasks import report_progress

    last = -math.inf

    def report(rows: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            report_progress(progress_id, rows, part=index)

    return report


def score_partition(pieces: list[Any], firsts: list[int], counts: list[int], index: int, file: str,
                    opts: ScoreOptions, progress_id: str | None = None) -> dict[str, Any]:
    """Score one span of rows (:mod:`dask_lm.io.spans`) and write ``part-<index>.parquet`` (and its bad rows)
    atomically.

    ``pieces`` are the span's rows as read: consecutive row groups of ``file`` (or one group's slice), each a
    pandas frame of Arrow-backed columns starting at file row ``firsts[k]`` with ``counts[k]`` rows, or an
    :class:`~dask_lm.io.parquet.UnreadableRowGroup` where the group could not be decoded: then every row of it is a
    bad row. With ``progress_id``, the job's bar hears when the replica is ready and the rows begin, and how many
    are scored, about twice a second (:func:`_rows_reporter`)."""
    import pyarrow as pa

    from dask_lm.io import parquet as pio
    from dask_lm.io.results import decode_topk_column

    t0 = time.perf_counter()
    for piece, first, n in zip(pieces, firsts, counts):
        if not isinstance(piece, pio.UnreadableRowGroup) and len(piece) != n:
            raise RuntimeError(f"partition {index}: rows {first}.. of {file} came back as {len(piece)} rows, the "
                               f"footer says {n}: the reader split the dataset differently than planned")
    unreadable = [p for p in pieces if isinstance(p, pio.UnreadableRowGroup)]
    if unreadable and not opts.skip_bad_rows:
        raise BadRowError(f"{unreadable[0].message()}, or pass {opt('skip_bad_rows', True)} to leave its rows out")
    lost_rows = [r for g in unreadable for r in range(g.first_row, g.first_row + g.num_rows)]
    lost_errors = [g.message() for g in unreadable for _ in range(g.num_rows)]
    readable = [(p, first) for p, first in zip(pieces, firsts) if not isinstance(p, pio.UnreadableRowGroup)]
    if not readable:
        return _unreadable(unreadable[0].schema, lost_rows, lost_errors, index, file, opts, t0)
    rep = _replica(opts)
    with rep.lock:
        startup = {"load_seconds": rep.load_seconds, "compile_seconds": rep.compile_seconds,
                   "load_phases": rep.load_phases, "ready_at": rep.ready_at} if rep.fresh else {}
        rep.fresh = False
        report = _rows_reporter(progress_id, index)
        report(0)  # the replica is ready: the bar stops saying that the model loads
        if rep.tokenizer is None and (not opts.ids_column or opts.decode_topk):
            raise ValueError(f"{rep.tokenizer_error}, or pass {opt('tokenizer')}")
        t_rows = time.perf_counter()
        rows = PreparedRows([], [], [], [])
        row_no: list[int] = []  # each row's number in the file, for messages and _errors.parquet
        for frame, first in readable:
            got = prepare_rows(frame, opts, tokenizer=rep.tokenizer, vocab_size=rep.vocab_size,
                               max_positions=rep.max_positions, file=file, first_row=first)
            rows.ids += got.ids
            rows.start += got.start
            rows.truncated += got.truncated
            rows.errors += got.errors
            row_no += range(first, first + len(frame))
        t_model = time.perf_counter()
        bad = [i for i, e in enumerate(rows.errors) if e is not None]
        if bad and not opts.skip_bad_rows:
            more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
            raise BadRowError(f"{rows.errors[bad[0]]}{more}; fix the data, or {again(resume=True, skip_bad_rows=True)} "
                              "to leave bad rows out (the parts already written are kept)")
        keep = [i for i in range(len(row_no)) if rows.errors[i] is None]
        lps, tops, finite, greedy = _score_rows(rep, [rows.ids[i] for i in keep], opts,  # type: ignore[misc]
                                                report)
    t_write = time.perf_counter()
    nonfinite = [row_no[keep[j]] for j, ok in enumerate(finite) if not ok]
    if nonfinite and not opts.allow_nonfinite:
        # raised before anything is written: no part under its final name, so the job ends without _SUCCESS
        raise NonFiniteError(f"the model produced non-finite logprobs (NaN/inf) on {len(nonfinite)} of {len(keep)} "
                             f"rows of {file} (first: row {nonfinite[0]}): its weights may hold NaN/inf, or the "
                             f"precision overflows (try {opt('precision', 'fp32')}); pass "
                             f"{opt('allow_nonfinite', True)} to keep them")
    import pandas as pd

    pdf = readable[0][0] if len(readable) == 1 else pd.concat([f for f, _ in readable], ignore_index=True)
    source = pdf.iloc[keep]
    if opts.id_column is not None:
        source = source[[opts.id_column]]
    table = pa.Table.from_pandas(source.reset_index(drop=True), preserve_index=False)
    sums = [_row_sums(lps[j], greedy[j], rows.start[i]) for j, i in enumerate(keep)]
    counts = [len(rows.ids[i]) for i in keep]  # type: ignore[arg-type]
    values: dict[str, Any] = {
        "num_tokens": counts, "prompt_tokens": [min(rows.start[i], n) for i, n in zip(keep, counts)],
        "num_scored": [s[0] for s in sums], "truncated": [rows.truncated[i] for i in keep],
        "logprobs": _list_column(lps, pa.list_(pa.float32())), "sum_logprob": [s[1] for s in sums],
        "mean_logprob": [s[2] for s in sums], "perplexity": [s[3] for s in sums], "is_greedy": [s[4] for s in sums]}
    if tops is not None:
        values["topk_ids"] = _list_column([t[0] for t in tops], pa.list_(pa.list_(pa.int32())))
        values["topk_logprobs"] = _list_column([t[1] for t in tops], pa.list_(pa.list_(pa.float32())))
        if opts.decode_topk:  # here, where the tokenizer is loaded: the strings travel no further than the part
            with rep.lock:  # a fast tokenizer used by two threads at once may raise "Already borrowed"
                values["topk_tokens"] = decode_topk_column(rep.tokenizer, values["topk_ids"])
    for name, type_ in pio.output_schema_columns(opts.topk, opts.decode_topk):
        column = values[name]
        table = table.append_column(name, column if isinstance(column, pa.Array) else pa.array(column, type_))
    _refuse_if_cancelled(index)
    # the bad rows first: a part file under its final name is what --resume skips, so it must come last
    if bad or lost_rows:
        bad_errors = [e for e in rows.errors if e is not None]  # those of `bad`, in order
        listed = sorted(zip(lost_rows + [row_no[i] for i in bad], lost_errors + bad_errors))
        err = pio.errors_table(index, file, [r for r, _ in listed], [e for _, e in listed])
        pio.write_part(err, pio.errors_dir(opts.output), pio.part_name(index))
    pio.write_part(table, opts.output, pio.part_name(index))
    tokens = sum(counts)
    from distributed.metrics import context_meter

    context_meter.digest_metric("tokens", tokens, "count")  # summed per span on the dashboard
    return {"part": index, "rows": len(keep), "tokens": tokens, "bad_rows": len(bad) + len(lost_rows),
            "empty_rows": sum(1 for s in sums if s[0] == 0), "truncated_rows": sum(values["truncated"]),
            "nonfinite_rows": len(nonfinite), "seconds": time.perf_counter() - t0, **startup,
            # where a partition's time goes (ScoreResult.phase_seconds sums them over the job): reading and checking
            # the rows, the model (forwards, heads, results to the host), building and writing the output
            "phases": {"rows": t_model - t_rows, "model": t_write - t_model, "output": time.perf_counter() - t_write}}


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


def _unreadable(schema: Any, rows: list[int], errors: list[str], index: int, file: str, opts: ScoreOptions,
                t0: float) -> dict[str, Any]:
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
    pio.write_part(table, opts.output, pio.part_name(index))  # last: it marks the part done
    return {"part": index, "rows": 0, "tokens": 0, "bad_rows": len(rows), "empty_rows": 0, "truncated_rows": 0,
            "nonfinite_rows": 0, "seconds": time.perf_counter() - t0}
