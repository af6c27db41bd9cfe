"""When a scoring job's start steps ended: the driver's checks, the worker's config check, the workers' processes,
preloads and replicas, the first part written. ``score_parquet`` reports them as ``ScoreResult.start_phases``,
in seconds from the call's start, and the slowest worker's load steps as ``model_load_phases``; and the whole call
cut into the steps the caller waited for, which add up to its wall time (``ScoreResult.wall_phases``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StartClock"]


@dataclass
class StartClock:
    """When the start's steps ended, in seconds from the call's start (``ScoreResult.start_phases``)."""

    started: float  # perf_counter
    started_at: float  # time.time()
    phases: dict[str, float]
    first_row_at: float | None = None
    load_phases: dict[str, float] = field(default_factory=dict)  # the slowest worker's model load, by step
    config_imports: dict[str, float] = field(default_factory=dict)  # the worker's config check, by step

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.perf_counter() - self.started

    def cluster_start(self, began_at: float | None, up_at: float | None) -> None:
        """The cluster's start itself (``time.time()`` stamps, ``None`` when not known): ``cluster_began`` /
        ``cluster_up``, an interval of its own that may overlap the driver's checks."""
        for phase, stamp in (("cluster_began", began_at), ("cluster_up", up_at)):
            if stamp is not None:
                self.phases[phase] = stamp - self.started_at

    def config_check(self, got: dict[str, Any]) -> None:
        """The worker's config check: when it began and was answered, and its imports (``load_phases``)."""
        if "began_at" in got:
            self.phases["config_check_began"] = got["began_at"] - self.started_at
            self.phases["config_checked"] = got["checked_at"] - self.started_at
            self.config_imports = {"config_check_torch_import": got["torch_import"], "config_check_rest": got["config"]}

    def workers(self, preloads: list[Any]) -> list[dict[str, Any]]:
        """The workers' start, from their preloads (those done; wall clock, so on one host or NTP-close ones):
        when the last worker process began, the last preload began, the last replica was ready. Returns the
        preloads' reports."""
        got = [f.result() for f in preloads if f.done() and f.status == "finished"]
        got = [g for g in got if isinstance(g, dict) and "error" not in g]
        for phase, key in (
            ("worker_processes", "process_started_at"),
            ("preloads_began", "began_at"),
            ("replicas_ready", "ready_at"),
        ):
            stamps = [g[key] for g in got if g.get(key)]
            if stamps:
                self.phases[phase] = max(stamps) - self.started_at
        if got and not self.load_phases:
            self.load_phases = max(got, key=lambda g: g["load_seconds"]).get("load_phases") or {}
        return got

    def first_row(self) -> None:
        if self.first_row_at is None:
            self.first_row_at = time.time()
            self.mark("first_row")

    def waited_for(self, stats: dict[str, Any]) -> bool:
        """Whether the caller waited for the replica a part's ``stats`` report: one ready (``ready_at``, wall
        clock) after the first part came back belongs to a worker that joined (or loaded) while rows were being
        written already, so its load is no part of the start (``wall_phases`` count it as scoring)."""
        ready = stats.get("ready_at")
        return ready is not None and (self.first_row_at is None or ready <= self.first_row_at)

    def steps(self, ready_at: float, compile_s: float, scored_at: float) -> dict[str, float]:
        """Where the call's time went up to ``scored_at`` (wall clock, the last part back), in steps that follow
        one another; ``ready_at`` is when the last replica was ready, ``compile_s`` its compilation. Each step is
        the wait for it once the ones before had ended: ``checks`` the driver's own checks, ``cluster_start`` what
        was left of the cluster's start and the worker's config check (its imports) once they had ended (the
        start may overlap the checks: ``phases`` gives each its own interval), and as the loads run beside both,
        only what is left of them counts as ``model_load`` (their whole length is the result's
        ``model_load_seconds``). :meth:`closed` adds the last step."""
        ends, at = {}, 0.0
        for phase, end in (
            ("checks", self.phases["checks"]),
            ("cluster_start", self.phases["cluster"]),
            ("model_load", ready_at - compile_s - self.started_at),
            ("compile", ready_at - self.started_at),
            ("scoring", scored_at - self.started_at),
        ):
            at = ends[phase] = max(at, end)  # the driver's clocks and the workers' wall clocks may differ a little
        steps, before = {}, 0.0
        for phase, end in ends.items():
            steps[phase], before = end - before, end
        return steps

    def closed(self, steps: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The call's wall time, now that it ends, and ``steps`` with ``closing`` (what came after them) added."""
        wall = time.time() - self.started_at
        return wall, {**steps, "closing": max(wall - sum(steps.values()), 0.0)}
