"""The architecture, checked over the import graph of every source file (imports at any depth count: in functions,
under ``TYPE_CHECKING``, ``import_module`` of a literal name):

- the host's rooms are layered: a room imports only the rooms below it (``HOST_ROOMS``), never the ``certlm`` package
  (the public API, made of the rooms) nor the top-level modules built on them;
- a plugin (``plugins/*``, ``examples/*``) imports from certlm only ``certlm`` and ``certlm.testing``: the vendor API;
- no import cycle anywhere;
- routes are leaves: only the app factory imports the host's route modules, only a plugin's hook module imports the
  plugin's own, and so no route module imports another."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIRECTORIES = ("certlm", "plugins", "examples", "tests", "bench", "scripts")
# The host's rooms, lowest first: each imports only rooms listed before it. Everything else in ``certlm`` (the package's
# ``__init__``, the CLI, the demo, the built-in plugin, the test kit, the plugin template) stands on top of them.
HOST_ROOMS = ("foundation", "storage", "contracts", "system", "pki", "inventory", "lifecycle", "service", "http")
# What a plugin may import from certlm: the public API, and the test kit for its tests.
PLUGIN_API_MODULES = ("certlm", "certlm.testing")
PLUGIN_DIRECTORIES = ("plugins", "examples")
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
    """Whether the module creates a ``Blueprint``, at module level or in a function that makes one (a plugin's
    ``make_blueprint(services, inventory)``), which makes it a route module."""
    return any(
        isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Blueprint"
        for node in ast.walk(tree)
    )


@functools.cache
def parsed_tree() -> Sources:
    return {module_name(path): (path, ast.parse(path.read_text(), str(path))) for path in source_files()}


def parse_sources() -> Sources:
    """The tree's modules, parsed once per run; a copy, so that a test may add an import to one module."""
    return dict(parsed_tree())


def sources_with(importer: str, source: str, *, appended: bool = False) -> Sources:
    """The tree with the module at path ``importer`` made of ``source`` (or, ``appended``, its own code and then
    ``source``): how a test injects the import a rule must find."""
    sources = parse_sources()
    path = REPO / importer
    body = [*sources[module_name(path)][1].body] if appended else []
    sources[module_name(path)] = (path, ast.Module(body=[*body, *ast.parse(source).body], type_ignores=[]))
    return sources


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
    [problem] = forbidden_imports(sources_with(importer, source))
    assert problem.startswith(f"{importer}:") and problem.endswith(f" imports the route module {route_module}")


def host_room(module: str) -> str | None:
    """The room of a host module (``certlm.<room>...``), ``"top"`` for the rest of ``certlm``, None outside it."""
    parts = module.split(".")
    if parts[0] != "certlm":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in HOST_ROOMS else "top"


def deepest_per_line(found: dict[tuple[Path, int], set[str]]) -> Iterator[tuple[Path, int, str]]:
    """One finding per import statement: ``from package import module`` names both, the module is what it imports."""
    for (path, line), modules in sorted(found.items()):
        yield path, line, max(modules, key=len)


def layering_violations(sources: Sources) -> list[str]:
    """One line per import of a host room module that reaches its own room's betters: a room above it or the top."""
    rank = {room: position for position, room in enumerate(HOST_ROOMS)}
    found: dict[tuple[Path, int], set[str]] = {}
    for importer, (path, tree) in sources.items():
        room = host_room(importer)
        if room in (None, "top"):
            continue
        for imported, line in imported_modules(path, tree):
            if imported not in sources:
                continue  # a name imported from a module, not a module
            target = host_room(imported)
            if target is not None and target != room and (target == "top" or rank[target] > rank[room]):
                found.setdefault((path, line), set()).add(imported)
    return [
        f"{path.relative_to(REPO)}:{line}: room {host_room(module_name(path))} imports {imported} "
        f"({host_room(imported)} is above it)"
        for path, line, imported in deepest_per_line(found)
    ]


def plugin_boundary_violations(sources: Sources) -> list[str]:
    """One line per import in a plugin or the example vendor package of a certlm module that is not the public API."""
    found: dict[tuple[Path, int], set[str]] = {}
    for _, (path, tree) in sources.items():
        if path.relative_to(REPO).parts[0] not in PLUGIN_DIRECTORIES:
            continue
        for imported, line in imported_modules(path, tree):
            inside = [module for module in sources if imported == module or imported.startswith(module + ".")]
            reached = max(inside, key=len, default=None)  # the module an import names (or names a member of)
            if reached is not None and host_room(reached) is not None and reached not in PLUGIN_API_MODULES:
                found.setdefault((path, line), set()).add(reached)
    return [
        f"{path.relative_to(REPO)}:{line}: imports {reached}, not the public API"
        for path, line, reached in deepest_per_line(found)
    ]


