"""A table or parquet file someone shared runs no code: nothing dask-lm reads from Arrow is unpickled, whatever the
field metadata asks for. Columns Arrow cannot store as data still travel inside Dask's own channel (a Shard carries
them beside its table), where workers already trust their peers.

The hostile file is written with plain pyarrow: a binary column whose dask-lm metadata says "pickle" and holds a
pickle that would create a marker file when loaded, and a field that names pyarrow's old pickled extension type
(``arrow.py_extension_type``, whose metadata older pyarrow unpickled on read). Every check looks for the marker.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from packaging.version import Version

import dask_lm
import dask_lm.data.arrow
from dask_lm.data import messages


class _CreatesMarker:
    """A pickle that creates a file when unpickled: proof that a process deserialised it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


TEXTS = ["the cat sat on the mat", "a dog ran in the park", "dask runs tasks", "tokens become logprobs"]


def _payload(marker) -> bytes:
    """The pickle, after checking that loading it does create the marker (so a marker left absent means the pickle
    was not loaded, not that it was harmless)."""
    payload = pickle.dumps(_CreatesMarker(str(marker)))
    pickle.loads(payload).close()
    assert marker.exists(), "the hostile pickle should create the marker when loaded"
    marker.unlink()
    return payload


@pytest.fixture()
def hostile(tmp_path):
    """(parquet path, marker path): a batch-like file (``input_ids``, ``text``) with both hostile columns."""
    marker = tmp_path / "the-pickle-ran"
    payload = _payload(marker)
    n = len(TEXTS)
    schema = pa.schema(
        [
            pa.field("id", pa.int64()),
            pa.field("text", pa.string()),
            pa.field("input_ids", pa.list_(pa.int32())),
            pa.field("evil", pa.binary(), metadata={b"dask_lm": json.dumps({"kind": "pickle"}).encode()}),
            pa.field(
                "evil_ext",
                pa.binary(),
                metadata={b"ARROW:extension:name": b"arrow.py_extension_type", b"ARROW:extension:metadata": payload},
            ),
        ]
    )
    table = pa.Table.from_arrays(
        [
            pa.array(range(n)),
            pa.array(TEXTS),
            pa.array([[5, 6, 7]] * n, pa.list_(pa.int32())),
            pa.array([payload] * n),
            pa.array([payload] * n),
        ],
        schema=schema,
    )
    path = tmp_path / "hostile.parquet"
    pq.write_table(table, path)
    # the file really carries the metadata: parquet keeps field metadata (in its stored Arrow schema)
    read = pq.read_table(path).schema
    assert json.loads(read.field("evil").metadata[b"dask_lm"]) == {"kind": "pickle"}
    assert read.field("evil_ext").metadata[b"ARROW:extension:metadata"] == payload
    assert not marker.exists()
    return path, marker


