"""What each caller is told, in their own terms (dask_lm.interface): a Python caller's errors name keyword
arguments (``truncate=True``), the CLI's name flags (``--truncate``), for the same check, on the driver or on a
worker; a failing job's worker logs nothing of its own into the terminal (the error is said once, by the job);
warnings point at the caller's line, once, not once per rank."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from click.testing import CliRunner
from helpers import TEXTS, make_batch

import dask_lm
from dask_lm import BatchedDataDict
from dask_lm.cli import main as cli
from dask_lm.errors import BadRowError
from dask_lm.scoring import prescan
from dask_lm.sft.job import sft_parquet

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

ROWS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "dask runs tasks",
    "tokens have logprobs",
    None,
    "the loss goes down",
]


@pytest.fixture
def bad_data(tmp_path):
    """Six rows in two row groups; row 4 (the second group) is null."""
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": list(range(6)), "text": ROWS}), path, row_group_size=3)
    return path


def _error(result):
    """The CLI's one line of error (click's ``Error: ...``)."""
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0][len("Error: ") :]


def test_bad_arguments_name_keyword_arguments_to_python_and_flags_to_the_cli(tiny, bad_data, tmp_path):
    model, out = tiny["llama"], str(tmp_path / "out")
    score = ["score", str(bad_data), "--model", model, "--text-column", "text", "--output", out, "--no-progress"]
    with pytest.raises(ValueError) as e:
        dask_lm.score_parquet(bad_data, out, model=model, text_column="text", topk=-1)
    assert str(e.value) == "topk and task_tokens must be >= 0, max_length and batch_tokens >= 1"
    assert (
        _error(CliRunner().invoke(cli, [*score, "--topk", "-1"]))
        == "--topk and --task-tokens must be >= 0, --max-length and --batch-tokens >= 1"
    )

    with pytest.raises(ValueError) as e:
        dask_lm.score_parquet(bad_data, out, model=model, text_column="text", resume=True, overwrite=True)
    assert str(e.value) == (
        "resume=True and overwrite=True exclude each other: resume=True continues the job in "
        "output, overwrite=True deletes it and starts again; pass one of them"
    )
    assert _error(CliRunner().invoke(cli, [*score, "--resume", "--overwrite"])) == (
        "--resume and --overwrite exclude each other: --resume continues the job in --output, --overwrite deletes "
        "it and starts again; pass one of them"
    )

    with pytest.raises(ValueError) as e:
        sft_parquet(bad_data, out, model=model, text_column="text", epochs=0, progress=False)
    assert str(e.value) == "epochs must be >= 1, got 0"
    sft = ["sft", str(bad_data), "--model", model, "--text-column", "text", "--output", out, "--epochs", "0"]
    assert _error(CliRunner().invoke(cli, sft)) == "--epochs must be >= 1, got 0"

    from dask_lm import interface

    with pytest.raises(ValueError) as e:
        dask_lm.connect(n_workers=0, cluster="cpu")
    assert str(e.value) == "`n_workers` must be >= 1, got 0"
    with interface.cli(), pytest.raises(ValueError) as e:  # as the CLI's --n-workers reaches it
        dask_lm.connect(n_workers=0, cluster="cpu")
    assert str(e.value) == "--n-workers must be >= 1, got 0"
    assert interface.current() == "python" and not os.path.exists(out)


@pytest.mark.cluster
def test_a_bad_row_found_by_a_worker_is_named_in_the_callers_terms(client, tiny, bad_data, tmp_path, monkeypatch):
    # a job too large for the driver's pre-scan: the worker scoring the second row group finds the bad row, in a
    # process of its own, told how the job's caller spells options by the job's options (an attached cluster)
    monkeypatch.setattr(prescan, "PRESCAN_MAX_TOKENS", 0)
    where = f"{bad_data}: row 4, column 'text': expected a string, got null; fix the data, or "
    with pytest.raises(BadRowError) as e:
        dask_lm.score_parquet(
            bad_data,
            tmp_path / "py",
            model=tiny["llama"],
            client=client,
            text_column="text",
            task_tokens=0,
            progress=False,
        )
    assert str(e.value) == (
        where + "call again with resume=True, skip_bad_rows=True to leave bad rows out (the "
        "parts already written are kept)"
    )
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
            str(tmp_path / "cli"),
            "--task-tokens",
            "0",
            "--no-progress",
            "--scheduler-address",
            client.scheduler.address,
        ],
    )
    assert _error(result) == (
        where + "run the same command with --resume --skip-bad-rows to leave bad rows out (the "
        "parts already written are kept)"
    )
    # what each is told next names the same options
    with pytest.raises(ValueError, match=r"pass resume=True to finish it .*\(add skip_bad_rows=True to leave out"):
        dask_lm.score_parquet(
            bad_data,
            tmp_path / "py",
            model=tiny["llama"],
            client=client,
            text_column="text",
            task_tokens=0,
            progress=False,
        )


_FAILING_JOB = """
import sys

