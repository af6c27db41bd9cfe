"""The rank half of ``Policy.get_full_logits_ipc``: a teacher's full-vocabulary logits, left in a buffer that a
consumer on the same machine maps without a copy (cross-tokenizer distillation reads every logit, so neither
top-k nor logprobs will do).

NeMo RL's layout, so its consumers' indexing holds: one persistent float32 buffer per rank of shape
``[N_mb, B_mb, S, V]`` (micro-batches x rows per micro-batch x the batch's padded width x the output vocabulary),
grown when a call needs more and otherwise reused (a distillation loop calls it every step; freeing and
re-allocating gigabytes each time fragments the allocator), freed by ``release_ipc_buffer``. Row ``t`` of a sample
holds the logits the model outputs at position ``t`` (they predict token ``t + 1``), divided by the generation
temperature as every other head here is; positions at and past the row's length hold 0.

What differs from NeMo RL's v0, and why: the rows of a micro-batch run through the same forward as every other
pass here (packed varlen attention or not, compiled or not), and only the real tokens' logits are computed, in
chunks of ``logprob_chunk_size`` positions, so no ``[B_mb, S, V]`` temporary besides the buffer itself exists.
The packing and dynamic-batching settings do not apply (NeMo raises on them): this call always cuts a rank's rows
into micro-batches of ``micro_batch_size`` (default ``logprob_batch_size``) in order.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import torch

from dask_lm.comm import collectives
from dask_lm.data.messages import MicroBatchPlan
from dask_lm.data.tokens import TokenRows
from dask_lm.model import device
from dask_lm.model.hf import find_output_embeddings
from dask_lm.model.logprobs import chunk_bounds, output_head
from dask_lm.model.shared_buffer import SharedBuffer, reclaim_stale
from dask_lm.workers.rank_model import RankModel
from dask_lm.workers.state import record_call

__all__ = ["FullLogitsExport"]

_GIB = float(1 << 30)


def _count(shape: tuple[int, ...]) -> int:
    return math.prod(shape, start=1)


class FullLogitsExport:
    """One rank's full-logits buffer and the pass that fills it."""

    def __init__(self, rank_model: RankModel) -> None:
        self.rank_model = rank_model
        self.buffer: SharedBuffer | None = None

    @torch.no_grad()
    def export(self, rows: TokenRows, micro_batch_size: int | None) -> dict[str, Any]:
        """Fill the buffer with the logits of ``rows`` (this rank's contiguous slice of the batch): NeMo RL's
        ``{"dp_rank": rank, "per_sample_handles": [one entry per row, in order]}``."""
        rm = self.rank_model
        mbs = micro_batch_size or int(rm.cfg.logprob_batch_size or 1)
        plan = rm.plan_pass(rows, MicroBatchPlan(), mbs)  # rows in order, mbs each; dummies keep FSDP in step
        real = [mb for mb in plan if not mb.dummy]
        head_module = find_output_embeddings(rm.model)
        assert head_module is not None, "the driver checks the model has an output projection"
        weight: Any = head_module.weight
        vocab = int(weight.shape[0])  # a DTensor's shape is the global one
        width = rows.width
        rows_per_mb = max((mb.end - mb.start for mb in real), default=0)
        shape = (len(real), rows_per_mb, width, vocab)
        self._reserve(shape)
        start = time.perf_counter()
        try:
            for buf_idx, mb in enumerate(plan):
                hidden, layout = rm.inference_forward(rows, mb)
                if mb.dummy or layout is None:
                    continue
                assert self.buffer is not None
                slot = self.buffer.tensor[buf_idx]
                slot[: mb.end - mb.start].zero_()  # an earlier call's values, and every padding position
                r, c = layout.valid_index
                picked = hidden[r, c]
                head = output_head(rm.model)  # read now: under FSDP the head is gathered during the forward
                for s, e in chunk_bounds(picked.shape[0], rm.cfg.logprob_chunk_size):
                    logits = head(picked[s:e])
                    if rm.temperature != 1.0:
                        logits = logits / rm.temperature
                    slot[r[s:e], c[s:e]] = logits.float()
        finally:
            rm.end_pass()
        # the writes are asynchronous on the device: done before a consumer can map the buffer and read it
        device.synchronize()
        record_call(rows.num_tokens, start)
        return {"dp_rank": rm.rank, "per_sample_handles": self._entries(real, width, vocab)}

    def _reserve(self, shape: tuple[int, ...]) -> None:
        """Make the buffer hold ``shape`` (grown, never shrunk), after checking on every rank that the memory is
        there: no rank starts its forward unless every rank can keep its logits (an FSDP forward on some ranks
        only would wait forever for the others)."""
        rm = self.rank_model
        fits = self.buffer is not None and self.buffer.fits(shape, torch.float32)
        # a buffer too small for this call grows to hold both (the next call of the earlier size reuses it)
        target = shape if self.buffer is None else tuple(max(a, b) for a, b in zip(shape, self.buffer.shape))
        message = None
        if not fits and _count(shape):
            need = _count(target) * 4
            # the grown buffer replaces the old one, so the old one's bytes count as free
            free = device.shareable_free_bytes() + (self.buffer.nbytes if self.buffer is not None else 0)
            if need > free:
                n, b, s, v = target
                where = "device memory" if device.ipc_kind() == "cuda" else "shared memory (/dev/shm, host RAM)"
                message = (
                    f"get_full_logits_ipc: rank {rm.rank} needs {need / _GIB:.2f} GiB for its logits buffer "
                    f"(float32 [{n} micro-batches, {b} rows, {s} positions, {v} vocabulary]) but has "
                    f"{free / _GIB:.2f} GiB of {where} free; pass fewer rows per call, a batch padded to a "
                    "shorter width, or a smaller micro_batch_size, or call release_ipc_buffer() first if "
                    "another Policy holds a buffer on these workers"
                )
        # the host-side (gloo) group: the message is a Python object; without FSDP no rank waits on another
        message = collectives.first_message(message, rm.cpu_group if rm.group is not None else None)
        if message is not None:
            raise ValueError(message)
        if fits or not _count(shape):
            return
        self.release()
        self.buffer = SharedBuffer(target, torch.float32, rm.device)

    def _entries(self, real: list[Any], width: int, vocab: int) -> list[dict[str, Any]]:
        """One entry per row, NeMo RL's keys: where the row sits in the buffer and, for NeMo's consumers that
        route tensor- and context-parallel shards, a single shard covering the whole sequence and vocabulary."""
        if not real:
            return []
        assert self.buffer is not None
        rank = self.rank_model.rank
        common = {
            "payload_ipc": self.buffer.payload,
            "storage_shape": self.buffer.shape,
            "actual_shape": (width, vocab),
            "dtype": "float32",
            "tp_rank": 0,
            "cp_rank": 0,
            "tp_size": 1,
            "cp_size": 1,
            "world_rank": rank,
            "vocab_start_index": 0,
            "vocab_end_index": vocab,
            "global_seq_start": 0,
            "full_vocab_size": vocab,
            "full_seq_len": width,
            "vocab_sharded": False,
            "sequence_sharded": False,
        }
        return [
            {**common, "buf_idx": buf_idx, "sample_index_in_buf": i}
            for buf_idx, mb in enumerate(real)
            for i in range(mb.end - mb.start)
        ]

    def release(self) -> bool:
        """Free the buffer (a consumer's mapping of a CUDA buffer keeps its memory until the consumer lets go), and
        the ``/dev/shm`` files that dead processes of this user left on this machine (a worker killed while
        holding one: :func:`~dask_lm.model.shared_buffer.reclaim_stale`)."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
            gc.collect()
            device.empty_cache()
            device.ipc_collect()
        reclaim_stale()
        return True
