"""How long the ``dask-lm`` command takes to answer ``--help`` / ``--version`` and a subcommand's ``--help``.

A benchmark, not a test: each command runs in a fresh process ``--repeat`` times and the table prints the best
and the median wall time, beside ``python -c pass`` (the interpreter's own start) and ``import torch`` (what the
command cost when the package imported its modules eagerly).

Examples
--------
    python benchmarks/cli_startup.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import click

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "dask-lm --help": [sys.executable, "-m", "dask_lm", "--help"],
    "dask-lm --version": [sys.executable, "-m", "dask_lm", "--version"],
    "dask-lm score --help": [sys.executable, "-m", "dask_lm", "score", "--help"],
    "dask-lm sft --help": [sys.executable, "-m", "dask_lm", "sft", "--help"],
}


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


@click.command()
@click.option("--repeat", type=int, default=5, show_default=True, help="Runs of each command.")
def main(repeat: int) -> None:
    """Print the start-up table."""
    click.echo(f"{'command':<28} {'best s':>8} {'median s':>9}")
    for name, cmd in COMMANDS.items():
        _time(cmd)  # the first run warms the page cache
        times = [_time(cmd) for _ in range(repeat)]
        click.echo(f"{name:<28} {min(times):>8.3f} {statistics.median(times):>9.3f}")


if __name__ == "__main__":
    main()
