"""A scoring job's numbers agree with each other: the wall time is the sum of its labelled steps, the bar's last
rate is the summary's, the bar says "loading the model" only until a worker scores, and a dashboard address is
shown only while its cluster is up. The references: the clock around the call, ``_SUCCESS`` read back, and the
text the bar wrote."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import pathlib
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli

pytestmark = pytest.mark.cluster

STEPS = ["checks", "cluster_start", "model_load", "compile", "scoring", "closing"]
ROWS = 40


def _preloads(off: bool) -> None:
    """On a worker: no replica loaded beside the checks (the job's one part loads it), or back to normal."""
    from dask_lm.scoring import replicas

    if off and not hasattr(replicas, "_real_preload"):
        replicas._real_preload = replicas.preload_replica
        replicas.preload_replica = lambda *args, **kwargs: {"error": "off for this test"}
    elif not off and hasattr(replicas, "_real_preload"):
        replicas.preload_replica = replicas._real_preload
        del replicas._real_preload


@pytest.fixture(scope="module")
def one_part_job(client, tiny, tmp_path_factory):
    """A job of one part (one row group, ``task_tokens=0``) with its bar on, whose replica loads inside that
    part: ``(result, the bar's text, time before the call, time after it)``."""
    root = tmp_path_factory.mktemp("numbers")
    data = root / "data.parquet"
    pq.write_table(
        pa.table({"id": list(range(ROWS)), "text": [f"row {i}: dask scores " * (1 + i % 3) for i in range(ROWS)]}), data
    )
    client.run(_preloads, True)
    bar = io.StringIO()
    try:
        before = time.time()
        with contextlib.redirect_stderr(bar):
            res = dask_lm.score_parquet(
                data,
                root / "out",
                model=tiny["llama"],
                client=client,
                text_column="text",
                id_column="id",
                task_tokens=0,
                progress=True,
            )
        after = time.time()
    finally:
        client.run(_preloads, False)
    assert res.parts == 1 and res.rows == ROWS
    return res, bar.getvalue(), before, after


def test_the_wall_time_is_the_sum_of_its_steps(one_part_job):
    res, _bar, before, after = one_part_job
    assert list(res.wall_phases) == STEPS
    assert all(v >= 0 for v in res.wall_phases.values()), res.wall_phases
    assert sum(res.wall_phases.values()) == pytest.approx(res.wall_seconds, abs=1e-6)
    assert before <= res.started_at and res.started_at + res.wall_seconds <= after  # the clock around the call
    assert res.wall_phases["checks"] == pytest.approx(res.prepare_seconds, abs=1e-6)
    assert res.wall_phases["scoring"] == pytest.approx(res.scoring_seconds, abs=1e-3)
    assert res.wall_phases["model_load"] + res.wall_phases["compile"] > 0  # the one part loaded the model
    done = json.loads(pathlib.Path(f"{res.output}/_SUCCESS").read_text())  # the summary the output keeps says the same
    assert done["wall_seconds"] == res.wall_seconds and done["wall_phases"] == res.wall_phases
    line = dict(res.summary())["seconds"]
    assert line.startswith(f"{res.wall_seconds:.1f} from the call's start = checks ")
    for label in ("cluster start", "model load", "compile", "scoring and writing", "closing"):
        assert f" + {label} " in line


def test_the_bar_ends_on_the_rate_the_summary_gives(one_part_job):
    res, bar, _before, _after = one_part_job
    shown = re.findall(r"([\d,]+) tok/s", bar)
    assert shown, bar[-2000:]
    assert shown[-1] == f"{res.tokens_per_s:,.0f}"
    assert res.tokens_per_s == pytest.approx(res.run_tokens / res.scoring_seconds)
    assert dict(res.summary())["tokens/s"].startswith(f"{shown[-1]} (this run's {res.run_tokens:,} tokens over ")


def test_the_bar_of_a_one_part_job_says_loading_until_the_part_scores(one_part_job):
    _res, bar, _before, _after = one_part_job
    states = [s.strip() for s in bar.replace("\n", "\r").split("\r") if s.strip()]
    counts = [re.search(r"\| (\d+)/(\d+) \[", s) for s in states]
    loading = next(i for i, s in enumerate(states) if "scoring: loading the model on" in s)
    # the part has begun (its replica is ready): the bar counts before the part's result is back
    scoring = next((i for i, m in enumerate(counts) if m and int(m[1]) < int(m[2])), None)
    done = next((i for i, m in enumerate(counts) if m and m[1] == m[2] == str(ROWS)), None)
    assert scoring is not None and done is not None, states
    assert loading < scoring < done
    assert not [s for s in states[scoring:] if "loading" in s]


def test_the_summary_after_the_call_closed_its_cluster_has_no_dashboard(tiny, tmp_path):
    """``dask-lm score`` on a local cluster of its own: the address is shown while the job runs, not in the
    summary printed after the cluster is gone; the closing is the wall time's last step."""
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["a b c", "dask scores rows", "the quick fox"]}), data)
    out = tmp_path / "out"
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
            str(out),
            "--n-workers",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = result.stdout[result.stdout.index("rows ") :]
    assert "http://" not in summary and "dashboard" not in summary, summary
    assert "watch the job on the Dask dashboard at http://" in result.stderr  # while it ran
    done = json.loads((out / "_SUCCESS").read_text())
    assert done["dashboard"] is None and sorted(done["wall_phases"]) == sorted(STEPS)  # JSON keys sorted
    assert sum(done["wall_phases"].values()) == pytest.approx(done["wall_seconds"], abs=1e-6)
    assert done["wall_phases"]["closing"] > 0  # the local cluster's close, waited for inside the call
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["dask_lm_version"] == dask_lm.__version__ == importlib.metadata.version("dask-lm")
