"""``PolicyFuture``: the future of one Policy call (``Policy.submit``), a ``distributed.Future`` of a real task.

One Policy call is one pinned task per rank (:class:`~dask_lm.engine.worker_group.WorkerGroup`); the ranks' answers
are parts (each rank's rows, or each rank's view of a train step). The future's key is a small *combine* task pinned
to rank 0's worker that depends on every rank's task and joins their answers into the call's result
(:mod:`dask_lm.workers.combine`): so the future works wherever Dask takes one — ``distributed.wait``,
``as_completed``, ``client.gather``, as an argument of ``client.submit`` or of another ``Policy.submit`` — and its
task shows on the dashboard's task stream under the call's name.

``result()`` first waits on the ranks themselves, with the group's rules for a failed call
(:meth:`WorkerGroup.settle`): the first failure wins, its peers get a few seconds to fail too, a peer still running
after that sits in a collective (the Policy is then broken), a lost worker is :class:`~dask_lm.WorkerLostError`,
a ``ValueError`` comes as it was raised and any other error as :class:`~dask_lm.RankFailedError` naming the call,
rank and worker: the text the blocking method raises, since the blocking method *is* ``submit(...).result()``.

``wait`` / ``as_completed`` see the combine task, which Dask marks failed as soon as one rank's task fails (a
dependent of a failed task fails at once, whatever its other dependencies are doing), so they do not hang on a peer
stuck in a collective either; ``client.gather`` of such a future raises the rank's own exception, unwrapped.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from distributed import Future

from dask_lm import interface
from dask_lm.data.messages import Join, JoinRows
from dask_lm.workers import tasks

if TYPE_CHECKING:
    from dask_lm.engine.worker_group import WorkerGroup

__all__ = ["PolicyFuture", "Pending"]


class PolicyFuture(Future[Any]):
    """The future of a Policy call, made by :meth:`dask_lm.Policy.submit`: a ``distributed.Future`` whose
    ``.result()`` is what the blocking method returns (and raises). ``call`` names the method.

    It works with ``distributed.wait``, ``as_completed`` and ``client.gather``, and as an argument of
    ``client.submit`` or of another ``Policy.submit``; see the Policy guide's "Futures" section for how errors
    surface through each.
    """

    def __init__(
        self,
        key: Any,
        client: Any,
        *,
        group: Any = None,  # the call's WorkerGroup
        ranks: Sequence[Future[Any]] = (),
        call: str = "",
        warnings: Future[Any] | None = None,
        done: Callable[[Any, BaseException | None], None] | None = None,
    ) -> None:
        super().__init__(key, client)
        self.call = call
        self._group: WorkerGroup | None = group
        self._ranks: list[Future[Any]] | None = list(ranks)
        self._warnings = warnings
        self._done = done

    @classmethod
    def combine(
        cls,
        group: WorkerGroup,
        ranks: Sequence[Future[Any]],
        how: Join,
        *,
        call: str,
        key_name: str,
        done: Callable[[Any, BaseException | None], None] | None = None,
    ) -> PolicyFuture:
        """The future of ``dask_lm.workers.tasks.combine`` of ``ranks``' answers joined as ``how`` says, pinned to
        rank 0's worker.
        ``done(value, error)`` runs once, at the first ``result()`` (the call's event, its progress bar closed).

        :meta private:
        """
        client = group.client
        token = uuid.uuid4().hex[:6]
        where = {"workers": [group.names[0]], "allow_other_workers": True, "pure": False, "retries": 0}
        joined = client.submit(tasks.combine, how, *ranks, key=f"{key_name}-{group.policy_id}-{token}", **where)
        # the ranks' warnings travel apart from the result (a few strings), so that the result stays the plain value
        # for wait / gather / a dependent task, and .result() raises them again at the user's line
        warned = client.submit(tasks.warnings_of, *ranks, key=f"{key_name}-warnings-{group.policy_id}-{token}", **where)
        fut = cls(joined.key, client, group=group, ranks=ranks, call=call, warnings=warned, done=done)
        joined.release()  # the PolicyFuture holds the key now
        fut.add_done_callback(_let_go_of_ranks)
        return fut

    def result(self, timeout: float | None = None) -> Any:
        """The call's result; a failure on a rank raises here with the blocking method's error."""
        try:
            value = self._policy_result(timeout)
        except BaseException as e:
            self._call_done(None, e)
            raise
        self._call_done(value, None)
        return value

    def _policy_result(self, timeout: float | None) -> Any:
        ranks, group = self._ranks, self._group
        if ranks is not None and group is not None:
            group.settle(ranks, what=self.call, timeout=timeout)
        if self._warnings is not None:
            value, warned = self.client.gather([self, self._warnings])
            interface.reissue([interface.Warned(None, tuple(warned))])
        else:
            value = super().result(timeout=timeout)
        if ranks is not None and group is not None:
            group.release(ranks)
        # the rank tasks' results were only inputs of the combine task: let the scheduler free them; the warnings
        # were raised once, here
        self._ranks, self._warnings = None, None
        return value

    def _call_done(self, value: Any, error: BaseException | None) -> None:
        done, self._done = self._done, None
        if done is not None and not isinstance(error, TimeoutError):
            done(value, error)

    def __repr__(self) -> str:
        return f"<PolicyFuture: {self.call}, status: {self.status}, key: {self.key}>"


def _let_go_of_ranks(fut: PolicyFuture) -> None:
    """Once the combined result is in, the rank tasks' answers are needed by nothing: neither this future (whose
    ``.result()`` settles the ranks only to explain a failure) nor the rank chain. Held, they would stay in the
    workers' memory for as long as the caller keeps the future (``wait`` and ``gather`` never call ``.result()``),
    and a held finished task is one the scheduler re-runs when its worker dies. Runs on distributed's callback
    thread."""
    ranks, group = fut._ranks, fut._group
    if fut.status == "finished" and ranks is not None and group is not None:
        fut._ranks = None
        group.release(ranks)


class Pending(NamedTuple):
    """A call posted to the ranks, before its answers are joined: what the ``post`` of a
    :data:`~dask_lm.engine.policy.SUBMIT` entry returns.
    ``rows`` / ``lengths``: each rank's input row numbers and lengths (inference calls, for :meth:`frame`)."""

    futures: list[Future[Any]]
    join: Join  # how dask_lm.workers.combine joins the answers
    call: str
    done: Callable[[Any, BaseException | None], None]
    rows: list[list[int]] | None = None
    lengths: list[list[int]] | None = None

    def future(self, group: WorkerGroup) -> PolicyFuture:
        """The answers joined into the call's result by a task on rank 0's worker (``collect=True``)."""
        return PolicyFuture.combine(
            group, self.futures, self.join, call=self.call, key_name=self.call.replace("_", "-"), done=self.done
        )

    def frame(self, group: WorkerGroup) -> Any:
        """The answers left where they are (``collect=False``): a Dask DataFrame, one partition per rank made on
        its worker (:func:`dask_lm.workers.combine.rank_frame`), a row per input row in the rank's order."""
        import dask.dataframe as dd

        assert isinstance(self.join, JoinRows) and self.rows is not None and self.lengths is not None, (
            "an inference call"
        )
        keys = self.join.keys
        client, token = group.client, uuid.uuid4().hex[:6]
        parts = [
            client.submit(
                tasks.rank_frame,
                answer,
                rows=rows,
                lengths=lens,
                keys=keys,
                key=f"{self.call.replace('_', '-')}-frame-{group.policy_id}-{token}-r{r}",
                workers=[group.names[r]],
                allow_other_workers=True,
                pure=False,
                retries=0,
            )
            for r, (answer, rows, lens) in enumerate(zip(self.futures, self.rows, self.lengths))
        ]
        # the rank chain lets go of each answer once it is done (the frame's tasks hold it from then on); not
        # before: until then the next call's task on that rank must wait for it
        for answer in self.futures:
            answer.add_done_callback(lambda f: group.release([f]) if f.status == "finished" else None)
        return dd.from_delayed(parts, meta=frame_meta(keys), verify_meta=False)


def frame_meta(keys: tuple[str, ...]) -> Any:
    """The empty pandas frame a ``collect=False`` result's partitions look like: ``row`` (int64), then per key a
    list of float32 per token (logprobs), a list of k-lists per token (top-k) or a float32 per row (scores)."""
    import pandas as pd
    import pyarrow as pa

    types = {
        "logprobs": pa.list_(pa.float32()),
        "reference_logprobs": pa.list_(pa.float32()),
        "topk_logits": pa.list_(pa.list_(pa.float32())),
        "topk_indices": pa.list_(pa.list_(pa.int64())),
        "scores": pa.float32(),
    }
    columns = {"row": pd.Series([], dtype="int64")}
    for key in keys:
        columns[key] = pd.Series([], dtype=pd.ArrowDtype(types[key]))
    return pd.DataFrame(columns)
