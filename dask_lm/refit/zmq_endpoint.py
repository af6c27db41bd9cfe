"""Where a policy rank's ZMQ refit socket lives: a private directory of its own, one socket file in it.

``stream_weights_via_ipc_zmq`` binds a REQ socket that the inference worker on the same GPU connects to. A socket
file in a shared directory (``/tmp``) can be reached by every local user, and whatever connects talks to the
policy rank, so each rank makes a directory with ``tempfile.mkdtemp`` (mode 0700, owned by the worker's user,
under ``$XDG_RUNTIME_DIR`` when set, else the temp dir) and binds ``refit.sock`` in it (then mode 0600). The
inference worker must therefore run as the same user on the same host, which a colocated engine does.

The directory is made on the first ``Policy.get_zmq_addresses()`` or stream and kept until the policy shuts down,
so the address stays the same between calls (also after a failed call, which closes the socket: a REQ socket that
missed an answer cannot send again). ``close`` removes the socket file and the directory.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_lm.refit.rank import Refitter

__all__ = ["Endpoint", "bind", "close_socket", "close"]

logger = logging.getLogger("dask_lm.worker")
SOCKET_NAME = "refit.sock"
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux holds 108 bytes with the trailing NUL
MAX_REPLY_BYTES = 4096  # an ACK or a REJECT with its reason; a peer sending more is disconnected by ZMQ


@dataclass
class Endpoint:
    directory: str
    sock: Any = None  # the bound zmq REQ socket, or None between a failed call and the next one

    @property
    def path(self) -> str:
        return os.path.join(self.directory, SOCKET_NAME)

    @property
    def address(self) -> str:
        return f"ipc://{self.path}"


def _runtime_dir() -> str:
    # $XDG_RUNTIME_DIR is per user and private already; the temp dir is shared, hence the private subdirectory
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return xdg
    return tempfile.gettempdir()


def endpoint(owner: Refitter) -> Endpoint:
    """This rank's endpoint; its private directory is made on the first call."""
    ep = owner.refit_zmq
    if ep is None:
        directory = tempfile.mkdtemp(prefix=f"dask-lm-refit-r{owner.rank}-", dir=_runtime_dir())  # mode 0700
        ep = Endpoint(directory)
        if len(ep.path.encode()) > MAX_SOCKET_PATH:
            os.rmdir(directory)
            raise ValueError(
                f"the refit socket path {ep.path!r} is longer than the {MAX_SOCKET_PATH} bytes a Unix "
                "socket can have: set TMPDIR (or XDG_RUNTIME_DIR) on the workers to a shorter directory"
            )
        owner.refit_zmq = ep
    return ep


def bind(owner: Refitter) -> Endpoint:
    """This rank's endpoint with its REQ socket bound (bound once, reused by every stream until an error)."""
    import zmq

    ep = endpoint(owner)
    if ep.sock is None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        try:
            sock.bind(ep.address)  # replaces the file of a socket closed after an error (libzmq unlinks it first)
            os.chmod(ep.path, 0o600)
        except BaseException:
            sock.close(linger=0)
            raise
        ep.sock = sock
    return ep


def close_socket(owner: Refitter) -> None:
    """Close the socket but keep the directory and address (after a failed call)."""
    ep = owner.refit_zmq
    if ep is not None and ep.sock is not None:
        sock, ep.sock = ep.sock, None
        sock.close(linger=0)


def close(owner: Refitter) -> None:
    """Close the socket and remove its file and directory (policy shutdown)."""
    close_socket(owner)
    ep, owner.refit_zmq = owner.refit_zmq, None
    if ep is None:
        return
    for remove, path in ((os.unlink, ep.path), (os.rmdir, ep.directory)):
        try:
            remove(path)
        except FileNotFoundError:
            pass
        except OSError:  # something else was put there; leave it, say so
            logger.warning("could not remove the refit socket's %s", path, exc_info=True)