def import_cycles(sources: Sources) -> list[list[str]]:
    """Every set of modules that import each other around a circle (strongly connected components of two or more
    modules, or one that imports itself), each sorted."""
    graph = {
        importer: {imported for imported, _ in imported_modules(path, tree) if imported in sources}
        for importer, (path, tree) in sources.items()
    }
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:
        # Tarjan's algorithm, iterative: a deep chain of imports must not reach Python's recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = lowest[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = lowest[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    lowest[module] = min(lowest[module], index[successor])
                continue
            work.pop()
            if work:
                lowest[work[-1][0]] = min(lowest[work[-1][0]], lowest[module])
            if lowest[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1 or module in graph[module]:
                    cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_the_rooms_are_layered() -> None:
    """Each room imports only rooms below it: the order in ``HOST_ROOMS`` is the architecture."""
    assert layering_violations(parse_sources()) == []


def test_every_room_is_seen() -> None:
    """The walk finds a module in each room and every sub-package of ``certlm`` is a room or a known top module, so a
    new directory cannot slip past the layering."""
    sources = parse_sources()
    packages = {name.split(".")[1] for name in sources if name.startswith("certlm.") and name.count(".") >= 2}
    assert set(HOST_ROOMS) <= packages
    assert packages - set(HOST_ROOMS) <= {"builtin", "testing", "plugin_template"}


def test_plugins_import_only_the_public_api() -> None:
    """Every plugin and the example vendor package import from certlm only ``certlm`` and ``certlm.testing``."""
    sources = parse_sources()
    assert {"certlm_gds_push.push_flow", "certlm_ssh.driver", "certlm_rest.driver", "certlm_acme_widget.plugin"} <= set(
        sources
    )
    assert plugin_boundary_violations(sources) == []


def test_there_is_no_import_cycle() -> None:
    assert import_cycles(parse_sources()) == []


@pytest.mark.parametrize(
    ("importer", "source", "problem"),
    [
        (
            "certlm/foundation/certs.py",
            "from certlm.storage.models import InventoryEntry\n",
            "room foundation imports certlm.storage.models (storage is above it)",
        ),
        (
            "certlm/pki/revocation.py",
            "def later():\n    from certlm.lifecycle import push\n",
            "room pki imports certlm.lifecycle.push (lifecycle is above it)",
        ),
        (
            "certlm/contracts/drivers.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from certlm.service.host import Host\n",
            "room contracts imports certlm.service.host (service is above it)",
        ),
        ("certlm/lifecycle/push.py", "import certlm\n", "room lifecycle imports certlm (top is above it)"),
        ("certlm/http/app.py", "from certlm import demo\n", "room http imports certlm.demo (top is above it)"),
    ],
)
def test_an_import_against_the_layering_is_found(importer: str, source: str, problem: str) -> None:
    [found] = layering_violations(sources_with(importer, source))
    assert found.startswith(f"{importer}:") and found.endswith(problem)


@pytest.mark.parametrize(
    ("importer", "source", "reached"),
    [
        (
            "plugins/ssh/certlm_ssh/driver.py",
            "from certlm.foundation.errors import NotFound\n",
            "certlm.foundation.errors",
        ),
        ("plugins/rest/certlm_rest/connection.py", "import certlm.storage.models\n", "certlm.storage.models"),
        (
            "plugins/pki_cmp/certlm_pki_cmp/backend.py",
            "def later():\n    from certlm.lifecycle.push import run\n",
            "certlm.lifecycle.push",
        ),
        ("plugins/gds_push/certlm_gds_push/driver.py", "from certlm.http import openapi\n", "certlm.http.openapi"),
        (
            "examples/acme_widget/certlm_acme_widget/plugin.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from certlm.service.host import Host\n",
            "certlm.service.host",
        ),
        ("plugins/ssh/certlm_ssh/plugin.py", "from certlm.testing.fixtures import x\n", "certlm.testing.fixtures"),
    ],
)
def test_a_plugin_import_of_a_host_internal_is_found(importer: str, source: str, reached: str) -> None:
    [found] = plugin_boundary_violations(sources_with(importer, source))
    assert found.startswith(f"{importer}:") and found.endswith(f"imports {reached}, not the public API")


def test_the_public_api_and_the_test_kit_are_allowed() -> None:
    source = "import certlm\nfrom certlm import hookimpl, pki_client\nfrom certlm.testing import push\n"
    assert plugin_boundary_violations(sources_with("plugins/ssh/certlm_ssh/plugin.py", source)) == []


@pytest.mark.parametrize(
    ("importer", "source", "cycle"),
    [
        (
            "certlm/foundation/errors.py",
            "def later():\n    from certlm.http import app\n",
            "certlm.foundation.errors",
        ),
        (
            "plugins/rest/certlm_rest/interface.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .driver import RestGenericDriver\n",
            "certlm_rest.interface",
        ),
        ("plugins/ssh/certlm_ssh/store.py", "from . import store\n", "certlm_ssh.store"),
    ],
)
def test_an_import_cycle_is_found(importer: str, source: str, cycle: str) -> None:
    [found] = import_cycles(sources_with(importer, source, appended=True))
    assert cycle in found
