"""A Policy user's whole process: start a cluster, build ``dask_lm.Policy``, ``get_logprobs`` of a parquet
dataset, write the sums, exit. ``benchmarks/logprobs.py --processes`` runs it beside the competent user's script
(``benchmarks/user_score.py``) on the same files and compares the two wall times, as the user waits for them.

Written as a user of the Python API would, with the defaults: ``dask_lm.connect()`` (one worker per GPU, or
``--n-workers``), a config naming only the model, its precision and the longest row, and one ``get_logprobs``
call on the whole set (the Policy shards it, packs micro-batches and compiles as it decides). It writes ``id``,
``num_tokens`` and ``sum_logprob`` (tokens 1.. given the ones before, as ``user_score.py``) to one parquet file and
prints one JSON line: seconds since its start at each phase, and ``first_result_at`` / ``end_at`` as
``time.time()`` stamps.

    python benchmarks/policy_logprobs.py MODEL_DIR DATA_DIR OUT.parquet --ids-column ids --id-column id
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402  (the clock starts before the imports: they are part of what the user waits for)
import json  # noqa: E402
import os  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("data", help="a parquet file or a folder of them")
    p.add_argument("out", help="the parquet file to write")
    p.add_argument("--ids-column", default="ids")
    p.add_argument("--id-column", default="id")
    p.add_argument("--n-workers", type=int, default=None)
    a = p.parse_args()
    phases: dict[str, float] = {}

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    import dask_lm
    from dask_lm import BatchedDataDict

    phases["imports"] = time.perf_counter() - T0

    files = sorted(os.path.join(a.data, f) for f in os.listdir(a.data)) if os.path.isdir(a.data) else [a.data]
    table = pa.concat_tables(pq.read_table(f, columns=[a.id_column, a.ids_column]) for f in files)
    rows = table[a.ids_column].to_pylist()
    lens = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)  # right-padded, as a BatchedDataDict wants
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    phases["read"] = time.perf_counter() - T0

    client = dask_lm.connect(n_workers=a.n_workers)
    phases["cluster"] = time.perf_counter() - T0
    try:
        config = {
            "model_name": a.model,
            "precision": "bfloat16" if torch.cuda.is_available() else "float32",
            "max_total_sequence_length": int(lens.max()),
        }
        policy = dask_lm.Policy(client, config, None, init_optimizer=False, init_reference_model=False)
        phases["policy"] = time.perf_counter() - T0
        start_phases = getattr(policy, "start_phases", None)  # where the Policy's start went, per process
        logprobs = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        first_result_at = time.time()
        phases["logprobs"] = time.perf_counter() - T0
        policy.shutdown()
    finally:
        client.close()
        if client.cluster is not None:
            client.cluster.close()
    phases["shutdown"] = time.perf_counter() - T0
    pos = torch.arange(ids.shape[1])[None, :]
    sums = (logprobs.double() * ((pos >= 1) & (pos < lens[:, None]))).sum(1)
    pq.write_table(pa.table({"id": table[a.id_column], "num_tokens": lens.numpy(), "sum_logprob": sums.numpy()}), a.out)
    phases["written"] = time.perf_counter() - T0
    print(
        json.dumps(
            {
                "phases_at": phases,
                "start_phases": start_phases,
                "first_result_at": first_result_at,
                "end_at": time.time(),
                "rows": len(rows),
                "tokens": int(lens.sum()),
            }
        )
    )


if __name__ == "__main__":  # the LocalCluster's worker processes re-import this module
    main()
