"""dask_lm.score: a Dask DataFrame in, a lazy one out (pandas or a list of texts in, pandas out), scored by the
code that writes score_parquet's parts, against score_parquet itself and a single-process Hugging Face forward."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from test_scoring import TEXTS, _hf_row

import dask_lm
from dask_lm.errors import BadRowError
from dask_lm.io.parquet import output_schema_columns

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def hf(tiny):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()


def _reference(hf, tok, text):
    """A text row as lm-evaluation-harness scores it (BOS, then the text), in one fp32 forward."""
    ids = [tok.bos_token_id] + tok(text)["input_ids"]
    return (ids, *_hf_row(hf, ids))


@pytest.fixture()
def frame():
    """Twelve labelled rows in three groups; a Dask DataFrame of three partitions of four rows."""
    pdf = pd.DataFrame(
        {"text": TEXTS[:12], "group": ["a", "b", "c"] * 4}, index=pd.Index([f"r{i}" for i in range(12)], name="key")
    )
    return pdf, dd.from_pandas(pdf, npartitions=3, sort=False)


@pytest.mark.cluster
def test_dask_frame_matches_score_parquet_and_hf(client, tiny, tok, hf, tmp_path):
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": list(range(20)), "text": TEXTS[:20]}), data, row_group_size=7)
    dask_lm.score_parquet(
        data, tmp_path / "out", model=tiny["llama"], client=client, text_column="text", topk=3, progress=False
    )
    written = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    ddf = dd.read_parquet(data, dtype_backend="pyarrow", split_row_groups=True)
    scored = dask_lm.score(ddf, model=tiny["llama"], text_column="text", topk=3, client=client)
    assert isinstance(scored, dd.DataFrame) and scored.npartitions == ddf.npartitions == 3  # nothing computed yet
    got = scored.compute()
    rows = sorted(pa.Table.from_pandas(got, preserve_index=False).to_pylist(), key=lambda r: r["id"])
    assert list(got.columns) == list(written[0]) and len(rows) == 20
    for a, b in zip(rows, written):  # row for row, every column
        assert a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a), (a["id"], a, b)
        ids, lp, lsm, total, n = _reference(hf, tok, TEXTS[a["id"]])
        assert a["num_tokens"] == len(ids) and a["num_scored"] == n
        torch.testing.assert_close(torch.tensor(a["logprobs"]), lp, atol=1e-4, rtol=0)
        assert a["sum_logprob"] == pytest.approx(total, abs=1e-3)
        assert a["topk_ids"] == torch.topk(lsm, 3, dim=-1).indices.tolist()


def _close(a, b, tol=1e-4):
    """Equal, floats within ``tol`` (the two jobs batch the rows differently: float noise), lists element-wise."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(b))
    return a == b


@pytest.mark.cluster
@pytest.mark.parametrize("topk,decode", [(0, False), (2, True)])
def test_meta_equals_the_computed_frame(client, tiny, frame, topk, decode):
    pdf, ddf = frame
    scored = dask_lm.score(ddf, model=tiny["llama"], text_column="text", topk=topk, decode_topk=decode)
    meta = scored._meta
    assert list(meta.columns) == [*pdf.columns, *(n for n, _ in output_schema_columns(topk, decode))]
    assert all(isinstance(meta[c].dtype, pd.ArrowDtype) for c in meta.columns[len(pdf.columns) :])
    got = scored.partitions[1].compute()
    assert list(got.index) == list(pdf.index[4:8])
    pd.testing.assert_series_equal(got.dtypes, meta.dtypes)
    empty = (
        dask_lm.score(ddf[ddf.group == "none"], model=tiny["llama"], text_column="text", topk=topk, decode_topk=decode)
        .partitions[0]
        .compute()
    )
    assert len(empty) == 0
    pd.testing.assert_series_equal(empty.dtypes, meta.dtypes)  # a partition left empty by a filter, too


@pytest.mark.cluster
def test_pandas_and_a_list_of_texts_give_pandas(client, tiny, tok, hf, frame):
    pdf, _ = frame
    got = dask_lm.score(pdf, model=tiny["llama"], text_column="text", client=client)
    assert isinstance(got, pd.DataFrame) and list(got.index) == list(pdf.index)
    assert list(got["group"]) == list(pdf["group"])
    for key, row in got.iterrows():
        _ids, _lp, _lsm, total, _n = _reference(hf, tok, pdf.loc[key, "text"])
        assert row["sum_logprob"] == pytest.approx(total, abs=1e-3)
    texts = ["a first text to score", "and a second one"]
    listed = dask_lm.score(texts, model=tiny["llama"])  # the default client: the session's
    assert isinstance(listed, pd.DataFrame) and list(listed["text"]) == texts and list(listed.index) == [0, 1]
    for row, text in zip(listed.itertuples(), texts):
        assert row.sum_logprob == pytest.approx(_reference(hf, tok, text)[3], abs=1e-3)


