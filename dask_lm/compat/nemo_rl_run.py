"""Run one of NeMo RL's entry points (``examples/run_sft.py``, ``run_dpo.py``, ...) on a Dask cluster, unmodified.

>>> from dask_lm.compat import nemo_rl_run
>>> nemo_rl_run.run("examples/run_sft.py", ["--config", "my_sft.yaml", "cluster.gpus_per_node=2"])

The script runs as ``python SCRIPT ARGS...`` would run it (``__main__``, its own ``sys.argv``, its folder first on
``sys.path``), against the NeMo RL that this interpreter imports, with three of NeMo RL's names standing for
dask-lm's, for the length of the run:

- ``nemo_rl.models.policy.lm_policy.Policy``: :class:`NemoRLPolicy`, ``dask_lm.Policy`` taking NeMo RL's
  constructor arguments, its ``cluster`` being the stand-in below;
- ``nemo_rl.distributed.virtual_cluster.RayVirtualCluster``: :class:`DaskVirtualCluster`, the Dask workers that
  NeMo RL's placement groups would have held, one per GPU it asks for (``sum(bundle_ct_per_node_list)``, which
  NeMo RL's SFT and DPO setups make ``cluster.gpus_per_node * cluster.num_nodes``: ``nemo_rl/algorithms/sft.py:190``,
  ``dpo.py:246``);
- ``nemo_rl.distributed.virtual_cluster.init_ray``: starts nothing.

The names are replaced in those two modules and in every ``nemo_rl`` module that had imported them already, and
put back when the run ends. The Dask cluster is the one at ``scheduler_address`` (or ``$DASK_SCHEDULER_ADDRESS``),
else a local one that :func:`dask_lm.connect` starts when NeMo RL asks for its first cluster, sized to it (GPU
workers through dask-cuda where GPUs are visible, CPU workers otherwise), and stops when the run ends.

Nothing else of Ray is imitated: NeMo RL still imports Ray (``nemo_rl/distributed/virtual_cluster.py:21``), so it
must be installed, and what NeMo RL runs as Ray actors beyond the Policy (environments, vLLM / SGLang generation
workers) stops with an error that names it (docs/guides/nemo_rl.md).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import runpy
import sys
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from dask_lm.engine.policy import Policy
from dask_lm.interface import opt

__all__ = ["run", "patched", "NemoRLPolicy", "DaskVirtualCluster"]

# NeMo RL's module -> its names that dask-lm stands in for
REPLACED = {
    "nemo_rl.distributed.virtual_cluster": ("RayVirtualCluster", "init_ray"),
    "nemo_rl.models.policy.lm_policy": ("Policy",),
}
GUIDE = "docs/guides/nemo_rl.md"


class _Session:
    """The one Dask client of a run: attached to ``scheduler_address``, or a local cluster started by the first
    virtual cluster NeMo RL asks for (sized to it), and closed with the run."""

    def __init__(self, scheduler_address: str | None) -> None:
        self.scheduler_address = scheduler_address or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
        self.client: Any = None
        self.main = sys.modules["__main__"]  # the process's own, before a script runs as __main__
        self.policies: weakref.WeakSet[Policy] = weakref.WeakSet()

    def workers_for(self, name: str, world_size: int, gpus_per_node: int, num_nodes: int) -> list[Any]:
        """The names of the ``world_size`` workers virtual cluster ``name`` stands for (the first by name)."""
        from dask_lm.engine import cluster
        from dask_lm.engine.worker_group import live_workers

        asked = (
            f"NeMo RL's {name or 'cluster'} asks for {world_size} GPU worker(s) (cluster.gpus_per_node="
            f"{gpus_per_node} x cluster.num_nodes={num_nodes})"
        )
        if self.client is None:
            if self.scheduler_address is None:
                gpus = cluster.count_gpus()
                if 0 < gpus < world_size:
                    raise ValueError(
                        f"{asked}, but this machine has {gpus} GPU(s): set cluster.gpus_per_node="
                        f"{gpus} cluster.num_nodes=1, or attach to a Dask cluster with "
                        f"{opt('scheduler_address', meta='ADDRESS')}"
                    )
                with _main_module(self.main):
                    self.client = cluster.connect(n_workers=world_size)
            else:
                self.client = cluster.connect(self.scheduler_address)
            print(
                f"dask-lm: NeMo RL's Policy runs on the Dask cluster at {self.client.scheduler.address} "
                f"(dashboard {self.client.dashboard_link})",
                flush=True,
            )
        names = sorted((w["name"] for w in live_workers(self.client)["workers"].values()), key=_name_key)
        if len(names) < world_size:
            raise ValueError(
                f"{asked}, but the Dask cluster at {self.client.scheduler.address} has "
                f"{len(names)} worker(s): start more workers, or set cluster.gpus_per_node and "
                "cluster.num_nodes to what it has"
            )
        return names[:world_size]

    def close(self) -> None:
        from dask_lm.engine.cluster import close

        for policy in list(self.policies):  # before the client goes: each frees its ranks' state
            with contextlib.suppress(Exception):
                policy.shutdown()
        if self.client is not None:
            close(self.client)  # a local cluster stops with it; an attached one stays up
            self.client = None


@contextlib.contextmanager
def _main_module(main: types.ModuleType) -> Iterator[None]:
    """The process's own ``__main__`` while a local cluster starts: its worker processes are spawned, and a spawned
    process imports the parent's ``__main__`` file first, which would be NeMo RL's script (all of NeMo RL, with
    Ray) in every worker. Workers import what they unpickle (NeMo RL's loss classes) on demand instead."""
    running = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        yield
    finally:
        sys.modules["__main__"] = running


def _name_key(name: Any) -> tuple[int, Any]:
    # rank order, as the Policy's worker group sorts names: numbers by value, then the rest as strings
    return (0, int(name)) if str(name).isdigit() else (1, str(name))


class DaskVirtualCluster:
    """What NeMo RL's ``RayVirtualCluster(...)`` becomes: the Dask workers of its bundles, one per GPU.

    It takes NeMo RL's constructor arguments (``nemo_rl/distributed/virtual_cluster.py:764``); placement (strategy,
    ports, NVLink segments) is Dask's, and those arguments are not used. ``client`` and ``workers`` are what
    :class:`NemoRLPolicy` gives ``dask_lm.Policy``. The methods that hand out Ray placement groups or a rendezvous
    address serve NeMo RL's Ray workers (vLLM, SGLang, TRT-LLM generation; collective refit between clusters): they
    raise, naming what asked.
    """

    session: _Session  # set on the per-run subclass that :func:`patched` makes

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = True,
        max_colocated_worker_groups: int = 1,
        num_gpus_per_node: int = 8,
        name: str = "",
        **_placement: Any,
    ) -> None:
        self.name = name
        self._bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.num_gpus_per_node = num_gpus_per_node
        self.use_gpus = use_gpus
        self.max_colocated_worker_groups = max_colocated_worker_groups
        world = sum(self._bundle_ct_per_node_list)
        if world < 1:
            raise ValueError(
                f"NeMo RL's {name or 'cluster'} asks for no GPU (bundle_ct_per_node_list="
                f"{self._bundle_ct_per_node_list}): set cluster.gpus_per_node and cluster.num_nodes"
            )
        self.workers = self.session.workers_for(name, world, num_gpus_per_node, self.node_count())
        self.client = self.session.client

    def world_size(self) -> int:
        return sum(self._bundle_ct_per_node_list)

    def node_count(self) -> int:
        return sum(1 for n in self._bundle_ct_per_node_list if n > 0)

    def shutdown(self) -> bool:
        return True  # the run closes its Dask client once, when the script ends

    def _ray_only(self, what: str) -> Any:
        raise RuntimeError(
            f"NeMo RL asked its {self.name or 'cluster'} for {what}, which only its Ray workers use "
            "(vLLM / SGLang / TRT-LLM generation, or a weight transfer between two clusters): dask-lm "
            f"runs the Policy, not those workers. See '{GUIDE}' for what dask-lm offers instead"
        )

    def get_placement_groups(self) -> Any:
        return self._ray_only("Ray placement groups")

    def get_master_address_and_port(self) -> Any:
        return self._ray_only("a rendezvous address (get_master_address_and_port)")

    def get_available_address_and_port(self, *args: Any, **kwargs: Any) -> Any:
        return self._ray_only("a free port on a Ray node")

    def get_available_addresses_and_ports_batch(self, *args: Any, **kwargs: Any) -> Any:
        return self._ray_only("free ports on its Ray nodes")


