"""An opt-in warm local cluster: ``dask-lm cluster start`` leaves the local cluster ``connect()`` would start running
in a background process, and later commands and ``connect()`` calls of the same user attach to it.

Why: a fresh worker process spends seconds importing torch and transformers (5-15 s, :mod:`dask_lm.workers.warm`)
and the cluster seconds starting; a second ``dask-lm score`` or Policy script finds both done. The cluster is the
one ``connect()`` starts (same preload, warm-up, one ``LocalCUDACluster`` worker per GPU or CPU ``LocalCluster``
workers, listening on loopback only), run by ``python -m dask_lm.engine.warm_server`` in a session of its own.

Its files are in one folder, ``<cache root>/warm-cluster`` (:func:`dask_lm.io.local_cache.cache_root`), made 0700:
distributed's scheduler file, this module's record beside it (the server's pid, the cluster's kind and size, when it
started; written once the workers have registered and warmed up) and the server's log. A folder that is not a
directory of this user's with no group / world write bit, and a record or scheduler file that is a link or not this
user's, are refused with an error naming them (a planted file would point the user's jobs at someone else's
scheduler, which runs what it is sent). A record whose server process is gone is stale: its files are removed and
the cluster counts as absent. A live server whose scheduler does not answer within :data:`ANSWER_S` is passed over
(a local cluster of the job's own starts) and left for ``dask-lm cluster stop``.

``DASK_LM_WARM_CLUSTER=0`` makes ``connect()`` ignore it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_lm.io.local_cache import cache_root

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["WarmCluster", "Asked", "folder", "find", "attach", "start", "stop", "holdings"]

SCHEDULER_FILE = "scheduler.json"
RECORD = "warm-cluster.json"
LOG = "warm-cluster.log"
START_LOCK = "start.lock"
SERVER = "dask_lm.engine.warm_server"  # the module the background process runs
# a scheduler on loopback that has not answered by then is hung or not there: a healthy one took 1.2 s to a new
# client on a 2-core machine at load 11, so 2 s would start a second cluster beside a live one
ANSWER_S = 5.0
STOP_HINT = "dask-lm cluster stop"


@dataclass(frozen=True)
class WarmCluster:
    """What the record and the scheduler file say of a running warm cluster."""

    folder: str
    pid: int  # the server process (leader of its own session: its workers are in its process group)
    kind: str  # "cuda" or "cpu"
    n_workers: int
    memory_limit: str
    started_at: float  # time.time()
    address: str
    dashboard: str | None

    @property
    def scheduler_file(self) -> str:
        return os.path.join(self.folder, SCHEDULER_FILE)

    @property
    def log(self) -> str:
        return os.path.join(self.folder, LOG)


def enabled() -> bool:
    return os.environ.get("DASK_LM_WARM_CLUSTER", "1") != "0"


def folder() -> str:
    """``<cache root>/warm-cluster`` (``$DASK_LM_CACHE_DIR``, else ``$XDG_CACHE_HOME/dask-lm``, ...)."""
    return os.path.join(cache_root(), "warm-cluster")


def checked_folder(*, create: bool) -> str | None:
    """The folder, made 0700 with ``create``; ``None`` where it does not exist. Refused (``ValueError``) where it is
    a link, not this user's, or writable by others."""
    path = folder()
    if create:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"warm cluster folder {path} is not a directory (a link?): remove it")
    if st.st_uid != os.getuid():
        raise ValueError(f"warm cluster folder {path} belongs to uid {st.st_uid}, not to you: remove it")
    if st.st_mode & 0o022:
        raise ValueError(
            f"warm cluster folder {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): remove it"
        )
    return path


