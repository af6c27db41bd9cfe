"""Ctrl-C and SIGTERM: one line, the conventional exit code, nothing left behind that blocks running again.

Three pieces, each where the process model puts it:

- **Local workers do not take the terminal's Ctrl-C.** A terminal sends SIGINT to its whole foreground process
  group, so a local cluster's worker processes would get it too, and each print its own ``KeyboardInterrupt``
  traceback (25 lines a worker) while the driver cleans up. They ignore it (:mod:`dask_lm.workers.preload`, a Dask
  preload that ``connect()`` gives its local clusters); the driver closes them.
- **SIGINT is always taken.** A process started with SIGINT ignored (what a non-interactive shell does to a command
  it runs in the background with ``&``, and what every child of such a process inherits) never gets Python's
  ``KeyboardInterrupt``: the signal is dropped and the job runs to its end, exit 0. A batch command is stopped by
  whoever sends it SIGINT, so :func:`signals_as_interrupts` installs Python's handler for the command's duration
  whatever the disposition it inherited.
- **SIGTERM is a Ctrl-C.** What a batch scheduler (SLURM, Kubernetes) sends before it kills a job. Python's default
  is to die at once, with no cleanup and no message. :func:`terminate_as_interrupt` turns it into
  :class:`Terminated` (a ``KeyboardInterrupt``) in the main thread, so the same cleanup runs; exit 143.
- **The job says what it kept.** A job interrupted mid-run raises :class:`JobInterrupted` with one line: how many
  of its parts (or checkpoints) are kept and that the same command with ``--resume`` continues it; the CLI prints
  it and exits ``128 + signal`` (130 for SIGINT, 143 for SIGTERM), as shells do. A new job that kept nothing removes
  its own entries (:meth:`dask_lm.jobs.output.JobOutput.locked`), so the same command runs again as if it never ran.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["JobInterrupted", "Terminated", "exit_code", "signals_as_interrupts", "signum_of", "terminate_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by :func:`terminate_as_interrupt`."""

    signum = signal.SIGTERM


class JobInterrupted(KeyboardInterrupt):
    """A job stopped by Ctrl-C or SIGTERM; ``str()`` is the one line to show, ``signum`` the signal."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.message, self.signum = message, signum

    def __str__(self) -> str:
        return self.message


def signum_of(e: BaseException) -> int:
    """The signal behind a ``KeyboardInterrupt`` (SIGINT unless it says otherwise)."""
    return int(getattr(e, "signum", signal.SIGINT))


def exit_code(e: BaseException) -> int:
    """The shell's exit code for a process ended by ``e``'s signal: 128 + its number."""
    return 128 + signum_of(e)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """For the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere, or where another handler
    than the default is installed, nothing changes)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """For the block, SIGINT raises ``KeyboardInterrupt`` and SIGTERM :class:`Terminated` in the main thread, even
    where SIGINT was inherited ignored (a background command of a script); the dispositions found are restored
    after. Elsewhere than in the main thread nothing changes (Python takes signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    taken = before in (signal.SIG_IGN, signal.SIG_DFL, None)  # else a handler of the caller's own: left in place
    if taken:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with terminate_as_interrupt():
            yield
    finally:
        if taken:
            signal.signal(signal.SIGINT, signal.SIG_DFL if before is None else before)
