"""What the Dask scheduler and the driver cost per task and per call: the inputs of ``docs/internals/scaling.md``.

A benchmark, not a test: it prints numbers and asserts nothing. On a local cluster of ``--n-workers`` processes
(one thread each, CPU: no model is involved, only the machinery that a dask-lm call or a scoring job goes
through), it measures:

* one round trip: ``client.submit(noop).result()``, median of ``--repeats`` (the floor under every rank call);
* the scheduler's throughput on independent tasks: ``--tasks`` no-op tasks submitted at once, gathered with
  ``as_completed`` (a scoring job's partitions, a request engine's tasks), in tasks/s;
* one SPMD call as a Policy makes it: one pinned task per worker (``workers=[w]``, ``allow_other_workers=False``),
  each fed a scattered payload of ``--payload-mb`` MB, gathered (a ``get_logprobs`` / ``train`` call without the
  model), so the driver's scatter bandwidth shows.

Examples
--------
    python benchmarks/scheduler_costs.py
    python benchmarks/scheduler_costs.py --n-workers 8 --tasks 20000 --payload-mb 64 --out costs.json
"""

from __future__ import annotations

import json
import statistics
import time

import click


def _noop(*_args: object) -> int:
    return 0


def _size(payload: bytes) -> int:
    return len(payload)


@click.command()
@click.option("--n-workers", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=200, show_default=True)
@click.option("--tasks", type=int, default=5000, show_default=True)
@click.option(
    "--payload-mb", type=float, default=16.0, show_default=True, help="Bytes scattered to each worker per SPMD call."
)
@click.option("--calls", type=int, default=10, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None)
def main(n_workers: int, repeats: int, tasks: int, payload_mb: float, calls: int, out: str | None) -> None:
    from distributed import as_completed

    import dask_lm

    client = dask_lm.connect(n_workers=n_workers, cluster="cpu")
    try:
        workers = sorted(client.scheduler_info()["workers"])
        client.submit(_noop, pure=False).result()  # warm the connections
        trips = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.submit(_noop, pure=False).result()
            trips.append(time.perf_counter() - t0)
        round_trip = statistics.median(trips)

        t0 = time.perf_counter()
        for f in as_completed(client.map(_noop, range(tasks), pure=False)):
            f.release()
        throughput = tasks / (time.perf_counter() - t0)

        payload = b"x" * int(payload_mb * 2**20)
        spmd = []
        for _ in range(calls):
            t0 = time.perf_counter()
            futs = []
            for w in workers:
                data = client.scatter(payload, workers=[w], direct=True)
                futs.append(client.submit(_size, data, workers=[w], allow_other_workers=False, pure=False))
            assert client.gather(futs) == [len(payload)] * len(workers)
            spmd.append(time.perf_counter() - t0)
        call = statistics.median(spmd)
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()

    scattered = payload_mb * len(workers)
    result = {
        "n_workers": len(workers),
        "round_trip_ms": round_trip * 1e3,
        "tasks_per_s": throughput,
        "spmd_call_ms": call * 1e3,
        "spmd_payload_mb_per_worker": payload_mb,
        "driver_scatter_mb_per_s": scattered / call,
    }
    print(f"{len(workers)} workers (local processes, one thread each)")
    print(f"  round trip (submit + result, median of {repeats}):  {round_trip * 1e3:8.2f} ms")
    print(f"  independent tasks ({tasks} no-ops, as_completed):  {throughput:8.0f} tasks/s")
    print(
        f"  SPMD call (1 pinned task per worker, {payload_mb:g} MB scattered to each, median of {calls}): "
        f"{call * 1e3:.1f} ms = {scattered / call:,.0f} MB/s from the driver"
    )
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
