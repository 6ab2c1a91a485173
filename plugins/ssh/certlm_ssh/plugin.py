"""The hooks that make the SSH drivers, their routes and their table available."""

from __future__ import annotations

from quart import Blueprint

from certlm import hookimpl
from certlm.contracts.registry import DeviceDriverRegistry
from certlm_ssh.driver import DebianOpcUaServerDriver, SshStoreDriver


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(SshStoreDriver)
    register.add(DebianOpcUaServerDriver)


@hookimpl
def certlm_provide_blueprints() -> list[Blueprint]:
    from certlm_ssh.blueprint import blueprint

    return [blueprint]


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_ssh.models"]
