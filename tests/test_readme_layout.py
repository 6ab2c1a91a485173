"""The README's layout table matches the tree: every host module, plugin and benchmark folder is named there, and
everything it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_paths() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    return {path.rstrip("/") for path in re.findall(r"`((?:certlm|plugins|bench|tests)/[^`\s]*)`", table)}


def test_every_host_module_and_plugin_is_in_the_layout_table() -> None:
    named = layout_paths()
    modules = {f"certlm/{path.name}" for path in (ROOT / "certlm").glob("*.py")}
    packages = {f"certlm/{path.name}" for path in (ROOT / "certlm").iterdir() if (path / "__init__.py").exists()}
    plugins = {f"plugins/{path.name}" for path in (ROOT / "plugins").iterdir() if path.is_dir()}
    missing = sorted((modules | packages | plugins) - named)
    assert not missing, f"README's layout table does not name {missing}"


def test_everything_the_layout_table_names_exists() -> None:
    absent = sorted(path for path in layout_paths() if not (ROOT / path).exists())
    assert not absent, f"README's layout table names {absent}, which the tree does not have"
