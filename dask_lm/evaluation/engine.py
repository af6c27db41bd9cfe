"""Token-id requests on a Dask cluster: the engine behind the lm-evaluation-harness model class
(:mod:`dask_lm.harness`), usable without lm-eval.

:class:`RequestEngine` takes lm-eval's two kinds of model work as token ids: ``loglikelihood`` (the summed
logprob of a continuation after its context, and whether greedy decoding would produce it) and ``generate``
(new tokens after a context). Requests are sorted longest first, so each task's rows pad to similar widths, and cut
into tasks of at most ``task_tokens`` tokens, at least two per worker when there are enough requests (a worker
done early takes the next task: Dask balances the load). Each task runs on whichever worker is free
(:func:`dask_lm.evaluation.tasks.loglikelihood_requests` / :func:`~dask_lm.evaluation.tasks.generate_requests`) on a
model replica that worker loads once and keeps until :meth:`RequestEngine.close`; results come back in request
order. Long requests are left-truncated as lm-eval's ``HFLM`` does: a request keeps its last ``max_length + 1``
tokens, of which the model reads all but the last.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dask_lm.config.defaults import PADDED_BATCH_TOKENS
from dask_lm.data.messages import GENERATE_BATCH_FACTOR, ScoreOptions
from dask_lm.data.packing import longest_first
from dask_lm.evaluation import tasks
from dask_lm.jobs.spec import precision_name
from dask_lm.jobs.start import worker_precision
from dask_lm.scoring.tasks import release_scorers
from dask_lm.workers.state import PLUGIN_NAME, DaskLMWorkerState

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_TASK_TOKENS", "RequestEngine", "model_positions"]

# a task's rows travel pickled with it and its results come back at its end: 64k tokens is a few seconds of a
# 7B forward on one GPU, short enough to balance across workers and to keep the progress bar moving
DEFAULT_TASK_TOKENS = 65536


def model_positions(model: str) -> int | None:
    """How many positions the model in directory ``model`` takes, from its ``config.json`` (the text config of a
    composite model first, then ``n_positions`` / ``max_position_embeddings`` / ``n_ctx``, as lm-eval reads them);
    ``None`` when the config names none."""
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for part in (cfg.get("text_config") or {}, cfg):
        for key in ("n_positions", "max_position_embeddings", "n_ctx"):
            if isinstance(part.get(key), int):
                return int(part[key])
    return None


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class RequestEngine:
    """lm-eval requests as token ids on the workers of a Dask cluster.

    ``model`` (and ``tokenizer``, default the model's) are local directories every worker can read. ``client`` is
    a Dask client, cluster or scheduler address; without one, ``dask_lm.connect(scheduler_address,
    n_workers=n_workers)`` attaches to a scheduler or starts a local cluster, which :meth:`close` shuts down again
    (a client given here stays open). ``precision`` (``"bfloat16"``, ``"float32"``, ``"float16"``; ``None``:
    bfloat16 on GPU workers, float32 on CPU ones). ``batch_tokens`` bounds a worker's micro-batch (padded tokens),
    ``task_tokens`` a task. ``max_length`` is the longest input the model reads (default: its positions).
    ``compile`` compiles each worker's scoring forward (pays only on long evaluations)."""

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        *,
        client: Any = None,
        scheduler_address: str | None = None,
        n_workers: int | None = None,
        precision: str | None = None,
        batch_tokens: int = PADDED_BATCH_TOKENS,
        task_tokens: int = DEFAULT_TASK_TOKENS,
        max_length: int | None = None,
        compile: bool = False,
        chunk_size: int = 1024,
        progress: bool = True,
    ) -> None:
        from dask_lm.engine import cluster
        from dask_lm.engine.worker_group import live_workers

        for name, value in (
            ("n_workers", n_workers),
            ("batch_tokens", batch_tokens),
            ("task_tokens", task_tokens),
            ("max_length", max_length),
            ("chunk_size", chunk_size),
        ):
            _positive(name, value)
        fixed = precision_name(precision)
        self.max_length = max_length if max_length is not None else model_positions(model)
        self.task_tokens = task_tokens
        self.progress = progress
        self.client: Any  # None once closed
        if client is None:
            self.client = cluster.connect(scheduler_address, n_workers=n_workers)
            self._owned = True
        else:
            self.client = cluster.as_client(client)
            self._owned = self.client is not client  # a scheduler address or cluster object: a client made here
        try:
            # the workers' dask-lm plugin holds the replicas and frees those a dead driver left idle
            self.client.register_plugin(DaskLMWorkerState(), name=PLUGIN_NAME)
            self.workers = len(live_workers(self.client)["workers"])
            self.opts = ScoreOptions(
                model=model,
                tokenizer=tokenizer or model,
                precision=fixed or worker_precision(self.client),
                output="-",
                batch_tokens=batch_tokens,
                chunk_size=chunk_size,
                compile=compile,
            )
        except BaseException:
            self._close_client()
            raise

    # ------------------------------------------------------------------------------------------ requests
    def loglikelihood(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of the continuation's logprobs, is_greedy)`` per ``(context ids, continuation ids)`` pair, in
        request order. The context must hold at least one token (lm-eval gives an empty context the BOS / EOS
        token) and the continuation at least one, and no more than ``max_length``."""
        ids: list[list[int]] = []
        starts: list[int] = []
        limit = self.max_length
        for i, (context, continuation) in enumerate(pairs):
            if not context or not continuation:
                raise ValueError(
                    f"request {i} has an empty {'context' if not context else 'continuation'}: "
                    "every request needs a context token to condition on (the BOS / EOS token for an "
                    "empty context) and a token to score"
                )
            if limit is not None and len(continuation) > limit:
                raise ValueError(
                    f"request {i}: its continuation has {len(continuation)} tokens, more than "
                    f"max_length ({limit}) lets the model read; shorten it, or raise max_length if "
                    "the model takes longer inputs"
                )
            row = list(context) + list(continuation)
            if limit is not None:
                row = row[-(limit + 1) :]
            ids.append(row)
            starts.append(len(row) - len(continuation))
        return self._run(
            "loglikelihood",
            [len(r) for r in ids],
            lambda part: (
                tasks.loglikelihood_requests,
                [ids[i] for i in part],
                [starts[i] for i in part],
                self.opts,
                part,
            ),
        )

    def generate(self, contexts: Sequence[list[int]], gen: dict[str, Any]) -> list[list[int]]:
        """The new token ids after each context, in request order. ``gen["max_new_tokens"]`` (required) caps
        them, ``gen["stop"]`` (strings) ends a row once its new text holds one, and every other key goes to Hugging
        Face's ``generate`` (greedy unless ``do_sample``). A context longer than ``max_length - max_new_tokens``
        keeps its last tokens, as lm-eval does."""
        max_new = gen.get("max_new_tokens")
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"gen['max_new_tokens'] must be a positive integer, got {max_new!r}")
        room = None if self.max_length is None else self.max_length - max_new
        if room is not None and room < 1:
            raise ValueError(
                f"max_new_tokens ({max_new}) leaves no room for a context in max_length "
                f"({self.max_length}); lower max_gen_toks or raise max_length"
            )
        rows = [list(c)[-room:] if room is not None else list(c) for c in contexts]
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"request {i} has an empty context: give it at least the BOS / EOS token")
        # one task per worker: a task's time is its decode steps (sequential), not its tokens, so fewer and wider
        # batches finish sooner; splitting further would only add steps (stop 23, benchmarks/lm_eval_requests.py)
        return self._run(
            "generate",
            [len(r) + max_new for r in rows],
            lambda part: (tasks.generate_requests, [rows[i] for i in part], gen, self.opts, part),
            per_worker=1,
            task_tokens=GENERATE_BATCH_FACTOR * self.task_tokens,
        )

    def plan(self, lengths: Sequence[int], *, per_worker: int = 2, task_tokens: int | None = None) -> list[list[int]]:
        """Request indices per task: longest first, each task at most ``task_tokens`` tokens (a longer request
        goes alone) and, given enough requests, at least ``per_worker`` tasks per worker."""
        if not lengths:
            return []
        wanted = min(len(lengths), per_worker * self.workers)
        task_tokens = self.task_tokens if task_tokens is None else task_tokens
        return longest_first(lengths, max(1, min(task_tokens, math.ceil(sum(lengths) / wanted))))

    def _run(
        self,
        what: str,
        lengths: list[int],
        task: Callable[[list[int]], tuple[Any, ...]],
        *,
        per_worker: int = 2,
        task_tokens: int | None = None,
    ) -> list[Any]:
        from distributed import as_completed, span

        from dask_lm.engine.progress import JobBar

        if self.client is None:
            raise ValueError("this RequestEngine is closed; create a new one")
        parts = self.plan(lengths, per_worker=per_worker, task_tokens=task_tokens)
        results: list[Any] = [None] * len(lengths)
        bar = JobBar(
            len(lengths),
            f"dask-lm {what}",
            "req",
            f"{len(parts)} tasks on {self.workers} workers",
            enabled=self.progress,
        )
        with span(f"dask-lm/lm-eval-{what}"):
            futures = [self.client.submit(*task(part), pure=False) for part in parts]
            where = {f.key: part for f, part in zip(futures, parts)}
            try:
                for fut in as_completed(futures):
                    part = where[fut.key]
                    for i, value in zip(part, fut.result()):  # a task's error is raised here
                        results[i] = value
                    bar.update(len(part))
            except BaseException:
                self.client.cancel(futures)
                raise
            finally:
                bar.close()
        return results

    # ------------------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the workers' replicas of the model, and close the client and local cluster this engine started."""
        if self.client is None:
            return
        try:
            self.client.run(release_scorers)
        finally:
            self._close_client()

    def _close_client(self) -> None:
        from dask_lm.engine import cluster

        client, self.client = self.client, None
        if client is not None and self._owned:
            cluster.close(client)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
