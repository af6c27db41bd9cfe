"""No module of dask_lm unpickles: an ``ast`` audit of every ``.py`` under ``dask_lm/`` (so comments and docstrings
do not count), with the audit itself tested on small good and bad snippets so that it cannot pass by checking
nothing.

Flagged, naming file:line: any use of ``pickle`` / ``_pickle`` / ``cloudpickle`` / ``dill`` ``load`` or ``loads``
(and ``pandas.read_pickle``), however imported (``from pickle import loads as l`` included); ``torch.load`` without
``weights_only=True`` written as a keyword; any ``.recv_pyobj``; an ``Unpickler`` instantiated directly; a class
that subclasses an ``Unpickler`` without its own ``find_class`` (the one place that decides what may be built).
Pickling (``dumps``, ``Pickler(...).dump``) is fine: it runs no code of anyone else's.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_PICKLE_MODULES = ("pickle", "_pickle", "cloudpickle", "dill")
LOADERS = {f"{m}.{f}" for m in _PICKLE_MODULES for f in ("load", "loads", "_load", "_loads")} | {"pandas.read_pickle"}
UNPICKLERS = {f"{m}.{c}" for m in _PICKLE_MODULES for c in ("Unpickler", "_Unpickler")}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it was imported as, from every import in the module (function-local ones too:
    scopes are merged, which can only flag more)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:  # `import torch.serialization` binds `torch`
                    names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``pk.loads`` -> ``pickle.loads`` after ``import pickle as pk``; None for anything but a name or attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(attrs)])


def _weights_only(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords
    )


def audit(source: str, filename: str) -> list[str]:
    """``file:line: what`` for every way ``source`` could unpickle."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    called: set[int] = set()  # the func nodes of torch.load calls, checked with their keywords
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module in _PICKLE_MODULES
            and any(a.name == "*" for a in node.names)
        ):
            found.append((node.lineno, f"`from {node.module} import *` hides which loaders are used"))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            if name in TORCH_LOADS:
                called.add(id(node.func))
                if not _weights_only(node):
                    found.append((node.lineno, f"{name} without weights_only=True (a keyword) unpickles anything"))
            elif name in UNPICKLERS:
                found.append((node.lineno, f"{name}(...) instantiated directly: its find_class builds any class"))
        elif isinstance(node, ast.ClassDef):
            bases = [name for name in (_dotted(b, aliases) for b in node.bases) if name in UNPICKLERS]
            own = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
                t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)
            }
            if bases and "find_class" not in own:
                found.append((node.lineno, f"class {node.name}({bases[0]}) has no find_class of its own"))
        if isinstance(node, ast.Attribute) and node.attr == "recv_pyobj":
            found.append((node.lineno, ".recv_pyobj unpickles what a socket receives"))
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            name = _dotted(node, aliases)
            if name in LOADERS:
                found.append((node.lineno, f"{name} unpickles"))
            elif name in TORCH_LOADS and id(node) not in called:  # ast.walk yields a call before its func
                found.append((node.lineno, f"{name} passed around: its weights_only cannot be checked"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def _package_files() -> list[pathlib.Path]:
    return sorted((ROOT / "dask_lm").rglob("*.py"))


def test_no_module_of_dask_lm_unpickles():
    files = _package_files()
    assert len(files) > 50, len(files)  # the whole package, not an empty glob
    problems = [p for f in files for p in audit(f.read_text(), str(f.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "path, legit, broken, rule",
    [
        # the Unpickler that reads DCP metadata passes because of its find_class
        ("dask_lm/io/safe_load.py", "def find_class", "def find_klass", "has no find_class"),
        # the torch loads pass because of their keyword
        ("dask_lm/io/safe_load.py", "weights_only=True", "weights_only=False", "torch.load without weights_only"),
        (
            "dask_lm/workers/checkpointing.py",
            "weights_only=True",
            "weights_only=None",
            "torch.load without weights_only",
        ),
    ],
)
def test_the_real_code_passes_for_the_reason_it_should(path, legit, broken, rule):
    """Each legitimate use is seen by the audit: undo what makes it safe and the audit names it."""
    source = (ROOT / path).read_text()
    assert legit in source and not audit(source, path)
    problems = audit(source.replace(legit, broken), path)
    assert problems and all(rule in p for p in problems), problems


BAD = {
    "pickle.loads": ("import pickle\npickle.loads(b)\n", "pickle.loads unpickles"),
    "pickle.load": ("import pickle\nwith open(p, 'rb') as f:\n    pickle.load(f)\n", "pickle.load unpickles"),
    "aliased module": ("import pickle as pk\npk.loads(b)\n", "pickle.loads unpickles"),
    "from import": ("from pickle import loads\nloads(b)\n", "pickle.loads unpickles"),
    "from import as": ("from pickle import loads as parse\nparse(b)\n", "pickle.loads unpickles"),
    "passed to map": ("import pickle\nrows = list(map(pickle.loads, blobs))\n", "pickle.loads unpickles"),
    "local import": ("def f(b):\n    import pickle as p\n    return p.loads(b)\n", "pickle.loads unpickles"),
    "cloudpickle": ("import cloudpickle\ncloudpickle.loads(b)\n", "cloudpickle.loads unpickles"),
    "cloudpickle.load": ("from cloudpickle import load\nload(f)\n", "cloudpickle.load unpickles"),
    "dill": ("import dill\ndill.load(f)\n", "dill.load unpickles"),
    "dill.loads": ("import dill as d\nd.loads(b)\n", "dill.loads unpickles"),
    "_pickle": ("import _pickle\n_pickle.loads(b)\n", "_pickle.loads unpickles"),
    "_pickle from": ("from _pickle import load\nload(f)\n", "_pickle.load unpickles"),
    "pandas.read_pickle": ("import pandas as pd\npd.read_pickle(p)\n", "pandas.read_pickle unpickles"),
    "star import": ("from pickle import *\nloads(b)\n", "import *"),
    "torch.load bare": ("import torch\ntorch.load(p)\n", "torch.load without weights_only"),
    "torch.load False": ("import torch\ntorch.load(p, weights_only=False)\n", "torch.load without weights_only"),
    "torch.load variable": ("import torch\ntorch.load(p, weights_only=flag)\n", "torch.load without weights_only"),
    "torch.load kwargs": ("import torch\ntorch.load(p, **kw)\n", "torch.load without weights_only"),
    "torch.load from": ("from torch import load\nload(p, map_location='cpu')\n", "torch.load without weights_only"),
    "torch.serialization": (
        "import torch.serialization\ntorch.serialization.load(p)\n",
        "torch.serialization.load without weights_only",
    ),
    "torch.load passed": ("import torch\nstate = list(map(torch.load, paths))\n", "torch.load passed around"),
    "recv_pyobj": ("def f(sock):\n    return sock.recv_pyobj()\n", ".recv_pyobj"),
    "recv_pyobj flags": ("msg = self._socket.recv_pyobj(flags=0)\n", ".recv_pyobj"),
    "Unpickler direct": ("import io, pickle\npickle.Unpickler(io.BytesIO(b)).load()\n", "pickle.Unpickler(...)"),
    "Unpickler from": ("from pickle import Unpickler as U\nU(f).load()\n", "pickle.Unpickler(...)"),
    "subclass without find_class": ("import pickle\nclass U(pickle.Unpickler):\n    pass\n", "has no find_class"),
    "_pickle subclass": (
        "import _pickle\nclass U(_pickle.Unpickler):\n    def load_more(self):\n        pass\n",
        "has no find_class",
    ),
    "subclass from import": ("from pickle import Unpickler\nclass Mine(Unpickler):\n    x = 1\n", "has no find_class"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_audit_flags_each_way_to_unpickle(case):
    source, rule = BAD[case]
    problems = audit(source, "snippet.py")
    assert problems and any(rule in p for p in problems), (case, problems)
    assert all(p.startswith("snippet.py:") for p in problems)


def test_the_audit_names_the_line():
    assert audit("import json\n\nx = 1\nimport pickle\ny = pickle.loads(b)\n", "m.py") == [
        "m.py:5: pickle.loads unpickles"
    ]


GOOD = {
    "dumps": "import pickle\ndata = pickle.dumps(obj, protocol=4)\n",
    "Pickler dump": "import io, pickle\nbuf = io.BytesIO()\npickle.Pickler(buf, protocol=4).dump(obj)\n",
    "torch.load weights_only": "import torch\ntorch.load(p, map_location='cpu', weights_only=True)\n",
    "torch.load from weights_only": "from torch import load\nload(p, weights_only=True)\n",
    "json.loads": "import json\njson.loads(s)\n",
    "msgpack.loads": "import msgpack\nmsgpack.unpackb(b)\nmsgpack.loads(b)\n",
    "own load function": "def load(x):\n    return x\nload(1)\nloads = 2\n",
    "a restricted Unpickler": (
        "import pickle\nclass Safe(pickle.Unpickler):\n    def find_class(self, module, name):\n"
        "        raise pickle.UnpicklingError(name)\nSafe(f).load()\n"
    ),
    "docstrings and comments": (
        '"""pickle.loads(b) and torch.load(p) in a docstring."""\n'
        "# pickle.loads(b); sock.recv_pyobj() in a comment\nx = 'pickle.loads(b)'\n"
    ),
    "isinstance of Unpickler": "import pickle\nisinstance(u, pickle.Unpickler)\n",
    "recv of data": "def f(sock):\n    return sock.recv_multipart(copy=False)\n",
}


@pytest.mark.parametrize("case", list(GOOD))
def test_the_audit_passes_code_that_does_not_unpickle(case):
    assert audit(GOOD[case], "snippet.py") == []
