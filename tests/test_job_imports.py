"""A batch job's first line comes before its heavy imports (issue 48, item 4): importing a job's entry point, as a
Python caller does (``from dask_lm.scoring.job import score_parquet``), loads none of the libraries that take
seconds to import, so the job's bar is on the screen within a second of the call; the job imports them once its
bar shows.

Counted, never timed: a fresh interpreter imports the entry point and lists which of those libraries it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# what takes from a few tenths of a second (pyarrow) to several seconds (torch) to import
HEAVY = ("torch", "transformers", "tokenizers", "distributed", "dask", "pandas", "pyarrow", "numpy")


def _loaded_by(statement: str) -> set[str]:
    """The libraries of :data:`HEAVY` that a fresh interpreter holds after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "statement",
    [
        "import dask_lm.scoring.job",
        "from dask_lm.scoring.job import score_parquet",
        "import dask_lm; dask_lm.score_parquet",
    ],
)
def test_the_scoring_entry_point_imports_nothing_heavy(statement):
    """``score_parquet``'s module holds the signature and the bar; the job's machinery (distributed, pyarrow) is
    imported by the call, after the bar's first line."""
    assert _loaded_by(statement) == set()


def test_the_sft_entry_point_imports_no_torch_and_no_dask():
    """``sft_parquet``'s module leaves torch (a batch's tensors) and distributed (the rows' tokenization, on the
    workers) to the functions that use them; pyarrow (its folder checks) is all it loads."""
    assert _loaded_by("from dask_lm.sft.job import sft_parquet") <= {"pyarrow", "numpy"}


def test_a_second_job_on_a_held_output_is_refused_before_distributed_loads(tmp_path):
    """The output's lock is the job's first step: a job on an output another job holds is refused before the
    job's import of distributed (a second or more), which only a job that holds its lock goes on to."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, out = tmp_path / "data.parquet", tmp_path / "out"
    pq.write_table(pa.table({"text": ["a row"]}), data)
    statement = f"""
from dask_lm.jobs.folder import OutputLock
OutputLock({str(out)!r}).acquire()  # the first job, in this process: flock's locks are per open file
from dask_lm.scoring.job import score_parquet
try:
    score_parquet({str(data)!r}, {str(out)!r}, model={str(tmp_path)!r}, text_column="text", progress=False)
except ValueError as e:
    assert "is in use by another dask-lm job" in str(e), e
else:
    raise AssertionError("not refused")
"""
    assert "distributed" not in _loaded_by(statement)


def test_the_heavy_libraries_are_seen_when_loaded():
    """The check sees what it looks for: the job's machinery loads pyarrow, its cluster module distributed."""
    assert "pyarrow" in _loaded_by("import dask_lm.scoring.run")
    assert {"distributed", "dask"} <= _loaded_by("import dask_lm.engine.cluster")
