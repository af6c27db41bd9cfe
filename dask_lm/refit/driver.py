"""The refit half of ``Policy`` (driver side): push the policy's current weights into inference engines.

Mixed into :class:`dask_lm.Policy`. The driver checks every argument, fixes the buffer size and which rank feeds
which engine, and submits one task per rank; the ranks stream (:mod:`dask_lm.refit.rank`,
:mod:`dask_lm.refit.http`). The streaming methods return the Dask futures of those tasks, as NeMo RL returns
Ray object refs: wait on them with ``client.gather(futures)`` (or ``f.result()``) before the next Policy call, the
way an RL loop waits for its inference side at the same time.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from distributed import Future

from dask_lm.data.messages import (
    ActionRequest,
    BroadcastRefitRequest,
    CollectiveInitRequest,
    HttpRefitRequest,
    Request,
    ReshardRefitRequest,
    WeightSwapRequest,
    ZmqRefitRequest,
)
from dask_lm.engine import progress
from dask_lm.engine.policy_base import PolicyBase
from dask_lm.workers import tasks

__all__ = ["RefitMixin", "check_urls", "engine_layout", "REFIT_BUFFER_MEMORY_RATIO"]

REFIT_BUFFER_MEMORY_RATIO = 0.3  # of the smallest free device memory, when no size is configured (NeMo RL's default)

# the Policies of this process that joined a refit group, by the group's store address: two Policies that share a
# worker cannot both be members (the process would wait for itself), which is told here before any rank waits
_REFIT_GROUPS: dict[tuple[str, int], list[dict[str, Any]]] = {}


def engine_layout(world_size: int, num_engines: int, tp: int) -> list[list[int]]:
    """``layout[e][i]``: the policy rank that produces TP entry ``i`` of engine ``e``.

    Colocated (``world_size == num_engines × tp``): rank ``e·tp + i`` shares a GPU with TP rank ``i`` of engine
    ``e`` and sends its own bucket from there. Otherwise each engine is fed by one rank (``e mod world_size``),
    which serializes its bucket once per TP rank, as SGLang's own HTTP adapter does."""
    if num_engines < 1:
        raise ValueError("stream_weights_via_http: `rollout_engine_urls` is empty; pass one URL per SGLang server")
    if world_size == num_engines * tp:
        return [[e * tp + i for i in range(tp)] for e in range(num_engines)]
    return [[e % world_size] * tp for e in range(num_engines)]


def check_urls(urls: Any) -> list[str]:
    if isinstance(urls, str) or not isinstance(urls, (list, tuple)):
        raise ValueError(f"`rollout_engine_urls` must be a list of server URLs, got {urls!r}")
    out = []
    for i, url in enumerate(urls):
        parsed = urlparse(str(url))
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"`rollout_engine_urls[{i}]` = {url!r} is not an http(s)://host:port URL")
        out.append(str(url).rstrip("/"))
    if len(set(out)) != len(out):
        raise ValueError(f"`rollout_engine_urls` lists a server twice: {out}")
    return out


