"""Progress bars for the calls a notebook or CLI user waits for: model load across workers, training over several
global batches, scoring (``score_parquet``).

Work inside a rank reports progress as a Dask event on the topic ``"dask-lm-progress"``
(``{"id": ..., "done": k}``, from rank 0 only); the driver subscribes once per client and moves the bar
(``tqdm.auto``: a widget in notebooks, text elsewhere; it disappears when the call ends). Quiet with
``dask_lm.set_progress(False)`` or ``DASK_LM_PROGRESS=0``; ``score_parquet(progress=False)`` for one job.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["TOPIC", "set_progress", "progress_enabled", "bar", "open_bar", "close_bar"]

TOPIC = "dask-lm-progress"
_enabled: bool = True
_bars: dict[str, Any] = {}
_lock = threading.Lock()
_subscribed: weakref.WeakSet = weakref.WeakSet()


def set_progress(enabled: bool) -> None:
    """Show (True, the default) or hide dask-lm's progress bars in this process."""
    global _enabled
    _enabled = bool(enabled)


def progress_enabled() -> bool:
    return _enabled and os.environ.get("DASK_LM_PROGRESS", "1") != "0"


def _on_event(event: Any) -> None:
    _time, msg = event
    with _lock:
        b = _bars.get(msg.get("id")) if isinstance(msg, dict) else None
        if b is not None and msg.get("done", 0) > b.n:
            b.update(int(msg["done"]) - b.n)


def open_bar(client: Any, total: int, desc: str, unit: str, **tqdm_kwargs: Any) -> tuple[str | None, Any]:
    """``(progress id, tqdm bar)``, or ``(None, None)`` when progress is off; close it with :func:`close_bar`."""
    if not progress_enabled() or total < 1:
        return None, None
    from tqdm.auto import tqdm

    if client not in _subscribed:
        try:
            client.subscribe_topic(TOPIC, _on_event)
            _subscribed.add(client)
        except Exception:  # an old scheduler without topics: the bar still shows start and end
            pass
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
