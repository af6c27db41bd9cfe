"""Data that stays on the workers: a Dask DataFrame of token ids, or a ``distributed.Future`` of a batch (another
call's :class:`~dask_lm.engine.futures.PolicyFuture`, a task's BatchedDataDict), handed to ``Policy.submit``.

The driver plans; the rows travel worker to worker (:mod:`dask_lm.workers.dataflow` runs the tasks):

1. a *prepare* task per partition checks it and turns it into a batch, where the partition is; a *lengths* task
   per partition returns its rows' lengths, which the driver gathers (numbers per row: no token);
2. the driver plans once from the lengths, with the same sharding code as a batch it holds
   (:mod:`dask_lm.data.shard_plan`): which rows each rank gets, in which order and micro-batches;
3. a *cut* task per (partition, rank) takes the rank's rows of the partition, and an *assemble* task pinned to
   each rank joins its pieces into the call's request; the rank's ``serve`` task takes that request.

So what the driver sends grows with rows (the plan), not with tokens; ``benchmarks/train.py --input dataframe``
measures it. ``submit`` returns once the lengths are in: a bad row is a ``ValueError`` there, naming the partition
and the row, before any rank works.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import torch
from distributed import Future, wait

from dask_lm.data import shard_plan
from dask_lm.workers import tasks

if TYPE_CHECKING:
    from dask_lm.data.batch import BatchedDataDict
    from dask_lm.engine.policy_base import PolicyBase

__all__ = ["is_remote", "RemoteRows"]


def _is_dask_frame(data: Any) -> bool:
    module = type(data).__module__ or ""
    if not module.startswith(("dask.", "dask_expr")):
        return False
    import dask.dataframe as dd

    return isinstance(data, dd.DataFrame)


def is_remote(data: Any) -> bool:
    """Whether ``data`` lives on the workers (a future, or a Dask DataFrame) rather than in this process."""
    return isinstance(data, Future) or _is_dask_frame(data)


class RemoteRows:
    """The rows of one call, left where they are; made by ``Policy.submit`` for a future or a Dask DataFrame."""

    def __init__(self, policy: PolicyBase, data: Any, *, call: str, train: tuple[Any, Any] | None = None) -> None:
        self.group = group = policy.group
        self.client = client = policy.client
        self.pad_token_id = policy.pad_token_id
        self.token = f"{group.policy_id}-{uuid.uuid4().hex[:6]}"
        if isinstance(data, Future):
            parts, source = [data], "future"
        else:
            # one future per partition; only the collection's graph goes to the scheduler, not its rows
            parts, source = client.compute(data.to_delayed()), "frame"
        opts = {
            "call": call,
            "pad_token_id": policy.pad_token_id,
            "vocab_size": policy.vocab_size,
            "max_length": policy.cfg.max_total_sequence_length,
            "train": train,
        }
        self.prepared = [
            client.submit(
                tasks.prepare_rows, p, source=source, index=i, pure=False, key=f"prepare-rows-{self.token}-{i}", **opts
            )
            for i, p in enumerate(parts)
        ]
        del parts  # the prepared batches hold the rows from here on
        futures = [
            client.submit(tasks.row_lengths, b, pure=False, key=f"row-lengths-{self.token}-{i}")
            for i, b in enumerate(self.prepared)
        ]
        wait(futures)
        for fut in futures:  # the first bad partition in order (not the first to fail), the same on every run
            if fut.status == "error":
                fut.result()
        lens = client.gather(futures)
        self.counts = [int(n.shape[0]) for n, _w in lens]
        if not sum(self.counts):
            what = "the future's batch" if source == "future" else "the Dask DataFrame"
            raise ValueError(f"{call}: {what} has no rows; pass at least one row")
        self.lengths = torch.cat([n for n, _w in lens])
        self.width = max(w for _n, w in lens)
        self.plans: list[shard_plan.RankPlan] | None = None

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    def skeleton(self) -> BatchedDataDict[Any]:
        """The rows as the sharding code sees them (:func:`dask_lm.data.shard_plan.skeleton`)."""
        return shard_plan.skeleton(self.lengths, self.width)

    def bind(self, shards: list[Any], *, packed: bool) -> RemoteRows:
        """Take the plan: ``shards`` are the skeleton's, as ``Policy._shard`` cut it."""
        self.plans = shard_plan.rank_plans(shards, self.counts, packed=packed)
        return self

    def requests(self, make: Any) -> list[Future[Any]]:
        """Per rank, the future of ``make(its shard)`` on its worker (cut and assemble tasks)."""
        assert self.plans is not None and len(self.plans) == self.group.world_size, "bind() the plan first"
        client, out = self.client, []
        for r, plan in enumerate(self.plans):
            pieces = [
                client.submit(
                    tasks.cut_rows, self.prepared[p], rows, pure=False, key=f"cut-rows-{self.token}-p{p}-r{r}"
                )
                for p, rows in plan.pieces
            ]
            out.append(
                client.submit(
                    tasks.assemble_rows,
                    *pieces,
                    order=plan.order,
                    plan=plan.plan,
                    width=self.width,
                    pad_token_id=self.pad_token_id,
                    make=make,
                    workers=[self.group.names[r]],
                    allow_other_workers=False,
                    pure=False,
                    key=f"assemble-rows-{self.token}-r{r}",
                )
            )
        return out
