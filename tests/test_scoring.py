"""Offline scoring of parquet datasets (score_parquet / `dask-lm score`) against single-process Hugging Face."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import threading
import time

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
    f"row {i}: " + " ".join(["dask", "tokens", "score", "parquet", "model"][: 1 + i % 5]) * (1 + i % 4)
    for i in range(30)
]


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def hf(tiny):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()


@pytest.fixture()
def dataset(tmp_path):
    """Two files, the first with three row groups: four partitions."""
    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(
        pa.table({"id": list(range(20)), "text": TEXTS[:20], "lang": ["en"] * 20}), d / "a.parquet", row_group_size=7
    )
    pq.write_table(pa.table({"id": list(range(20, 30)), "text": TEXTS[20:], "lang": ["en"] * 10}), d / "b.parquet")
    return d


def _hf_row(hf, ids, start=1):
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    lsm = torch.log_softmax(logits, -1)
    lp = torch.zeros(len(ids))
    lp[1:] = lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return lp, lsm, float(lp[start:].double().sum()), len(ids) - start


def _read(out):
    parts = sorted(f for f in os.listdir(out) if f.startswith("part-"))
    return pa.concat_tables([pq.read_table(out / f) for f in parts]), parts


@pytest.mark.cluster
def test_text_mode_matches_hf_with_schema_and_topk(client, tiny, tok, hf, dataset, tmp_path):
    out = tmp_path / "out"
    res = dask_lm.score_parquet(
        dataset, out, model=tiny["llama"], client=client, text_column="text", topk=3, progress=False
    )
    table, parts = _read(out)
    # two files: the small row groups of each are merged into one task (dask_lm.scoring.spans), one part per file
    assert parts == [f"part-{i:05d}.parquet" for i in range(2)] and res.parts == 2 and res.rows == 30
    assert {"_manifest.json", "_SUCCESS"} <= set(os.listdir(out))
    # worker time per phase, summed over the parts: each phase ran, and all of it fits in the job's worker time
    assert set(res.phase_seconds) == {"rows", "model", "output"} and min(res.phase_seconds.values()) > 0
    assert sum(res.phase_seconds.values()) <= res.seconds * len(client.scheduler_info(n_workers=-1)["workers"])
    schema = table.schema
    assert schema.field("num_tokens").type == pa.int32() and schema.field("num_scored").type == pa.int32()
    assert schema.field("truncated").type == pa.bool_()
    assert schema.field("logprobs").type == pa.list_(pa.float32())
    assert schema.field("sum_logprob").type == pa.float64()
    assert schema.field("topk_ids").type == pa.list_(pa.list_(pa.int32()))
    assert schema.field("topk_logprobs").type == pa.list_(pa.list_(pa.float32()))
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == list(range(30))  # every row once, input order within and across parts
    assert all(r["lang"] == "en" for r in rows)  # all input columns kept without --id-column
    assert schema.field("is_greedy").type == pa.bool_()
    for r in rows:
        # lm-evaluation-harness's convention: a text is scored whole, its first token given BOS (which this
        # tokenizer does not add itself)
        ids = [tok.bos_token_id] + tok(TEXTS[r["id"]])["input_ids"]
        lp, lsm, total, n = _hf_row(hf, ids)
        assert r["num_tokens"] == len(ids) and r["num_scored"] == n and not r["truncated"]
        assert r["is_greedy"] == bool((lsm[:-1].argmax(-1) == torch.tensor(ids[1:])).all())
        torch.testing.assert_close(torch.tensor(r["logprobs"]), lp, atol=1e-4, rtol=0)
        assert r["sum_logprob"] == pytest.approx(total, abs=1e-3)
        assert r["mean_logprob"] == pytest.approx(total / n, abs=1e-4)
        assert r["perplexity"] == pytest.approx(float(torch.exp(torch.tensor(-total / n))), rel=1e-4)
        top = torch.topk(lsm, 3, dim=-1)
        assert r["topk_ids"] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(r["topk_logprobs"]), top.values, atol=1e-4, rtol=0)


@pytest.mark.cluster
def test_job_is_a_dask_span_with_its_tokens_and_writes_a_performance_report(client, tiny, dataset, tmp_path):
    report = tmp_path / "report.html"
    res = dask_lm.score_parquet(
        dataset,
        tmp_path / "out",
        model=tiny["llama"],
        client=client,
        text_column="text",
        progress=False,
        performance_report=str(report),
    )
    assert report.exists() and report.stat().st_size > 1000

    def span_tokens(dask_scheduler):
        return sum(
            v
            for span in dask_scheduler.extensions["spans"].spans.values()
            if span.name and span.name[-1] == "dask-lm/score"
            for k, v in span.cumulative_worker_metrics.items()
            if k[-2:] == ("tokens", "count")
        )

    deadline = time.time() + 20  # worker metrics reach the scheduler with the heartbeat
    while time.time() < deadline and client.run_on_scheduler(span_tokens) < res.tokens:
        time.sleep(0.5)
    assert client.run_on_scheduler(span_tokens) >= res.tokens > 0


@pytest.mark.cluster
def test_ids_and_prompt_response_modes(client, tiny, tok, hf, tmp_path):
    data = tmp_path / "pr.parquet"
    prompts, responses = TEXTS[:6], [t.upper()[:20] for t in TEXTS[6:12]]
    ids_col = [tok(p)["input_ids"] for p in prompts]
    pq.write_table(
        pa.table(
            {
                "key": [f"k{i}" for i in range(6)],
                "prompt": prompts,
                "response": responses,
                "ids": pa.array(ids_col, pa.list_(pa.int64())),
            }
        ),
        data,
    )
    out_pr, out_ids = tmp_path / "pr", tmp_path / "ids"
    dask_lm.score_parquet(
        data,
        out_pr,
        model=tiny["llama"],
        client=client,
        prompt_column="prompt",
        response_column="response",
        id_column="key",
        progress=False,
    )
    dask_lm.score_parquet(
        data, out_ids, model=tiny["llama"], client=client, ids_column="ids", id_column="key", progress=False
    )
    pr, _ = _read(out_pr)
    assert pr.column_names[0] == "key" and "prompt" not in pr.column_names
    for i, r in enumerate(pr.to_pylist()):
        p = tok(prompts[i])["input_ids"]
        full = p + tok(responses[i], add_special_tokens=False)["input_ids"]
        _lp, _lsm, total, n = _hf_row(hf, full, start=len(p))  # only response tokens, given the prompt
        assert r["num_tokens"] == len(full) and r["sum_logprob"] == pytest.approx(total, abs=1e-3)
        assert r["mean_logprob"] == pytest.approx(total / n, abs=1e-4)
    for i, r in enumerate(_read(out_ids)[0].to_pylist()):
        assert r["sum_logprob"] == pytest.approx(_hf_row(hf, ids_col[i])[2], abs=1e-3)


def test_bad_input_exit_2_and_nothing_written(tiny, dataset, tmp_path):
    runner = CliRunner()
    (tmp_path / "junk.parquet").write_text("not parquet")
    no_weights = tmp_path / "empty_model"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    out = tmp_path / "out"
    cases = [
        ([str(tmp_path / "missing.parquet"), "--text-column", "text"], "does not exist"),
        ([str(tmp_path / "junk.parquet"), "--text-column", "text"], "not a readable parquet file"),
        ([str(dataset), "--text-column", "body"], "column 'body' is missing"),
        ([str(dataset), "--text-column", "id"], "a text column must be string"),
        ([str(dataset), "--ids-column", "text"], "an ids column must be list<int>"),
        ([str(dataset), "--text-column", "text", "--ids-column", "id"], "exactly one of"),
    ]
    for args, message in cases:
        result = runner.invoke(cli, ["score", *args, "--model", tiny["llama"], "--output", str(out)])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output, result.output
    # --verbose adds the traceback, not another exit code
    result = runner.invoke(
        cli, ["-v", "score", str(dataset), "--text-column", "body", "--model", tiny["llama"], "--output", str(out)]
    )
    assert result.exit_code == 2 and "Traceback" in result.output and "column 'body' is missing" in result.output
    result = runner.invoke(
        cli, ["score", str(dataset), "--text-column", "text", "--model", str(no_weights), "--output", str(out)]
    )
    assert result.exit_code == 2 and "has no weights" in result.output
    # without --resume INPUTS and --model are required (click's usage error); with it, a folder that holds no
    # job has nothing to take them from
    result = runner.invoke(cli, ["score", str(dataset), "--text-column", "text", "--output", str(out)])
    assert result.exit_code == 2 and "Missing option '--model'" in result.output
    result = runner.invoke(cli, ["score", "--output", str(out), "--resume"])
    assert result.exit_code == 2 and result.output.strip() == (
        f"Error: --resume: nothing to resume in {out}: it holds no _manifest.json (no dask-lm scoring job was "
        "started there), so the inputs and --model cannot be taken from it; pass the --output of the job to resume, "
        "or give the inputs, --model and the options to start one"
    )
    assert not out.exists()


@pytest.mark.cluster
def test_bad_rows_fail_or_are_skipped(client, tiny, tok, tmp_path):
    data = tmp_path / "bad.parquet"
    texts = ["fine text", None, "", "also fine", "ok"]
    pq.write_table(pa.table({"id": [0, 1, 2, 3, 4], "text": texts}), data)
    with pytest.raises(ValueError, match=r"bad.parquet: row 1, column 'text': expected a string, got null"):
        dask_lm.score_parquet(
            data, tmp_path / "o1", model=tiny["llama"], client=client, text_column="text", progress=False
        )
    assert not (tmp_path / "o1" / "_SUCCESS").exists()
    with pytest.warns(UserWarning, match="nothing to score"):
        res = dask_lm.score_parquet(
            data,
            tmp_path / "o2",
            model=tiny["llama"],
            client=client,
            text_column="text",
            skip_bad_rows=True,
            max_length=3,
            progress=False,
        )
    table, _ = _read(tmp_path / "o2")
    errors = pq.read_table(tmp_path / "o2" / "_errors.parquet").to_pylist()
    long_rows = {i for i, t in enumerate(texts) if t is not None and 1 + len(tok(t)["input_ids"]) > 3}  # + BOS
    assert {e["row"] for e in errors} == {1} | long_rows and res.bad_rows == len(errors)
    assert all("more than max_length=3" in e["error"] for e in errors if e["row"] != 1)
    # the empty text is not a bad row: it is written, flagged by num_scored 0 and null sums
    assert sorted(table.column("id").to_pylist()) == sorted(set(range(5)) - {1} - long_rows)
    (empty,) = [r for r in table.to_pylist() if r["id"] == 2]
    assert empty["num_scored"] == 0 and empty["num_tokens"] == 1 and empty["sum_logprob"] is None  # BOS alone


@pytest.mark.cluster
def test_resume_finishes_only_missing_parts_and_refuses_changes(client, tiny, dataset, tmp_path):
    """One part per row group as written (task_tokens=0), so that the parts are known to the test. The resumes
    give nothing but the output: inputs, model, columns, --topk and --task-tokens are the manifest's."""
    out = tmp_path / "out"
    first = dask_lm.score_parquet(
        dataset, out, model=tiny["llama"], client=client, text_column="text", topk=2, progress=False, task_tokens=0
    )
    before = {f: (out / f).read_bytes() for f in os.listdir(out) if f.startswith("part-")}
    os.remove(out / "part-00002.parquet")
    os.remove(out / "_SUCCESS")  # as if the job had died before its last part
    kept = os.stat(out / "part-00000.parquet").st_mtime_ns
    # a given option that differs is refused, naming it, before anything starts
    with pytest.raises(ValueError, match=r"resume=True refused: .* different options: topk was 2, now 3 "):
        dask_lm.score_parquet(None, out, client=None, resume=True, topk=3, progress=False)
    again = dask_lm.score_parquet(None, out, client=client, resume=True, progress=False)
    # the part scored again is the uninterrupted run's, value for value, and every row is there once
    assert pq.read_table(out / "part-00002.parquet").equals(
        pq.read_table(pa.BufferReader(before["part-00002.parquet"]))
    )
    assert sorted(_read(out)[0].column("id").to_pylist()) == list(range(30))
    # row groups of 7, 7, 6 and 10: the totals are the output's (all 30 rows), this run's 6 apart
    assert again.parts_skipped == 3 and (again.rows, again.run_rows) == (30, 6) and first.rows == first.run_rows == 30
    parts = pa.concat_tables(pq.read_table(out / f"part-{i:05d}.parquet") for i in range(4))
    success = json.loads((out / "_SUCCESS").read_text())
    assert (success["rows"], success["tokens"]) == (parts.num_rows, sum(parts.column("num_tokens").to_pylist()))
    assert (again.tokens, success["run_rows"]) == (success["tokens"], 6) and again.tokens > again.run_tokens > 0
    assert dict(again.summary())["rows"] == "30 (6 scored by this run)"
    done = dask_lm.score_parquet(
        dataset, out, model=tiny["llama"], client=client, text_column="text", resume=True, progress=False, task_tokens=0
    )
    assert done.already_complete and (done.rows, done.tokens, done.run_rows) == (30, success["tokens"], 0)
    assert os.stat(out / "part-00000.parquet").st_mtime_ns == kept
    assert pq.read_table(out / "part-00002.parquet").equals(
        pq.read_table(pa.BufferReader(before["part-00002.parquet"]))
    )
    assert (out / "_SUCCESS").exists()
    with pytest.raises(ValueError, match=r"resume=True refused.*options"):
        dask_lm.score_parquet(
            dataset,
            out,
            model=tiny["llama"],
            client=client,
            text_column="text",
            topk=3,
            resume=True,
            progress=False,
            task_tokens=0,
        )
    # the CLI alike: `--output DIR --resume` alone finishes the job (the cluster from DASK_SCHEDULER_ADDRESS)
    os.remove(out / "part-00001.parquet")
    os.remove(out / "_SUCCESS")
    env = {"DASK_SCHEDULER_ADDRESS": client.scheduler.address, "DASK_LM_PROGRESS": "0"}
    refused = CliRunner().invoke(cli, ["score", "--output", str(out), "--resume", "--text-column", "lang"], env=env)
    assert refused.exit_code == 2 and "--text-column was 'text', now 'lang'" in refused.output, refused.output
    result = CliRunner().invoke(cli, ["score", "--output", str(out), "--resume"], env=env)
    assert result.exit_code == 0, result.output
    assert "30 (7 scored by this run)" in result.output and re.search(r"parts +4 \(3 already done\)", result.output)
    assert pq.read_table(out / "part-00001.parquet").equals(
        pq.read_table(pa.BufferReader(before["part-00001.parquet"]))
    )
    assert sorted(_read(out)[0].column("id").to_pylist()) == list(range(30))
    with pytest.raises(ValueError, match=r"resume=True refused.*model"):
        dask_lm.score_parquet(
            dataset,
            out,
            model=tiny["llama_tuned"],
            client=client,
            text_column="text",
            resume=True,
            progress=False,
            task_tokens=0,
        )
    with pytest.raises(ValueError, match=r"holds a finished dask-lm scoring job.*resume=True.*overwrite=True"):
        dask_lm.score_parquet(
            dataset, out, model=tiny["llama"], client=client, text_column="text", progress=False, task_tokens=0
        )


