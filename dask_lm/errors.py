"""Every exception class dask-lm raises on purpose, in one module that imports nothing.

User mistakes are ``ValueError`` (with the key, row or file and the fix in the message); the subclasses here let
callers tell the kinds apart. Runtime failures of the cluster or an engine are ``RuntimeError`` subclasses. The
modules that raise them import them from here; the public ones are also ``dask_lm.<Name>``.
"""

from __future__ import annotations

__all__ = [
    "BatchError",
    "LossConfigError",
    "BadRowError",
    "UnsafeCheckpointError",
    "CheckpointWriteError",
    "PartWriteError",
    "RankFailedError",
    "WorkerLostError",
    "PeerFailedError",
    "RefitError",
    "NonFiniteError",
    "InputChangedError",
    "SchedulerLostError",
]


# ------------------------------------------------------------------------------------------- bad input
class BatchError(ValueError, AssertionError):
    """A batch that cannot be split as asked. A ``ValueError`` (bad input), and an ``AssertionError`` too, because
    NeMo RL asserts the same conditions and code written against it may catch that."""


class LossConfigError(ValueError, AssertionError):
    """An invalid loss configuration. A ``ValueError`` (bad user input) and an ``AssertionError`` too, because NeMo
    RL asserts the same conditions and code written against it may catch that."""


class BadRowError(ValueError):
    """A row (or row group) that cannot be scored; the message names file, row and column and the fix."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that cannot be read as data only (tampered with, corrupt, or from a foreign writer)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written. One line: the path, the operating system's reason, the fix; ``errno``
    is set when the reason is known."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


class PartWriteError(OSError):
    """A scoring job's part file could not be written (a full disk, a quota, a folder that cannot be written). One
    line: the part, its path, the operating system's reason, the fix (the parts written before are kept, so the
    job resumes); ``errno`` is set when the reason is known. A runtime failure: the CLI exits 1."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


# ------------------------------------------------------------------------------------------- the cluster
class RankFailedError(RuntimeError):
    """A rank's task failed or its worker died; the group must be re-created."""


class SchedulerLostError(RuntimeError):
    """A batch job lost its Dask scheduler mid-run (killed, or the network to it gone). One line: the scheduler,
    what the output kept and, where there is a job to continue, that ``--resume`` continues it. The CLI exits 1."""


class WorkerLostError(RankFailedError):
    """A rank's worker died or restarted, or the driver lost its scheduler (the cluster is gone for it): the
    Policy's state is gone, so this Policy cannot run again."""


class PeerFailedError(RuntimeError):
    """This rank was fine, but another rank of the same call failed; the driver reports that rank's error."""


class RefitError(RuntimeError):
    """An inference engine refused or lost a weight update; the message is the engine's own."""


class NonFiniteError(RuntimeError):
    """The model produced NaN / inf logprobs: a runtime failure (exit 1), not bad input."""


class InputChangedError(RuntimeError):
    """A file the job pinned (an input or a model file) changed while the job ran: a runtime failure (exit 1), with
    no ``_SUCCESS``; the message names the file and says how to go on."""
