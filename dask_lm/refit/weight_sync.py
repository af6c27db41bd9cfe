"""NeMo RL's ``WeightSynchronizer`` for dask-lm's SGLang refit over HTTP (driver side).

NeMo RL moves weights from its policy into its generation backend through a synchronizer object
(``nemo_rl/weight_sync/interfaces.py:46-127``): ``init_communicator()`` once at setup, ``sync_weights(timer=,
kv_scales=)`` at every refit, ``is_stale`` and ``shutdown()``. ``create_weight_synchronizer(...)``
(``nemo_rl/weight_sync/factory.py:37-45``) picks one by backend; for colocated SGLang it is the HTTP one
(``http_weight_synchronizer.py``). Its calls on the policy (``offload_before_refit``, ``stream_weights_via_http``,
``offload_after_refit``, ``prepare_refit_info``, ``get_free_memory_bytes``) are all ``dask_lm.Policy`` methods;
what it cannot do with a dask-lm Policy is wait: it waits with ``ray.get`` on what the policy returns, and
dask-lm's are Dask futures. :class:`HTTPWeightSynchronizer` here is the same object for a dask-lm Policy, written
against NeMo RL's interface without importing it (:class:`WeightSynchronizer` is a structural Protocol), and
:class:`SGLangEngines` is the generation side it talks to: SGLang servers that already run, named by URL.

NeMo RL's GRPO uses a synchronizer wherever one sits at ``policy_generation.weight_synchronizer``
(``nemo_rl/algorithms/grpo.py:2337-2339`` for every refit, ``grpo.py:2422-2427`` for the first one), so putting
this one there routes its refits through dask-lm.

Staleness means what NeMo RL's interface says (``interfaces.py:100-111``): ``is_stale`` is True until a
``sync_weights()`` succeeds, and per-step staleness (a train step since the last sync) is the training loop's to
track (its ``POLICY_GENERATION_STALE``, set after ``prepare_for_training``, ``grpo.py:3328-3329``), not this
object's. A sync that fails part-way leaves the engines with some new and some old weights, so it makes
``is_stale`` True again.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from dask_lm.engine.metrics import timed
from dask_lm.refit.driver import check_urls

__all__ = [
    "WeightSynchronizer",
    "HTTPWeightSynchronizer",
    "SGLangEngines",
    "create_weight_synchronizer",
    "GENERATION_BACKENDS",
]

GENERATION_BACKENDS = ("vllm", "sglang", "megatron", "dynamo")  # the names NeMo RL's factory accepts
TIMER_LABEL = "prepare_for_generation/transfer_and_update_weights"  # NeMo RL's label for the transfer's time
MEMORY_RATIO_ENV = "NRL_REFIT_BUFFER_MEMORY_RATIO"  # NeMo RL's knob: the share of free memory a bucket may take


@runtime_checkable
class WeightSynchronizer(Protocol):
    """What NeMo RL's training loops call on a weight synchronizer (``nemo_rl/weight_sync/interfaces.py``)."""

    def sync_weights(self, *, timer: Any = None, kv_scales: dict[str, float] | None = None) -> dict[str, float] | None:
        """Put the policy's current weights into every generation engine; raise ``RuntimeError`` on failure."""

    @property
    def is_stale(self) -> bool:
        """True until the first successful ``sync_weights()``."""

    def init_communicator(self) -> None:
        """Once, after the policy and the generation side exist."""

    def shutdown(self) -> None:
        """Release what the transport holds."""


