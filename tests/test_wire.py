"""The ZMQ refit wire format (dask_lm.refit.wire) and the receiver that reads it: data only in both directions.
Nothing a peer sends is unpickled; a hostile or mismatched message is refused with a ValueError naming what is
wrong, and the CUDA IPC handle travels as plain data that round-trips to the arguments torch's rebuild takes."""

from __future__ import annotations

import inspect
import os
import pickle
import threading

import msgpack
import pytest
import torch
import zmq
from helpers import WritesMarker
from torch.multiprocessing import reductions

from dask_lm.model import cuda_ipc
from dask_lm.refit import wire
from dask_lm.refit.receiver import receive_via_zmq

FAKE_UUID = "GPU-12345678-1234-1234-1234-123456789abc"


def _torch_cuda_args(index=2):
    """What torch's reduce_tensor gives rebuild_cuda_tensor for a 4096-byte uint8 CUDA buffer (15 arguments)."""
    return (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        index,
        b"\x01" * 64,
        4096,
        1024,
        False,
        b"/torch_123_456_7",
        3,
        b"\x02" * 64,
        True,
    )


def test_cuda_handle_round_trips_through_the_header_as_plain_data():
    # the argument order assumed by cuda_handle / cuda_rebuild_args is the installed torch's
    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters) == [
        "tensor_cls",
        "tensor_size",
        "tensor_stride",
        "tensor_offset",
        "storage_cls",
        "dtype",
        "storage_device",
        "storage_handle",
        "storage_size_bytes",
        "storage_offset_bytes",
        "requires_grad",
        "ref_counter_handle",
        "ref_counter_offset",
        "event_handle",
        "event_sync_required",
    ]
    args = _torch_cuda_args()
    frame = wire.encode_weights(["w"], 16, transport="ipc", ipc=cuda_ipc.cuda_handle(args, FAKE_UUID))
    raw = msgpack.unpackb(frame)  # any msgpack reader sees plain values: no class, no function
    assert raw["ipc"]["device"] == FAKE_UUID and raw["ipc"]["dtype"] == "uint8"
    got = cuda_ipc.cuda_rebuild_args(wire.decode_header(frame)["ipc"], device_index=5)
    want = list(args)
    want[0], want[4], want[6] = torch.Tensor, torch.UntypedStorage, 5  # classes chosen here; the local index
    assert got[0] is torch.Tensor and got[4] is torch.UntypedStorage
    assert [tuple(a) if isinstance(a, torch.Size) else a for a in got] == [
        tuple(a) if isinstance(a, torch.Size) else a for a in want
    ]


def test_encode_cuda_names_the_gpu_by_uuid(monkeypatch):
    from dask_lm.model import device

    args = _torch_cuda_args(index=2)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args))
    monkeypatch.setattr(device, "device_uuid", lambda index=0: f"GPU-uuid-of-{index}")
    h = cuda_ipc.encode_cuda(torch.zeros(1))
    assert h["device"] == "GPU-uuid-of-2" and h["handle"] == args[7] and h["ref_counter_handle"] == args[11]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"tensor_cls": "os.system"}, "has keys"),
        ({"dtype": "__class__"}, "is not one of"),
        ({"ref_counter_handle": b"/../../etc/passwd"}, "reference counter"),
        ({"handle": "not bytes"}, "must be bytes"),
        ({"size": [8192]}, "reaches byte"),
        ({"tensor_offset": 4000}, "reaches byte"),
        ({"requires_grad": True}, "autograd"),
        ({"storage_size_bytes": True}, "non-negative int"),
        ({"size": [2, 2], "stride": [1]}, "differ in length"),
        ({"ref_counter_offset": 10_000}, "outside torch's reference counter"),
        ({"storage_offset_bytes": 1 << 41}, "past any device's memory"),
    ],
)
def test_cuda_handle_fields_are_checked(change, match):
    h = {**cuda_ipc.cuda_handle(_torch_cuda_args(), FAKE_UUID), **change}
    with pytest.raises(ValueError, match=match):
        cuda_ipc.cuda_rebuild_args(h, 0)


def test_a_pickle_is_not_a_header_and_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ValueError, match="not a dask-lm refit header"):
        wire.decode_header(pickle.dumps(WritesMarker(marker)))
    assert not marker.exists()


@pytest.mark.parametrize(
    "header,match",
    [
        ({"v": 2, "kind": "complete"}, "version 2"),
        ({"v": 1, "kind": "exec"}, "unknown refit message kind"),
        ({"v": 1, "kind": "complete", "extra": 1}, "has keys"),
        ({"v": 1, "kind": "weights", "names": [1], "used": 4, "transport": "bytes"}, "list of strings"),
        ({"v": 1, "kind": "weights", "names": ["a"], "used": True, "transport": "bytes"}, "byte count"),
        ({"v": 1, "kind": "weights", "names": ["a"], "used": 4, "transport": "shm"}, "transport"),
        ({"v": 1, "kind": "weights", "names": ["a"], "used": 4, "transport": "ipc"}, "has keys"),
    ],
)
def test_bad_headers_are_refused(header, match):
    with pytest.raises(ValueError, match=match):
        wire.decode_header(msgpack.packb(header))


