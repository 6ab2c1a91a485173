"""Every example in README.md runs and answers what a reader would expect.

The commands are read from README.md's ``sh`` blocks, not copied here. The curl examples run, in README's order,
against a demo started as ``scripts/demo`` starts it (``RunningDemo``), after README's own ``KEY=...`` line, in
the directory that holds the demo's ``certlm-demo/``; the only rewriting is the demo's ports (5000 and
48410-48412 become the test's free ports). A ``.curlrc`` makes curl add the HTTP status to what it prints; the
commands themselves are unchanged. The ``certlm license`` commands run in a temporary directory, and the license
they issue is checked with the key pair they made.

Not run: ``scripts/demo`` (started the same way above, without its set-up step, which reinstalls ``.venv``),
``scripts/test`` (the test suite itself), synopses with ``[options]`` (``certlm serve``, ``certlm-simulate``: each
option they show is checked against the command's ``--help``), and the benchmarks (``bench/...``), which take
minutes and measure rather than check; "Operating certlm"'s installation commands (``sudo``, ``podman``,
``journalctl``: a plant's machine as root, with systemd or podman), of which every repository file they name must
exist (``tests/test_packaging.py`` checks those files), and its ``certlm backup``/``restore``/``config`` commands,
whose options are checked against ``--help`` (``tests/test_backup.py`` and ``tests/test_config_file.py`` run them).
A command of any other kind fails the test until it is covered.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
from collections.abc import Callable
from datetime import UTC, date, datetime, time
from itertools import takewhile
from pathlib import Path
from typing import Any

import pytest

from certlm.system.licensing import validate_license
from tests.support import REPO
from tests.test_demo import VENV_BIN, RunningDemo

README = REPO / "README.md"
README_PORT = 5000
README_DEVICE_PORTS = (48410, 48411, 48412)
KEY_LINE = "KEY=$(cat certlm-demo/secrets/certlm_api_key.txt)"
NOT_RUN = {
    "scripts/demo": "started the same way by RunningDemo, without the set-up step",
    "scripts/test": "the test suite itself",
}
# curl's status after the body: README's commands stay as they are.
CURLRC = 'silent\nshow-error\nmax-time = 120\nwrite-out = "\\n%{http_code}"\n'


def shell_commands(markdown: str) -> list[str]:
    """The commands of every ``sh`` block, each continued line joined to its command; blank lines dropped."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, re.M | re.S):
        commands += [command.strip() for command in block.replace("\\\n", " ").splitlines() if command.strip()]
    return commands


def words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def is_bench(command: str) -> bool:
    return any(word.startswith("bench/") for word in words(command))


# Installing certlm on a plant's machine: root, systemd, podman; not run here.
INSTALLATION = ("sudo", "podman", "journalctl")
# Administration commands whose options are checked against their --help; their own tests run them.
CHECKED_OPTIONS = (["certlm", "backup"], ["certlm", "restore"], ["certlm", "config"])


def is_installation(command: str) -> bool:
    first = words(command)
    return bool(first) and (first[0] in INSTALLATION or first[:2] == ["cd", "packaging"])


def is_checked_by_options(command: str) -> bool:
    return words(command)[:2] in CHECKED_OPTIONS


def is_synopsis(command: str) -> bool:
    return any(word.startswith("[") for word in words(command))


def with_ports(command: str, demo: RunningDemo) -> str:
    """README's command with the demo's ports in place of 5000 and 48410-48412."""
    ports = {README_PORT: demo.port} | {
        port: demo.device_port + offset for offset, port in enumerate(README_DEVICE_PORTS)
    }
    return re.sub(r"(?<![\d.])(\d{4,5})(?!\d)", lambda m: str(ports.get(int(m[1]), m[1])), command)


