"""``certlm plugin new NAME``: a new plugin distribution from the template in ``files/``, which passes its own tests
as written (a GDS push driver for a device family, its tests with ``certlm.testing``, its README)."""

from __future__ import annotations

import importlib.util
import keyword
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from string import Template

from certlm.foundation.version import PLUGIN_API_VERSION, __version__

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
MAX_NAME_CHARS = 64
TEMPLATE_SUFFIX = ".tmpl"
# The template's folder that becomes the plugin's Python package.
PACKAGE_FOLDER = "package"


class BadPluginName(ValueError):
    """A name ``certlm plugin new`` cannot make a plugin of, or a place it must not write to; the message says why."""


@dataclass(frozen=True)
class PluginNames:
    """The names of a plugin called ``name`` (``acme_press``): its distribution ``certlm-acme-press``, its module
    ``certlm_acme_press``, its ``certlm`` entry point ``acme_press``, its driver's service ``gds-push-acme-press``."""

    name: str

    @classmethod
    def checked(cls, name: str) -> PluginNames:
        if not NAME_PATTERN.fullmatch(name) or len(name) > MAX_NAME_CHARS or keyword.iskeyword(name):
            raise BadPluginName(
                f"{name!r} is no plugin name: use a Python identifier of lower-case letters, digits and underscores, "
                f"starting with a letter, at most {MAX_NAME_CHARS} characters (e.g. acme_press)"
            )
        names = cls(name)
        if importlib.util.find_spec(names.module) is not None:
            raise BadPluginName(f"a module {names.module} is installed already: choose another name")
        return names

    @property
    def dashed(self) -> str:
        return self.name.replace("_", "-")

    @property
    def module(self) -> str:
        return f"certlm_{self.name}"

    @property
    def title(self) -> str:
        return " ".join(word.capitalize() for word in self.name.split("_") if word)

    def substitutions(self) -> dict[str, str]:
        """What the template's ``${...}`` placeholders stand for."""
        return {
            "distribution": f"certlm-{self.dashed}",
            "module": self.module,
            "entry_point": self.name,
            "service": f"gds-push-{self.dashed}",
            "title": self.title,
            "class_name": f"{self.title.replace(' ', '')}Driver",
            "plugin_api": PLUGIN_API_VERSION,
            "certlm_version": __version__,
        }


def _template_files(folder: Traversable, relative: Path = Path()) -> list[tuple[Path, Traversable]]:
    files = []
    for item in sorted(folder.iterdir(), key=lambda item: item.name):
        if item.is_dir():
            files += _template_files(item, relative / item.name)
        elif item.name.endswith(TEMPLATE_SUFFIX):
            files.append((relative / item.name.removesuffix(TEMPLATE_SUFFIX), item))
    return files


def write_plugin(name: str, parent: Path) -> Path:
    """Write the plugin ``name`` into a new directory ``parent/certlm-<name>``; that directory. Raises
    ``BadPluginName`` for a bad name or when the directory exists, before anything is written."""
    names = PluginNames.checked(name)
    substitutions = names.substitutions()
    if parent.exists() and not parent.is_dir():
        raise BadPluginName(f"{parent} is not a directory")
    target = parent / substitutions["distribution"]
    if target.exists():
        raise BadPluginName(f"{target} exists already: remove it, or choose another name or --dir")
    for relative, source in _template_files(resources.files(__package__) / "files"):
        parts = [names.module if part == PACKAGE_FOLDER else part for part in relative.parts]
        path = target.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(source.read_text(encoding="utf-8")).substitute(substitutions), encoding="utf-8")
    return target
