"""The watchdog of a waiting call: which Policy its ranks' workers are busy in, and a deadlock between two Policies.

The calls of the Policies of one ``Client`` run in one order per worker and cannot deadlock
(:mod:`dask_lm.engine.worker_order`). Policies made through *different* clients or driver processes on the same
workers are not ordered: a worker may start Policy A's call while its peer starts Policy B's, and each then waits in
a collective for a peer busy in the other Policy's call, until the collective timeout (``collective_timeout_s``,
600 s by default). While a call waits, :meth:`WorkerGroup.settle` asks its workers (on their event loops, which
answer while the task thread sits in a collective) what they run and hold ready (:mod:`dask_lm.workers.occupancy`):

- a rank whose worker runs another Policy's call is logged once, naming that Policy: the call waits for it;
- two calls X (this Policy) and Y (another) where one worker runs X and holds Y ready while another worker runs Y
  and holds X ready is a deadlock: neither can finish. Seen twice in a row (a snapshot is not atomic across
  workers), it fails the call at once, naming both Policies and the fix, instead of after the collective timeout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_lm.workers.occupancy import occupancy

if TYPE_CHECKING:
    from dask_lm.engine.worker_group import WorkerGroup

__all__ = ["Watchdog"]

logger = logging.getLogger("dask_lm")

Call = tuple[str, str, str]  # (policy id, call name, call token): see dask_lm.workers.occupancy


class Watchdog:
    """One call's watch over its workers while :meth:`WorkerGroup.settle` waits for it."""

    def __init__(self, group: WorkerGroup, what: str) -> None:
        self.group = group
        self.what = what
        self._suspect: tuple[Call, Call] | None = None
        self._named: set[str] = set()

    def _occupancy(self) -> dict[Any, dict[str, list[Call]]]:
        """Worker name -> its running and queued rank tasks (workers that do not answer are left out)."""
        group = self.group
        addresses = group.addresses()
        if not addresses:
            return {}
        answers = group.client.run(occupancy, workers=list(addresses), on_error="return")
        return {
            addresses[a]: {k: [(str(c[0]), str(c[1]), str(c[2])) for c in v] for k, v in ans.items()}
            for a, ans in answers.items()
            if isinstance(ans, dict)
        }

    def check(self) -> str | None:
        """A deadlock's description (seen on two checks in a row), else None; logs the other Policies that this
        call's workers are busy in."""
        try:
            seen = self._occupancy()
        except Exception:  # a worker or the scheduler that does not answer: the group's other checks handle it
            logger.debug("watchdog query failed", exc_info=True)
            return None
        mine = self.group.policy_id
        for name, occ in seen.items():
            for policy_id, call, _token in occ["running"]:
                if policy_id != mine and policy_id not in self._named:
                    self._named.add(policy_id)
                    logger.warning(
                        "%s of policy %s is still pending while worker %r runs %s of policy %s",
                        self.what,
                        mine,
                        name,
                        call,
                        policy_id,
                    )
        found = _cycle(seen, mine)
        if found is None or found[:2] != self._suspect:
            self._suspect = None if found is None else found[:2]
            return None
        (x, y), (w1, w2) = found[:2], found[2:]
        return (
            f"{self.what} of policy {mine} is deadlocked with policy {y[0]} on the same workers: worker {w1!r} "
            f"runs this Policy's {x[1]} while {y[1]} of policy {y[0]} waits there, and worker {w2!r} runs {y[1]} "
            f"of policy {y[0]} while this Policy's call waits there; each waits in a collective for a peer busy "
            "in the other Policy's call, until collective_timeout_s. dask-lm orders the calls of Policies that "
            "share one Client: shut both Policies down and create them with the same Client (not one client, "
            "scheduler address or driver process each)"
        )


def _cycle(seen: dict[Any, dict[str, list[Call]]], mine: str) -> tuple[Call, Call, Any, Any] | None:
    """Calls X of ``mine`` and Y of another Policy, and workers w1, w2: w1 runs X and holds Y ready, w2 runs Y and
    holds X ready."""
    for w1, occ1 in seen.items():
        for x in occ1["running"]:
            if x[0] != mine:
                continue
            for y in occ1["queued"]:
                if y[0] == mine:
                    continue
                for w2, occ2 in seen.items():
                    if w2 != w1 and y in occ2["running"] and x in occ2["queued"]:
                        return x, y, w1, w2
    return None
