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
  buffer on the policy's GPU (:func:`dask_lm.model.cuda_ipc.encode_cuda`), the bytes at the same offsets;
- ``{"v": 1, "kind": "complete"}``: every weight was sent.

**Inference -> policy.** One reply per message, from a fixed set: :data:`ACK` (loaded; the buffer may be reused),
or :data:`REJECT` followed by one UTF-8 frame saying why (read as text, never parsed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch

from dask_lm.moved import moved_names

__all__ = [
    "VERSION",
    "ALIGN",
    "ACK",
    "REJECT",
    "TRANSPORTS",
    "encode_weights",
    "encode_complete",
    "decode_header",
    "layout",
    "read_reply",
    "reject_frames",
]

# the CUDA IPC handle codec (the ``"ipc"`` field of a weights header) is dask_lm.model.cuda_ipc, which shared logits
# buffers use too; its old path here warns
__getattr__ = moved_names(
    __name__, dict.fromkeys(["encode_cuda", "cuda_handle", "cuda_rebuild_args", "open_cuda"], "dask_lm.model.cuda_ipc")
)

VERSION = 1
ALIGN = 512
ACK = b"dask-lm-refit-ack/1"
REJECT = b"dask-lm-refit-reject/1"
TRANSPORTS = ("bytes", "ipc")
MAX_HEADER_BYTES = 16 << 20  # the names of one buffer: far below this even for tens of thousands of tensors
MAX_REASON_BYTES = 1000
_KEYS = {"complete": {"v", "kind"}, "weights": {"v", "kind", "names", "used", "transport"}}


# ----------------------------------------------------------------------------------------- headers
def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def encode_weights(names: Sequence[str], used: int, *, transport: str, ipc: dict[str, Any] | None = None) -> bytes:
    """Frame 0 of a weights message (see the module docstring)."""
    assert transport in TRANSPORTS and (ipc is not None) == (transport == "ipc"), (transport, ipc is None)
    header: dict[str, Any] = {
        "v": VERSION,
        "kind": "weights",
        "names": list(names),
        "used": int(used),
        "transport": transport,
    }
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
        raise ValueError(
            f"the header frame has {len(frame)} bytes, more than the {MAX_HEADER_BYTES} a refit header can have"
        )
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for malformed input; all mean the same here
        raise ValueError(f"the header frame is not a dask-lm refit header (not msgpack: {type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(
            f"the header frame is not a dask-lm refit header (a msgpack {type(header).__name__}, not a map)"
        )
    if header.get("v") != VERSION:
        raise ValueError(
            f"refit header version {header.get('v')!r}, this receiver reads version {VERSION}: "
            "install the same dask-lm version on both sides"
        )
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


def layout(
    names: Sequence[str], used: int, refit_info: Mapping[str, tuple[Sequence[int], torch.dtype]], seen: set[str]
) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
    """``(name, byte offset, shape, dtype)`` of each tensor of a weights message, from the receiver's refit info.
    Every name must be known and arrive once (``seen`` collects them over a stream), and the tensors must span
    exactly ``used`` bytes."""
    out, offset = [], 0
    for name in names:
        if name not in refit_info:
            raise ValueError(
                f"weight {name!r} is not in this receiver's refit info: pass Policy.prepare_refit_info() "
                "of the policy that streams"
            )
        if name in seen:
            raise ValueError(f"weight {name!r} arrived twice in one refit")
        seen.add(name)
        shape, dtype = refit_info[name]
        offset = -(-offset // ALIGN) * ALIGN
        out.append((name, offset, tuple(int(d) for d in shape), dtype))
        offset += math.prod(int(d) for d in shape) * dtype.itemsize
    if offset != used:
        raise ValueError(
            f"a refit message of {used} bytes does not match its {len(names)} tensors ({offset} bytes "
            "by this receiver's refit info): the refit info differs from the policy's"
        )
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
    raise ValueError(
        f"expected a dask-lm refit reply ({ACK!r}, or {REJECT!r} and a reason), got {len(frames)} "
        f"frame(s) of {sizes} bytes"
    )


def reject_frames(reason: str) -> list[bytes]:
    return [REJECT, reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]]
