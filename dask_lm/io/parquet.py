"""Parquet in and out for offline scoring: input discovery and checks, the output schema, atomic part files.

Nothing here touches CUDA or a model: the driver checks inputs with parquet metadata alone (no row is read), and
workers use the writers to publish each part under its final name only once it is complete.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dask_lm import interface
from dask_lm.errors import PartWriteError
from dask_lm.io import part_proof, safe_paths
from dask_lm.io.fingerprint import Pin, stamp, verify

__all__ = [
    "ScoreInputs",
    "resolve_input_files",
    "inspect_inputs",
    "part_name",
    "write_part",
    "write_json_atomic",
    "output_schema_columns",
    "UnreadableRowGroup",
    "slice_rows",
    "read_partition",
    "errors_table",
    "errors_dir",
    "make_errors_dir",
    "merge_errors",
    "remove_debris",
    "write_fix",
    "MANIFEST",
    "SUCCESS",
    "ERRORS",
]

MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
ERRORS = "_errors.parquet"
_ERRORS_DIR = "_errors"


@dataclass
class ScoreInputs:
    """The input dataset as the job sees it: files, and one partition per row group (file, group, first row)."""

    files: list[str]
    partitions: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(file, row group, first row of the group in its file, rows)."""
    schema: pa.Schema | None = None
    num_rows: int = 0
    scored_bytes: int = 0
    """Uncompressed bytes of the scored columns (text, ids, prompt + response) over every row group, from the
    footers."""
    group_tokens: list[float] = field(default_factory=list)
    """Each row group's tokens (of ``partitions``), from its footer: exact for an ids column, estimated for text.
    How a job sizes its tasks (:mod:`dask_lm.scoring.spans`) and decides whether compiling pays."""
    stamps: dict[str, Any] = field(default_factory=dict)
    """Each file's :class:`~dask_lm.io.fingerprint.Stamp` as its footer was read: the hash must be of the same
    bytes, or the partitions planned from the footer may not be the file's."""


def resolve_input_files(input: str | os.PathLike[str] | list[Any]) -> list[str]:
    """A parquet file, a directory of them (recursively), a glob, or a list of those: absolute paths, sorted
    within each item, each file once.

    Inside a directory, files and directories whose names start with ``_`` or ``.`` are skipped at every depth, as
    Dask and Spark skip them: they hold metadata (``_SUCCESS``, ``_delta_log/``), temporaries (``_temporary/``,
    ``.part.tmp-*``) or a job's own bookkeeping (``_errors/``), never rows. Symlinks are followed, to files and to
    directories alike (pyarrow's dataset discovery follows both, and a link is how a dataset is assembled from
    parts that live elsewhere; skipping one would drop its rows without a word). A directory reached a second way
    (a symlink loop, two links to one place) is walked once, and a file reached twice (by two links, two globs or
    a glob and a name) is read once: both with a warning naming the paths. A glob that matches a directory walks
    it, as the shell's expansion of the same pattern would pass it. A directory that cannot be listed is an error
    naming it, never a silent gap."""
    items = input if isinstance(input, (list, tuple)) else [input]
    files: list[str] = []
    for item in items:
        path = os.fspath(item)
        if any(c in path for c in "*?["):
            matched = sorted(glob.glob(path, recursive=True))
            if not matched:
                raise ValueError(f"input {path!r} matches no file")
            for m in matched:
                if os.path.isdir(m):
                    if not os.path.basename(m.rstrip(os.sep)).startswith(("_", ".")):
                        files.extend(sorted(_walk_parquet(m)))
                elif os.path.isfile(m):
                    files.append(m)
        elif os.path.isdir(path):
            found = sorted(_walk_parquet(path))
            if not found:
                raise ValueError(f"input directory {path!r} holds no .parquet files")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"input {path!r} does not exist")
    return _once([os.path.abspath(f) for f in files])


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)  # follows links: the file or directory itself
    return st.st_dev, st.st_ino


