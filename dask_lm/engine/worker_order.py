"""One order of SPMD calls per worker, whichever Policy a call belongs to.

A Policy's call is one pinned task per rank, and its ranks meet in collectives: a rank that started the call waits
in its first collective until every peer has started it too. Two Policies on the same workers (a policy and its
reference or reward model, NeMo RL's pattern) therefore deadlock when one worker starts Policy A's call while its
peer starts Policy B's: each waits for a peer that is busy in the other Policy's call, until the collective timeout.
Nothing in Dask prevents it: a worker runs whichever of its ready tasks comes first.

So the driver keeps, per worker, the last SPMD task submitted there by any Policy of the same ``Client``, and chains
every new rank task after it. Calls are appended under one lock, a whole call (all its ranks) at a time, so the
calls of all Policies run on every worker in the one order they were submitted in, from any driver thread, through
``submit`` futures or blocking calls alike. Then no deadlock is possible: the earliest unfinished call has nothing
unfinished before it on any of its workers, so all its ranks start, and it finishes.

Dask fails every task whose dependency failed, and one Policy's failed call must not fail the next call of another
Policy: a rank task is therefore a *link* (:func:`dask_lm.workers.tasks.link`) that never fails (its value is the
answer or a :class:`~dask_lm.workers.tasks.Failed`), and what callers wait on is a second small task on the same
worker (:func:`dask_lm.workers.tasks.result_of`) that returns the answer or raises the rank's error.

The order holds among the Policies of one ``Client`` (a Dask future cannot depend on another client's). Policies
made on one cluster through different clients (or driver processes) are not ordered; the group's watchdog
(:mod:`dask_lm.engine.stuck`) names the Policy a waiting rank's worker is busy in.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

from distributed import Client, Future

__all__ = ["Tail", "WorkerOrder", "order_of"]

BAD = ("error", "cancelled", "lost")


class Tail(NamedTuple):
    """One rank task at the end of a chain."""

    link: Future[Any]  # the task itself (tasks.link): never fails; its value is the answer or a Failed
    result: Future[Any]  # what callers wait on (tasks.result_of): the answer, or the rank's error raised
    policy_id: str
    incarnation: str  # the worker process it was submitted to (WorkerGroup.ids)
    contagious: bool  # a failure of it fails the same Policy's next call on the rank (not for settle=True calls)

    def failed(self) -> bool:
        """Done and failed as its caller sees it: the next call of its Policy runs without it."""
        return self.link.status in BAD or (self.contagious and self.result.status in BAD)


class WorkerOrder:
    """The last SPMD task on each worker (by name) among the Policies of one Client, and the lock that appends a
    whole call at once. Shared by every :class:`~dask_lm.engine.worker_group.WorkerGroup` of the client."""

    def __init__(self) -> None:
        # reentrant: a group appends under it and may release finished tails while it holds it
        self.lock = threading.RLock()
        self._tails: dict[Any, Tail] = {}

    def after(self, worker: Any, incarnation: str) -> Future[Any] | None:
        """The task a new rank task on ``worker`` must follow: the worker's last one, unless it is done (nothing to
        wait for) or was submitted to an earlier process of that worker (it never runs: the worker restarted)."""
        tail = self._tails.get(worker)
        if tail is None or tail.incarnation != incarnation or tail.link.status in ("finished", *BAD):
            return None
        return tail.link

    def append(self, worker: Any, tail: Tail) -> None:
        self._tails[worker] = tail

    def forget(self, results: list[Future[Any]]) -> None:
        """Let go of the tails whose result is among ``results`` (a finished call; see WorkerGroup.release)."""
        with self.lock:
            for worker, tail in list(self._tails.items()):
                if any(tail.result is f for f in results):
                    del self._tails[worker]

    def forget_failed(self) -> None:
        """Let go of tails that are done and failed (they hold nothing later calls must wait for)."""
        with self.lock:
            for worker, tail in list(self._tails.items()):
                if tail.failed():
                    del self._tails[worker]


_ORDERS: weakref.WeakKeyDictionary[Client, WorkerOrder] = weakref.WeakKeyDictionary()
_ORDERS_LOCK = threading.Lock()


def order_of(client: Client) -> WorkerOrder:
    """The one :class:`WorkerOrder` of ``client`` (made on first use, gone with the client)."""
    with _ORDERS_LOCK:
        order = _ORDERS.get(client)
        if order is None:
            order = _ORDERS[client] = WorkerOrder()
        return order
