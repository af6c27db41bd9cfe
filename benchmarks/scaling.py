"""Worker-count sweeps for the benchmark scripts: the ``--n-workers`` list and the scaling table printed at the end.

``--n-workers`` takes a comma-separated list of worker counts (``1,2,4,8``; one number is a list of one), or
``all``: one count per power of two up to the GPUs this machine has, plus that number (on a CPU machine, up to its
cores). Each script starts a fresh cluster per count, runs its dask-lm arm on it, closes it, and then prints one
table with :func:`print_table` over the rows :func:`add_efficiency` completed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import click

N_WORKERS_HELP = (
    "Worker counts to measure, comma-separated (1,2,4,8), each on a fresh cluster; 'all' = every "
    "power of two up to the GPU count, plus that count"
)


def powers_up_to(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    counts, n = [], 1
    while n <= limit:
        counts.append(n)
        n *= 2
    return sorted({*counts, max(limit, 1)})


def worker_counts(spec: str | None, *, on_gpu: bool, cpu_default: int) -> tuple[list[int], bool]:
    """``(sorted distinct worker counts, whether the user named them)`` for ``--n-workers spec``.

    No ``spec``: ``all`` on a GPU machine, ``[cpu_default]`` (what the script did before it swept) on a CPU one."""
    from dask_lm.engine.cluster import count_gpus

    gpus = count_gpus()
    text = (spec or "").strip().lower()
    if not text or text == "all":
        if not text and not on_gpu:
            return [cpu_default], False
        return powers_up_to(gpus if on_gpu else (os.cpu_count() or 1)), bool(text)
    counts = set()
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise click.BadParameter(
                f"{part!r} is not a worker count (expected e.g. 1,2,4,8 or all)", param_hint="--n-workers"
            ) from None
        if n < 1:
            raise click.BadParameter(f"worker counts must be >= 1, got {n}", param_hint="--n-workers")
        counts.add(n)
    if on_gpu and max(counts) > gpus:
        raise click.BadParameter(
            f"{max(counts)} workers but {gpus} GPUs are visible (one worker per GPU)", param_hint="--n-workers"
        )
    return sorted(counts), True


def add_efficiency(rows: list[dict[str, Any]], key: str, out_key: str) -> int:
    """Set ``row[out_key] = row[key] / (N / N0 x base[key])`` on every row; returns N0, the base count: 1 when it was
    measured, else the smallest count (so with N0 = 1 it is ``tokens/s(N) / (N x tokens/s(1))``)."""
    base = min(rows, key=lambda r: r["workers"])
    n0 = base["workers"]
    for r in rows:
        ideal = base[key] * r["workers"] / n0 if base.get(key) else None
        r[out_key] = r[key] / ideal if ideal and r.get(key) is not None else None
    return n0


Column = tuple[str, str, str]  # (header, row key, format spec: "{:.2f}", "{:.1%}", ...)


def print_table(
    title: str, columns: Sequence[Column], rows: Sequence[dict[str, Any]], notes: Sequence[str] = ()
) -> None:
    """A Markdown table (pastes into the scaling document as is); a missing or None value prints as ``-``."""

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        v = r.get(key)
        return "-" if v is None else fmt.format(v)

    cells = [[cell(r, key, fmt) for _h, key, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _k, _f) in enumerate(columns)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for (h, _k, _f), w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(c, widths)) + " |")
    for note in notes:
        print(note)


def efficiency_header(n0: int) -> str:
    return "efficiency vs 1 worker" if n0 == 1 else f"efficiency vs {n0} workers (no 1-worker arm)"


def mfu_columns(on_gpu: bool, key_989: str, key_measured: str, peak_what: str, what: str = "") -> list[Column]:
    """Per-GPU MFU against the 989.5 TFLOP/s datasheet peak (GPU runs) and against the peak measured in this run."""
    cols: list[Column] = []
    if on_gpu:
        cols.append((f"per-GPU MFU{what} (989.5 datasheet)", key_989, "{:.1%}"))
    cols.append((f"per-{'GPU' if on_gpu else 'worker'} MFU{what} (measured {peak_what})", key_measured, "{:.1%}"))
    return cols