def _limit_file_size(limit):
    """Set this process's file size limit (RLIMIT_FSIZE); the limit it had. A write past it fails with EFBIG,
    as one on a full disk fails with ENOSPC (Python ignores the SIGXFSZ that comes with it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return soft


@pytest.mark.cluster
def test_a_part_that_cannot_be_written_is_named_with_the_fix(client, tiny, dataset, tmp_path):
    """The workers' part writes fail in the operating system (a 1 KiB file size limit: every part file is
    larger), through the real writer: exit 1 and one line naming the part, its path, the reason and the fix; no
    temporary file left, nothing under a part's name; once there is room, `--resume` scores every row once."""
    out = tmp_path / "out"
    limits = client.run(_limit_file_size, 1024)
    try:
        result = CliRunner().invoke(
            cli,
            [
                "score",
                str(dataset),
                "--model",
                tiny["llama"],
                "--text-column",
                "text",
                "--output",
                str(out),
                "--task-tokens",
                "0",
                "--no-progress",
                "--scheduler-address",
                client.scheduler.address,
            ],
        )
    finally:
        # the job's other task may still be running (a cancelled task is not stopped): the limit stays until the
        # workers are idle, so that no part appears, and no temporary is seen half-written, after the command
        deadline = time.time() + 120
        while any(client.processing().values()) and time.time() < deadline:
            time.sleep(0.1)
        for address, soft in limits.items():
            client.run(_limit_file_size, soft, workers=[address])
    assert result.exit_code == 1, result.output
    match = re.match(r"Error: PartWriteError: could not write (part-\d{5}\.parquet) ", result.output)
    assert match, result.output
    name = match.group(1)
    assert result.output == (
        f"Error: PartWriteError: could not write {name} ({out / name}): "
        f"{os.strerror(errno.EFBIG)}; free space (or fix what the reason names), then run the "
        "same command with --resume; the parts already written are kept\n"
    )
    assert sorted(os.listdir(out)) == [".dask-lm.lock", "_errors", "_manifest.json"]  # no part, no temporary
    assert os.listdir(out / "_errors") == []
    done = CliRunner().invoke(
        cli,
        ["score", "--output", str(out), "--resume", "--no-progress", "--scheduler-address", client.scheduler.address],
    )
    assert done.exit_code == 0, done.output
    assert sorted(_read(out)[0].column("id").to_pylist()) == list(range(30))