class SGLangEngines:
    """The generation side of an SGLang refit: SGLang servers that run already (one URL per engine, each engine
    ``num_gpus_per_engine`` GPUs of tensor parallelism), with the methods NeMo RL's synchronizers and GRPO call on
    its ``SGLangGeneration``.

    dask-lm does not start or stop these servers, so their memory is theirs: ``prepare_for_generation`` and
    ``finish_generation`` do nothing, as NeMo RL's do for servers that are not offloaded (``needs_offload``
    false, ``nemo_rl/models/generation/sglang/sglang_generation.py:743-761``)."""

    def __init__(self, urls: list[str], *, num_gpus_per_engine: int = 1, timeout_s: float = 60.0) -> None:
        self.urls = check_urls(urls)
        if isinstance(num_gpus_per_engine, bool) or not isinstance(num_gpus_per_engine, int) or num_gpus_per_engine < 1:
            raise ValueError(f"`num_gpus_per_engine` must be a positive int, got {num_gpus_per_engine!r}")
        self.num_gpus_per_engine = num_gpus_per_engine
        self.timeout_s = float(timeout_s)
        self.refit_info: dict[str, Any] | None = None

    @classmethod
    def from_policy(cls, policy: Any) -> SGLangEngines:
        """The servers of a Policy's ``generation.sglang_cfg.server_urls``; the TP size from NeMo RL's key
        ``generation.sglang_cfg.sglang_server_config.num_gpus_per_engine`` (default 1)."""
        gen = policy.cfg.generation
        sg = gen.sglang_cfg if gen is not None else None
        if sg is None or not sg.server_urls:
            raise ValueError(
                "SGLangEngines.from_policy: the policy's config names no servers; set "
                "`policy.generation.sglang_cfg.server_urls`, or give the URLs: SGLangEngines([...])"
            )
        server_cfg = sg.extra.get("sglang_server_config") or {}
        return cls(list(sg.server_urls), num_gpus_per_engine=int(server_cfg.get("num_gpus_per_engine", 1)))

    def get_rollout_engine_urls(self) -> list[str]:
        """Each engine's HTTP base URL, in engine order."""
        return list(self.urls)

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        """Kept for reference only: SGLang learns names and shapes from each update's payload."""
        self.refit_info = state_dict_info

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def invalidate_kv_cache(self) -> bool:
        """``GET /flush_cache`` on every server; True if every one flushed (NeMo RL's meaning,
        ``sglang_generation.py:763-780``: a server that refuses, or is busy, makes it False)."""
        import requests

        ok = True
        for url in self.urls:
            try:
                ok = requests.get(url + "/flush_cache", timeout=self.timeout_s).status_code == 200 and ok
            except requests.RequestException:
                ok = False
        return ok

    def shutdown(self) -> bool:
        """The servers are not dask-lm's: they keep running."""
        return True

    def __repr__(self) -> str:
        return f"SGLangEngines({self.urls!r}, num_gpus_per_engine={self.num_gpus_per_engine})"


