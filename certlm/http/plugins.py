"""Finding and loading plugins: the built-ins, then every installed distribution's ``certlm`` entry points."""

from __future__ import annotations

import importlib
import importlib.metadata

import pluggy

from certlm.contracts import hookspecs

ENTRY_POINT_GROUP = "certlm"

# Built-in behaviour is a plugin too; vendors' plugins are loaded the same way.
DEFAULT_PLUGINS: tuple[str, ...] = ("certlm.builtin.pki_none",)


class PluginLoadError(RuntimeError):
    """An installed plugin could not be imported or registered. Start-up stops with this message."""


def build_plugin_manager(disabled: frozenset[str] = frozenset()) -> pluggy.PluginManager:
    """Load every plugin not named in ``disabled`` (entry point names, e.g. ``pki_internal``)."""
    manager = pluggy.PluginManager("certlm")
    manager.add_hookspecs(hookspecs)
    for name in disabled:
        manager.set_blocked(name)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in disabled:
            continue
        try:
            # One entry point at a time, so a failure names the plugin that caused it.
            manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=entry_point.name)
        except Exception as error:
            distribution = entry_point.dist.name if entry_point.dist else "unknown distribution"
            raise PluginLoadError(
                f"plugin {entry_point.name!r} ({entry_point.value}, from {distribution}) failed to load: "
                f"{type(error).__name__}: {error}"
            ) from error
    for module_name in DEFAULT_PLUGINS:
        if module_name not in disabled:
            manager.register(importlib.import_module(module_name), name=module_name)
    manager.check_pending()
    return manager


def plugin_names(manager: pluggy.PluginManager) -> list[str]:
    return sorted(name for name, _ in manager.list_name_plugin())
