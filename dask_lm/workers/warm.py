"""A local cluster's worker warms up as it starts: torch, transformers' modelling code and dask-lm's rank code are
imported, and the GPU's CUDA context made, in a background thread of the worker process.

Why: a fresh worker process holds none of them, and every first task that needs a model (a Policy's load, a
scoring replica, a config check) paid for them in its own time: 5-15 s of imports, most of it
``transformers.modeling_utils`` and ``transformers.generation`` (the model's own modelling file is a small part),
then about a second of CUDA initialisation. Started by the worker's preload as soon as the worker has registered,
the same work runs while the rest of the cluster comes up and while the driver checks its arguments, reads its
inputs and parses the model's config: it is no longer on the path between ``Policy(...)`` and a loaded model.
dask-cuda's ``pre_import`` imports modules too, but in the worker's start, which the cluster (``connect()``) then
waits for; in a thread, nothing waits. (Not before the registration: the importing thread holds the GIL most of
the time, and the worker's own start, in the same process, would wait for it. The driver imports nothing in the
background for the same reason: its process runs the local cluster's scheduler, and a thread importing
transformers during ``connect()`` slowed the cluster's start by as much as it saved, 2.0 -> 3.3 s on two cores.)

A task that needs what the warm-up makes calls :func:`wait` first: it does not import the same modules beside it
(two threads importing one package's modules in different orders can deadlock on Python's per-module import
locks). :func:`wait` returns at once in a process that did not warm up (a worker of an attached cluster that
loaded no preload of ours, or a test calling rank code in-process). A warm-up that fails leaves its error to the
task, whose own import then raises it where the user sees it.

``DASK_LM_WARM_WORKERS=0`` turns it off (each worker then imports on its first task). Workers started by hand warm
up with ``dask worker --preload dask_lm.workers.warm``.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Any

__all__ = ["start", "wait", "report", "dask_setup", "MODULES", "COMPILER_MODULES"]

# in order: what a Policy's load and a scoring replica import, heaviest first
MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.models.auto.modeling_auto",
    "dask_lm.model.device",
    "dask_lm.workers.tasks",
    "dask_lm.workers.policy_worker",
    "dask_lm.workers.endpoints",
    "dask_lm.model.load",
)
# where the forward compiles (a GPU): what torch.compile imports on its first call, 2-3 s more (Inductor's lowerings
# and custom ops, AOTAutograd's partitioner)
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx", "torch._functorch.aot_autograd")

_DONE = threading.Event()
_IMPORTED = threading.Condition()  # notified as each module of MODULES has been imported
_STARTED = False
_REPORT: dict[str, Any] = {}


def start(worker: Any = None) -> bool:
    """Start the warm-up thread (once a process); whether it was started. With the Dask ``worker`` whose preload
    starts it, the imports begin once that worker has registered with the scheduler: a thread importing torch holds
    the GIL most of the time, and the worker's registration, which the cluster's start waits for, would wait too."""
    global _STARTED
    if _STARTED or os.environ.get("DASK_LM_WARM_WORKERS", "1") == "0":
        return False
    _STARTED = True
    threading.Thread(target=_warm, args=(worker,), name="dask-lm-warm-up", daemon=True).start()
    return True


def dask_setup(worker: Any) -> None:
    """A Dask preload of its own, for workers started by hand: ``dask worker --preload dask_lm.workers.warm``."""
    start(worker)


def wait(timeout: float | None = None, *, until: str | None = None) -> None:
    """Return once the warm-up has ended; with ``until``, once that step has: a module of :data:`MODULES` imported,
    or ``"device"`` (every module of :data:`MODULES` and the CUDA context; the compiler's imports may still run).
    At once where no warm-up was started."""
    if not _STARTED:
        return
    if until is None:
        _DONE.wait(timeout)
        return
    assert until in MODULES or until == "device", until
    step = "device" if until == "device" else f"import {until}"
    with _IMPORTED:
        _IMPORTED.wait_for(lambda: step in _REPORT.get("steps", {}) or _DONE.is_set(), timeout)


def report() -> dict[str, Any]:
    """When the warm-up began and ended (``time.time()``), and each step's seconds; empty where none ran."""
    return dict(_REPORT)


def _import(name: str) -> None:
    """``name`` imported; once more after a moment where the first try failed: a task of the worker importing the
    same package in its own thread can, under Python's per-module import locks, leave this thread a module that was
    still half-initialised (a second import finds it whole)."""
    try:
        importlib.import_module(name)
    except (ImportError, AttributeError):
        time.sleep(0.5)
        importlib.import_module(name)


def _registered(worker: Any, timeout: float = 60.0) -> None:
    """Until ``worker`` runs (registered with its scheduler), or ``timeout`` seconds, or it stopped starting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = str(getattr(getattr(worker, "status", None), "name", ""))
        if status not in ("undefined", "created", "init", "starting"):  # running; or closing, failed: not starting
            return
        time.sleep(0.02)


def _warm(worker: Any = None) -> None:
    if worker is not None:
        _registered(worker)
    steps: dict[str, float] = {}
    _REPORT.update(began_at=time.time(), steps=steps)
    try:
        for name in MODULES:
            t0 = time.perf_counter()
            _import(name)
            steps[f"import {name}"] = time.perf_counter() - t0
            with _IMPORTED:
                _IMPORTED.notify_all()
        from dask_lm.model import device

        t0 = time.perf_counter()
        device.initialise()
        steps["device"] = time.perf_counter() - t0
        with _IMPORTED:
            _IMPORTED.notify_all()
        if device.compile_capable():
            for name in COMPILER_MODULES:
                t0 = time.perf_counter()
                importlib.import_module(name)
                steps[f"import {name}"] = time.perf_counter() - t0
    except BaseException as e:  # the task that needs the module imports it again and raises it to the user
        _REPORT["error"] = f"{type(e).__name__}: {e}"
    finally:
        _REPORT["ended_at"] = time.time()
        _DONE.set()
        with _IMPORTED:
            _IMPORTED.notify_all()
