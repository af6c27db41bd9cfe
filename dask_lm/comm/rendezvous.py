"""Where a rank's process group listens: on the address its Dask worker listens on, and nowhere else.

``torch.distributed``'s rendezvous store and its transports (gloo's pairs, NCCL's bootstrap) listen on sockets of
their own. Left to themselves they pick an interface from the host name (and torch's store binds every interface),
so a cluster that Dask keeps on loopback would still expose an unauthenticated store to the network. Each rank
therefore:

- hosts the store (rank 0) on a socket it binds itself to its worker's address and hands to ``TCPStore`` as
  ``master_listen_fd``;
- sets ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` to the interface that holds its worker's address, unless
  the user set them (a multi-host cluster on a fast fabric names its own interface).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["worker_host", "find_free_port", "interface_for", "pin_interfaces", "listen_fd", "create_store"]

logger = logging.getLogger("dask_lm.worker")


def worker_host() -> str:
    """The host part of this Dask worker's address (what the scheduler and peers reach it by)."""
    from distributed import get_worker

    host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
    return host.strip("[]")


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name
        return socket.AF_INET


def find_free_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_for(host: str) -> str | None:
    """The network interface that holds ``host``'s address (``lo`` for 127.0.0.1, and for any other address of the
    loopback network, such as 127.0.0.2, which Linux routes to ``lo`` though ``lo`` lists only 127.0.0.1), or
    None."""
    import psutil

    try:
        addr = socket.gethostbyname(host) if _family(host) == socket.AF_INET else host
    except OSError:
        return None
    interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.is_loopback:  # no interface lists it: the one whose loopback network holds it
        for name, addrs in interfaces.items():
            for a in addrs:
                if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                    continue
                try:
                    network = ipaddress.ip_interface(f"{a.address.split('%')[0]}/{a.netmask}").network
                except ValueError:
                    continue
                if network.is_loopback and ip in network:
                    return name
    return None


def pin_interfaces(host: str) -> None:
    """Keep gloo's and NCCL's own sockets on the worker's interface (user settings win)."""
    iface = interface_for(host)
    if iface is None:
        logger.info(
            "no interface holds %s; gloo/NCCL choose their own (set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME)", host
        )
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, iface)


def listen_fd(host: str, port: int, *, what: str) -> int:
    """The file descriptor of a TCP socket listening on ``host:port`` only (whoever takes it owns it); ``what``
    names the call in the error."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(
            f"{what}: {host!r} does not resolve on this worker ({e.strerror}); pass an address of its host"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ValueError(
            f"{what}: cannot listen on {host}:{port} ({e.strerror}): pass an address of this host and a free port"
        ) from None
    return sock.detach()


def create_store(
    host: str,
    port: int,
    world_size: int,
    *,
    is_master: bool,
    timeout_s: float,
    wait_for_workers: bool = False,
    what: str = "the process group rendezvous",
) -> Any:
    """A ``TCPStore`` at ``host:port``; the master listens on ``host`` only (a socket bound here, not by torch,
    whose own listener takes every interface)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    fd = listen_fd(host, int(port), what=what)
    # the store owns the descriptor from here on and closes it with itself
    return dist.TCPStore(
        host,
        int(port),
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=fd,
    )
