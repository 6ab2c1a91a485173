"""docs/writing-a-plugin.md says what there is: every hook, every fixture of ``certlm.testing`` and every helper it
names exist, and every file of the repository it points to."""

from __future__ import annotations

import inspect
import re

from certlm import testing
from certlm.contracts import hookspecs
from certlm.testing import fixtures
from tests.support import REPO

GUIDE = (REPO / "docs" / "writing-a-plugin.md").read_text()


def table_names(heading: str) -> set[str]:
    """The names in the first column of the table under ``heading``."""
    section = GUIDE.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return {match for row in re.findall(r"^\| `([^`]+)`", section, re.M) for match in re.findall(r"^\w+", row)}


def test_the_hook_table_is_every_hook() -> None:
    hooks = {name for name, obj in vars(hookspecs).items() if inspect.isfunction(obj) and name.startswith("certlm_")}
    assert table_names("The hooks") == hooks


def test_the_fixture_table_is_every_fixture_of_the_kit() -> None:
    kit = {name for name in vars(fixtures) if name.startswith("certlm_")}
    assert table_names("Testing with `certlm.testing`") == kit


def test_every_helper_named_is_the_kits() -> None:
    helpers = GUIDE.split("The helpers take the API", 1)[1].split("```python", 1)[0]
    named = set(re.findall(r"`(\w+)\(", helpers))
    assert len(named) > 5, "the section names the helpers"
    assert sorted(name for name in named if name not in testing.__all__) == []


def test_every_file_it_points_to_exists() -> None:
    paths = set(re.findall(r"`((?:certlm|plugins|examples|tests|docs)/[\w./-]+)`", GUIDE))
    assert paths, "the guide points to files"
    assert sorted(path for path in paths if not (REPO / path).exists()) == []
