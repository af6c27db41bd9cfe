"""Ranks as Dask workers: pinned, chained SPMD tasks and the torch.distributed rendezvous.

Rank r is the worker whose *name* sorts r-th (names survive a nanny restart; addresses do not). A collective call
is one task per rank, submitted together under a lock, each pinned to its worker (``allow_other_workers=False``)
and chained to that rank's previous SPMD task so every rank runs collectives in the same order, and to the
worker's previous task of any other Policy of the same client, so that Policies sharing workers run their calls
in one order on every worker and never deadlock (:mod:`dask_lm.engine.worker_order`). Tasks never retry: one rank
cannot redo a collective alone, so a lost rank fails the call with an error naming it.

The group holds the Policy's lease (:mod:`dask_lm.workers.lease`): while this driver lives, the scheduler keeps a
key that the ranks check; when the driver dies, the ranks free the Policy by themselves.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import Client, Future, Lock, as_completed, wait

from dask_lm import interface
from dask_lm.engine.stuck import Watchdog
from dask_lm.engine.worker_order import Tail, order_of
from dask_lm.errors import RankFailedError, WorkerLostError
from dask_lm.workers import lease, tasks
from dask_lm.workers.state import PLUGIN_NAME, DaskLMWorkerState

if TYPE_CHECKING:
    from dask_lm.data.messages import Request

__all__ = ["WorkerGroup", "RankFailedError", "WorkerLostError"]

logger = logging.getLogger("dask_lm")

# how long WorkerGroup.settle waits on a call's ranks before it asks the scheduler whether their workers are still
# there. Dask never fails a task pinned to a worker that left (allow_other_workers=False): it stays 'no-worker' on
# the scheduler, so when no peer fails with the lost rank (they had finished), nothing else ends the wait. A few
# seconds: a lost worker is named soon, and a long call costs the scheduler one identity query per slice.
SETTLE_SLICE_S = 5.0


def scheduler_info(client: Client) -> dict[str, Any]:
    # asked of the scheduler itself: Client.scheduler_info() fetches, then returns the client's cached identity,
    # which the client's periodic refresh (every 2 s, without the workers) may overwrite in between, so that it
    # listed no worker now and then (distributed 2026.8: a scoring job then preloaded nothing). Recent distributed
    # lists only 5 workers unless asked for all.
    scheduler = client.scheduler
    if scheduler is None:  # a closed client: what it last knew
        return dict(client.scheduler_info())
    try:
        return dict(client.sync(scheduler.identity, n_workers=-1))
    except TypeError:  # a scheduler without n_workers lists them all
        return dict(client.scheduler_info())


def live_workers(client: Client, timeout_s: float = 120.0) -> dict[str, Any]:
    """The scheduler's workers, waiting up to ``timeout_s`` for one when there are none at the moment (a cluster
    still starting, or whose workers are being restarted by their nannies)."""
    info = scheduler_info(client)
    if not info["workers"]:
        client.wait_for_workers(1, timeout=timeout_s)
        info = scheduler_info(client)
    return info


def _incarnation(address: str, info: dict[str, Any]) -> str:
    return lease.incarnation(address, info.get("local_directory", ""))


def _name_key(name: Any) -> tuple[int, Any]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))


@dataclass(frozen=True)
class _RankCall:
    """One rank's task of :meth:`WorkerGroup.submit`: ``fn(previous, *args, **kwargs)``, placed by ``where``
    (:meth:`WorkerGroup._where`); ``key_name`` and ``settle`` as ``submit`` takes them."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key_name: str
    where: dict[str, Any]
    settle: bool


