"""What a job reads, resolved and pinned: the model's files and the tokenizer's (:func:`resolve_model`,
:func:`resolve_tokenizer`), the manifest that pins them with the input files (:func:`manifest`), the input rows
read one row group per task (:func:`located_partitions`); and a directory the job writes
whole (:func:`publishing`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from dask_lm.errors import InputChangedError
from dask_lm.interface import current, opt
from dask_lm.io import fingerprint, hub, modelcheck
from dask_lm.io import parquet as pio
from dask_lm.io.manifest import FORMAT

__all__ = ["resolve_model", "resolve_tokenizer", "manifest", "located_partitions", "publishing"]

# what AutoTokenizer needs at least one of; the other tokenizer files only complete these
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_model(
    model: str | os.PathLike[str], *, revision: str | None = None, load_config: bool = True
) -> tuple[hub.ModelSource, modelcheck.ModelInfo]:
    """Where ``model``'s files are (a Hub id becomes its cache snapshot, here, once) and what checking them found:
    damaged config or weight files are a ``ValueError`` naming the file."""
    source = hub.resolve_model(model, revision=revision)
    return source, modelcheck.check_model(source.path, load_config=load_config)


def resolve_tokenizer(
    tokenizer: str | os.PathLike[str] | None, model: str, *, fix: str | None, check: bool = True
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


def manifest(
    source: hub.ModelSource,
    info: modelcheck.ModelInfo,
    inputs: pio.ScoreInputs,
    options: dict[str, Any],
    *,
    tokenizer: str | None = None,
    **extra: Any,
) -> tuple[dict[str, Any], list[fingerprint.Pin]]:
    """``_manifest.json`` of a job: the format, the options and, by content, the model files, the files of a
    ``tokenizer`` directory apart from the model's, and the input files; ``extra`` entries are the job's own.
    Also the pins behind it (model and tokenizer files first, then the inputs), which the job checks its reads
    and its ``_SUCCESS`` against (:meth:`dask_lm.jobs.output.JobOutput.pin`)."""
    from dask_lm import __version__

    separate = tokenizer if tokenizer and tokenizer != source.path else None  # else its files are the model's
    entries, pins = fingerprint.job_pins(
        source.path,
        info.files,
        inputs.files,
        tokenizer=separate,
        tokenizer_files=modelcheck.tokenizer_files(separate) if separate else (),
    )
    for pin in pins[len(pins) - len(inputs.files) :]:
        if inputs.stamps.get(pin.path, pin.stamp) != pin.stamp:  # the footers planned are not the bytes hashed
            raise InputChangedError(
                f"{pin.path} changed between reading its footer and hashing it "
                "(something is writing it); run the job again once it is complete"
            )
    named = {"tokenizer": tokenizer} if tokenizer else {}
    return (
        {
            "format": FORMAT,
            "dask_lm_version": __version__,
            "model": source.path,
            **named,
            "options": options,
            **extra,
            **entries,
            "model_source": source.record(),
        },  # how the model was named: recorded, not compared
        pins,
    )


def located_partitions(inputs: pio.ScoreInputs, columns: list[str] | None, pins: list[fingerprint.Pin]) -> list[Any]:
    """One delayed read per planned row group whose failure names file and row group
    (:func:`dask_lm.io.parquet.read_partition`): ``dd.read_parquet``'s reader raises a corrupt page's error with
    neither, and inside its task nothing downstream can turn the error into bad rows for ``--skip-bad-rows``.
    Each read checks its file against the file's pin in ``pins`` first."""
    import dask

    by_path = {p.path: p for p in pins}
    caller = current()  # a file changed mid-job is reported in the caller's terms (--resume, resume=True)
    return [
        dask.delayed(pio.read_partition, pure=False)(f, g, start, n, columns, by_path[f], caller)
        for f, g, start, n in inputs.partitions
    ]


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