def run_shell(script: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("CERTLM_")}
    environment["PATH"] = f"{VENV_BIN}{os.pathsep}{environment.get('PATH', '')}"
    environment.update(env or {})
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=environment, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_every_readme_command_is_covered() -> None:
    """Each command is run by a test here, or is one of the kinds the module docstring names as not run."""
    uncovered = [
        command
        for command in shell_commands(README.read_text())
        if not (
            command == KEY_LINE
            or words(command)[0] == "curl"
            or words(command)[:2] == ["certlm", "license"]
            or command in NOT_RUN
            or is_bench(command)
            or is_synopsis(command)
            or is_installation(command)
            or is_checked_by_options(command)
        )
    ]
    assert uncovered == []


def test_readme_sets_key_before_the_curl_examples() -> None:
    commands = shell_commands(README.read_text())
    first_curl = next(i for i, command in enumerate(commands) if words(command)[0] == "curl")
    assert commands[first_curl - 1] == KEY_LINE


@pytest.mark.parametrize(
    "synopsis",
    [c for c in shell_commands(README.read_text()) if is_synopsis(c) and not is_bench(c)],
    ids=lambda command: words(command)[0],
)
def test_synopses_show_options_the_commands_have(synopsis: str) -> None:
    # The command and its subcommands: the words before the first option, placeholder (FILE) or [option].
    program = list(takewhile(lambda word: not word.startswith(("-", "[")) and not word.isupper(), words(synopsis)))
    result = run_shell(shlex.join([*program, "--help"]), REPO)
    assert result.returncode == 0, result.stderr
    shown = {re.sub(r"[\[\]]", "", word) for word in words(synopsis) if word.lstrip("[").startswith("--")}
    assert [option for option in sorted(shown) if option not in result.stdout] == []


def test_installation_commands_name_files_the_repository_has() -> None:
    commands = [command for command in shell_commands(README.read_text()) if is_installation(command)]
    assert commands, "README's installation steps are gone"
    named = {word for command in commands for word in words(command) if word.startswith(("packaging/", "./plugins/"))}
    assert {"packaging/certlm.service", "packaging/certlm.toml.example", "packaging/Containerfile"} <= named
    assert [path for path in sorted(named) if not (REPO / path).exists()] == []


@pytest.mark.parametrize(
    "command", [c for c in shell_commands(README.read_text()) if is_checked_by_options(c)], ids=lambda c: words(c)[1]
)
def test_administration_commands_use_options_the_commands_have(command: str) -> None:
    program = words(command)[:3] if words(command)[1] == "config" else words(command)[:2]
    result = run_shell(shlex.join([*program, "--help"]), REPO)
    assert result.returncode == 0, result.stderr
    used = {word.split("=")[0] for word in words(command) if word.startswith("--")}
    assert used and [option for option in sorted(used) if option not in result.stdout] == []


def test_license_examples_issue_a_license_their_key_pair_validates(tmp_path: Path) -> None:
    commands = [
        c for c in shell_commands(README.read_text()) if words(c)[:2] == ["certlm", "license"] and not is_synopsis(c)
    ]
    assert [words(c)[2] for c in commands] == ["keygen", "issue"]
    results = [run_shell(command, tmp_path) for command in commands]
    assert [result.returncode for result in results] == [0, 0], [result.stderr for result in results]

    keygen, issue = (words(command) for command in commands)
    key_dir = tmp_path / keygen[keygen.index("--out") + 1]
    assert stat.S_IMODE((key_dir / "license_private_key.pem").stat().st_mode) == 0o600
    arguments = dict(zip(issue[3::2], issue[4::2], strict=True))
    assert Path(arguments["--private-key"]).parent == Path(keygen[keygen.index("--out") + 1])
    valid_from = date.fromisoformat(arguments["--valid-from"])
    status = validate_license(
        results[1].stdout.strip(),
        key_dir / "license_public_key.pem",
        now=datetime.combine(valid_from, time(12), tzinfo=UTC),
    )
    assert status.validation_success is True, status.validation_message
    assert status.company == arguments["--company"]
    assert status.features == arguments["--features"].split(",")
    assert status.licensed_endpoints == int(arguments["--endpoints"])
    assert (status.validity_start, status.validity_end) == (arguments["--valid-from"], arguments["--valid-until"])
    assert status.license_type == arguments["--type"]


