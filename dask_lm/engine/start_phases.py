"""Where a Policy's start went: the driver's steps and each rank's, as :attr:`Policy.start_phases` reports them.

A Policy's start is spread over processes: the driver reads the model's config, leases its workers, checks the
model against the config and waits for the load; each worker process warmed up in the background since it was
spawned (:mod:`dask_lm.workers.warm`), then its load task waited for what of the warm-up was left and built the
rank's model (:class:`~dask_lm.workers.rank_model.RankModel` times its steps). A user who asks "why did it take
that long" gets all of it in one dict, in seconds, with the workers' wall-clock stamps given from the moment the
driver's ``Policy(...)`` began (negative: before it; a worker warmed up while the cluster started or while the
driver read its inputs).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["PolicyStartClock"]


class PolicyStartClock:
    """The driver's steps of one ``Policy(...)``: :meth:`mark` at each step's end."""

    def __init__(self) -> None:
        self.began_at = time.time()
        self._last = time.perf_counter()
        self.driver: dict[str, float] = {}

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.driver[step], self._last = now - self._last, now

    def phases(self, worker_info: list[dict[str, Any]]) -> dict[str, Any]:
        """``{"driver": {step: seconds}, "ranks": [per rank]}``. Each rank's: when its warm-up began and ended and
        its load task began and ended (seconds from the driver's start), how long the task waited for the warm-up,
        the warm-up's steps, and the model build's steps (``weights``, ``shard``, ``master_weights``,
        ``compile_setup``, ``reference``, ``weights_path``: those that ran)."""
        ranks = []
        for info in worker_info:
            start = info.get("start") or {}
            warm = start.get("warm_up") or {}
            rank: dict[str, Any] = {}
            for key, stamp in (
                ("warm_up_began", warm.get("began_at")),
                ("warm_up_ended", warm.get("ended_at")),
                ("load_began", start.get("task_began_at")),
                ("ready", start.get("ready_at")),
            ):
                if stamp is not None:
                    rank[key] = round(stamp - self.began_at, 3)
            if "waited_for_warm_up" in start:
                rank["waited_for_warm_up"] = round(start["waited_for_warm_up"], 3)
            if warm.get("steps"):
                rank["warm_up_steps"] = {k: round(v, 3) for k, v in warm["steps"].items()}
            if warm.get("error"):
                rank["warm_up_error"] = warm["error"]
            rank["build"] = {k: round(v, 3) for k, v in (start.get("build") or {}).items()}
            ranks.append(rank)
        return {"driver": {k: round(v, 3) for k, v in self.driver.items()}, "ranks": ranks}
