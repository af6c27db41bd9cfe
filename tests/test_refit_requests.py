"""One request per refit route, each answered by its own handler on the rank: the driver's request reaches the
Refitter's method of that route with its fields, and no route's request carries another route's fields. Fast: a
recording Refitter stands in for the rank's."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from dask_lm.data import messages
from dask_lm.data.messages import (
    BroadcastRefitRequest,
    HttpRefitRequest,
    RefitRequest,
    ReshardRefitRequest,
    ZmqRefitRequest,
)
from dask_lm.workers.endpoints import ENDPOINTS, handle


class _Refitter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return {"route": name}

        return record


ROUTES = [
    (
        HttpRefitRequest(
            ("http://a:1", "http://b:2"),
            [[0], [1]],
            "7",
            buffer_size_bytes=64,
            timeout_s=5.0,
            transport="shm",
            progress_id="p",
        ),
        (
            "stream_via_http",
            (["http://a:1", "http://b:2"],),
            {
                "layout": [[0], [1]],
                "buffer_size_bytes": 64,
                "weight_version": "7",
                "timeout_s": 5.0,
                "transport": "shm",
                "progress_id": "p",
            },
        ),
    ),
    (
        ZmqRefitRequest(buffer_size_bytes=32, timeout_s=3.0, progress_id="q"),
        ("stream_via_zmq", (), {"buffer_size_bytes": 32, "timeout_s": 3.0, "progress_id": "q"}),
    ),
    (
        BroadcastRefitRequest(buffer_size_bytes=16, progress_id=None),
        ("broadcast", (), {"buffer_size_bytes": 16, "progress_id": None}),
    ),
    (ReshardRefitRequest({"boxes": []}), ("reshard", ({"boxes": []},), {})),
]


def test_every_route_has_its_own_handler():
    routes = typing.get_args(RefitRequest)
    assert set(routes) <= set(ENDPOINTS)
    assert len({ENDPOINTS[r] for r in routes}) == len(routes)
    assert {type(req) for req, _ in ROUTES} == set(routes)
    assert not hasattr(messages, "RefitPlan")


@pytest.mark.parametrize(
    "request_, call", ROUTES, ids=lambda x: type(x).__name__ if dataclasses.is_dataclass(x) else ""
)
def test_a_route_s_request_reaches_its_refitter_method(request_, call):
    worker = types.SimpleNamespace(refitter=_Refitter())
    assert handle(worker, request_) == {"route": call[0]}  # type: ignore[arg-type]
    assert worker.refitter.calls == [call]


def test_a_route_carries_only_its_own_fields():
    fields = {r.__name__: {f.name for f in dataclasses.fields(r)} for r in typing.get_args(RefitRequest)}
    assert fields == {
        "HttpRefitRequest": {
            "urls",
            "layout",
            "weight_version",
            "buffer_size_bytes",
            "timeout_s",
            "transport",
            "progress_id",
        },
        "ZmqRefitRequest": {"buffer_size_bytes", "timeout_s", "progress_id"},
        "BroadcastRefitRequest": {"buffer_size_bytes", "progress_id"},
        "ReshardRefitRequest": {"plan", "progress_id"},
    }
