"""A model folder's own Python never runs, whatever the terminal: a config or tokenizer config with ``auto_map`` is
refused up front by every entry (``Policy``, ``dask-lm logprobs``, ``dask-lm score``, the lm-eval model), and every
transformers load in the package passes ``trust_remote_code=False``.

transformers asks "Do you wish to run the custom code? [y/N]" on its stdin when a config names code of its own and
``trust_remote_code`` is not given: answered ``y``, it imports the folder's modules in the asking process. The
tests run each entry in a pseudo-terminal, answer ``y`` to any such question, and check that the modules, which
write a marker file when imported, never ran."""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import json
import os
import pathlib
import pty
import select
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.io import modelcheck

ROOT = pathlib.Path(dask_lm.__file__).resolve().parent.parent  # the tree under test, for the subprocesses
NOBODY = "tcp://127.0.0.1:9"  # a scheduler address nothing listens on: a refused entry never gets that far

_MODULE = """import pathlib
pathlib.Path({marker!r}).open("a").write("{name} ran\\n")
{body}
"""
_BODIES = {
    "configuration_evil": "from transformers import LlamaConfig\n\n\nclass EvilConfig(LlamaConfig):\n"
    "    model_type = 'evil_llama'\n",
    "modeling_evil": "from transformers import LlamaForCausalLM\n\n\nclass EvilForCausalLM(LlamaForCausalLM):\n"
    "    pass\n",
    "tokenization_evil": "from transformers import PreTrainedTokenizerFast\n\n\n"
    "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n",
}


def _edit_json(path: pathlib.Path, **changes) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def _evil(tiny: dict, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of the tiny Llama whose config and tokenizer config name modules of its own folder (a model type
    transformers does not ship, so that transformers asks before running them); each module appends a line to
    ``marker`` when imported. Returns (model directory, marker path)."""
    model, marker = tmp_path / "evil-model", tmp_path / "code-ran.txt"
    shutil.copytree(tiny["llama"], model)
    for name, body in _BODIES.items():
        (model / f"{name}.py").write_text(_MODULE.format(marker=str(marker), name=name, body=body))
    _edit_json(
        model / "config.json",
        model_type="evil_llama",
        architectures=["EvilForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        },
    )
    _edit_json(
        model / "tokenizer_config.json",
        tokenizer_class="EvilTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]},
    )
    return model, marker


def _in_terminal(args: list[str], tmp_path: pathlib.Path) -> tuple[int, str, int]:
    """Run ``args`` with a pseudo-terminal as stdin, stdout and stderr, answering ``y`` to every "[y/N]" question.
    Returns (exit code, everything it printed, questions answered)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_MODULES_CACHE": str(tmp_path / "hf-modules"),
        "HF_HUB_OFFLINE": "1",
        "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "5s",
        "TERM": "dumb",
    }
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        args, stdin=secondary, stdout=secondary, stderr=secondary, env=env, cwd=tmp_path, start_new_session=True
    )
    os.close(secondary)
    out, answered = b"", 0
    give_up = time.monotonic() + 480  # a guard against a hang only, inside pytest-timeout's 600 s
    try:
        while True:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # EIO: every holder of the terminal's other end has closed it
                    chunk = b""
                if not chunk:
                    break
                out += chunk
                if out.count(b"[y/N]") > answered:
                    os.write(primary, b"y\n")
                    answered += 1
            elif proc.poll() is not None:
                break
            if time.monotonic() > give_up:
                proc.kill()
                raise AssertionError(f"{args[:4]} hung; it printed:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        os.close(primary)
    return proc.wait(), out.decode(errors="replace").replace("\r\n", "\n"), answered


_POLICY = """
import sys, transformers, dask_lm
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[2], trust_remote_code=False)
try:
    dask_lm.Policy({nobody!r}, {{"model_name": sys.argv[1]}}, tokenizer, init_optimizer=False,
                   init_reference_model=False)
except ValueError as e:
    print("ValueError:", e)
    sys.exit(2)
"""
_LM_EVAL = """
import sys
from dask_lm.harness import DaskLM
try:
    DaskLM(pretrained=sys.argv[1], scheduler_address={nobody!r})
except ValueError as e:
    print("ValueError:", e)
    sys.exit(2)
"""


_ENTRIES = ["Policy", "logprobs", "score", "lm-eval"]


def _in_terminal_refusal(entry: str, tiny: dict, tmp_path: pathlib.Path) -> tuple:
    """One entry given its own copy of the model in ``tmp_path``, run in a terminal: ``(model, marker, exit code,
    everything it printed, questions answered)``."""
    model, marker = _evil(tiny, tmp_path)
    if entry == "Policy":
        args = [sys.executable, "-c", _POLICY.format(nobody=NOBODY), str(model), tiny["llama"]]
    elif entry == "lm-eval":
        args = [sys.executable, "-c", _LM_EVAL.format(nobody=NOBODY), str(model)]
    elif entry == "logprobs":
        args = [
            sys.executable,
            "-m",
            "dask_lm",
            "logprobs",
            "--model",
            str(model),
            "--scheduler-address",
            NOBODY,
            "a text",
        ]
    else:
        data = tmp_path / "data.parquet"
        pq.write_table(pa.table({"text": ["a text", "another text"]}), data)
        args = [
            sys.executable,
            "-m",
            "dask_lm",
            "score",
            str(data),
            "--model",
            str(model),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "out"),
            "--scheduler-address",
            NOBODY,
            "--no-progress",
        ]
    return (model, marker, *_in_terminal(args, tmp_path))