ENTRY_POINTS = {
    "BatchedDataDict.from_arrow": lambda t: dask_lm.BatchedDataDict.from_arrow(t),
    "dask_lm.data.arrow.from_arrow": lambda t: dask_lm.data.arrow.from_arrow(t),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_column_marked_pickle_is_refused_never_unpickled(entry, hostile):
    path, marker = hostile
    with pytest.raises(ValueError) as e:
        ENTRY_POINTS[entry](pq.read_table(path))
    message = str(e.value)
    assert "'evil'" in message and "never unpickles" in message and "could run code" in message, message
    assert "re-encode the batch with this dask-lm's to_arrow" in message and "drop the column" in message
    assert not marker.exists()
    # the fix the message names: without the column, the rest of the file reads as data
    rows = ENTRY_POINTS[entry](pq.read_table(path, columns=["id", "text", "input_ids"]))
    assert rows["text"] == TEXTS and rows["input_ids"].tolist() == [[5, 6, 7]] * len(TEXTS)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_pyarrows_pickled_extension_type_is_not_loaded(entry, hostile):
    """pyarrow >= 14.0.1 no longer unpickles ``arrow.py_extension_type`` metadata (CVE-2023-47248); the field reads
    as its storage type with the metadata left as bytes, and dask-lm sees a foreign binary column."""
    path, marker = hostile
    assert Version(pa.__version__) >= Version("14.0.1")
    table = pq.read_table(path, columns=["input_ids", "evil_ext"])
    assert table.schema.field("evil_ext").type == pa.binary()  # not an extension type: nothing was deserialised
    assert not marker.exists()
    rows = ENTRY_POINTS[entry](table)
    assert rows["evil_ext"] == [pickle.dumps(_CreatesMarker(str(marker)))] * len(TEXTS)  # bytes, as data
    assert not marker.exists()
    # pandas, as the batch jobs read their partitions (Arrow-backed columns)
    import pandas as pd

    frame = pq.ParquetFile(path).read_row_group(0).to_pandas(types_mapper=pd.ArrowDtype)
    assert list(frame.columns) == ["id", "text", "input_ids", "evil", "evil_ext"]
    assert not marker.exists()


def _table_with(field_meta: bytes, column: pa.Array) -> pa.Table:
    schema = pa.schema(
        [pa.field("input_lengths", pa.int64()), pa.field("x", column.type, metadata={b"dask_lm": field_meta})]
    )
    return pa.Table.from_arrays([pa.array([1, 2]), column], schema=schema)


@pytest.mark.parametrize(
    "meta, column, why",
    [
        (b'{"kind": "pickle"}', pa.array([b"a", b"b"]), "never unpickles"),
        (b'{"kind": "cloudpickle"}', pa.array([b"a", b"b"]), "kind 'cloudpickle' is not one this dask-lm reads"),
        (b'{"kind": "tensor", "dtype": "object", "shape": [2]}', pa.array([1, 2]), "tensor dtype 'object'"),
        (b'{"kind": "tensor", "shape": [2]}', pa.array([1, 2]), "tensor dtype None"),
        (b'{"kind": "tensor", "dtype": "int64", "shape": "2"}', pa.array([1, 2]), "shape '2'"),
        (b"{not json", pa.array([1, 2]), "not a JSON object with a 'kind'"),
        (b'["pickle"]', pa.array([1, 2]), "not a JSON object with a 'kind'"),
        (b'{"kind": 3}', pa.array([1, 2]), "not a JSON object with a 'kind'"),
        (b'{"kind": "json"}', pa.array(["[1]", "{oops"], pa.large_string()), "a row is not JSON"),
        (b'{"kind": "json"}', pa.array([b"1", b"2"]), "a JSON column holds strings"),
    ],
)
def test_metadata_asking_for_anything_but_data_is_refused_naming_the_column(meta, column, why):
    with pytest.raises(ValueError) as e:
        dask_lm.data.arrow.from_arrow(_table_with(meta, column))
    message = str(e.value)
    assert message.startswith("column 'x'") and why in message and "drop the column" in message, message


def test_arrow_module_does_not_import_pickle():
    """The module that reads tables cannot unpickle: it does not even import pickle (see also test_unpickle_audit)."""
    import ast

    tree = ast.parse(pathlib.Path(dask_lm.data.arrow.__file__).read_text())
    imported = {
        a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "json" in imported and not {"pickle", "_pickle", "cloudpickle", "dill"} & imported, imported


# ------------------------------------------------------------------------------------------- Dask's own channel
def _batch_with_objects() -> dask_lm.BatchedDataDict:
    """NeMo RL's kind of batch: a ``message_log`` of dicts holding tensors, a tuple column, and data columns."""
    return dask_lm.BatchedDataDict(
        input_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]),
        message_log=[
            [
                {"role": "user", "token_ids": torch.tensor([5, 6])},
                {"role": "assistant", "token_ids": torch.tensor([7])},
            ],
            [{"role": "user", "token_ids": torch.tensor([8, 9])}],
        ],
        input_lengths=torch.tensor([3, 2]),
        spans=[(0, 3), (1, 2)],
        text=["a", "b"],
    )


def _assert_same_batch(got, want) -> None:
    assert list(got) == list(want)  # the batch's key order, object columns in their places
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert got["text"] == want["text"] and got["spans"] == want["spans"]
    assert all(type(s) is tuple for s in got["spans"])
    for got_row, want_row in zip(got["message_log"], want["message_log"], strict=True):
        assert [m["role"] for m in got_row] == [m["role"] for m in want_row]
        assert all(torch.equal(g["token_ids"], w["token_ids"]) for g, w in zip(got_row, want_row, strict=True))