class NemoRLPolicy(Policy):
    """``dask_lm.Policy`` with NeMo RL's constructor (``nemo_rl/models/policy/lm_policy.py:90``): ``cluster`` is
    the :class:`DaskVirtualCluster` NeMo RL made, whose workers become the ranks. A Dask client, cluster or
    scheduler address is taken too, as ``dask_lm.Policy`` takes it."""

    def __init__(
        self,
        cluster: Any,
        config: Any,
        tokenizer: Any,
        name_prefix: str = "lm_policy",
        workers_per_node: int | list[int] | None = None,
        init_optimizer: bool = True,
        weights_path: Any = None,
        optimizer_path: Any = None,
        init_reference_model: bool = True,
        processor: Any = None,
        worker_extension_cls_fqn: str | None = None,
        skip_weight_load: bool = False,
    ) -> None:
        workers = None
        if isinstance(cluster, DaskVirtualCluster):
            cluster.session.policies.add(self)
            if isinstance(workers_per_node, list):  # NeMo RL's per-node counts: the cluster's first workers
                workers = cluster.workers[: sum(workers_per_node)]
            elif workers_per_node is None:
                workers = cluster.workers
            cluster = cluster.client
        if isinstance(workers_per_node, list):
            workers_per_node = None
        super().__init__(
            cluster,
            config,
            tokenizer,
            name_prefix=name_prefix,
            workers_per_node=workers_per_node,
            init_optimizer=init_optimizer,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_reference_model=init_reference_model,
            processor=processor,
            worker_extension_cls_fqn=worker_extension_cls_fqn,
            skip_weight_load=skip_weight_load,
            workers=workers,
        )


