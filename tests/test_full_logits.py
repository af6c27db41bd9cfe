"""Policy.get_full_logits_ipc / release_ipc_buffer / preinit_nvshmem, and the consumer's helper.

The CPU ranks share their buffers through /dev/shm, the path a GPU rank takes with CUDA IPC (tests/test_gpu.py);
this test process is the consumer, another process than the ranks'. The reference is a single-process Hugging Face
forward in float32."""

from __future__ import annotations

import os
import pickle
import types

import msgpack
import pytest
import torch
import transformers
from helpers import TEXTS, WritesMarker, hf_logprobs, make_batch

import dask_lm
from dask_lm import BatchedDataDict
from dask_lm.model import device
from dask_lm.model.shared_buffer import SHM_DIR, SharedBuffer, open_payload
from dask_lm.teacher_logits import open_full_logits, open_full_logits_batch

needs_shm = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="POSIX shared memory (/dev/shm) is Linux's")


# ----------------------------------------------------------------------------------------- the buffer, no cluster
@needs_shm
def test_a_shared_buffer_is_seen_by_its_payload_and_removed_when_closed():
    buf = SharedBuffer((2, 3, 4, 5), torch.float32, torch.device("cpu"))
    assert torch.all(buf.tensor == 0)
    buf.tensor.copy_(torch.arange(120, dtype=torch.float32).view(2, 3, 4, 5))
    payload = msgpack.unpackb(msgpack.packb(buf.payload), raw=False)  # plain data: it survives msgpack
    seen = open_payload(payload)
    assert seen.shape == (2, 3, 4, 5) and seen.dtype == torch.float32
    torch.testing.assert_close(seen, buf.tensor, rtol=0, atol=0)
    buf.tensor[1, 2, 3, 4] = -7.0  # one memory: a later write is seen through the mapping
    assert seen[1, 2, 3, 4] == -7.0
    path = os.path.join(SHM_DIR, buf.payload["name"])
    assert os.path.exists(path) and oct(os.stat(path).st_mode & 0o777) == "0o600"
    buf.close()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="is gone"):
        open_payload(payload)


@needs_shm
def test_a_buffer_never_closed_is_removed_when_collected():
    buf = SharedBuffer((1, 1, 2, 2), torch.float32, torch.device("cpu"))
    path = os.path.join(SHM_DIR, buf.payload["name"])
    del buf
    import gc

    gc.collect()
    assert not os.path.exists(path)


def _payload(**change):
    base = {
        "v": 1,
        "kind": "shm",
        "name": "dask_lm_1_0123456789abcdef",
        "shape": [1, 1, 2, 2],
        "dtype": "float32",
        "nbytes": 16,
    }
    return {**base, **change}


@pytest.mark.parametrize(
    "payload,match",
    [
        (_payload(name="../../etc/passwd"), "not one dask-lm makes"),
        (_payload(name="dask_lm_1_0123456789abcdef/../x"), "not one dask-lm makes"),
        (_payload(kind="pickle"), "kind must be"),
        (_payload(v=2), "not a dask-lm shared-buffer payload"),
        (_payload(extra=1), "has keys"),
        (_payload(dtype="__class__"), "must be one of"),
        (_payload(shape=[1, "2"]), "list of 1 to 8"),
        (_payload(nbytes=1 << 40), "not shape x itemsize"),
        (_payload(nbytes=True), "not shape x itemsize"),
        ({"v": 1, "kind": "cuda", "cuda": {"device": "GPU-0", "tensor_cls": "os.system"}}, "has keys"),
        ({"v": 1, "kind": "cuda", "cuda": "x"}, "must be a dict"),
        ("a string", "not a dask-lm shared-buffer payload"),
    ],
)
def test_a_forged_payload_is_refused(payload, match):
    with pytest.raises(ValueError, match=match):
        open_payload(payload)


