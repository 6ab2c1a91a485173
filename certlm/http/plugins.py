"""Finding and loading plugins: the built-ins, then every installed distribution's ``certlm`` entry points."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import pluggy

from certlm.contracts import hookspecs
from certlm.contracts.registry import DeviceDriverRegistry
from certlm.foundation.version import PLUGIN_API_VERSION, __version__

ENTRY_POINT_GROUP = "certlm"

# Built-in behaviour is a plugin too; vendors' plugins are loaded the same way.
DEFAULT_PLUGINS: tuple[str, ...] = ("certlm.builtin.pki_none",)


class PluginLoadError(RuntimeError):
    """An installed plugin could not be imported or registered. Start-up stops with this message."""


def api_version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def check_plugin_api(name: str, module: ModuleType, distribution: str) -> None:
    """Refuse a plugin that declares a plugin API this certlm does not offer (``CERTLM_PLUGIN_API``): another major
    version, or a later minor one. A plugin that declares none is taken as written for this one."""
    needed = getattr(module, "CERTLM_PLUGIN_API", None)
    if needed is None:
        return
    try:
        wanted = api_version(str(needed))
    except ValueError:
        raise PluginLoadError(
            f"plugin {name!r} (from {distribution}) declares CERTLM_PLUGIN_API {needed!r}, which is not a version "
            "such as '1.0'"
        ) from None
    offered = api_version(PLUGIN_API_VERSION)
    if wanted[0] != offered[0] or wanted[1] > offered[1]:
        raise PluginLoadError(
            f"plugin {name!r} (from {distribution}) needs certlm plugin API {needed}, and this certlm "
            f"({__version__}) offers plugin API {PLUGIN_API_VERSION}: install a certlm that offers it, or a release "
            f"of the plugin for plugin API {offered[0]}.x"
        )


def build_plugin_manager(disabled: frozenset[str] = frozenset()) -> pluggy.PluginManager:
    """Load every plugin not named in ``disabled`` (entry point names, e.g. ``pki_internal``)."""
    manager = pluggy.PluginManager("certlm")
    manager.add_hookspecs(hookspecs)
    for name in disabled:
        manager.set_blocked(name)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in disabled:
            continue
        distribution = entry_point.dist.name if entry_point.dist else "unknown distribution"
        try:
            # One entry point at a time, so a failure names the plugin that caused it.
            manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=entry_point.name)
        except Exception as error:
            raise PluginLoadError(
                f"plugin {entry_point.name!r} ({entry_point.value}, from {distribution}) failed to load: "
                f"{type(error).__name__}: {error}"
            ) from error
        check_plugin_api(entry_point.name, manager.get_plugin(entry_point.name), distribution)
    for module_name in DEFAULT_PLUGINS:
        if module_name not in disabled:
            manager.register(importlib.import_module(module_name), name=module_name)
    manager.check_pending()
    return manager


def register_device_drivers(manager: pluggy.PluginManager, drivers: DeviceDriverRegistry) -> None:
    """Each plugin's ``certlm_register_device_drivers`` in turn, so that the registry knows which plugin API each
    driver's plugin declared (``DeviceDriverRegistry.plugin_api``)."""
    plugins = [impl.plugin for impl in manager.hook.certlm_register_device_drivers.get_hookimpls()]
    for plugin in plugins:
        call = manager.subset_hook_caller(
            "certlm_register_device_drivers", remove_plugins=[other for other in plugins if other is not plugin]
        )
        declared = getattr(plugin, "CERTLM_PLUGIN_API", None)
        with drivers.registering_for(None if declared is None else str(declared)):
            call(register=drivers)


def plugin_names(manager: pluggy.PluginManager) -> list[str]:
    return sorted(name for name, _ in manager.list_name_plugin())
