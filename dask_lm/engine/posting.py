"""How a Policy call reaches its ranks: the batch checked (on the driver, or on the workers for rows that stay
there), cut into per-rank shards and posted as one request per rank (:meth:`PostingMixin._post_sharded`), and the
call's event logged when its result is taken."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from distributed import span

from dask_lm.data.batch import BatchedDataDict
from dask_lm.data.messages import JoinRows, Request, Shard
from dask_lm.data.validation import validate_input_batch
from dask_lm.engine.dataflow import RemoteRows, is_remote
from dask_lm.engine.events import log_call
from dask_lm.engine.futures import Pending
from dask_lm.engine.metrics import timed
from dask_lm.engine.policy_base import PolicyBase

__all__ = ["Posted", "PostingMixin"]


class Posted(NamedTuple):
    """One call's rank futures, the permutation that restores input order (or None), its ``done`` hook, and each
    rank's input rows (row numbers and lengths, for ``collect=False``)."""

    futures: list[Any]
    order: list[int] | None
    done: Callable[[Any, BaseException | None], None]
    rows: list[list[int]]
    lengths: list[list[int]]


class PostingMixin(PolicyBase):
    """The posting half of :class:`~dask_lm.Policy`, shared by its inference calls."""

    def _post_sharded(
        self,
        request: Callable[[Shard], Request],
        data: Any,
        *,
        what: str,
        timer: Any = None,
        contiguous: bool = False,
        rows_per_mb: bool = False,
    ) -> Posted:
        """Validate, shard and post ``request(its shard)`` to each rank: the ranks' futures, the permutation that
        restores input order (or None) and what to log when the call is done. ``rows_per_mb``: the call names a
        micro_batch_size, so no packing."""
        start = time.perf_counter()
        group = self.group
        remote = RemoteRows(self, data, call=what) if is_remote(data) else None
        if remote is not None:  # checked on the workers; planned here from the rows' lengths
            data = remote.skeleton()
        else:
            data = validate_input_batch(
                data,
                what=what,
                vocab_size=self.vocab_size,
                max_length=self.cfg.max_total_sequence_length,
                pad_token_id=self.pad_token_id,
            )
            # the forward needs only these two keys; other per-row data (masks, advantages) stays on the driver
            data = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        with timed(timer, f"{what}/shard_data"):
            if contiguous:  # rows stay in order, a contiguous slice per rank (generation decodes whole rows)
                shards, order, packed = (
                    data.shard_by_batch_size(self.data_parallel_size, allow_uneven_shards=True),
                    None,
                    False,
                )
            else:
                # rows per micro-batch were asked for when the call names a micro_batch_size: no packing then
                shards, order, packed = self._shard(data, auto_pack=not rows_per_mb)
        with timed(timer, f"{what}/submit_logprob_futures"), span(f"dask-lm/{what}"):
            source = (
                remote.bind(shards, packed=packed)
                if remote is not None
                else [Shard.of(s, packed=packed) for s in shards]
            )
            futures = self._post_requests(request, source, what=what)
        tokens, rows = int(data["input_lengths"].sum()), int(data["input_lengths"].shape[0])
        # each rank's rows as input row numbers: the shards in rank order are the input rows permuted by `order`
        numbers = list(range(rows)) if order is None else list(order)
        per_rank, lens, at = [], [], 0
        for s in shards:
            n = int(s["input_lengths"].shape[0])
            per_rank.append(numbers[at : at + n])
            lens.append(s["input_lengths"].tolist())
            at += n
        return Posted(
            futures, order, self._logger(what, start, tokens=tokens, rows=rows, ranks=group.world_size), per_rank, lens
        )

    def _logger(self, what: str, start: float, **fields: Any) -> Callable[[Any, BaseException | None], None]:
        """The call's event (:func:`dask_lm.engine.events.log_call`), logged when its result is taken."""
        client, policy_id = self.client, self.group.policy_id

        def done(value: Any, error: BaseException | None) -> None:
            if error is None:
                log_call(client, policy_id, what, start=start, **fields)

        return done

    def _rows_future(self, posted: Posted, what: str, keys: tuple[str, ...], cat: bool = False) -> Pending:
        return Pending(
            posted.futures, JoinRows(keys, posted.order, cat), what, posted.done, posted.rows, posted.lengths
        )