def test_a_pickled_payload_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    hostile = pickle.dumps(WritesMarker(marker))
    for forged in (
        hostile,
        {
            "teacher_shards": [
                {
                    "payload_ipc": hostile,
                    "buf_idx": 0,
                    "sample_index_in_buf": 0,
                    "actual_shape": (1, 1),
                    "storage_shape": (1, 1, 1, 1),
                }
            ]
        },
    ):
        with pytest.raises(ValueError):
            open_full_logits(forged)
    assert not marker.exists()


@needs_shm
def test_a_shard_pointing_outside_its_buffer_is_refused():
    buf = SharedBuffer((1, 2, 3, 4), torch.float32, torch.device("cpu"))
    try:
        shard = {
            "payload_ipc": buf.payload,
            "buf_idx": 0,
            "sample_index_in_buf": 2,
            "actual_shape": (3, 4),
            "storage_shape": (1, 2, 3, 4),
        }
        with pytest.raises(ValueError, match="outside its buffer"):
            open_full_logits(shard)
        with pytest.raises(ValueError, match="was grown or released"):
            open_full_logits({**shard, "sample_index_in_buf": 0, "storage_shape": (2, 2, 3, 4)})
        assert open_full_logits({**shard, "sample_index_in_buf": 1}).shape == (3, 4)
    finally:
        buf.close()


# ----------------------------------------------------------------------------------------- the memory check
class _NoForward:
    """A rank model whose forward must not run: the memory check comes first."""

    def __init__(self, vocab):
        self.cfg = types.SimpleNamespace(logprob_batch_size=2, logprob_chunk_size=None)
        head = torch.nn.Linear(4, vocab, bias=False)
        self.model = types.SimpleNamespace(get_output_embeddings=lambda: head)
        self.rank, self.group, self.cpu_group, self.device = 0, None, None, torch.device("cpu")
        self.forwards = 0

    def plan_pass(self, rows, plan, mbs):
        from dask_lm.model.forward import plan_micro_batches

        return plan_micro_batches(rows.size, mbs=mbs, micro_batch_indices=None, packed=False)

    def inference_forward(self, rows, mb):
        self.forwards += 1
        raise AssertionError("the forward ran before the memory check")

    def end_pass(self):
        pass


def test_a_request_too_big_for_the_device_is_refused_before_any_forward(monkeypatch):
    from dask_lm.data.tokens import TokenRows
    from dask_lm.workers.full_logits import FullLogitsExport

    rm = _NoForward(vocab=10_000)
    export = FullLogitsExport(rm)  # type: ignore[arg-type]
    rows = TokenRows.from_lists([[1, 2, 3], [4, 5], [6]], width=64)
    monkeypatch.setattr(device, "shareable_free_bytes", lambda: 1 << 20)  # 1 MiB; the call needs 2 x 2 x 64 x 10k x 4 B
    with pytest.raises(
        ValueError,
        match=r"rank 0 needs 0\.01 GiB .*\[2 micro-batches, 2 rows, 64 positions, 10000 "
        r"vocabulary\].*release_ipc_buffer",
    ):
        export.export(rows, None)
    assert rm.forwards == 0 and export.buffer is None


# ----------------------------------------------------------------------------------------- on a cluster
@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


def _cfg(model_dir, **extra):
    return {
        "model_name": model_dir,
        "precision": "float32",
        "logprob_batch_size": 2,
        "logprob_chunk_size": 5,
        "max_total_sequence_length": 128,
        **extra,
    }


def _shm_files(entries):
    return {os.path.join(SHM_DIR, e["teacher_shards"][0]["payload_ipc"]["name"]) for e in entries}


