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
import tempfile

__all__ = ["demo_model", "demo_data"]


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
