"""The demo's model and data, built on this machine without a download: what ``dask-lm demo`` scores, and what
every example in the docs runs on, so a newcomer can run each one as written before pointing it at a real model.

``demo_model()`` is a tiny random Llama with a byte-level BPE tokenizer trained on the spot (``dask_lm.tiny``),
saved with ``save_pretrained`` under the cache directory (``$DASK_LM_CACHE_DIR``, else ``~/.cache/dask-lm``);
``demo_data()`` is a folder of two parquet files (``id`` int64, ``text`` string). Both are built once, aside under a
temporary name and renamed into place when complete (a concurrent or interrupted build never leaves half a model
under the final name), and returned as paths on later calls. The numbers a random model gives are meaningless;
the shapes, files and commands are the real ones.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

__all__ = ["demo_model", "demo_data", "next_steps"]


def demo_model() -> str:
    """The path of the demo's tiny random Llama model directory (config, safetensors weights, tokenizer), built
    the first time (a few seconds, offline) and reused after. Pass it wherever a model is named
    (``--model``, ``model=``, ``policy.model_name``)."""
    from dask_lm.io.local_cache import cache_root

    root = os.path.join(cache_root(), "tiny-llama")
    if os.path.exists(os.path.join(root, "config.json")):
        return root
    import transformers

    from dask_lm.tiny import build_tiny_model, train_tiny_tokenizer

    transformers.utils.logging.disable_progress_bar()
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)  # built aside, renamed into place when complete
    try:
        tok = train_tiny_tokenizer(os.path.join(tmp, "tokenizer"))
        build_tiny_model(os.path.join(tmp, "model"), family="llama", tokenizer_path=tok)
        try:
            os.replace(os.path.join(tmp, "model"), root)
        except OSError:  # another process finished first: its model is as good
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


_WORDS = [
    "dask",
    "cluster",
    "worker",
    "task",
    "graph",
    "token",
    "model",
    "parquet",
    "column",
    "row",
    "score",
    "batch",
    "gpu",
    "rank",
    "shard",
    "log",
    "probability",
    "language",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "on",
    "with",
    "for",
]


def demo_data(rows: int = 512) -> str:
    """The path of a folder of sample sentences: ``a.parquet`` and ``b.parquet``, columns ``id`` (int64) and
    ``text`` (string), ``rows`` rows in all in row groups of 64, built once per row count (seeded: the same rows on
    every machine)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dask_lm.io.local_cache import cache_root

    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
        raise ValueError(f"rows must be an integer >= 2, got {rows!r}")
    directory = os.path.join(cache_root(), "demo")
    target = os.path.join(directory, f"data-{rows}")
    if os.path.isdir(target):
        return target
    rng = random.Random(0)
    texts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 60))) for _ in range(rows)]
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=directory)  # complete before it gets its name
    half = rows // 2
    for name, lo, hi in (("a.parquet", 0, half), ("b.parquet", half, rows)):
        pq.write_table(
            pa.table({"id": list(range(lo, hi)), "text": texts[lo:hi]}), os.path.join(tmp, name), row_group_size=64
        )
    try:
        os.replace(tmp, target)
    except OSError:  # built by a concurrent demo
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def next_steps(model_dir: str, data: str) -> list[str]:
    """The demo's last lines: what to type next on this machine, as printed (a shell runs them, comments and all;
    tests/test_first_day.py does): score a file with the demo's model, shown on one of the demo's own files, into a
    new folder of the current directory, then read it back."""
    import shlex

    output = next(
        name for name in ("my-scores", *(f"my-scores-{i}" for i in range(2, 1000))) if not os.path.exists(name)
    )
    python = _python()
    # ``dask-lm`` where the one on PATH is this environment's (beside this python, or the script running now);
    # else the module, run by this interpreter
    script = shutil.which("dask-lm")
    here = script is not None and (
        os.path.dirname(os.path.abspath(script)) == os.path.dirname(sys.executable)
        or os.path.abspath(script) == os.path.abspath(sys.argv[0])
    )
    command = "dask-lm" if here else f"{python} -m dask_lm"
    read = f"import dask_lm; print(dask_lm.read_scores({output!r}))"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a clone's, where dask-lm runs from one
    where = (
        os.path.join(repo, "docs", "quickstart.md")
        if os.path.isfile(os.path.join(repo, "pyproject.toml")) and os.path.isdir(os.path.join(repo, "docs"))
        else "docs/quickstart.md in the dask-lm repository"
    )
    sample, model = (shlex.quote(os.path.abspath(p)) for p in (os.path.join(data, "a.parquet"), model_dir))
    return [
        "",
        "next:",
        "  # score a parquet file of your own with this model (--text-column names your text column); on a demo file:",
        f"  {command} score {sample} --model {model} --text-column text --output {output}",
        "  # read the scores back as a pandas DataFrame (one row per input row, in input order):",
        f'  {python} -c "{read}"',
        f"  # more: {where}",
    ]


def _python() -> str:
    """This interpreter as the shell should name it: ``python`` / ``python3`` where that is the one on PATH (an
    activated environment), else its full path. Paths are compared unresolved: a virtualenv's python is a symlink
    to the system's, whose packages differ."""
    import shlex

    for name in ("python", "python3"):
        found = shutil.which(name)
        if found is not None and os.path.abspath(found) == os.path.abspath(sys.executable):
            return name
    return shlex.quote(sys.executable)
