"""A command the suite starts early in a process of its own and judges later (mypy, the docs site's build)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile
from collections.abc import Callable


class BackgroundRun:
    """``command(scratch)`` run in ``cwd``, its output kept in a file of ``scratch``, a scratch directory that also
    takes what the command writes (a pipe nobody reads while the suite runs would fill and stall it)."""

    def __init__(
        self,
        command: Callable[[pathlib.Path], list[str]],
        cwd: pathlib.Path,
        env: dict[str, str] | None = None,
        prefix: str = "dask-lm-run-",
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.scratch = pathlib.Path(self._dir.name)
        self._out = open(self.scratch / "output", "w+")  # noqa: SIM115 (stop() closes it)
        self._proc = subprocess.Popen(
            command(self.scratch),
            cwd=cwd,
            env=env or dict(os.environ),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait(self, timeout: float) -> tuple[int, str]:
        """Waits for the command: its exit status and what it printed."""
        code = self._proc.wait(timeout=timeout)
        self._out.seek(0)
        return code, self._out.read()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._out.close()
        self._dir.cleanup()
