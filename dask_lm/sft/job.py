"""Scheduled fine-tuning over a parquet dataset: ``sft_parquet`` (the driver side of ``dask-lm sft``).

NLL training through ``Policy.train``: text rows train on every token; prompt + response rows train on the
response tokens only. Rows are tokenized on the workers (one Dask task per row group), then walked in a
deterministic order (a seeded permutation per epoch), ``global_batch_size`` rows per optimizer step; a short last
batch is padded with rows whose ``sample_mask`` is 0.

Checkpoints: every ``save_every`` steps (and at the end) ``output/step_N/`` appears, holding ``weights/`` (a
Hugging Face directory), ``optimizer/``, ``tokenizer/`` and ``training_state.json`` (step, epoch, position in the
epoch, losses). It is written as ``output/.step_N.tmp-<id>/``, synced to disk and renamed once complete
(:func:`dask_lm.jobs.model_files.publishing`), so ``resume=True`` can always take the newest ``step_N`` and continue
exactly where it stopped (same data order, same optimizer state).
``keep`` bounds how many step directories stay. ``_manifest.json`` pins the options and, by content (SHA-256 of
every file: :mod:`dask_lm.io.fingerprint`), the model and input files; ``resume=True`` refuses a run where any of
them changed, naming what did. ``_SUCCESS`` ends the job.

A job holds a lock on its output directory for its whole life (:mod:`dask_lm.jobs.folder`): a second job on the same
output is refused, and the ``.step_N.tmp-<id>/`` directories that a killed job left (a model and optimizer state
each) are deleted when the next job on that output starts. The model files are checked
(:mod:`dask_lm.io.modelcheck`) and an input without rows is refused before any cluster starts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, cast

from dask_lm.data.continuation import Convention
from dask_lm.data.text_bytes import text_bound
from dask_lm.engine import progress as progress_bars
from dask_lm.interface import again, opt
from dask_lm.io import parquet as pio
from dask_lm.io import safe_paths
from dask_lm.jobs import folder, interrupts, model_files
from dask_lm.jobs.output import JobKind, JobOutput
from dask_lm.jobs.resume import spec_for
from dask_lm.jobs.start import ClusterStart, running, worker_precision
from dask_lm.sft.spec import SFTSpec

__all__ = ["sft_parquet", "SFTResult"]

_STEP = re.compile(r"^step_(\d+)$")
# what a save killed inside model_files.publishing leaves: its temporary, or the step it was replacing
_STALE_STEP = r"\.step_\d+\.(?:tmp|old)-[0-9A-Za-z]+"
_KIND = JobKind(
    name="sft run",
    did="trained",
    owned=r"step_\d+",
    debris=functools.partial(folder.remove_stale, pattern=_STALE_STEP),
    flags=SFTSpec.flags(),
)


@dataclass
class SFTResult:
    output: str
    steps: int
    epochs_completed: int
    losses: list[float]
    resumed_from: int | None
    seconds: float
    checkpoint: str
    tokens: int = 0
    """Real tokens of the rows trained on in every step up to ``steps`` (prompt tokens included: the forward runs
    over them), a resumed run's earlier steps too: the trained model's total."""
    run_tokens: int = 0
    """Of ``tokens``, those trained on by this run."""
    train_seconds: float = 0.0
    """Of ``seconds``, the time inside ``Policy.train`` (the rest: model load, tokenizing, checkpoints)."""
    checkpoint_seconds: float = 0.0
    """Of ``seconds``, the time spent writing checkpoints."""
    already_complete: bool = False
    """A ``resume`` of a run that had reached its last step: nothing ran; the rest is the finished run's."""


def _training_state(step_dir: str) -> dict[str, Any]:
    """``step_N/training_state.json``, never read through a link (``ValueError`` naming it)."""
    fd = safe_paths.open_no_follow(os.path.join(step_dir, "training_state.json"), os.O_RDONLY)
    with open(fd, encoding="utf-8") as f:
        state: dict[str, Any] = json.load(f)
    return state


