"""Progress bars for the calls a notebook or CLI user waits for: model load across workers, training over several
global batches, scoring (``score_parquet``).

Work inside a rank reports progress as a Dask event on the topic ``"dask-lm-progress"``
(``{"id": ..., "done": k}``, from rank 0 only); the driver subscribes once per client and moves the bar
(``tqdm.auto``: a widget in notebooks, text elsewhere; it disappears when the call ends). Quiet with
``dask_lm.set_progress(False)`` or ``DASK_LM_PROGRESS=0``; ``score_parquet(progress=False)`` for one job.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["TOPIC", "set_progress", "progress_enabled", "quiet", "bar", "open_bar", "close_bar", "JobBar"]

TOPIC = "dask-lm-progress"
_enabled: bool = True
_bars: dict[str, Any] = {}
_lock = threading.Lock()
_subscribed: weakref.WeakSet[Any] = weakref.WeakSet()  # dask clients
_announced: JobBar | None = None  # a job's bar shown before the job began (JobBar.announce)
FIRST_LINE_DELAY_S = 0.3  # a job's bar from its start appears this late: an instant answer comes alone


def set_progress(enabled: bool) -> None:
    """Show (True, the default) or hide dask-lm's progress bars in this process."""
    global _enabled
    _enabled = bool(enabled)


# a job run with progress=False: no bar of any call it makes (its Policy's "loading the model" too), and only
# in its own thread, so a job beside it keeps its bars
_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar("dask_lm_quiet", default=False)


def progress_enabled() -> bool:
    return _enabled and not _quiet.get() and os.environ.get("DASK_LM_PROGRESS", "1") != "0"


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No dask-lm bar in this thread while the block runs (with ``on``; else nothing changes)."""
    token = _quiet.set(True) if on else None
    try:
        yield
    finally:
        if token is not None:
            _quiet.reset(token)


def _on_event(event: Any) -> None:
    _time, msg = event
    with _lock:
        progress_id = msg.get("id") if isinstance(msg, dict) else None
        b = _bars.get(progress_id) if isinstance(progress_id, str) else None
        if isinstance(b, JobBar):
            b.on_event(msg)
        elif b is not None and msg.get("done", 0) > b.n:
            b.update(int(msg["done"]) - b.n)


def _subscribe(client: Any) -> None:
    """This process's handler for :data:`TOPIC`, once per client."""
    if client not in _subscribed:
        try:
            client.subscribe_topic(TOPIC, _on_event)
            _subscribed.add(client)
        except Exception:  # an old scheduler without topics: the bar still shows start and end
            pass


def open_bar(client: Any, total: int, desc: str, unit: str, **tqdm_kwargs: Any) -> tuple[str | None, Any]:
    """``(progress id, tqdm bar)``, or ``(None, None)`` when progress is off; close it with :func:`close_bar`."""
    if not progress_enabled() or total < 1:
        return None, None
    from tqdm.auto import tqdm

    _subscribe(client)
    progress_id = uuid.uuid4().hex
    b = tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, **tqdm_kwargs)
    with _lock:
        _bars[progress_id] = b
    return progress_id, b


def close_bar(progress_id: str | None) -> None:
    with _lock:
        b = _bars.pop(progress_id, None) if progress_id else None
    if b is not None:
        b.close()


@contextlib.contextmanager
def bar(client: Any, total: int, desc: str, unit: str) -> Iterator[tuple[str | None, Any]]:
    """A bar for the duration of one call (see :func:`open_bar`)."""
    progress_id, b = open_bar(client, total, desc, unit)
    try:
        yield progress_id, b
    finally:
        close_bar(progress_id)