@pytest.fixture(scope="module")
def refusals(tiny, tmp_path_factory):
    """The entries' runs, side by side from the first test that asks (each an interpreter's start-up, most of it
    importing torch and transformers: on two cores about half the time of one after the other).
    ``{entry: a future of its _in_terminal_refusal}``; lm-eval's only where it is installed."""
    entries = [e for e in _ENTRIES if e != "lm-eval" or importlib.util.find_spec("lm_eval") is not None]
    with concurrent.futures.ThreadPoolExecutor(len(entries)) as pool:
        yield {e: pool.submit(_in_terminal_refusal, e, tiny, tmp_path_factory.mktemp("entry")) for e in entries}


@pytest.mark.parametrize("entry", _ENTRIES)
def test_a_model_with_auto_map_is_refused_in_a_terminal_and_its_code_never_runs(refusals, entry):
    if entry == "lm-eval":
        pytest.importorskip("lm_eval")
    model, marker, code, out, answered = refusals[entry].result()
    assert not marker.exists(), f"the model's own code ran ({marker.read_text()!r}); output:\n{out[-3000:]}"
    assert code == 2, out[-3000:]
    flat = " ".join(out.split())  # the terminal wraps nothing, but the message may span lines
    assert f'{model / "config.json"} has "auto_map"' in flat, out[-3000:]
    assert "dask-lm runs only the classes transformers ships" in flat, out[-3000:]
    assert answered == 0 and "[y/N]" not in out, out[-3000:]  # nobody was asked


def test_a_tokenizer_with_auto_map_is_refused_naming_its_file(tiny, tmp_path, no_cluster):
    """A tokenizer of its own (``--tokenizer``) with ``auto_map``, beside a model transformers ships: refused,
    naming tokenizer_config.json, before any cluster."""
    tok = tmp_path / "tok"
    shutil.copytree(tiny["tokenizer"], tok)
    _edit_json(tok / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "tokenization_x.XTokenizer"]})
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["a text"]}), data)
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(data),
            "--model",
            tiny["llama"],
            "--tokenizer",
            str(tok),
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert (
        f"--tokenizer '{tok}': {tok / 'tokenizer_config.json'} has \"auto_map\" (tokenization_x.XTokenizer)" in flat
    ), result.output
    assert 'If transformers ships this tokenizer, delete "auto_map" from tokenizer_config.json' in flat
    assert not no_cluster and not (tmp_path / "out").exists()


def test_auto_map_is_refused_even_where_transformers_ships_the_architecture(tiny, tmp_path):
    """A Llama config that also names code of its own: transformers would load its own Llama classes when told
    ``trust_remote_code=False``, but which code the folder meant is not for dask-lm to guess: refused, with the fix
    (delete the entry) for the user who knows the two agree."""
    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    _edit_json(model / "config.json", auto_map={"AutoConfig": "configuration_x.XConfig"})
    with pytest.raises(
        ValueError,
        match=r"has \"auto_map\" \(configuration_x\.XConfig\).*If transformers ships "
        r"this architecture \(model_type 'llama'\), delete \"auto_map\" from "
        r"config\.json",
    ):
        dask_lm.Policy(object(), {"model_name": str(model)}, None, init_optimizer=False, init_reference_model=False)


_LOADERS = {"from_pretrained", "from_config"}


def test_every_transformers_load_in_the_package_passes_trust_remote_code_false():
    """Every ``X.from_pretrained(...)`` / ``X.from_config(...)`` call in ``dask_lm/`` says
    ``trust_remote_code=False`` (a keyword, or a ``**kwargs`` dict literal that holds it), so that no load can ask
    the terminal, whichever entry reached it. dask-lm's own ``FLOPTracker.from_config`` is not a transformers
    load."""
    missing = []
    for path in sorted((ROOT / "dask_lm").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        dicts = {}  # name -> keys of a dict literal assigned to it (rank_model builds from_pretrained's kwargs so)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Dict)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                dicts[node.targets[0].id] = {
                    k.value: v for k, v in zip(node.value.keys, node.value.values) if isinstance(k, ast.Constant)
                }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOADERS):
                continue
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "FLOPTracker":
                continue
            given = {k.arg: k.value for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    given.update({key: v for key, v in dicts.get(k.value.id, {}).items()})
            value = given.get("trust_remote_code")
            if not (isinstance(value, ast.Constant) and value.value is False):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    assert not missing, "loads without trust_remote_code=False:\n" + "\n".join(missing)


def test_refuse_remote_code_passes_a_plain_model(tiny):
    """The check refuses only what asks for code: the fixtures' models and tokenizer pass it (a check that refused
    everything would pass the tests above)."""
    for name in ("llama", "qwen2", "tokenizer"):
        modelcheck.refuse_remote_code(tiny[name])
    assert modelcheck.check_model(tiny["llama"], load_config=False).path == tiny["llama"]
