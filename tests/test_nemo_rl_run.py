"""``dask-lm nemo-rl SCRIPT ...``: a NeMo RL entry point run unmodified, with dask-lm's Policy and a Dask cluster
where NeMo RL's ``lm_policy.Policy``, ``RayVirtualCluster`` and ``init_ray`` stand.

CI cannot fetch NeMo RL, so these tests write a small fake of it: a checkout folder with the module paths the runner
replaces (whose own classes raise if they are ever used: they would start Ray) and an entry point shaped like
``examples/run_sft.py`` (argparse ``--config`` plus ``section.key=value`` overrides, ``init_ray()``, a cluster of
``cluster.gpus_per_node x cluster.num_nodes`` bundles, ``Policy(cluster=..., config=..., tokenizer=...)``, then
logprobs and one training step). Its numbers are compared with a one-process Hugging Face reference. The real
NeMo RL scripts are run by ``../shared/nemo_rl_client`` and by hand (docs/guides/nemo_rl.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers
from helpers import hf_logprobs, hf_nll_steps, model_logprobs

ROOT = pathlib.Path(__file__).resolve().parents[1]

# NeMo RL's module paths that the runner replaces names in, each name raising if NeMo RL's own would run
_RAISE = "raise RuntimeError('the fake NeMo RL {} ran: NeMo RL would start Ray here')"
FAKE_NEMO_RL = {
    "nemo_rl/__init__.py": "",
    "nemo_rl/distributed/__init__.py": "",
    "nemo_rl/distributed/virtual_cluster.py": f"""
class RayVirtualCluster:
    def __init__(self, *args, **kwargs):
        {_RAISE.format("RayVirtualCluster")}


def init_ray(log_dir=None):
    {_RAISE.format("init_ray")}
""",
    # NeMo RL's, as dask-lm mirrors it
    "nemo_rl/distributed/batched_data_dict.py": "from dask_lm import BatchedDataDict\n",
    "nemo_rl/models/__init__.py": "",
    "nemo_rl/models/policy/__init__.py": "",
    "nemo_rl/models/policy/lm_policy.py": f"""
class Policy:
    def __init__(self, *args, **kwargs):
        {_RAISE.format("Policy")}
""",
    "nemo_rl/algorithms/__init__.py": "",
    # as nemo_rl/algorithms/sft.py: the names imported when the module loads, before the runner could patch them
    # in a plain import; the loss class lives in nemo_rl, so the Dask workers must import this checkout to unpickle it
    "nemo_rl/algorithms/fake_sft.py": """
from dask_lm.losses import NLLLossFn as _NLL
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.policy.lm_policy import Policy


class NLLLossFn(_NLL):
    pass


def setup(cluster_config, policy_config, tokenizer):
    cluster = RayVirtualCluster(
        name="sft_cluster", bundle_ct_per_node_list=[cluster_config["gpus_per_node"]] * cluster_config["num_nodes"],
        use_gpus=True, num_gpus_per_node=cluster_config["gpus_per_node"], max_colocated_worker_groups=1,
        port_range_low=None, port_range_high=None, segment_size=None, node_resource_constraints=None)
    policy = Policy(cluster=cluster, config=policy_config, tokenizer=tokenizer, processor=None, weights_path=None,
                    optimizer_path=None, init_optimizer=True, init_reference_model=False)
    return policy, cluster
""",
    "nemo_rl/algorithms/late.py": "from nemo_rl.models.policy.lm_policy import Policy\n",
    "examples/run_fake.py": """
import argparse
import json
import sys

import torch
import transformers

from nemo_rl.algorithms.fake_sft import NLLLossFn, setup
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import init_ray


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    args, overrides = parser.parse_known_args()
    with open(args.config) as f:
        config = json.load(f)
    for override in overrides:  # Hydra's section.key=value, enough of it
        key, value = override.split("=", 1)
        section, name = key.split(".")
        config[section][name] = json.loads(value)
    if config.get("exit_code") is not None:
        sys.exit(config["exit_code"])
    init_ray()
    tokenizer = transformers.AutoTokenizer.from_pretrained(config["policy"]["model_name"])
    policy, cluster = setup(config["cluster"], config["policy"], tokenizer)
    result = {"mro": [f"{c.__module__}.{c.__qualname__}" for c in type(policy).__mro__], "argv": sys.argv,
              "world_size": cluster.world_size(), "data_parallel_size": policy.data_parallel_size}
    if config.get("texts"):
        enc = tokenizer(config["texts"], padding=True, return_tensors="pt")
        batch = BatchedDataDict(input_ids=enc["input_ids"], input_lengths=enc["attention_mask"].sum(1),
                                token_mask=enc["attention_mask"].float(), sample_mask=torch.ones(len(config["texts"])))
        result["logprobs"] = policy.get_logprobs(batch)["logprobs"].tolist()
        out = policy.train(batch, NLLLossFn())
        result["loss"], result["grad_norm"] = float(out["loss"][0]), float(out["grad_norm"][0])
        result["logprobs_after"] = policy.get_logprobs(batch)["logprobs"].tolist()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