def _read_json(path: str) -> dict[str, Any] | None:
    """A JSON object from ``path``, opened without following a link and only if it is this user's regular file;
    ``None`` where it does not exist or is not whole (being written)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"warm cluster file {path} is a symbolic link: refused; remove it") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"warm cluster file {path} is not a regular file of yours (uid {st.st_uid}): remove it")
        try:
            value = json.loads(f.read())
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def write_json(path: str, value: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")  # 0600, a fresh name: no link followed
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def remove_files(path: str) -> None:
    for name in (RECORD, SCHEDULER_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))  # unlink removes a link itself, never its target


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which no reaper collected yet, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: the pid was reused
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _is_server(pid: int) -> bool:
    """Whether ``pid`` is a live warm cluster server (not a process that reused a dead server's pid)."""
    if not _alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return SERVER.encode() in f.read()
    except OSError:  # no /proc: the pid alone
        return True


def find() -> WarmCluster | None:
    """The warm cluster recorded in this user's cache folder whose server runs; a stale record is removed. It is not
    asked whether it answers (:func:`attach` does). ``ValueError`` for a folder or file that is refused."""
    path = checked_folder(create=False)
    if path is None:
        return None
    record = _read_json(os.path.join(path, RECORD))
    sched = _read_json(os.path.join(path, SCHEDULER_FILE))
    if record is None:
        return None  # none, or one still starting (its server writes the record once its workers are up)
    if not isinstance(record.get("pid"), int) or not _is_server(record["pid"]):
        remove_files(path)
        return None
    if sched is None or not isinstance(sched.get("address"), str):
        return None
    return WarmCluster(
        folder=path,
        pid=record["pid"],
        kind=str(record.get("kind")),
        n_workers=int(record.get("n_workers", 0)),
        memory_limit=str(record.get("memory_limit")),
        started_at=float(record.get("started_at", 0.0)),
        address=sched["address"],
        dashboard=record.get("dashboard"),
    )


@dataclass(frozen=True)
class Asked:
    """The local-cluster options of a ``connect()`` call (its defaults: what the warm cluster is)."""

    n_workers: int | None = None
    cluster: str = "auto"
    memory_limit: str | float | None = "auto"
    host: str = "127.0.0.1"
    dashboard_address: str | None = None
    cluster_kwargs: tuple[str, ...] = ()  # the names of the other options given


def _mismatch(warm: WarmCluster, asked: Asked, name: Callable[[str], str]) -> str | None:
    """The first option of a ``connect()`` call that the warm cluster cannot honour, said as a message; else None."""
    if asked.n_workers is not None and asked.n_workers != warm.n_workers:
        return f"{name('n_workers')}={asked.n_workers} but the warm local cluster has {warm.n_workers} workers"
    if asked.cluster not in ("auto", warm.kind):
        return f"{name('cluster')}={asked.cluster!r} but the warm local cluster runs {warm.kind} workers"
    limit = asked.memory_limit
    if warm.kind == "cpu" and limit != "auto" and str(limit) != warm.memory_limit:
        return f"{name('memory_limit')}={limit!r} but the warm local cluster's is {warm.memory_limit!r}"
    if asked.host != "127.0.0.1":
        return f"{name('host')}={asked.host!r} but the warm local cluster listens on 127.0.0.1"
    if asked.dashboard_address is not None:
        return f"{name('dashboard_address')} is given, but the warm local cluster's dashboard is {warm.dashboard}"
    if asked.cluster_kwargs:
        given = ", ".join(sorted(asked.cluster_kwargs))
        return f"local cluster options ({given}) are given, but the warm local cluster is already started"
    return None


def attach(asked: Asked = Asked(), name: Callable[[str], str] = lambda key: f"`{key}`") -> Client | None:
    """A ``distributed.Client`` of the running warm cluster for a ``connect()`` call with no address, or ``None``
    (none running, disabled, or its scheduler does not answer). ``asked``: the call's local-cluster options;
    ``name``: how a message names an option. ``ValueError`` where the call asks for what the warm cluster is not."""
    if not enabled():
        return None
    warm = find()
    if warm is None:
        return None
    problem = _mismatch(warm, asked, name)
    if problem is not None:
        raise ValueError(
            f"{problem} ({warm.scheduler_file}): leave the option out to use it, stop it (`{STOP_HINT}`), or set "
            "DASK_LM_WARM_CLUSTER=0 to start a local cluster of this run's own"
        )
    from distributed import Client

    try:
        client = Client(warm.address, timeout=ANSWER_S)
    except (OSError, TimeoutError):
        _say(
            f"dask-lm: the warm local cluster (pid {warm.pid}) did not answer at {warm.address} within {ANSWER_S:g} s:"
            f" starting a local cluster instead; `{STOP_HINT}` stops it"
        )
        return None
    # the client keeps its connection timeout for later waits too (a scatter, a reconnect): Dask's default again
    import dask
    from dask.utils import parse_timedelta

    client._timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")
    _say(
        f"dask-lm: using the warm local cluster at {warm.address} ({warm.n_workers} {warm.kind} workers); "
        f"`{STOP_HINT}` stops it"
    )
    return client


def _say(line: str) -> None:
    """``line`` on stderr, above a job's progress bar where one is shown (a job connects while its bar runs)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(line, file=sys.stderr)
        return
    tqdm.write(line, file=sys.stderr)


def start(*, n_workers: int | None, cluster: str, memory_limit: str, timeout: float = 600.0) -> WarmCluster:
    """Start the server in a session of its own and return once its workers have registered. ``ValueError`` where
    one runs already; ``RuntimeError`` (with its log's end) where the server exits or is not up by ``timeout``."""
    running = find()
    if running is not None:
        raise ValueError(
            f"a warm local cluster is already running at {running.address} (pid {running.pid}): `{STOP_HINT}` first"
        )
    path = checked_folder(create=True)
    assert path is not None
    import fcntl

    lock_fd = os.open(os.path.join(path, START_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another `dask-lm cluster start` is under way ({path})") from None
        remove_files(path)  # a record of a server that died (find() said none runs)
        log_fd = os.open(os.path.join(path, LOG), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        args = [sys.executable, "-m", SERVER, "--cluster", cluster, "--memory-limit", str(memory_limit)]
        if n_workers is not None:
            args += ["--n-workers", str(n_workers)]
        try:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True, close_fds=True
            )
        finally:
            os.close(log_fd)
        deadline = time.monotonic() + timeout
        while True:
            warm = find()
            if warm is not None and warm.pid == proc.pid:
                return warm
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    _kill_group(proc.pid)
                    proc.wait()
                raise RuntimeError(f"the warm local cluster did not start; its log ({path}/{LOG}) ends:\n{_tail(path)}")
            time.sleep(0.2)  # the server writes its record once its workers have registered
    finally:
        os.close(lock_fd)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(os.path.join(path, LOG), "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def stop(timeout: float = 60.0) -> WarmCluster | None:
    """Stop the running warm cluster (SIGTERM to its server, which closes its workers and removes its files; past
    ``timeout`` its whole process group is killed); the cluster that was stopped, ``None`` where none ran."""
    warm = find()
    if warm is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(warm.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(warm.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # the workers are in the server's process group: what is left of it once the server is gone (or past the
    # timeout, the server too) is killed
    if _alive(warm.pid) or _group_alive(warm.pid):
        _kill_group(warm.pid)
    remove_files(warm.folder)
    return warm


def holdings(dask_worker: Any = None) -> dict[str, Any]:
    """What a warm cluster's worker holds (run with ``client.run``): its pid, whether its warm-up ended, its device
    memory, and the model replicas and Policies cached in its dask-lm plugin state. Imports nothing heavy."""
    from dask_lm.workers import warm

    report = warm.report()
    ended = "ended_at" in report or os.environ.get("DASK_LM_WARM_WORKERS", "1") == "0"  # none to wait for
    held: dict[str, Any] = {"pid": os.getpid(), "warm": ended, "error": report.get("error")}
    plugin = getattr(dask_worker, "plugins", {}).get("dask-lm")  # registered by the first job or Policy
    held["jobs_ran"] = plugin is not None
    held["replicas"] = len(getattr(plugin, "scorers", {}) or {})
    held["policies"] = len(getattr(plugin, "policies", {}) or {})
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        held["device"] = torch.cuda.get_device_name()
        held["device_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    return held
