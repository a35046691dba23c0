"""The package's layer map (CONTRIBUTING.md): every module imports only from modules in
lower layers, so there is no import circle and no upward edge; every module has a layer.

Units are the package's top-level modules, and its two subpackages (``_torch``,
``passes``) as wholes; inside a subpackage the modules must not form a circle either.
"""

from __future__ import annotations

import ast
import pathlib

import ddp_fusion

PACKAGE = pathlib.Path(ddp_fusion.__file__).parent

LAYERS: list[set[str]] = [  # L0, L1, ...: as CONTRIBUTING.md draws it
    {"_torch", "config", "launch", "_autoload", "_native"},
    {"log", "effects", "scaling"},
    {"plan", "host_group"},
    {"ops", "dump", "comm_hooks", "ready_order", "settings_check"},
    {"plan_check", "autocap", "unused"},
    {"passes", "reducer"},
    {"join"},
    {"grad_sync"},
    {"wrapper", "stock"},
    {"_install"},
    {"__init__", "demo"},
    {"__main__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of the package that ``path`` imports, as dotted names relative to the
    package (``plan``, ``passes.concat``, ``_torch``)."""
    package = _module_name(path).split(".")[:-1]  # "passes.concat", "passes.__init__": passes
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                prefix = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and (node.module == "ddp_fusion" or node.module.startswith("ddp_fusion.")):
                prefix = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                target = [*prefix, alias.name]
                # "from . import x": x is a module; "from .x import y": y is a name in x
                found.add(".".join(target) if _is_module(target) else ".".join(prefix))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ddp_fusion."):
                    found.add(alias.name.removeprefix("ddp_fusion."))
    return {f for f in found if f}


def _is_module(parts: list[str]) -> bool:
    path = PACKAGE.joinpath(*parts)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _unit(module: str) -> str:
    return module.split(".")[0]


def _modules() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert units - set(LAYER) == set(), "put new modules in LAYERS (and CONTRIBUTING.md)"
    assert set(LAYER) - units == set(), "LAYERS names a module that does not exist"


def test_imports_go_only_downward():
    upward = []
    for module, imported in _modules().items():
        for target in imported:
            a, b = _unit(module), _unit(target)
            if a != b and LAYER[b] >= LAYER[a]:
                upward.append(f"{module} (layer {LAYER[a]}) imports {target} (layer {LAYER[b]})")
    assert upward == []


def test_no_import_circle():
    graph = _modules()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph.get(m, ()):
            t = t if t in graph else f"{t}.__init__"
            if state.get(t) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*path, m, t])}")
            if t in graph and not state.get(t):
                visit(t, [*path, m])
        state[m] = 2

    for m in graph:
        if not state.get(m):
            visit(m, [])


def test_the_parser_sees_relative_and_absolute_imports():
    """The checks above are only as good as ``_imports``."""
    assert {"plan", "plan_check", "passes._graph"} <= _imports(PACKAGE / "passes" / "guard.py")
    assert {"ops", "passes._graph", "passes.bucketing"} <= _imports(PACKAGE / "passes" / "concat.py")
    assert "grad_sync" in _imports(PACKAGE / "wrapper.py")
    assert "_torch" in _imports(PACKAGE / "plan.py")
