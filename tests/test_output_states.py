"""An output folder's states, as a user meets them: a job that stopped at a bad row, a finished job, a folder
that holds someone else's files. Each refusal needs only the folder, so it comes before anything is looked at
(here: before a model that does not exist is even resolved, and with ``connect`` made to fail), and names the
next command; ``--resume`` of a finished job returns without a cluster and leaves ``_SUCCESS`` as it was;
``--overwrite`` runs again into a folder and never deletes files dask-lm did not write."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from click.testing import CliRunner
from helpers import hf_logprobs

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.engine import cluster
from dask_lm.scoring import prescan
from dask_lm.sft.job import sft_parquet

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park today",
    "dask runs tasks on workers",
    "tokens have logprobs",
    "gradients flow backwards through layers",
    "the loss goes down",
    "two ranks agree on it",
    "parquet has columns",
]


@pytest.fixture
def no_cluster(monkeypatch):
    """``connect`` fails: a call that gets past its checks would say so."""

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(cluster, "connect", refuse)


@pytest.fixture
def bad_data(tmp_path):
    path = tmp_path / "bad.parquet"
    texts = [TEXTS[0], TEXTS[1], None, TEXTS[2], TEXTS[3], TEXTS[4]]
    pq.write_table(pa.table({"id": list(range(6)), "text": texts}), path, row_group_size=3)
    return path


def _score(data, out, model, client, **kw):
    return dask_lm.score_parquet(
        data, out, model=model, client=client, text_column="text", id_column="id", progress=False, **kw
    )


@pytest.mark.cluster
def test_a_bad_row_then_resume_with_skip_bad_rows_keeps_the_good_part(client, tiny, bad_data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    # a job too large for the driver's pre-scan (scoring/prescan.py): its worker finds the bad row mid-job, after
    # the parts before it were written
    monkeypatch.setattr(prescan, "PRESCAN_MAX_TOKENS", 0)
    with pytest.raises(ValueError, match=r"row 2, column 'text'.*call again with resume=True, skip_bad_rows=True"):
        _score(bad_data, out, tiny["llama"], client)
    # the retry the first error suggests, without --resume: refused, naming what to type, before any model check
    with monkeypatch.context() as m:
        m.setattr(cluster, "connect", lambda *a, **k: pytest.fail("a cluster was started"))
        with pytest.raises(
            ValueError, match=r"unfinished dask-lm scoring job.*resume=True.*skip_bad_rows=True.*overwrite=True"
        ):
            _score(bad_data, out, str(tmp_path / "no-such-model"), None, skip_bad_rows=True)
    result = _score(bad_data, out, tiny["llama"], client, skip_bad_rows=True, resume=True)
    assert result.bad_rows == 1 and not result.already_complete
    table = pq.read_table(out).to_pandas().sort_values("id")
    assert table["id"].tolist() == [0, 1, 3, 4, 5]
    assert pq.read_table(out / "_errors.parquet").to_pylist()[0]["row"] == 2
    assert json.loads((out / "_manifest.json").read_text())["options"]["skip_bad_rows"] is True
    # finished with skip_bad_rows, it resumes without re-typing it (nor anything else: the CLI's `--output --resume`)
    with monkeypatch.context() as m:
        m.setattr(cluster, "connect", lambda *a, **k: pytest.fail("a cluster was started"))
        again = _score(bad_data, out, tiny["llama"], None, resume=True)
        shown = CliRunner().invoke(cli, ["score", "--output", str(out), "--resume"])
    assert again.already_complete and (again.rows, again.bad_rows) == (5, 1)
    assert shown.exit_code == 0 and "already complete" in shown.output, shown.output
    # the sums are the model's: a single-process HF forward of the same rows
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    texts = [TEXTS[i] for i in range(5)]
    rows = [[tok.bos_token_id] + tok(t)["input_ids"] for t in texts]  # lm-eval's convention: a text after BOS
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    ref, _ = hf_logprobs(tiny["llama"], ids, torch.tensor([len(r) for r in rows]))
    assert table["sum_logprob"].tolist() == pytest.approx(ref.sum(1).tolist(), abs=1e-4)
    # the summary's corpus perplexity is exp(-total logprob / scored tokens) of what the files hold
    want = math.exp(-table["sum_logprob"].sum() / table["num_scored"].sum())
    assert result.corpus_perplexity == pytest.approx(want, rel=1e-9)
    assert result.scored_tokens == int(table["num_scored"].sum())
    assert result.perplexity == pytest.approx(table["perplexity"].mean(), rel=1e-9)


@pytest.mark.cluster
def test_a_finished_job_resumes_at_once_and_overwrite_runs_again(client, tiny, tmp_path, monkeypatch):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "text": TEXTS[:3]}), data)
    out = tmp_path / "out"
    first = _score(data, out, tiny["llama"], client)
    success = (out / "_SUCCESS").read_bytes()
    with monkeypatch.context() as m:
        m.setattr(cluster, "connect", lambda *a, **k: pytest.fail("a cluster was started"))
        with pytest.raises(ValueError, match=r"finished dask-lm scoring job \(3 rows\).*resume=True.*overwrite=True"):
            _score(data, out, str(tmp_path / "no-such-model"), None)
        again = _score(data, out, tiny["llama"], None, resume=True)
    assert again.already_complete and (again.rows, again.tokens) == (first.rows, first.tokens)
    assert again.corpus_perplexity == pytest.approx(first.corpus_perplexity, rel=1e-12)
    assert (out / "_SUCCESS").read_bytes() == success
    with pytest.raises(ValueError, match="resume=True and overwrite=True exclude each other"):
        _score(data, out, tiny["llama"], client, resume=True, overwrite=True)
    # --overwrite with other options: a new job, its manifest and parts replace the old ones
    redone = _score(data, out, tiny["llama"], client, topk=2, overwrite=True)
    assert not redone.already_complete and redone.rows == 3
    assert "topk_ids" in pq.read_table(out).column_names
    assert json.loads((out / "_manifest.json").read_text())["options"]["topk"] == 2


@pytest.mark.cluster
def test_overwrite_never_deletes_files_dask_lm_did_not_write(client, tiny, tmp_path, no_cluster):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [0], "text": TEXTS[:1]}), data)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "part-00000.parquet").write_bytes(b"not ours either: there is no manifest")
    for kw in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ValueError, match=r"not a dask-lm scoring job's \(notes.txt, part-00000.parquet\)"):
            _score(data, out, tiny["llama"], None, **kw)
    assert (out / "notes.txt").read_text() == "keep me" and (out / "part-00000.parquet").exists()


@pytest.mark.cluster
def test_sft_finished_run_resumes_at_once_overwrite_retrains_and_weights_are_self_contained(
    client, tiny, tmp_path, monkeypatch
):
    data = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"text": TEXTS[:8]}), data)
    out = tmp_path / "run"
    args = dict(
        model=tiny["llama"],
        text_column="text",
        global_batch_size=4,
        micro_batch_size=2,
        lr=1e-3,
        save_every=1,
        progress=False,
    )
    done = sft_parquet(data, out, client=client, **args)
    assert done.steps == 2 and not done.already_complete
    success = (out / "_SUCCESS").read_bytes()
    with monkeypatch.context() as m:
        m.setattr(cluster, "connect", lambda *a, **k: pytest.fail("a cluster was started"))
        with pytest.raises(ValueError, match=r"finished dask-lm sft run.*resume=True.*overwrite=True"):
            sft_parquet(data, out, client=None, **{**args, "model": str(tmp_path / "no-such-model")})
        again = sft_parquet(data, out, client=None, resume=True, **args)
    assert again.already_complete and again.steps == 2 and again.losses == pytest.approx(done.losses)
    assert (out / "_SUCCESS").read_bytes() == success
    # a step's weights directory is a complete Hugging Face directory: model and tokenizer load from it alone
    weights = out / "step_2" / "weights"
    tok = transformers.AutoTokenizer.from_pretrained(weights)
    want = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    assert tok(TEXTS[5])["input_ids"] == want(TEXTS[5])["input_ids"]
    transformers.AutoModelForCausalLM.from_pretrained(weights)
    scored = dask_lm.score_parquet(
        data, tmp_path / "scores", model=weights, client=client, text_column="text", progress=False
    )
    assert scored.rows == 8
    # --overwrite trains again from the start (other options allowed); a longer --max-steps continues instead
    redone = sft_parquet(data, out, client=client, overwrite=True, **{**args, "lr": 2e-3})
    assert redone.resumed_from is None and redone.steps == 2
    assert json.loads((out / "_manifest.json").read_text())["options"]["lr"] == 2e-3


def test_cli_refusals_name_the_next_command(tiny, bad_data, tmp_path, no_cluster):
    out = tmp_path / "o"
    out.mkdir()
    (out / "_manifest.json").write_text(json.dumps({"format": 2, "options": {}}))
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(bad_data),
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(out),
            "--skip-bad-rows",
        ],
    )
    assert result.exit_code == 2 and "pass --resume" in result.output and "--overwrite" in result.output
    assert "Traceback" not in result.output
