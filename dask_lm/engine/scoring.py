"""Offline scoring of parquet datasets: ``score_parquet`` (the driver side of ``dask-lm score``).

The job: read a parquet dataset with ``dd.read_parquet(..., dtype_backend="pyarrow")`` (one partition per row
group), score each partition on whichever worker is free (:func:`dask_lm.workers.scorer.score_partition`, a
model replica per worker), and write ``part-NNNNN.parquet`` per partition, each atomically. ``_manifest.json``
(written first) pins the model (path and a fingerprint of its files), the options, the input files and the
dask-lm version; ``_SUCCESS`` (written last) marks a complete output. ``resume=True`` skips the parts already
there and refuses an output whose manifest does not match.

Everything that can be checked without reading rows is checked before any work starts: the input files exist and
are parquet with the needed columns and types, the model directory holds a config and weights, the output is new
(or resumable). A bad row found while scoring fails the job with a message naming file, row and column, unless
``skip_bad_rows`` (then it is listed in ``_errors.parquet``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from dask_lm.io import parquet as pio
from dask_lm.workers.scorer import ScoreOptions, release_scorers, score_partition

__all__ = ["score_parquet", "ScoreResult"]

logger = logging.getLogger("dask_lm")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class ScoreResult:
    """What a scoring job did; ``perplexity`` is the mean of the rows' perplexities (rows scored in this run only
    for ``rows`` / ``tokens`` / ``seconds``; every part of the output for ``perplexity``)."""

    output: str
    rows: int
    tokens: int
    parts: int
    parts_skipped: int
    bad_rows: int
    seconds: float
    perplexity: float
    dashboard: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def _repr_html_(self) -> str:
        from dask_lm.engine.reprs import table

        return table("dask-lm scoring job", None, self.summary())

    def summary(self) -> list[tuple[str, str]]:
        return [("rows", f"{self.rows:,}"), ("tokens", f"{self.tokens:,}"),
                ("tokens/s", f"{self.tokens_per_s:,.0f}"), ("perplexity", f"{self.perplexity:.3f}"),
                ("parts", f"{self.parts} ({self.parts_skipped} already done)"), ("bad rows", str(self.bad_rows)),
                ("output", self.output), ("dashboard", self.dashboard or "-")]


def _model_files(model: str) -> list[str]:
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is not a directory")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model!r} has no config.json: not a Hugging Face model directory")
    weights = sorted(f for f in os.listdir(model) if f.endswith(_WEIGHT_SUFFIXES) and not f.startswith("."))
    if not weights:
        raise ValueError(f"--model {model!r} has no weights (*.safetensors or pytorch_model*.bin)")
    return ["config.json", *weights]


def _fingerprint(model: str, files: list[str]) -> str:
    """sha256 over each model file's name, size, and first and last MiB: cheap, and changes with the weights."""
    h = hashlib.sha256()
    for name in files:
        path = os.path.join(model, name)
        size = os.path.getsize(path)
        h.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(2**20))
            if size > 2**21:
                f.seek(-(2**20), os.SEEK_END)
                h.update(f.read())
    return h.hexdigest()


def _check_mode(text_column: str | None, ids_column: str | None, prompt_column: str | None,
                response_column: str | None) -> None:
    modes = [m for m, on in (("--text-column", text_column), ("--ids-column", ids_column),
                              ("--prompt-column/--response-column", prompt_column or response_column)) if on]
    if len(modes) != 1:
        raise ValueError("give exactly one of --text-column, --ids-column, or --prompt-column with "
                         f"--response-column (got {modes or 'none'})")
    if (prompt_column is None) != (response_column is None):
        raise ValueError("--prompt-column and --response-column go together")


def _manifest(opts: ScoreOptions, inputs: pio.ScoreInputs, fingerprint: str) -> dict[str, Any]:
    from dask_lm import __version__

    options = {k: v for k, v in asdict(opts).items() if k not in ("output", "model", "tokenizer", "batch_tokens",
                                                                   "chunk_size")}
    return {"dask_lm_version": __version__, "model": opts.model, "model_fingerprint": fingerprint,
            "tokenizer": opts.tokenizer, "options": options,
            "inputs": [{"path": f, "size": os.path.getsize(f)} for f in inputs.files],
            "partitions": len(inputs.partitions)}