@pytest.mark.cluster
def test_a_killed_worker_costs_a_retry_not_a_row(tiny, tmp_path):
    """SIGKILL one of two workers mid-job: its partitions run again (elsewhere, or on it after the nanny restarts
    it) and the output holds every input row exactly once. The rows are one row group, as pandas writes a file,
    split into tasks of about 50 estimated tokens (the estimate sees the dictionary-encoded texts: about a tenth
    of the real tokens): the split spans share one read, and each is retried on its own."""
    d = tmp_path / "data"
    d.mkdir()
    n = 240
    pq.write_table(pa.table({"id": list(range(n)), "text": [TEXTS[i % 30] * 3 for i in range(n)]}), d / "a.parquet")
    assert pq.ParquetFile(d / "a.parquet").metadata.num_row_groups == 1
    out = tmp_path / "out"
    client = dask_lm.connect(n_workers=2, cluster="cpu")
    try:
        pids = client.run(os.getpid)
        victim = sorted(pids.values())[0]

        def kill_when_started():
            deadline = time.time() + 120
            while time.time() < deadline:
                if out.exists() and any(f.startswith("part-") for f in os.listdir(out)):
                    os.kill(victim, signal.SIGKILL)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_started)
        killer.start()
        res = dask_lm.score_parquet(
            d,
            out,
            model=tiny["llama"],
            client=client,
            text_column="text",
            id_column="id",
            batch_tokens=64,
            task_tokens=50,
            progress=False,
        )
        killer.join()
        assert victim not in client.run(os.getpid).values()  # the worker really died (and was replaced)
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
    ids = _read(out)[0].column("id").to_pylist()
    assert sorted(ids) == list(range(n)) and res.parts >= 12  # one row group, cut into many tasks
    assert not [f for f in os.listdir(out) if ".tmp-" in f]


