"""Who called dask-lm, and how to address them: option names in messages, and warnings at the caller's line.

The same job runs from the ``dask-lm`` command and from Python (``dask_lm.score_parquet(...)``), and its errors
name the setting to change: ``--truncate`` to the command's user, ``truncate=True`` to a Python caller. Messages
spell options through :func:`opt`, which renders the keyword argument's name for the interface in use. The CLI
says it is the caller (:func:`cli`, for its whole command: the driver's checks run in threads of that process
too); a job's worker tasks are told by their options (``ScoreOptions.interface``) and render under
:func:`speaking`, so a bad row found on a worker names the option as the driver would.

Warnings point at the caller's own line (:func:`warn`): the first frame outside this package, whatever depth
of dask-lm code raised it. A warning raised on a rank during a Policy call is caught there (:func:`caught`),
travels back with the rank's answer (:class:`Warned`) and is raised again on the driver at the user's call, once
for all ranks (:func:`reissue`). This module imports only the standard library: the CLI imports it at start.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Interface",
    "current",
    "cli",
    "speaking",
    "opt",
    "opts",
    "again",
    "warn",
    "caught",
    "Warned",
    "reissue",
    "strip",
]

Interface = Literal["python", "cli"]

# the process's interface: the CLI sets it for its command (its checks run in threads, which a ContextVar set in
# the main thread would not reach), and in the environment, which the worker processes of the local cluster it
# starts inherit (their tasks that take no job options, the reads, speak as it does); a worker task of a job sets
# the ContextVar, which shadows both in that task only
_ENV = "DASK_LM_INTERFACE"
_process: list[Interface] = ["cli" if os.environ.get(_ENV) == "cli" else "python"]
_task: ContextVar[Interface | None] = ContextVar("dask_lm_interface", default=None)

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_UNSET: Any = object()


def current() -> Interface:
    """The interface of the call being served: ``"cli"`` or ``"python"``."""
    return _task.get() or _process[0]


@contextlib.contextmanager
def cli() -> Iterator[None]:
    """The ``dask-lm`` command's block: messages name flags, and warnings print as one line each."""
    before, show, env = _process[0], warnings.showwarning, os.environ.get(_ENV)
    _process[0] = "cli"
    os.environ[_ENV] = "cli"
    warnings.showwarning = _show_cli_warning
    try:
        yield
    finally:
        _process[0] = before
        warnings.showwarning = show
        if env is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = env


def _show_cli_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    # a command's user did not write the line a warning would point at: the message alone, as the errors are shown
    try:
        print(f"Warning: {message}", file=file if file is not None else sys.stderr)
    except OSError:  # stderr gone (a closed pipe): nothing to tell
        pass


@contextlib.contextmanager
def speaking(interface: Interface) -> Iterator[None]:
    """A task run for a job that ``interface`` started (on a worker: the job's options say which)."""
    token = _task.set(interface)
    try:
        yield
    finally:
        _task.reset(token)


def opt(name: str, value: Any = _UNSET, *, meta: str | None = None, flag: str | None = None) -> str:
    """Option ``name`` (the keyword argument, e.g. ``"max_length"``) as the caller spells it, with ``value`` or a
    placeholder ``meta`` when given. CLI, then Python:

    - ``opt("output")``: ``--output``, ``output``
    - ``opt("truncate", True)``: ``--truncate``, ``truncate=True``
    - ``opt("shuffle", False)``: ``--no-shuffle``, ``shuffle=False``
    - ``opt("precision", "fp32")``: ``--precision fp32``, ``precision='fp32'``
    - ``opt("max_length", meta="N")``: ``--max-length N``, ``max_length=N``

    ``flag`` is the CLI's spelling where it is not ``--name-with-dashes``."""
    if current() == "python":
        if meta is not None:
            return f"{name}={meta}"
        return name if value is _UNSET else f"{name}={value!r}"
    spelled = flag or f"--{name.replace('_', '-')}"
    if value is True:
        return spelled
    if value is False:
        return f"--no-{spelled[2:]}" if spelled.startswith("--") else spelled
    shown = meta if meta is not None else None if value is _UNSET else value
    return spelled if shown is None else f"{spelled} {shown}"


def opts(**values: Any) -> str:
    """Several options given together: ``--resume --skip-bad-rows`` / ``resume=True, skip_bad_rows=True``."""
    return (" " if current() == "cli" else ", ").join(opt(k, v) for k, v in values.items())


def again(**values: Any) -> str:
    """How to run the job once more with these options: "run the same command with --resume" / "call again with
    resume=True"."""
    if current() == "cli":
        return f"run the same command with {opts(**values)}" if values else "run the same command again"
    return f"call again with {opts(**values)}" if values else "call again"


# ------------------------------------------------------------------------------------------- warnings
def _user_stacklevel(start: int) -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` made ``start`` frames below the caller of :func:`warn`) of the
    first frame outside this package: the line of the caller's code that called into dask-lm."""
    frame = sys._getframe(start)
    level = 2
    while frame is not None and _ours(frame):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level if frame is not None else 2


def _ours(frame: Any) -> bool:
    # by module too: a dataclass's generated __init__ (which calls a config's __post_init__) is "<string>" code
    # run in the globals of the module that defined the class
    name = str(frame.f_globals.get("__name__") or "")
    return frame.f_code.co_filename.startswith(_PACKAGE) or name == "dask_lm" or name.startswith("dask_lm.")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the caller's own line, however deep in dask-lm it was raised: Python's
    filters then show it once per line of the caller's code, and ``w.filename`` is the caller's file."""
    warnings.warn(message, category, stacklevel=_user_stacklevel(2))


@dataclass(frozen=True)
class Warned:
    """A rank's answer with the warnings dask-lm raised while it was computed (category and text each)."""

    result: Any
    warnings: tuple[tuple[type[Warning], str], ...]


@contextlib.contextmanager
def caught(into: list[tuple[type[Warning], str]]) -> Iterator[None]:
    """On a rank: collect into ``into`` the warnings dask-lm's own code raises in the block, to be raised again at
    the user's call (:func:`reissue`). Another library's warnings are not collected: they show here, on the worker."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")  # every occurrence: the driver decides what is shown (its filters, once)
        yield
    for w in got:
        if w.filename.startswith(_PACKAGE):
            if (w.category, str(w.message)) not in into:
                into.append((w.category, str(w.message)))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_worker_registry)


_worker_registry: dict[Any, Any] = {}  # another library's warnings, shown once per worker process


def strip(result: Any) -> tuple[Any, tuple[tuple[type[Warning], str], ...]]:
    """A rank's answer and the warnings that came with it (none for a plain answer)."""
    if isinstance(result, Warned):
        return result.result, result.warnings
    return result, ()


def reissue(results: list[Any]) -> list[Any]:
    """On the driver: the ranks' answers without their :class:`Warned` wrappers; each distinct warning raised again
    once (every rank usually says the same), at the user's line."""
    plain, seen = [], []
    for r in results:
        value, ws = strip(r)
        plain.append(value)
        seen += [w for w in ws if w not in seen]
    for category, text in seen:
        warnings.warn(text, category, stacklevel=_user_stacklevel(2))
    return plain