""",
}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Dask",
    "Tokens flow through the cluster of workers.",
    "Parquet files store columns.",
]
LR, MAX_GRAD_NORM = 0.5, 1.0


def _checkout(root: pathlib.Path, **replace: str) -> pathlib.Path:
    for rel, text in {**FAKE_NEMO_RL, **replace}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _config(tmp_path: pathlib.Path, model: str, **extra) -> str:
    config = {
        "cluster": {"gpus_per_node": 1, "num_nodes": 1},
        "policy": {
            "model_name": model,
            "precision": "float32",
            "train_global_batch_size": len(TEXTS),
            "train_micro_batch_size": 2,
            "logprob_batch_size": 2,
            "max_total_sequence_length": 128,
            "max_grad_norm": MAX_GRAD_NORM,
            "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": LR}},
        },
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _start(*args: str, cwd: pathlib.Path, pythonpath: str = str(ROOT)) -> subprocess.Popen:
    # CPU workers whatever the machine has; nemo_rl only from the fake checkout the script is in
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "DASK_LM_PROGRESS": "0",
    }
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "dask_lm", "nemo-rl", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _dask_lm(*args: str, cwd: pathlib.Path, pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess:
    return _finish(_start(*args, cwd=cwd, pythonpath=pythonpath))


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.cluster
def test_a_nemo_rl_script_trains_on_a_local_dask_cluster_sized_from_its_config(tmp_path, tiny):
    """The script runs as ``__main__`` with its own arguments; ``init_ray`` starts nothing; the cluster is 2 local
    workers because the override says ``cluster.gpus_per_node=2``; the Policy NeMo RL's module hands out is
    dask-lm's, on both workers; its logprobs and one SGD step equal a one-process HF forward and step."""
    checkout = _checkout(tmp_path / "RL")
    script = checkout / "examples" / "run_fake.py"
    config = _config(tmp_path, tiny["llama"], texts=TEXTS)
    done = _dask_lm(str(script), "--config", config, "cluster.gpus_per_node=2", cwd=tmp_path)
    result = _result(done)
    assert result["argv"] == [str(script), "--config", config, "cluster.gpus_per_node=2"]
    assert result["mro"][:2] == ["dask_lm.compat.nemo_rl_run.NemoRLPolicy", "dask_lm.engine.policy.Policy"]
    assert result["world_size"] == 2 and result["data_parallel_size"] == 2
    assert "dask-lm: NeMo RL's Policy runs on the Dask cluster at tcp://127.0.0.1:" in done.stdout

    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    ids, lens, mask = enc["input_ids"], enc["attention_mask"].sum(1), enc["attention_mask"].float()
    expected, _ = hf_logprobs(tiny["llama"], ids, lens)
    torch.testing.assert_close(torch.tensor(result["logprobs"]), expected, atol=1e-4, rtol=0)
    losses, norms, model = hf_nll_steps(
        tiny["llama"], [(ids, lens, mask, torch.ones(len(TEXTS)))], lr=LR, max_grad_norm=MAX_GRAD_NORM
    )
    assert result["loss"] == pytest.approx(losses[0], abs=1e-5)
    assert result["grad_norm"] == pytest.approx(norms[0], rel=1e-5)
    torch.testing.assert_close(
        torch.tensor(result["logprobs_after"]), model_logprobs(model, ids, lens), atol=1e-4, rtol=0
    )


@pytest.mark.cluster
def test_an_attached_cluster_gives_the_config_its_workers_and_stays_up(tmp_path, tiny, attached_cluster):
    """With ``--scheduler-address`` the Policy takes as many of the cluster's workers as the config asks for (2 of
    3), the cluster is left running, and a config asking for more workers than it has exits 2 naming the keys."""
    from distributed import Client

    sched = attached_cluster(3)
    script = _checkout(tmp_path / "RL") / "examples" / "run_fake.py"
    config = _config(tmp_path, tiny["llama"])
    with Client(scheduler_file=str(sched)) as c:
        c.wait_for_workers(3, timeout=120)
    done = _dask_lm(
        "--scheduler-address", str(sched), str(script), "--config", config, "cluster.gpus_per_node=2", cwd=tmp_path
    )
    result = _result(done)
    assert result["world_size"] == 2 and result["data_parallel_size"] == 2

    done = _dask_lm(
        "--scheduler-address",
        str(sched),
        str(script),
        "--config",
        config,
        "cluster.gpus_per_node=2",
        "cluster.num_nodes=2",
        cwd=tmp_path,
    )
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-3000:])
    assert (
        "asks for 4 GPU worker(s) (cluster.gpus_per_node=2 x cluster.num_nodes=2), but the Dask cluster at "
        in done.stderr
        and "has 3 worker(s)" in done.stderr
    ), done.stderr
    with Client(scheduler_file=str(sched)) as c:
        assert len(c.scheduler_info()["workers"]) == 3  # neither run closed the attached cluster