def _init_ray(log_dir: str | None = None) -> None:
    """NeMo RL's ``init_ray``: Ray is not started (the Dask cluster starts with the first virtual cluster)."""


def _import_nemo_rl(script: str | None) -> dict[str, types.ModuleType]:
    """NeMo RL's two modules whose names are replaced, imported; a ``ValueError`` naming the fix when NeMo RL, or
    Ray, which it imports, is missing. A script of a NeMo RL checkout finds that checkout when nothing else does."""
    top = sys.modules.get("nemo_rl")
    if top is not None and getattr(top, "_dask_lm_alias", False):
        raise ValueError(
            "`nemo_rl` in this process is dask-lm's alias (dask_lm.compat.nemo_rl.install()), not NeMo "
            "RL: run the recipe in a fresh process"
        )
    if top is None and importlib.util.find_spec("nemo_rl") is None:
        root = _checkout_root(script)
        if root is None:
            raise ValueError(
                "NeMo RL is not installed (no module named 'nemo_rl'): `pip install nemo-rl`, or run a "
                "script of a NeMo RL checkout, or put the checkout on PYTHONPATH"
            )
        sys.path.insert(0, root)
    modules = {}
    for name in REPLACED:
        try:
            modules[name] = importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing == "ray" or missing.startswith("ray."):
                raise ValueError(
                    f"NeMo RL imports Ray when its modules load ({name} imports {missing}), though "
                    "dask-lm never starts it: `pip install ray` (a dependency of NeMo RL)"
                ) from e
            raise ValueError(
                f"NeMo RL's {name} imports {missing!r}, which is not installed: install NeMo RL with "
                "its dependencies (`pip install nemo-rl`)"
            ) from e
    return modules


def _checkout_root(script: str | None) -> str | None:
    here = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
    while True:
        if os.path.isfile(os.path.join(here, "nemo_rl", "__init__.py")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _rebind(pairs: list[tuple[Any, Any]]) -> None:
    """In every ``nemo_rl`` module, each attribute that is (by identity) the first of a pair becomes its second:
    ``from nemo_rl.models.policy.lm_policy import Policy``, run before or during the block, binds the same."""
    table = {id(old): (old, new) for old, new in pairs}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "nemo_rl" or mod_name.startswith("nemo_rl.")):
            continue
        for attr, value in list(vars(mod).items()):
            found = table.get(id(value))
            if found is not None and found[0] is value:
                setattr(mod, attr, found[1])


@contextlib.contextmanager
def patched(scheduler_address: str | None = None, *, script: str | None = None) -> Iterator[None]:
    """The block runs NeMo RL with dask-lm's Policy and a Dask cluster in place of its Ray ones (the module's
    docstring says which names); they are put back, and the Dask client closed, when the block ends."""
    modules = _import_nemo_rl(script)
    session = _Session(scheduler_address)
    cluster_cls = type("RayVirtualCluster", (DaskVirtualCluster,), {"session": session, "__module__": __name__})
    ours = {"RayVirtualCluster": cluster_cls, "init_ray": _init_ray, "Policy": NemoRLPolicy}
    pairs = [(getattr(modules[m], n), ours[n]) for m, names in REPLACED.items() for n in names]
    _rebind(pairs)
    try:
        yield
    finally:
        try:
            session.close()
        finally:
            _rebind([(new, old) for old, new in pairs])


def run(script: str, args: Sequence[str] = (), *, scheduler_address: str | None = None) -> None:
    """Run NeMo RL's entry point ``script`` with ``args`` as its command line, as ``python script args...`` would,
    with dask-lm's Policy on a Dask cluster (:func:`patched`). A ``SystemExit`` of the script (argparse's, or its own
    ``sys.exit``) passes through; ``sys.argv`` and ``sys.path`` are restored after."""
    if not script.endswith(".py") or not os.path.isfile(script):
        what = "does not exist" if not os.path.exists(script) else "is not a Python file"
        raise ValueError(
            f"SCRIPT {script!r} {what}: give the path of a NeMo RL entry point, such as "
            "examples/run_sft.py of a NeMo RL checkout"
        )
    argv, path = sys.argv[:], sys.path[:]
    try:
        with patched(scheduler_address, script=script):
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv[:], sys.path[:] = argv, path
