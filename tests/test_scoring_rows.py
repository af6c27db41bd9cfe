"""Scoring rows that cannot be scored as they are: too long for the model, nothing to score, values that are null,
not UTF-8, out of vocabulary, or in a corrupt page; and a model whose logprobs are not finite. Each either fails
with its location, is listed by --skip-bad-rows, or is flagged in the output: never a silent wrong number."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.tiny import build_tiny_model

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

WORDS = "dask tokens score parquet model cluster worker"


@pytest.fixture(scope="module")
def short(tiny, tmp_path_factory):
    """A tiny llama with 64 positions (the session's models have 4096), and its limit read back from config.json."""
    path = build_tiny_model(
        str(tmp_path_factory.mktemp("short") / "llama64"),
        family="llama",
        max_position_embeddings=64,
        tokenizer_path=tiny["tokenizer"],
        seed=5,
    )
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)["max_position_embeddings"]


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["tokenizer"])


def _hf_logprobs(model_dir, ids):
    """Per-token logprobs of one row from a plain single-process HF forward (position 0 = 0)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.zeros(len(ids))
    lp[1:] = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return lp


def _read(out):
    parts = sorted(f for f in os.listdir(out) if f.startswith("part-"))
    return pa.concat_tables([pq.read_table(os.path.join(out, f)) for f in parts]).to_pylist()


def _cli(client, args):
    """`dask-lm score` attached to the test cluster (no cluster of its own to start)."""
    return CliRunner().invoke(
        cli, ["score", *map(str, args), "--scheduler-address", client.scheduler.address, "--no-progress"]
    )


@pytest.mark.cluster
def test_rows_longer_than_the_model_are_bad_rows_or_keep_their_last_tokens(client, short, tmp_path):
    model, limit = short
    rows = [[3 + (7 * k) % 300 for k in range(limit + 11)], [5, 6, 7, 8, 9, 10], list(range(10, 10 + limit))]
    data = tmp_path / "long.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "ids": pa.array(rows, pa.list_(pa.int32()))}), data)

    result = _cli(client, [data, "--model", model, "--ids-column", "ids", "--output", tmp_path / "o1"])
    assert result.exit_code == 2, result.output
    assert (
        f"long.parquet: row 0, column 'ids': {limit + 11} tokens, more than the model's {limit} positions"
        in result.output
        and "--truncate" in result.output
    )
    assert not (tmp_path / "o1" / "_SUCCESS").exists()

    res = dask_lm.score_parquet(
        data, tmp_path / "o2", model=model, client=client, ids_column="ids", skip_bad_rows=True, progress=False
    )
    errors = pq.read_table(tmp_path / "o2" / "_errors.parquet").to_pylist()
    assert [(e["row"], f"{limit + 11} tokens" in e["error"]) for e in errors] == [(0, True)] and res.bad_rows == 1
    assert [r["id"] for r in _read(tmp_path / "o2")] == [1, 2]  # a row of exactly the limit is fine

    dask_lm.score_parquet(
        data, tmp_path / "o3", model=model, client=client, ids_column="ids", truncate=True, progress=False
    )
    got = _read(tmp_path / "o3")
    assert [r["truncated"] for r in got] == [True, False, False]
    kept = rows[0][-limit:]  # the context side goes, the end of the row stays
    want = _hf_logprobs(model, kept)
    assert got[0]["num_tokens"] == limit and got[0]["num_scored"] == limit - 1
    torch.testing.assert_close(torch.tensor(got[0]["logprobs"]), want, atol=1e-4, rtol=0)
    assert got[0]["sum_logprob"] == pytest.approx(float(want[1:].double().sum()), abs=1e-3)


@pytest.mark.cluster
def test_truncated_prompt_response_rows_keep_the_whole_response(client, short, tok, tmp_path):
    model, limit = short
    prompt = " ".join([WORDS] * 12)
    response, too_long = "parquet model", " ".join([WORDS] * 6)
    p, r = tok(prompt)["input_ids"], tok(response, add_special_tokens=False)["input_ids"]
    assert len(p) + len(r) > limit and len(tok(too_long, add_special_tokens=False)["input_ids"]) >= limit
    data = tmp_path / "pr.parquet"
    pq.write_table(pa.table({"id": [0, 1], "prompt": [prompt, "short"], "response": [response, too_long]}), data)

    with pytest.raises(
        ValueError,
        match=r"pr.parquet: row 0, columns 'prompt' \+ 'response': prompt \+ response "
        rf"are {len(p) + len(r)} tokens, more than the model's {limit} positions",
    ):
        dask_lm.score_parquet(
            data,
            tmp_path / "o1",
            model=model,
            client=client,
            prompt_column="prompt",
            response_column="response",
            progress=False,
        )

    res = dask_lm.score_parquet(
        data,
        tmp_path / "o2",
        model=model,
        client=client,
        prompt_column="prompt",
        response_column="response",
        truncate=True,
        skip_bad_rows=True,
        progress=False,
    )
    errors = pq.read_table(tmp_path / "o2" / "_errors.parquet").to_pylist()
    assert [e["row"] for e in errors] == [1] and "the response alone is" in errors[0]["error"]
    (row,) = _read(tmp_path / "o2")
    kept = (p + r)[-limit:]
    assert kept[-len(r) :] == r and row["truncated"] and row["num_tokens"] == limit and row["num_scored"] == len(r)
    want = _hf_logprobs(model, kept)
    assert row["sum_logprob"] == pytest.approx(float(want[-len(r) :].double().sum()), abs=1e-3)
    assert res.rows == 1 and res.bad_rows == 1

    # a --max-length below the model's limit cuts there instead
    dask_lm.score_parquet(
        data,
        tmp_path / "o3",
        model=model,
        client=client,
        prompt_column="prompt",
        response_column="response",
        truncate=True,
        max_length=20,
        skip_bad_rows=True,
        progress=False,
    )
    (row,) = _read(tmp_path / "o3")
    want = _hf_logprobs(model, (p + r)[-20:])
    assert row["num_tokens"] == 20 and row["sum_logprob"] == pytest.approx(float(want[-len(r) :].sum()), abs=1e-3)


def _nan_model(src, dst):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (weights,) = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    state = load_file(os.path.join(dst, weights))
    state["model.norm.weight"][3] = float("nan")  # the final norm: every logit of every row becomes NaN
    save_file(state, os.path.join(dst, weights), metadata={"format": "pt"})
    return dst


@pytest.mark.cluster
def test_nan_weights_fail_the_job_unless_allowed(client, tiny, tmp_path):
    model = _nan_model(tiny["llama"], str(tmp_path / "nan_model"))
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(8)), "text": [f"{WORDS} {i}" for i in range(8)]}), data, row_group_size=4)
    out = tmp_path / "o1"
    result = _cli(client, [data, "--model", model, "--text-column", "text", "--output", out])
    assert result.exit_code == 1, result.output
    assert "non-finite logprobs" in result.output and "d.parquet (first: row " in result.output
    assert "--allow-nonfinite" in result.output
    assert not (out / "_SUCCESS").exists() and not [f for f in os.listdir(out) if f.startswith("part-")]

    res = dask_lm.score_parquet(
        data, tmp_path / "o2", model=model, client=client, text_column="text", allow_nonfinite=True, progress=False
    )
    got = _read(tmp_path / "o2")
    assert res.rows == 8 and (tmp_path / "o2" / "_SUCCESS").exists()
    assert all(torch.isnan(torch.tensor(r["logprobs"][1:])).all() for r in got)


@pytest.mark.cluster
def test_rows_with_nothing_to_score_have_null_sums_and_are_counted(client, tiny, tok, tmp_path):
    model = tiny["llama"]
    texts = ["dask tokens score", "a", "", "parquet model"]
    assert [len(tok(t)["input_ids"]) for t in texts][1:3] == [1, 0]  # one token, and none
    data = tmp_path / "d.parquet"
    pq.write_table(
        pa.table(
            {
                "id": [0, 1, 2, 3],
                "text": texts,
                "prompt": ["dask tokens", "score", "model", "x"],
                "response": [" score", "", " parquet", ""],
            }
        ),
        data,
    )
    with pytest.warns(UserWarning, match="2 rows had nothing to score"):  # the text's first token: its context
        res = dask_lm.score_parquet(
            data,
            tmp_path / "t",
            model=model,
            client=client,
            text_column="text",
            id_column="id",
            progress=False,
            convention="separate",
        )
    got = _read(tmp_path / "t")
    assert [r["num_scored"] for r in got] == [max(len(tok(t)["input_ids"]) - 1, 0) for t in texts]
    assert [r["num_scored"] for r in got][1:3] == [0, 0]
    for r in (got[1], got[2]):
        assert (r["sum_logprob"], r["mean_logprob"], r["perplexity"]) == (None, None, None)
    assert got[1]["num_tokens"] == 1 and got[2]["num_tokens"] == 0 and got[2]["logprobs"] == []
    ppls = []
    for i in (0, 3):
        lp = _hf_logprobs(model, tok(texts[i])["input_ids"])
        assert got[i]["sum_logprob"] == pytest.approx(float(lp[1:].double().sum()), abs=1e-3)
        ppls.append(float(torch.exp(-lp[1:].double().mean())))
    assert res.perplexity == pytest.approx(sum(ppls) / 2, rel=1e-4)  # the flagged rows left out, not counted as 1
    assert json.loads((tmp_path / "t" / "_SUCCESS").read_text())["empty_rows"] == 2

    with pytest.warns(UserWarning, match="2 rows had nothing to score"):
        dask_lm.score_parquet(
            data,
            tmp_path / "pr",
            model=model,
            client=client,
            prompt_column="prompt",
            response_column="response",
            id_column="id",
            progress=False,
            convention="separate",
        )
    got = _read(tmp_path / "pr")
    assert [r["num_scored"] for r in got] == [
        len(tok(t, add_special_tokens=False)["input_ids"]) for t in (" score", "", " parquet", "")
    ]
    assert got[1]["sum_logprob"] is None and got[3]["perplexity"] is None and got[0]["sum_logprob"] is not None
    assert json.loads((tmp_path / "pr" / "_SUCCESS").read_text())["empty_rows"] == 2
    # prompt_tokens marks where the response starts: the prompt's own tokens, and the sums cover what follows
    prompts = ["dask tokens", "score", "model", "x"]
    assert [r["prompt_tokens"] for r in got] == [len(tok(p)["input_ids"]) for p in prompts]
    assert all(r["num_tokens"] == r["prompt_tokens"] + r["num_scored"] for r in got)
    assert got[0]["sum_logprob"] == pytest.approx(sum(got[0]["logprobs"][got[0]["prompt_tokens"] :]), abs=1e-5)
    # in text mode the first token is the context: one prompt token (none for an empty text)
    assert [r["prompt_tokens"] for r in _read(tmp_path / "t")] == [1, 1, 0, 1]

    # lm-evaluation-harness's convention (the default): a text is an empty prompt plus the text, so its first token
    # is scored given BOS (this tokenizer adds none itself) and only the empty text has nothing to score
    with pytest.warns(UserWarning, match="1 rows had nothing to score"):
        dask_lm.score_parquet(
            data, tmp_path / "lm", model=model, client=client, text_column="text", id_column="id", progress=False
        )
    got = _read(tmp_path / "lm")
    bos = tok.bos_token_id
    assert [r["num_scored"] for r in got] == [len(tok(t)["input_ids"]) for t in texts]
    assert [r["prompt_tokens"] for r in got] == [1, 1, 1, 1] and got[2]["sum_logprob"] is None
    for i in (0, 1, 3):
        lp = _hf_logprobs(model, [bos] + tok(texts[i])["input_ids"])
        assert got[i]["sum_logprob"] == pytest.approx(float(lp[1:].double().sum()), abs=1e-3)


def _invalid_utf8_strings(values):
    """A string array whose second value is not UTF-8: parquet stores the bytes as they are."""
    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


BAD_ROWS = [
    # (name, columns, mode, bad row, column named, what the error says)
    (
        "null_text",
        {"text": ["dask tokens", None, "score parquet"]},
        ["--text-column", "text"],
        1,
        "text",
        "expected a string, got null",
    ),
    (
        "not_utf8",
        {"text": _invalid_utf8_strings([b"dask tokens", b"ok \xff\xfe bytes", b"score"])},
        ["--text-column", "text"],
        1,
        "text",
        "expected a string, got bytes that are not valid UTF-8 (byte 3",
    ),
    (
        "null_list",
        {"ids": pa.array([[5, 6, 7], None, [8, 9]], pa.list_(pa.int64()))},
        ["--ids-column", "ids"],
        1,
        "ids",
        "expected a list of token ids, got null",
    ),
    (
        "null_id",
        {"ids": pa.array([[5, 6, 7], [8, None, 9], [8, 9]], pa.list_(pa.int64()))},
        ["--ids-column", "ids"],
        1,
        "ids",
        "null token id at position 1",
    ),
    (
        "out_of_vocab",
        {"ids": pa.array([[5, 6, 7], [8, 9], [8, 100000]], pa.list_(pa.int64()))},
        ["--ids-column", "ids"],
        2,
        "ids",
        "token id 100000 at position 1 is outside the model's vocabulary",
    ),
]


@pytest.mark.cluster
@pytest.mark.parametrize("name,columns,mode,row,column,what", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_rows_are_located_and_skippable(client, tiny, tmp_path, name, columns, mode, row, column, what):
    data = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], **columns}), data)
    result = _cli(client, [data, "--model", tiny["llama"], *mode, "--output", tmp_path / "o1"])
    assert result.exit_code == 2, result.output
    assert f"{name}.parquet: row {row}, column {column!r}: {what}" in result.output, result.output
    assert "--skip-bad-rows" in result.output and not (tmp_path / "o1" / "_SUCCESS").exists()

    result = _cli(
        client,
        [data, "--model", tiny["llama"], *mode, "--output", tmp_path / "o2", "--skip-bad-rows", "--id-column", "id"],
    )
    assert result.exit_code == 0, result.output
    errors = pq.read_table(tmp_path / "o2" / "_errors.parquet").to_pylist()
    assert [(e["file"], e["row"]) for e in errors] == [(str(data), row)] and what in errors[0]["error"]
    assert [r["id"] for r in _read(tmp_path / "o2")] == [i for i in range(3) if i != row]


@pytest.mark.cluster
def test_a_corrupt_data_page_names_its_row_group_and_skips_its_rows(client, tiny, tmp_path):
    data = tmp_path / "corrupt.parquet"
    pq.write_table(
        pa.table({"id": list(range(12)), "text": [f"{WORDS} {i}" for i in range(12)]}),
        data,
        row_group_size=4,
        compression="none",
    )
    chunk = pq.ParquetFile(data).metadata.row_group(1).column(1)
    with open(data, "r+b") as f:  # garbage over the page header of row group 1's text page; the footer stays valid
        f.seek(chunk.data_page_offset)
        f.write(b"\xde\xad\xbe\xef" * 4)
    assert pq.ParquetFile(data).metadata is not None  # still opens: only a read of that page fails

    result = _cli(client, [data, "--model", tiny["llama"], "--text-column", "text", "--output", tmp_path / "o1"])
    assert result.exit_code == 2, result.output
    assert "corrupt.parquet: row group 1 (rows 4-7) cannot be read" in result.output, result.output
    assert not (tmp_path / "o1" / "_SUCCESS").exists()

    # merged into one task (the default for small row groups) and one task per row group as written: the same rows
    # out, the same rows listed, and where a whole task is unreadable, an empty part of the output's schema
    for out, task_tokens, parts in ((tmp_path / "o2", None, 1), (tmp_path / "o3", 0, 3)):
        res = dask_lm.score_parquet(
            data,
            out,
            model=tiny["llama"],
            client=client,
            text_column="text",
            skip_bad_rows=True,
            progress=False,
            task_tokens=task_tokens,
        )
        errors = pq.read_table(out / "_errors.parquet").to_pylist()
        assert [e["row"] for e in errors] == [4, 5, 6, 7] and all("row group 1" in e["error"] for e in errors)
        assert [r["id"] for r in _read(out)] == [0, 1, 2, 3, 8, 9, 10, 11]
        assert res.bad_rows == 4 and res.rows == 8 and res.parts == parts
    empty, first = (pq.read_table(tmp_path / "o3" / f"part-0000{i}.parquet") for i in (1, 0))
    assert empty.num_rows == 0 and empty.schema.names == first.schema.names


def test_values_of_a_pandas_object_column_are_checked_one_by_one():
    """A frame that did not come from parquet (object columns): wrong types and missing values are bad rows too."""
    import pandas as pd

    from dask_lm.data.messages import ScoreOptions
    from dask_lm.data.rows import RowModel, prepare_rows

    opts = ScoreOptions(
        model="-", tokenizer="-", precision="float32", output="-", ids_column="ids", max_length=4, truncate=True
    )
    values = [[1, 2, 3], pd.NA, [1, None, 2], "abc", [1.5, 2], [], list(range(1, 8))]
    pdf = pd.DataFrame({"ids": pd.Series(values, dtype=object)})
    rows = prepare_rows(pdf, opts, RowModel(None, 10, 64), file="f.parquet", first_row=100)
    assert rows.errors == [
        None,
        "f.parquet: row 101, column 'ids': expected a list of token ids, got null",
        "f.parquet: row 102, column 'ids': null token id at position 1 (of 3)",
        "f.parquet: row 103, column 'ids': expected a list of token ids, got str 'abc'",
        "f.parquet: row 104, column 'ids': token id 1.5 at position 0 is not an integer",
        None,
        None,
    ]
    assert rows.ids[5] == [] and rows.ids[6] == [4, 5, 6, 7] and rows.truncated == [False] * 6 + [True]


def test_ids_mode_prompt_lengths_set_the_first_scored_id_and_are_checked():
    """``--prompt-length-column``: the leading ids that are context. A length outside [0, len(ids)], null or not an
    integer is a bad row naming the column; a long row keeps its scored ids whole and loses context from the left."""
    import pandas as pd

    from dask_lm.data.messages import ScoreOptions
    from dask_lm.data.rows import RowModel, prepare_rows

    opts = ScoreOptions(
        model="-",
        tokenizer="-",
        precision="float32",
        output="-",
        ids_column="ids",
        prompt_length_column="plen",
        max_length=5,
        truncate=True,
    )
    ids = [[1, 2, 3, 4], [1, 2, 3], [1, 2], [1, 2], [1, 2], list(range(1, 9)), list(range(1, 9))]
    plen = [2, 0, 3, None, 1.5, 6, 2]
    pdf = pd.DataFrame({"ids": pd.Series(ids, dtype=object), "plen": pd.Series(plen, dtype=object)})
    rows = prepare_rows(pdf, opts, RowModel(None, 10, 64), file="f.parquet", first_row=0)
    assert rows.errors[:2] == [None, None] and rows.start[:2] == [2, 1]  # position 0 has no context: from 1
    assert rows.errors[2] == (
        "f.parquet: row 2, column 'plen': prompt length 3 is outside [0, 2] (the row has 2 "
        "token ids); it counts the leading ids that are context, not scored"
    )
    assert rows.errors[3] == "f.parquet: row 3, column 'plen': expected a prompt length (an integer), got null"
    assert rows.errors[4].startswith(
        "f.parquet: row 4, column 'plen': expected a prompt length (an integer), got float 1.5"
    )
    # 8 ids, 6 of them context, limit 5: the first 3 ids go, the 2 scored ones stay whole after 3 context ids
    assert rows.errors[5] is None and rows.ids[5] == [4, 5, 6, 7, 8] and rows.start[5] == 3 and rows.truncated[5]
    assert rows.errors[6] == (
        "f.parquet: row 6, columns 'ids' + 'plen': the response alone is 6 tokens, and "
        "scoring it needs it plus at least one context token within max_length=5; truncate=True "
        "cannot keep it whole: shorten the response or use a model with more positions"
    )


def test_merge_errors_keeps_what_an_interrupted_merge_wrote(tmp_path):
    """A job killed after merging its bad rows but before _SUCCESS: the resumed job's merge keeps them (and a
    part redone since replaces its own rows), so _errors.parquet and the count agree with the input."""
    from dask_lm.io import parquet as pio

    out = tmp_path / "out"
    os.makedirs(pio.errors_dir(str(out)))
    pq.write_table(pio.errors_table(0, "a.parquet", [3, 4], ["bad", "bad"]), out / pio.ERRORS)
    assert pio.merge_errors(str(out)) == 2  # nothing new: the merged file stands
    os.makedirs(pio.errors_dir(str(out)))
    pq.write_table(
        pio.errors_table(1, "a.parquet", [12], ["bad"]), os.path.join(pio.errors_dir(str(out)), pio.part_name(1))
    )
    pq.write_table(
        pio.errors_table(0, "a.parquet", [4], ["bad"]), os.path.join(pio.errors_dir(str(out)), pio.part_name(0))
    )
    assert pio.merge_errors(str(out)) == 2
    merged = pq.read_table(out / pio.ERRORS)
    assert sorted(zip(merged.column("part").to_pylist(), merged.column("row").to_pylist())) == [(0, 4), (1, 12)]


def test_compiling_is_chosen_by_the_tokens_the_footers_promise_per_worker(tmp_path, monkeypatch):
    """score_parquet(compile=None) compiles only where the job is long enough to pay: its size comes from the
    footers (no read: an ids column's value count, a text column's uncompressed bytes), per worker; other columns
    do not count."""
    from dask_lm.io import parquet as pio
    from dask_lm.scoring import compile_choice

    g = torch.Generator().manual_seed(0)  # distinct values: the footers count bytes after dictionary encoding
    texts = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (400,), generator=g)) for _ in range(50)]
    ids = torch.randint(0, 2**40, (50, 100), generator=g).tolist()  # 5,000 int64 ids
    pq.write_table(
        pa.table({"text": texts, "ids": pa.array(ids, pa.list_(pa.int64())), "other": texts}),
        tmp_path / "d.parquet",
        row_group_size=10,
    )
    files = [str(tmp_path / "d.parquet")]
    text = pio.inspect_inputs(
        files, text_column="text", ids_column=None, prompt_column=None, response_column=None, id_column=None
    )
    by_ids = pio.inspect_inputs(
        files, text_column=None, ids_column="ids", prompt_column=None, response_column=None, id_column=None
    )
    meta = pq.ParquetFile(files[0]).metadata
    want = sum(meta.row_group(g).column(0).total_uncompressed_size for g in range(meta.num_row_groups))
    # the text column's 20,000 characters (about 5,000 tokens), not "other"'s
    assert text.scored_bytes == want and 20_000 <= want < 26_000  # (plus lengths and page headers)
    assert 40_000 <= by_ids.scored_bytes < 50_000  # 8 bytes per id
    assert by_ids.group_tokens == [1000.0] * 5  # ids: the footer counts them exactly (10 rows of 100 per group)
    assert sum(text.group_tokens) == pytest.approx(want / 4)  # text: about 4 bytes a token
    monkeypatch.setattr(compile_choice, "COMPILE_MIN_TOKENS_PER_WORKER", 4_000)
    assert compile_choice.worth_compiling(text, None, 1) and not compile_choice.worth_compiling(text, None, 2)
    assert compile_choice.worth_compiling(by_ids, "ids", 1) and not compile_choice.worth_compiling(by_ids, "ids", 2)
