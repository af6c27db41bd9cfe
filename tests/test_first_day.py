"""A user's first day after the demo: reading an output back (``read_scores``, ``ScoreResult.to_pandas`` /
``to_arrow``, ``pd.read_parquet``), the top-k as strings (``--decode-topk``, ``dask-lm logprobs --topk``), and the
demo's next commands, run as printed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

TEXTS = [
    f"row {i}: " + " ".join(["the dask", "tokens of", "a score", "parquet", "model"][: 1 + i % 5]) * (1 + i % 3)
    for i in range(24)
]


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def job(client, tiny, tmp_path_factory):
    """One finished job of several parts (two files, one of three row groups: one task per row group), with
    ``topk=3`` and ``decode_topk``; its result and output folder."""
    root = tmp_path_factory.mktemp("first_day")
    data = root / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": list(range(16)), "text": TEXTS[:16]}), data / "a.parquet", row_group_size=6)
    pq.write_table(pa.table({"id": list(range(16, 24)), "text": TEXTS[16:]}), data / "b.parquet")
    out = root / "out"
    res = dask_lm.score_parquet(
        data,
        out,
        model=tiny["llama"],
        client=client,
        text_column="text",
        topk=3,
        decode_topk=True,
        task_tokens=0,
        progress=False,
    )
    return res, out


def _parts(out):
    """The part files read back with pyarrow directly, in part-number order."""
    names = sorted((f for f in os.listdir(out) if f.startswith("part-")), key=lambda f: int(f[5:-8]))
    return pa.concat_tables([pq.read_table(out / f) for f in names]), names


@pytest.mark.cluster
def test_read_scores_to_pandas_to_arrow_and_read_parquet_give_the_parts_rows_in_order(job):
    res, out = job
    direct, names = _parts(out)
    assert len(names) == 4 and direct.column("id").to_pylist() == list(range(24))  # input order, across parts
    table = res.to_arrow()
    assert isinstance(table, pa.Table) and table.equals(direct)
    df = dask_lm.read_scores(out)
    assert list(df.columns) == direct.column_names and list(df.index) == list(range(24))
    # every column Arrow-backed, with the parts' own types (list columns too)
    assert all(isinstance(t, pd.ArrowDtype) for t in df.dtypes), df.dtypes
    assert [t.pyarrow_dtype for t in df.dtypes] == direct.schema.types
    for name in direct.column_names:  # the same values, cell by cell
        assert [None if v is pd.NA else v for v in df[name].tolist()] == direct.column(name).to_pylist(), name
    pd.testing.assert_frame_equal(res.to_pandas(), df)
    # the one-liner: the same rows in the same order (the _manifest.json, _SUCCESS and the lock are skipped)
    plain = pd.read_parquet(out)
    assert plain["id"].tolist() == list(range(24)) and plain["text"].tolist() == TEXTS
    assert plain["sum_logprob"].tolist() == direct.column("sum_logprob").to_pylist()
    pd.testing.assert_frame_equal(pd.read_parquet(out, dtype_backend="pyarrow"), df)
    # columns=: those, in that order
    some = dask_lm.read_scores(out, columns=["perplexity", "id"])
    assert list(some.columns) == ["perplexity", "id"] and some["id"].tolist() == list(range(24))
    assert res.to_arrow(columns=["id"]).column_names == ["id"]
    with pytest.raises(ValueError, match="no column 'nope'"):
        dask_lm.read_scores(out, columns=["id", "nope"])
    with pytest.raises(ValueError, match=r"not the string 'id': pass \['id'\]"):
        dask_lm.read_scores(out, columns="id")


@pytest.mark.cluster
def test_topk_tokens_are_the_tokenizers_strings_of_topk_ids(job, tok):
    _res, out = job
    direct, _ = _parts(out)
    assert direct.schema.field("topk_tokens").type == pa.list_(pa.list_(pa.string()))
    assert json.loads((out / "_manifest.json").read_text())["options"]["decode_topk"] is True  # pinned
    differs = False
    for ids, tokens in zip(direct.column("topk_ids").to_pylist(), direct.column("topk_tokens").to_pylist()):
        assert len(tokens) == len(ids) and all(len(t) == 3 for t in tokens)
        assert tokens == [[tok.decode([i]) for i in position] for position in ids]
        differs |= any(tok.decode([i]) != tok.convert_ids_to_tokens(i) for position in ids for i in position)
    assert differs  # the choice is visible with this tokenizer: decode's text, not the vocabulary's spelling


@pytest.mark.cluster
def test_read_scores_refuses_what_is_not_a_finished_scoring_output(job, tmp_path):
    _res, out = job
    direct, names = _parts(out)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "_SUCCESS").unlink()
    with pytest.raises(
        ValueError,
        match=f"{copy} holds an unfinished dask-lm scoring job .*4 of 4 parts.*--resume.*allow_incomplete=True",
    ):
        dask_lm.read_scores(copy)
    (copy / names[1]).unlink()  # a job still running: the parts written so far, in order, gaps and all
    partial = dask_lm.read_scores(copy, allow_incomplete=True)
    kept = pa.concat_tables([pq.read_table(out / n) for n in names if n != names[1]])
    assert partial["id"].tolist() == kept.column("id").to_pylist() and len(partial) < 24
    lost = tmp_path / "lost"
    shutil.copytree(out, lost)
    (lost / names[2]).unlink()
    with pytest.raises(
        ValueError,
        match=f"{lost} is a finished dask-lm scoring job that lost 1 of its 4 parts "
        f"\\({names[2]} first\\).*--overwrite",
    ):
        dask_lm.read_scores(lost)
    plain = tmp_path / "plain"  # parquet files, but no job's
    plain.mkdir()
    pq.write_table(direct, plain / "part-00000.parquet")
    for folder in (plain, tmp_path / "missing"):
        with pytest.raises(ValueError, match=f"{folder} is not a (dask-lm scoring output|directory).*pass that folder"):
            dask_lm.read_scores(folder)
    (plain / "_manifest.json").write_text(json.dumps({"format": 4, "options": {"epochs": 1}}))  # an sft run's
    (plain / "_SUCCESS").write_text("{}")
    with pytest.raises(ValueError, match=r"not a dask-lm scoring output .*another kind of job"):
        dask_lm.read_scores(plain)


def test_decode_topk_needs_topk(tiny, tmp_path):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a b c"]}), data)
    with pytest.raises(ValueError, match=r"decode_topk=True .* needs topk=K"):
        dask_lm.score_parquet(data, tmp_path / "out", model=tiny["llama"], text_column="text", decode_topk=True)
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(data),
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "out"),
            "--decode-topk",
        ],
    )
    assert result.exit_code == 2 and "--decode-topk decodes the top-k ids: it needs --topk K" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.cluster
def test_logprobs_cli_shows_the_topk_as_the_tokenizers_strings(client, tiny, tok):
    text = "the dask tokens of a score"
    result = CliRunner().invoke(
        cli,
        [
            "logprobs",
            "--model",
            tiny["llama"],
            "--scheduler-address",
            client.scheduler.address,
            "--precision",
            "fp32",
            "--topk",
            "2",
            "--json",
            text,
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    ids = tok(text)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        top = hf(torch.tensor([ids])).logits[0].topk(2, dim=-1).indices.tolist()
    assert record["tokens"] == [tok.decode([i]) for i in ids]
    assert record["topk"] == [[tok.decode([i]) for i in position] for position in top]


@pytest.mark.cluster
def test_the_demos_next_commands_run_as_printed(tmp_path):
    """``dask-lm demo`` ends with what to type next; a shell runs each line as printed, in the user's directory, on
    the machine the demo ran on (the environment's bin directory on PATH, as an activated virtualenv has it)."""
    cwd, cache = tmp_path / "work", tmp_path / "cache"
    cwd.mkdir()
    env = {
        **os.environ,
        "DASK_LM_CACHE_DIR": str(cache),
        "COLUMNS": "80",
        "LINES": "24",  # pandas' print width
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dask_lm", "demo", "--rows", "64"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the summary, and the dashboard's address while its cluster was up (the summary, printed after the demo's
    # cluster closed, leaves it out)
    for key in ("rows", "tokens/s", "perplexity", "output"):
        assert re.search(rf"^{re.escape(key)} ", proc.stdout, flags=re.M), key
    assert "dashboard at http://127.0.0.1:" in proc.stderr and "dashboard" not in proc.stdout
    assert (cache / "demo" / "scores" / "_SUCCESS").exists()
    block = proc.stdout.split("\nnext:\n", 1)[1].splitlines()
    assert len(block) < 10 and "--text-column names your text column" in proc.stdout
    assert "docs" in block[-1] and "quickstart.md" in block[-1]
    commands = [line.strip() for line in block if line.strip() and not line.strip().startswith("#")]
    assert len(commands) == 2 and str(cache / "tiny-llama") in commands[0] and "--output my-scores" in commands[0]
    ran = [
        subprocess.run(c, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600) for c in commands
    ]
    assert [r.returncode for r in ran] == [0, 0], [r.stderr[-3000:] for r in ran]
    # the first scored the demo's own file into ./my-scores: its rows, in its order
    source = pq.read_table(cache / "demo" / "data-64" / "a.parquet")
    scored, _ = _parts(cwd / "my-scores")
    assert (cwd / "my-scores" / "_SUCCESS").exists() and scored.num_rows == source.num_rows == 32
    assert scored.select(["id", "text"]).equals(source)
    # the second printed those rows: the frame pandas itself reads from the folder, printed alike
    reference = subprocess.run(
        [sys.executable, "-c", "import pandas as pd; print(pd.read_parquet('my-scores', dtype_backend='pyarrow'))"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert reference.returncode == 0 and ran[1].stdout == reference.stdout
    assert "[32 rows x 11 columns]" in ran[1].stdout  # the id and text columns, and the 9 scoring columns


def test_the_next_commands_name_this_python_where_dask_lm_is_not_on_path(tmp_path, monkeypatch):
    """Outside an activated environment (nothing of it on PATH) the commands name this interpreter by its path, and
    an ``--output`` already in the directory is not reused; ``demo --help`` says the demo ends with them."""
    import shlex

    from dask_lm.demo import next_steps as _next_steps

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    (tmp_path / "my-scores").mkdir()
    lines = _next_steps("/models/tiny llama", "/data/demo")
    python = shlex.quote(sys.executable)
    assert lines[3] == (
        f"  {python} -m dask_lm score /data/demo/a.parquet --model '/models/tiny llama' "
        "--text-column text --output my-scores-2"
    )
    assert lines[5] == f'''  {python} -c "import dask_lm; print(dask_lm.read_scores('my-scores-2'))"'''
    help_text = CliRunner().invoke(cli, ["demo", "--help"]).output
    assert "next commands" in help_text and "read the scores back" in help_text
