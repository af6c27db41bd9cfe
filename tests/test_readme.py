"""The README's Python examples, run as written: every ``python`` block that is a script (it has the
``if __name__ == "__main__":`` guard a Dask script needs) runs in a fresh interpreter, in a scratch directory with
a ``data/`` parquet folder, against an offline Hugging Face cache in which ``Qwen/Qwen2.5-0.5B`` is a tiny random
Qwen2 model (Hub layout: ``models--Qwen--Qwen2.5-0.5B/refs/main`` naming a snapshot). The scripts therefore name
the model exactly as a user does, and nothing is downloaded."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.cluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
HUB_ID = "Qwen/Qwen2.5-0.5B"


def _scripts() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    out = []
    for block in blocks:
        if 'if __name__ == "__main__":' in block:
            heading = text[:text.index(block)].rsplit("\n## ", 1)[-1].split("\n", 1)[0]
            out.append((heading, block))
    return out


SCRIPTS = _scripts()


def test_the_readme_has_its_scripts():
    # scoring, policy inference, training: the test below must not pass by finding nothing
    assert [h for h, _ in SCRIPTS] == ["Scoring parquet datasets", "Python", "Training"], [h for h, _ in SCRIPTS]
    assert all(HUB_ID in block for _, block in SCRIPTS)


@pytest.fixture(scope="module")
def hub_home(tiny, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "c" * 40
    shutil.copytree(tiny["qwen2"], repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


@pytest.mark.parametrize("heading,script", SCRIPTS, ids=[h for h, _ in SCRIPTS])
def test_a_readme_script_runs_as_written(heading, script, hub_home, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    words = "the cat sat on a mat while dask ran tasks on two workers".split()
    texts = [" ".join(words[i % 5: i % 5 + 3 + i % 7]) for i in range(40)]
    pq.write_table(pa.table({"id": list(range(40)), "text": texts}), data / "part.parquet", row_group_size=10)
    (tmp_path / "example.py").write_text(script)
    env = {**os.environ, "HF_HUB_CACHE": str(hub_home), "HF_HUB_OFFLINE": "1", "DASK_LM_PROGRESS": "0"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, f"README section {heading!r}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    if heading == "Scoring parquet datasets":
        assert out.stdout.split()[0] == "40" and (tmp_path / "scores" / "_SUCCESS").exists()
    if heading == "Training":
        assert (tmp_path / "run" / "step_3" / "weights" / "tokenizer.json").exists()
