"""The hooks that make the REST drivers, their inventory routes and their table available."""

from __future__ import annotations

from quart import Blueprint

from certlm import DeviceDriverRegistry, HostServices, InventoryAccess, hookimpl
from certlm_rest.blueprint import make_blueprint
from certlm_rest.contoso import ContosoGatewayDriver
from certlm_rest.driver import RestGenericDriver

# The certlm plugin API these hooks are written for.
CERTLM_PLUGIN_API = "1.1"


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(RestGenericDriver)
    register.add(ContosoGatewayDriver)


@hookimpl
def certlm_provide_blueprints(services: HostServices, inventory: InventoryAccess) -> list[Blueprint]:
    return [make_blueprint(services, inventory)]


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_rest.models"]