class HTTPWeightSynchronizer:
    """NeMo RL's HTTP weight synchronizer for a ``dask_lm.Policy``: refits SGLang engines with the policy's
    ``stream_weights_via_http`` and waits on its Dask futures.

    ``generation`` is anything with ``get_rollout_engine_urls()`` and ``prepare_for_generation(tags=...)``:
    :class:`SGLangEngines`, or NeMo RL's own generation object. ``colocated`` (NeMo RL's meaning: the engines share
    the policy's GPUs) brackets each transfer with the phase changes of NeMo RL's sequence
    (``http_weight_synchronizer.py:21-26``); not colocated, the synchronizer only moves the weights, as NeMo RL's
    non-colocated ones do (``interfaces.py:55-58``), and dask-lm sends the bytes themselves to a server on another
    host.

    >>> sync = HTTPWeightSynchronizer(policy, SGLangEngines(["http://h:30000"]))  # doctest: +SKIP
    >>> sync.init_communicator()                                                     # doctest: +SKIP
    >>> policy.train(batch, loss_fn); sync.sync_weights()                            # doctest: +SKIP
    """

    def __init__(
        self, policy: Any, generation: Any, refit_buffer_size_gb: float | int | None = None, *, colocated: bool = True
    ) -> None:
        if not callable(getattr(generation, "get_rollout_engine_urls", None)):
            raise ValueError(
                f"the SGLang refit needs a generation side with get_rollout_engine_urls(), got "
                f"{type(generation).__name__}: pass dask_lm.refit.weight_sync.SGLangEngines([url, ...]) "
                "or SGLangEngines.from_policy(policy)"
            )
        if refit_buffer_size_gb is not None and not refit_buffer_size_gb > 0:
            raise ValueError(f"`refit_buffer_size_gb` must be > 0, got {refit_buffer_size_gb!r}")
        self._policy = policy
        self._generation = generation
        self._refit_buffer_size_gb = refit_buffer_size_gb
        self._colocated = bool(colocated)
        self._stale = True
        self._closed = False

    @property
    def is_stale(self) -> bool:
        return self._stale

    def init_communicator(self) -> None:
        """The engines' TP size to the policy (NeMo RL's GRPO does this itself at setup, ``grpo.py:1442``; here it
        comes from the generation side's ``num_gpus_per_engine``), then the refit metadata handshake
        (``http_weight_synchronizer.py:103-105``). HTTP needs no process group."""
        tp = getattr(self._generation, "num_gpus_per_engine", None)
        if tp is not None:
            self._policy.set_rollout_num_gpus_per_engine(int(tp))
        state_dict_info = self._policy.prepare_refit_info()
        if self._generation is not self._policy and callable(getattr(self._generation, "prepare_refit_info", None)):
            self._generation.prepare_refit_info(state_dict_info)

    def sync_weights(self, *, timer: Any = None, kv_scales: dict[str, float] | None = None) -> dict[str, float]:
        """One refit; returns its size and time (NeMo RL's GRPO logs them under ``refit/``). Raises
        :class:`dask_lm.RefitError` (a ``RuntimeError``) with the server's message when an engine refuses."""
        if self._closed:
            raise ValueError("sync_weights() after shutdown(): make a new synchronizer")
        if kv_scales is not None:
            raise ValueError(
                "`kv_scales`: the SGLang HTTP refit carries no FP8 KV-cache scales (nor does NeMo RL's, "
                "http_weight_synchronizer.py:69-74); pass None"
            )
        if self._colocated:
            self._policy.offload_before_refit()
            self._generation.prepare_for_generation(tags=["weights"])
        self._stale = True  # from the first bucket on, the engines hold a mix until every engine has answered
        try:
            with timed(timer, TIMER_LABEL):
                futures = self._policy.stream_weights_via_http(
                    rollout_engine_urls=self._generation.get_rollout_engine_urls(),
                    buffer_size_bytes=self._buffer_size_bytes(),
                )
                results = self._policy.client.gather(list(futures))
        finally:
            if self._colocated:
                self._policy.offload_after_refit()
                self._generation.prepare_for_generation(tags=["kv_cache"])
        self._stale = False
        return {
            "http_bytes_sent": float(sum(r["bytes"] for r in results)),
            "http_buckets": float(max(r["buckets"] for r in results)),
            "http_transfer_s": float(max(r["seconds"] for r in results)),
        }

    def shutdown(self) -> None:
        """Each refit opens and ends its own HTTP sessions, so nothing stays open between refits; later
        ``sync_weights()`` calls are refused."""
        self._closed = True

    def _buffer_size_bytes(self) -> int | None:
        """NeMo RL's rule (``http_weight_synchronizer.py:110-126``): the configured size, else
        ``NRL_REFIT_BUFFER_MEMORY_RATIO`` of the free device memory; with neither, None lets the Policy apply the
        same rule with its own ``refit_buffer_size_gb`` and NeMo RL's default ratio, 0.3."""
        if self._refit_buffer_size_gb is not None:
            return int(self._refit_buffer_size_gb * 2**30)
        raw = os.environ.get(MEMORY_RATIO_ENV)
        if raw is None:
            return None
        try:
            ratio = float(raw)
        except ValueError:
            raise ValueError(f"{MEMORY_RATIO_ENV} must be a number, got {raw!r}") from None
        if not ratio > 0:
            raise ValueError(f"{MEMORY_RATIO_ENV} must be > 0, got {raw!r}")
        return max(1, int(self._policy.get_free_memory_bytes() * ratio))

    def __repr__(self) -> str:
        # the generation's own repr: asking it for its URLs may be a remote call (NeMo RL's asks its Ray actors)
        return f"HTTPWeightSynchronizer({self._generation!r}, colocated={self._colocated}, stale={self._stale})"


def create_weight_synchronizer(
    policy: Any,
    generation: Any,
    generation_backend: str,
    colocated: bool,
    train_cluster: Any = None,
    inference_cluster: Any = None,
    refit_buffer_size_gb: float | int | None = None,
) -> HTTPWeightSynchronizer:
    """NeMo RL's factory (``nemo_rl/weight_sync/factory.py:37-45``, the same arguments) for a ``dask_lm.Policy``.

    ``"sglang"`` gives :class:`HTTPWeightSynchronizer`, colocated or not (NeMo RL refuses SGLang not colocated;
    dask-lm's HTTP refit also reaches servers on other hosts). The clusters are not needed: HTTP forms no process
    group. The other backends' synchronizers are not built here; their refits are Policy methods."""
    if generation_backend not in GENERATION_BACKENDS:
        raise ValueError(f"Unknown generation backend {generation_backend!r}; supported: {list(GENERATION_BACKENDS)}")
    if refit_buffer_size_gb is not None and not refit_buffer_size_gb > 0:
        raise ValueError(f"`refit_buffer_size_gb` must be > 0, got {refit_buffer_size_gb!r}")
    if generation_backend != "sglang":
        raise NotImplementedError(
            f"a {generation_backend} weight synchronizer is not built by dask-lm; its Policy refits through "
            "stream_weights_via_ipc_zmq (colocated vLLM-style workers), broadcast_weights_for_collective and "
            "nccl_reshard_refit (remote inference ranks) or swap_weights_via_reshard (a generation-side Policy): "
            "see docs/guides/refit.md"
        )
    return HTTPWeightSynchronizer(policy, generation, refit_buffer_size_gb, colocated=colocated)