def _once(files: list[str]) -> list[str]:
    """``files`` without the second and later paths to one file (its rows would be scored twice)."""
    first: dict[tuple[int, int], str] = {}
    out, twice = [], []
    for f in files:
        ident = _identity(f)
        if ident in first:
            if f != first[ident]:  # the same path twice (``data/**`` matches a directory and its files) says nothing
                twice.append(f"{f} (= {first[ident]})")
        else:
            first[ident] = f
            out.append(f)
    if twice:
        shown = "; ".join(twice[:3]) + (f" and {len(twice) - 3} more" if len(twice) > 3 else "")
        interface.warn(f"{len(twice)} input paths lead to a file already in the input, each read once: {shown}")
    return out


def _walk_parquet(directory: str) -> list[str]:
    def unlistable(e: OSError) -> None:
        raise ValueError(
            f"input directory {e.filename} cannot be listed ({e.strerror}): its files would be left "
            "out; fix its permissions, or name the input files you mean"
        )

    found: list[str] = []
    walked: set[tuple[int, int]] = set()
    again: list[str] = []
    for root, dirs, names in os.walk(directory, onerror=unlistable, followlinks=True):
        ident = _identity(root)
        if ident in walked:  # a symlink loop, or a second link to a directory already walked: its files are in
            dirs[:] = []
            again.append(root)
            continue
        walked.add(ident)
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]  # pruned in place: os.walk never enters them
        found += [
            os.path.join(root, f)
            for f in names
            if f.endswith((".parquet", ".parq", ".pq")) and not f.startswith(("_", "."))
        ]
    if again:
        shown = ", ".join(again[:3]) + (f" and {len(again) - 3} more" if len(again) > 3 else "")
        interface.warn(
            f"{len(again)} directories of input {directory} are reached a second way (a symlink loop, or "
            f"two links to one directory), each walked once: {shown}"
        )
    return found


def _column_type(schema: pa.Schema, name: str, file: str) -> pa.DataType:
    if name not in schema.names:
        raise ValueError(f"{file}: column {name!r} is missing (columns: {schema.names})")
    return schema.field(name).type


def inspect_inputs(
    files: list[str],
    *,
    text_column: str | None,
    ids_column: str | None,
    prompt_column: str | None,
    response_column: str | None,
    id_column: str | None,
    prompt_length_column: str | None = None,
) -> ScoreInputs:
    """Read every file's footer: it must be parquet, hold the needed columns with the right types, and agree on
    the schema. Row groups become partitions. A file without rows adds none and is held to nothing but being
    parquet and naming the columns: its types may be anything (pandas writes an empty object column as ``null``)."""
    out = ScoreInputs(files=files)
    empty: list[tuple[str, pa.Schema]] = []
    for file in files:
        try:
            out.stamps[file] = stamp(file)
            meta = pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{file} is not a readable parquet file: {e}") from None
        schema = meta.schema_arrow
        if meta.metadata.num_rows == 0:
            empty.append((file, schema))
            continue
        if out.schema is None:
            out.schema = schema
        elif not schema.equals(out.schema):
            raise ValueError(
                f"{file} has schema {schema} but {files[0]} has {out.schema}; every input file needs "
                "the same columns and types"
            )
        start = 0
        scored = {c for c in (text_column, ids_column, prompt_column, response_column) if c}
        for g in range(meta.num_row_groups):
            group = meta.metadata.row_group(g)
            out.partitions.append((file, g, start, group.num_rows))
            start += group.num_rows
            columns = [
                group.column(j)
                for j in range(group.num_columns)
                if any(
                    group.column(j).path_in_schema == c or group.column(j).path_in_schema.startswith(c + ".")
                    for c in scored
                )
            ]
            out.scored_bytes += sum(c.total_uncompressed_size for c in columns)
            # an ids column's leaf values are its tokens, counted exactly by the footer; text is about 4 bytes of
            # (dictionary- or plain-encoded) data per token
            out.group_tokens.append(
                float(sum(c.num_values for c in columns))
                if ids_column is not None
                else sum(c.total_uncompressed_size for c in columns) / 4
            )
        out.num_rows += meta.metadata.num_rows
    for file, schema in empty:  # the columns must be there, whatever their type
        for name in (text_column, ids_column, prompt_column, response_column, prompt_length_column, id_column):
            if name is not None:
                _column_type(schema, name, file)
    if out.schema is None:  # no file has a row: nothing to score, nothing whose type matters
        out.schema = empty[0][1]
        return out
    first = next(f for f in files if f not in {e for e, _ in empty})
    for name in (text_column, prompt_column, response_column):
        if name is not None:
            t = _column_type(out.schema, name, first)
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
                raise ValueError(f"{first}: column {name!r} has type {t}; a text column must be string")
    if ids_column is not None:
        t = _column_type(out.schema, ids_column, first)
        if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
            raise ValueError(f"{first}: column {ids_column!r} has type {t}; an ids column must be list<int>")
    if prompt_length_column is not None:
        t = _column_type(out.schema, prompt_length_column, first)
        if not pa.types.is_integer(t):
            raise ValueError(
                f"{first}: column {prompt_length_column!r} has type {t}; a prompt-length column must be "
                "an integer column (how many leading ids of the row are context)"
            )
    if id_column is not None:
        _column_type(out.schema, id_column, first)
    for reserved in [name for name, _type in output_schema_columns(1, decode_topk=True)]:
        if id_column is None and reserved in out.schema.names:
            raise ValueError(
                f"{first}: input column {reserved!r} would collide with the output column of the same "
                f"name; pass {interface.opt('id_column')} to keep only an id column"
            )
    return out