def lists_the_demo_devices(answer: Any, demo: RunningDemo) -> None:
    assert sorted(entry["url"] for entry in answer) == demo.device_urls
    assert all(entry["cert_base64"] and "CN=certlm Internal CA" in entry["cert_issuerdn"] for entry in answer), answer


def renewed_with_step_timings(answer: Any, demo: RunningDemo) -> None:
    assert answer["success"] is True, answer
    result = answer["result"]
    assert result["url"] == demo.device_urls[0]
    assert "CN=certlm Internal CA" in result["certificate"]["issuer_dn"]
    assert result["steps"] and all(step["ok"] for step in result["steps"]), result["steps"]
    assert all(isinstance(step["seconds"], float) and step["seconds"] >= 0 for step in result["steps"])


def answers_a_trust_list(answer: Any, demo: RunningDemo) -> None:
    assert answer["url"] == demo.device_urls[0]
    lists = ("trustlist_trusted_ca", "trustlist_trusted_crl", "trustlist_issuer_ca", "trustlist_issuer_crl")
    assert all(isinstance(answer[name], list) for name in lists), answer
    # The demo wrote its internal CA into the device's trust list.
    assert answer["trustlist_trusted_ca"] or answer["trustlist_issuer_ca"], answer


def makes_a_named_key(answer: Any, demo: RunningDemo) -> None:
    assert (answer["name"], answer["role"], answer["expires"]) == ("shift-lead", "operator", None), answer
    assert answer["key"].startswith("certlm_") and answer["created_by"] == "administrator", answer


# What a reader expects from each curl example, by the request path it ends with.
EXPECTED: dict[str, Callable[[Any, RunningDemo], None]] = {
    r"/gds/inventory": lists_the_demo_devices,
    r"/gds/push/change": renewed_with_step_timings,
    r"/gds/monitor/trustlist/[^/]+": answers_a_trust_list,
    r"/apikeys": makes_a_named_key,
}


async def test_curl_examples_answer_against_the_demo(tmp_path: Path) -> None:
    commands = shell_commands(README.read_text())
    examples = [command for command in commands if words(command)[0] == "curl"]
    assert examples
    curl_home = tmp_path / "curl"
    curl_home.mkdir()
    (curl_home / ".curlrc").write_text(CURLRC)
    demo = RunningDemo(tmp_path / "demo-home")
    demo.directory.mkdir()
    demo.start()
    try:
        summary = await demo.wait_for_summary()
        assert "  devices:  3 of 3 enrolled from PKI 'Demo internal CA'" in summary, demo.console()
        # The demo's next steps are README's examples, with its own ports and its key file's full path.
        steps = summary[summary.index("  next steps:") + 1 :]
        assert steps[0].strip() == KEY_LINE.replace("certlm-demo/", f"{demo.data_dir}/")
        shown = [words(step) for step in "\n".join(steps[1:]).replace("\\\n", " ").splitlines()]
        assert all(step in [words(with_ports(example, demo)) for example in examples] for step in shown), shown

        for example in examples:
            command = with_ports(example, demo)
            expectation = next(
                (check for path, check in EXPECTED.items() if re.search(rf"{path}$", words(command)[-1])), None
            )
            assert expectation is not None, f"no expectation for README example {example!r}"
            result = run_shell(f"{KEY_LINE}\n{command}", demo.directory, env={"CURL_HOME": str(curl_home)})
            assert result.returncode == 0, (command, result.stderr)
            body, _, status = result.stdout.rpartition("\n")
            assert 200 <= int(status) < 300, (command, status, body)
            expectation(json.loads(body), demo)
    finally:
        await demo.stop()
