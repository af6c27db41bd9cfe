"""Start-up, as the user waits for it: whole processes, each pair side by side in one run, and where the time went.

A benchmark, not a test. On the same parquet rows and model, it runs as fresh processes, ``--repeats`` times each
and in turns (so that a machine's drift spreads over all of them):

* the competent user's script (``user_score.py``: length-sorted token-budget batches, sdpa, bf16);
* a Policy user's batch job (``policy_logprobs.py``: ``connect()``, ``Policy(...)``, one ``get_logprobs`` of the
  set, write the sums, exit), with ``Policy.start_phases`` (each process's steps);
* ``dask-lm score`` cold (a fresh local cluster, the CLI's defaults), with its ``start_phases``;
* with ``--warm-cluster`` (the default), the Policy job and ``dask-lm score`` again on this tree, on a warm local
  cluster started once before them (``dask-lm cluster start``, its start timed apart);

and, with ``--base-tree DIR`` (a checkout's root, or a folder holding its ``dask_lm`` package), the two dask-lm
processes again on that tree: before and after, from one run on one machine. Then, in a fresh process on this tree,
the compile's cost: a Policy rank's first ``get_logprobs`` against the same call warm, with the on-disk compile
caches cold and then warm.

Examples
--------
    python benchmarks/start.py --shape qwen2.5-0.5b
    python benchmarks/start.py --shape qwen2.5-1.5b --base-tree /tmp/main-before --repeats 2
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import click
from common import SHAPE_CHOICES, build_model, make_rows

HERE = os.path.dirname(os.path.abspath(__file__))

# one rank's first and later get_logprobs in a fresh process (imports and the model's build timed apart)
_COMPILE_PROBE = r"""
import json, sys, time
t = time.perf_counter
import torch
from dask_lm.config import PolicyConfig
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.workers.policy_worker import PolicyWorker
from dask_lm.workers.rank_model import RankPlace
from torch._dynamo.utils import counters
cfg = PolicyConfig.from_dict({"model_name": sys.argv[1], "precision": "bfloat16", "max_total_sequence_length": 2048})
s = t()
w = PolicyWorker(cfg, RankPlace(0, 1), pad_token_id=0,
                 init_optimizer=False, init_reference_model=False)
torch.cuda.synchronize()
out = {"build": t() - s}
g = torch.Generator().manual_seed(0)
rows = TokenRows.from_lists([torch.randint(3, 1000, (int(n),), generator=g).tolist()
                             for n in torch.randint(16, 1024, (256,), generator=g)])
for i in range(3):
    s = t(); w.rank_model.get_logprobs(rows, MicroBatchPlan(), 16); torch.cuda.synchronize()
    out[f"call {i}"] = t() - s
