"""Refit into SGLang servers over HTTP (SGLang 0.5.23's weight-update session), run on every policy rank.

The sequence per call, for every engine (one server per data-parallel replica, ``tp`` GPUs each):

1. ``POST /begin_weight_update`` (a 404 means a server older than sessions: carry on without one);
2. per bucket, ``POST /update_weights_from_tensor`` with one fresh serialization per TP rank, in TP order,
   ``load_format: "flattened_bucket"``, ``flush_cache: false`` and the ``weight_version``;
3. ``POST /end_weight_update``, then ``/flush_cache`` until the server has no request in flight.

``layout[e]`` names the policy rank that produces TP entry ``i`` of engine ``e``: colocated, rank ``e·tp + i``
builds its own bucket on its own GPU and the engine's first rank gathers the entries (gloo) and posts them; a
single producer per engine repeats its own serialization ``tp`` times. Every rank agrees on the outcome of each
phase and bucket before going on (one small gloo collective), which keeps each bucket alive until every rank of
every engine heard the server's answer, stops all ranks together on the first refusal, and hands every rank the
server's message. A refusal ends the session, so the server is not left waiting for the rest of the update.
"""

from __future__ import annotations

import gc
import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from dask_lm.comm import collectives
from dask_lm.comm.progress import report_progress
from dask_lm.errors import RefitError
from dask_lm.model import device
from dask_lm.refit import buckets as bk
from dask_lm.refit.source import iter_buckets, refit_info

if TYPE_CHECKING:
    from dask_lm.refit.rank import Refitter
    from dask_lm.refit.source import RefitHost

__all__ = ["stream_via_http", "transport_for"]

CONNECT_TIMEOUT_S = 10.0


def transport_for(url: str) -> str:
    """How a bucket reaches ``url``'s server from this process: a server on another host gets the bytes themselves;
    one on this host a CUDA IPC handle (GPU workers) or a shared-memory file (CPU workers)."""
    host = urlparse(url).hostname or ""
    local = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        local.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    if not (host in local or host.startswith("127.")):
        return "value"
    return "ipc" if device.is_cuda() else "shm"


class _Server:
    """One SGLang server as seen by its source rank."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import requests

        self.url = url.rstrip("/")
        self.timeout = (CONNECT_TIMEOUT_S, timeout_s)
        self.http = requests.Session()
        self.session_open = False
        self.has_sessions = True

    def call(self, method: str, route: str, body: dict | None = None) -> tuple[int, Any]:
        import requests

        try:
            resp = self.http.request(method, self.url + route, json=body, timeout=self.timeout)
        except requests.Timeout:
            raise RefitError(
                f"SGLang server {self.url} did not answer {method} {route} within {self.timeout[1]:.0f} s "
                "(a weight update waits for running requests: pause generation first, or raise "
                "timeout_s)"
            ) from None
        except requests.RequestException as e:
            raise RefitError(
                f"SGLang server {self.url} did not answer {method} {route}: {type(e).__name__}: {e}. "
                "Is it running, and is the URL right?"
            ) from None
        try:
            payload: Any = resp.json()
        except ValueError:
            payload = resp.text
        return resp.status_code, payload

    @staticmethod
    def message(payload: Any) -> str:
        if isinstance(payload, dict):
            err = payload.get("error")
            return str(payload.get("message") or (err.get("message") if isinstance(err, dict) else err) or payload)
        return str(payload).strip()

    def begin(self) -> None:
        status, payload = self.call("POST", "/begin_weight_update", {"selector": "all"})
        if status == 404:  # SGLang before weight-update sessions: updates are accepted without one
            self.has_sessions = False
            return
        if status != 200 or (isinstance(payload, dict) and payload.get("success") is False):
            hint = ""
            if "already" in self.message(payload).lower():
                hint = (
                    " (another client, or an earlier refit that died, left a session open; if nothing else is "
                    f"updating this server, POST {self.url}/end_weight_update and retry)"
                )
            raise RefitError(
                f"SGLang server {self.url} refused begin_weight_update: HTTP {status}: {self.message(payload)}{hint}"
            )
        self.session_open = True

    def update(self, entries: list[str], weight_version: str, what: str) -> None:
        body = {
            "serialized_named_tensors": entries,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": weight_version,
        }
        status, payload = self.call("POST", "/update_weights_from_tensor", body)
        if status != 200 or not (isinstance(payload, dict) and payload.get("success", False)):
            raise RefitError(f"SGLang server {self.url} refused {what}: HTTP {status}: {self.message(payload)}")

    def end(self) -> None:
        if not self.session_open:
            return
        self.session_open = False
        status, payload = self.call("POST", "/end_weight_update", {})
        if status != 200 or (isinstance(payload, dict) and payload.get("success") is False):
            raise RefitError(
                f"SGLang server {self.url} refused end_weight_update: HTTP {status}: {self.message(payload)}"
            )

    def flush(self, retries: int, interval_s: float) -> None:
        # 400 while requests are running or queued: the server asks to be asked again
        for attempt in range(retries + 1):
            status, payload = self.call("GET", "/flush_cache")
            if status == 200:
                return
            if status != 400:  # 400 is "busy, ask again"; anything else will not get better by asking
                break
            if attempt < retries:
                time.sleep(interval_s)
        raise RefitError(
            f"SGLang server {self.url} did not flush its cache (HTTP {status}: {self.message(payload)}); "
            "the new weights are loaded but cached prefixes are stale"
        )

    def abandon(self) -> None:
        """End an open session after a failure, so the server takes the next refit."""
        try:
            self.end()
        except RefitError:
            pass


def _agree(group: Any, error: str | None) -> None:
    """Every rank learns whether any rank failed, and the first failure's message; all raise it together."""
    first = collectives.first_message(error, group)
    if first is not None:
        raise RefitError(first)