def _prepare_output(output: str, manifest: dict[str, Any], resume: bool) -> list[int]:
    """Create (or check, for resume) the output directory; the part indices already complete."""
    import json

    path = os.path.join(output, pio.MANIFEST)
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output!r} exists and is not a directory")
    existing = os.path.isdir(output) and [f for f in os.listdir(output) if not f.startswith(".")]
    if existing and not resume:
        raise ValueError(f"--output {output!r} already holds files; pass --resume to finish an interrupted job, or "
                         "choose a new directory")
    if resume and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diffs = [k for k in ("model", "model_fingerprint", "tokenizer", "options", "inputs", "partitions")
                 if old.get(k) != manifest.get(k)]
        if diffs:
            raise ValueError(f"--resume refused: {output} was written with different {', '.join(diffs)} "
                             f"(see {pio.MANIFEST}); score into a new directory instead")
    elif existing:
        raise ValueError(f"--resume refused: {output!r} has files but no {pio.MANIFEST}; it is not a dask-lm "
                         "scoring output")
    os.makedirs(pio.errors_dir(output), exist_ok=True)
    pio.write_json_atomic(manifest, path)
    if os.path.exists(os.path.join(output, pio.SUCCESS)):
        return list(range(manifest["partitions"]))
    return [i for i in range(manifest["partitions"]) if os.path.exists(os.path.join(output, pio.part_name(i)))]


def _partitions(inputs: pio.ScoreInputs, columns: list[str] | None) -> list[Any]:
    """One delayed pandas frame per row group, read by ``dd.read_parquet`` with Arrow-backed dtypes."""
    import dask
    import dask.dataframe as dd

    ddf = dd.read_parquet(inputs.files, dtype_backend="pyarrow", split_row_groups=True, columns=columns)
    if ddf.npartitions == len(inputs.partitions):
        return ddf.to_delayed()
    # a reader that grouped row groups differently: read exactly the planned row groups ourselves
    return [dask.delayed(_read_row_group)(f, g, columns) for f, g, _start, _n in inputs.partitions]


def _read_row_group(file: str, group: int, columns: list[str] | None) -> Any:
    import pandas as pd
    import pyarrow.parquet as pq

    return pq.ParquetFile(file).read_row_group(group, columns=columns).to_pandas(types_mapper=pd.ArrowDtype)


def _worker_has_gpu(client: Any) -> bool:
    from dask_lm.workers.tasks import rank_info

    infos = client.run(rank_info)
    return any(i.get("device") == "cuda" for i in infos.values())


def score_parquet(input: Any, output: str | os.PathLike, *, model: str | os.PathLike, client: Any = None,
                  text_column: str | None = None, ids_column: str | None = None, prompt_column: str | None = None,
                  response_column: str | None = None, id_column: str | None = None, topk: int = 0,
                  max_length: int | None = None, truncate: bool = False, batch_tokens: int = 16384,
                  precision: str | None = None, resume: bool = False, progress: bool = True,
                  skip_bad_rows: bool = False, tokenizer: str | os.PathLike | None = None,
                  performance_report: str | None = None, n_workers: int | None = None,
                  scheduler_address: str | None = None) -> ScoreResult:
    """Score every row of a parquet dataset with ``model``; see the module docstring for the output.

    ``input`` is a parquet file, a directory of them, a glob, or a list. Exactly one of ``text_column``,
    ``ids_column`` or ``prompt_column`` + ``response_column`` says what to score. ``client`` is a Dask client
    (default: ``connect(scheduler_address, n_workers=n_workers)``, started after the checks and closed here). ``precision`` defaults to bfloat16 on GPU workers and
    float32 on CPU ones. Raises ``ValueError`` for bad usage or input, before anything is written.
    """
    from dask_lm.engine.cluster import close, connect

    _check_mode(text_column, ids_column, prompt_column, response_column)
    if topk < 0 or (max_length is not None and max_length < 1) or batch_tokens < 1:
        raise ValueError("--topk must be >= 0, --max-length >= 1 and --batch-tokens >= 1")
    model = os.path.abspath(os.fspath(model))
    files = _model_files(model)
    tokenizer = os.path.abspath(os.fspath(tokenizer)) if tokenizer else model
    if not ids_column and not any(os.path.exists(os.path.join(tokenizer, f))
                                  for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ValueError(f"{tokenizer!r} has no tokenizer files; pass --tokenizer, or score token ids with --ids-column")
    output = os.path.abspath(os.fspath(output))
    inputs = pio.inspect_inputs(pio.resolve_input_files(input), text_column=text_column, ids_column=ids_column,
                                prompt_column=prompt_column, response_column=response_column, id_column=id_column)
    owns = client is None
    client = client or connect(scheduler_address, n_workers=n_workers)
    try:
        if precision in (None, "auto"):
            precision = "bfloat16" if _worker_has_gpu(client) else "float32"
        precision = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(precision, precision)
        if precision not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"--precision must be bf16, fp32 or fp16, got {precision!r}")
        opts = ScoreOptions(model=model, tokenizer=tokenizer, precision=precision, output=output,
                            text_column=text_column, ids_column=ids_column, prompt_column=prompt_column,
                            response_column=response_column, id_column=id_column, topk=topk, max_length=max_length,
                            truncate=truncate, batch_tokens=batch_tokens, skip_bad_rows=skip_bad_rows)
        done = _prepare_output(output, _manifest(opts, inputs, _fingerprint(model, files)), resume)
        return _run(client, inputs, opts, done, progress, performance_report)
    finally:
        if owns:
            close(client)