def test_a_shard_carries_object_columns_beside_its_table_through_dasks_serializers():
    from distributed.protocol.serialize import deserialize, serialize

    batch = _batch_with_objects()
    with pytest.raises(ValueError, match=r"column 'message_log': row 0 holds a value of type 'torch.Tensor'"):
        dask_lm.data.arrow.to_arrow(batch)
    batch.micro_batch_indices = [[[0, 1], [1, 2]]]
    shard = messages.Shard.of(batch)
    assert shard.table.column_names == ["input_ids", "input_lengths", "text"]  # data only in the table
    assert list(shard.objects) == ["message_log", "spans"]
    header, frames = serialize(shard, serializers=("dask", "pickle"), on_error="raise")
    assert header["serializer"] == "dask"  # field by field: the table as Arrow frames
    back = deserialize(header, frames)
    assert type(back) is messages.Shard
    rows = back.rows()
    _assert_same_batch(rows, batch)
    assert back.plan.micro_batch_indices == [[[0, 1], [1, 2]]] and rows.micro_batch_indices is None
    # a shard without object columns is what it was: the table alone
    plain = messages.Shard.of(dask_lm.BatchedDataDict(input_ids=batch["input_ids"], text=["a", "b"]))
    assert plain.objects == {} and plain.keys == ()


@pytest.mark.cluster
def test_a_shard_with_object_columns_reaches_a_worker(client):
    batch = _batch_with_objects()
    request = messages.ForwardRequest(messages.Shard.of(batch))

    def on_worker(req):
        rows = req.shard.rows()
        return list(rows), [type(s).__name__ for s in rows["spans"]], rows["message_log"][0][1]["token_ids"].tolist()

    keys, span_types, ids = client.submit(on_worker, request, pure=False).result()
    assert keys == list(batch) and span_types == ["tuple", "tuple"] and ids == [7]


# ------------------------------------------------------------------------------------------- the batch jobs
# score_parquet / sft_parquet / `dask-lm score` read their own columns with pyarrow and pandas (Arrow-backed
# columns): a hostile column beside the text is read as bytes (score without an id column reads every column and
# passes it through to its output) or not read at all, never unpickled, and the job scores / trains on the text.


@pytest.mark.cluster
@pytest.mark.parametrize("id_column", [None, "id"])
def test_score_parquet_of_a_hostile_file_scores_the_text_and_runs_nothing(client, tiny, hostile, tmp_path, id_column):
    path, marker = hostile
    out = tmp_path / "scored"
    res = dask_lm.score_parquet(
        path, out, model=tiny["llama"], client=client, text_column="text", id_column=id_column, progress=False
    )
    assert not marker.exists()
    assert res.rows == len(TEXTS)
    parts = sorted(f for f in os.listdir(out) if f.startswith("part-"))
    scored = pa.concat_tables([pq.read_table(out / f) for f in parts])
    assert scored.num_rows == len(TEXTS) and all(x < 0 for x in scored.column("sum_logprob").to_pylist())
    if id_column is None:
        # every input column passes through (via pandas), the hostile ones as the same bytes: data, not objects,
        # and without their field metadata (pandas keeps none), so the output does not even ask to be unpickled
        assert scored.column("evil").to_pylist() == pq.read_table(path).column("evil").to_pylist()
        for name in ("evil", "evil_ext"):
            assert scored.schema.field(name).type == pa.binary() and not scored.schema.field(name).metadata, name
        assert dask_lm.BatchedDataDict.from_arrow(scored)["evil"][0].startswith(b"\x80")  # a pickle, as bytes
    else:  # only the id column and the scored one are read
        assert not {"evil", "evil_ext", "input_ids", "text"} & set(scored.column_names)
    assert not marker.exists()


@pytest.mark.cluster
def test_the_score_command_on_a_hostile_file_runs_nothing(client, tiny, hostile, tmp_path):
    from click.testing import CliRunner

    from dask_lm.cli import main as cli

    path, marker = hostile
    out = tmp_path / "cli"
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(path),
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(out),
            "--scheduler-address",
            client.scheduler.address,
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "_SUCCESS").read_text())["rows"] == len(TEXTS)
    assert not marker.exists()


@pytest.mark.cluster
def test_sft_parquet_of_a_hostile_file_trains_on_the_text_and_runs_nothing(client, tiny, hostile, tmp_path):
    path, marker = hostile
    from dask_lm.sft.job import sft_parquet  # the job behind `dask-lm sft` (not a top-level name)

    res = sft_parquet(
        path,
        tmp_path / "sft",
        model=tiny["llama"],
        client=client,
        text_column="text",
        global_batch_size=2,
        micro_batch_size=1,
        lr=1e-3,
        max_steps=2,
        save_every=2,
        progress=False,
    )
    assert res.steps == 2 and not marker.exists()