def _collect(rank: int, feeders: list[int], mine: list[str], groups: dict[Any, Any]) -> list[str] | None:
    """The engine's entries in TP order on its source rank (gathered from the other feeders), None elsewhere."""
    import torch.distributed as dist

    members = tuple(sorted(set(feeders)))
    if len(members) == 1:
        return mine if rank == members[0] else None
    if rank not in members:
        return None
    gathered: list[Any] | None = [None] * len(members) if rank == feeders[0] else None
    dist.gather_object(mine, gathered, dst=feeders[0], group=groups[members])
    if gathered is None:
        return None
    by_rank = dict(zip(members, gathered))
    if any(len(by_rank[r]) != feeders.count(r) for r in members):
        return []  # a feeder failed to serialize: its error reaches every rank at the next agreement
    taken = dict.fromkeys(members, 0)
    entries = []
    for r in feeders:
        entries.append(by_rank[r][taken[r]])
        taken[r] += 1
    return entries


def _cumulative_tensor_bytes(plan: list[list[bk.Slot]]) -> list[int]:
    """Tensor bytes sent after each bucket (alignment gaps left out), for the driver's progress bar."""
    out, total = [], 0
    for bucket in plan:
        total += sum(s.nbytes for s in bucket)
        out.append(total)
    return out


def _attempt(fn: Any, *args: Any) -> str | None:
    """Run ``fn(*args)``; a failure becomes a message for the agreement, so every rank stops at the same point."""
    try:
        fn(*args)
        return None
    except RefitError as e:
        return str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def stream_via_http(
    worker: RefitHost,
    refitter: Refitter,
    urls: list[str],
    *,
    layout: list[list[int]],
    buffer_size_bytes: int,
    weight_version: str,
    timeout_s: float,
    flush_retries: int = 60,
    flush_interval_s: float = 1.0,
    transport: str | None = None,
    progress_id: str | None = None,
) -> dict[str, Any]:
    if transport == "ipc" and not device.is_cuda():
        raise ValueError("transport='ipc' (CUDA IPC handles) needs GPU workers; use 'shm' or 'value' on CPU")
    rank = worker.rank
    groups = (
        refitter.gloo_groups(layout, worker.world_size, worker.cfg.collective_timeout_s)
        if worker.world_size > 1
        else {}
    )
    agree_group = groups.get("all")
    servers = {e: _Server(url, timeout_s) for e, url in enumerate(urls) if layout[e][0] == rank}
    feeds = {e: [i for i, r in enumerate(feeders) if r == rank] for e, feeders in enumerate(layout)}
    transports = {e: transport or transport_for(urls[e]) for e in range(len(urls))}
    plan = bk.plan_buckets(refit_info(worker), buffer_size_bytes)
    bucket_ends = _cumulative_tensor_bytes(plan)
    start, sent = time.perf_counter(), 0

    def begin_all() -> None:
        for s in servers.values():
            s.begin()

    def finish_all() -> None:
        for s in servers.values():
            s.end()
            s.flush(flush_retries, flush_interval_s)

    error = _attempt(begin_all)
    try:
        _agree(agree_group, error)
        for b, (bucket, flat) in enumerate(zip(plan, iter_buckets(worker, plan, keep=any(feeds.values())))):
            what = (
                f"bucket {b + 1}/{len(plan)} ({len(bucket)} tensors from {bucket[0].name}, "
                f"{bk.bucket_nbytes(bucket) / 2**20:.1f} MiB; earlier buckets are already loaded)"
            )
            error = None
            host_copy = None
            for e, feeders in enumerate(layout):
                # one fresh serialization per TP entry, each opened (and released) by exactly one server rank; every
                # engine gets its entries even after another refused, so no export is left unconsumed
                mine: list[str] = []
                if feeds[e]:
                    assert flat is not None  # iter_buckets keeps every bucket on a rank that feeds an engine
                    src = flat
                    if transports[e] == "value":  # the bytes travel inside the pickle: from host memory
                        host_copy = flat.cpu() if host_copy is None else host_copy
                        src = host_copy
                    # serialized inside the attempt: extend consumes the generator there
                    err = _attempt(
                        mine.extend, (bk.dumps_b64(bk.sglang_bucket(src, bucket), transports[e]) for _ in feeds[e])
                    )
                    error = error or err
                entries = _collect(rank, feeders, mine, groups)
                if entries is not None and e in servers and len(entries) == len(feeders):
                    err = _attempt(servers[e].update, entries, weight_version, what)
                    error = error or err
                    sent += bk.bucket_nbytes(bucket) * len(entries)
            _agree(agree_group, error)  # nobody frees this bucket before every engine has answered for it
            if rank == 0:
                report_progress(progress_id, bucket_ends[b])
            del flat, host_copy
            device.ipc_collect()
        error = _attempt(finish_all)
        _agree(agree_group, error)
    except BaseException:
        for s in servers.values():
            s.abandon()
        raise
    finally:
        gc.collect()  # then exported blocks the servers have released can go back to the allocator
        device.ipc_collect()
    return {
        "engines": [s.url for s in servers.values()],
        "buckets": len(plan),
        "bytes": sent,
        "seconds": time.perf_counter() - start,
    }