class JobBar:
    """A job's bar in two phases, so that neither the wait nor the rate misleads.

    Until a worker scores it says what the job waits for (``waiting``, e.g. "loading the model on 2 workers") and
    how long it has waited for that (the clock starts again at each new wait), with no count and no ETA: an ETA
    from a rate that includes model loads would promise minutes for a job of seconds. It becomes a counting bar at
    the first sign of scoring: a worker's event that it began a part (its replica ready; see :meth:`listen`), or
    the first :meth:`update`. Rows scored inside a part still running count too, from the same events, so a job
    of one large part moves; the part's :meth:`update` when it is done replaces them. The rate (and so its ETA)
    leaves out what was done before the bar began to count: tqdm's ``initial`` is not counted in the rate.

    The events arrive on the client's event-loop thread, the updates on the job's: one lock orders them."""

    def __init__(
        self, total: int | None, desc: str, unit: str, waiting: str, enabled: bool = True, delay: float = 0.0
    ) -> None:
        # ``total`` None: not known yet (a job's bar shown from its first second, before its inputs are read); a
        # later :meth:`wait` gives it. ``delay``: the bar appears only that late (a job that ends sooner, a resume
        # of a finished one, prints nothing but its answer)
        self.total, self.desc, self.unit, self.n = total or 0, desc, unit, 0
        self._bar: Any = None
        self._wait: Any = None
        self._waiting = f"{desc}: {waiting}"  # what the wait bar says, or will say once shown
        self._lock = threading.RLock()
        self._running: dict[int, int] = {}  # rows scored so far in the parts still running, by part
        self._finished: set[int] = set()
        self.progress_id: str | None = None
        self._on = enabled and progress_enabled() and (total is None or total > 0)
        self._timer: threading.Timer | None = None
        if self._on:
            from tqdm.auto import tqdm

            self._tqdm = tqdm
            if delay > 0:
                self._timer = threading.Timer(delay, self._open_wait)
                self._timer.daemon = True
                self._timer.start()
            else:
                self._open_wait()

    def _open_wait(self) -> None:
        with self._lock:
            if self._on and self._wait is None and self._bar is None:
                self._wait = self._tqdm(
                    total=None, desc=self._waiting, bar_format="{desc} ({elapsed})", dynamic_ncols=True
                )

    @classmethod
    def announce(cls, desc: str, unit: str, waiting: str) -> None:
        """Show a job's bar now, before the job's own modules are imported (the ``dask-lm`` command, whose user
        otherwise sees nothing for the seconds ``distributed`` takes to import): the job takes it over
        (:meth:`for_job`)."""
        global _announced
        _announced = cls(None, desc, unit, waiting, delay=FIRST_LINE_DELAY_S)

    @classmethod
    def for_job(cls, desc: str, unit: str, waiting: str, enabled: bool = True) -> JobBar:
        """A job's bar from its first second, saying ``waiting``: the one :meth:`announce` showed for it, else a new
        one. Its total is given by a later :meth:`wait` (the job's rows or steps, once known)."""
        global _announced
        bar, _announced = _announced, None
        if bar is not None and bar.desc == desc and enabled and progress_enabled():
            bar.wait(waiting)
            return bar
        if bar is not None:
            bar.close()
        return cls(None, desc, unit, waiting, enabled=enabled, delay=FIRST_LINE_DELAY_S)

    def listen(self, client: Any) -> str | None:
        """The id under which the workers report this job's parts (``{"id": ..., "part": i, "done": rows}`` on
        :data:`TOPIC`: :func:`dask_lm.comm.progress.report_progress`); ``None`` when the bar is off."""
        if not self._on:
            return None
        _subscribe(client)
        self.progress_id = uuid.uuid4().hex
        with _lock:
            _bars[self.progress_id] = self
        return self.progress_id

    def wait(self, waiting: str, total: int | None = None) -> None:
        """Say what the job waits for now (before the first update); ``total`` corrects the count to come."""
        with self._lock:
            if total is not None:
                self.total = total
            if self._waiting != f"{self.desc}: {waiting}":
                self._waiting = f"{self.desc}: {waiting}"
                if self._wait is not None:
                    self._wait.reset()  # the time shown is this wait's, as the summary's phases count it
                    self._wait.set_description_str(self._waiting)

    def write(self, line: str) -> None:
        """A line above the bar (the dashboard's address while the job runs); nothing when the bar is off."""
        with self._lock:
            if self._on:
                self._open_wait()  # a line above a bar that is there
                import sys

                self._tqdm.write(line, file=sys.stderr)  # with the bar, off stdout (which a script may parse)

    def on_event(self, msg: dict[str, Any]) -> None:
        """A worker's report: it began part ``msg["part"]`` (``done`` 0), or has scored ``done`` of its rows."""
        part = msg.get("part")
        if not isinstance(part, int):
            return
        with self._lock:
            if part in self._finished:  # an event that arrived after the part's own result
                return
            self._running[part] = max(self._running.get(part, 0), int(msg.get("done", 0)))
            self._show()

    def update(self, n: int, postfix: str | None = None, part: int | None = None) -> None:
        """``n`` more units done (those of ``part``, when it is given: its running count goes)."""
        with self._lock:
            self.n += n
            if part is not None:
                self._finished.add(part)
                self._running.pop(part, None)
            self._show()
            if self._bar is not None and postfix:
                self._bar.set_postfix_str(postfix)

    def _show(self) -> None:
        shown = min(self.n + sum(self._running.values()), self.total)
        if self._on and self._bar is None:
            if self._wait is not None:
                self._wait.close()
                self._wait = None
            self._bar = self._tqdm(total=self.total, initial=shown, desc=self.desc, unit=self.unit, dynamic_ncols=True)
        elif self._bar is not None and shown > self._bar.n:
            self._bar.update(shown - self._bar.n)

    def close(self) -> None:
        if self.progress_id is not None:
            with _lock:
                _bars.pop(self.progress_id, None)
        with self._lock:
            self._on = False
            if self._timer is not None:
                self._timer.cancel()
            for b in (self._wait, self._bar):
                if b is not None:
                    b.close()
            self._wait = self._bar = None
