"""Project-level guarantees: the driver never touches CUDA, environment.yml matches pyproject, public names."""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


_CUDA = """
import torch
def boom(*a, **k):
    raise RuntimeError("the driver initialised CUDA")
torch.cuda._lazy_init = boom
torch.cuda.init = boom
import dask_lm
from dask_lm.data.validation import validate_input_batch
from dask_lm.engine import cluster
b = dask_lm.BatchedDataDict(input_ids=torch.tensor([[4, 5, 6], [7, 8, 0]]), input_lengths=torch.tensor([3, 2]))
validate_input_batch(b, what="t", vocab_size=10, max_length=8, pad_token_id=0)
b.shard_by_batch_size(2, allow_uneven_shards=True, sequence_packing_args={"input_key": "input_ids",
    "input_lengths_key": "input_lengths", "max_tokens_per_microbatch": 8, "algorithm": "first_fit_decreasing"})
b.to_arrow()
cluster.count_gpus()
assert not torch.cuda.is_initialized()
print("ok")
"""
_HEAVY = """
import sys
import dask_lm, dask_lm.cli
heavy = sorted(m for m in ("torch", "transformers", "distributed", "dask", "pyarrow") if m in sys.modules)
assert not heavy, heavy
from dask_lm import Policy, NLLLoss
assert Policy.__module__ == "dask_lm.engine.policy" and NLLLoss.__module__ == "dask_lm.losses.supervised"
assert "torch" in sys.modules
print("ok")
"""


def _run(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def fresh():
    """The fresh interpreters of this module's tests, started side by side when the first asks (each is mostly an
    interpreter's start-up and an import of torch: on two cores about half the time of one after the other).
    ``{name: a future of its CompletedProcess}`` (a thread each reads its pipes, so none fills and stalls)."""

    def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    runs = {
        "cuda": (_run("-c", _CUDA), 120),
        "heavy": (_run("-c", _HEAVY), 120),
        "version": (_run("-m", "dask_lm", "--version"), 60),
    }
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        yield {name: pool.submit(finish, proc, timeout) for name, (proc, timeout) in runs.items()}


def test_driver_never_initialises_cuda(fresh):
    """Import the package and shard / validate a batch with CUDA initialisation made fatal."""
    out = fresh["cuda"].result()
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _pyproject_deps() -> dict[str, str]:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = data["project"]["dependencies"]
    return {re.split(r"[<>=!\[ ]", d, maxsplit=1)[0].lower(): d for d in deps}


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    # conda-forge spells a few differently
    conda_names = {"torch": "pytorch", "msgpack": "msgpack-python", "huggingface-hub": "huggingface_hub"}
    listed = {re.split(r"[<>=! ]", d, maxsplit=1)[0].lower() for d in env["dependencies"] if isinstance(d, str)}
    pip = [x for d in env["dependencies"] if isinstance(d, dict) for x in d.get("pip", [])]
    assert any(p.startswith("-e .") for p in pip), "environment.yml must install dask-lm itself"
    for name in _pyproject_deps():
        want = conda_names.get(name, name)
        assert want in listed, f"{name} is in pyproject.toml but {want} is not in environment.yml"
    # and nothing in environment.yml that the project does not declare (besides python / pip)
    declared = {conda_names.get(n, n) for n in _pyproject_deps()} | {
        "python",
        "pip",
        "dask-cuda",
        "pytest",
        "pytest-timeout",
    }
    assert listed <= declared, listed - declared


def test_public_names():
    import dask_lm

    for name in dask_lm.__all__:
        assert hasattr(dask_lm, name), name
    assert {"Policy", "PolicyConfig", "BatchedDataDict", "connect"} <= set(dask_lm.__all__)


def test_driver_modules_import_without_torch():
    """``dask_lm.io`` re-exports nothing (it once re-exported ``data.arrow``, which imports torch), and the config
    package is dataclasses only: a driver that resolves a model or reads a config does not pay for torch."""
    for module in ("dask_lm.io.hub", "dask_lm.config"):
        code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "[]", (module, out.stdout, out.stderr)


def test_the_package_and_the_command_import_no_heavy_module(fresh):
    """``import dask_lm`` and the ``dask-lm`` entry point load neither torch, transformers nor distributed (the
    public names import on first use), so ``dask-lm --help`` / ``--version`` answer at once; a public name still
    resolves to its class."""
    out = fresh["heavy"].result()
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    version = fresh["version"].result()
    import tomllib

    import dask_lm

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0 and version.stdout.strip() == f"dask-lm {dask_lm.__version__}"
    assert dask_lm.__version__ == pyproject
