"""bench reaches private torch only through its shim, bench/_lib/_torch.py (CONTRIBUTING.md).

* every name in the shim's ``REQUIRED`` resolves in this torch, and each is used;
* no other file of bench imports a private torch module or reaches a private torch name
  (``torch._dynamo``, ``torch.ops._c10d_functional``, ...), nor ddp_fusion's own shim;
* a private attribute of an object outside the shim is one of the few listed here, with
  the reason.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import bench
from bench._lib import _torch

BENCH = pathlib.Path(bench.__file__).parent
SHIM = BENCH / "_lib" / "_torch.py"
FILES = sorted(p for p in [*BENCH.glob("*.py"), *BENCH.glob("_lib/*.py")] if p != SHIM)

# private attributes of objects that bench reads outside the shim, and why
ALLOWED_ATTRIBUTES = {
    "_buffer": "ddp_fusion's eager reducer bucket, read without allocating it (profiling.held_bytes)",
    "_sync": "ddp_fusion's GradSync of a wrapper (not torch's): bench.callback_ab keeps one model "
             "on a hook per parameter and checks which design each model runs",
}


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def private_uses(source: str) -> list[str]:
    """Private torch names (and ddp_fusion's shim) a source reaches, and private
    attributes of objects not in :data:`ALLOWED_ATTRIBUTES`."""
    tree = ast.parse(source)
    torch_alias: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_alias[a.asname or "torch"] = a.name if a.asname else "torch"
                    if any(_private(s) for s in a.name.split(".")):
                        found.append(f"import {a.name}")
                if a.name.startswith("ddp_fusion._torch"):
                    found.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "torch":
                for a in node.names:
                    torch_alias[a.asname or a.name] = f"{node.module}.{a.name}"
                    if any(_private(s) for s in [*parts, a.name]):
                        found.append(f"from {node.module} import {a.name}")
            if node.module.startswith("ddp_fusion._torch") or (
                    node.module == "ddp_fusion" and any(a.name == "_torch" for a in node.names)):
                found.append(f"from {node.module} import ...")
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
            continue
        root, attrs = _chain(node)
        if isinstance(root, ast.Name) and root.id in torch_alias:
            if any(_private(a) for a in torch_alias[root.id].split(".") + attrs):
                found.append(".".join([torch_alias[root.id], *attrs]))
        elif isinstance(root, ast.Name) and root.id == "ddp_fusion" and attrs[:1] == ["_torch"]:
            found.append(".".join(["ddp_fusion", *attrs]))
        elif not (isinstance(root, ast.Name) and root.id in ("self", "cls")):
            found += [a for a in attrs if _private(a) and a not in ALLOWED_ATTRIBUTES]
    return found


def test_every_required_name_resolves():
    assert _torch.check() == []


def test_every_required_name_is_used():
    """Each ``REQUIRED`` name's last part is used in bench, outside the ``REQUIRED`` list
    (in the shim, or on what the shim hands out, such as ``C10D.wait_tensor``)."""
    shim = SHIM.read_text()
    start = shim.index("REQUIRED = (")
    code = shim[:start] + shim[shim.index("\n)\n", start):] + "".join(p.read_text() for p in FILES)
    assert [name for name in _torch.REQUIRED if name.split(".")[-1] not in code] == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(BENCH)))
def test_no_private_torch_outside_the_shim(path):
    assert private_uses(path.read_text()) == []


def test_the_check_sees_private_torch():
    assert private_uses("import torch\ntorch._dynamo.reset()\n") == ["torch._dynamo.reset"]
    assert private_uses("from torch._inductor import config\n") == ["from torch._inductor import config"]
    assert private_uses("import torch\nx = torch.ops._c10d_functional.all_reduce\n") == [
        "torch.ops._c10d_functional.all_reduce"]
    assert private_uses("from ddp_fusion import _torch\n") == ["from ddp_fusion import ..."]
    assert private_uses("model._orig_mod\n") == ["_orig_mod"]
    assert private_uses("import torch\nself._x = torch.nn.Linear\n") == []
