"""Structured events: one per Policy call, on the Dask event topic ``"dask-lm"``.

Each event is a flat dict of numbers and short strings (``policy``, ``call``, ``seconds``, ``tokens``, and for
``train`` the loss, grad norm, learning rate and MFU), logged from the driver with ``Client.log_event``. Read them
with ``client.get_events("dask-lm")`` (a tuple of ``(timestamp, event)``) or follow them live with
``client.subscribe_topic("dask-lm", handler)``; the scheduler keeps the most recent ones
(``distributed.admin.low-level-log-length``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

__all__ = ["TOPIC", "log_call"]

TOPIC = "dask-lm"
logger = logging.getLogger("dask_lm")


def _plain(value: Any) -> Any:
    """A JSON-friendly scalar or list: tensors and numpy values become floats; non-finite floats become None."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def log_call(client: Any, policy_id: str, call: str, *, start: float, tokens: int | None = None, **fields: Any) -> None:
    """Log one finished call (``start`` from ``time.perf_counter()``). Never raises: metrics must not fail work."""
    event = {"policy": policy_id, "call": call, "seconds": time.perf_counter() - start, "tokens": tokens}
    event.update({k: _plain(v) for k, v in fields.items() if v is not None})
    try:
        client.log_event(TOPIC, event)
    except Exception:
        logger.debug("could not log a %s event", TOPIC, exc_info=True)
