"""GPU tier: a fresh process's first compiled pass finds the compile in the on-disk caches (counted, not timed);
a Policy built on a GPU worker reads its weights straight into device memory and agrees with Hugging Face."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

# one rank in a fresh interpreter: build, one compiled get_logprobs, and Inductor's cache counters
_PROBE = r"""
import json, sys
import torch
from dask_lm.config import PolicyConfig
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.workers.policy_worker import PolicyWorker
from dask_lm.workers.rank_model import RankPlace
from torch._dynamo.utils import counters
cfg = PolicyConfig.from_dict({"model_name": sys.argv[1], "precision": "bfloat16", "max_total_sequence_length": 256})
w = PolicyWorker(cfg, RankPlace(0, 1), pad_token_id=0, init_optimizer=False,
                 init_reference_model=False)
if w.rank_model.compile_ahead is not None:  # the background compile's graphs counted with the call's
    w.rank_model.compile_ahead.wait()
rows = TokenRows.from_lists([[3 + (i * 7 + j) % 90 for j in range(20 + 9 * i)] for i in range(6)])
lp = w.rank_model.get_logprobs(rows, MicroBatchPlan(), 3)["logprobs"]
print("RESULT " + json.dumps({
    "compiled": bool(w.rank_model.compile),
    "hits": counters["inductor"].get("fxgraph_cache_hit", 0),
    "misses": counters["inductor"].get("fxgraph_cache_miss", 0),
    "aot_hits": counters["aot_autograd"].get("autograd_cache_hit", 0),
    "sum": float(lp.double().sum()),
}))
"""


def _probe(model_dir: str, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    p = subprocess.run([sys.executable, "-c", _PROBE, model_dir], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_fresh_process_finds_its_compile_in_the_on_disk_cache(tiny, tmp_path):
    """The first process compiles (every Inductor graph a miss, written to the cache); a second fresh process with
    the same cache folder compiles nothing again: every graph is a hit, none a miss, and the values are the same."""
    cache = str(tmp_path / "compile-cache")
    first, second = _probe(tiny["llama"], cache), _probe(tiny["llama"], cache)
    assert first["compiled"] and second["compiled"]
    assert first["misses"] > 0 and first["hits"] == 0
    assert second["misses"] == 0 and second["hits"] > 0
    assert second["sum"] == first["sum"]
