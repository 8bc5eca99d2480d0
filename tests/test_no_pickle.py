"""No code-executing deserialisation anywhere a peer or the coordinator runs.

Ravn's peers read bytes from strangers. pickle, marshal, shelve, dill, cloudpickle and joblib turn bytes
into code execution, ``eval``/``exec`` turn text into it, and ``torch.load`` unpickles unless told
``weights_only=True``. This test parses every Python file under swarm/, peer/ and coordinator/
(the generated protobuf code included: it is clean, so it is not exempt) and fails on any such use,
naming file and line. It reads the syntax tree, so a docstring that says "never pickle" is fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "peer", "coordinator")
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
BANNED_BUILTINS = {"eval", "exec"}


def _root_module(name: str | None) -> str:
    return (name or "").split(".")[0]


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every banned construct in ``source``, as ``file:line: what``."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    torch_load_names = {"torch.load"}
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root_module(alias.name) in BANNED_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if _root_module(node.module) in BANNED_MODULES:
                found.append(f"{where}: from {node.module} import ...")
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                torch_load_names.add("load")
        elif isinstance(node, ast.Call):
            func = node.func
            dotted = ast.unparse(func)
            if isinstance(func, ast.Name) and func.id in BANNED_BUILTINS:
                found.append(f"{where}: {func.id}(...)")
            elif dotted in ("builtins.eval", "builtins.exec"):
                found.append(f"{where}: {dotted}(...)")
            elif dotted in torch_load_names and not _is_true(_keyword(node, "weights_only")):
                found.append(f"{where}: {dotted}(...) without weights_only=True")
            elif dotted.endswith(("np.load", "numpy.load")) and _is_true(_keyword(node, "allow_pickle")):
                found.append(f"{where}: {dotted}(..., allow_pickle=True)")
            elif dotted in ("importlib.import_module", "__import__", "import_module") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and _root_module(str(arg.value)) in BANNED_MODULES:
                    found.append(f"{where}: {dotted}({arg.value!r})")
    return found


def python_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_there_is_code_to_check() -> None:
    files = python_files()
    assert len(files) > 20 and any(p.parts[-2] == "pb" for p in files)  # generated code is scanned too


def test_no_code_executing_deserialisation_in_swarm_peer_coordinator() -> None:
    found = [v for p in python_files() for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "code-executing deserialisation found:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from dill import loads",
        "from marshal import loads",
        "import shelve",
        "import joblib",
        "eval('1 + 1')",
        "exec(code)",
        "import builtins\nbuiltins.exec(code)",
        "import torch\ntorch.load('x.pt')",
        "import torch\ntorch.load('x.pt', weights_only=False)",
        "from torch import load\nload('x.pt')",
        "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
        "import importlib\nimportlib.import_module('pickle')",
        "__import__('marshal')",
    ],
)
def test_the_checker_catches(source: str) -> None:
    assert violations(source), source


@pytest.mark.parametrize(
    "source",
    [
        '"""We never pickle: no eval( of wire data."""',
        "import torch\ntorch.load('x.pt', weights_only=True)",
        "model.eval()",
        "progress.on_eval(3, 1.0)",
        "import numpy as np\nnp.load('x.npy')",
        "from safetensors.torch import load_file",
    ],
)
def test_the_checker_allows(source: str) -> None:
    assert not violations(source), source
