"""Weight refit by ZMQ and by a collective broadcast: what a receiver process gets is bit-identical to the weights
the policy writes with save_checkpoint (read back from disk), after a training step. Whatever reaches a rank's socket
is never unpickled, the socket is private to the worker's user, and the rendezvous store listens on one address."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import transformers
from helpers import TEXTS, WritesMarker, sft_batch
from safetensors.torch import load_file

import dask_lm
from dask_lm.refit import buckets as bk

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")


def _cfg(model_dir):
    return {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 128,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
    }


def _saved_weights(path):
    import glob

    out = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def trained(client, tiny, tmp_path_factory):
    """A 2-rank policy after one AdamW step, and its weights as written to disk."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    policy = dask_lm.Policy(client, _cfg(tiny["llama"]), tok)
    policy.train(sft_batch(tok, TEXTS[:4]), dask_lm.NLLLoss())
    path = tmp_path_factory.mktemp("refit") / "weights"
    policy.save_checkpoint(str(path))
    yield policy, _saved_weights(path)
    policy.shutdown()


def _spawn(target, *args):
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _check_identical(got, saved):
    assert sorted(got) == sorted(saved)
    for name, t in saved.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), f"{name} differs"


@pytest.mark.cluster
def test_refit_info_names_shapes_dtypes(trained, tiny):
    policy, _saved = trained
    info = policy.prepare_refit_info()
    # an independent reference: the names, order and full shapes of the model as Hugging Face loads it
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).state_dict()
    assert list(info) == list(hf)
    for name, (shape, dtype) in info.items():
        assert tuple(shape) == tuple(hf[name].shape) and dtype == torch.float32


@pytest.mark.cluster
def test_zmq_stream_is_bit_identical(trained, tmp_path):
    import refit_peers

    policy, saved = trained
    info = policy.prepare_refit_info()
    addresses = policy.get_zmq_addresses()
    assert len(set(addresses)) == 2
    outs = [tmp_path / f"zmq{r}.pt" for r in range(2)]
    procs = [_spawn(refit_peers.zmq_peer, a, info, str(o)) for a, o in zip(addresses, outs)]
    # 64 KiB: ping-pong halves of 32 KiB, several messages, and the 96 KiB embedding alone in a one-off buffer
    stats = policy.client.gather(policy.stream_weights_via_ipc_zmq(buffer_size_bytes=64 * 1024))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for o, s in zip(outs, stats):
        res = torch.load(o)
        _check_identical(res["weights"], saved)
        assert res["stats"]["messages"] == s["messages"] > 3
        assert ["model.embed_tokens.weight"] in res["messages"]
    # the driver's progress bar followed rank 0's bytes up to the whole model
    total = sum(t.numel() * t.element_size() for t in saved.values())
    deadline = time.time() + 30
    while time.time() < deadline and policy.client.get_events("dask-lm-progress")[-1][1]["done"] != total:
        time.sleep(0.2)
    assert policy.client.get_events("dask-lm-progress")[-1][1]["done"] == total


@pytest.mark.cluster
def test_zmq_without_receiver_times_out(trained):
    policy, _ = trained
    with pytest.raises(TimeoutError, match="inference worker on"):
        policy.client.gather(policy.stream_weights_via_ipc_zmq(buffer_size_bytes=1 << 20, timeout_s=1.0))