import dask_lm
from dask_lm.scoring import prescan

prescan.PRESCAN_MAX_TOKENS = 0  # the bad row is found by the worker, mid-job


def users_own_task():
    raise RuntimeError("the user's own task failed")


if __name__ == "__main__":
    client = dask_lm.connect(n_workers=1, cluster="cpu")
    try:
        try:
            dask_lm.score_parquet({data!r}, {out!r}, model={model!r}, client=client, text_column="text",
                                  task_tokens=0)
        except ValueError as e:
            print(f"raised: {{e}}", file=sys.stderr)
        try:  # the user's own task on the same cluster: its failure is logged by its worker, as Dask does
            client.submit(users_own_task, pure=False).result()
        except RuntimeError:
            pass
    finally:
        dask_lm.engine.cluster.close(client)
"""


@pytest.mark.cluster
def test_a_failing_job_prints_no_worker_log_lines_into_its_progress(tiny, bad_data, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(_FAILING_JOB.format(data=str(bad_data), out=str(tmp_path / "out"), model=tiny["llama"]))
    )
    # a Python caller's environment: not the one the CLI (invoked in this process by other tests) leaves behind
    env = {k: v for k, v in os.environ.items() if k not in ("DASK_LM_QUIET_WORKERS", "DASK_LM_INTERFACE")}
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    err = run.stderr
    assert run.returncode == 0, err
    message = f"{bad_data}: row 4, column 'text': expected a string, got null"
    assert err.count(message) == 1 and f"raised: {message}" in err, err  # said once: as the error
    assert "score_partition" not in err and "BadRowError" not in err, err  # no task repr, no worker record of it
    records = [line for line in err.splitlines() if "distributed.worker" in line]
    assert len(records) == 1 and "Compute Failed" in records[0], err  # the user's own task's, and only that
    assert "users_own_task" in err.split(records[0], 1)[1]


@pytest.mark.cluster
def test_warnings_point_at_the_callers_line_once(client, tiny, tmp_path):
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["the cat sat", "", "a dog ran"]}), data)
    os.symlink(data, tmp_path / "link.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the input named twice (a link to it): a warning from the input's resolution, then the job is refused
        with pytest.raises(ValueError, match="does not exist"):
            dask_lm.score_parquet(
                [str(data), str(tmp_path / "link.parquet")],
                tmp_path / "o1",
                model=str(tmp_path / "no-model"),
                text_column="text",
            )
        # an empty text: one row with nothing to score, said when the job ends
        dask_lm.score_parquet(
            data, tmp_path / "o2", model=tiny["llama"], client=client, text_column="text", progress=False
        )
    twice = [w for w in caught if "already in the input" in str(w.message)]
    empty = [w for w in caught if "nothing to score" in str(w.message)]
    assert len(twice) == len(empty) == 1, [str(w.message) for w in caught]
    assert twice[0].filename == empty[0].filename == __file__
    # the CLI's user did not write that line: the message alone, as errors are shown
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
            str(tmp_path / "o3"),
            "--no-progress",
            "--scheduler-address",
            client.scheduler.address,
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "Warning: 1 rows had nothing to score (an empty text, response or id list, or a single token): their "
        "num_scored is 0 and sum_logprob / mean_logprob / perplexity are null\n"
    ) in result.output
    assert "UserWarning" not in result.output and ".py:" not in result.output


@pytest.mark.cluster
def test_a_ranks_warning_reaches_the_callers_line_once(client, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    ids, lens = make_batch(tok, TEXTS)
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    cfg = {
        "model_name": tiny["llama"],
        "precision": "float32",
        "max_total_sequence_length": 128,
        "logprob_batch_size": 2,
        "generation": {"max_new_tokens": 4, "top_p": 0.5},
        "dtensor_cfg": {"sequence_parallel": True},
    }  # a key dask-lm accepts and ignores, with a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per line of the caller
        with dask_lm.Policy(
            client, cfg, tok, workers_per_node=2, init_optimizer=False, init_reference_model=False
        ) as policy:
            for _ in range(2):
                policy.get_logprobs(batch)
    ignored = [w for w in caught if "sequence_parallel" in str(w.message)]
    filtered = [w for w in caught if "generation.top_p" in str(w.message)]
    assert len(ignored) == 1 and ignored[0].filename == __file__, [str(w.message) for w in caught]
    # both ranks filtered tokens out; the caller hears it once, at their get_logprobs line
    assert len(filtered) == 1 and filtered[0].filename == __file__, [str(w.message) for w in caught]
    assert str(filtered[0].message) == (
        "generation.top_p = 0.5 filters the logprobs too, as NeMo RL applies the sampler's filters to them: a token "
        "outside the filter gets logprob 0 (as if its probability were 1), and the others are renormalised within "
        "it; set generation.top_p = 1.0 and generation.top_k = None for the model's own logprobs "
        "(get_reference_policy_logprobs never filters)"
    )