class RefitMixin(PolicyBase):
    _rollout_gpus_per_engine: int | None = None
    _weight_version: int = 0
    _refit_total_bytes: int | None = None
    _refit_place: dict[str, Any] | None = None  # the refit group this Policy's ranks joined: store, member offset

    def _refit_buffer_size(self, buffer_size_bytes: int | None) -> int:
        if buffer_size_bytes is not None:
            if isinstance(buffer_size_bytes, bool) or not isinstance(buffer_size_bytes, int) or buffer_size_bytes < 1:
                raise ValueError(f"`buffer_size_bytes` must be a positive int, got {buffer_size_bytes!r}")
            return buffer_size_bytes
        gb = self.cfg.refit_buffer_size_gb
        if gb is not None:
            return int(gb * 2**30)
        return max(1, int(self.get_free_memory_bytes() * REFIT_BUFFER_MEMORY_RATIO))

    def _post(
        self, request: Callable[[str | None], Request], what: str, *, show_progress: bool = True
    ) -> list[Future[Any]]:
        """``request(progress_id)`` on every rank, whose futures handed back raise the rank's error while the
        rank's chain goes on: the caller may see one rank's failure and submit again before the other ranks'
        tasks have finished. A progress bar over the bytes sent (rank 0 reports them) lives until every future is
        done."""
        progress_id = None
        if show_progress:
            progress_id, _bar = progress.open_bar(self.client, self._refit_bytes(), "refit", "B", unit_scale=True)
        futures = self.group.post(request(progress_id), key_name=what.replace("_", "-"), what=what, settle=True)
        if progress_id is not None:
            pending = [len(futures)]
            lock = threading.Lock()

            def one_done(_fut: Future[Any]) -> None:
                with lock:
                    pending[0] -= 1
                    last = pending[0] == 0
                if last:
                    progress.close_bar(progress_id)

            for f in futures:
                f.add_done_callback(one_done)
        return futures

    def _refit_bytes(self) -> int:
        """Bytes one refit sends (for the progress bar); learned once, since the weights' shapes do not change."""
        if not progress.progress_enabled():
            return 0
        if self._refit_total_bytes is None:
            import torch

            self._refit_total_bytes = sum(
                torch.Size(shape).numel() * dtype.itemsize for shape, dtype in self.prepare_refit_info().values()
            )
        return self._refit_total_bytes

    # ----------------------------------------------------------------------------------------- info
    def prepare_refit_info(self) -> dict[str, tuple[Any, Any]]:
        """``{name: (shape, dtype)}`` of every weight a refit sends: Hugging Face names (tied duplicates left out,
        as ``save_pretrained`` does), full unsharded shapes, floating weights in the policy precision."""
        info: dict[str, tuple[Any, Any]] = self.group.run(
            ActionRequest("prepare_refit_info"), what="prepare_refit_info", key_name="prepare-refit-info"
        )[0]
        return info

    def report_device_id(self) -> list[str]:
        """Each rank's device: its GPU UUID (``cpu-<host>-<pid>`` on CPU workers)."""
        return self.group.run(ActionRequest("report_device_id"), what="report_device_id", key_name="report-device-id")

    def get_zmq_addresses(self) -> list[str]:
        """The socket each rank binds for ``stream_weights_via_ipc_zmq`` (the inference worker on the same device
        connects a ZMQ REP socket to it; see :func:`dask_lm.refit.receiver.receive_via_zmq`).

        Each is an ``ipc://`` path in a directory private to the worker's user (mode 0700; the socket 0600), made
        by the rank on the first call and removed at ``shutdown()``: the inference worker must run as the same user
        on the same host. Asked of the ranks, since only they know the directory; the same until shutdown."""
        return self.group.call(
            tasks.zmq_address, self.group.policy_id, what="get_zmq_addresses", key_name="zmq-address"
        )

    # ----------------------------------------------------------------------------------------- SGLang over HTTP
    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        """The tensor-parallel size of each SGLang server (needed before ``stream_weights_via_http``)."""
        if isinstance(num_gpus_per_engine, bool) or not isinstance(num_gpus_per_engine, int) or num_gpus_per_engine < 1:
            raise ValueError(f"`num_gpus_per_engine` must be a positive int, got {num_gpus_per_engine!r}")
        self._rollout_gpus_per_engine = num_gpus_per_engine

    def stream_weights_via_http(
        self,
        rollout_engine_urls: list[str],
        buffer_size_bytes: int | None = None,
        *,
        weight_version: str | None = None,
        timeout_s: float = 600.0,
        transport: str | None = None,
    ) -> list[Future[Any]]:
        """Push the current weights into SGLang servers (their weight-update session); one future per rank.

        ``buffer_size_bytes`` caps a bucket (default: ``policy.refit_buffer_size_gb``, else 0.3 × the smallest free
        device memory). ``weight_version`` defaults to a counter that grows by one per call. ``transport``
        overrides how buckets travel (``"ipc"``, ``"shm"``, ``"value"``; see :mod:`dask_lm.refit.buckets`)."""
        urls = check_urls(rollout_engine_urls)
        tp = self._rollout_gpus_per_engine
        if tp is None:
            raise ValueError(
                "call set_rollout_num_gpus_per_engine(n) (the SGLang servers' TP size) before stream_weights_via_http"
            )
        if transport not in (None, "ipc", "shm", "value"):
            raise ValueError(f"`transport` must be 'ipc', 'shm' or 'value', got {transport!r}")
        layout = engine_layout(self.data_parallel_size, len(urls), tp)
        size = self._refit_buffer_size(buffer_size_bytes)
        self._weight_version += 1
        version = str(weight_version) if weight_version is not None else str(self._weight_version)
        return self._post(
            lambda progress_id: HttpRefitRequest(
                tuple(urls),
                layout,
                version,
                buffer_size_bytes=size,
                timeout_s=float(timeout_s),
                transport=transport,
                progress_id=progress_id,
            ),
            "stream_weights_via_http",
        )

    # ----------------------------------------------------------------------------------------- ZMQ, colocated
    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int | None = None, kv_scales: Any = None, *, timeout_s: float = 120.0
    ) -> list[Future[Any]]:
        """Every rank streams all weights to the inference worker on its own device, over the ZMQ socket named by
        ``get_zmq_addresses()``, in two ping-pong buffers of half ``buffer_size_bytes``; one future per rank."""
        if kv_scales is not None:
            raise ValueError("`kv_scales` (FP8 KV-cache scales) are not supported by this backend; pass None")
        size = self._refit_buffer_size(buffer_size_bytes)
        return self._post(
            lambda progress_id: ZmqRefitRequest(
                buffer_size_bytes=size, timeout_s=float(timeout_s), progress_id=progress_id
            ),
            "stream_weights_via_ipc_zmq",
        )

    # ----------------------------------------------------------------------------------------- collective
    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, timeout_s: float | None = None
    ) -> list[Future[Any]]:
        """Build the refit process group with ``world_size - train_world_size`` inference ranks (NCCL on GPUs,
        gloo on CPU). Policy rank 0 hosts its store at ``ip:port``; inference rank ``i`` joins as
        ``train_world_size + i`` (see :class:`dask_lm.refit.receiver.CollectiveReceiver`). One future per rank; they
        finish when every member has joined."""
        if train_world_size != self.data_parallel_size:
            raise ValueError(
                f"`train_world_size` = {train_world_size}, but this Policy has {self.data_parallel_size} ranks"
            )
        if not isinstance(world_size, int) or world_size <= train_world_size:
            raise ValueError(
                f"`world_size` = {world_size!r} must count the {train_world_size} training ranks plus "
                "at least one inference rank"
            )
        return self._join_refit_group(
            str(ip), port, world_size, rank_offset=0, backend=None, what="init_collective", timeout_s=timeout_s
        )

    def init_collective_mcore_generation(
        self, ip: str, port: int, world_size: int, *, rank_offset: int, refit_backend: str = "gloo"
    ) -> list[Future[Any]]:
        """Join a refit group that two Policies share, for :meth:`swap_weights_via_reshard` (NeMo RL's collective
        between a training Policy and a generation-side Policy).

        The training Policy calls it with ``rank_offset=0`` (its ranks are members ``0 .. N-1``; its rank 0
        hosts the store at ``ip:port``), the generation-side one with ``rank_offset=N`` (its ranks follow);
        ``world_size`` counts both. Issue both calls before waiting on either's futures: each finishes once
        every member joined. ``refit_backend``: ``"gloo"`` (NeMo RL's default; tensors travel through host
        memory) or ``"nccl"`` (GPU ranks). The two Policies must run on different workers of the cluster
        (``Policy(..., workers=[...])``): a process is one member. A generation-side Policy joined this way also
        receives the training side's :meth:`broadcast_weights_for_collective`, with
        ``swap_weights_via_reshard(is_source=False)``. One future per rank."""
        n = self.data_parallel_size
        if refit_backend not in ("gloo", "nccl"):
            hint = " (NeMo RL's NVSHMEM copy service is Megatron's)" if refit_backend == "nvshmem" else ""
            raise ValueError(f"`refit_backend` = {refit_backend!r}: 'gloo' or 'nccl'{hint}")
        if refit_backend == "nccl" and not all(i.get("device") == "cuda" for i in self.worker_info):
            raise ValueError("`refit_backend` = 'nccl' needs GPU ranks; this Policy's ranks are on CPUs: use 'gloo'")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ValueError(f"`rank_offset` must be a non-negative int, got {rank_offset!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < rank_offset + n:
            raise ValueError(
                f"`world_size` = {world_size!r} must count this Policy's {n} ranks from `rank_offset` "
                f"{rank_offset}, and the other Policy's"
            )
        if rank_offset == 0 and world_size == n:
            raise ValueError(
                f"`world_size` = {world_size} holds only this Policy's ranks; count the receiving Policy's ranks too"
            )
        if rank_offset > 0 and rank_offset + n != world_size:
            raise ValueError(
                f"`rank_offset` = {rank_offset}: the receiving Policy's ranks are the group's last "
                f"{n} members, so rank_offset is world_size - {n} = {world_size - n}"
            )
        return self._join_refit_group(
            str(ip),
            port,
            world_size,
            rank_offset=rank_offset,
            backend=refit_backend,
            what="init_collective_mcore_generation",
        )

    def swap_weights_via_reshard(self, *, is_source: bool) -> list[Future[Any]]:
        """Move the weights between the two Policies of :meth:`init_collective_mcore_generation`'s group: the
        training Policy calls it with ``is_source=True``, the generation-side one with ``is_source=False``, both
        before waiting (``client.gather(src + dst)``). Each receiving rank gets only its own FSDP rows of every
        weight, from the sending ranks that hold them (:mod:`dask_lm.refit.swap`); what travels is what training
        keeps (fp32 masters where there are some), so the receiver's weights equal the sender's (rounded to the
        receiver's precision where it is lower). The receiver's reference weights and optimizer state are left as
        they were. The receiving side also takes a :meth:`broadcast_weights_for_collective` of the sender. One
        future per rank; each rank's result is True."""
        place = self._refit_place
        if place is None:
            raise ValueError(
                "swap_weights_via_reshard() needs init_collective_mcore_generation(...) on both Policies first"
            )
        if is_source and place["rank_offset"] != 0:
            raise ValueError(
                f"this Policy joined the refit group at rank_offset {place['rank_offset']}, as the "
                "receiving side: call swap_weights_via_reshard(is_source=False) here"
            )
        if not is_source and place["rank_offset"] == 0:
            raise ValueError(
                "this Policy joined the refit group at rank_offset 0, as the sending side: call "
                "swap_weights_via_reshard(is_source=True) here"
            )
        return self._post(
            lambda _progress_id: WeightSwapRequest(is_source=bool(is_source)),
            "swap_weights_via_reshard",
            show_progress=False,
        )

    def _join_refit_group(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        rank_offset: int,
        backend: str | None,
        what: str,
        timeout_s: float | None = None,
    ) -> list[Future[Any]]:
        """Every rank joins the refit group at ``ip:port`` as member ``rank_offset + rank``. Refused here when
        another Policy of this process joined the same group on one of these workers, or at the same members:
        one worker process cannot be two members (it would wait for itself)."""
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"`port` must be a TCP port number, got {port!r}")
        n = self.data_parallel_size
        key = (ip, port)
        mine = set(self.group.ids)
        _REFIT_GROUPS[key] = [o for o in _REFIT_GROUPS.get(key, []) if o["policy"]() is not None]
        for other in _REFIT_GROUPS[key]:
            peer = other["policy"]()
            if peer is None or peer is self or peer._refit_place is None or peer._refit_place.get("key") != key:
                continue
            shared = [name for name, i in zip(self.group.names, self.group.ids) if i in mine & set(peer.group.ids)]
            if shared:
                raise ValueError(
                    f"{what}: workers {shared} already hold a member of the refit group at {ip}:{port} "
                    "for another Policy; one process is one member, so give the two Policies different "
                    "workers: Policy(..., workers=[...]) (client.scheduler_info()['workers'] lists them)"
                )
            lo = peer._refit_place["rank_offset"]
            if lo < rank_offset + n and rank_offset < lo + peer.data_parallel_size:
                raise ValueError(
                    f"{what}: members {rank_offset}..{rank_offset + n - 1} overlap another Policy's "
                    f"{lo}..{lo + peer.data_parallel_size - 1} in the refit group at {ip}:{port}"
                )
        timeout = float(timeout_s if timeout_s is not None else self.cfg.collective_timeout_s)
        futures = self._post(
            lambda _progress_id: CollectiveInitRequest(
                ip=ip,
                port=port,
                world_size=world_size,
                train_world_size=rank_offset or n,
                timeout_s=timeout,
                rank_offset=rank_offset,
                backend=backend,
            ),
            what,
            show_progress=False,
        )
        self._refit_place = {"key": key, "rank_offset": rank_offset, "world_size": world_size}
        _REFIT_GROUPS.setdefault(key, []).append({"policy": weakref.ref(self)})
        return futures

    def broadcast_weights_for_collective(
        self, kv_scales: Any = None, *, buffer_size_bytes: int | None = None, num_buffers: int | None = None
    ) -> list[Future[Any]]:
        """Broadcast all weights from rank 0 to the inference ranks of ``init_collective``'s group, in buckets of
        ``buffer_size_bytes`` (sent ahead, so receivers need only the refit info); one future per rank."""
        if kv_scales is not None:
            raise ValueError("`kv_scales` (FP8 KV-cache scales) are not supported by this backend; pass None")
        if num_buffers is not None and num_buffers < 1:
            raise ValueError(f"`num_buffers` must be >= 1, got {num_buffers}")
        size = self._refit_buffer_size(buffer_size_bytes)
        return self._post(
            lambda progress_id: BroadcastRefitRequest(buffer_size_bytes=size, progress_id=progress_id),
            "broadcast_weights_for_collective",
        )

    def preinit_nvshmem(self) -> list[Future[Any]]:
        """NeMo RL's hook to start NVSHMEM on every rank before a Megatron reshard refit. dask-lm's refits
        (HTTP, ZMQ, collective broadcast) use no NVSHMEM, so there is nothing to start: as NeMo RL's own ranks do
        when no NVSHMEM copy service exists, this does nothing and returns one finished future per rank, whose
        result is None, so code that waits on them (``client.gather``, ``wait``) goes straight on."""
        return list(self.client.scatter([None] * self.data_parallel_size, hash=False))

    # ----------------------------------------------------------------------------------------- resharded refit
    def init_nccl_reshard_comm_group(
        self,
        pp_ips: list[str],
        pp_ports: list[int],
        pp_size: int,
        pp_stages: list[int],
        sub_world_size: int,
        ranks_in_group: list[int],
    ) -> list[Future[Any]]:
        """NeMo RL's group for a resharded refit: one per pipeline stage, holding that stage's training ranks and
        every inference rank. A dask-lm rank holds the whole model (no pipeline stages), so there is one stage
        (``pp_size`` 1, every ``pp_stages`` entry 0, ``ranks_in_group`` = 0 .. N-1) and the group is
        :meth:`init_collective`'s: rank 0 hosts its store at ``pp_ips[0]:pp_ports[0]``; inference rank ``j`` joins
        as ``N + j`` (:class:`dask_lm.refit.receiver.ReshardReceiver`). One future per rank."""
        n = self.data_parallel_size
        if pp_size != 1:
            raise ValueError(
                f"`pp_size` = {pp_size!r}: a dask-lm Policy has no pipeline stages (each rank holds "
                "the whole model); pass pp_size=1"
            )
        if list(pp_stages) != [0] * n:
            raise ValueError(f"`pp_stages` = {list(pp_stages)!r}: one stage, so one 0 per training rank ({n})")
        if list(ranks_in_group) != list(range(n)):
            raise ValueError(
                f"`ranks_in_group` = {list(ranks_in_group)!r}: training rank i is member i of the "
                f"group, so pass list(range({n}))"
            )
        if len(pp_ips) != 1 or len(pp_ports) != 1:
            raise ValueError(
                f"`pp_ips` / `pp_ports` name one address per pipeline stage: one each, got "
                f"{len(pp_ips)} / {len(pp_ports)}"
            )
        return self.init_collective(pp_ips[0], pp_ports[0], sub_world_size, train_world_size=n)

    def prepare_nccl_reshard_refit_info(
        self,
        train_parallelism: dict[str, Any],
        gen_parallelism: dict[str, Any],
        train_world_size: int,
        gen_world_size: int,
    ) -> dict[str, Any]:
        """The plan of a resharded refit (:func:`dask_lm.refit.reshard.build_plan`, plain data): for every
        weight, which box goes from which training rank's FSDP shard to which inference rank. Give it to each
        :class:`~dask_lm.refit.receiver.ReshardReceiver`; :meth:`nccl_reshard_refit` sends by it.

        ``train_parallelism``: this Policy's, data-parallel only (``{"dp": N}``; ``tp`` / ``pp`` / ``cp`` / ``ep``
        may be given as 1). ``gen_parallelism``: the inference side's ``tp`` (tensor-parallel ranks per replica,
        default ``gen_world_size``) and ``split``: ``"tensor_parallel"`` (default: Megatron's column / row cuts),
        ``"rows"`` or ``"columns"``."""
        from dask_lm.refit import reshard

        n = self.data_parallel_size
        if train_world_size != n:
            raise ValueError(f"`train_world_size` = {train_world_size!r}, but this Policy has {n} ranks")
        for key, value in dict(train_parallelism).items():
            if key not in ("dp", "tp", "pp", "cp", "ep"):
                raise ValueError(
                    f"`train_parallelism.{key}`: unknown key; a dask-lm Policy has dp, and tp / pp / cp / ep of 1"
                )
            if value != (n if key == "dp" else 1):
                raise ValueError(
                    f"`train_parallelism.{key}` = {value!r}: this Policy's ranks are {n} data-parallel "
                    f"FSDP ranks, so dp is {n} and every other size is 1"
                )
        gen = dict(gen_parallelism)
        unknown = sorted(set(gen) - {"tp", "pp", "ep", "dp", "split"})
        if unknown:
            raise ValueError(f"`gen_parallelism.{unknown[0]}`: unknown key; give tp, split (and pp / ep of 1)")
        for key in ("pp", "ep"):
            if gen.get(key, 1) != 1:
                raise ValueError(
                    f"`gen_parallelism.{key}` = {gen[key]!r}: only tensor-parallel inference ranks "
                    "are planned for; pass 1"
                )
        if not isinstance(gen_world_size, int) or isinstance(gen_world_size, bool) or gen_world_size < 1:
            raise ValueError(f"`gen_world_size` must be a positive integer, got {gen_world_size!r}")
        tp = gen.get("tp", gen_world_size)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or gen_world_size % tp:
            raise ValueError(f"`gen_parallelism.tp` = {tp!r} must divide `gen_world_size` = {gen_world_size}")
        split = gen.get("split", "tensor_parallel")
        if split not in reshard.SPLITS:
            raise ValueError(f"`gen_parallelism.split` = {split!r}: one of {list(reshard.SPLITS)}")
        plan = reshard.build_plan(
            self.prepare_refit_info(), train_world_size=n, gen_world_size=gen_world_size, split=split, gen_tp=tp
        )
        self._reshard_plan = plan
        return plan

    def nccl_reshard_refit(self, kv_scales: Any = None) -> list[Future[Any]]:
        """Send every weight by the plan of :meth:`prepare_nccl_reshard_refit_info` over the group of
        :meth:`init_nccl_reshard_comm_group`: each training rank sends the boxes of its own shards, each inference
        rank receives only its slices (NCCL on GPUs, gloo on CPU). One future per rank."""
        if kv_scales is not None:
            raise ValueError("`kv_scales` (FP8 KV-cache scales) are not supported by this backend; pass None")
        plan = getattr(self, "_reshard_plan", None)
        if plan is None:
            raise ValueError("nccl_reshard_refit() needs a plan: call prepare_nccl_reshard_refit_info(...) first")
        return self._post(
            lambda progress_id: ReshardRefitRequest(plan, progress_id=progress_id),
            "nccl_reshard_refit",
            show_progress=False,
        )
