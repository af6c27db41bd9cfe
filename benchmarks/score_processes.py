"""The whole-process arms of benchmarks/score.py: the competent user's script (``user_score.py``) and ``dask-lm
score``, each run as the user waits for it (imports, start-up, model load and exit included), timed from outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in the output:\n{text[-4000:]}")


def timed_process(cmd: list[str], what: str) -> tuple[float, float, str]:
    """Run ``cmd`` as a fresh process: (time.time() it was started at, wall seconds, its stdout)."""

    started = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return started, wall, proc.stdout


def user_process(model_dir: str, data: str, out: str, budget: int | None = None) -> dict[str, Any]:
    """The competent user's script (``user_score.py``) as a whole process: wall time, first batch, its sums;
    ``budget``: its padded tokens per batch (None: the script's default)."""
    import pyarrow.parquet as pq

    cmd = [
        sys.executable,
        os.path.join(HERE, "user_score.py"),
        model_dir,
        data,
        out,
        "--ids-column",
        "ids",
        "--id-column",
        "id",
    ]
    started, wall, stdout = timed_process(cmd + (["--budget", str(budget)] if budget else []), "user_score.py")
    info = _last_json(stdout)
    t = pq.read_table(out, columns=["id", "sum_logprob"]).to_pydict()
    return {
        "seconds": wall,
        "first_row_seconds": info["first_batch_at"] - started,
        "phases_at": info["phases_at"],
        "sums": dict(zip(t["id"], t["sum_logprob"])),
    }


def cli_process(model_dir: str, data: str, out: str, extra: list[str]) -> dict[str, Any]:
    """``dask-lm score`` (the CLI, its defaults) as a whole process: wall time, first part, start phases, sums."""
    import pyarrow.parquet as pq

    cmd = [
        sys.executable,
        "-m",
        "dask_lm",
        "score",
        data,
        "--model",
        model_dir,
        "--ids-column",
        "ids",
        "--id-column",
        "id",
        "--output",
        out,
        "--no-progress",
        *extra,
    ]
    started, wall, _stdout = timed_process(cmd, "dask-lm score")
    with open(os.path.join(out, "_SUCCESS"), encoding="utf-8") as f:
        summary = json.load(f)
    sums = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("part-"):
            t = pq.read_table(os.path.join(out, name), columns=["id", "sum_logprob"]).to_pydict()
            sums.update(zip(t["id"], t["sum_logprob"]))
    first = summary.get("first_row_at")
    return {
        "seconds": wall,
        "first_row_seconds": first - started if first else float("nan"),
        "start_phases": summary.get("start_phases") or {},
        "model_load": summary.get("model_load_seconds"),
        "model_load_phases": summary.get("model_load_phases") or {},
        "compile": summary.get("compile_seconds"),
        "scoring": summary.get("scoring_seconds"),
        "sums": sums,
        "command": " ".join(cmd[1:]),
    }


def policy_process(model_dir: str, data: str, out: str, n_workers: int = 1) -> dict[str, Any]:
    """A Policy user's batch job (``policy_logprobs.py``) as a whole process: wall time, the phases it reports, when
    its first result came, ``Policy.start_phases`` (None for a tree that has none)."""
    cmd = [sys.executable, os.path.join(HERE, "policy_logprobs.py"), model_dir, data, out]
    started, wall, stdout = timed_process(cmd + ["--n-workers", str(n_workers)], "policy_logprobs.py")
    info = _last_json(stdout)
    return {
        "seconds": wall,
        "phases_at": info["phases_at"],
        "first_result_seconds": info["first_result_at"] - started,
        "start_phases": info.get("start_phases"),
    }