out["fx graph cache hits"] = counters["inductor"].get("fxgraph_cache_hit", 0)
out["fx graph cache misses"] = counters["inductor"].get("fxgraph_cache_miss", 0)
print("RESULT " + json.dumps(out))
"""


def _tree_env(tree: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    return env


def _with_tree(tree: str | None, fn: Any, *args: Any) -> Any:
    saved, env = dict(os.environ), _tree_env(tree)
    os.environ.clear()
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def compile_probe(model_dir: str, cache: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    p = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, model_dir], capture_output=True, text=True, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"compile probe failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="qwen2.5-0.5b", show_default=True)
@click.option("--num-rows", type=int, default=2048, show_default=True)
@click.option("--repeats", type=int, default=1, show_default=True, help="Runs of each process, taken in turns.")
@click.option("--base-tree", default=None, help="A tree to run the dask-lm processes on as well (before / after).")
@click.option("--score/--no-score", default=True, show_default=True, help="Also time `dask-lm score` cold.")
@click.option("--compile-probe/--no-compile-probe", "probe", default=True, show_default=True)
@click.option(
    "--warm-cluster/--no-warm-cluster",
    "warm",
    default=True,
    show_default=True,
    help="Also run the dask-lm processes (this tree) on a warm local cluster (`dask-lm cluster start`).",
)
def main(shape: str, num_rows: int, repeats: int, base_tree: str | None, score: bool, probe: bool, warm: bool) -> None:
    import transformers
    from score import write_dataset
    from score_processes import cli_process, policy_process, timed_process, user_process

    root = tempfile.mkdtemp(prefix="dask-lm-start-")
    # a warm cluster of this benchmark's own (none of the user's is found by the cold arms)
    os.environ["DASK_LM_CACHE_DIR"] = os.path.join(root, "cache")
    model_dir = build_model(shape, root, 2048)
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    ids, lens = make_rows(num_rows, 16, 2048, 256, 1.0, vocab, 0, 0)
    data = write_dataset(root, ids, lens, 4, None)
    print(f"model {shape}; {num_rows} rows, {int(lens.sum())} tokens", flush=True)
    # one throw-away process first: every arm finds torch's and transformers' files in the page cache alike
    timed_process([sys.executable, "-c", "import torch, transformers, dask, distributed"], "page cache")
    trees = [("this tree", None)] + ([("base tree", base_tree)] if base_tree else [])
    runs: dict[str, list[dict[str, Any]]] = {}
    for i in range(repeats):
        runs.setdefault("user", []).append(user_process(model_dir, data, os.path.join(root, f"user{i}.parquet")))
        print(f"user: {runs['user'][-1]['seconds']:.2f} s", flush=True)
        for label, tree in trees:
            out = os.path.join(root, f"policy-{label}-{i}.parquet")
            runs.setdefault(f"policy, {label}", []).append(_with_tree(tree, policy_process, model_dir, data, out))
            print(f"policy, {label}: " + json.dumps(runs[f"policy, {label}"][-1], default=str), flush=True)
            if score:
                out = os.path.join(root, f"score-{label}-{i}")
                runs.setdefault(f"score, {label}", []).append(_with_tree(tree, cli_process, model_dir, data, out, []))
    if warm:
        _, up, _ = timed_process(
            [sys.executable, "-m", "dask_lm", "cluster", "start", "--n-workers", "1"], "dask-lm cluster start"
        )
        print(f"dask-lm cluster start: {up:.1f} s (once; not in the processes below)", flush=True)
        try:
            for i in range(repeats):
                out = os.path.join(root, f"policy-warm-{i}.parquet")
                runs.setdefault("policy, warm cluster", []).append(policy_process(model_dir, data, out))
                print("policy, warm cluster: " + json.dumps(runs["policy, warm cluster"][-1], default=str), flush=True)
                if score:
                    out = os.path.join(root, f"score-warm-{i}")
                    runs.setdefault("score, warm cluster", []).append(cli_process(model_dir, data, out, []))
        finally:
            timed_process([sys.executable, "-m", "dask_lm", "cluster", "stop"], "dask-lm cluster stop")
    user = _median(runs["user"], "seconds")
    print(f"\n| process | wall (median of {repeats}) | against the user's script |")
    print("|---|---|---|")
    print(f"| user's script | {user:.1f} s | 1.00x |")
    for name, rs in runs.items():
        if name != "user":
            wall = _median(rs, "seconds")
            print(f"| {name} | {wall:.1f} s | {user / wall:.2f}x |")
    for name, rs in runs.items():
        if name.startswith("policy"):
            phases = rs[-1]["phases_at"]
            print(f"\n{name}: phases ended at " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
            if rs[-1].get("start_phases"):
                print("Policy.start_phases: " + json.dumps(rs[-1]["start_phases"]))
        if name.startswith("score"):
            print(f"\n{name}: start_phases " + json.dumps({k: round(v, 2) for k, v in rs[-1]["start_phases"].items()}))
    if probe:
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = compile_probe(model_dir, cache), compile_probe(model_dir, cache)
        print("\none rank, fresh process: seconds of the model's build and of three get_logprobs calls (256 rows)")
        print("| compile caches | build | first call | second | third | first / third |")
        print("|---|---|---|---|---|---|")
        for label, r in (("cold", cold), ("warm (on disk)", warm)):
            print(
                f"| {label} | {r['build']:.2f} | {r['call 0']:.2f} | {r['call 1']:.2f} | {r['call 2']:.2f} | "
                f"{r['call 0'] / r['call 2']:.1f}x |"
            )
    print(
        "\nRESULT "
        + json.dumps(
            {k: [{kk: vv for kk, vv in r.items() if kk != "sums"} for r in v] for k, v in runs.items()}, default=str
        )
    )


if __name__ == "__main__":
    main()
