"""The ``dask-lm`` command (also ``python -m dask_lm``).

Exit codes: 0 success, 2 bad usage or bad input (one clear line), 1 a runtime failure, 130 / 143 interrupted by
SIGINT / SIGTERM (:mod:`dask_lm.jobs.interrupts`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import traceback
import typing
from typing import Any, ClassVar

import click

from dask_lm import (
    __version__,  # the package imports its heavy modules lazily: --help stays fast
    interface,  # the standard library only
)
from dask_lm.cli_cluster import cluster_group  # click only, until a subcommand runs
from dask_lm.jobs import interrupts  # signal and threading only
from dask_lm.jobs.spec import JobSpec, options_of  # the jobs' specs and their checks: the standard library only
from dask_lm.scoring.spec import ScoreSpec
from dask_lm.sft.spec import SFTSpec

__all__ = ["main"]


class _CliError(click.ClickException):
    exit_code = 2


class _Precision(click.Choice):
    """``--precision`` with one spelling in every subcommand (``auto``, ``bf16``, ``fp32``, ``fp16``); the torch
    names (``bfloat16``, ``float32``, ``float16``) are accepted too, and not shown."""

    ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return super().convert(self.ALIASES.get(value, value), param, ctx)


def _precision_option(*choices: str, help: str) -> Any:
    return click.option(
        "--precision", type=_Precision(["auto", *choices]), default="auto", show_default=True, help=help
    )


# options every job command shares, spelled and described once
_SCHEDULER_HELP = (
    "Attach to this scheduler address (tcp://host:8786) or scheduler file; default: "
    "$DASK_SCHEDULER_ADDRESS, else the warm local cluster of `dask-lm cluster start` when one runs, else a local "
    "cluster that the command starts and stops."
)
_N_WORKERS_HELP = "Size of the local cluster (default: one worker per GPU, or 2 on a CPU machine)."
_REVISION_HELP = "Branch, tag or commit of a Hub --model (default: the repository's main branch)."


def _spec_options(job: str, *names: str, exclude: tuple[str, ...] = ()) -> Any:
    """The command's options for the fields ``names`` of a job's spec (every field with an option, less
    ``exclude``, where none are named), in the spec's order: spelling, type, choices, help and the default shown
    all come from the spec (:mod:`dask_lm.jobs.spec`). One left at its default is passed on as ``None``, "not
    given" (:func:`_job_given`): ``--resume`` then takes the manifest's value, and a new job the spec's default."""
    spec = _SPECS[job]
    hints = typing.get_type_hints(spec)
    chosen = [(f, o) for f, o in options_of(spec) if o.cli and f.name not in exclude and (not names or f.name in names)]

    def decorate(fn: Any) -> Any:
        for f, o in reversed(chosen):
            spelled = o.flag or f"--{f.name.replace('_', '-')}"
            base = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
            default = None if f.default is dataclasses.MISSING else f.default
            kwargs: dict[str, Any] = {"default": default, "help": o.help}
            if default is not None and not isinstance(default, bool) and not o.toggle:
                kwargs["show_default"] = True
            if o.toggle:
                decls = [f"{spelled}/--no-{spelled[2:]}", f.name]
            elif base is bool:
                decls = [spelled, f.name]
                kwargs.update(is_flag=True, flag_value=not default)
            else:
                decls = [spelled, f.name]
                kwargs["type"] = (
                    _Precision(list(o.choices))
                    if f.name == "precision"
                    else click.Choice(list(o.choices))
                    if o.choices
                    else base
                )
            fn = click.option(*decls, **kwargs)(fn)
        return fn

    return decorate


_SPECS: dict[str, type[JobSpec]] = {"score": ScoreSpec, "sft": SFTSpec}


