"""The wire format of the ZMQ refit (``stream_weights_via_ipc_zmq`` / ``receive_via_zmq``): data only, both ways.

Whatever connects to a refit socket can send anything, so nothing received there is unpickled and no class or
function is ever looked up by a name that came from the peer: the worst a stranger can do is send bytes that fail
validation.

**Policy -> inference.** A ZMQ multipart message: frame 0 is a msgpack map (the header), any further frame is raw
bytes. Version 1 headers:

- ``{"v": 1, "kind": "weights", "names": [...], "used": n, "transport": "bytes"}`` plus one frame of exactly ``n``
  bytes: the tensors of ``names``, back to back in that order, each at a :data:`ALIGN`-byte aligned offset (shapes
  and dtypes come from the receiver's refit info, so only names travel);
- the same with ``"transport": "ipc"`` and ``"ipc": {...}`` instead of the frame: a CUDA IPC handle of a uint8
  buffer on the policy's GPU (:func:`encode_cuda`), the bytes at the same offsets;
- ``{"v": 1, "kind": "complete"}``: every weight was sent.

**Inference -> policy.** One reply per message, from a fixed set: :data:`ACK` (loaded; the buffer may be reused),
or :data:`REJECT` followed by one UTF-8 frame saying why (read as text, never parsed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch

__all__ = ["VERSION", "ALIGN", "ACK", "REJECT", "TRANSPORTS", "encode_weights", "encode_complete", "decode_header",
           "layout", "read_reply", "reject_frames", "encode_cuda", "cuda_handle", "cuda_rebuild_args", "open_cuda"]

VERSION = 1
ALIGN = 512
ACK = b"dask-lm-refit-ack/1"
REJECT = b"dask-lm-refit-reject/1"
TRANSPORTS = ("bytes", "ipc")
MAX_HEADER_BYTES = 16 << 20  # the names of one buffer: far below this even for tens of thousands of tensors
MAX_REASON_BYTES = 1000
_KEYS = {"complete": {"v", "kind"},
         "weights": {"v", "kind", "names", "used", "transport"}}

# dtypes a handle may name: a table, so a name from the peer is only ever a key, never an attribute lookup
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}
_CUDA_KEYS = ("size", "stride", "tensor_offset", "dtype", "device", "handle", "storage_size_bytes",
              "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
              "event_sync_required")
# torch names the shared-memory block of a CUDA IPC reference counter "/torch_<pid>_<random>_<n>"; the receiver
# opens it by that name, so nothing else (no other directory, no traversal) is accepted
_REF_COUNTER = re.compile(rb"/torch_[0-9A-Za-z_]{1,200}")
_MAX_HANDLE_BYTES = 1 << 16


# ----------------------------------------------------------------------------------------- headers
def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def encode_weights(names: Sequence[str], used: int, *, transport: str, ipc: dict[str, Any] | None = None) -> bytes:
    """Frame 0 of a weights message (see the module docstring)."""
    assert transport in TRANSPORTS and (ipc is not None) == (transport == "ipc"), (transport, ipc is None)
    header: dict[str, Any] = {"v": VERSION, "kind": "weights", "names": list(names), "used": int(used),
                              "transport": transport}
    if ipc is not None:
        header["ipc"] = ipc
    return _pack(header)


def encode_complete() -> bytes:
    return _pack({"v": VERSION, "kind": "complete"})


def _is_int(x: Any) -> bool:
    return type(x) is int  # msgpack gives bools as bool; a bool is no byte count


def decode_header(frame: bytes) -> dict[str, Any]:
    """The header of a message from the policy, checked for shape and types (``ValueError`` naming what is
    wrong). Names are checked against the refit info by :func:`layout`."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ValueError(f"the header frame has {len(frame)} bytes, more than the {MAX_HEADER_BYTES} a refit "
                         "header can have")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for malformed input; all mean the same here
        raise ValueError(f"the header frame is not a dask-lm refit header (not msgpack: {type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header frame is not a dask-lm refit header (a msgpack {type(header).__name__}, "
                         "not a map)")
    if header.get("v") != VERSION:
        raise ValueError(f"refit header version {header.get('v')!r}, this receiver reads version {VERSION}: "
                         "install the same dask-lm version on both sides")
    kind = header.get("kind")
    if kind not in _KEYS:
        raise ValueError(f"unknown refit message kind {kind!r}; expected one of {sorted(_KEYS)}")
    expected = _KEYS[kind] | ({"ipc"} if header.get("transport") == "ipc" else set())
    if set(header) != expected:
        raise ValueError(f"a {kind!r} refit header has keys {sorted(header)}, expected {sorted(expected)}")
    if kind == "weights":
        names, used = header["names"], header["used"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError("`names` of a refit header must be a non-empty list of strings")
        if not _is_int(used) or used < 0:
            raise ValueError(f"`used` of a refit header must be a byte count, got {used!r}")
        if header["transport"] not in TRANSPORTS:
            raise ValueError(f"refit transport {header['transport']!r} is not one of {TRANSPORTS}")
        if "ipc" in header and not isinstance(header["ipc"], dict):
            raise ValueError("`ipc` of a refit header must be a map (a CUDA IPC handle)")
    return header


def layout(names: Sequence[str], used: int, refit_info: Mapping[str, tuple[Sequence[int], torch.dtype]],
           seen: set[str]) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
    """``(name, byte offset, shape, dtype)`` of each tensor of a weights message, from the receiver's refit info.
    Every name must be known and arrive once (``seen`` collects them over a stream), and the tensors must span
    exactly ``used`` bytes."""
    out, offset = [], 0
    for name in names:
        if name not in refit_info:
            raise ValueError(f"weight {name!r} is not in this receiver's refit info: pass Policy.prepare_refit_info() "
                             "of the policy that streams")
        if name in seen:
            raise ValueError(f"weight {name!r} arrived twice in one refit")
        seen.add(name)
        shape, dtype = refit_info[name]
        offset = -(-offset // ALIGN) * ALIGN
        out.append((name, offset, tuple(int(d) for d in shape), dtype))
        offset += math.prod(int(d) for d in shape) * dtype.itemsize
    if offset != used:
        raise ValueError(f"a refit message of {used} bytes does not match its {len(names)} tensors ({offset} bytes "
                         "by this receiver's refit info): the refit info differs from the policy's")
    return out


# ----------------------------------------------------------------------------------------- replies
def read_reply(frames: Sequence[bytes]) -> str | None:
    """None for :data:`ACK`, the peer's reason for :data:`REJECT`; ``ValueError`` for anything else."""
    if len(frames) == 1 and frames[0] == ACK:
        return None
    if len(frames) == 2 and frames[0] == REJECT and len(frames[1]) <= MAX_REASON_BYTES:
        # shown to a person: printable text only, whatever the peer put there
        return "".join(c if c.isprintable() else "?" for c in bytes(frames[1]).decode("utf-8", "replace"))
    sizes = [len(f) for f in frames]
    raise ValueError(f"expected a dask-lm refit reply ({ACK!r}, or {REJECT!r} and a reason), got {len(frames)} "
                     f"frame(s) of {sizes} bytes")


def reject_frames(reason: str) -> list[bytes]:
    return [REJECT, reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]]


# ----------------------------------------------------------------------------------------- CUDA IPC handles
def cuda_handle(args: Sequence[Any], device_uuid: str) -> dict[str, Any]:
    """Plain data from the arguments torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor`` (torch 2.x: tensor
    class, size, stride, offset, storage class, dtype, device index, handle, storage bytes, storage offset,
    requires_grad, ref-counter handle and offset, event handle, event sync). The classes are left out (the receiver
    picks its own) and the device index becomes the GPU's UUID: the two processes see different
    ``CUDA_VISIBLE_DEVICES``."""
    assert len(args) == 15, f"torch's rebuild_cuda_tensor takes 15 arguments here, reduce_tensor gave {len(args)}"
    (_cls, size, stride, offset, _storage_cls, dtype, _index, handle, nbytes, storage_offset, requires_grad,
     ref_counter, ref_counter_offset, event, event_sync) = args
    return {"size": [int(s) for s in size], "stride": [int(s) for s in stride], "tensor_offset": int(offset),
            "dtype": str(dtype).removeprefix("torch."), "device": str(device_uuid), "handle": bytes(handle),
            "storage_size_bytes": int(nbytes), "storage_offset_bytes": int(storage_offset),
            "requires_grad": bool(requires_grad), "ref_counter_handle": bytes(ref_counter),
            "ref_counter_offset": int(ref_counter_offset), "event_handle": bytes(event),
            "event_sync_required": bool(event_sync)}


def encode_cuda(t: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC handle of ``t`` as plain data (every call exports a fresh reference)."""
    from torch.multiprocessing import reductions

    from dask_lm.model import device

    rebuild, args = reductions.reduce_tensor(t)
    assert rebuild is reductions.rebuild_cuda_tensor, "encode_cuda takes a CUDA tensor"
    return cuda_handle(args, device.device_uuid(args[6]))


def _check_bytes(h: dict[str, Any], key: str) -> bytes:
    v = h[key]
    if not isinstance(v, bytes) or not 0 < len(v) <= _MAX_HANDLE_BYTES:
        raise ValueError(f"`ipc.{key}` of a refit header must be bytes, got {type(v).__name__}")
    return v


_REF_COUNTER_ENTRIES = 10_000
_MAX_STORAGE_BYTES = 1 << 40  # 1 TiB: more than any GPU holds


def cuda_rebuild_args(h: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """The arguments for torch's ``rebuild_cuda_tensor`` from a handle made by :func:`cuda_handle`, with classes
    chosen here (``torch.Tensor``, ``torch.UntypedStorage``) and ``device_index`` for the UUID. Checks every field,
    and that the view lies inside the shared storage."""
    if set(h) != set(_CUDA_KEYS):
        raise ValueError(f"`ipc` of a refit header has keys {sorted(h)}, expected {sorted(_CUDA_KEYS)}")
    size, stride = h["size"], h["stride"]
    for key in ("size", "stride"):
        if not isinstance(h[key], list) or len(h[key]) > 8 or not all(_is_int(d) and d >= 0 for d in h[key]):
            raise ValueError(f"`ipc.{key}` of a refit header must be a list of non-negative ints")
    if len(size) != len(stride):
        raise ValueError("`ipc.size` and `ipc.stride` of a refit header differ in length")
    for key in ("tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset"):
        if not _is_int(h[key]) or h[key] < 0:
            raise ValueError(f"`ipc.{key}` of a refit header must be a non-negative int, got {h[key]!r}")
    for key in ("requires_grad", "event_sync_required"):
        if not isinstance(h[key], bool):
            raise ValueError(f"`ipc.{key}` of a refit header must be a bool")
    if h["requires_grad"]:
        raise ValueError("`ipc.requires_grad` is true: refit buffers carry no autograd history")
    dtype = _DTYPES.get(h["dtype"]) if isinstance(h["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"`ipc.dtype` {h['dtype']!r} is not one of {sorted(_DTYPES)}")
    handle, event = _check_bytes(h, "handle"), _check_bytes(h, "event_handle")
    ref_counter = _check_bytes(h, "ref_counter_handle")
    if not _REF_COUNTER.fullmatch(ref_counter):
        raise ValueError(f"`ipc.ref_counter_handle` {ref_counter[:80]!r} is not the name of a torch shared-memory "
                         "reference counter")
    if h["storage_size_bytes"] == 0:
        raise ValueError("`ipc.storage_size_bytes` is 0: a refit buffer is never empty")
    # torch decrements the int64 at ``ref_counter_offset`` of the counter file it maps, unchecked: an offset past
    # the file would write outside it (torch/csrc/CudaIPCTypes.h: CUDA_IPC_REF_COUNTER_FILE_SIZE entries)
    if h["ref_counter_offset"] >= _REF_COUNTER_ENTRIES:
        raise ValueError(f"`ipc.ref_counter_offset` {h['ref_counter_offset']} is outside torch's reference counter "
                         f"file ({_REF_COUNTER_ENTRIES} entries)")
    if h["storage_offset_bytes"] + h["storage_size_bytes"] > _MAX_STORAGE_BYTES:
        raise ValueError(f"the CUDA IPC storage ends at byte {h['storage_offset_bytes'] + h['storage_size_bytes']}, "
                         "past any device's memory")
    # the furthest element the view reaches must lie inside the storage the handle maps
    end = h["tensor_offset"] + sum((d - 1) * s for d, s in zip(size, stride)) + 1 if all(size) else 0
    if end * dtype.itemsize > h["storage_size_bytes"]:
        raise ValueError(f"the CUDA IPC view reaches byte {end * dtype.itemsize} of a storage of "
                         f"{h['storage_size_bytes']} bytes")
    return (torch.Tensor, tuple(size), tuple(stride), h["tensor_offset"], torch.UntypedStorage, dtype, device_index,
            handle, h["storage_size_bytes"], h["storage_offset_bytes"], False, ref_counter, h["ref_counter_offset"],
            event, h["event_sync_required"])


def open_cuda(h: dict[str, Any]) -> torch.Tensor:
    """The tensor a :func:`encode_cuda` handle describes, mapped from the producer's GPU memory (no copy)."""
    from torch.multiprocessing import reductions

    from dask_lm.model import device

    if not isinstance(h.get("device"), str):
        raise ValueError("`ipc.device` of a refit header must be a GPU UUID string")
    args = cuda_rebuild_args(h, 0)  # every field checked before the UUID is even looked up
    rebuild = (*args[:6], device.index_for_uuid(h["device"]), *args[7:])
    return reductions.rebuild_cuda_tensor(*rebuild)
