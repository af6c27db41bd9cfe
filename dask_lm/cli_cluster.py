"""``dask-lm cluster start | status | stop``: the opt-in warm local cluster (:mod:`dask_lm.engine.warm_cluster`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from dask_lm.engine import warm_cluster  # the standard library only: the CLI's start stays light

__all__ = ["cluster_group"]


_GROUP_EPILOG = """Examples:

\b
  dask-lm cluster start
  dask-lm cluster start --n-workers 2 --cluster cpu
  dask-lm cluster status
  dask-lm cluster stop

While it runs, `dask-lm score`, `dask-lm sft`, `dask-lm logprobs` and `dask_lm.connect()` without a scheduler
address use it (DASK_LM_WARM_CLUSTER=0: they start their own)."""
_START_EPILOG = """Examples:

\b
  dask-lm cluster start
  dask-lm cluster start --n-workers 2 --cluster cpu --memory-limit 8GiB"""
_STATUS_EPILOG = """Examples:

\b
  dask-lm cluster status"""
_STOP_EPILOG = """Examples:

\b
  dask-lm cluster stop"""


def _uptime(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s"


def cluster_group(exit_codes: Callable[[click.Context, Callable[[], None]], Any]) -> click.Group:
    """The ``cluster`` group; ``exit_codes(ctx, fn)`` runs a subcommand's body with the command's exit codes and
    one-line errors (``dask_lm.cli._exit_codes``, passed in: cli.py imports this module)."""

    @click.group(epilog=_GROUP_EPILOG)
    def cluster() -> None:
        """A warm local cluster that later commands and connect() use: workers started and imported once."""

    @cluster.command(epilog=_START_EPILOG)
    @click.option(
        "--n-workers",
        type=int,
        default=None,
        help="Workers to start (default: one per GPU, or 2 on a CPU machine).",
    )
    @click.option(
        "--cluster",
        "kind",
        type=click.Choice(["auto", "cuda", "cpu"]),
        default="auto",
        show_default=True,
        help="cuda: one GPU worker per GPU (dask-cuda); cpu: CPU workers; auto: cuda where GPUs are visible.",
    )
    @click.option(
        "--memory-limit",
        default="auto",
        show_default=True,
        help="Host memory limit of each CPU worker (GPU workers have none), as Dask spells it: auto, 8GiB, 0.",
    )
    @click.pass_context
    def start(ctx: click.Context, n_workers: int | None, kind: str, memory_limit: str) -> None:
        """Start the local cluster that connect() would start, in the background, and leave it running."""

        def run() -> None:
            from dask_lm.engine.cluster import count_gpus

            if n_workers is not None and n_workers < 1:
                raise ValueError(f"--n-workers must be >= 1, got {n_workers}")
            gpus = count_gpus()  # connect()'s own checks, said here rather than in the background process's log
            if kind == "cuda" and gpus == 0:
                raise ValueError("--cluster cuda but no GPU is visible on this machine: use --cluster cpu")
            if (kind == "cuda" or (kind == "auto" and gpus)) and n_workers is not None and n_workers > gpus:
                raise ValueError(f"--n-workers {n_workers} but only {gpus} GPUs are visible: one worker per GPU")
            running = warm_cluster.find()  # refused before anything is said to start (start() checks again)
            if running is not None:
                raise ValueError(
                    f"a warm local cluster is already running at {running.address} (pid {running.pid}): "
                    f"`{warm_cluster.STOP_HINT}` first"
                )
            click.echo("dask-lm: starting a warm local cluster ...")
            warm = warm_cluster.start(n_workers=n_workers, cluster=kind, memory_limit=memory_limit)
            click.echo(
                f"dask-lm: a warm local cluster of {warm.n_workers} {warm.kind} workers runs at {warm.address} "
                f"(pid {warm.pid})\n"
                f"  dashboard: {warm.dashboard}\n"
                f"  scheduler file: {warm.scheduler_file}\n"
                f"  log: {warm.log}\n"
                "dask-lm commands and connect() without a scheduler address now use it; "
                f"stop it with `{warm_cluster.STOP_HINT}`"
            )

        exit_codes(ctx, run)

    def plain(epilog: str) -> Callable[[Callable[[], None]], click.Command]:
        """A subcommand without options: the decorated function, run under the command's exit codes; its
        docstring is the command's help."""

        def make(body: Callable[[], None]) -> click.Command:
            @cluster.command(name=body.__name__, epilog=epilog, help=body.__doc__)
            @click.pass_context
            def command(ctx: click.Context) -> None:
                exit_codes(ctx, body)

            return command

        return make

    @plain(epilog=_STATUS_EPILOG)
    def status() -> None:
        """Say whether a warm local cluster runs: its address, workers, uptime and what its workers hold."""
        from distributed import Client

        warm = warm_cluster.find()
        if warm is None:
            click.echo(f"dask-lm: no warm local cluster is running ({warm_cluster.folder()})")
            return
        click.echo(
            f"dask-lm: a warm local cluster runs at {warm.address} (pid {warm.pid}, up "
            f"{_uptime(time.time() - warm.started_at)})\n  dashboard: {warm.dashboard}\n  log: {warm.log}"
        )
        try:
            client = Client(warm.address, timeout=warm_cluster.ANSWER_S)
        except (OSError, TimeoutError):
            raise RuntimeError(f"its scheduler does not answer: `{warm_cluster.STOP_HINT}` stops it") from None
        with client:
            held = client.run(warm_cluster.holdings, on_error="return")
        click.echo(f"  workers: {len(held)} ({warm.kind})")
        for address, h in sorted(held.items()):
            if isinstance(h, BaseException):
                click.echo(f"    {address}: {type(h).__name__}: {h}")
                continue
            device = f", {h['device']} ({h['device_reserved_gib']:.2f} GiB reserved)" if "device" in h else ""
            warm_state = "warm" if h["warm"] else "warming up"
            click.echo(
                f"    {address}: pid {h['pid']}, {warm_state}{device}, "
                f"{h['replicas']} model replica(s), {h['policies']} Policy shard(s)"
            )

    @plain(epilog=_STOP_EPILOG)
    def stop() -> None:
        """Stop the warm local cluster: its workers closed, its files removed."""
        stopped = warm_cluster.stop()
        click.echo(
            f"dask-lm: stopped the warm local cluster at {stopped.address} (pid {stopped.pid}); its files removed"
            if stopped is not None
            else f"dask-lm: no warm local cluster is running ({warm_cluster.folder()})"
        )

    return cluster
