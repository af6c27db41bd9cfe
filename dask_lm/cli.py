"""The ``dask-lm`` command (also ``python -m dask_lm``).

Exit codes: 0 success, 2 bad usage or bad input (one clear line), 1 a runtime failure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

import click

__all__ = ["main"]


def _tiny_model_dir() -> str:
    """A tiny random model + tokenizer, built once under the cache directory (no download)."""
    from dask_lm.tiny import build_tiny_model, train_tiny_tokenizer

    root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dask-lm", "tiny-llama")
    if os.path.exists(os.path.join(root, "config.json")):
        return root
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)  # built aside, renamed into place when complete
    tok = train_tiny_tokenizer(os.path.join(tmp, "tokenizer"))
    build_tiny_model(os.path.join(tmp, "model"), family="llama", tokenizer_path=tok)
    try:
        os.replace(os.path.join(tmp, "model"), root)
    except OSError:  # another process finished first
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return root


class _CliError(click.ClickException):
    exit_code = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--verbose", "-v", is_flag=True, help="Show Dask's logs and full tracebacks.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """dask-lm: language-model policy work on a Dask cluster."""
    ctx.obj = {"verbose": verbose}
    if not verbose:
        for name in ("distributed", "transformers"):
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@main.command()
@click.argument("texts", nargs=-1)
@click.option("--model", "model_dir", default=None, help="Hugging Face model directory (default: a tiny random "
              "model built on the spot).")
@click.option("--scheduler-address", default=None, help="Attach to this scheduler (or scheduler file) instead "
              "of starting a local cluster.")
@click.option("--n-workers", type=int, default=None, help="Local cluster size (default: one per GPU, or 2).")
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              help="auto: bfloat16 with GPUs, float32 without.")
@click.option("--topk", type=int, default=0, help="Also show the k most likely tokens at each position.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per text instead of a table.")
@click.pass_context
def logprobs(ctx: click.Context, texts: tuple[str, ...], model_dir: str | None, scheduler_address: str | None,
             n_workers: int | None, precision: str, topk: int, as_json: bool) -> None:
    """Per-token log-probabilities of TEXTS (default: two sample sentences)."""
    verbose = ctx.obj["verbose"]
    try:
        _run_logprobs(list(texts) or ["The quick brown fox jumps over the lazy dog.",
                                      "Dask schedules tasks across the workers of a cluster."],
                      model_dir, scheduler_address, n_workers, precision, topk, as_json)
    except (ValueError, FileNotFoundError) as e:
        if verbose:
            raise
        raise _CliError(str(e)) from None
    except Exception as e:  # a runtime failure: one line, exit 1
        if verbose:
            raise
        click.echo(f"Error: {type(e).__name__}: {e}", err=True)
        sys.exit(1)


def _run_logprobs(texts: list[str], model_dir: str | None, scheduler_address: str | None, n_workers: int | None,
                  precision: str, topk: int, as_json: bool) -> None:
    import transformers

    import dask_lm
    from dask_lm.engine.cluster import count_gpus

    if model_dir is not None and not os.path.isdir(model_dir):
        raise ValueError(f"--model {model_dir!r} is not a directory")
    model_dir = model_dir or _tiny_model_dir()
    if precision == "auto":
        precision = "bfloat16" if count_gpus() and not scheduler_address else "float32"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids, lengths = enc["input_ids"], enc["attention_mask"].sum(1)
    client = dask_lm.connect(scheduler_address, n_workers=n_workers)
    try:
        cfg = {"model_name": model_dir, "precision": precision,
               "max_total_sequence_length": max(int(lengths.max()), 1)}
        with dask_lm.Policy(client, cfg, tokenizer, init_optimizer=False, init_reference_model=False) as policy:
            batch = dask_lm.BatchedDataDict(input_ids=ids, input_lengths=lengths)
            lp = policy.get_logprobs(batch)["logprobs"]
            tk = policy.get_topk_logits(batch, topk) if topk else None
            ranks = policy.data_parallel_size
    finally:
        if getattr(client, "_dask_lm_owns_cluster", False):
            cluster = client.cluster
            client.close()
            cluster.close()
        else:
            client.close()
    for b, text in enumerate(texts):
        n = int(lengths[b])
        tokens = tokenizer.convert_ids_to_tokens(ids[b, :n].tolist())
        values = lp[b, :n].tolist()
        record: dict[str, Any] = {"text": text, "tokens": tokens, "logprobs": values,
                                  "sum_logprob": sum(values[1:]), "num_tokens": n}
        if tk is not None:
            record["topk"] = [tokenizer.convert_ids_to_tokens(tk["topk_indices"][b, i].tolist()) for i in range(n)]
        if as_json:
            click.echo(json.dumps(record))
            continue
        click.echo(f"\n{text!r}  ({n} tokens, sum logprob {record['sum_logprob']:.3f}, {ranks} rank(s))")
        for i, (tok, value) in enumerate(zip(tokens, values)):
            extra = f"  top: {' '.join(record['topk'][i - 1])}" if tk is not None and i else ""
            click.echo(f"  {i:4d}  {tok!r:>20}  {value:10.4f}{extra}")


if __name__ == "__main__":
    main()
