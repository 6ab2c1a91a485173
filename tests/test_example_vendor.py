"""Vendor packages in an environment of their own, as a vendor has it: a new virtual environment holding certlm and
the distributions a plugin's tests need (the GDS push plugin the drivers build on, the internal CA, the OPC UA
simulator), installed from this checkout, everything else from the package index. In it, the example vendor package
(examples/acme_widget) passes its own tests, and so does a package ``certlm plugin new`` writes there.

Both run in one environment: the package ``certlm plugin new`` writes comes from the certlm installed there (its
template as installed package data, not this checkout), and a second environment would only double the time spent
installing."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

# Distributions from this checkout, each with the extras the tests need.
LOCAL = {
    ".": "[testing]",
    "plugins/gds_push": "",
    "plugins/pki_internal": "",
    "plugins/opcua_simulator": "",
    "examples/acme_widget": "[test]",
}
# Bounds for a hung index or test, far above what they take (installing about 30 s, each project's tests 10-15 s).
INSTALL_TIMEOUT_S = 600
TESTS_TIMEOUT_S = 300
BUILD_LEFTOVERS = shutil.ignore_patterns("__pycache__", "build", "*.egg-info", ".pytest_cache", ".ruff_cache")


@dataclass(frozen=True)
class VendorEnvironment:
    """A virtual environment and the copies of this checkout's distributions installed in it."""

    directory: Path
    sources: Path
    # The certlm distributions right after the environment was made, before any test installed into it (the
    # package ``certlm plugin new`` writes is installed there by its test, in whatever order the tests run).
    certlm_distributions: frozenset[str] = frozenset()

    def run(self, *command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """``command`` with the environment's ``bin`` first on PATH and nothing of this test run's environment that
        could reach into it (``PYTHONPATH``, ``CERTLM_*``)."""
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH" and not key.startswith("CERTLM_")}
        env["PATH"] = f"{self.directory / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.directory)
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    def python(self, *arguments: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        return self.run(str(self.directory / "bin" / "python"), *arguments, cwd=cwd, timeout=timeout)

    def pytest(self, project: Path) -> subprocess.CompletedProcess:
        """The project's own tests, with pytest's scratch space in the project (it runs inside this test's)."""
        return self.python(
            "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(project / ".pytest-tmp"),
            cwd=project, timeout=TESTS_TIMEOUT_S,
        )  # fmt: skip


def copy_distribution(relative: str, sources: Path) -> Path:
    """A copy of the checkout's distribution ``relative`` under ``sources``: pip builds in the source tree, which
    must not touch the checkout."""
    target = sources / (relative if relative != "." else "certlm")
    if relative == ".":
        target.mkdir(parents=True)
        shutil.copytree(REPO / "certlm", target / "certlm", ignore=BUILD_LEFTOVERS)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, target / name)
    else:
        shutil.copytree(REPO / relative, target, ignore=BUILD_LEFTOVERS)
    return target


def outcome(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-4000:]}"


def assert_all_passed(result: subprocess.CompletedProcess, project: Path) -> None:
    """Every test function of ``project`` ran and passed: none failed, none was skipped or left out."""
    assert result.returncode == 0, outcome(result)
    written = sum(len(re.findall(r"^async def test_|^def test_", path.read_text(), re.M))
                  for path in (project / "tests").glob("test_*.py"))  # fmt: skip
    assert re.search(rf"^{written} passed in ", result.stdout, re.M), outcome(result)


@pytest.fixture(scope="module")
def vendor_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VendorEnvironment]:
    root = tmp_path_factory.mktemp("vendor-environment")
    environment = VendorEnvironment(root / "venv", root / "sources")
    venv.create(environment.directory, with_pip=True)
    requirements = [f"{copy_distribution(path, environment.sources)}{extra}" for path, extra in LOCAL.items()]
    installed = environment.python(
        "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--root-user-action=ignore", *requirements,
        cwd=root, timeout=INSTALL_TIMEOUT_S,
    )  # fmt: skip
    assert installed.returncode == 0, outcome(installed)
    listed = environment.python("-m", "pip", "list", "--format=freeze", cwd=root, timeout=60)
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    yield dataclasses.replace(environment, certlm_distributions=frozenset(n for n in names if n.startswith("certlm")))
    shutil.rmtree(root, ignore_errors=True)


def test_the_environment_holds_only_what_the_example_needs(vendor_environment: VendorEnvironment) -> None:
    """What the example's tests run with: nothing of this checkout's environment, no other certlm plugin."""
    assert vendor_environment.certlm_distributions == {
        "certlm", "certlm-gds-push", "certlm-pki-internal", "certlm-opcua-simulator", "certlm-acme-widget",
    }  # fmt: skip
    where = vendor_environment.python("-c", "import certlm; print(certlm.__file__)", cwd=Path("/"), timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(vendor_environment.directory), where.stdout


def test_the_example_vendor_passes_its_tests_in_its_own_environment(vendor_environment: VendorEnvironment) -> None:
    example = vendor_environment.sources / "examples" / "acme_widget"
    assert_all_passed(vendor_environment.pytest(example), example)


def test_a_package_made_by_certlm_plugin_new_passes_its_tests(
    vendor_environment: VendorEnvironment, tmp_path: Path
) -> None:
    new = [str(vendor_environment.directory / "bin" / "certlm"), "plugin", "new", "acme_press", "--dir", str(tmp_path)]
    made = vendor_environment.run(*new, cwd=tmp_path, timeout=60)
    assert made.returncode == 0, outcome(made)
    project = tmp_path / "certlm-acme-press"
    assert str(project) in made.stdout
    # Lint-clean as written, by the rules its pyproject.toml sets (certlm's own).
    ruff = [sys.executable, "-m", "ruff", "check", "--no-cache", "."]
    linted = subprocess.run(ruff, cwd=project, capture_output=True, text=True, timeout=60)
    assert linted.returncode == 0, outcome(linted)
    # Its dependencies, test ones included, are all in the environment already: pip only checks them.
    installed = vendor_environment.python(
        "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--root-user-action=ignore",
        f"{project}[test]", cwd=tmp_path, timeout=INSTALL_TIMEOUT_S,
    )  # fmt: skip
    try:
        assert installed.returncode == 0, outcome(installed)
        assert_all_passed(vendor_environment.pytest(project), project)
    finally:
        # Gone again, so that the example's tests (in whatever order they run) load no plugin but their own.
        vendor_environment.python(
            "-m", "pip", "uninstall", "--yes", "--quiet", "certlm-acme-press", cwd=tmp_path, timeout=120
        )