def output_schema_columns(topk: int, decode_topk: bool = False) -> list[tuple[str, pa.DataType]]:
    """The columns scoring appends to the input's, in order. ``num_tokens`` and ``logprobs`` describe the row as
    the model saw it (after ``--truncate``): the prompt too, in prompt + response mode. ``prompt_tokens`` is where
    the scored tokens start: the tokens before the first scored one (the prompt's, or 1 for a text / ids row,
    whose first token has no context), so ``num_tokens == prompt_tokens + num_scored`` and the response's logprobs
    are ``logprobs[prompt_tokens:]``. ``num_scored`` counts the tokens in the sums, and where it is 0 the sums,
    mean and perplexity are null: an empty response scores no token, which is not a log-likelihood of 0.
    ``is_greedy`` is lm-evaluation-harness's: every scored token is the argmax of the model's distribution before
    it (greedy decoding would have produced the scored text); null where nothing is scored. With ``topk``,
    ``topk_ids`` / ``topk_logprobs`` at position t are the k most likely tokens after token t, and with
    ``decode_topk`` ``topk_tokens`` holds their strings, each id as ``tokenizer.decode([id])`` gives it."""
    cols = [
        ("num_tokens", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("num_scored", pa.int32()),
        ("truncated", pa.bool_()),
        ("logprobs", pa.list_(pa.float32())),
        ("sum_logprob", pa.float64()),
        ("mean_logprob", pa.float64()),
        ("perplexity", pa.float64()),
        ("is_greedy", pa.bool_()),
    ]
    if topk:
        cols += [("topk_ids", pa.list_(pa.list_(pa.int32()))), ("topk_logprobs", pa.list_(pa.list_(pa.float32())))]
        if decode_topk:
            cols.append(("topk_tokens", pa.list_(pa.list_(pa.string()))))
    return cols


@dataclass
class UnreadableRowGroup:
    """A row group whose pages cannot be decoded (the footer could): stands in for its rows, all of them bad."""

    file: str
    group: int
    first_row: int
    num_rows: int
    error: str
    schema: pa.Schema
    """The columns that were asked for, from the footer, so that an empty part keeps the output schema."""

    def message(self) -> str:
        last = self.first_row + self.num_rows - 1
        return (
            f"{self.file}: row group {self.group} (rows {self.first_row}-{last}) cannot be read: {self.error}; "
            "the file is damaged: re-create it"
        )


def slice_rows(part: Any, offset: int, num_rows: int) -> Any:
    """Rows ``offset .. offset + num_rows`` of a read row group (a pandas frame, or an :class:`UnreadableRowGroup`,
    which stays one for those rows): a split row group's span, cut where the group was read."""
    if isinstance(part, UnreadableRowGroup):
        return replace(part, first_row=part.first_row + offset, num_rows=num_rows)
    return part.iloc[offset : offset + num_rows].reset_index(drop=True)


def read_partition(
    file: str,
    group: int,
    first_row: int,
    num_rows: int,
    columns: list[str] | None,
    pin: Pin | None = None,
    caller: interface.Interface | None = None,
) -> Any:
    """Row group ``group`` of ``file`` as a pandas frame of Arrow-backed columns, or an :class:`UnreadableRowGroup`
    when its pages are corrupt.

    Reading here rather than in ``dd.read_parquet``'s task gives the error a location (a corrupt page raises
    "Couldn't deserialize thrift" with no file or row group), lets ``--skip-bad-rows`` list the row group's rows
    instead of failing the job, and verifies page checksums where the writer stored them, so a flipped byte in a
    value is found rather than scored. A file that is gone or whose footer broke since the checks is not a bad
    row: that raises. So does a file that no longer holds its ``pin``'s content, checked before the read (one
    ``stat`` while its stamp is unchanged) and after it (the stamp must not have moved during the read):
    :class:`~dask_lm.errors.InputChangedError`, naming the file and the fix as ``caller`` spells options (the job's
    interface: a worker process started apart from the command would speak Python)."""
    with interface.speaking(caller) if caller else contextlib.nullcontext():
        return _read_partition(file, group, first_row, num_rows, columns, pin)


def _read_partition(
    file: str, group: int, first_row: int, num_rows: int, columns: list[str] | None, pin: Pin | None
) -> Any:
    import pandas as pd

    before = verify(pin) if pin is not None else None
    f = pq.ParquetFile(file, page_checksum_verification=True)
    try:
        table = f.read_row_group(group, columns=columns)
    except (OSError, pa.ArrowException) as e:
        schema = f.schema_arrow
        if columns is not None:
            schema = pa.schema([schema.field(c) for c in columns])
        table = UnreadableRowGroup(file, group, first_row, num_rows, " ".join(str(e).split()), schema)
    if pin is not None:
        verify(pin, since=before)  # moved during the read: re-hashed, and refused if its bytes are not the pin's
    return table if isinstance(table, UnreadableRowGroup) else table.to_pandas(types_mapper=pd.ArrowDtype)


def errors_table(index: int, file: str, rows: list[int], errors: list[str]) -> pa.Table:
    """The bad rows of part ``index``: one row each (``part``, ``file``, ``row`` in its file, ``error``)."""
    return pa.table(
        {
            "part": pa.array([index] * len(rows), pa.int32()),
            "file": pa.array([file] * len(rows), pa.string()),
            "row": pa.array(rows, pa.int64()),
            "error": pa.array(errors, pa.string()),
        }
    )


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | safe_paths.NOFOLLOW)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_part(table: pa.Table, directory: str, name: str, proof: part_proof.PartProof | None = None) -> str:
    """Write ``table`` as ``directory/name``: a hidden temporary file first, then an atomic rename. With ``proof``
    the footer carries it (:mod:`dask_lm.io.part_proof`: what ``--resume`` checks before it keeps the part). An
    ``OSError`` (a full disk) becomes a :class:`~dask_lm.errors.PartWriteError` naming the part and the path
    (:func:`write_fix`); the temporary file is removed, and nothing appears under the final name."""
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with safe_paths.create_new(tmp) as sink:  # a new file, never through a link planted under its name
            if proof is None:
                pq.write_table(table, sink)
            else:
                part_proof.write(table, sink, proof)
        _fsync(tmp)
        os.replace(tmp, final)  # a retried partition replaces its own earlier copy: every row exactly once
    except BaseException as e:
        with contextlib.suppress(OSError):  # a temporary that cannot be removed must not hide why the write failed
            if os.path.lexists(tmp):
                os.remove(tmp)
        if isinstance(e, OSError) and not isinstance(e, PartWriteError):
            raise part_write_error(e, final) from e
        raise
    return final


