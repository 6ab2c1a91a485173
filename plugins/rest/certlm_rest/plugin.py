"""The hooks that make the REST drivers, their inventory routes and their table available."""

from __future__ import annotations

from quart import Blueprint

from certlm import hookimpl
from certlm.contracts.registry import DeviceDriverRegistry
from certlm_rest.contoso import ContosoGatewayDriver
from certlm_rest.driver import RestGenericDriver


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(RestGenericDriver)
    register.add(ContosoGatewayDriver)


@hookimpl
def certlm_provide_blueprints() -> list[Blueprint]:
    from certlm_rest.blueprint import blueprint

    return [blueprint]


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_rest.models"]
