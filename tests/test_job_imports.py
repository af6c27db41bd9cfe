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


def test_the_heavy_libraries_are_seen_when_loaded():
    """The check sees what it looks for: importing the scoring job's machinery loads distributed and pyarrow."""
    assert {"distributed", "pyarrow"} <= _loaded_by("import dask_lm.scoring.run")