def _finished(output: str, newest: tuple[int, str]) -> SFTResult:
    """``resume`` of a run that reached its last step: its ``_SUCCESS`` summary, no cluster, no file touched."""
    state = _training_state(newest[1])
    summary = folder.read_summary(output)
    return SFTResult(
        output=output,
        steps=int(state["step"]),
        epochs_completed=int(summary.get("epochs_completed", 0)),
        losses=list(state.get("losses", [])),
        resumed_from=newest[0],
        seconds=0.0,
        checkpoint=newest[1],
        tokens=int(summary.get("tokens") or 0),
        already_complete=True,
    )


def _tokenize_partition(
    pdf: Any,
    text_column: str | None,
    prompt_column: str | None,
    response_column: str | None,
    tokenizer_dir: str,
    file: str,
    first_row: int,
    convention: Convention = "lm-eval",
    max_length: int | None = None,
    truncate: bool = False,
) -> list[tuple[list[int], int]]:
    """(token ids, first trained position) per row, on a worker; every row trains, so a bad one fails the run. A
    text too long for ``max_length`` tokens by its bytes alone (:func:`dask_lm.data.text_bytes.text_bound`) is
    refused before it is tokenized."""
    from dask_lm.data.rows import tokenize_rows  # lazy: distributed (its messages) loads on the workers, not first

    if isinstance(pdf, pio.UnreadableRowGroup):  # a damaged page: nothing of the row group can be trained on
        raise ValueError(pdf.message())
    errors: list[str | None] = [None] * len(pdf)
    tokenizer = _tokenizer(tokenizer_dir)
    bound = text_bound(tokenizer, max_length, opt("max_length", max_length), truncate)
    ids, prompt_lens = tokenize_rows(
        pdf,
        tokenizer,
        text_column=text_column,
        prompt_column=prompt_column,
        response_column=response_column,
        file=file,
        first_row=first_row,
        errors=errors,
        convention=convention,
        bound=bound,
    )
    bad = next((e for e in errors if e is not None), None)
    if bad is not None:
        raise ValueError(bad)
    # a response trains from its first token, each given everything before it; a text from its first (given BOS /
    # EOS) in the lm-eval convention, from its second in the separate one
    return [(toks, max(n, 1)) for toks, n in zip(ids, prompt_lens)]  # type: ignore[misc]


