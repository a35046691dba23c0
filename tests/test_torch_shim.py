"""Private torch lives in ``ddp_fusion/_torch/`` only, and checks itself.

* No other module of the package imports a private torch module or reaches a private
  torch name (``torch._dynamo``, ``torch._C``, ``torch.ops._c10d_functional``,
  ``dist._DEFAULT_FIRST_BUCKET_BYTES``, ...).
* Every torch name a shim module reaches through ``torch`` (by import, attribute or
  alias) and that has a private part is listed in its ``REQUIRED`` (which
  ``check_torch()`` resolves at import), and every ``REQUIRED`` entry is used.
* Private attributes of objects (an instance's ``_timeout``) cannot be resolved at
  import: each is the last part of a ``REQUIRED`` name (a class attribute checked
  there) or named in the module's ``UNCHECKED`` with the reason it is safe.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import ddp_fusion
from ddp_fusion import _torch

PACKAGE = pathlib.Path(ddp_fusion.__file__).parent
SHIM = PACKAGE / "_torch"


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def torch_uses(source: str) -> tuple[set[str], set[str]]:
    """(dotted torch names the source reaches, private attribute names of objects it
    cannot resolve to a torch name). Aliases from ``import``, ``from ... import`` and
    module-level ``NAME = torch....`` assignments are followed; ``self``/``cls``
    attributes are the module's own."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    uses: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    uses.add(a.name)
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
            node.module == "torch" or node.module.startswith("torch.")
        ):
            for a in node.names:
                uses.add(f"{node.module}.{a.name}")
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}

    def chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        return node, attrs[::-1]

    for stmt in tree.body:  # NAME = torch.x.y at module level
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            root, attrs = chain(stmt.value)
            if attrs and isinstance(root, ast.Name) and root.id in alias:
                alias[stmt.targets[0].id] = ".".join([alias[root.id], *attrs])
    unresolved: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
            continue  # only whole chains
        root, attrs = chain(node)
        if isinstance(root, ast.Name) and root.id in alias:
            uses.add(".".join([alias[root.id], *attrs]))
        elif not (isinstance(root, ast.Name) and root.id in ("self", "cls")):
            unresolved.update(a for a in attrs if _private(a))
    for node in ast.walk(tree):  # a bare alias of a private name counts too
        if isinstance(node, ast.Name) and node.id in alias:
            uses.add(alias[node.id])
    return uses, unresolved


def _has_private(dotted: str) -> bool:
    # ATen's and prims' ops are the public operator set, underscored ones included
    # (``aten._foreach_div``); the private op namespaces (``_c10d_functional``) are not.
    if dotted.startswith(("torch.ops.aten.", "torch.ops.prims.")):
        return False
    return any(_private(s) for s in dotted.split("."))


def _strings(source: str) -> set[str]:
    nodes = ast.walk(ast.parse(source))
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _covered(use: str, required: tuple[str, ...]) -> bool:
    return any(r == use or r.startswith(use + ".") for r in required)


def test_nothing_outside_the_shim_touches_private_torch():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if SHIM in path.parents:
            continue
        private = sorted(u for u in torch_uses(path.read_text())[0] if _has_private(u))
        if private:
            offenders[str(path.relative_to(PACKAGE))] = private
    assert offenders == {}


@pytest.mark.parametrize("module", _torch.SUBSYSTEMS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_private_name_the_shim_uses_is_checked(module):
    source = pathlib.Path(module.__file__).read_text()
    uses, unresolved = torch_uses(source)
    unchecked = sorted(u for u in uses if _has_private(u) and not _covered(u, module.REQUIRED))
    assert unchecked == [], "add these to REQUIRED"
    # A required name is used directly, or through a module or namespace the shim
    # reaches (and hands out), or as an attribute of an object or a class override.
    reached = unresolved | _strings(source)
    stale = sorted(
        r for r in module.REQUIRED
        if not any(u == r or r.startswith(u + ".") for u in uses) and r.rsplit(".", 1)[-1] not in reached
    )
    assert stale == [], "REQUIRED names something the module does not use"
    known = {r.rsplit(".", 1)[-1] for r in _torch.required()} | set(module.UNCHECKED)
    assert sorted(unresolved - known) == [], "check these (REQUIRED) or explain them (UNCHECKED)"
    assert set(module.UNCHECKED) <= reached, "UNCHECKED names an attribute no longer used"


def test_check_torch_resolves_every_required_name():
    for name in _torch.required():
        _torch.resolve(name)


def test_the_scanner_follows_aliases():
    """The checks above are only as good as ``torch_uses``."""
    uses, unresolved = torch_uses(
        "import torch\nimport torch.distributed as dist\nfrom torch._dynamo import eval_frame\n"
        "DDP = torch.nn.parallel.DistributedDataParallel\n"
        "def f(group, ddp):\n"
        "    torch._C._foo(dist._bar, eval_frame._stance, DDP._pre_forward)\n"
        "    group._get_backend().options._timeout; ddp.__class__; ddp._x\n"
    )
    assert {"torch._C._foo", "torch.distributed._bar", "torch._dynamo.eval_frame._stance",
            "torch.nn.parallel.DistributedDataParallel._pre_forward"} <= uses
    assert unresolved == {"_get_backend", "_timeout", "_x"}


def test_a_torch_without_a_needed_internal_fails_naming_it(monkeypatch):
    """What a torch upgrade that moved an internal looks like: a clear ImportError (at
    the first use of ddp_fusion: turning it on, building a model, running the pass)."""
    monkeypatch.setattr(_torch, "_checked", False)
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_pre_forward")
    wanted = r"DistributedDataParallel\._pre_forward.*tested with torch 2\.11 to 2\.14"
    with pytest.raises(ImportError, match=wanted):
        _torch.check_torch()


@pytest.mark.parametrize("version, warns", [
    ("2.10.0", True), ("2.11.0+cpu", False), ("2.14.1+cu130", False), ("2.15.0", True),
    ("2.16.0.dev20261120+cpu", True),
])
def test_a_torch_outside_the_tested_window_warns_once_naming_it(monkeypatch, recwarn, version, warns):
    """Outside the window ddp_fusion runs (the names it needs are checked) and says so
    once, where it is first used; inside it says nothing."""
    monkeypatch.setattr(_torch, "_checked", False)
    monkeypatch.setattr(torch, "__version__", version)
    _torch.check_torch()
    _torch.check_torch()
    said = [str(w.message) for w in recwarn if issubclass(w.category, _torch.UntestedTorchWarning)]
    if warns:
        assert len(said) == 1 and f"tested with torch 2.11 to 2.14; this is torch {version}" in said[0]
    else:
        assert said == []


def test_the_window_is_declared_once_everywhere():
    """pyproject's lower bound is the oldest tested release and it has no upper bound (pip
    keeps a user's newer torch); the window script tests the releases TESTED_TORCH names."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11

    root = PACKAGE.parent
    with open(root / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert f"torch>={_torch.TESTED_TORCH[0]}" in deps
    script = ast.parse((root / ".ci" / "torch_window.py").read_text())
    (window,) = [ast.literal_eval(node.value) for node in script.body
                 if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "WINDOW"]
    assert tuple(_torch.minor_version(v) for v in window) == _torch.TESTED_TORCH