class WorkerGroup:
    """The Dask workers one Policy runs on, one rank each."""

    def __init__(
        self,
        client: Client,
        *,
        workers: Sequence[Any] | None = None,
        name_prefix: str = "lm_policy",
        wait_timeout_s: float = 120.0,
    ) -> None:
        self.client = client
        info = live_workers(client, wait_timeout_s)
        by_name = {w["name"]: addr for addr, w in info["workers"].items()}
        if workers is None:
            names = sorted(by_name, key=_name_key)
        else:
            missing = [w for w in workers if w not in by_name]
            if missing:
                raise ValueError(f"workers {missing} are not in the cluster (it has {sorted(by_name, key=_name_key)})")
            names = list(workers)
        if not names:
            raise ValueError("no workers to run the policy on: pass workers that are in the cluster")
        self.names: list[Any] = names
        self.hosts: list[str] = [info["workers"][by_name[n]]["host"] for n in names]
        # a restarted worker keeps its name (and Dask id, which is the name) but not its address and scratch
        # directory together: that pair tells whether a rank is still the process that holds its shard
        self.ids: list[str] = [_incarnation(by_name[n], info["workers"][by_name[n]]) for n in names]
        self.policy_id = f"{name_prefix}-{uuid.uuid4().hex[:8]}"
        self.scheduler_address = str(getattr(client.scheduler, "address", "") or "")
        # each rank's last chained task of this group; the order across the client's groups is shared
        self._last: list[Tail | None] = [None] * len(names)
        self._order = order_of(client)
        self._submit_lock = self._order.lock
        self.settle_timeout_s = 10.0
        self.broken: RankFailedError | None = None
        client.register_plugin(DaskLMWorkerState(), name=PLUGIN_NAME)
        # taken before any rank loads: a rank that sees no lease frees the policy
        self.lease: Future[Any] | None = client.submit(
            lease.lease_token, self.policy_id, pure=False, key=lease.lease_key(self.policy_id)
        )

    @staticmethod
    def per_node(client: Client, workers_per_node: int) -> list[Any]:
        """The names of at most ``workers_per_node`` workers per host (the first by name on each), in rank order."""
        if workers_per_node < 1:
            raise ValueError(f"`workers_per_node` must be >= 1, got {workers_per_node}")
        per_host: dict[str, list[Any]] = {}
        for w in live_workers(client)["workers"].values():
            per_host.setdefault(w["host"], []).append(w["name"])
        return sorted(
            (n for names in per_host.values() for n in sorted(names, key=_name_key)[:workers_per_node]), key=_name_key
        )

    def release_lease(self) -> None:
        fut, self.lease = self.lease, None
        if fut is not None:
            try:
                fut.release()
            except Exception:  # a closed client has released it already
                pass

    def lost_ranks(self, *, unreachable_is_lost: bool = True) -> list[int]:
        """Ranks whose worker is gone or was restarted since the group was made (a fresh scheduler query). A
        scheduler that does not answer counts as every rank lost, unless ``unreachable_is_lost`` is false (a poll
        during a healthy call, where one slow answer must not break the Policy for good)."""
        try:
            workers = scheduler_info(self.client)["workers"]
        except Exception:  # the scheduler itself is unreachable: every rank is as good as lost
            return list(range(self.world_size)) if unreachable_is_lost else []
        alive = {(w["name"], _incarnation(a, w)) for a, w in workers.items()}
        return [r for r, (n, i) in enumerate(zip(self.names, self.ids)) if (n, i) not in alive]

    def addresses(self) -> dict[str, Any]:
        """The address of each rank's worker that the scheduler lists now -> the worker's name."""
        workers = scheduler_info(self.client)["workers"]
        by_name = {w["name"]: a for a, w in workers.items()}
        return {by_name[n]: n for n in self.names if n in by_name}

    def _lost_error(self, lost: list[int], what: str) -> WorkerLostError:
        workers = ", ".join(f"{self.names[r]!r} (rank {r} of {self.world_size})" for r in lost)
        noun = "worker" if len(lost) == 1 else "workers"
        return WorkerLostError(
            f"{noun} {workers} died or restarted during {what}; this Policy's state there is "
            "gone: create a new Policy (and reload the last checkpoint)"
        )

    def fail_if_lost(self, what: str, cause: BaseException | None = None) -> None:
        """Raise (and remember) :class:`WorkerLostError` when a rank's worker, or the scheduler, is gone."""
        self.fail_if_scheduler_lost(what, cause)
        lost = self.lost_ranks()
        if lost:
            self.fail_if_scheduler_lost(what, cause)  # the query itself may be what found the scheduler gone
            if not isinstance(self.broken, WorkerLostError):  # the first call that saw the loss names it
                self.broken = self._lost_error(lost, what)
            raise type(self.broken)(str(self.broken)) from cause

    def scheduler_lost(self) -> bool:
        """This driver lost its scheduler: its client is reconnecting, closing or closed, or the lease was cancelled
        (Dask cancels every future of a client whose scheduler connection dropped, the lease among them, and the
        ranks then free the Policy as they would for a dead driver)."""
        if self.client.status != "running":
            return True
        return self.lease is not None and self.lease.status == "cancelled"

    def _scheduler_lost_error(self, what: str | None) -> WorkerLostError:
        at = f" at {self.scheduler_address}" if self.scheduler_address else ""
        during = f" during {what}" if what else ""
        return WorkerLostError(
            f"this driver lost its connection to the scheduler{at}{during} (the scheduler stopped, or the network to "
            "it failed): Dask cancelled every call of this Policy in flight, and the workers free the Policy's model "
            "without their scheduler. Start the cluster again (or reconnect to it), create a new Policy and reload "
            "the last checkpoint"
        )

    def fail_if_scheduler_lost(self, what: str | None, cause: BaseException | None = None) -> None:
        """Raise (and remember) :class:`WorkerLostError` naming the scheduler when this driver lost it."""
        if self.scheduler_lost():
            if not isinstance(self.broken, WorkerLostError):
                self.broken = self._scheduler_lost_error(what)
            raise type(self.broken)(str(self.broken)) from cause

    @property
    def world_size(self) -> int:
        return len(self.names)

    def raise_if_broken(self) -> None:
        if self.broken is None and self.scheduler_lost():
            self.broken = self._scheduler_lost_error(None)
        if self.broken is not None:
            # the same error class and text on every later call, whatever the call
            raise type(self.broken)(str(self.broken))

    def scatter(self, payloads: Sequence[Any], *, what: str) -> list[Future[Any]]:
        """``payloads[r]`` onto rank r's worker (one per rank), ahead of the call that reads it."""
        self.raise_if_broken()
        try:
            return [self.client.scatter(p, workers=[n], hash=False) for p, n in zip(payloads, self.names)]
        except Exception as e:  # a rank's worker left between calls: say so, not "missing port number"
            self.fail_if_lost(what, e)
            raise

    def submit(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        key_name: str,
        per_rank: Sequence[tuple[Any, ...]] | None = None,
        per_rank_kwargs: Sequence[dict[str, Any]] | None = None,
        ranks: Sequence[int] | None = None,
        chain: bool = True,
        settle: bool = False,
        **kwargs: Any,
    ) -> list[Future[Any]]:
        """The one way work reaches the ranks: a pinned task on each of ``ranks`` (default: all), submitted together
        under the group's lock and, when ``chain``, chained after that rank's previous SPMD task.

        Rank r runs ``fn(previous result, *args, *per_rank[r], **kwargs, **per_rank_kwargs[r])``. ``settle``: the
        futures handed back resolve to the rank's result or raise its error, while the rank's chain goes on past a
        failure (refit futures, which the caller gathers when it likes: see :func:`tasks.link`)."""
        ranks = range(self.world_size) if ranks is None else ranks
        with self._submit_lock:
            if chain:
                self.raise_if_broken()
            futures = []
            token = uuid.uuid4().hex[:6]  # one per call, in every rank's key: the watchdog tells calls apart by it
            for r in ranks:
                call = _RankCall(
                    fn,
                    (*args, *(per_rank[r] if per_rank is not None else ())),
                    {**kwargs, **(per_rank_kwargs[r] if per_rank_kwargs is not None else {})},
                    key_name,
                    self._where(r, key_name, token),
                    settle,
                )
                futures.append(self._submit_link(r, call) if chain else self._submit_alone(call))
        return futures

    def _where(self, rank: int, key_name: str, token: str) -> dict[str, Any]:
        return {
            "workers": [self.names[rank]],
            "allow_other_workers": False,
            "pure": False,
            "retries": 0,
            "key": f"{key_name}-{self.policy_id}-r{rank}-{token}",
        }

    def _submit_alone(self, call: _RankCall) -> Future[Any]:
        """An unchained task on the call's rank (``fn(None, ...)``): it neither waits for the chain nor joins it."""
        if not call.settle:
            return self.client.submit(call.fn, None, *call.args, **call.where, **call.kwargs)
        fut = self.client.submit(tasks.settled, None, call.fn, *call.args, **call.where, **call.kwargs)
        return self.client.submit(tasks.unwrap, fut, key=f"{call.key_name}-result-{fut.key}", pure=False)

    def _submit_link(self, rank: int, call: _RankCall) -> Future[Any]:
        """A chained task on ``rank``: after this group's previous call there and after the worker's previous task
        of any other group of the client (:mod:`dask_lm.engine.worker_order`). Returns what the caller waits on
        (:func:`tasks.result_of`), a task pinned beside it that raises the rank's error."""
        own = self._last[rank]
        if own is not None and own.failed():
            # a failed call the user already saw (refit futures are gathered by the caller): it has finished, so
            # order is kept without it, and chaining on it would fail this call with that old error
            own = None
        name = self.names[rank]
        after = self._order.after(name, self.ids[rank])
        if own is not None and after is own.link:
            after = None
        link = self.client.submit(
            tasks.link,
            None if own is None else own.link,
            after,
            call.fn,
            not call.settle,
            self.policy_id,
            *call.args,
            **call.where,
            **call.kwargs,
        )
        result = self.client.submit(
            tasks.result_of,
            link,
            call.settle,
            key=f"{call.where['key']}-result",
            workers=[name],
            allow_other_workers=True,
            pure=False,
            retries=0,
        )
        tail = Tail(link, result, self.policy_id, self.ids[rank], not call.settle)
        self._last[rank] = tail
        self._order.append(name, tail)
        return result

    def call(
        self, fn: Callable[..., Any], /, *args: Any, what: str, key_name: str, progress: Any = None, **kwargs: Any
    ) -> list[Any]:
        """:meth:`submit`, then :meth:`gather`: one result per rank."""
        return self.gather(self.submit(fn, *args, key_name=key_name, **kwargs), what=what, progress=progress)

    def post(
        self, requests: Request | Sequence[Request], *, key_name: str, what: str, settle: bool = False
    ) -> list[Future[Any]]:
        """Requests to :func:`tasks.serve` on every rank: one per rank (each scattered onto its rank's worker
        first, since they carry the rows) or one for all."""
        if isinstance(requests, (list, tuple)):
            assert len(requests) == self.world_size, (len(requests), self.world_size)
            payloads = self.scatter(requests, what=what)
            return self.submit(
                tasks.serve, self.policy_id, per_rank=[(p,) for p in payloads], key_name=key_name, settle=settle
            )
        return self.submit(tasks.serve, self.policy_id, requests, key_name=key_name, settle=settle)

    def run(
        self, requests: Request | Sequence[Request], *, what: str, key_name: str, progress: Any = None
    ) -> list[Any]:
        """:meth:`post`, then :meth:`gather`: each rank's answer, in rank order."""
        return self.gather(self.post(requests, key_name=key_name, what=what), what=what, progress=progress)

    def gather(
        self, futures: Sequence[Future[Any]], *, what: str, timeout: float | None = None, progress: Any = None
    ) -> list[Any]:
        """Results of one SPMD call; a failure names the rank and worker and keeps the root cause. ``progress``
        (a tqdm bar, or None) moves by one per finished rank."""
        self.settle(futures, what=what, timeout=timeout, progress=progress)
        # the ranks' warnings, raised again at the user's call: once, not once per rank (dask_lm.interface)
        results: list[Any] = interface.reissue(self.client.gather(list(futures)))
        self.release(futures)
        return results

    def release(self, futures: Sequence[Future[Any]]) -> None:
        """Let the rank chains go of ``futures`` (a finished call)."""
        # a finished call needs no successor chained on it (the next call is submitted after this one ended), and a
        # held future of a finished task is one the scheduler recomputes when its worker dies — a model load or a
        # train step re-run on a restarted worker. So the chain lets go of what it gathered.
        with self._submit_lock:
            for r, last in enumerate(self._last):
                if last is not None and any(last.result is f for f in futures):
                    self._last[r] = None
            self._order.forget(list(futures))

    def settle(
        self, futures: Sequence[Future[Any]], *, what: str, timeout: float | None = None, progress: Any = None
    ) -> None:
        """Wait until every rank of one SPMD call finished, or raise its failure as :meth:`gather` does (without
        fetching the results: :class:`dask_lm.engine.futures.PolicyFuture` fetches only the combined one)."""
        # a driver without its scheduler: its futures are cancelled, and once the client has closed, Dask's wait
        # helpers find no client at all ("ValueError: No clients found")
        self.fail_if_scheduler_lost(what)
        self._wait_ranks(futures, what=what, timeout=timeout, progress=progress)
        bad = ("error", "cancelled", "lost")
        failed = [(r, f) for r, f in enumerate(futures) if f.status in bad]
        if not failed and any(f.status != "finished" for f in futures):
            failed = [(r, f) for r, f in enumerate(futures) if f.status != "finished"]
        if failed:
            self.fail_if_scheduler_lost(what)  # a scheduler that went away cancels every rank's task
            # peers of a failed rank usually fail fast too (same bad input); give them a moment to settle
            pending = [f for f in futures if f.status == "pending"]
            if pending:
                try:
                    wait(pending, timeout=self.settle_timeout_s)
                except TimeoutError:
                    pass
            # Dask fails every task whose dependency failed, so a failed task must not stay at the head of its
            # rank's chain: the Policy keeps working after a rejected or failed call
            with self._submit_lock:
                for r, last in enumerate(self._last):
                    if last is not None and last.failed():
                        self._last[r] = None
                self._order.forget_failed()
            # a dead worker explains every other symptom (closed comms, peers failing their collective, a restarted
            # worker without the policy): say that, once, the same way on every later call
            self.fail_if_lost(what)
            stuck = [self.names[r] for r, f in enumerate(futures) if f.status == "pending"]
            if stuck:
                # a rank still running after its peer failed sits in a collective: the group cannot be trusted
                self.broken = RankFailedError(
                    f"workers {stuck} did not finish {what} after a peer failed (stuck in a collective until its "
                    "timeout); shut this Policy down and create it again"
                )
            errors = []
            for rank, fut in failed + [
                (r, f) for r, f in enumerate(futures) if f.status in bad and (r, f) not in failed
            ]:
                try:
                    errors.append((rank, fut.exception(timeout=5)))
                except Exception as e:  # cancelled / lost futures raise here
                    errors.append((rank, e))
            # report the root cause, not a rank that only learned that a peer failed
            rank, exc = next(((r, e) for r, e in errors if not isinstance(e, tasks.PeerFailedError)), errors[0])
            if isinstance(exc, ValueError):
                raise exc
            raise RankFailedError(
                f"{what} failed on rank {rank} (worker {self.names[rank]!r}): {type(exc).__name__}: {exc}"
            ) from exc

    def _wait_ranks(self, futures: Sequence[Future[Any]], *, what: str, timeout: float | None, progress: Any) -> None:
        """Until every rank finished or one did not (failed, cancelled, lost), in slices of :data:`SETTLE_SLICE_S`;
        after a slice that ends with ranks still pending, a rank whose worker is gone fails the call
        (:meth:`fail_if_lost`), and so does a deadlock with another Policy's call (:mod:`dask_lm.engine.stuck`).
        TimeoutError once ``timeout`` has passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(futures)
        watchdog: Watchdog | None = None
        while pending:
            slice_s = SETTLE_SLICE_S if deadline is None else min(SETTLE_SLICE_S, max(deadline - time.monotonic(), 0))
            try:
                for fut in as_completed(pending, timeout=slice_s, loop=self.client.loop):
                    if fut.status != "finished":
                        return  # stop at the first failure: its peers may sit in a collective until its timeout
                    pending = [f for f in pending if f is not fut]
                    if progress is not None:
                        progress.update(1)
            except TimeoutError:
                self.fail_if_scheduler_lost(what)
                if self.lost_ranks(unreachable_is_lost=False):
                    self.fail_if_lost(what)
                watchdog = watchdog or Watchdog(self, what)
                deadlock = watchdog.check()
                if deadlock is not None:
                    # its ranks sit in collectives until their timeout: no later call can run on them before
                    self.broken = RankFailedError(deadlock)
                    raise RankFailedError(deadlock) from None  # the poll's timeout is not its cause
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{len(pending)} of {len(futures)} rank tasks of {what} did not finish within {timeout} s"
                    ) from None

    def rendezvous(self) -> tuple[str, int] | None:
        """Rank 0's host and a free port there, found by a task on rank 0 (None for one rank)."""
        if self.world_size == 1:
            return None
        ((host, port),) = self.call(
            tasks.find_free_port, what="finding a rendezvous port", key_name="find-port", ranks=[0], chain=False
        )
        return str(host), int(port)

    def group_lock(self) -> Lock:
        """Cluster-wide lock held while process groups are created, so every worker makes them in one order."""
        return Lock("dask-lm-process-groups", scheduler_rpc=self.client.scheduler, loop=self.client.loop)