@functools.lru_cache(maxsize=4)
def _tokenizer(directory: str) -> Any:
    """The tokenizer of ``directory``, loaded once per worker process (every partition of a run needs it)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=False)


def _batch(rows: list[tuple[list[int], int]], size: int, pad_id: int) -> Any:
    """A right-padded training batch of ``size`` rows (missing rows are copies with sample_mask 0)."""
    import torch  # lazy: the driver's bar shows before torch loads (seconds); tests/test_job_imports.py

    from dask_lm.data.batch import BatchedDataDict

    real = len(rows)
    rows = rows + [rows[0]] * (size - real)
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((size, width), pad_id, dtype=torch.int64)
    token_mask = torch.zeros(size, width)
    for b, (toks, start) in enumerate(rows):
        ids[b, : len(toks)] = torch.tensor(toks)
        token_mask[b, start : len(toks)] = 1.0  # position t trains log p(token t | tokens < t)
    lengths = torch.tensor([len(toks) for toks, _ in rows])
    sample_mask = (torch.arange(size) < real).float()
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=sample_mask)


def _newest_checkpoint(output: str) -> tuple[int, str] | None:
    steps = [
        (int(m.group(1)), os.path.join(output, d))
        for d in os.listdir(output)
        if (m := _STEP.match(d)) and os.path.exists(os.path.join(output, d, "training_state.json"))
    ]
    return max(steps) if steps else None


def _order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    import torch  # lazy: the driver's bar shows before torch loads (seconds); tests/test_job_imports.py

    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _step_rows(
    rows: list[tuple[list[int], int]], step: int, global_batch_size: int, seed: int, shuffle: bool
) -> list[tuple[list[int], int]]:
    """The rows of optimizer step ``step`` (0-based): a function of the step alone, so a resumed run trains on the
    rows the uninterrupted run would have, and can count what its earlier steps trained on."""
    steps_per_epoch = math.ceil(len(rows) / global_batch_size)
    epoch, within = divmod(step, steps_per_epoch)
    order = _order(len(rows), epoch, seed, shuffle)
    return [rows[i] for i in order[within * global_batch_size : (within + 1) * global_batch_size]]


def sft_parquet(
    input: Any,
    output: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | None = None,
    client: Any = None,
    text_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    epochs: int | None = None,
    max_steps: int | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    lr: float | None = None,
    weight_decay: float | None = None,
    warmup_steps: int | None = None,
    max_length: int | None = None,
    truncate: bool | None = None,
    precision: str | None = None,
    save_every: int | None = None,
    keep: int | None = None,
    seed: int | None = None,
    shuffle: bool | None = None,
    resume: bool = False,
    progress: bool = True,
    scheduler_address: str | None = None,
    n_workers: int | None = None,
    revision: str | None = None,
    overwrite: bool = False,
    convention: str | None = None,
) -> SFTResult:
    """Fine-tune ``model`` with NLL on a parquet dataset; see the module docstring. ``ValueError`` on bad input
    (before any cluster starts), a resumable checkpoint every ``save_every`` steps. An output holding a run is
    refused unless ``resume`` (continue it; one that already reached its last step returns at once, without a
    cluster) or ``overwrite`` (delete that run's checkpoints and train again). Rows are tokenized in
    ``convention``, as :func:`~dask_lm.score_parquet` does (:mod:`dask_lm.data.continuation`), so a row trained on
    and the same row scored are the same ids.

    With ``resume``, what is not given (``None``) is the manifest's (:mod:`dask_lm.jobs.resume`): ``input``,
    ``model`` and every option, so ``sft_parquet(None, output, resume=True)`` continues a run; a given option that
    differs from a pinned one is refused, naming it, and a given ``max_steps`` (or ``save_every``, ``keep``,
    ``micro_batch_size``) replaces the recorded one. Otherwise ``model`` is required and the defaults are
    ``epochs=1``, ``max_steps=None`` (every epoch's steps), ``global_batch_size=32``, ``micro_batch_size=4``,
    ``lr=1e-5``, ``weight_decay=0.01``, ``warmup_steps=0``, ``max_length=1024``, ``truncate=False``,
    ``save_every=100``, ``keep=2``, ``seed=0``, ``shuffle=True``, ``convention="lm-eval"``."""
    import dask_lm

    given = SFTSpec.given(locals())
    # the bar from the first second, saying what the run waits for at each step of its start
    bar = progress_bars.JobBar.for_job("sft", "step", "checking the output, the model and the inputs", enabled=progress)
    try:
        # what the call gave, completed on a resume from the manifest, then from the spec's defaults; checked
        spec = spec_for(SFTSpec, output, resume=resume, given=given)
        out = JobOutput.open(_KIND, list(spec.input), output, resume=resume, overwrite=overwrite)  # the lock, first
    except BaseException:
        bar.close()
        raise
    try:
        out.settings = spec.manifest_settings()
        source, info = model_files.resolve_model(spec.model, revision=revision)
        model = source.path
        model_files.resolve_tokenizer(
            None, model, fix="sft trains with the model's own tokenizer: put its files beside the weights"
        )
        inputs = pio.inspect_inputs(
            out.files,
            text_column=spec.text_column,
            ids_column=None,
            prompt_column=spec.prompt_column,
            response_column=spec.response_column,
            id_column=None,
        )
        if inputs.num_rows == 0:
            files = out.files
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise ValueError(
                f"the input has no rows: {shown} hold{'s' if len(files) == 1 else ''} 0 rows, nothing to "
                "train on; check the input path"
            )
        manifest, pins = model_files.manifest(source, info, inputs, spec.manifest_options())
        bar.wait("loading the tokenizer (imports torch and transformers)")
        import transformers  # after the lock and the cheap checks: a second run on the output is refused first

        tokenizer = transformers.AutoTokenizer.from_pretrained(model, trust_remote_code=False)
        pad_id = next((v for v in (tokenizer.pad_token_id, tokenizer.eos_token_id) if isinstance(v, int)), 0)
        # every row trains (a bad one fails the run), so the run's length is known from the footers' row counts
        planned = math.ceil(inputs.num_rows / spec.global_batch_size) * spec.epochs
        planned = planned if spec.max_steps is None else min(spec.max_steps, planned)
        with progress_bars.quiet(not progress), out.locked() as old:  # no bar at all: the Policy's load has one
            out.pin(manifest, old, pins)
            start = _newest_checkpoint(out.path) if old is not None else None
            if start is not None and start[0] >= planned and out.finished:
                return _finished(out.path, start)
            out.reopen()
            cluster = ClusterStart(client, scheduler_address=scheduler_address, n_workers=n_workers)
            with running(cluster, total=planned, desc="sft", unit="step", progress=progress, bar=bar) as (
                dask_client,
                bar,
            ):
                precision = spec.fixed_precision or worker_precision(dask_client)
                out.pin_precision(precision)
                bar.wait("tokenizing the rows")
                rows = _tokenize_all(
                    dask_client,
                    inputs,
                    pins,
                    spec.text_column,
                    spec.prompt_column,
                    spec.response_column,
                    model,
                    spec.max_length,
                    spec.truncate,
                    cast("Convention", spec.convention),
                )
                steps_per_epoch = math.ceil(len(rows) / spec.global_batch_size)
                total = (
                    steps_per_epoch * spec.epochs
                    if spec.max_steps is None
                    else min(spec.max_steps, steps_per_epoch * spec.epochs)
                )
                bar.wait("loading the model", total=total)
                cfg = _policy_config(
                    model,
                    precision,
                    spec.global_batch_size,
                    spec.micro_batch_size,
                    spec.max_length,
                    spec.lr,
                    spec.weight_decay,
                    spec.warmup_steps,
                )
                state: dict[str, Any] = {"step": 0, "losses": []}  # what training_state.json holds
                paths: dict[str, Any] = {}
                if start is not None:
                    state = _training_state(start[1])
                    paths = {
                        "weights_path": os.path.join(start[1], "weights"),
                        "optimizer_path": os.path.join(start[1], "optimizer"),
                    }
                t0 = time.perf_counter()
                # the checkpoint's earlier steps count in the total: what the trained model has seen
                earlier = sum(
                    len(ids)
                    for step in range(state["step"])
                    for ids, _first in _step_rows(rows, step, spec.global_batch_size, spec.seed, spec.shuffle)
                )
                tokens, train_s, save_s = 0, 0.0, 0.0
                with dask_lm.Policy(dask_client, cfg, tokenizer, init_reference_model=False, **paths) as policy:
                    last = state["step"]
                    while state["step"] < total:
                        step = state["step"]
                        chunk = _step_rows(rows, step, spec.global_batch_size, spec.seed, spec.shuffle)
                        t_step = time.perf_counter()
                        result = policy.train(_batch(chunk, spec.global_batch_size, pad_id), dask_lm.NLLLoss())
                        train_s += time.perf_counter() - t_step
                        tokens += sum(len(ids) for ids, _first in chunk)
                        state["step"] = step + 1
                        state["losses"].append(float(result["loss"][0]))
                        # to the step reached: a resumed run's bar starts at its checkpoint
                        bar.update(state["step"] - bar.n, f"loss {state['losses'][-1]:.4f}")
                        if state["step"] % spec.save_every == 0 or state["step"] == total:
                            t_save = time.perf_counter()
                            _save(policy, out.path, state, spec.keep)
                            save_s += time.perf_counter() - t_save
                            last = state["step"]
                    bar.close()
                    if last != state["step"]:  # nothing to train (resumed at the end): make sure a checkpoint exists
                        _save(policy, out.path, state, spec.keep)
                seconds = time.perf_counter() - t0
                done = SFTResult(
                    output=out.path,
                    steps=state["step"],
                    epochs_completed=state["step"] // steps_per_epoch,
                    losses=state["losses"],
                    resumed_from=start[0] if start else None,
                    seconds=seconds,
                    checkpoint=os.path.join(out.path, f"step_{state['step']}"),
                    tokens=earlier + tokens,
                    run_tokens=tokens,
                    train_seconds=train_s,
                    checkpoint_seconds=save_s,
                )
                out.finish(done.__dict__)
                return done
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the cluster is closed; one line says what is kept
        raise _interrupted(out, e) from None
    finally:
        bar.close()
        out.close()  # the lock released; a run refused before it wrote anything leaves nothing


def _interrupted(out: JobOutput, e: BaseException) -> interrupts.JobInterrupted:
    newest = _newest_checkpoint(out.path) if os.path.exists(os.path.join(out.path, pio.MANIFEST)) else None
    if newest is not None:
        message = (
            f"interrupted: checkpoint step_{newest[0]} kept in {out.path}; {again(resume=True)} to train on from it"
        )
    elif os.path.exists(os.path.join(out.path, pio.MANIFEST)):
        message = f"interrupted: no checkpoint yet in {out.path}; {again(resume=True)} to start it"
    else:
        message = f"interrupted: nothing was written to {out.path}; {again()} to start over"
    return interrupts.JobInterrupted(message, interrupts.signum_of(e))


def _policy_config(
    model: str,
    precision: str,
    global_batch_size: int,
    micro_batch_size: int,
    max_length: int,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_name": model,
        "precision": precision,
        "train_global_batch_size": global_batch_size,
        "train_micro_batch_size": micro_batch_size,
        "max_total_sequence_length": max_length,
        "logprob_batch_size": micro_batch_size,
        "max_grad_norm": 1.0,
        "dynamic_batching": {
            "enabled": True,
            "train_mb_tokens": max_length * micro_batch_size,
            "logprob_mb_tokens": max_length * micro_batch_size,
        },
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": lr, "weight_decay": weight_decay}},
    }
    if warmup_steps:
        cfg["scheduler"] = [
            {
                "name": "torch.optim.lr_scheduler.LinearLR",
                "kwargs": {"start_factor": 1.0 / (warmup_steps + 1), "end_factor": 1.0, "total_iters": warmup_steps},
            },
            {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 1}},
            {"milestones": [warmup_steps]},
        ]
    return cfg


def _tokenize_all(
    client: Any,
    inputs: pio.ScoreInputs,
    pins: list[Any],
    text_column: str | None,
    prompt_column: str | None,
    response_column: str | None,
    tokenizer_dir: str,
    max_length: int,
    truncate: bool,
    convention: Convention,
) -> list[tuple[list[int], int]]:
    import dask

    columns = [c for c in (text_column, prompt_column, response_column) if c]
    parts = model_files.located_partitions(inputs, columns, pins)
    tasks = [
        dask.delayed(_tokenize_partition, pure=False)(
            p, text_column, prompt_column, response_column, tokenizer_dir, f, first, convention, max_length, truncate
        )
        for p, (f, _g, first, _n) in zip(parts, inputs.partitions)
    ]
    rows: list[tuple[list[int], int]] = []
    for (file, _g, first, _n), part in zip(inputs.partitions, client.gather(client.compute(tasks))):
        for i, (ids, start) in enumerate(part):
            if len(ids) < 2:
                raise ValueError(f"{file}: row {first + i}: {len(ids)} token(s), nothing to train on")
            if len(ids) > max_length:
                if not truncate:
                    raise ValueError(
                        f"{file}: row {first + i}: {len(ids)} tokens, more than "
                        f"{opt('max_length', max_length)}; pass {opt('truncate', True)} or raise "
                        f"{opt('max_length')}"
                    )
                ids = ids[:max_length]
            if start >= len(ids):
                raise ValueError(f"{file}: row {first + i}: no response token within {opt('max_length', max_length)}")
            rows.append((ids, start))
    if not rows:
        raise ValueError("the input has no rows")
    return rows


def _save(policy: Any, output: str, state: dict[str, Any], keep: int) -> None:
    """``output/step_N`` appears only when weights, optimizer, tokenizer and state are all written and on disk;
    then only the newest ``keep`` steps stay."""
    with model_files.publishing(os.path.join(output, f"step_{state['step']}")) as tmp:
        policy.save_checkpoint(
            os.path.join(tmp, "weights"),
            optimizer_path=os.path.join(tmp, "optimizer"),
            tokenizer_path=os.path.join(tmp, "tokenizer"),
        )
        pio.write_json_atomic(state, os.path.join(tmp, "training_state.json"))
    steps = sorted((int(m.group(1)), d) for d in os.listdir(output) if (m := _STEP.match(d)))
    for _n, d in steps[:-keep]:
        with contextlib.suppress(OSError):  # an old step that will not go is left, not worth failing the run for
            safe_paths.remove(os.path.join(output, d))  # a link goes as a link, never what it points to