def write_fix() -> str:
    """What a failed part write tells the user to do, as the caller spells it (:mod:`dask_lm.interface`: a worker
    task speaks as its job's caller). The parts written before it are complete (each renamed into place whole), so
    the job resumes where it stopped."""
    return (
        f"free space (or fix what the reason names), then {interface.again(resume=True)}; the parts already "
        "written are kept"
    )


def part_write_error(exc: OSError, path: str) -> PartWriteError:
    """``exc``, raised while writing the part file ``path``, as one line: which part, where, why, what to do."""
    reason = os.strerror(exc.errno) if exc.errno else (str(exc) or type(exc).__name__)
    part = os.path.basename(path)
    where = os.path.basename(os.path.dirname(path))
    shown = f"{where}/{part}" if where == _ERRORS_DIR else part  # the bad-row list of a part lies in _errors/
    return PartWriteError(exc.errno, f"could not write {shown} ({path}): {reason}; {write_fix()}")


def write_json_atomic(obj: Any, path: str) -> None:
    """``obj`` as JSON at ``path``: a new temporary file beside it (never opened through a link), synced, then
    renamed over ``path`` (which replaces a link there, never its target)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    with safe_paths.create_new(tmp) as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, default=str).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def errors_dir(output: str) -> str:
    return os.path.join(output, _ERRORS_DIR)


def make_errors_dir(output: str) -> str:
    """Create ``output/_errors`` if it is missing; ``ValueError`` naming it when it is a link (the parts' bad-row
    lists would be written, and debris deleted, wherever it points) or not a directory."""
    return safe_paths.own_dir(errors_dir(output))


def _errors_parts(d: str) -> list[str]:
    """The bad-row files in ``_errors`` (none when it is missing); ``ValueError`` naming ``_errors`` or a file
    in it that is a link: its rows are not the job's."""
    safe_paths.refuse_link(d)
    if not os.path.isdir(d):
        return []
    parts = sorted(f for f in os.listdir(d) if f.endswith(".parquet"))
    for f in parts:
        safe_paths.refuse_link(os.path.join(d, f))
    return parts