@pytest.mark.cluster
def test_ids_and_prompt_response_columns(client, tiny, tok, hf):
    prompts, responses = TEXTS[:4], [t.upper()[:20] for t in TEXTS[4:8]]
    pdf = pd.DataFrame(
        {
            "prompt": prompts,
            "response": responses,
            "ids": [
                tok(p)["input_ids"] + tok(r, add_special_tokens=False)["input_ids"] for p, r in zip(prompts, responses)
            ],
            "context": [len(tok(p)["input_ids"]) for p in prompts],
        }
    )
    ddf = dd.from_pandas(pdf, npartitions=2, sort=False)
    by_text = dask_lm.score(ddf, model=tiny["llama"], prompt_column="prompt", response_column="response").compute()
    by_ids = dask_lm.score(pdf, model=tiny["llama"], ids_column="ids", prompt_length_column="context")
    for i in range(4):
        ids, start = pdf.ids[i], pdf.context[i]
        _lp, _lsm, total, n = _hf_row(hf, ids, start=start)  # only the response's tokens, given the prompt
        for got in (by_text, by_ids):
            assert got.num_tokens[i] == len(ids) and got.prompt_tokens[i] == start and got.num_scored[i] == n
            assert got.sum_logprob[i] == pytest.approx(total, abs=1e-3)


@pytest.mark.cluster
def test_a_worker_without_the_plugin_installs_it(client, tiny, frame):
    """A lazy frame computed on workers that were never told of dask-lm (it was built before they joined, or for
    another client): each installs the plugin that holds its replica with its first partition."""
    from dask_lm.workers.state import PLUGIN_NAME

    pdf, ddf = frame
    scored = dask_lm.score(ddf, model=tiny["llama"], text_column="text")  # registers it on the default client
    client.unregister_worker_plugin(PLUGIN_NAME)

    def has_plugin(dask_worker):
        return PLUGIN_NAME in dask_worker.plugins

    assert not any(client.run(has_plugin).values())
    got = scored.compute()
    assert list(got.index) == list(pdf.index) and got.sum_logprob.notna().all()
    assert any(client.run(has_plugin).values())


@pytest.mark.cluster
def test_without_a_client_a_local_cluster_is_started_and_closed(client, tiny, monkeypatch):
    """No client given and none current: ``dask_lm.connect()``'s, closed before the result is returned (here a
    second client of the session's cluster stands in for the local cluster, which takes seconds to start)."""
    import distributed

    from dask_lm.engine import cluster

    def no_default():
        raise ValueError("No clients found")

    started = []
    monkeypatch.setattr(distributed, "default_client", no_default)
    monkeypatch.setattr(
        cluster, "connect", lambda *a, **k: started.append(distributed.Client(client.cluster)) or started[-1]
    )
    got = dask_lm.score(["a dask cluster scores the rows"], model=tiny["llama"])
    assert len(got) == 1 and got.num_tokens[0] > 1
    assert len(started) == 1 and started[0].status == "closed"


@pytest.mark.cluster
def test_it_composes_with_a_filter_before_and_a_groupby_after(client, tiny, tok, hf, frame, tmp_path):
    pdf, ddf = frame
    kept = pdf[pdf.group != "c"]
    expected = pd.Series({k: _reference(hf, tok, t)[3] for k, t in kept["text"].items()})
    scored = dask_lm.score(ddf[ddf.group != "c"], model=tiny["llama"], text_column="text")
    by_group = scored.groupby("group").sum_logprob.sum()
    per_group, everything = dask.compute(by_group, scored)  # one graph, two results
    pd.testing.assert_series_equal(
        everything["sum_logprob"].astype(float), expected.rename("sum_logprob"), check_index=False, atol=1e-3
    )
    assert list(everything.index) == list(kept.index)
    for g in ("a", "b"):
        assert per_group[g] == pytest.approx(expected[kept.group == g].sum(), abs=1e-3)
    joined = scored[["sum_logprob"]].join(ddf[["group"]].rename(columns={"group": "g"})).compute()
    assert list(joined.loc[list(kept.index), "g"]) == list(kept.group)  # the index is the input's: a join lines up
    persisted = scored.persist()
    pd.testing.assert_frame_equal(persisted.compute(), everything)
    scored.to_parquet(tmp_path / "scores")
    back = dd.read_parquet(tmp_path / "scores", dtype_backend="pyarrow").compute()
    assert list(back.index) == list(kept.index)
    assert back["sum_logprob"].tolist() == pytest.approx(expected.tolist(), abs=1e-3)


