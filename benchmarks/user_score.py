"""The scoring script a competent user writes on day one: the baseline ``dask-lm score`` is judged against.

Not dask-lm: plain PyTorch + transformers + pyarrow, about 40 lines of work, run as its own process by
``benchmarks/score.py --processes`` (so its imports, parquet read and model load are timed as the user waits for
them). What makes it competent rather than a strawman:

* every row is read once (``pyarrow.parquet.read_table`` of the dataset), sorted longest first;
* padded batches filled up to a token budget (``--budget`` padded tokens, 65536 by default), not a fixed row count;
* the model in bf16 with sdpa attention, loaded straight to the GPU (``device_map``);
* the head applied to the hidden states in slices of ``--chunk-tokens`` tokens (rows x positions) with an fp32
  logsumexp, so the full ``[B, S, V]`` logits never exist at once and a slice's size does not grow with the rows
  of a batch (slices of a fixed position count took 28 GiB of logits at once on a batch of short rows and ran an
  80 GB H100 out of memory).

It writes ``id``, ``num_tokens`` and ``sum_logprob`` (the logprob of tokens 1.. given the ones before, as dask-lm's
``sum_logprob``) to one parquet file, and prints one JSON line: seconds since its start of each phase, and
``first_batch_at`` / ``end_at`` as ``time.time()`` stamps, so the parent can tell the time to the first scored batch
from the moment it started this process.

    python benchmarks/user_score.py MODEL_DIR DATA_DIR OUT.parquet --ids-column ids --id-column id
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402  (the clock starts before the imports: they are part of what the user waits for)
import json  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def load(model_dir, dtype, device):
    """The model in ``dtype`` with sdpa, straight to ``device`` (``device_map``: no CPU copy), or, where this
    transformers wants ``accelerate`` for that and it is missing, loaded on the host and moved."""
    try:
        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa", device_map={"": device}
        ).eval()
    except (ImportError, ValueError) as e:
        if "accelerate" not in str(e):
            raise
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def score_rows(model, rows, order, budget, chunk_tokens, device, per_token=False):
    """Each row's summed logprob of tokens 1.. (and with ``per_token`` its logprobs, on the host), in batches of
    rows taken longest first (``order``) up to ``budget`` padded tokens; and when the first batch's sums were on
    the host (``time.time()``). Used as well by ``benchmarks/logprobs.py``'s competent arm."""
    sums = [0.0] * len(rows)
    tokens = [None] * len(rows) if per_token else None
    first_batch_at = None
    with torch.inference_mode():
        s = 0
        while s < len(order):
            width = len(rows[order[s]])  # longest first: the first row of a batch is its widest
            take = max(1, budget // width)
            batch = order[s : s + take]
            s += take
            x = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, i in enumerate(batch):
                x[r, : len(rows[i])] = torch.as_tensor(rows[i])
                mask[r, : len(rows[i])] = 1
            x, mask = x.to(device), mask.to(device)
            hidden = model.model(input_ids=x, attention_mask=mask).last_hidden_state
            lps = []
            chunk = max(1, chunk_tokens // len(batch))  # positions per slice
            for c in range(0, width - 1, chunk):
                logits = model.lm_head(hidden[:, c : c + chunk]).float()
                target = x[:, c + 1 : c + 1 + chunk]
                logits = logits[:, : target.shape[1]]
                lps.append(logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, -1))
            lp = (torch.cat(lps, 1) if lps else torch.zeros(len(batch), 0, device=device)) * mask[:, 1:]
            for r, v in zip(batch, lp.double().sum(1).tolist()):
                sums[r] = v
            if tokens is not None:
                host = lp.cpu()
                for k, r in enumerate(batch):
                    tokens[r] = host[k, : len(rows[r]) - 1]
            if first_batch_at is None:
                first_batch_at = time.time()
    return sums, tokens, first_batch_at


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--ids-column", default="ids")
    ap.add_argument("--id-column", default="id")
    ap.add_argument("--budget", type=int, default=65536, help="padded tokens per batch")
    ap.add_argument(
        "--chunk-tokens", type=int, default=16384, help="tokens (rows x positions) per head / logsumexp slice"
    )
    args = ap.parse_args()
    phases = {"imports": time.perf_counter() - T0}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    table = pq.read_table(args.data, columns=[args.id_column, args.ids_column])
    rows = table[args.ids_column].to_pylist()
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    phases["read"] = time.perf_counter() - T0
    model = load(args.model, dtype, device)
    phases["load"] = time.perf_counter() - T0

    sums, _, first_batch_at = score_rows(model, rows, order, args.budget, args.chunk_tokens, device)
    phases["scoring"] = time.perf_counter() - T0
    pq.write_table(
        pa.table(
            {
                args.id_column: table[args.id_column],
                "num_tokens": pa.array([len(r) for r in rows], pa.int32()),
                "sum_logprob": pa.array(sums, pa.float64()),
            }
        ),
        args.out,
    )
    phases["write"] = time.perf_counter() - T0
    print(
        json.dumps(
            {
                "phases_at": phases,
                "first_batch_at": first_batch_at,
                "end_at": time.time(),
                "rows": len(rows),
                "tokens": sum(len(r) for r in rows),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
