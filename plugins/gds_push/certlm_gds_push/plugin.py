"""The hooks that make the GDS push driver, certlm's OPC UA client certificate route and its table available."""

from __future__ import annotations

from quart import Blueprint

from certlm import hookimpl
from certlm.contracts.registry import DeviceDriverRegistry
from certlm_gds_push.driver import GdsPushDriver


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(GdsPushDriver)


@hookimpl
def certlm_provide_blueprints() -> list[Blueprint]:
    from certlm_gds_push.blueprint import blueprint

    return [blueprint]


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_gds_push.models"]
