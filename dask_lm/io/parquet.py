"""Parquet in and out for offline scoring: input discovery and checks, the output schema, atomic part files.

Nothing here touches CUDA or a model: the driver checks inputs with parquet metadata alone (no row is read), and
workers use the writers to publish each part under its final name only once it is complete.
"""

from __future__ import annotations

import glob
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ScoreInputs", "resolve_input_files", "inspect_inputs", "part_name", "write_part", "write_json_atomic",
           "output_schema_columns", "errors_dir", "merge_errors", "remove_debris", "MANIFEST", "SUCCESS", "ERRORS"]

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


def resolve_input_files(input: str | os.PathLike | list) -> list[str]:
    """A parquet file, a directory of them (recursively), a glob, or a list of those: sorted absolute paths."""
    items = input if isinstance(input, (list, tuple)) else [input]
    files: list[str] = []
    for item in items:
        path = os.fspath(item)
        if any(c in path for c in "*?["):
            matched = sorted(glob.glob(path, recursive=True))
            if not matched:
                raise ValueError(f"input {path!r} matches no file")
            files.extend(m for m in matched if os.path.isfile(m))
        elif os.path.isdir(path):
            found = sorted(os.path.join(root, f) for root, _dirs, names in os.walk(path) for f in names
                           if f.endswith((".parquet", ".parq", ".pq")) and not f.startswith(("_", ".")))
            if not found:
                raise ValueError(f"input directory {path!r} holds no .parquet files")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"input {path!r} does not exist")
    return [os.path.abspath(f) for f in files]


def _column_type(schema: pa.Schema, name: str, file: str) -> pa.DataType:
    if name not in schema.names:
        raise ValueError(f"{file}: column {name!r} is missing (columns: {schema.names})")
    return schema.field(name).type


def inspect_inputs(files: list[str], *, text_column: str | None, ids_column: str | None, prompt_column: str | None,
                   response_column: str | None, id_column: str | None) -> ScoreInputs:
    """Read every file's footer: it must be parquet, hold the needed columns with the right types, and agree on
    the schema. Row groups become partitions."""
    out = ScoreInputs(files=files)
    for file in files:
        try:
            meta = pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{file} is not a readable parquet file: {e}") from None
        schema = meta.schema_arrow
        if out.schema is None:
            out.schema = schema
        elif not schema.equals(out.schema):
            raise ValueError(f"{file} has schema {schema} but {files[0]} has {out.schema}; every input file needs "
                             "the same columns and types")
        start = 0
        for g in range(meta.num_row_groups):
            n = meta.metadata.row_group(g).num_rows
            out.partitions.append((file, g, start, n))
            start += n
        out.num_rows += meta.metadata.num_rows
    assert out.schema is not None
    first = files[0]
    for name in (text_column, prompt_column, response_column):
        if name is not None:
            t = _column_type(out.schema, name, first)
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
                raise ValueError(f"{first}: column {name!r} has type {t}; a text column must be string")
    if ids_column is not None:
        t = _column_type(out.schema, ids_column, first)
        if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
            raise ValueError(f"{first}: column {ids_column!r} has type {t}; an ids column must be list<int>")
    if id_column is not None:
        _column_type(out.schema, id_column, first)
    for reserved in ("num_tokens", "logprobs", "sum_logprob", "mean_logprob", "perplexity", "topk_ids",
                     "topk_logprobs"):
        if id_column is None and reserved in out.schema.names:
            raise ValueError(f"{first}: input column {reserved!r} would collide with the output column of the same "
                             "name; pass --id-column to keep only an id column")
    return out


def output_schema_columns(topk: int) -> list[tuple[str, pa.DataType]]:
    cols = [("num_tokens", pa.int32()), ("logprobs", pa.list_(pa.float32())), ("sum_logprob", pa.float64()),
            ("mean_logprob", pa.float64()), ("perplexity", pa.float64())]
    if topk:
        cols += [("topk_ids", pa.list_(pa.list_(pa.int32()))), ("topk_logprobs", pa.list_(pa.list_(pa.float32())))]
    return cols


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_part(table: pa.Table, directory: str, name: str) -> str:
    """Write ``table`` as ``directory/name``: a hidden temporary file first, then an atomic rename."""
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        pq.write_table(table, tmp)
        _fsync(tmp)
        os.replace(tmp, final)  # a retried partition replaces its own earlier copy: every row exactly once
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return final


def write_json_atomic(obj: Any, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def errors_dir(output: str) -> str:
    return os.path.join(output, _ERRORS_DIR)


def merge_errors(output: str) -> int:
    """Gather the per-part bad-row files into ``_errors.parquet`` (atomically); returns the number of bad rows."""
    import shutil

    d = errors_dir(output)
    parts = sorted(f for f in os.listdir(d) if f.endswith(".parquet")) if os.path.isdir(d) else []
    if not parts:
        shutil.rmtree(d, ignore_errors=True)
        return 0
    table = pa.concat_tables([pq.read_table(os.path.join(d, f)) for f in parts])
    write_part(table, output, ERRORS)
    shutil.rmtree(d, ignore_errors=True)
    return table.num_rows


def remove_debris(output: str) -> None:
    """Temporary files of writers that were killed mid-write (their partitions were redone elsewhere)."""
    for root in (output, errors_dir(output)):
        if os.path.isdir(root):
            for f in os.listdir(root):
                if f.startswith(".") and ".tmp-" in f:
                    os.remove(os.path.join(root, f))