def merge_errors(output: str) -> int:
    """Gather the per-part bad-row files into ``_errors.parquet`` (atomically), keeping what an earlier, interrupted
    merge already put there (a resumed job); returns the number of bad rows in it."""
    import pyarrow.compute as pc

    d = errors_dir(output)
    parts = _errors_parts(d)
    merged = os.path.join(output, ERRORS)
    safe_paths.refuse_link(merged)
    tables = [pq.read_table(os.path.join(d, f)) for f in parts]
    if os.path.exists(merged):
        old = pq.read_table(merged)
        redone = pa.array(sorted({int(p) for t in tables for p in t.column("part").to_pylist()}), pa.int32())
        tables.insert(0, old.filter(pc.invert(pc.is_in(old.column("part"), value_set=redone))))
    if not parts:  # nothing new: what is merged already stands
        _remove_errors_dir(d)
        return int(tables[0].num_rows) if tables else 0
    table = pa.concat_tables(tables)
    write_part(table, output, ERRORS)
    _remove_errors_dir(d)
    return int(table.num_rows)


def _remove_errors_dir(d: str) -> None:
    with contextlib.suppress(OSError):  # merged already: a directory that will not go is left, not worth failing for
        safe_paths.remove(d)


def remove_debris(output: str) -> None:
    """Temporary files of writers that were killed mid-write (their partitions were redone elsewhere), in the
    output and in its ``_errors`` (a link there is refused, naming it: the files it leads to are not the job's).
    A link among them is removed as a link."""
    safe_paths.refuse_link(errors_dir(output))
    for root in (output, errors_dir(output)):
        if os.path.isdir(root):
            for f in os.listdir(root):
                if f.startswith(".") and ".tmp-" in f:
                    safe_paths.remove(os.path.join(root, f))