def _job_given(ctx: click.Context, options: dict[str, Any], *, job: str) -> None:
    """The job's options left at their defaults become ``None``, "not given", so that ``--resume`` takes them from
    the manifest (and a new job gets the same defaults from its spec). Without ``--resume`` INPUTS and --model are
    required: click's own usage error (exit 2) names the one missing."""
    from click.core import ParameterSource

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)

    for f, _o in options_of(_SPECS[job]):
        if f.name in options and not given(f.name):
            options[f.name] = None
    if not options["resume"]:
        for name in ("inputs", "model"):
            if not given(name):
                param = next(p for p in ctx.command.params if p.name == name)
                raise click.MissingParameter(ctx=ctx, param=param)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="""Exit codes, of every command: 0 done;
2 bad usage or input (one line naming the option, file or row); 1 a runtime failure; 130 interrupted by Ctrl-C
(SIGINT) and 143 by SIGTERM (a batch scheduler's stop): a score or sft job says on one line what it kept, and the
same command with --resume continues it.""",
)
@click.version_option(__version__, "--version", "-V", prog_name="dask-lm", message="%(prog)s %(version)s")
@click.option("--verbose", "-v", is_flag=True, help="Show Dask's logs and full tracebacks.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """dask-lm: language-model policy work on a Dask cluster."""
    ctx.obj = {"verbose": verbose}
    if not verbose:
        for name in ("distributed", "transformers"):
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DASK_LM_QUIET_WORKERS", "1")  # a local cluster's workers: no tracebacks of their own


def _exit_codes(ctx: click.Context, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn``: bad usage or input (``ValueError``) exits 2 with one line, any other failure exits 1. With
    ``--verbose`` the full traceback comes first, and the exit code is the same."""
    verbose = ctx.obj["verbose"]
    try:
        # SIGINT even where it was inherited ignored, and a scheduler's SIGTERM, get Ctrl-C's cleanup and one line;
        # messages name flags, not keyword arguments
        with interrupts.signals_as_interrupts(), interface.cli():
            return fn(*args, **kwargs)
    except KeyboardInterrupt as e:  # the job's own line (what it kept), else a bare one; 130 / 143 as shells do
        if verbose:
            traceback.print_exc()
        click.echo(str(e) if isinstance(e, interrupts.JobInterrupted) else "interrupted", err=True)
        sys.exit(interrupts.exit_code(e))
    except (ValueError, FileNotFoundError) as e:
        if verbose:
            traceback.print_exc()
        raise _CliError(str(e)) from None
    except Exception as e:  # a runtime failure: one line, exit 1
        if verbose:
            traceback.print_exc()
        click.echo(f"Error: {type(e).__name__}: {e}", err=True)
        sys.exit(1)


@main.command(
    epilog="""Examples:

\b
  dask-lm logprobs "The capital of France is Paris."
  dask-lm logprobs --model Qwen/Qwen2.5-0.5B --topk 3 "Dask runs tasks." "On every GPU."
  dask-lm logprobs --model ./my-model --json "one text" > logprobs.jsonl"""
)
@click.argument("texts", nargs=-1)
@click.option(
    "--model",
    "model_dir",
    default=None,
    help="Hugging Face Hub id (e.g. Qwen/Qwen2.5-0.5B) or model "
    "directory (default: a tiny random model built on the spot).",
)
@click.option("--revision", default=None, help=_REVISION_HELP)
@click.option("--scheduler-address", default=None, help=_SCHEDULER_HELP)
@click.option("--n-workers", type=int, default=None, help=_N_WORKERS_HELP)
@_precision_option("bf16", "fp32", "fp16", help="auto: bf16 on a local GPU cluster, fp32 otherwise.")
@click.option(
    "--topk", type=int, default=0, show_default=True, help="Also show the k most likely tokens at each position."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per text instead of a table.")
@click.pass_context
def logprobs(
    ctx: click.Context,
    texts: tuple[str, ...],
    model_dir: str | None,
    revision: str | None,
    scheduler_address: str | None,
    n_workers: int | None,
    precision: str,
    topk: int,
    as_json: bool,
) -> None:
    """Per-token log-probabilities of TEXTS (default: two sample sentences).

    Each text is encoded as tokenizer(text) and its first token has no context, so it is not scored: the sum is
    over tokens 2..n (dask-lm score --convention separate). dask-lm score's default convention (lm-eval) scores
    the first token too, conditioned on BOS (EOS when the tokenizer adds no BOS): with a tokenizer that adds no BOS
    its sum has one more term, and the two differ. The output says which convention it used."""
    _exit_codes(
        ctx,
        _run_logprobs,
        list(texts)
        or ["The quick brown fox jumps over the lazy dog.", "Dask schedules tasks across the workers of a cluster."],
        model_dir,
        scheduler_address,
        n_workers,
        precision,
        topk,
        as_json,
        revision,
    )


@main.command(
    epilog="""Examples:

\b
  dask-lm score data/*.parquet --model Qwen/Qwen2.5-0.5B --text-column text --id-column id --output scores/
  dask-lm score data/ --model M --prompt-column prompt --response-column response --output scores/ --topk 20
  dask-lm score data/ --model M --text-column text --output scores/ --topk 5 --decode-topk
  dask-lm score --output scores/ --resume
  dask-lm score data/ --model M --ids-column input_ids --prompt-length-column prompt_len --output scores/
  dask-lm score data/ --model M --text-column text --output scores/ --overwrite --precision fp32

Exit codes: 0 done; 2 bad usage or input: refused before anything is written, or a bad row found while scoring
(the parts written are kept: --resume --skip-bad-rows finishes the job); 1 a runtime failure (a lost scheduler
too: --resume continues); 130 interrupted by Ctrl-C (SIGINT), 143 by SIGTERM: --resume continues. --verbose adds
the traceback and keeps the code."""
)
@click.argument("inputs", nargs=-1, metavar="INPUTS...")  # required, unless --resume (checked in the command)
@_spec_options("score", "model")
@click.option("--revision", default=None, help=_REVISION_HELP)
@click.option("--output", required=True, help="Output directory (part-NNNNN.parquet, _manifest.json, _SUCCESS).")
@_spec_options("score", exclude=("model", "skip_bad_rows"))
@click.option("--scheduler-address", default=None, help=_SCHEDULER_HELP)
@click.option("--n-workers", type=int, default=None, help=_N_WORKERS_HELP)
@click.option(
    "--resume",
    is_flag=True,
    help="Finish the job in --output: INPUTS, --model and every option not "
    "given are its _manifest.json's (--output DIR --resume alone will do); a given option that differs is "
    "refused. Parts already written are kept (a finished job returns at once). May add --skip-bad-rows.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete the earlier job's files in --output and score again with "
    "these options (files dask-lm did not write are never deleted).",
)
@_spec_options("score", "skip_bad_rows")
@click.option("--performance-report", default=None, help="Write Dask's HTML performance report to this file.")
@click.option("--no-progress", is_flag=True, help="No progress bar (also: DASK_LM_PROGRESS=0).")
@click.pass_context
def score(
    ctx: click.Context,
    /,
    inputs: tuple[str, ...],
    model: str | None,
    output: str,
    scheduler_address: str | None,
    n_workers: int | None,
    no_progress: bool,
    **options: Any,
) -> None:
    """Per-token logprobs, log-likelihood and perplexity of every row of parquet INPUTS (files, directories,
    globs).

    By default (--convention lm-eval) every token of a text is scored, the first one conditioned on BOS (EOS when
    the tokenizer adds no BOS), as lm-evaluation-harness scores it; dask-lm logprobs leaves a text's first token
    unscored, as --convention separate does, so their sums differ for a tokenizer that adds no BOS. The summary
    names the convention used."""
    _job_given(ctx, options, job=ctx.command.name or "")

    def run() -> None:
        from dask_lm.engine.progress import JobBar  # the standard library and tqdm only

        if not no_progress:  # a first line now: the job's modules take seconds to import (distributed)
            JobBar.announce("scoring", "row", "importing dask")
        import dask_lm

        # the checks run before any cluster starts; score_parquet then connects, and closes what it started
        result = dask_lm.score_parquet(
            list(inputs) or None,
            output,
            model=model,
            scheduler_address=scheduler_address,
            n_workers=n_workers,
            progress=not no_progress,
            **options,
        )
        _print_summary(result)

    _exit_codes(ctx, run)


@main.command(
    epilog="""Examples:

\b
  dask-lm sft data/ --model Qwen/Qwen2.5-0.5B --prompt-column prompt --response-column response \\
      --output runs/sft-1 --epochs 2 --global-batch-size 64 --lr 1e-5 --save-every 100
  dask-lm sft --output runs/sft-1 --resume
  dask-lm score eval/ --model runs/sft-1/step_200/weights --text-column text --output eval-scores/

Exit codes: 0 done; 2 bad usage or input (refused before any training step), 1 a runtime failure; 130 interrupted
by Ctrl-C (SIGINT), 143 by SIGTERM: --resume continues from the newest checkpoint. --verbose adds the traceback and
keeps the code."""
)
@click.argument("inputs", nargs=-1, metavar="INPUTS...")  # required, unless --resume (checked in the command)
@_spec_options("sft", "model")
@click.option("--revision", default=None, help=_REVISION_HELP)
@click.option("--output", required=True, help="Run directory: step_N/ checkpoints, _manifest.json, _SUCCESS.")
@_spec_options("sft", exclude=("model",))
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --output from its newest complete checkpoint (a "
    "run that reached its last step returns at once): INPUTS, --model and every option not given are its "
    "_manifest.json's (--output DIR --resume alone will do); a given option that differs is refused, a "
    "larger --max-steps trains on.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete the earlier run's checkpoints in --output and train again "
    "(files dask-lm did not write are never deleted).",
)
@click.option("--scheduler-address", default=None, help=_SCHEDULER_HELP)
@click.option("--n-workers", type=int, default=None, help=_N_WORKERS_HELP)
@click.option("--no-progress", is_flag=True, help="No progress bar (also: DASK_LM_PROGRESS=0).")
@click.pass_context
def sft(ctx: click.Context, /, inputs: tuple[str, ...], no_progress: bool, **options: Any) -> None:
    """Supervised fine-tuning (NLL) on parquet INPUTS, with periodic resumable checkpoints."""
    _job_given(ctx, options, job=ctx.command.name or "")

    def run() -> None:
        from dask_lm.engine.progress import JobBar  # the standard library and tqdm only

        if not no_progress:  # a first line now: the job's modules take seconds to import (distributed)
            JobBar.announce("sft", "step", "importing dask")
        from dask_lm.sft.job import sft_parquet

        result = sft_parquet(list(inputs) or None, progress=not no_progress, **options)
        if result.already_complete:
            click.echo(
                f"already complete: the run in {result.output} reached step {result.steps}; nothing was "
                f"run (pass --overwrite to train again)\ncheckpoint  {result.checkpoint}"
            )
            return
        first, last = (result.losses[0], result.losses[-1]) if result.losses else (float("nan"), float("nan"))
        click.echo(
            f"steps       {result.steps} ({result.epochs_completed} epochs"
            f"{f', resumed from step {result.resumed_from}' if result.resumed_from is not None else ''})\n"
            f"loss        {first:.4f} -> {last:.4f}\ncheckpoint  {result.checkpoint}\n"
            f"seconds     {result.seconds:.1f} (training {result.train_seconds:.1f}, checkpoints "
            f"{result.checkpoint_seconds:.1f})\n"
            f"tokens      {result.tokens:,}"
            + (f" ({result.run_tokens:,} by this run)" if result.resumed_from is not None else "")
            + f" ({result.run_tokens / max(result.train_seconds, 1e-9):,.0f} per second of training)"
        )

    _exit_codes(ctx, run)


@main.command(
    epilog="""Examples:

\b
  dask-lm demo
  dask-lm demo --rows 4096 --n-workers 4

It ends with the next commands, for this machine: score a parquet file of your own with the model it built, then
read the scores back with pandas."""
)
@click.option("--rows", type=int, default=512, show_default=True, help="Rows in the sample dataset.")
@click.option("--n-workers", type=int, default=None, help=_N_WORKERS_HELP)
@click.pass_context
def demo(ctx: click.Context, rows: int, n_workers: int | None) -> None:
    """Build a tiny model and a sample parquet dataset, score it on a local cluster, print a summary and what to
    run next."""

    def run() -> None:
        import dask_lm
        from dask_lm.demo import demo_data, demo_model, next_steps
        from dask_lm.io.local_cache import cache_root

        if rows < 2:
            raise ValueError("--rows must be >= 2")
        built = time.monotonic()
        model_dir = demo_model()
        data = demo_data(rows)
        built = time.monotonic() - built
        output = os.path.join(cache_root(), "demo", "scores")
        shutil.rmtree(output, ignore_errors=True)  # the demo's own output from an earlier run
        click.echo(
            f"model   {model_dir} (tiny random llama)\ndata    {data} ({rows} rows)"
            + (f"\n        (built in {built:.1f} s; later runs reuse them)" if built >= 0.5 else "")
        )
        # score_parquet starts the local cluster and closes it, as `dask-lm score` does: its summary's wall time
        # then counts the cluster's start and close too, and the dashboard's address is printed while it is up
        result = dask_lm.score_parquet(
            data, output, model=model_dir, n_workers=n_workers, text_column="text", id_column="id"
        )
        _print_summary(result)
        click.echo("\n".join(next_steps(model_dir, data)))

    _exit_codes(ctx, run)


@main.command(
    "nemo-rl",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog="""Examples:

\b
  # in a NeMo RL checkout, or anywhere with `pip install nemo-rl`:
  dask-lm nemo-rl examples/run_sft.py --config examples/configs/sft.yaml cluster.gpus_per_node=4
  dask-lm nemo-rl examples/run_dpo.py --config my_dpo.yaml policy.model_name=Qwen/Qwen2.5-0.5B
  dask-lm nemo-rl --scheduler-address tcp://10.0.0.5:8786 examples/run_sft.py --config my_sft.yaml

dask-lm's own options come before SCRIPT; everything after it is the script's (its --config, Hydra overrides).
Exit codes: 0 done; 2 bad usage or input (SCRIPT missing, NeMo RL or Ray not installed, a config key refused, a
cluster smaller than the config asks for); 1 a runtime failure; 130 / 143 interrupted; a code the script exits
with itself is passed on. Guide: docs/guides/nemo_rl.md.""",
)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--scheduler-address",
    default=None,
    help="Run the Policy on the Dask cluster of this scheduler "
    "address (tcp://host:8786) or scheduler file; default: $DASK_SCHEDULER_ADDRESS, else a local cluster "
    "of cluster.gpus_per_node x cluster.num_nodes workers (GPU workers where GPUs are visible, CPU "
    "workers otherwise), started when NeMo RL asks for it and stopped at the end.",
)
@click.pass_context
def nemo_rl(ctx: click.Context, script: str, args: tuple[str, ...], scheduler_address: str | None) -> None:
    """Run NeMo RL's entry point SCRIPT (examples/run_sft.py, run_dpo.py, ...) unmodified, with dask-lm's Policy on
    a Dask cluster where NeMo RL has its Ray cluster and Policy workers.

    SCRIPT runs as `python SCRIPT ARGS...` would, against the NeMo RL this Python imports (or the checkout SCRIPT
    is in). NeMo RL's lm_policy.Policy, RayVirtualCluster and init_ray stand for dask-lm's for the run; nothing
    else of NeMo RL changes. What NeMo RL runs as Ray actors beyond the Policy (environments, vLLM / SGLang
    generation workers) is not replaced: such a script stops there, naming it."""

    def run() -> None:
        from dask_lm.compat.nemo_rl_run import run as run_script

        run_script(script, list(args), scheduler_address=scheduler_address)

    _exit_codes(ctx, run)


def _close(client: Any) -> None:
    from dask_lm.engine.cluster import close

    close(client)


def _print_summary(result: Any) -> None:
    width = max(len(k) for k, _ in result.summary())
    for key, value in result.summary():
        click.echo(f"{key:<{width}}  {value}")


def _run_logprobs(
    texts: list[str],
    model_dir: str | None,
    scheduler_address: str | None,
    n_workers: int | None,
    precision: str,
    topk: int,
    as_json: bool,
    revision: str | None,
) -> None:
    import transformers

    import dask_lm
    from dask_lm.data.continuation import LOGPROBS_CONVENTION, describe
    from dask_lm.demo import demo_model
    from dask_lm.engine.cluster import count_gpus
    from dask_lm.io import modelcheck
    from dask_lm.io.hub import resolve_model

    # a Hub id becomes its local snapshot (downloaded once, on this machine); the workers load that directory. A
    # model asking for code of its own, damaged files or impossible sizes: exit 2 here, before any cluster
    model_dir = resolve_model(model_dir, revision=revision).path if model_dir is not None else demo_model()
    modelcheck.check_model(model_dir, load_config=False)
    modelcheck.check_tokenizer(model_dir)
    if precision == "auto":
        precision = "bfloat16" if count_gpus() and not scheduler_address else "float32"
    precision = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(precision, precision)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids, lengths = enc["input_ids"], enc["attention_mask"].sum(1)
    client = dask_lm.connect(scheduler_address, n_workers=n_workers)
    try:
        cfg = {"model_name": model_dir, "precision": precision, "max_total_sequence_length": max(int(lengths.max()), 1)}
        with dask_lm.Policy(client, cfg, tokenizer, init_optimizer=False, init_reference_model=False) as policy:
            batch: dask_lm.BatchedDataDict[Any] = dask_lm.BatchedDataDict(input_ids=ids, input_lengths=lengths)
            lp = policy.get_logprobs(batch)["logprobs"]
            tk = policy.get_topk_logits(batch, topk) if topk else None
            ranks = policy.data_parallel_size
    finally:
        _close(client)
    from dask_lm.io.results import token_strings  # the strings of score --decode-topk (that module says why)

    if not as_json:
        click.echo(f"convention: {describe(LOGPROBS_CONVENTION)}")
    for b, text in enumerate(texts):
        n = int(lengths[b])
        tokens = token_strings(tokenizer, ids[b, :n].tolist())
        values = lp[b, :n].tolist()
        record: dict[str, Any] = {
            "text": text,
            "tokens": tokens,
            "logprobs": values,
            "sum_logprob": sum(values[1:]),
            "num_tokens": n,
            "convention": LOGPROBS_CONVENTION,
        }
        if tk is not None:
            record["topk"] = [token_strings(tokenizer, tk["topk_indices"][b, i].tolist()) for i in range(n)]
        if as_json:
            click.echo(json.dumps(record))
            continue
        click.echo(
            f"\n{text!r}  ({n} tokens, sum logprob {record['sum_logprob']:.3f} over tokens 2..{n}, {ranks} rank(s))"
        )
        for i, (tok, value) in enumerate(zip(tokens, values)):
            # the strings the model ranked first for this position (a token's own leading space shows in repr)
            extra = f"  top: {', '.join(map(repr, record['topk'][i - 1]))}" if tk is not None and i else ""
            click.echo(f"  {i:4d}  {tok!r:>20}  {value:10.4f}{extra}")


main.add_command(cluster_group(_exit_codes))  # `dask-lm cluster start | status | stop`: the warm local cluster

if __name__ == "__main__":
    main()
