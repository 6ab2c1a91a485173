"""``certlm plugin new NAME``: the package it writes, and the names and places it refuses. That the package passes its
own tests is tests/test_example_vendor.py's (it needs an environment of its own)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from certlm import PLUGIN_API_VERSION
from certlm.cli import main


def written_files(directory: Path) -> dict[str, str]:
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    return {str(path.relative_to(directory)): path.read_text() for path in files}


def test_writes_a_distribution_named_after_the_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugin", "new", "acme_press", "--dir", str(tmp_path)]) == 0
    project = tmp_path / "certlm-acme-press"
    assert str(project) in capsys.readouterr().out
    files = written_files(project)
    assert set(files) == {
        "README.md",
        "pyproject.toml",
        "certlm_acme_press/__init__.py",
        "certlm_acme_press/driver.py",
        "certlm_acme_press/plugin.py",
        "tests/conftest.py",
        "tests/test_driver.py",
    }
    assert not [name for name, text in files.items() if "${" in text], "every placeholder is filled in"
    for name, text in files.items():
        if name.endswith(".py"):
            ast.parse(text, name)
    pyproject = tomllib.loads(files["pyproject.toml"])
    assert pyproject["project"]["name"] == "certlm-acme-press"
    assert pyproject["project"]["entry-points"]["certlm"] == {"acme_press": "certlm_acme_press.plugin"}
    assert f'CERTLM_PLUGIN_API = "{PLUGIN_API_VERSION}"' in files["certlm_acme_press/plugin.py"]
    assert 'service = "gds-push-acme-press"' in files["certlm_acme_press/driver.py"]
    assert "class AcmePressDriver(GdsPushDriver):" in files["certlm_acme_press/driver.py"]
    # The plugin imports from certlm only what a plugin may: certlm, and certlm.testing in its tests.
    for name, text in files.items():
        if name.endswith(".py"):
            imported = {
                node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom) and node.module
            }
            assert {module for module in imported if module.startswith("certlm.")} <= {"certlm.testing"}, name


@pytest.mark.parametrize(
    "name",
    ["Acme", "acme-press", "acme press", "1acme", "_acme", "acme.press", "", "a" * 65, "import", "acmé"],
)
def test_a_name_that_is_no_lower_case_identifier_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["plugin", "new", name, "--dir", str(tmp_path)])
    assert str(refused.value).startswith(f"certlm: {name!r} is no plugin name: use a Python identifier")
    assert list(tmp_path.iterdir()) == [], "nothing is written"


def test_the_name_of_an_installed_module_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["plugin", "new", "gds_push", "--dir", str(tmp_path)])
    assert str(refused.value) == "certlm: a module certlm_gds_push is installed already: choose another name"
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_left_alone(tmp_path: Path) -> None:
    existing = tmp_path / "certlm-acme-press"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as refused:
        main(["plugin", "new", "acme_press", "--dir", str(tmp_path)])
    assert str(refused.value) == f"certlm: {existing} exists already: remove it, or choose another name or --dir"
    assert written_files(existing) == {"notes.txt": "mine"}


def test_a_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(SystemExit) as refused:
        main(["plugin", "new", "acme_press", "--dir", str(not_a_directory)])
    assert str(refused.value) == f"certlm: {not_a_directory} is not a directory"


def test_a_missing_dir_is_made(tmp_path: Path) -> None:
    assert main(["plugin", "new", "acme_press", "--dir", str(tmp_path / "new" / "place")]) == 0
    assert (tmp_path / "new" / "place" / "certlm-acme-press" / "pyproject.toml").is_file()


def test_the_command_exits_1_with_the_reason_on_stderr(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "certlm", "plugin", "new", "Acme", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith("certlm: 'Acme' is no plugin name")
    assert result.stdout == ""