def _run(client: Any, inputs: pio.ScoreInputs, opts: ScoreOptions, done: list[int], progress: bool,
         performance_report: str | None) -> ScoreResult:
    import dask
    from distributed import as_completed, span
    from distributed import performance_report as perf_report

    columns = None
    if opts.id_column is not None:
        columns = sorted({c for c in (opts.id_column, opts.text_column, opts.ids_column, opts.prompt_column,
                                      opts.response_column) if c})
    todo = [i for i in range(len(inputs.partitions)) if i not in set(done)]
    parts = _partitions(inputs, columns)
    report = perf_report(filename=performance_report) if performance_report else contextlib.nullcontext()
    t0 = time.perf_counter()
    rows = tokens = bad = 0
    total_rows = sum(inputs.partitions[i][3] for i in todo)
    bar = _progress(total_rows, progress)
    with report, span("dask-lm/score"):
        tasks = [dask.delayed(score_partition, pure=False)(parts[i], i, inputs.partitions[i][0],
                                                           inputs.partitions[i][2], inputs.partitions[i][3], opts)
                 for i in todo]
        futures = client.compute(tasks)
        try:
            for fut in as_completed(futures):
                stats = fut.result()  # a bad row or a runtime failure raises here
                rows += stats["rows"]
                tokens += stats["tokens"]
                bad += stats["bad_rows"]
                if bar is not None:
                    bar.update(stats["rows"] + stats["bad_rows"])
                    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")
        except BaseException:
            client.cancel(futures)
            raise
        finally:
            if bar is not None:
                bar.close()
        client.run(release_scorers)
    seconds = time.perf_counter() - t0
    pio.remove_debris(opts.output)
    bad_total = pio.merge_errors(opts.output)
    result = ScoreResult(output=opts.output, rows=rows, tokens=tokens, parts=len(inputs.partitions),
                         parts_skipped=len(done), bad_rows=bad_total, seconds=seconds,
                         perplexity=_mean_perplexity(opts.output, len(inputs.partitions)),
                         dashboard=getattr(client, "dashboard_link", None))
    pio.write_json_atomic({k: v for k, v in asdict(result).items()}, os.path.join(opts.output, pio.SUCCESS))
    return result


def _mean_perplexity(output: str, parts: int) -> float:
    """The mean of the per-row perplexities over every part (resumed parts included; rows without a scored
    token, whose perplexity is NaN, left out)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total, count = 0.0, 0
    for i in range(parts):
        ppl = pq.read_table(os.path.join(output, pio.part_name(i)), columns=["perplexity"])["perplexity"]
        ppl = ppl.filter(pc.invert(pc.is_nan(ppl)))
        total += float(pc.sum(ppl).as_py() or 0.0)
        count += len(ppl)
    return total / count if count else float("nan")


def _progress(total: int, enabled: bool) -> Any:
    from dask_lm.engine.progress import progress_enabled

    if not (enabled and progress_enabled()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", desc="scoring", dynamic_ncols=True)
