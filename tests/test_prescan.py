"""Every bad row of a job in one refusal, found while the workers load (dask_lm.scoring.prescan): the same rules and
messages as the workers' (compared with what a --skip-bad-rows run lists in _errors.parquet), and nothing written."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.errors import BadRowError
from dask_lm.scoring import prescan

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

WORDS = "dask scores parquet rows on its workers"


@pytest.fixture
def text_data(tmp_path):
    """Two files; a null text in a.parquet row 3, a long text in b.parquet row 5, a non-UTF-8 one in b row 1."""
    d = tmp_path / "data"
    d.mkdir()
    a = [f"{WORDS} {i}" for i in range(8)]
    a[3] = None
    pq.write_table(pa.table({"id": list(range(8)), "text": a}), d / "a.parquet", row_group_size=4)
    b = [f"{WORDS} {i}".encode() for i in range(8)]
    b[5] = (" ".join([WORDS] * 20)).encode()
    b[1] = b"caf\xe9 au lait"  # latin-1 bytes in a string column: parquet does not check
    pq.write_table(
        pa.table({"id": list(range(8, 16)), "text": pa.array(b, pa.binary()).view(pa.string())}), d / "b.parquet"
    )
    return d


def _errors(out):
    return sorted(pq.read_table(out / "_errors.parquet").column("error").to_pylist())


@pytest.mark.cluster
def test_every_bad_row_is_named_in_one_refusal_before_anything_is_written(client, tiny, text_data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BadRowError) as e:
        dask_lm.score_parquet(
            text_data, out, model=tiny["llama"], client=client, text_column="text", max_length=24, progress=False
        )
    msg = str(e.value)
    assert msg.startswith("3 bad rows in the input, found before scoring")
    for where in (
        "a.parquet: row 3, column 'text'",
        "b.parquet: row 1, column 'text'",
        "b.parquet: row 5, column 'text'",
    ):
        assert where in msg, msg
    assert not out.exists()  # refused before the output was even created
    # the workers' own checks list the same rows with the same words
    listed = tmp_path / "listed"
    res = dask_lm.score_parquet(
        text_data,
        listed,
        model=tiny["llama"],
        client=client,
        text_column="text",
        max_length=24,
        skip_bad_rows=True,
        progress=False,
    )
    assert res.bad_rows == 3
    assert _errors(listed) == sorted(_scan(text_data, tiny["llama"], max_length=24))


def _scan(data, model, **options):
    """The pre-scan's errors for a text job over ``data``, called as score_parquet calls it."""
    from dask_lm.data.messages import ScoreOptions
    from dask_lm.io import modelcheck
    from dask_lm.io import parquet as pio
    from dask_lm.scoring import spans

    inputs = pio.inspect_inputs(
        pio.resolve_input_files(str(data)),
        text_column="text",
        ids_column=None,
        prompt_column=None,
        response_column=None,
        id_column=None,
    )
    opts = ScoreOptions(
        model=model, tokenizer=model, precision="float32", output="unused", text_column="text", **options
    )
    return prescan.bad_rows(
        inputs, spans.plan_spans(inputs.partitions, inputs.group_tokens), opts, modelcheck.stated_vocab(model)
    )


# the command starts its local cluster (a worker process) while it scans the rows, and stops it at the bad rows
@pytest.mark.cluster
def test_ids_rows_are_counted_past_the_first_few_and_the_cli_exits_2(tiny, tmp_path):
    import json
    import pathlib

    vocab = json.loads(pathlib.Path(f"{tiny['llama']}/config.json").read_text())["vocab_size"]
    ids = [[5, 6, 7, 8] for _ in range(20)]
    for r in (2, 4, 9, 11, 13, 17, 19):
        ids[r] = [5, vocab + r, 6]  # outside the vocabulary
    ids[7] = None
    data = tmp_path / "ids.parquet"
    pq.write_table(
        pa.table({"id": list(range(20)), "ids": pa.array(ids, pa.list_(pa.int64()))}), data, row_group_size=5
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(data),
            "--model",
            tiny["llama"],
            "--ids-column",
            "ids",
            "--output",
            str(out),
            "--n-workers",
            "1",
            "--no-progress",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "8 bad rows in the input, found before scoring" in result.output
    assert "row 2, column 'ids': token id" in result.output and "(and 3 more)" in result.output
    assert "--skip-bad-rows" in result.output and not out.exists()


@pytest.mark.cluster
def test_large_jobs_and_skipping_jobs_leave_the_checks_to_the_workers(client, tiny, text_data, tmp_path, monkeypatch):
    monkeypatch.setattr(prescan, "PRESCAN_MAX_TOKENS", 1)  # every job is "large"
    with pytest.raises(BadRowError) as e:
        dask_lm.score_parquet(
            text_data,
            tmp_path / "out",
            model=tiny["llama"],
            client=client,
            text_column="text",
            max_length=24,
            progress=False,
        )
    assert "found before scoring" not in str(e.value) and "skip_bad_rows=True" in str(e.value)  # a worker's