def _run_in_thread(fn, *args):
    import threading

    out = []

    def run():
        try:
            out.append(fn(*args))
        except Exception as e:  # the test reads it back
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _pickle_answering_peer(address, answer):
    """A peer on the policy rank's socket that answers the first message with ``answer`` (raw bytes)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(address)
    try:
        sock.recv_multipart()
        sock.send(answer)
    finally:
        sock.close(linger=0)


@pytest.mark.cluster
def test_a_pickled_answer_on_the_policy_socket_is_never_read(trained, tmp_path):
    """Whatever answers on a rank's socket with a pickle (one that would create a file when unpickled): the stream
    fails with an error naming the socket, and no file appears (the worker never deserialised it)."""
    import pickle

    policy, _ = trained
    marker = tmp_path / "pwned"
    addresses = policy.get_zmq_addresses()
    peers = [_run_in_thread(_pickle_answering_peer, a, pickle.dumps(WritesMarker(marker))) for a in addresses]
    with pytest.raises(
        Exception, match="answered refit message 1 with something other than a dask-lm refit reply"
    ) as err:
        policy.client.gather(policy.stream_weights_via_ipc_zmq(buffer_size_bytes=64 * 1024, timeout_s=30))
    assert any(a in str(err.value) for a in addresses)
    for t, _ in peers:
        t.join(60)
    assert not marker.exists()


@pytest.mark.cluster
def test_zmq_socket_is_private_to_the_user_and_removed_at_shutdown(client, tiny):
    """The rank's socket sits in a directory of its own (0700) and is itself 0600 while weights stream; shutdown
    removes both."""
    import stat

    from dask_lm.refit.receiver import receive_via_zmq

    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    seen = []
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, workers_per_node=1, init_optimizer=False) as policy:
        [address] = policy.get_zmq_addresses()
        path = address.removeprefix("ipc://")
        directory = os.path.dirname(path)

        def on_weights(_named):
            d, f = os.stat(directory), os.stat(path)
            seen.append((stat.S_IMODE(d.st_mode), d.st_uid, stat.S_ISSOCK(f.st_mode), stat.S_IMODE(f.st_mode)))

        info = policy.prepare_refit_info()
        t, out = _run_in_thread(lambda: receive_via_zmq(address, info, on_weights, timeout_s=60))
        policy.client.gather(policy.stream_weights_via_ipc_zmq(buffer_size_bytes=1 << 20, timeout_s=60))
        t.join(60)
        assert out and not isinstance(out[0], Exception), out
        assert out[0]["messages"] == len(seen) > 0
        assert set(seen) == {(0o700, os.getuid(), True, 0o600)}
    assert not os.path.exists(path) and not os.path.exists(directory)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cluster
def test_collective_broadcast_is_bit_identical(trained, tmp_path):
    import refit_peers

    policy, saved = trained
    info = policy.prepare_refit_info()
    port = _free_port()
    outs = [tmp_path / "peer2.pt", tmp_path / "peer3.pt"]
    procs = [_spawn(refit_peers.collective_peer, "127.0.0.1", port, 4, 2 + i, info, str(outs[i]), 2) for i in range(2)]
    policy.client.gather(policy.init_collective("127.0.0.1", port, 4, train_world_size=2))
    first = policy.client.gather(policy.broadcast_weights_for_collective(buffer_size_bytes=48 * 1024))
    assert first[0]["buckets"] > 3
    # a second call with another buffer size: the receivers learn it from the header
    policy.client.gather(policy.broadcast_weights_for_collective(buffer_size_bytes=1 << 20))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for o in outs:
        results = torch.load(o)
        assert len(results) == 2
        for res in results:
            _check_identical(res["weights"], saved)
        assert len(results[0]["messages"]) == first[0]["buckets"] and len(results[1]["messages"]) == 1


@pytest.mark.cluster
def test_collective_store_listens_only_on_the_given_address(trained, tmp_path):
    """Rank 0's rendezvous store accepts connections on the ``ip`` it was given, not on every interface."""
    import psutil
    import refit_peers

    policy, _ = trained
    port = _free_port()
    proc = _spawn(
        refit_peers.collective_peer, "127.0.0.1", port, 3, 2, policy.prepare_refit_info(), str(tmp_path / "peer.pt"), 0
    )
    policy.client.gather(policy.init_collective("127.0.0.1", port, 3, train_world_size=2))
    listening = {
        c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    # and every other listener of the ranks (Dask's, the gloo pairs of the policy's and the refit's groups)
    ranks = {
        c.laddr.ip
        for pid in policy.client.run(os.getpid).values()
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    proc.join(60)
    assert listening == {"127.0.0.1"}
    assert ranks == {"127.0.0.1"}, ranks


def test_collective_store_port_in_use_is_a_clear_error():
    from dask_lm.comm.rendezvous import listen_fd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(ValueError, match=r"cannot listen on 127\.0\.0\.1:\d+ \(Address already in use\)"):
            listen_fd("127.0.0.1", taken.getsockname()[1], what="init_collective")


@pytest.mark.cluster
def test_collective_receiver_with_other_refit_info_fails_loudly(trained, tmp_path):
    import refit_peers

    policy, _ = trained
    info = dict(policy.prepare_refit_info())
    name = next(iter(info))
    info[name] = (info[name][0], torch.bfloat16)  # a receiver that expects another dtype
    port = _free_port()
    proc = _spawn(refit_peers.collective_peer, "127.0.0.1", port, 3, 2, info, str(tmp_path / "bad.pt"))
    policy.client.gather(policy.init_collective("127.0.0.1", port, 3, train_world_size=2))
    with pytest.raises(Exception, match="planned different refit buckets"):
        policy.client.gather(policy.broadcast_weights_for_collective(buffer_size_bytes=1 << 20))
    proc.join(60)
    assert "does not match the policy's" in torch.load(tmp_path / "bad.pt")[0]["error"]


def test_plan_aligns_every_tensor_and_isolates_oversized_ones():
    info = {
        "a": ((3,), torch.bfloat16),
        "b": ((5,), torch.float32),
        "big": ((4096,), torch.float32),
        "c": ((7,), torch.int64),
    }
    plan = bk.plan_buckets(info, 2048)
    assert [[s.name for s in b] for b in plan] == [["a", "b"], ["big"], ["c"]]
    for b in plan:
        for s in b:
            shape, dtype = info[s.name]
            assert s.start % bk.ALIGN == 0 and s.nbytes == torch.Size(shape).numel() * dtype.itemsize
    flat = torch.zeros(bk.bucket_nbytes(plan[0]), dtype=torch.uint8)
    values = {"a": torch.tensor([1.5, -2, 3], dtype=torch.bfloat16), "b": torch.arange(5, dtype=torch.float32)}
    for s in plan[0]:
        bk.write_slot(flat, s, values[s.name])
    for name, t in bk.unpack(flat, plan[0]):
        assert torch.equal(t, values[name])
    with pytest.raises(ValueError, match="positive"):
        bk.plan_buckets(info, 0)


# ----------------------------------------------------------------------------------------- resharded refit
def test_reshard_plan_covers_every_slice_exactly_once():
    """Every inference rank's slice is tiled by the training ranks' boxes, without overlap, for uneven shapes and
    rank counts (the plan is built from shapes only: an independent tiling check, cell by cell)."""
    from dask_lm.refit import reshard

    info = {
        "model.embed_tokens.weight": ((7, 5), torch.float32),
        "model.layers.0.mlp.down_proj.weight": ((5, 9), torch.float32),
        "model.layers.0.self_attn.q_proj.bias": ((5,), torch.float32),
        "model.norm.weight": ((3,), torch.float32),
    }
    for n, m, tp, split in [
        (1, 1, 1, "rows"),
        (2, 2, 2, "tensor_parallel"),
        (3, 2, 2, "columns"),
        (4, 3, 3, "rows"),
        (2, 4, 2, "tensor_parallel"),
    ]:
        plan = reshard.build_plan(info, train_world_size=n, gen_world_size=m, split=split, gen_tp=tp)
        for p in plan["params"]:
            shape = p["shape"]
            for j in range(m):
                want = torch.zeros(shape, dtype=torch.int32)
                want[tuple(slice(s, e) for s, e in p["dst"][j])] = 1
                cover = torch.zeros(shape, dtype=torch.int32)
                for src, dst, box in p["transfers"]:
                    if dst == j:
                        rows = reshard.chunk(shape[0], n)[src]
                        assert rows[0] <= box[0][0] and box[0][1] <= rows[1], "a box outside its source's rows"
                        cover[tuple(slice(s, e) for s, e in box)] += 1
                assert torch.equal(cover, want), (p["name"], n, m, split)
    plan = reshard.build_plan(info, train_world_size=2, gen_world_size=2, split="tensor_parallel")
    dims = {p["name"]: p["split_dim"] for p in plan["params"]}
    assert dims == {
        "model.embed_tokens.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
        "model.layers.0.self_attn.q_proj.bias": 0,
        "model.norm.weight": None,
    }


@pytest.mark.cluster
@pytest.mark.parametrize(
    "gen_world_size,tp,split", [(1, 1, "rows"), (2, 2, "rows"), (2, 2, "columns"), (2, 2, "tensor_parallel")]
)
def test_reshard_refit_gives_each_receiver_exactly_its_slice(trained, tmp_path, gen_world_size, tp, split):
    """A 2-rank FSDP policy sends its shards' boxes to 1 or 2 receiver processes (gloo); each receiver's slices
    equal the saved weights cut the receiver's way (torch.chunk along the split dimension)."""
    import refit_peers

    policy, saved = trained
    n = policy.data_parallel_size
    world = n + gen_world_size
    plan = policy.prepare_nccl_reshard_refit_info({"dp": n}, {"tp": tp, "split": split}, n, gen_world_size)
    port = _free_port()
    outs = [tmp_path / f"gen{j}.pt" for j in range(gen_world_size)]
    procs = [
        _spawn(refit_peers.reshard_peer, "127.0.0.1", port, world, n + j, plan, str(outs[j]))
        for j in range(gen_world_size)
    ]
    policy.client.gather(policy.init_nccl_reshard_comm_group(["127.0.0.1"], [port], 1, [0] * n, world, list(range(n))))
    stats = policy.client.gather(policy.nccl_reshard_refit())
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    split_dims = {p["name"]: p["split_dim"] for p in plan["params"]}
    sent = sum(s["bytes"] for s in stats)
    received = 0
    for j, out in enumerate(outs):
        res = torch.load(out)
        assert "error" not in res, res.get("error")
        assert sorted(res["weights"]) == sorted(saved)
        for name, full in saved.items():
            dim = split_dims[name]
            want = full if dim is None else full.chunk(tp, dim)[j % tp]
            assert torch.equal(res["weights"][name], want), (name, j)
        received += res["stats"]["bytes"]
    assert sent == received  # each slice crossed the wire once
    if split == "rows" and gen_world_size == n:
        # the same cut on both sides: every training rank sends only to its own counterpart
        assert all(s["messages"] == len(saved) for s in stats)


@pytest.mark.cluster
def test_reshard_refit_is_refused_without_a_plan_and_with_bad_parallelism(trained):
    policy, _ = trained
    n = policy.data_parallel_size
    with pytest.raises(ValueError, match=r"train_parallelism.tp` = 2"):
        policy.prepare_nccl_reshard_refit_info({"dp": n, "tp": 2}, {"tp": 1}, n, 1)
    with pytest.raises(ValueError, match=r"gen_parallelism.split` = 'diagonal'"):
        policy.prepare_nccl_reshard_refit_info({"dp": n}, {"split": "diagonal"}, n, 1)
    with pytest.raises(ValueError, match=r"gen_parallelism.tp` = 3 must divide"):
        policy.prepare_nccl_reshard_refit_info({"dp": n}, {"tp": 3}, n, 2)
    with pytest.raises(ValueError, match="no pipeline stages"):
        policy.init_nccl_reshard_comm_group(["127.0.0.1"] * 2, [1, 2], 2, [0] * n, n + 1, list(range(n)))
    with pytest.raises(ValueError, match="kv_scales"):
        policy.nccl_reshard_refit(kv_scales={"k": 1.0})
