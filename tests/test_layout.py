"""Routes are leaves: only the app factory imports the host's route modules, only a plugin's hook module imports the
plugin's own, and so no route module imports another. Checked over the import graph of every source file."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIRECTORIES = ("certlm", "plugins", "tests", "bench", "scripts")
HOST_ROUTES = "certlm.http.blueprints"
APP_FACTORY = "certlm.http.app"
# The module of a plugin package that hands its routes to the host (hook ``certlm_provide_blueprints``).
PLUGIN_HOOK_MODULE = "plugin"

Sources = dict[str, tuple[Path, ast.Module]]


def source_files() -> Iterator[Path]:
    for top in SOURCE_DIRECTORIES:
        for path in sorted((REPO / top).rglob("*.py")):
            if not {"__pycache__", "build"} & set(path.parts) and not any(p.endswith(".egg-info") for p in path.parts):
                yield path


def module_name(path: Path) -> str:
    """The dotted name ``path`` is imported as: relative to its distribution (the nearest ``pyproject.toml``, so a
    plugin's modules are ``certlm_<name>.*``)."""
    root = next(parent for parent in path.parents if (parent / "pyproject.toml").exists())
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Every module ``tree`` may import, with the line: imports at any depth (in functions too), relative ones
    resolved, ``from package import name`` as both ``package`` and ``package.name``, and ``import_module`` of a
    literal name."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module, node.lineno
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


def defines_blueprint(tree: ast.Module) -> bool:
    """Whether the module creates a ``Blueprint`` at module level, which makes it a route module."""
    return any(
        isinstance(node, ast.Assign | ast.AnnAssign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "Blueprint"
        for node in tree.body
    )


def parse_sources() -> Sources:
    return {module_name(path): (path, ast.parse(path.read_text(), str(path))) for path in source_files()}


def route_modules(sources: Sources) -> set[str]:
    return {name for name, (_, tree) in sources.items() if defines_blueprint(tree)}


def allowed_importer(route_module: str) -> str:
    """The one module that may import ``route_module``: the app factory for the host's routes, else the hook module of
    the plugin package the routes belong to."""
    if route_module == HOST_ROUTES or route_module.startswith(HOST_ROUTES + "."):
        return APP_FACTORY
    return f"{route_module.split('.')[0]}.{PLUGIN_HOOK_MODULE}"


def forbidden_imports(sources: Sources) -> list[str]:
    """One line per import statement that reaches a route module it must not."""
    routes = route_modules(sources) | {HOST_ROUTES}
    problems: dict[str, set[str]] = {}
    for importer, (path, tree) in sources.items():
        for imported, line in imported_modules(path, tree):
            if imported in routes and importer != allowed_importer(imported):
                problems.setdefault(f"{path.relative_to(REPO)}:{line}", set()).add(imported)
    return [f"{where} imports the route module {', '.join(sorted(names))}" for where, names in sorted(problems.items())]


def test_route_modules_are_found() -> None:
    """The walk sees the host's and a plugin's route modules, so that no forbidden import is a finding."""
    routes = route_modules(parse_sources())
    assert {"certlm.http.blueprints.push", "certlm.http.blueprints.inventory", "certlm_gds_push.blueprint"} <= routes


def test_routes_are_leaves() -> None:
    """A route module imports host services, models and schemas, never another route module, and nothing imports a
    route module but the app factory (``BLUEPRINT_MODULES``) or its plugin's hook module: tests call routes over
    HTTP."""
    assert forbidden_imports(parse_sources()) == []


@pytest.mark.parametrize(
    ("importer", "source", "route_module"),
    [
        (
            "certlm/inventory/entries.py",
            "from certlm.http.blueprints.system import SOFTWARE\n",
            "certlm.http.blueprints.system",
        ),
        (
            "certlm/http/blueprints/push.py",
            "from certlm.http.blueprints.inventory import MAX_ID\n",
            "certlm.http.blueprints.inventory",
        ),
        (
            "certlm/http/blueprints/push.py",
            "from . import inventory\n",
            "certlm.http.blueprints, certlm.http.blueprints.inventory",
        ),
        ("certlm/http/blueprints/push.py", "from .pki import render\n", "certlm.http.blueprints.pki"),
        (
            "certlm/demo.py",
            "def onboard():\n    import certlm.http.blueprints.inventory\n",
            "certlm.http.blueprints.inventory",
        ),
        ("certlm/demo.py", "from certlm.http import blueprints\n", "certlm.http.blueprints"),
        (
            "certlm/cli.py",
            "import importlib\n\nimportlib.import_module('certlm.http.blueprints.pki')\n",
            "certlm.http.blueprints.pki",
        ),
        (
            "plugins/gds_push/certlm_gds_push/blueprint.py",
            "from certlm.http.blueprints.pki import render\n",
            "certlm.http.blueprints.pki",
        ),
        (
            "plugins/gds_push/certlm_gds_push/identity.py",
            "from .blueprint import blueprint\n",
            "certlm_gds_push.blueprint",
        ),
        (
            "tests/blueprints/test_pki.py",
            "from certlm.http.blueprints.pki import render\n",
            "certlm.http.blueprints.pki",
        ),
    ],
)
def test_a_forbidden_import_is_found(importer: str, source: str, route_module: str) -> None:
    """Each way of reaching a route module, added to a real module of the tree, is reported once."""
    sources = parse_sources()
    path = REPO / importer
    sources[module_name(path)] = (path, ast.parse(source))
    [problem] = forbidden_imports(sources)
    assert problem.startswith(f"{importer}:") and problem.endswith(f" imports the route module {route_module}")