@pytest.mark.cluster
def test_cli_attaches_to_a_separately_started_cluster(tiny, dataset, tmp_path, attached_cluster):
    sched_file = attached_cluster(1)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(dataset),
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(out),
            "--scheduler-address",
            str(sched_file),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "rows" in result.output and json.loads((out / "_SUCCESS").read_text())["rows"] == 30


@pytest.mark.cluster
def test_a_file_without_rows_adds_nothing_whatever_its_column_types(client, tiny, tmp_path):
    """pandas writes an empty object column with arrow's ``null`` type: such a file holds no row to score, so it
    neither fails the job nor changes what the other files give. A column it lacks is still named."""
    import pandas as pd

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(
        pa.table({"id": [0, 1, 2], "text": ["a b c", "dask scores rows", "the quick fox"]}), data / "a.parquet"
    )
    pd.DataFrame({"id": pd.Series([], dtype="int64"), "text": pd.Series([], dtype=object)}).to_parquet(
        data / "b.parquet", index=False
    )
    assert pq.read_schema(data / "b.parquet").field("text").type == pa.null()
    res = dask_lm.score_parquet(
        data, tmp_path / "out", model=tiny["llama"], client=client, text_column="text", id_column="id", progress=False
    )
    assert res.rows == 3 and sorted(_read(tmp_path / "out")[0]["id"].to_pylist()) == [0, 1, 2]
    pd.DataFrame({"id": pd.Series([], dtype="int64")}).to_parquet(data / "c.parquet", index=False)
    with pytest.raises(ValueError, match=r"c.parquet.*'text'"):
        dask_lm.score_parquet(
            data, tmp_path / "out2", model=tiny["llama"], client=client, text_column="text", progress=False
        )