def test_layout_follows_the_refit_info():
    info = {"a": ((3,), torch.float32), "b": ((2, 2), torch.bfloat16), "c": ((1,), torch.int64)}
    # a: bytes 0-12; b starts at the next multiple of 512 and spans 8 bytes; c at 1024
    assert wire.layout(["a", "b", "c"], 1024 + 8, info, set()) == [
        ("a", 0, (3,), torch.float32),
        ("b", 512, (2, 2), torch.bfloat16),
        ("c", 1024, (1,), torch.int64),
    ]
    with pytest.raises(ValueError, match="'z' is not in this receiver's refit info"):
        wire.layout(["z"], 4, info, set())
    with pytest.raises(ValueError, match="does not match its 1 tensors"):
        wire.layout(["a"], 16, info, set())
    with pytest.raises(ValueError, match="arrived twice"):
        wire.layout(["a"], 12, info, {"a"})


def test_replies_are_fixed_byte_strings(tmp_path):
    marker = tmp_path / "pwned"
    assert wire.read_reply([wire.ACK]) is None
    assert wire.read_reply(wire.reject_frames("bad\nname")) == "bad?name"
    for frames in ([pickle.dumps(WritesMarker(marker))], [b"ack"], [wire.ACK, b"x"], [wire.REJECT, b"x" * 5000]):
        with pytest.raises(ValueError, match="expected a dask-lm refit reply"):
            wire.read_reply(frames)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------- the receiver
class _Policy:
    """The policy end in this process: a bound REQ socket, as a policy rank has."""

    def __init__(self, tmp_path):
        self.address = f"ipc://{tmp_path}/policy.sock"
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 20_000)
        self.sock.bind(self.address)

    def ask(self, frames):
        self.sock.send_multipart(frames)
        return self.sock.recv_multipart()

    def close(self):
        self.sock.close(linger=0)


def _serve(address, info, got, errors):
    def on_weights(named):
        got.extend((n, t.clone()) for n, t in named)

    try:
        errors.append(receive_via_zmq(address, info, on_weights, timeout_s=20))
    except Exception as e:
        errors.append(e)


@pytest.fixture
def receiver(tmp_path):
    """Start ``receive_via_zmq`` in a thread against a policy socket of the test's own; yields (policy, run)."""
    policy = _Policy(tmp_path)
    threads = []

    def run(info):
        got, result = [], []
        t = threading.Thread(target=_serve, args=(policy.address, info, got, result), daemon=True)
        t.start()
        threads.append(t)

        def finished():
            t.join(30)
            assert result, "the receiver did not return"
            return result[0]

        return got, finished

    yield policy, run
    for t in threads:
        t.join(30)
    policy.close()


def test_receiver_loads_raw_byte_frames(receiver):
    policy, run = receiver
    a, b = torch.arange(6, dtype=torch.float32), torch.tensor([[1, -2], [3, 4]], dtype=torch.int64)
    info = {"a": ((6,), torch.float32), "b": ((2, 2), torch.int64)}
    got, finished = run(info)
    buf = torch.zeros(512 + 32, dtype=torch.uint8)
    buf[:24] = a.view(torch.uint8)
    buf[512:] = b.reshape(-1).view(torch.uint8)
    assert policy.ask([wire.encode_weights(["a", "b"], 544, transport="bytes"), buf.numpy().tobytes()]) == [wire.ACK]
    assert policy.ask([wire.encode_complete()]) == [wire.ACK]
    stats = finished()
    assert stats["messages"] == 1 and stats["bytes"] == 544
    assert [n for n, _ in got] == ["a", "b"]
    assert torch.equal(got[0][1], a) and torch.equal(got[1][1], b)


def test_receiver_refuses_a_pickle_from_a_hostile_policy(receiver, tmp_path):
    """A "policy" that sends a pickle (which would create a file when unpickled) gets a rejection; the receiver
    raises a ValueError and no file appears."""
    policy, run = receiver
    marker = tmp_path / "pwned"
    _got, finished = run({"a": ((1,), torch.float32)})
    reply = policy.ask([pickle.dumps(WritesMarker(marker))])
    assert reply[0] == wire.REJECT and b"not a dask-lm refit header" in reply[1]
    error = finished()
    assert isinstance(error, ValueError) and "not a dask-lm refit header" in str(error)
    assert not marker.exists()


@pytest.mark.parametrize(
    "frames,match",
    [
        ([wire.encode_weights(["w"], 4, transport="bytes"), b"\0" * 4], "'w' is not in this receiver's refit info"),
        ([wire.encode_weights(["a"], 4, transport="bytes"), b"\0" * 3], "announces 4 bytes and carries 3"),
        ([wire.encode_weights(["a"], 4, transport="bytes")], "should have 2 frame"),
        ([wire.encode_complete()], "1 of 1 weights not sent"),
    ],
)
def test_receiver_names_what_is_wrong(receiver, frames, match):
    policy, run = receiver
    _got, finished = run({"a": ((1,), torch.float32)})
    reply = policy.ask(frames)
    assert reply[0] == wire.REJECT
    error = finished()
    assert isinstance(error, ValueError)
    assert "refit message 1 on ipc://" in str(error) and match in str(error)


def test_socket_path_is_short_enough(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dask_lm.refit import zmq_endpoint

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    with pytest.raises(ValueError, match="set TMPDIR"):
        zmq_endpoint.endpoint(SimpleNamespace(rank=0, refit_zmq=None))
    assert os.listdir(deep) == []
