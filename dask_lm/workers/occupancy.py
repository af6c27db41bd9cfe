"""What a worker is busy with, by Policy: the watchdog's view of a worker (:mod:`dask_lm.engine.stuck`).

Every chained rank task (:func:`dask_lm.workers.tasks.link`) notes its Policy's id here when it starts, so this
worker process can tell, from Dask's task keys alone (``<call>-<policy id>-r<rank>-<call token>``), which Policy and
which call each of its running and waiting tasks belongs to. :func:`occupancy` runs on the worker's event loop
(``Client.run``), so it answers while the task thread sits in a collective.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["note_policy", "occupancy"]

_SEEN: set[str] = set()  # the policy ids whose rank tasks ran in this process (a few per Policy ever made)
_LOCK = threading.Lock()


def note_policy(policy_id: str) -> None:
    with _LOCK:
        _SEEN.add(policy_id)


def _calls(keys: list[str], seen: set[str]) -> list[tuple[str, str, str]]:
    """``(policy id, call name, call token)`` of each rank-task key of a Policy seen here (a caller's
    ``-result`` task and other tasks are left out)."""
    out = []
    for key in keys:
        if key.endswith("-result"):
            continue
        for policy_id in seen:
            at = key.find(f"-{policy_id}-r")
            if at > 0:
                out.append((policy_id, key[:at], key.rsplit("-", 1)[1]))
                break
    return out


def occupancy(dask_worker: Any) -> dict[str, list[tuple[str, str, str]]]:
    """The rank tasks this worker runs (``running``) and holds ready to run (``queued``: waiting for a thread), as
    ``(policy id, call name, call token)``."""
    with _LOCK:
        seen = set(_SEEN)
    state = dask_worker.state
    running = [str(ts.key) for ts in state.executing]
    queued = [str(key) for key, ts in state.tasks.items() if ts.state in ("ready", "constrained")]
    return {"running": _calls(running, seen), "queued": _calls(queued, seen)}