@needs_shm
@pytest.mark.cluster
@pytest.mark.parametrize("n_ranks", [1, 2])
def test_full_logits_match_hf_in_another_process(client, tiny, tok, n_ranks):
    ids, lens = make_batch(tok, TEXTS)
    _, logits = hf_logprobs(tiny["llama"], ids, lens, temperature=0.7)
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    cfg = _cfg(tiny["llama"], generation={"temperature": 0.7})
    with dask_lm.Policy(client, cfg, tok, workers_per_node=None if n_ranks == 2 else 1) as policy:
        entries = policy.get_full_logits_ipc(batch, micro_batch_size=2)
        assert len(entries) == len(TEXTS) and all(len(e["teacher_shards"]) == 1 for e in entries)
        shard = entries[0]["teacher_shards"][0]
        assert shard["actual_shape"] == (ids.shape[1], logits.shape[-1]) and shard["dtype"] == "float32"
        assert shard["full_vocab_size"] == logits.shape[-1] and not shard["vocab_sharded"]
        # rows in input order, rank by rank
        assert [e["teacher_shards"][0]["world_rank"] for e in entries] == sorted(
            e["teacher_shards"][0]["world_rank"] for e in entries
        )
        assert len(_shm_files(entries)) == n_ranks
        valid = torch.arange(ids.shape[1])[None, :] < lens[:, None]
        for i, entry in enumerate(entries):
            got = open_full_logits(entry)
            torch.testing.assert_close(got[valid[i]], logits[i][valid[i]], atol=1e-4, rtol=0)
            assert torch.all(got[~valid[i]] == 0)
        stacked = open_full_logits_batch(entries)
        torch.testing.assert_close(stacked[valid], logits[valid], atol=1e-4, rtol=0)

        # the buffer is reused: the same files and payloads, the values of the new call (rows reversed)
        flipped = BatchedDataDict(input_ids=ids.flip(0), input_lengths=lens.flip(0))
        again = policy.get_full_logits_ipc(flipped, micro_batch_size=2)
        assert _shm_files(again) == _shm_files(entries)
        assert again[0]["teacher_shards"][0]["payload_ipc"] == entries[0]["teacher_shards"][0]["payload_ipc"]
        torch.testing.assert_close(open_full_logits(again[0])[: lens[-1]], logits[-1][: lens[-1]], atol=1e-4, rtol=0)
        assert torch.all(open_full_logits(again[0])[lens[-1] :] == 0)  # the earlier, longer row's values are gone

        # a call needing more grows it: a new buffer, the old one removed
        wider = BatchedDataDict(input_ids=torch.cat([ids, ids]), input_lengths=torch.cat([lens, lens]))
        grown = policy.get_full_logits_ipc(wider, micro_batch_size=2)
        assert not (_shm_files(grown) & _shm_files(entries))
        assert not any(os.path.exists(p) for p in _shm_files(entries))
        torch.testing.assert_close(
            open_full_logits_batch(grown)[torch.cat([valid, valid])],
            torch.cat([logits, logits])[torch.cat([valid, valid])],
            atol=1e-4,
            rtol=0,
        )

        policy.release_ipc_buffer()
        assert not any(os.path.exists(p) for p in _shm_files(grown))
        with pytest.raises(ValueError, match="is gone"):
            open_full_logits(grown[0])


@pytest.mark.cluster
def test_preinit_nvshmem_is_a_no_op_with_finished_futures(client, tiny, tok):
    from distributed import wait

    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        futures = policy.preinit_nvshmem()
        assert len(futures) == policy.data_parallel_size
        assert all(f.done() for f in futures) and client.gather(futures) == [None] * len(futures)
        wait(futures)
        ids, lens = make_batch(tok, TEXTS[:2])
        policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))  # the Policy goes on as before


@pytest.mark.cluster
def test_a_bad_micro_batch_size_is_refused_on_the_driver(client, tiny, tok):
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, workers_per_node=1) as policy:
        ids, lens = make_batch(tok, TEXTS[:2])
        with pytest.raises(ValueError, match="`micro_batch_size` must be a positive integer"):
            policy.get_full_logits_ipc(BatchedDataDict(input_ids=ids, input_lengths=lens), micro_batch_size=0)
