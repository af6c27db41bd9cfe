"""Notebook views (``_repr_html_``) of dask-lm objects: plain HTML tables, no JavaScript, escaped values."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_lm.engine.policy_base import PolicyBase

__all__ = ["table", "policy_html"]

_STYLE = "text-align:left;padding:2px 8px"


def table(caption: str, header: Sequence[str] | None, rows: Sequence[Sequence[Any]]) -> str:
    def cells(values: Sequence[Any], tag: str) -> str:
        return "".join(f"<{tag} style='{_STYLE}'>{html.escape(str(v))}</{tag}>" for v in values)

    head = f"<tr>{cells(header, 'th')}</tr>" if header else ""
    body = "".join(f"<tr>{cells(r, 'td')}</tr>" for r in rows)
    return f"<table><caption style='text-align:left'><b>{html.escape(caption)}</b></caption>{head}{body}</table>"


def _worker_gauges(policy: PolicyBase) -> dict[str, dict[str, Any]]:
    """The scheduler's latest heartbeat metrics per worker name (no task, no round trip to the workers)."""
    from dask_lm.engine.worker_group import scheduler_info

    try:
        workers = scheduler_info(policy.client)["workers"].values()
    except Exception:  # a closed or unreachable client: show what the Policy knows
        return {}
    return {str(w["name"]): w.get("metrics", {}) for w in workers}


def policy_html(policy: PolicyBase) -> str:
    try:
        group = policy.group
    except RuntimeError:  # shut down
        return table("dask-lm Policy (shut down)", None, [])
    info = policy.worker_info
    params = info[0].get("num_parameters") if info else None
    dashboard = getattr(policy.client, "dashboard_link", None) or "-"
    summary = table(
        "dask-lm Policy",
        None,
        [
            ("model", policy.cfg.model_name),
            ("precision", policy.cfg.precision),
            ("parameters", f"{params / 1e6:,.1f} M" if params else "-"),
            ("ranks", policy.data_parallel_size),
            ("generation backend", policy.cfg.generation.backend if policy.cfg.generation else "-"),
            ("dashboard", dashboard),
        ],
    )
    gauges = _worker_gauges(policy)
    rows = []
    for rank, (name, i) in enumerate(zip(group.names, info)):
        g = gauges.get(str(name), {})
        device = i.get("gpu_name") if i.get("device") == "cuda" else "cpu"
        mem = g.get("dask_lm_device_mem_gib")
        tps = g.get("dask_lm_tokens_per_s")
        rows.append(
            (
                rank,
                name,
                i.get("hostname", i.get("node_ip")),
                device,
                f"{mem:.2f}" if isinstance(mem, (int, float)) else "-",
                f"{tps:,.0f}" if isinstance(tps, (int, float)) else "-",
            )
        )
    ranks = table("ranks", ["rank", "worker", "host", "device", "memory in use (GiB)", "tokens/s (last call)"], rows)
    return summary + ranks