# a package that is there but fails as a missing Ray does, first on the path (a real Ray may be installed)
_NO_RAY = 'raise ModuleNotFoundError("No module named \'ray\'", name="ray")\n'


_STOPS = ["no script", "not python", "no nemo_rl", "no ray", "script exits 3"]


def _start_stop_case(tmp_path: pathlib.Path, case: str) -> subprocess.Popen:
    """The command of one case of the test below, its files written under ``tmp_path``, started."""
    checkout = _checkout(
        tmp_path / "RL", **({"nemo_rl/distributed/virtual_cluster.py": "import ray\n"} if case == "no ray" else {})
    )
    script, pythonpath, config = str(checkout / "examples" / "run_fake.py"), str(ROOT), _config(tmp_path, "unused")
    if case == "no script":
        script = "missing.py"
    elif case == "not python":
        script = str(checkout / "nemo_rl" / "__init__.py").replace(".py", ".txt")
        pathlib.Path(script).write_text("")
    elif case == "no nemo_rl":  # a script outside any checkout
        script = str(tmp_path / "run_fake.py")
        pathlib.Path(script).write_text(FAKE_NEMO_RL["examples/run_fake.py"])
    elif case == "no ray":
        (tmp_path / "shadow" / "ray").mkdir(parents=True)
        (tmp_path / "shadow" / "ray" / "__init__.py").write_text(_NO_RAY)
        pythonpath = os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])
    elif case == "script exits 3":
        config = _config(tmp_path, "unused", exit_code=3)
    return _start(script, "--config", config, cwd=tmp_path, pythonpath=pythonpath)


@pytest.fixture(scope="module")
def stops(tmp_path_factory):
    """The five cases' commands, started side by side when the first case's test asks: each is little more than an
    interpreter's start-up (torch imported), so on two cores they take about half the time of one after the other.
    Returns ``{case: a future of its CompletedProcess}`` (a thread each reads its pipes, so none fills and stalls)."""
    with concurrent.futures.ThreadPoolExecutor(len(_STOPS)) as pool:
        procs = {case: _start_stop_case(tmp_path_factory.mktemp("stop"), case) for case in _STOPS}
        yield {case: pool.submit(_finish, proc) for case, proc in procs.items()}


@pytest.mark.parametrize("case", _STOPS)
def test_what_stops_before_any_cluster_says_what_to_do(stops, case):
    """Exit 2 with one line naming the fix (docs/reference/exit-codes.md) for a missing SCRIPT, a NeMo RL that is
    not installed, and a NeMo RL that cannot import Ray; the script's own exit code passes through."""
    expected = {
        "no script": "SCRIPT 'missing.py' does not exist",
        "not python": "is not a Python file",
        "no nemo_rl": "NeMo RL is not installed (no module named 'nemo_rl'): `pip install nemo-rl`",
        "no ray": "NeMo RL imports Ray when its modules load (nemo_rl.distributed.virtual_cluster imports "
        "ray), though dask-lm never starts it: `pip install ray`",
    }.get(case)
    done = stops[case].result()
    if case == "script exits 3":
        assert done.returncode == 3 and "Error" not in done.stderr, (done.returncode, done.stderr[-3000:])
        return
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and expected in errors[0], done.stderr[-3000:]


def test_the_names_are_replaced_in_every_nemo_rl_module_and_put_back(tmp_path, monkeypatch):
    """``patched()`` replaces the three names in NeMo RL's own modules and in modules that imported them before or
    during the block, and puts NeMo RL's back after it. No cluster starts: none is asked for."""
    from dask_lm.compat import nemo_rl_run

    checkout = _checkout(tmp_path / "RL")
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "nemo_rl" or k.startswith("nemo_rl.")}
    monkeypatch.syspath_prepend(str(checkout))
    try:
        import nemo_rl.algorithms.fake_sft as early
        from nemo_rl.distributed import virtual_cluster
        from nemo_rl.models.policy import lm_policy

        originals = (virtual_cluster.RayVirtualCluster, virtual_cluster.init_ray, lm_policy.Policy)
        with nemo_rl_run.patched():
            import nemo_rl.algorithms.late as late

            assert lm_policy.Policy is early.Policy is late.Policy is nemo_rl_run.NemoRLPolicy
            assert early.RayVirtualCluster is virtual_cluster.RayVirtualCluster
            assert issubclass(virtual_cluster.RayVirtualCluster, nemo_rl_run.DaskVirtualCluster)
            assert virtual_cluster.init_ray() is None
        assert (virtual_cluster.RayVirtualCluster, virtual_cluster.init_ray, lm_policy.Policy) == originals
        assert early.Policy is late.Policy is originals[2] and early.RayVirtualCluster is originals[0]
    finally:
        for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
            del sys.modules[k]
        sys.modules.update(ours)