@pytest.mark.cluster
def test_a_bad_row_names_partition_row_and_label_and_skip_drops_it(client, tiny, frame):
    pdf, _ = frame
    pdf = pdf.astype({"text": object})
    pdf.loc["r5", "text"] = None  # the second row of the second partition
    ddf = dd.from_pandas(pdf, npartitions=3, sort=False)
    with pytest.raises(BadRowError) as e:
        dask_lm.score(ddf, model=tiny["llama"], text_column="text").compute()
    assert str(e.value) == (
        "partition 1: row 1 (index 'r5'), column 'text': expected a string, got null; fix the "
        "data, or pass skip_bad_rows=True to leave bad rows out of the result (a warning says "
        "how many)"
    )
    with pytest.warns(UserWarning, match=r"^dask_lm.score: 1 bad row of 12 left out \(skip_bad_rows=True\)"):
        got = dask_lm.score(pdf, model=tiny["llama"], text_column="text", skip_bad_rows=True, client=client)
    assert list(got.index) == [k for k in pdf.index if k != "r5"]
    lazy = dask_lm.score(ddf, model=tiny["llama"], text_column="text", skip_bad_rows=True).compute()
    assert list(lazy.index) == list(got.index)
    # a Dask result's partition warns from its worker (distributed.warn): the event reached the scheduler on the
    # worker's stream before the partition's result did
    import pickle

    said = [pickle.loads(event["message"]) for _, event in client.get_events("warn")]
    assert (
        "dask_lm.score: 1 bad row of partition 1 left out (skip_bad_rows=True); the first: partition 1: row 1 "
        "(index 'r5'), column 'text': expected a string, got null"
    ) in [str(w) for w in said]


@pytest.mark.cluster
def test_a_long_pandas_input_is_cut_finer_than_a_partition_per_worker(client, tiny, frame, monkeypatch):
    from dask_lm.scoring import frame as frame_module

    monkeypatch.setattr(frame_module, "PANDAS_PARTITION_ROWS", 2)  # 12 rows: 6 partitions of 2, not 2 of 6
    pdf, _ = frame
    pdf = pdf.astype({"text": object})
    pdf.loc["r5", "text"] = None
    with pytest.raises(BadRowError, match=r"^partition 2: row 1 \(index 'r5'\), column 'text'"):
        dask_lm.score(pdf, model=tiny["llama"], text_column="text", client=client)
    rest = pdf.drop(index="r5")
    got = dask_lm.score(rest, model=tiny["llama"], text_column="text", client=client)
    assert list(got.index) == list(rest.index) and got.sum_logprob.notna().all()  # in the input's order


def test_usage_errors_come_before_any_graph(tiny, frame):
    pdf, ddf = frame
    clash = ddf.rename(columns={"group": "perplexity"})
    with pytest.raises(
        ValueError,
        match=r"the data's column 'perplexity' has the name of a column dask_lm.score "
        r"adds .*rename it first",
    ):
        dask_lm.score(clash, model=tiny["llama"], text_column="text")
    with pytest.raises(
        ValueError,
        match=r"^text_column='body': the data has no column 'body'; its columns are "
        r"\['text', 'group'\]$",
    ):
        dask_lm.score(pdf, model=tiny["llama"], text_column="body")
    with pytest.raises(ValueError, match="give exactly one of"):
        dask_lm.score(ddf, model=tiny["llama"], text_column="text", ids_column="text")
    with pytest.raises(ValueError, match="takes a dask or pandas DataFrame"):
        dask_lm.score({"text": ["a"]}, model=tiny["llama"])
    with pytest.raises(ValueError, match=r"^for a Dask DataFrame, client is a distributed.Client .*got str$"):
        dask_lm.score(ddf, model=tiny["llama"], text_column="text", client="tcp://127.0.0.1:1")


def test_local_schedulers_are_refused_with_the_way_on(tiny, frame):
    _, ddf = frame
    scored = dask_lm.score(ddf, model=tiny["llama"], text_column="text")
    with pytest.raises(RuntimeError, match=r"computed on a Dask cluster's workers.*dask_lm.connect\(\)"):
        scored.compute(scheduler="sync")
